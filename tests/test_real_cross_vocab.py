"""SmolLM2-135M (another tokenizer) drafting for a packaged Qwen2.5-Coder target (on the backend `auto` picks): greedy
speculative decoding equals the target's own greedy decoding. Skipped locally when a package is missing; required
in CI."""

import os

import pytest

from speculant import generate, load_model
from speculant.bench.datasets import load_dataset
from speculant.drafters.spec import load_drafter
from speculant.errors import ModelNotAvailable

pytestmark = pytest.mark.real_model

NON_ASCII = ["Écris une phrase sur la mer et les étoiles.", "用中文解释什么是递归。", "Name three emoji 🐍🚀🎉 and say why."]


def loaded(name: str, target=None):
    try:
        return load_drafter(name, target) if target is not None else load_model(name)
    except ModelNotAvailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))


def test_smollm2_drafting_for_qwen_equals_autoregressive():
    target = loaded("qwen2.5-coder-0.5b")  # (the 1.5B reads the same vocabulary: one target suffices)
    drafter = loaded("smollm2-135m", target)
    prompts = [p.text for p in load_dataset("humaneval[:2]")]
    accepted = 0
    for prompt, chat in [(p, False) for p in prompts] + [(p, True) for p in NON_ASCII]:
        ar = generate(target, prompt, method="ar", max_new_tokens=20, chat=chat)
        sd = generate(target, prompt, drafter=drafter, k=4, max_new_tokens=20, chat=chat)
        assert sd.token_ids == ar.token_ids, prompt
        accepted += sum(sd.stats.accepted_lengths)
    assert accepted > 20  # the 135M's drafts are accepted, counted in target tokens
