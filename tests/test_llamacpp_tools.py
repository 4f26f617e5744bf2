"""llama.cpp built for this machine and its tools as bench peers: the AMX fix applied to the source, the
tools' output read back (text, prompt tokens, times), clear errors, and (where the tools are built) one bench
run in which `ar` and `llamacpp-cli-*` give the same text."""

import json
import os
import subprocess
import sys

import pytest

from speculant.bench.llamacpp_cli import CLI_PEERS, read_completion, read_speculative
from speculant.bench.methods import parse_method
from speculant.errors import ConfigError, ModelNotAvailable
from speculant.models.backends import llamacpp_build

# What the tools print (captured from llama.cpp 0.3.36's builds; log lines carry a timestamp prefix).
COMPLETION_OUT = b"Hello! How can I assist you today? [end of text]\n\n\n"
COMPLETION_LOG = """0.06.080.639 I common_perf_print:    sampling time =       4.47 ms
0.06.080.654 I common_perf_print:    samplers time =       0.90 ms /    19 tokens
0.06.080.668 I common_perf_print:        load time =    3968.91 ms
0.06.080.675 I common_perf_print: prompt eval time =     267.31 ms /    10 tokens (   29.70 ms per token,    33.67 tokens per second)
0.06.080.682 I common_perf_print:        eval time =    1316.85 ms /     9 runs   (  146.32 ms per token,     6.83 tokens per second)
0.06.080.688 I common_perf_print:       total time =    1609.82 ms /    18 tokens
"""
PROMPT = b"<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
SPECULATIVE_OUT = b"\n\n" + PROMPT + b"Hello! How can I assist you today?\n\n\n\n"
SPECULATIVE_LOG = """0.09.913.043 I encoded   10 tokens in    2.493 seconds, speed:    3.610 t/s
0.09.913.044 I decoded   10 tokens in    2.825 seconds, speed:    3.539 t/s
0.09.913.045 I n_predict = 10
0.09.913.045 I n_drafted = 4
0.09.913.045 I n_accept  = 2
"""


def test_completion_output_is_read_back():
    run = read_completion(COMPLETION_OUT, COMPLETION_LOG)
    assert run.text == "Hello! How can I assist you today?"
    assert (run.new_tokens, run.prompt_tokens) == (10, 10)  # 9 evaluated + the end token never evaluated
    assert run.wall_s == pytest.approx((267.31 + 1316.85 + 4.47) / 1000)
    assert run.ttft_s == pytest.approx((267.31 + 4.47 / 10) / 1000)


def test_a_completion_that_decoded_nothing_counts_one_token():
    """One token asked for (or an end token first): llama.cpp prints '0.00 ms / 1 runs' for no forward at all."""
    log = COMPLETION_LOG.replace("1316.85 ms /     9 runs", "   0.00 ms /     1 runs")
    assert read_completion(b" \n\n", log).new_tokens == 1
    assert read_completion(b"  #\n\n", COMPLETION_LOG.replace("/     9 runs", "/     1 runs")).new_tokens == 2


def test_a_tool_that_fails_or_hangs_is_one_line_naming_why(monkeypatch):
    from types import SimpleNamespace

    from speculant.bench import llamacpp_cli
    from speculant.config import SamplingConfig
    from speculant.errors import SpeculantError
    from speculant.models.backends import llamacpp

    monkeypatch.setattr(llamacpp_cli, "tool", lambda name: name)
    monkeypatch.setattr(llamacpp, "LlamaCppCausalLM", SimpleNamespace)
    tokenizer = SimpleNamespace(decode=lambda ids, **kwargs: "def f():")
    target = SimpleNamespace(weights=SimpleNamespace(path="m.gguf"), threads=2, max_positions=4096, tokenizer=tokenizer)
    options = parse_method("llamacpp-cli-ar").options

    def generate():
        return llamacpp_cli.cli_generate("llamacpp-cli-ar", target, [1, 2], 4, options, SamplingConfig(), 0)

    failed = subprocess.CompletedProcess([], 1, b"", b"0.00.1 I loading\n0.02.183.367 E failed to initialize\n")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(SpeculantError, match="^llama-completion exited with 1: failed to initialize$"):
        generate()
    read = subprocess.CompletedProcess([], 0, b"x", COMPLETION_LOG.encode())  # a prompt of 10 tokens, not 2
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: read)
    with pytest.raises(SpeculantError, match="into 10 tokens, speculant into 2"):
        generate()

    def hangs(args, **kwargs):
        raise subprocess.TimeoutExpired(args, kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", hangs)
    with pytest.raises(SpeculantError, match="llama-completion did not finish in 1800 s"):
        generate()


def test_a_tool_whose_logger_cut_its_output_short_runs_again(monkeypatch):
    """llama.cpp's logger prints a tool's text and times from a thread and drops what it has not printed when the tool
    exits (rc 0, no text, a few lines of log): the run is made again, up to TRIES times, then refused in one line."""
    from types import SimpleNamespace

    from speculant.bench import llamacpp_cli
    from speculant.config import SamplingConfig
    from speculant.models.backends import llamacpp

    monkeypatch.setattr(llamacpp_cli, "tool", lambda name: name)
    monkeypatch.setattr(llamacpp, "LlamaCppCausalLM", SimpleNamespace)
    tokenizer = SimpleNamespace(decode=lambda ids, **kwargs: PROMPT.decode(), encode=lambda text, **kwargs: [7])
    target = SimpleNamespace(weights=SimpleNamespace(path="m.gguf"), threads=2, max_positions=4096, tokenizer=tokenizer)
    cut = subprocess.CompletedProcess([], 0, b"", "0.00.001.529 I llama_completion: llama backend init\n".encode())
    whole = {"llamacpp-cli-ar": subprocess.CompletedProcess([], 0, COMPLETION_OUT, COMPLETION_LOG.encode()),
             "llamacpp-cli-ngram": subprocess.CompletedProcess([], 0, SPECULATIVE_OUT, (
                 SPECULATIVE_LOG + COMPLETION_LOG).encode())}
    for method, done in whole.items():
        # (llama-speculative-simple writes its text's second end after its times: the log whole, the text cut)
        ended = [] if method == "llamacpp-cli-ar" else [[done.__class__([], 0, done.stdout[:-2], done.stderr)] * 2]
        for runs in ([cut, cut, done], *[[*early, done] for early in ended]):
            calls = iter(runs)
            monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: next(calls))
            result = llamacpp_cli.cli_generate(method, target, [1] * 10, 10, parse_method(method).options,
                                               SamplingConfig(), 0)
            assert result.text == "Hello! How can I assist you today?" and next(calls, None) is None
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: cut)
    with pytest.raises(ConfigError, match=f"^llama-completion exited 0 with its output cut short {llamacpp_cli.TRIES} "
                                          "times: llama.cpp's logger drops"):
        llamacpp_cli.cli_generate("llamacpp-cli-ar", target, [1] * 10, 10, parse_method("llamacpp-cli-ar").options,
                                  SamplingConfig(), 0)


def test_speculative_output_is_read_back_and_its_prompt_checked():
    run = read_speculative(SPECULATIVE_OUT, SPECULATIVE_LOG, PROMPT)
    assert run.text == "Hello! How can I assist you today?"
    assert (run.new_tokens, run.prompt_tokens) == (10, 10)
    # the first step (of 10 tokens - 2 accepted drafts = 8) is timed with decoding: TTFT takes one step's mean
    assert run.wall_s == pytest.approx(2.493 + 2.825) and run.ttft_s == pytest.approx(2.493 + 2.825 / 8)
    with pytest.raises(ConfigError, match="another prompt"):
        read_speculative(SPECULATIVE_OUT, SPECULATIVE_LOG, PROMPT.replace(b"hi", b"ho"))
    with pytest.raises(ConfigError, match="decoded"):
        read_speculative(SPECULATIVE_OUT, "encoded 3 tokens in 1.0 seconds", PROMPT)
    # the newlines a text ends with are its own: only the tool's two ends go
    assert read_speculative(b"\n\n" + PROMPT + b"  x\n" + b"\n\n\n\n", SPECULATIVE_LOG, PROMPT).text == "  x\n"


def test_each_tool_is_asked_for_the_tokens_the_run_asks(monkeypatch):
    """llama-completion stops at -n tokens, llama-speculative-simple one token past it."""
    from types import SimpleNamespace

    from speculant.bench import llamacpp_cli
    from speculant.config import SamplingConfig

    monkeypatch.setattr(llamacpp_cli, "tool", lambda name: name)
    target = SimpleNamespace(weights=SimpleNamespace(path="m.gguf"), threads=2, max_positions=4096)
    for method, n in (("llamacpp-cli-ar", "96"), ("llamacpp-cli-ngram", "95")):
        args = llamacpp_cli.tool_args(method, target, "p.txt", 96, parse_method(method).options, SamplingConfig(), 0)
        assert args[args.index("-n") + 1] == n


def test_the_amx_tile_configuration_fix_applies_to_the_line_gcc_12_miscompiles(tmp_path):
    source = tmp_path / "llama.cpp"
    path = source / llamacpp_build.AMX_FILE
    path.parent.mkdir(parents=True)
    path.write_text("    alignas(64) tile_config_t tc = {};\n    _tile_loadconfig(&tc);\n    done = true;\n")
    assert llamacpp_build.patch_amx(source)
    text = path.read_text()
    assert "_tile_loadconfig(&tc)" not in text and '"m"(tc)' in text and "done = true;" in text
    assert not llamacpp_build.patch_amx(source)  # already fixed (or a llama.cpp that no longer has the line)
    assert not llamacpp_build.patch_amx(tmp_path / "elsewhere")


def test_a_build_is_per_version_and_cpu_and_missing_tools_say_how_to_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    root = llamacpp_build.build_root("9.9.9")
    assert root.parent == tmp_path / "llamacpp" and root.name == f"9.9.9-{llamacpp_build.cpu_key()}"
    pytest.importorskip("llama_cpp")
    with pytest.raises(ModelNotAvailable, match="speculant peers build-llamacpp"):
        llamacpp_build.tool("llama-completion")
    from speculant import cli

    assert cli.main(["bench", "--methods", "ar", "llamacpp-cli-ar", "--target", "no-such-model"]) == 2
    assert "build-llamacpp" in capsys.readouterr().err  # said before the (unknown) model is looked up
    bin_dir = llamacpp_build.build_root() / "build" / "bin"  # a build from before llama-server was among the tools
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-completion").write_text("")
    (llamacpp_build.build_root() / "manifest.json").write_text(json.dumps({"bin": str(bin_dir), "lib": str(bin_dir)}))
    assert llamacpp_build.tool("llama-completion") == bin_dir / "llama-completion"
    with pytest.raises(ModelNotAvailable, match="llama-server is not built.*build-llamacpp"):
        llamacpp_build.tool("llama-server")
    for damaged in ([], {"bin": 3}, {"key": "k"}):  # a manifest of another shape names no build (they were tracebacks)
        (llamacpp_build.build_root() / "manifest.json").write_text(json.dumps(damaged))
        with pytest.raises(ModelNotAvailable, match="llama-completion is not built.*build-llamacpp"):
            llamacpp_build.tool("llama-completion")


def test_cli_peer_specs_parse_and_refuse_bad_options():
    for name in CLI_PEERS:
        spec = parse_method(name)
        assert spec.peer and spec.backend == "llamacpp" and spec.options.kv == "bf16"
    assert parse_method("llamacpp-cli-ar:kv=f16").options.kv == "f16"
    assert parse_method("llamacpp-cli-ngram:k=16").options.k == 16
    with pytest.raises(ConfigError, match="kv must be one of"):
        parse_method("llamacpp-cli-ar:kv=q4_0")
    with pytest.raises(ConfigError):
        parse_method("llamacpp-cli-ar:k=4")  # plain decoding drafts nothing


@pytest.mark.real_model
def test_llamacpp_tools_give_ar_s_text_in_one_bench_run(tmp_path):
    """In a fresh process (so speculant loads the same native build as the tools): ar and llama.cpp's plain
    decoding agree on every prompt; its two drafting tools start alike but may drift, as their multi-token
    verification runs other ggml kernels than one token does (on Zen4 one of these prompts diverges)."""
    pytest.importorskip("llama_cpp")
    from speculant.models.catalog import CATALOG

    try:
        CATALOG["qwen2.5-coder-0.5b"].part_paths()
        llamacpp_build.tool("llama-completion")
    except ModelNotAvailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"id": "a", "category": "qa", "turns": ["What does a hash map do? Answer in one sentence."]},
        {"id": "b", "category": "code", "prompt": "def fib(n):\n    \"\"\"Return the n-th Fibonacci number ('\\\\n' stays).\"\"\"\n"}]))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "speculant.cli", "bench", "--target", "qwen2.5-coder-0.5b",
                           "--backend", "llamacpp",  # (the 0.5B runs on lean by default)
                           "--prompts", str(prompts), "--max-new-tokens", "24", "--out", str(out), "--methods", "ar",
                           "llamacpp-cli-ar", "llamacpp-cli-ngram", "llamacpp-cli-spec:drafter=qwen2.5-coder-0.5b,k=4"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    summary = {s["method"]: s for s in results["summary"]}
    assert summary["llamacpp-cli-ar"]["identical_to_ar"] == 1.0
    first = {(row["prompt_id"], row["method"]): row["token_ids"][:4] for row in results["rows"]}
    for name in ("llamacpp-cli-ar", "llamacpp-cli-ngram", "llamacpp-cli-spec:drafter=qwen2.5-coder-0.5b,k=4"):
        assert all(first[prompt, name] == first[prompt, "ar"] for prompt in ("a", "b")), name
        assert summary[name]["tokens_per_s"] > 0 and summary[name]["ttft_s"] > 0


@pytest.mark.real_model
def test_llama_cpp_python_s_own_library_runs_with_or_without_its_amx_path(tmp_path):
    """llama-cpp-python's library as pip built it, in a fresh process and cache: where ggml has an AMX matmul it
    is tried in a child first; if it faulted (GCC 12 builds on AMX CPUs), the weights load without extra buffers,
    else with them; either way generating works instead of crashing. (CI installs the bindings without a library:
    test_llamacpp.py's test of a faulting AMX matmul, its child faked, covers the choice there.)"""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        pytest.skip("llama-cpp-python is not installed")
    lib = Path(spec.submodule_search_locations[0]) / "lib"
    if not any(lib.glob("libllama*")):  # `speculant peers build-llamacpp` installs the bindings without a library
        pytest.skip("llama-cpp-python has no library of its own here")
    code = ("import json; from speculant import generate; from speculant.models import load_model; "
            "from speculant.models.backends import llamacpp; m = load_model('qwen2.5-coder-0.5b@gguf'); "
            "r = generate(m, 'def f():', method='ar', max_new_tokens=8); "
            "print(json.dumps([m.weights.buffers, llamacpp.system_info()['features'].split(), len(r.token_ids)]))")
    from speculant.cache import cache_root

    if (cache_root() / "models").is_dir():  # the fresh cache shares the packaged models, made once
        (tmp_path / "models").symlink_to(cache_root() / "models")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LLAMA_CPP_LIB_PATH": str(lib), "SPECULANT_CACHE": str(tmp_path)})
    if "cannot" in done.stderr and done.returncode == 2:
        pytest.skip(done.stderr.strip()[-200:])
    assert done.returncode == 0, done.stderr[-2000:]
    buffers, features, n = json.loads(done.stdout.strip().splitlines()[-1])
    assert n == 8
    verdicts = tmp_path / "llamacpp-faults.json"
    if "AMX_INT8" in features:
        (faulted,) = json.loads(verdicts.read_text()).values()
        assert ("AMX" in buffers) != faulted
    else:
        assert not verdicts.exists() and "AMX" not in buffers
