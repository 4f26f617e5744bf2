"""The llama.cpp backend: tiny GGUF files (llama and qwen2, q8_0 and f32 weights) written in the test agree
with transformers on the same weights, tree attention through sequence ids is right, and every method's
greedy output equals the backend's own `ar` token for token."""

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

from helpers import BYTE_VOCAB, DRAFTS_ACCEPTED, byte_tokenizer, costs, every_method, invent, run_job  # noqa: E402
from tiny_gguf import GGUF_ARCHS, write_tiny_gguf  # noqa: E402

from speculant import generate  # noqa: E402
from speculant.errors import ConfigError  # noqa: E402
from speculant.models.base import Interrupted  # noqa: E402
from speculant.models import HFCausalLM, load_model  # noqa: E402
from speculant.models.loading import resolve_backend  # noqa: E402
from speculant.trees.tree import TokenTree  # noqa: E402

TREE = TokenTree((7, 11, 12, 13, 21, 22, 31), (-1, 0, 0, 0, 1, 1, 4))  # root; 3 children; 2 grandchildren; 1 more
QUANTS = ("q8_0", "f32")  # q8_0: several tokens per llama_decode; f32: one (ggml's f32 matmul is batch-dependent)


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory):
    """Machine profiles and measured widths of throwaway files go to a throwaway cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULANT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, private_cache):
    """{(arch, quant, seed): (path, the transformers model written)}."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in GGUF_ARCHS:
        for quant in QUANTS:
            for seed in (0, 1, 7):
                path = root / f"{arch}-{quant}-{seed}.gguf"
                files[arch, quant, seed] = (path, write_tiny_gguf(path, arch, seed, quant))
    return files


def gguf_model(gguf_files, arch, quant="q8_0", seed=0):
    return load_model(str(gguf_files[arch, quant, seed][0]), backend="llamacpp", tokenizer=byte_tokenizer())


def prompt_ids(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BYTE_VOCAB - 1) for _ in range(n)]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_logits_agree_with_transformers_on_the_same_weights(gguf_files, arch, quant):
    model = gguf_model(gguf_files, arch, quant)
    reference = HFCausalLM(gguf_files[arch, quant, 0][1])
    prompt = prompt_ids(1, 30)
    tolerance = 0.02 if quant == "f32" else 0.2  # bf16 KV cache; q8_0 weights against their f32 originals
    torch.testing.assert_close(model.prefill(prompt), reference.prefill(prompt), atol=tolerance, rtol=0)
    torch.testing.assert_close(model.forward([5, 6, 7]), reference.forward([5, 6, 7]), atol=tolerance, rtol=0)
    assert model.vocab_size == BYTE_VOCAB and model.eos_token_ids == {256} and model.cache_len == 33
    model.rollback(31)
    reference.rollback(31)
    torch.testing.assert_close(model.forward([6]), reference.forward([6]), atol=tolerance, rtol=0)


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_tree_attention_through_sequence_ids_agrees_with_transformers(gguf_files, arch):
    """One pass over a tree, and the same tree grown node by node, score every node on its own path."""
    model = gguf_model(gguf_files, arch, "f32")
    reference = HFCausalLM(gguf_files[arch, "f32", 0][1])
    prefix = prompt_ids(2, 9)
    for m in (model, reference):
        m.prefill(prefix)
    expected = reference.forward(list(TREE.tokens), tree=TREE)
    whole = model.forward(list(TREE.tokens), tree=TREE)
    torch.testing.assert_close(whole, expected, atol=0.02, rtol=0)
    model.rollback(len(prefix) + 1)  # the root stays, as a drafter's resync leaves it
    grown = [model.forward(list(TREE.tokens[1:4]), tree=TokenTree(TREE.tokens[:4], TREE.parents[:4])),
             model.forward(list(TREE.tokens[4:6]), tree=TokenTree(TREE.tokens[:6], TREE.parents[:6])),
             model.forward(list(TREE.tokens[6:]), tree=TREE)]
    torch.testing.assert_close(torch.cat(grown), expected[1:], atol=0.02, rtol=0)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_keep_leaves_the_cache_as_plain_decoding_would_bit_for_bit(gguf_files, arch, quant):
    """Accepting a path off the tree's first chain: the next logits equal plain decoding's exactly."""
    prefix = prompt_ids(3, 9)
    for node in (6, 5, 2, 3, 0):
        model = gguf_model(gguf_files, arch, quant)
        model.prefill(prefix)
        model.forward(list(TREE.tokens), tree=TREE)
        path = TREE.path_to(node)
        model.keep(len(prefix), [len(prefix) + i for i in path])
        assert model.cache_len == len(prefix) + len(path)
        caught = model.catch_up([33, 34])  # the path's kept cells pending, as a forward finds them
        model.rollback(len(prefix) + len(path))
        after = model.forward([33, 34])
        assert torch.equal(caught, after[-1:])
        plain = gguf_model(gguf_files, arch, quant)
        plain.prefill(prefix)
        rows = [plain.forward([token]) for token in [TREE.tokens[i] for i in path] + [33, 34]]
        assert torch.equal(after, torch.cat(rows[-2:])), node


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_every_method_equals_ar_on_the_llamacpp_backend(gguf_files, arch, quant, monkeypatch):
    for seed in (0, 1):
        target = gguf_model(gguf_files, arch, quant, seed)
        other = gguf_model(gguf_files, arch, "f32" if quant == "q8_0" else "q8_0", seed)  # (the same weights)
        prompt = prompt_ids(seed + 10)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
        invent(monkeypatch, costs(target))  # (auto speculates)
        # (dsi's target forwards padded to 10 ms: its drafter, as costly as the target, keeps ahead of the servers, so
        # drafts are accepted whatever the threads' timing)
        runs = {**every_method(other), "dsi": dict(method="dsi", drafter=other, servers=2, lookahead=3,
                                                   twin_latency="10,0")}
        for label, options in runs.items():
            result = generate(target, prompt_ids=prompt, max_new_tokens=30, **options)
            assert result.token_ids == expected, label
            assert label not in (*DRAFTS_ACCEPTED, "dsi") or sum(result.stats.accepted_lengths) > 0, label


def test_trees_wider_than_a_verification_takes_are_cut_to_its_tree_nodes(gguf_files):
    """A tree forward gives each leaf a sequence id of its own, N_SEQ - 1 of them: trees of 2 x 64 drafted nodes are
    cut to that many (one level of 63), and the output is ar's."""
    target = gguf_model(gguf_files, "qwen2")
    prompt = prompt_ids(12)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids
    result = generate(target, prompt_ids=prompt, method="tree", drafter="self", depth=2, width=64, verify_width=127,
                      max_new_tokens=12)
    assert result.token_ids == expected and max(result.stats.tree_widths) == target.capabilities.tree_nodes


def test_a_server_on_llamacpp_answers_concurrent_requests_as_it_would_alone(gguf_files):
    """Rows of a llama.cpp target run one after another on contexts of their own: outputs as alone."""
    from concurrent.futures import ThreadPoolExecutor

    from speculant.methods import get_method
    from speculant.serve.engine import Engine

    target = gguf_model(gguf_files, "llama", "q8_0", 0)
    other = gguf_model(gguf_files, "llama", "q8_0", 7)
    engine = Engine(target, "auto", get_method("auto").make_options({"drafters": (other, "maxgram")}))
    prompts = [prompt_ids(seed) for seed in range(5)]
    solo = [run_job(engine, p).text for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(lambda p: run_job(engine, p).text, prompts)) == solo
    assert solo[0] == generate(target, prompt_ids=prompts[0], method="ar", max_new_tokens=24).text
    engine.close()


def test_dsi_process_servers_load_the_gguf_by_path(gguf_files):
    target = gguf_model(gguf_files, "qwen2", "q8_0", 1)
    prompt = prompt_ids(20)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
    result = generate(target, prompt_ids=prompt, method="dsi", drafter="maxgram", servers=2, lookahead=2,
                      executor="process", max_new_tokens=24)
    assert result.token_ids == expected


def test_dsi_servers_kept_across_prompts_prefill_each_prompt_whole(gguf_files):
    """A bench keeps its DSI servers between prompts: a new prompt is prefilled whole, as `ar` does, never
    built on the previous prompt's cache (llama.cpp's prefill and forward differ in numerics), so the
    server's rows equal plain decoding's logits bit for bit."""
    from speculant.config import SamplingConfig
    from speculant.decoding.dsi.jobs import Job, TargetServer

    target = gguf_model(gguf_files, "qwen2", "q8_0", 7)
    server = TargetServer(0, target.share(), SamplingConfig())
    shared = prompt_ids(30, 40)
    for request in range(3):
        prompt = shared + prompt_ids(31 + request, 6)
        answer = server.run(Job(request, request, 0, tuple(prompt), len(prompt)))
        assert answer.forwarded == len(prompt), f"prompt {request}"  # the whole prompt, not its new part
        assert answer.tokens == [int(target.prefill(prompt).argmax())]


def test_llamacpp_peers_decode_as_the_backend_does(gguf_files):
    from speculant.bench.peers import PEERS, peer_generate
    from speculant.config import SamplingConfig

    target = gguf_model(gguf_files, "llama", "q8_0", 0)
    prompt = prompt_ids(30)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
    for peer in ("llamacpp-ar", "llamacpp-pld"):
        result = peer_generate(peer, target, prompt, 20, PEERS[peer](), SamplingConfig(), 0)
        assert len(result.token_ids) == 20 and result.stats.wall_s > 0
        if peer == "llamacpp-ar":
            assert result.token_ids == expected


def test_bad_tree_calls_and_rollbacks_are_refused(gguf_files):
    model = gguf_model(gguf_files, "llama")
    model.prefill(prompt_ids(4))
    with pytest.raises(ValueError, match="last nodes"):
        model.forward([11, 12], tree=TREE)
    plain = gguf_model(gguf_files, "llama")
    plain.prefill(prompt_ids(4))
    expected = plain.forward([5])
    plain.rollback(12)
    # refused calls leave the cache as it was: a tree at the wrong positions (with the root cached, or waiting to
    # run after a keep) and a chain past the context
    with pytest.raises(ValueError, match="root's position plus their depth"):
        model.forward(list(TREE.tokens[1:]), positions=[0] * (len(TREE) - 1), tree=TREE)
    with pytest.raises(ValueError, match="exceed the llama.cpp context"):
        model.forward([5] * model.max_positions)
    assert model.cache_len == 12 and torch.equal(model.forward([5]), expected)
    model.rollback(12)
    with pytest.raises(ValueError, match="next positions"):
        model.forward([5], positions=[40])
    model.forward(list(TREE.tokens), tree=TREE)
    with pytest.raises(ValueError, match="draft tree"):
        model.forward([5])
    with pytest.raises(ValueError, match="root-to-node path"):
        model.keep(12, [12, 16])  # node 4 hangs below node 1, not the root
    wide = TokenTree((1, *range(2, 70)), (-1, *[0] * 68))
    model.rollback(model.cache_len)  # (keeping every position, a tree's too, changes nothing)
    model.rollback(12)
    with pytest.raises(ValueError, match="at most 63 leaves"):
        model.forward(list(wide.tokens), tree=wide)


@pytest.mark.parametrize("root_cached", [False, True])
def test_a_failed_or_interrupted_tree_forward_leaves_the_cache_as_it_was(gguf_files, root_cached):
    """Whether the tree is new (its root cached as text or not) or grows by a level, a forward cut short (DSI's
    preemption) or refused inside (too many leaves) drops what it cached: the same calls then give what an
    untouched model gives."""
    def fresh():
        model = gguf_model(gguf_files, "llama")
        model.prefill(prompt_ids(4))
        if root_cached:
            model.forward([TREE.tokens[0]])
        return model

    head, rest = list(TREE.tokens[root_cached:4]), list(TREE.tokens[4:])
    first, grown = TokenTree(TREE.tokens[:4], TREE.parents[:4]), TREE
    untouched = fresh()
    expected_first, expected_grown = untouched.forward(head, tree=first), untouched.forward(rest, tree=grown)
    model = fresh()
    cached = model.cache_len
    model.interrupt = lambda: True
    with pytest.raises(Interrupted):
        model.forward(head, tree=first)
    model.interrupt = None
    wide = TokenTree((TREE.tokens[0], *range(2, 70)), (-1, *[0] * 68))
    with pytest.raises(ValueError, match="at most 63 leaves"):
        model.forward(list(wide.tokens[1:]) if root_cached else list(wide.tokens), tree=wide)
    assert model.cache_len == cached
    assert torch.equal(model.forward(head, tree=first), expected_first)
    model.interrupt = lambda: True
    with pytest.raises(Interrupted):
        model.forward(rest, tree=grown)
    model.interrupt = None
    assert model.cache_len == 12 + len(first)
    assert torch.equal(model.forward(rest, tree=grown), expected_grown)


def test_a_prompt_part_after_a_kept_branch_follows_it(gguf_files):
    """`keep` of a path whose nodes left their plain positions leaves them waiting to be written; a prompt's next
    part (`continue_prefill`) runs after them, not over them."""
    model, plain = gguf_model(gguf_files, "llama"), gguf_model(gguf_files, "llama")
    model.prefill(prompt_ids(4))
    model.forward(list(TREE.tokens), tree=TREE)
    model.keep(12, [12, 14])  # the root and its second child, which sat in the third cell
    plain.prefill(prompt_ids(4) + [TREE.tokens[0], TREE.tokens[2]])
    assert model.cache_len == plain.cache_len == 14
    assert torch.allclose(model.continue_prefill([5, 6]), plain.continue_prefill([5, 6]), atol=1e-4)
    assert model.cache_len == 16


def test_threads_loading_one_gguf_at_once_share_one_load(tmp_path, private_cache):
    """Loads take a lock (`llamacpp._loading`): llama.cpp's log callback fills one list with the buffer types of the
    load it hears, and a file loaded by two threads at once was loaded twice."""
    import threading

    from speculant.models.backends.llamacpp import shared_weights

    path = tmp_path / "once.gguf"  # (a file no other test loaded: none of its weights alive to be shared already)
    write_tiny_gguf(path, GGUF_ARCHS[0], 11, "q8_0")
    start, loaded = threading.Barrier(4), []

    def load() -> None:
        start.wait()
        loaded.append(shared_weights(path))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(loaded) == 4 and all(weights is loaded[0] for weights in loaded) and loaded[0].buffers


def test_backend_choice_and_clear_errors_before_loading(tmp_path, monkeypatch):
    from speculant.models import loading

    for simd, backend in ((True, "lean"), (False, "llamacpp")):  # where the kernels have a SIMD path, or none
        monkeypatch.setattr(loading, "_simd_kernels", lambda simd=simd: simd)
        assert resolve_backend("auto", "qwen2.5-coder-1.5b", None, "cpu") == backend
        assert resolve_backend("auto", "qwen2.5-coder-0.5b", None, "cpu") == backend  # Q5_0: q5_b, Q8_0: q8_b
        assert resolve_backend(None, "qwen2.5-coder-0.5b", "lean", None) == "lean"  # as a drafter
    assert resolve_backend("auto", "qwen2.5-coder-1.5b", "int8", "cpu") == "hf"
    assert resolve_backend("auto", "qwen2.5-coder-1.5b", None, "cpu", "bf16") == "hf"
    assert resolve_backend("auto", "org/model", None, "cpu") == "hf"
    assert resolve_backend(None, "qwen2.5-coder-1.5b", "gguf", None) == "llamacpp"
    assert resolve_backend("hf", "qwen2.5-coder-1.5b", None, "cpu") == "hf"
    for args, message in [(("llamacpp", "org/model", None, "cpu"), "runs GGUF weights"),
                          (("llamacpp", "qwen2.5-coder-1.5b", "int4", "cpu"), "runs the GGUF as it is"),
                          (("hf", "qwen2.5-coder-1.5b", "gguf", "cpu"), "@gguf runs on the llama.cpp backend"),
                          (("llamacpp", "qwen2.5-coder-0.5b", "lean", "cpu"), "@lean runs on the lean backend"),
                          (("tpu", "qwen2.5-coder-1.5b", None, "cpu"), "unknown backend")]:
        with pytest.raises(ConfigError, match=message):
            resolve_backend(*args)
    with pytest.raises(ConfigError, match="no dtype"):
        load_model("qwen2.5-coder-1.5b@gguf", dtype="bf16")
    with pytest.raises(Exception, match="no GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    import gguf  # a block count of 0, which llama.cpp asserts against (ending the process): refused before it loads

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_block_count", lambda writer, n, o=gguf.GGUFWriter.add_block_count: o(
            writer, 0))
        write_tiny_gguf(tmp_path / "blocks0.gguf", "llama", 0)
    with pytest.raises(ConfigError, match="blocks0.gguf: its llama.block_count is 0: a model has at least one block"):
        load_model(str(tmp_path / "blocks0.gguf"), backend="llamacpp")


@pytest.mark.real_model
def test_speculant_s_amx_kernel_leaves_ggml_s_tiles_as_it_found_them(gguf_files):
    """ggml's AMX matmul configures a thread's tiles once and keeps them; speculant's AMX kernel runs on the
    same OpenMP threads. Interleaved in one process (a child: a thread left without its tiles faults), each
    gives what it gives alone."""
    import subprocess
    import sys
    from pathlib import Path

    from speculant.models.numerics import native

    if not native.KERNELS["amx"].available(torch.bfloat16):
        pytest.skip("no AMX on this CPU")
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers import byte_tokenizer
from speculant.models import load_model
from speculant.models.numerics import native
model = load_model({str(gguf_files["llama", "q8_0", 0][0])!r}, backend="llamacpp", tokenizer=byte_tokenizer())
if "AMX" not in model.weights.buffers:
    print("no AMX buffer"); sys.exit(0)
amx, x, w = native.KERNELS["amx"], torch.randn(5, 64).bfloat16(), torch.randn(48, 64).bfloat16()
ggml_first = model.prefill(list(range(1, 13)))
ours_first = amx.linear(x, amx.pack(w), 48)
ggml_again = model.prefill(list(range(1, 13)))
assert torch.equal(ggml_first, ggml_again) and torch.equal(ours_first, amx.linear(x, amx.pack(w), 48))
print("interleaved")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1500:]}"
    assert done.stdout.strip().splitlines()[-1] in ("interleaved", "no AMX buffer")


@pytest.mark.parametrize("killed", [True, False])
def test_a_library_whose_amx_matmul_faults_loads_weights_without_extra_buffers(gguf_files, killed, tmp_path,
                                                                               monkeypatch, caplog):
    """A library with ggml's AMX matmul that is not speculant's fixed build (llama-cpp-python's own, which CI never
    installs) has its forwards tried once in a child per library, CPU and file: killed by a signal, the weights load
    without extra buffer types and a warning says why; else with them. (The child is faked: no CPU here faults.)"""
    import subprocess

    from speculant.models.backends import llamacpp, llamacpp_build

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    info = llamacpp.system_info()
    monkeypatch.setattr(llamacpp, "system_info", lambda: {**info, "features": info["features"] + " AMX_INT8"})
    monkeypatch.setattr(llamacpp_build, "manifest", lambda: None)  # not speculant's own build
    children = []

    def child(command, **kwargs):
        children.append(kwargs["env"]["LLAMA_CPP_LIB_PATH"])
        return subprocess.CompletedProcess(command, -11 if killed else 0)
    monkeypatch.setattr(llamacpp.subprocess, "run", child)
    lib, extra = llamacpp._import(), []
    load = lib.llama_model_load_from_file
    monkeypatch.setattr(lib, "llama_model_load_from_file", lambda path, params: extra.append(params.use_extra_bufts)
                        or load(path, params))
    for _ in range(2):
        llamacpp.GGUFWeights(gguf_files["llama", "q8_0", 0][0])
    assert children == [str(llamacpp.library_path().parent)]  # tried once, on the library in use
    assert extra == [not killed] * 2
    assert ("runs without AMX and repacked weights" in caplog.text) == killed


def test_a_windowed_llama_gguf_is_sent_to_the_lean_backend_which_applies_its_window(tmp_path, private_cache,
                                                                                     monkeypatch):
    """llama.cpp ignores a llama GGUF's sliding window (its logits are those of the same weights without one), so
    the backend refuses such a file in one line, naming the lean backend, which applies it (test_lean.py)."""
    from tiny_gguf import dequantized_transformer

    from speculant.models.backends import llamacpp

    path = tmp_path / "window.gguf"
    plain = dequantized_transformer(path, write_tiny_gguf(path, "llama", 0, "k", hidden=256, window=6), "llama")
    with pytest.raises(ConfigError, match="sliding window of 6 .* --backend lean"):
        load_model(str(path), backend="llamacpp", tokenizer=byte_tokenizer())
    monkeypatch.setattr(llamacpp, "UNWINDOWED", frozenset())  # what it would compute: the window ignored
    ids = prompt_ids(1, 20)
    model = load_model(str(path), backend="llamacpp", tokenizer=byte_tokenizer())
    rows = torch.cat([model.prefill(ids[:5])[None], model.forward(ids[5:])])[:, :BYTE_VOCAB]
    with torch.no_grad():
        unwindowed = plain(torch.tensor([ids])).logits[0, 4:]
    assert (rows - unwindowed).norm() / unwindowed.norm() < 0.05  # if this fails, llama.cpp now applies it
    assert load_model(str(path), backend="lean", tokenizer=byte_tokenizer()).prefill([1, 2, 3]).shape[-1] >= BYTE_VOCAB


@pytest.mark.parametrize("length", [5, 20])  # within the window of 8, and past it
def test_greedy_decoding_of_a_windowed_gemma_is_transformers_own(tmp_path, private_cache, length):
    """A Gemma 3 GGUF (five windowed layers and a global one; F32): llama.cpp applies its window, and greedy `ar`,
    `sd`, `tree` and `cascade` on it emit the tokens of transformers' greedy decoding of the same model, recomputed
    in full at every step, for generations that cross the window."""
    from helpers import greedy
    from test_lean import WINDOWED_METHODS
    from tiny_gguf import dequantized_transformer

    path = tmp_path / "gemma3.gguf"
    reference = dequantized_transformer(path, write_tiny_gguf(path, "gemma3", 0, "F32", hidden=256, layers=6),
                                        "gemma3")
    prompt = prompt_ids(30 + length, length)
    expected = greedy(reference, prompt)
    model = load_model(str(path), backend="llamacpp", tokenizer=byte_tokenizer())
    for label, options in WINDOWED_METHODS.items():
        assert generate(model, prompt_ids=prompt, max_new_tokens=16, **options).token_ids == expected, label


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """`llamacpp_build.build` in a throwaway cache with its tools faked: an sdist of one file, and a cmake whose
    build makes the tools' files (slowly, so that builds started together overlap). Yields the cmake calls."""
    import io
    import subprocess
    import tarfile
    import time
    from types import SimpleNamespace

    from speculant.models.backends import llamacpp_build

    calls = []

    def fetch_sdist(version, into, run):
        archive = into / f"llama_cpp_python-{version}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            member = tarfile.TarInfo(f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/CMakeLists.txt")
            tar.addfile(member, io.BytesIO())
        return archive

    def popen(command, stdout=None, stderr=None, env=None, start_new_session=False):  # (done at once)
        calls.append(command)
        if "--build" in command:
            time.sleep(0.5)
            bin_dir = Path(command[command.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True)
            for name in llamacpp_build.TOOLS:
                (bin_dir / name).write_text("")
        return SimpleNamespace(pid=0, wait=lambda: 0)

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp_build, "installed_version", lambda: "9.9.9")
    monkeypatch.setattr(llamacpp_build, "fetch_sdist", fetch_sdist)
    monkeypatch.setattr(llamacpp_build, "subprocess", SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda name: f"/usr/bin/{name}")
    yield calls


def test_builds_started_together_make_one_build_on_the_cores_the_process_may_use(fake_build, monkeypatch):
    """`peers build-llamacpp` run twice at once: one builds, the other waits and finds its build (never both
    building into one directory, nor one deleting the other's); `-j` counts the cores of this process's affinity."""
    from concurrent.futures import ThreadPoolExecutor

    from speculant.models.backends import llamacpp_build

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: llamacpp_build.build(say=lambda line: None), range(2)))
    builds = [call for call in fake_build if "--build" in call]
    assert len(builds) == 1 and builds[0][builds[0].index("-j") + 1] == "3"
    assert built[0] == built[1] and not llamacpp_build.missing(built[0])


def test_a_build_is_made_again_when_its_cmake_flags_or_amx_fix_change(fake_build, monkeypatch):
    from speculant.models.backends import llamacpp_build

    def builds():
        bin_dir = llamacpp_build.build(jobs=1, say=lambda line: None)
        assert llamacpp_build.manifest()["bin"] == str(bin_dir) and not llamacpp_build.missing(bin_dir)
        return sum("--build" in call for call in fake_build)

    assert builds() == 1 and builds() == 1
    first = Path(llamacpp_build.manifest()["bin"]).parent
    monkeypatch.setattr(llamacpp_build, "CMAKE_FLAGS", (*llamacpp_build.CMAKE_FLAGS, "-DGGML_AVX512=OFF"))
    assert builds() == 2 and "-DGGML_AVX512=OFF" in fake_build[-2] and not first.exists()  # (the one it replaced)
    monkeypatch.setattr(llamacpp_build, "AMX_FIXED", llamacpp_build.AMX_FIXED + " ")
    assert builds() == 3 and builds() == 3


def test_an_sdist_extracts_where_python_has_no_tar_filters_but_never_outside_its_tree(tmp_path, monkeypatch):
    """Python 3.11.0-3.11.3 take no `filter` (a TypeError): the tree is extracted without one, and a member whose path
    leaves the tree, or that is no plain file or folder, is refused."""
    import io
    import tarfile

    from speculant.models.backends import llamacpp_build

    def extractall(self, path=".", members=None, *, numeric_owner=False, real=tarfile.TarFile.extractall):
        return real(self, path, members, numeric_owner=numeric_owner, filter="fully_trusted")

    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.setattr(tarfile.TarFile, "extractall", extractall)
    tree = "llama_cpp_python-9.9.9/vendor/llama.cpp/"
    for name, extra in (("good", None), ("escaping", tarfile.TarInfo(tree + "../../../../evil")),
                        ("linked", tarfile.TarInfo(tree + "link"))):
        archive = tmp_path / name / "llama_cpp_python-9.9.9.tar.gz"
        archive.parent.mkdir()
        with tarfile.open(archive, "w:gz") as tar:
            tar.addfile(tarfile.TarInfo(tree + "CMakeLists.txt"), io.BytesIO())
            if extra is not None:
                extra.type, extra.linkname = (tarfile.SYMTYPE, "/etc") if name == "linked" else (tarfile.REGTYPE, "")
                tar.addfile(extra, io.BytesIO())
        if extra is None:
            assert (llamacpp_build.extract_source(archive, archive.parent / "x") / "CMakeLists.txt").is_file()
        else:
            with pytest.raises(ConfigError, match="no file or folder inside its tree"):
                llamacpp_build.extract_source(archive, archive.parent / "x")
            assert not (archive.parent / "evil").exists() and not (archive.parent / "x").exists()
