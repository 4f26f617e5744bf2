"""Smoke tests on a packaged real model. Skipped locally when the package is missing; required in CI."""

import os
import subprocess
import sys

import pytest
from helpers import costs, invent

from speculant import generate, load_model
from speculant.errors import ModelNotAvailable

MODEL = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def model():
    try:
        return load_model(MODEL, dtype="fp32")
    except ModelNotAvailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))


def test_self_drafting_accepts_every_draft_and_matches_autoregressive(model):
    prompt = "def fibonacci(n):"
    ar = generate(model, prompt, method="ar", max_new_tokens=12)
    sd = generate(model, prompt, drafter=model, k=4, max_new_tokens=12)
    assert sd.token_ids == ar.token_ids and len(ar.token_ids) == 12
    assert sd.stats.acceptance_rate == 1.0
    assert sd.stats.target_forwards < ar.stats.target_forwards
    assert "fibonacci" in ar.text or "return" in ar.text or "if" in ar.text


def test_cli_generate_runs():
    """`speculant generate` on a GGUF, which needs only a tokenizer from transformers: its models, seconds of imports
    in every process (each CLI call, server and DSI worker), stay unimported (Python's -X importtime lists every
    module a process imports)."""
    pytest.importorskip("llama_cpp")
    gguf = f"{MODEL}@gguf"  # (llama.cpp loads it in a second; the module's fp32 model takes ten)
    command = [sys.executable, "-X", "importtime", "-m", "speculant.cli", "generate", "def add(a, b):", "--target",
               gguf, "--drafter", gguf, "--max-new-tokens", "8", "--k", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "8 tokens in" in done.stderr and "acceptance 100%" in done.stderr
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "speculant.models.backends.llamacpp" in imported
    assert not imported & {"transformers.modeling_utils", "speculant.models.backends.hf"}


def test_catalog_gguf_loads_in_seconds_and_auto_is_exact(monkeypatch):
    """The catalog's GGUF on llama.cpp: loaded in seconds, and auto's and sd's drafts accepted with output ar's (auto
    decides on invented costs: on the machine's measured ones it may decode 24 tokens plainly)."""
    import time

    pytest.importorskip("llama_cpp")
    start = time.perf_counter()
    try:
        target = load_model(f"{MODEL}@gguf")
    except ModelNotAvailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
    assert time.perf_counter() - start < 60 and target.backend == "llamacpp"
    prompt = "Repeat exactly: alpha beta gamma delta alpha beta gamma delta"
    expected = generate(target, prompt, method="ar", max_new_tokens=24, chat=True)
    invent(monkeypatch, costs(target))
    for method in ("auto", "sd"):
        options = {"drafter": "maxgram"} if method == "sd" else {}
        result = generate(target, prompt, method=method, max_new_tokens=24, chat=True, **options)
        assert result.token_ids == expected.token_ids and sum(result.stats.accepted_lengths) > 0, method


def test_the_catalog_drafter_reads_with_its_target_s_tokenizer(model):
    """The catalog's Qwen2.5-Coder models ship the same tokenizer files: a drafter among them takes the target's
    tokenizer (no second parse); SmolLM2's are other files."""
    from speculant.models.loading import drafter_tokenizer

    assert drafter_tokenizer(model, "qwen2.5-coder-0.5b@lean") is model.tokenizer
    try:
        assert drafter_tokenizer(model, "smollm2-135m") is None
    except ModelNotAvailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
