"""The lean model on speculant's kernels: tiny GGUF files with Q4_K_M's mix of Q4_K and Q6_K (qwen2, llama,
and llama with a sliding window) agree with transformers on the same de-quantized weights; a W-token forward
equals W one-token forwards bit for bit; every method's greedy output and log-probabilities equal the lean model's
own `ar`'s."""

import random

import gguf
import numpy as np
import pytest
import torch
from helpers import (BYTE_VOCAB, DRAFTS_ACCEPTED, assert_trees_fit_the_last_positions, byte_tokenizer, costs,
                     every_method, greedy, invent)
from tiny_gguf import dequantized_transformer, write_tiny_gguf

from speculant import generate, kernels
from speculant.errors import ConfigError
from speculant.models import load_model
from speculant.models.backends.lean import LeanCausalLM
from speculant.models.gguf_header import GGUFFile, same_as_gguf_reader
from speculant.trees.tree import TokenTree

VARIANTS = {"qwen2": ("qwen2", None), "llama": ("llama", None), "llama-window": ("llama", 6)}
TREE = TokenTree((7, 11, 12, 13, 21, 22, 31), (-1, 0, 0, 0, 1, 1, 4))


@pytest.fixture(scope="module")
def lean_files(tmp_path_factory):
    """{(variant, seed): (path, the transformers model written)}, and (variant, "q8_0"): seed 0's weights in Q8_0 (a
    drafter that agrees with seed 0's often); repacked weights go to a throwaway cache."""
    root = tmp_path_factory.mktemp("lean")
    files = {}
    for variant, (arch, window) in VARIANTS.items():
        for seed in (0, 7):
            path = root / f"{variant}-{seed}.gguf"
            files[variant, seed] = (path, write_tiny_gguf(path, arch, seed, "k", hidden=256, window=window))
        path = root / f"{variant}-q8_0.gguf"
        files[variant, "q8_0"] = (path, write_tiny_gguf(path, arch, 0, "q8_0", hidden=256, window=window))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULANT_CACHE", str(root / "cache"))
        yield files


def lean(lean_files, variant, seed: int | str = 0) -> LeanCausalLM:
    return load_model(str(lean_files[variant, seed][0]), backend="lean", tokenizer=byte_tokenizer())


def prompt_ids(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BYTE_VOCAB - 1) for _ in range(n)]


@pytest.mark.parametrize("variant", ["qwen2", "llama"])
def test_logits_agree_with_transformers_on_the_same_weights(lean_files, variant):
    path, model = lean_files[variant, 0]
    reference = dequantized_transformer(path, model, VARIANTS[variant][0])
    ids = prompt_ids(1, 20)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, 4:]
    model = lean(lean_files, variant)
    rows = torch.cat([model.prefill(ids[:5])[None], model.forward(ids[5:])])[:, :BYTE_VOCAB]
    error = (rows - expected).norm() / expected.norm()
    assert error < 0.05, error  # int8 activations; a wrong rotary layout or mask gives ~1


def test_keys_beyond_the_sliding_window_do_not_reach_the_last_token(lean_files):
    """Two layers with a window of 6 see 11 positions back: the first tokens cannot matter, bit for bit."""
    ids = prompt_ids(2, 16)
    changed = [(ids[0] + 1) % (BYTE_VOCAB - 1)] + ids[1:]
    windowed, plain = lean(lean_files, "llama-window"), lean(lean_files, "llama")
    assert torch.equal(windowed.prefill(ids), windowed.prefill(changed))
    assert not torch.equal(plain.prefill(ids), plain.prefill(changed))


@pytest.mark.parametrize("isa", kernels.paths(emulated=True))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_w_token_forward_equals_w_one_token_forwards_bit_for_bit(lean_files, variant, isa, monkeypatch):
    monkeypatch.setattr(kernels, "best", lambda: isa)
    ids = prompt_ids(3, 14)
    model = lean(lean_files, variant)
    model.prefill(ids[:4])
    block = model.forward(ids[4:])
    model.rollback(4)
    rows = torch.cat([model.forward([token]) for token in ids[4:]])
    assert torch.equal(block, rows)
    model.rollback(4)  # a catch-up runs the same rows and skips the head for all but its last
    assert torch.equal(model.catch_up(ids[4:-1], 2), block[-3:-1]) and torch.equal(model.forward(ids[-1:]), block[-1:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_keep_compacts_the_cache_in_place_as_plain_decoding_would(lean_files, variant):
    prefix = prompt_ids(4, 9)
    for node in (6, 5, 2, 0):
        model = lean(lean_files, variant)
        storage = model._keys.data_ptr(), model._values.data_ptr()
        model.prefill(prefix)
        model.forward(list(TREE.tokens), tree=TREE)
        path = TREE.path_to(node)
        model.keep(len(prefix), [len(prefix) + i for i in path])
        assert (model._keys.data_ptr(), model._values.data_ptr()) == storage  # no copy of the cache
        after = model.forward([33, 34])
        plain = lean(lean_files, variant)
        plain.prefill(prefix)
        rows = [plain.forward([token]) for token in [TREE.tokens[i] for i in path] + [33, 34]]
        assert torch.equal(after, torch.cat(rows[-2:])), node


def test_keep_refuses_positions_that_do_not_ascend_within_the_cache(lean_files):
    """`keep(kept, path)` copies only the path's positions that move (those in place lead) and checks all of them."""
    model = lean(lean_files, "qwen2")
    model.prefill(prompt_ids(4, 9))
    for kept, path in ((1, [2, 1]), (0, [1, 0]), (2, [9]), (0, [-1, 3]), (2, [1]), (2, [3, 3]), (10, []), (-1, [3])):
        with pytest.raises(ValueError, match="they must ascend within the 9 cached"):
            model.keep(kept, path)
    assert model.cache_len == 9
    keys = model._keys[:, :, :9].clone()
    model.keep(2, [4, 6])
    assert model.cache_len == 4 and torch.equal(model._keys[:, :, :4], keys[:, :, [0, 1, 4, 6]])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_method_equals_ar_on_the_lean_model(lean_files, variant, monkeypatch):
    for seed in (0, 1):
        target, other = lean(lean_files, variant), lean(lean_files, variant, "q8_0")  # (other: drafts accepted)
        prompt = prompt_ids(seed + 10)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24, logprobs=2)
        invent(monkeypatch, costs(target))  # (auto speculates)
        for label, options in every_method(other).items():
            result = generate(target, prompt_ids=prompt, max_new_tokens=24, logprobs=2, **options)
            assert result.token_ids == expected.token_ids, label
            assert result.logprobs == expected.logprobs, label  # row-invariant: the same values, bit for bit
            assert label not in DRAFTS_ACCEPTED or sum(result.stats.accepted_lengths) > 0, label


def test_trees_near_the_end_of_the_cache_fit_the_slots_left(lean_files, monkeypatch):
    assert_trees_fit_the_last_positions(lean(lean_files, "qwen2"), BYTE_VOCAB, monkeypatch)


def test_the_repack_is_cached(lean_files, monkeypatch):
    path = lean_files["qwen2", 0][0]
    first = lean(lean_files, "qwen2")
    cached = list((path.parent / "cache" / "lean").glob("qwen2-0-*/*.npy"))
    assert len(cached) == 1 + 2 * 7  # the output head and 7 matrices per layer
    from speculant.kernels import formats
    from speculant.models.backends.lean import LeanWeights

    def no_repack(*args):
        raise AssertionError("repacked again")

    monkeypatch.setattr(formats, "pack", no_repack)
    again = LeanWeights(path)  # as a second process would load it
    assert torch.equal(again.output.data, first.weights.output.data)
    from speculant.models.backends import lean as lean_module

    monkeypatch.setattr(lean_module.inspect, "getsource", lambda function: "def _repack(): ...  # edited")
    with pytest.raises(AssertionError, match="repacked again"):
        LeanWeights(path)  # another cache writer: files of its own, not those of the last one


def test_a_drafter_on_the_kernels_keeps_frequent_tokens_and_drafts_exactly(lean_files, tmp_path, monkeypatch):
    """`name@lean`: a GGUF of a type other than Q4_K and Q6_K (Q8_0; hidden 64, so inputs padded to 128; Q5_K), which
    a target runs as it is, is quantized again as a drafter, and its head keeps FR-Spec's most frequent tokens; a lean
    target drafted for by it emits what it emits alone."""
    from speculant.models.backends import lean as lean_module

    monkeypatch.setattr(lean_module, "DRAFT_HEAD", 64)
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, "qwen2", 3, "q8_0")
    assert load_model(str(path), backend="lean", tokenizer=byte_tokenizer()).weights.layers[0].q.kind == "q8_b"
    drafter = load_model(f"{path}@lean", tokenizer=byte_tokenizer())
    assert drafter.weights.layers[0].q.kind == "q4_k" and drafter.weights.output.kind == "q6_k"
    five = tmp_path / "q5k.gguf"
    write_tiny_gguf(five, "qwen2", 3, "Q5_K", hidden=256)
    assert load_model(str(five), backend="lean", tokenizer=byte_tokenizer()).weights.layers[0].q.kind == "q5_k"
    assert load_model(f"{five}@lean", tokenizer=byte_tokenizer()).weights.layers[0].q.kind == "q4_k"
    head = drafter.weights.head.tolist()
    assert len(head) == 64 and 256 in head  # <eos> kept whatever its count
    assert {ord(" "), ord("e"), ord("t")} <= set(head)  # the corpus's commonest bytes
    logits = drafter.prefill(prompt_ids(3))
    outside = torch.ones(BYTE_VOCAB, dtype=torch.bool)
    outside[head] = False
    assert torch.isinf(logits[outside]).all() and torch.isfinite(logits[~outside]).all()
    # the target is the same weights whole: the drafts are accepted wherever the target's token is in the head
    target = load_model(str(path), backend="lean", tokenizer=byte_tokenizer())
    invent(monkeypatch, costs(target))  # (auto speculates)
    for seed in (0, 1):
        prompt = prompt_ids(seed + 20)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
        for options in (dict(method="sd", drafter=drafter, k=4), dict(method="auto", drafters=[drafter, "maxgram"])):
            result = generate(target, prompt_ids=prompt, max_new_tokens=24, **options)
            assert result.token_ids == expected, options
            assert sum(result.stats.accepted_lengths) > 0, options


@pytest.mark.parametrize("variant", ["qwen2", "llama-window"])
def test_every_kernel_path_runs_the_lean_layers_to_the_same_bits(lean_files, variant, monkeypatch):
    """The C layer (kernels/layer.h) is compiled into every ISA's library: each gives the scalar path's bits."""
    outputs = {}
    for isa in kernels.paths(emulated=True):
        monkeypatch.setattr(kernels, "best", lambda isa=isa: isa)
        model = lean(lean_files, variant)
        model.prefill(prompt_ids(5, 10))
        outputs[isa] = model.forward(prompt_ids(6, 5))
    assert "scalar" in outputs and all(torch.equal(outputs["scalar"], out) for out in outputs.values()), list(outputs)


def test_a_tree_deeper_than_the_window_sees_each_node_s_window_of_positions(lean_files):
    """A window of 6 and a branch 8 deep: a node's window counts positions (its depth), not cache slots (where its
    side branch's nodes sit before it), so each node's logits are, bit for bit, its path's run as a chain."""
    tree = TokenTree((7, 40, 41, 42, 43, 44, 45, 46, 47, 48), (-1, 0, 0, 2, 3, 4, 5, 6, 7, 8))
    model, prompt = lean(lean_files, "llama-window"), prompt_ids(60, 9)
    model.prefill(prompt)
    rows = model.forward(list(tree.tokens), tree=tree)
    for node in range(len(tree)):
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        model.prefill(prompt)
        assert torch.equal(model.forward([tree.tokens[i] for i in reversed(path)])[-1], rows[node]), node


@pytest.mark.parametrize("variant", ["qwen2", "llama-window"])
def test_rows_of_several_sequences_in_one_forward_equal_their_own_forwards(lean_files, variant):
    """`lean.forward_rows`: prefills (short, and past the window), chains, a catch-up and a tree of different
    sequences in one forward; each gets bit for bit the logits and cache length of its own calls."""
    from speculant.models.base import Call
    from speculant.models.backends.lean import forward_rows

    base = lean(lean_files, variant)
    batched, alone = [base.share() for _ in range(3)], [base.share() for _ in range(3)]
    prompts = [prompt_ids(30, 5), prompt_ids(31, 11), prompt_ids(32, 2)]
    rounds = [[Call(p, prefill=True) for p in prompts],
              [Call([1, 2, 3]), Call([4]), Call(TREE.tokens, tree=TREE)],
              [Call([5, 6]), Call(prompts[1], prefill=True), Call([11])],
              [Call(prompt_ids(33, 9), rows=2), Call([12, 13, 14, 15]), Call([16])],  # a catch-up's last 2 rows
              [Call([17, 18, 19], prefill=True, continues=True), Call([20]), Call([21, 22], prefill=True, continues=True)]]
    for calls in rounds:
        got = forward_rows(list(zip(batched, calls)))
        for row, call, logits in zip(alone, calls, got):
            assert torch.equal(call.run(row), logits)
        assert [r.cache_len for r in batched] == [r.cache_len for r in alone]


def test_served_lean_requests_batch_and_equal_their_solo_runs(lean_files, monkeypatch):
    """A server on the lean backend runs concurrent requests' calls as one forward per model; each greedy
    output equals the request alone and the model's `ar`, for sd and auto."""
    from helpers import assert_served_rows_batch_and_equal_solo
    from speculant.models.backends import lean as lean_module

    target, drafter = lean(lean_files, "qwen2"), lean(lean_files, "qwen2", seed=7)
    prompts = [prompt_ids(40 + i, 4 + 3 * i) for i in range(5)]
    assert_served_rows_batch_and_equal_solo(lean_module, target, drafter, prompts, monkeypatch)


@pytest.mark.parametrize("variant", ["qwen2", "llama", "llama-window"])
def test_a_long_prompt_prefills_in_parts_that_compute_the_whole_prompt(lean_files, variant, monkeypatch):
    """Each part attends to the parts before it (within the window, where the model has one, so that a prompt
    past it runs in parts too and stalls no other request): the logits and the cache are the unsplit prefill's up
    to rounding, and a part's call gives what the prefill's own loop gives."""
    from speculant.models import base
    from speculant.models.backends import lean as lean_module

    model, ids = lean(lean_files, variant), prompt_ids(50, 13)
    whole = model.prefill(ids)
    keys = model._keys[:, :, :13].clone()
    monkeypatch.setattr(base, "PREFILL_PART", 5)  # the parts prefill runs
    monkeypatch.setattr(lean_module, "SERVED_PART", 5)  # and those a server runs
    assert model.prefill_parts(ids) == [ids[:5], ids[5:10], ids[10:]]
    parts = []  # what prefill ran, part by part (whether their bits equal the whole's depends on the CPU's kernels)
    continue_prefill = type(model).continue_prefill
    monkeypatch.setattr(type(model), "continue_prefill", lambda self, part: parts.append(list(part)) or
                        continue_prefill(self, part))
    parted = model.prefill(ids)
    assert parts == [ids[:5], ids[5:10], ids[10:]]
    monkeypatch.undo()
    assert model.cache_len == 13
    assert (parted - whole).abs().max() < 1e-3 * whole.abs().max()
    assert (model._keys[:, :, :13] - keys).abs().max() < 1e-3 * keys.abs().max()
    monkeypatch.setattr(base, "PREFILL_PART", 5)
    model.prefill(ids[:5])
    model.continue_prefill(ids[5:10])
    assert torch.equal(model.continue_prefill(ids[10:]), parted)
    fresh = model.share()
    fresh.prefill(ids)
    assert torch.equal(model.forward([3, 4]), fresh.forward([3, 4]))


def test_a_served_long_prompt_prefills_in_parts_while_others_decode(lean_files, monkeypatch):
    """A server runs a long prompt's parts in separate forwards, the running request's decode rows beside
    them, and every output equals its solo run."""
    from speculant.config import SamplingConfig
    from speculant.methods import get_method
    from speculant.models.backends import lean as lean_module
    from speculant.serve.engine import Engine, ServeJob

    monkeypatch.setattr(lean_module, "SERVED_PART", 4)
    batches = []  # per forward: (prefill, continues) of each call
    forward_rows = lean_module.forward_rows
    monkeypatch.setattr(lean_module, "forward_rows", lambda rows: batches.append(
        [(call.prefill, call.continues) for _, call in rows]) or forward_rows(rows))
    target = lean(lean_files, "qwen2")
    short, long = prompt_ids(60, 3), prompt_ids(61, 17)
    expected = [generate(target, prompt_ids=p, method="ar", max_new_tokens=12).text for p in (short, long)]
    engine = Engine(target, "ar", get_method("ar").make_options({}), 8, 16)
    done = {}
    jobs = {name: ServeJob(ids, 12, SamplingConfig()) for name, ids in (("short", short), ("long", long))}
    engine.batcher.run(lambda: [engine.submit(job, lambda piece, logprobs: None,  # (admitted together)
                                              lambda outcome, name=name: done.setdefault(name, outcome))
                                for name, job in jobs.items()])
    engine.close()
    assert [done["short"].text, done["long"].text] == expected
    parts = [b for b in batches if (True, True) in b]
    assert len(parts) == 4  # 17 tokens in parts of 4: four after the first
    assert any((False, False) in b for b in parts)  # the short request decoded beside them


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_handle_skipping_layers_computes_the_model_without_them(lean_files, tmp_path, arch):
    """`skipping`: the prefill (torch) and the forward (the C layers) of a 4-layer model without layers 1 and 2
    agree with transformers' model of layers 0 and 3 on the same weights, its cache holding only theirs."""
    path = tmp_path / f"{arch}.gguf"
    reference = dequantized_transformer(path, write_tiny_gguf(path, arch, 4, "k", layers=4, hidden=256), arch)
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[0], reference.model.layers[3]])
    ids = prompt_ids(8, 20)
    with torch.no_grad():
        expected = reference(torch.tensor([ids]), use_cache=False).logits[0, 4:]
    target = load_model(str(path), backend="lean", tokenizer=byte_tokenizer())
    skipping = target.skipping([1, 2])
    assert skipping.layers == (0, 3) and skipping._keys.shape[0] == 2 and skipping.share().layers == (0, 3)
    rows = torch.cat([skipping.prefill(ids[:5])[None], skipping.forward(ids[5:])])[:, :BYTE_VOCAB]
    error = (rows - expected).norm() / expected.norm()
    assert error < 0.05, error
    full = torch.cat([target.prefill(ids[:5])[None], target.forward(ids[5:])])[:, :BYTE_VOCAB]
    assert (full - expected).norm() / expected.norm() > 0.2  # the layers left out matter
    from speculant.models.base import Call
    from speculant.models.backends.lean import forward_rows

    # a server batches handles by weights_key: a skipping handle's rows never join the full model's
    assert skipping.weights_key == skipping.share().weights_key != target.weights_key == target.share().weights_key
    with pytest.raises(ValueError, match="layers"):
        forward_rows([(target.share(), Call(ids, prefill=True)), (skipping.share(), Call(ids, prefill=True))])


def test_the_model_drafts_for_itself_with_calibrated_layers_left_out(lean_files, tmp_path, monkeypatch):
    """`self@skip` (Draft & Verify; SWIFT): the calibration leaves out middle layers only and is remembered;
    sd and auto drafting with it emit what `ar` emits."""
    from speculant.models.backends import layer_skip

    path = tmp_path / "six.gguf"
    write_tiny_gguf(path, "qwen2", 6, "k", layers=6, hidden=256)
    target = load_model(str(path), backend="lean", tokenizer=byte_tokenizer())
    skipped = layer_skip.skipped_layers(target)
    assert skipped and set(skipped) <= {1, 2, 3, 4}, skipped
    monkeypatch.setattr(layer_skip, "_calibrate", lambda *args: pytest.fail("calibrated again"))
    assert layer_skip.skipped_layers(target.share()) == skipped
    invent(monkeypatch, costs(target))  # (auto speculates)
    for seed in (0, 1):
        prompt = prompt_ids(seed + 50)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
        for options in (dict(method="sd", drafter="self@skip", k=3), dict(method="auto", drafters=["self@skip"])):
            result = generate(target, prompt_ids=prompt, max_new_tokens=24, **options)
            assert result.token_ids == expected, options
            assert sum(result.stats.accepted_lengths) > 0, options
            if options["method"] == "sd":
                assert sum(result.stats.draft_lengths) > 0 and list(result.stats.drafter_forwards) == [
                    f"{target.name} skipping {len(skipped)}"]
    for bad in ("maxgram@skip", "qwen2.5-coder-0.5b@skip"):
        with pytest.raises(ConfigError, match="self@skip"):
            generate(target, prompt_ids=prompt, max_new_tokens=4, method="sd", drafter=bad)


def test_self_skip_where_calibration_finds_no_layer_worth_skipping_is_one_error(lean_files, tmp_path):
    """A model with no middle layer (two layers) calibrates to none skipped: `self@skip` would draft at the model's
    own cost, so sd and auto, which name it, say so in one line rather than draft with the whole model."""
    path = tmp_path / "two.gguf"
    write_tiny_gguf(path, "qwen2", 6, "k", layers=2, hidden=256)
    target = load_model(str(path), backend="lean", tokenizer=byte_tokenizer())
    for options in (dict(method="sd", drafter="self@skip"), dict(method="auto", drafters=["self@skip", "maxgram"])):
        with pytest.raises(ConfigError, match=f"calibration found no layer worth skipping in {target.name}"):
            generate(target, prompt_ids=[1, 2, 3], max_new_tokens=4, **options)


def test_a_windowed_model_agrees_with_transformers_mistral_on_the_same_weights(lean_files):
    """A llama GGUF with a sliding window of 6 is Mistral: its logits, for a prompt past the window, are those of
    transformers' Mistral on the de-quantized weights, which applies the window itself (and not those of the same
    weights without one)."""
    from transformers import MistralConfig, MistralForCausalLM

    path, model = lean_files["llama-window", 0]
    plain = dequantized_transformer(path, model, "llama")
    config = MistralConfig(**{**plain.config.to_dict(), "sliding_window": 6})
    reference = MistralForCausalLM(config).eval()
    reference.load_state_dict(plain.state_dict())
    ids = prompt_ids(1, 20)
    windowed = lean(lean_files, "llama-window")
    rows = torch.cat([windowed.prefill(ids[:5])[None], windowed.forward(ids[5:])])[:, :BYTE_VOCAB]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, 4:]
        unwindowed = plain(torch.tensor([ids])).logits[0, 4:]
    assert (rows - expected).norm() / expected.norm() < 0.05  # int8 activations
    assert (rows - unwindowed).norm() / unwindowed.norm() > 0.1  # the window matters here


ARCHITECTURES = ("llama3", "qwen3", "phi3", "gemma2", "gemma3")  # beside the qwen2 and llama above
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q5_K", "F16", "BF16", "F32")


@pytest.fixture(scope="module")
def typed_files(tmp_path_factory):
    """A file per architecture (Q8_0) and per type (qwen3), written as each is asked for."""
    root, files = tmp_path_factory.mktemp("typed"), {}

    def file(arch: str, ggml_type: str):
        if (arch, ggml_type) not in files:
            path = root / f"{arch}-{ggml_type}.gguf"
            layers = 6 if arch == "gemma3" else 2  # Gemma 3: five windowed layers, then a global one
            files[arch, ggml_type] = (path, write_tiny_gguf(path, arch, 0, ggml_type, hidden=256, layers=layers))
        return files[arch, ggml_type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULANT_CACHE", str(root / "cache"))
        yield file


@pytest.mark.parametrize("arch, ggml_type", [(arch, "Q8_0") for arch in ARCHITECTURES] +
                         [("qwen3", t) for t in TYPES if t != "Q8_0"])
def test_every_architecture_and_type_agrees_with_transformers_and_rows_are_exact(typed_files, arch, ggml_type):
    """Logits against transformers on the de-quantized weights (its own Llama 3 rope scaling, Qwen3's q and k
    norms, Phi-3's fused matrices, Gemma's windowed and global layers, soft caps and norms), for a prompt longer
    than Llama 3's original context of 64 and Gemma's window of 8; a W-token forward equals W one-token forwards
    bit for bit."""
    path, model = typed_files(arch, ggml_type)
    reference = dequantized_transformer(path, model, arch)
    ids = prompt_ids(1, 80)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, 4:]
    lean = load_model(str(path), backend="lean", tokenizer=byte_tokenizer())
    rows = torch.cat([lean.prefill(ids[:5])[None], lean.forward(ids[5:])])[:, :BYTE_VOCAB]
    error = (rows - expected).norm() / expected.norm()
    assert error < (1e-4 if ggml_type in ("F16", "BF16", "F32") else 0.08), error  # int8 activations: ~0.05
    lean.rollback(5)
    assert torch.equal(torch.cat([lean.forward([t]) for t in ids[5:12]]), rows[1:8])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_method_equals_ar_on_every_architecture(typed_files, arch, monkeypatch):
    target = load_model(str(typed_files(arch, "Q8_0")[0]), backend="lean", tokenizer=byte_tokenizer())
    prompt = prompt_ids(20)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=16)
    invent(monkeypatch, costs(target))  # (auto speculates)
    for label, options in every_method(target.share()).items():
        result = generate(target, prompt_ids=prompt, max_new_tokens=16, **options)
        assert result.token_ids == expected.token_ids, label
        assert label not in DRAFTS_ACCEPTED or sum(result.stats.accepted_lengths) > 0, label


def test_a_user_s_gguf_runs_on_lean_where_it_can_and_says_why_in_one_line(typed_files, tmp_path, monkeypatch, caplog):
    """`auto` on a .gguf path: the lean backend where it runs the file as it is, else llama.cpp, the reason in one
    line read from the header (nothing loaded); a tokenizer transformers cannot read, the reason in one line."""
    from speculant.models import loading

    monkeypatch.setattr(loading, "_simd_kernels", lambda: True)
    path = typed_files("qwen3", "Q5_K")[0]
    assert loading.resolve_backend("auto", str(path), None, None) == "lean"
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert loading.resolve_backend("auto", str(other), None, None) == "llamacpp"
    assert loading.resolve_backend("auto", str(path), None, None, "bf16") == "llamacpp"  # a dtype: not as it is
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"speculant: {path.name} runs on the lean backend: qwen3, Q5_K matrices",
                     "speculant: other.gguf runs on llama.cpp: the lean backend runs qwen2, llama, qwen3, phi3, gemma2, gemma3, "
                     "not gpt2"]
    assert "qwen3 with Q5_K matrices" in load_model(str(path), tokenizer=byte_tokenizer()).describe()[0]
    caplog.clear()  # a tokenizer transformers cannot convert (this file's one merge makes a token it lacks)
    assert load_model(str(path)).tokenizer is None
    [line] = [r.getMessage() for r in caplog.records if "tokenizer" in r.getMessage()]
    assert line.startswith(f"speculant: transformers cannot read {path.name}'s tokenizer (Error while initializing BPE")
    assert line.endswith("): it runs on token ids only")


def variant(tmp_path, monkeypatch, name, arch="llama", **writes):
    """A tiny F32 GGUF whose writer's `writes` (GGUFWriter method: its replacement, called with the writer and the
    original's arguments) change what it writes: the metadata and tensors of files written by other tools."""
    with monkeypatch.context() as patch:
        for method, replacement in writes.items():
            original = getattr(gguf.GGUFWriter, method)
            patch.setattr(gguf.GGUFWriter, method,
                          lambda self, *args, f=replacement, o=original, **kw: f(self, o, *args, **kw))
        path = tmp_path / f"{name}.gguf"
        variant.model = write_tiny_gguf(path, arch, 0, "F32", hidden=128)  # (the last written: a reference's weights)
    return path


def test_metadata_llama_cpp_reads_with_defaults_computes_as_llama_cpp_does(tmp_path, monkeypatch):
    """A linear rope scaling given only by its factor, or under the older `rope.scale_linear` key, and a Gemma 2 file
    without its soft caps (llama.cpp's defaults: linear; 50 and 30) compute as the file that names them."""
    ids = prompt_ids(3, 40)

    def logits(path):
        return load_model(str(path), backend="lean", tokenizer=byte_tokenizer()).prefill(ids)

    def then(*more):  # after the rope's dimension count: keys of the writer's own
        return lambda writer, original, n: (original(writer, n), *(add(writer) for add in more))

    path = variant(tmp_path, monkeypatch, "named", add_rope_dimension_count=then(
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), lambda w: w.add_rope_scaling_factor(4.0)))
    named = logits(path)
    plain = dequantized_transformer(path, variant.model, "llama")  # transformers' own linear scaling, the reference
    scaled = type(plain)(type(plain.config)(**{**plain.config.to_dict(), "rope_parameters": dict(
        rope_type="linear", factor=4.0, rope_theta=plain.config.rope_parameters["rope_theta"])})).eval()
    scaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        expected = scaled(torch.tensor([ids])).logits[0, -1]
    assert (named[:len(expected)] - expected).norm() / expected.norm() < 1e-4
    for name, key in (("factor", lambda w: w.add_rope_scaling_factor(4.0)),
                      ("old", lambda w: w.add_float32("llama.rope.scale_linear", 4.0))):
        assert torch.equal(logits(variant(tmp_path, monkeypatch, name, add_rope_dimension_count=then(key))), named)
    capped = logits(variant(tmp_path, monkeypatch, "capped", "gemma2", add_attn_logit_softcapping=lambda w, o, v: o(
        w, 50.0), add_final_logit_softcapping=lambda w, o, v: o(w, 30.0)))
    bare = variant(tmp_path, monkeypatch, "bare", "gemma2", add_attn_logit_softcapping=lambda w, o, v: None,
                   add_final_logit_softcapping=lambda w, o, v: None)
    assert "softcapping" not in str(GGUFFile(bare).fields) and torch.equal(logits(bare), capped)


def test_files_the_lean_model_would_compute_otherwise_run_on_llama_cpp(tmp_path, monkeypatch):
    """Each says why in one line read from the header: a tensor it does not compute (a bias of the output
    projection), experts, one part of a split model, per-layer head counts, a norm not in F32, a count of 0, a
    matrix of more than two dimensions."""
    from speculant.models.backends.lean import coverage

    extra = lambda name, values: lambda w, o, n: (o(w, n), w.add_tensor(name, values))  # noqa: E731
    cases = {
        "blk.0.attn_output.bias, which": dict(add_rope_dimension_count=extra("blk.0.attn_output.bias",
                                                                             np.ones(128, np.float32))),
        "with experts": dict(add_rope_dimension_count=lambda w, o, n: (o(w, n), w.add_uint32("llama.expert_count", 4))),
        "one part of a split model": dict(add_rope_dimension_count=lambda w, o, n: (o(w, n), w.add_uint16(
            "split.count", 3))),
        "head_count_kv is list": dict(add_head_count_kv=lambda w, o, n: w.add_array("llama.attention.head_count_kv",
                                                                                    [n, n])),
        "attn_norm.weight is F16": dict(add_tensor=lambda w, o, name, values, *rest, **kw: o(
            w, name, values.astype(np.float16) if name.endswith("attn_norm.weight") else values, *rest, **kw)),
        "attention.head_count is 0": dict(add_head_count=lambda w, o, n: o(w, 0)),  # (it divided by it)
        "output.weight has 3 dimensions": dict(add_tensor=lambda w, o, name, values, *rest, **kw: o(
            w, name, values[None] if name == "output.weight" else values, *rest, **kw)),
    }
    for reason, writes in cases.items():
        runs, why = coverage(variant(tmp_path, monkeypatch, reason.split()[0], **writes))
        assert not runs and reason in why, why


def test_a_header_with_an_array_longer_than_the_file_or_nested_without_end_is_refused(tmp_path):
    import struct

    def header(value: bytes) -> bytes:  # one key, "k", of array type (9)
        return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + value

    long = header(struct.pack("<IQ", 0, 2**63))  # 2^63 uint8s
    deep = header(b"".join(struct.pack("<IQ", 9, 1) for _ in range(3000)))  # arrays of one array, 3000 deep
    for name, data in (("long", long), ("deep", deep)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match="damaged GGUF header"):
            GGUFFile(tmp_path / name)


def test_a_damaged_gguf_is_refused_as_damaged_not_sent_to_llama_cpp(tmp_path):
    """A truncated file's header cannot be read: it was routed to llama.cpp, whose refusal (or the advice to build it)
    hid the cause, said only in a warning line."""
    from speculant.models import load_model

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "qwen2", 3, "q8_0")
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    with pytest.raises(ConfigError, match="t.gguf: a damaged GGUF header"):
        load_model(str(path))


WINDOWED_METHODS = {"ar": dict(method="ar"), "sd": dict(method="sd", drafter="maxgram", k=4),
                    "tree": dict(method="tree", drafter="self", depth=3, width=3),
                    "cascade": dict(method="cascade", drafters=["self", "maxgram"])}


def windowed_reference(typed_files, tmp_path, arch: str, window: int | None = 8):
    """(GGUF path, transformers model on its de-quantized F32 weights) of a windowed tiny model: Gemma 3 (five
    windowed layers and a global one) or Mistral (a llama GGUF with a window); window=None: the same weights
    with no window."""
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        path = tmp_path / "mistral.gguf"
        plain = dequantized_transformer(path, write_tiny_gguf(path, "llama", 0, "F32", hidden=256, window=8), "llama")
        model = MistralForCausalLM(MistralConfig(**{**plain.config.to_dict(), "sliding_window": window or 4096}))
        model.load_state_dict(plain.state_dict())
        return path, model.eval()
    path, model = typed_files(arch, "F32")
    model = dequantized_transformer(path, model, arch)
    if window is None:
        wide = type(model)(type(model.config)(**{**model.config.to_dict(), "sliding_window": 4096})).eval()
        wide.load_state_dict(model.state_dict())
        return path, wide
    return path, model


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
@pytest.mark.parametrize("length", [5, 20])  # within the window of 8, and past it
def test_greedy_decoding_of_a_windowed_model_is_transformers_own(typed_files, tmp_path, arch, length):
    """F32 matrices (fp32 rows, no int8 activations): greedy `ar`, `sd`, `tree` and `cascade` on the lean model
    emit the tokens of transformers' greedy decoding of the same model, recomputed in full at every step, for
    generations that cross the window (where the same weights without a window emit others)."""
    path, reference = windowed_reference(typed_files, tmp_path, arch)
    prompt = prompt_ids(30 + length, length)
    expected = greedy(reference, prompt)
    assert expected != greedy(windowed_reference(typed_files, tmp_path, arch, None)[1], prompt)  # the window matters
    lean = load_model(str(path), backend="lean", tokenizer=byte_tokenizer())
    for label, options in WINDOWED_METHODS.items():
        assert generate(lean, prompt_ids=prompt, max_new_tokens=16, **options).token_ids == expected, label


def test_a_gguf_file_reads_as_gguf_s_own_reader_reads_it(typed_files, lean_files, tmp_path):
    """`GGUFFile` (the metadata and tensor table as the format lays them out) against gguf's `GGUFReader`: every
    metadata value and every tensor's type, shape, offset and data view alike, for each architecture and each type the
    kernels read, and for a file of every value type (a bool array, an empty one, strings with non-ASCII text), an
    alignment of 256, as GGUF version 3 and 2; a file that is not GGUF, or is cut short: one line."""
    values = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(values), "llama")
    writer.add_custom_alignment(256)
    for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700), ("uint32", 7 << 20),
                        ("int32", -(7 << 20)), ("float32", 0.1), ("uint64", 7 << 40), ("int64", -(7 << 40)),
                        ("float64", 0.1), ("bool", True), ("string", "Écris 用中文 🐍")]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.empty", [])
    writer.add_array("test.strings", ["a", "Ġb", "é", ""])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_tensor("odd", np.arange(15, dtype=np.float32).reshape(3, 5))
    writer.add_tensor("half", np.ones((2, 8), dtype=np.float16))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    second = tmp_path / "version2.gguf"
    second.write_bytes(values.read_bytes()[:4] + (2).to_bytes(4, "little") + values.read_bytes()[8:])
    paths = [typed_files(arch, "Q8_0")[0] for arch in ARCHITECTURES] + \
        [typed_files("qwen3", t)[0] for t in TYPES] + [lean_files["llama-window", 0][0], values, second]
    for path in paths:
        assert same_as_gguf_reader(path) == [], path.name
    assert GGUFFile(values).fields["test.bools"] == [True, False, True]
    assert all(tensor.data_offset % 256 == 0 for tensor in GGUFFile(second).tensors)
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    short = tmp_path / "short.gguf"
    short.write_bytes(values.read_bytes()[:200])
    for path, message in [(bad, "not a GGUF file"), (short, "damaged GGUF header")]:
        with pytest.raises(ConfigError, match=message):
            GGUFFile(path)


def test_a_gguf_file_refuses_what_it_cannot_honour(lean_files):
    """A .gguf file runs as it is: a quantization, compilation or another device asked of it is refused, not dropped
    (auto's route had taken it to llama.cpp as it was); so is a setting given with a model already loaded."""
    path = str(lean_files["llama", 0][0])
    for kwargs, message in [(dict(quant="int8"), "@int8 quantizes transformers weights"),
                            (dict(compile=True), "compile applies to the static backend"),
                            (dict(group_size=0), "group_size must be a positive integer"),
                            (dict(tokenizer="gpt2"), "tokenizer must be a loaded tokenizer")]:
        with pytest.raises(ConfigError, match=message):
            load_model(path, **kwargs)
    loaded = lean(lean_files, "llama")
    assert load_model(loaded) is loaded
    with pytest.raises(ConfigError, match="a loaded model runs as it is: dtype, backend apply"):
        load_model(loaded, dtype="bf16", backend="lean")


def run_at_once(load, threads: int = 2) -> list:
    """What `load()` returns in each of `threads` threads started together (a thread that raises returns nothing)."""
    import threading

    barrier, loaded = threading.Barrier(threads), []

    def first_use():
        barrier.wait()
        loaded.append(load())

    started = [threading.Thread(target=first_use) for _ in range(threads)]
    [thread.start() for thread in started]
    [thread.join() for thread in started]
    return loaded


def slowed_pack(monkeypatch, every=None):
    """Count (and slow, so that threads overlap) the matrices repacked; raise KeyboardInterrupt at the `every`-th."""
    import time

    from speculant.kernels import formats

    pack, packed = formats.pack, []

    def counted(*args):
        packed.append(1)
        if len(packed) == every:
            raise KeyboardInterrupt
        time.sleep(0.02)
        return pack(*args)

    monkeypatch.setattr(formats, "pack", counted)
    return packed


def test_threads_that_first_load_one_file_at_once_both_load_it_and_share_one_repack(tmp_path, monkeypatch):
    """Each repack writes a temporary directory of its own (two at once, as two processes would, both load), and
    `shared_weights` repacks a file once however many threads first ask for it at once."""
    from speculant.models.backends import lean as lean_module

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2", 0, "k", hidden=256)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    packed = slowed_pack(monkeypatch)
    assert len(run_at_once(lambda: lean_module.LeanWeights(path))) == 2
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "again"))
    packed.clear()
    first, second = run_at_once(lambda: lean_module.shared_weights(path))
    assert first is second and len(packed) == 1 + 2 * 7  # the head and 7 matrices per layer, once
    assert [p.name.startswith(".tmp-") for p in (tmp_path / "again" / "lean").iterdir()] == [False]


def test_a_repack_that_stops_part_way_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """Ctrl-C (or an error, a full disk) part-way through the first load removes the repack's temporary directory;
    one a killed process left is removed once untouched for a day."""
    import os
    import time

    from speculant.models.backends import lean as lean_module

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2", 0, "k", hidden=256)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    slowed_pack(monkeypatch, every=5)
    with pytest.raises(KeyboardInterrupt):
        lean_module.LeanWeights(path)
    root = tmp_path / "cache" / "lean"
    assert list(root.iterdir()) == []
    for name in (".tmp-killed", ".tmp-running"):
        (root / name).mkdir()
        (root / name / "output.weight.npy").write_bytes(b"")
    two_days_ago = time.time() - 2 * 86400
    os.utime(root / ".tmp-killed", (two_days_ago, two_days_ago))
    lean_module._remove_unused(root)
    assert [p.name for p in root.iterdir()] == [".tmp-running"]


def test_an_interrupted_prefill_leaves_the_cache_as_the_earlier_parts_left_it(lean_files):
    """An `Interrupted` in a later block of a prompt part drops the part's finished blocks too (base.Interrupted: the
    cache as it was before the call); a prefill starts from an empty cache, and leaves it empty."""
    from speculant.models.base import Interrupted

    model, ids = lean(lean_files, "qwen2"), prompt_ids(3, 150)
    model.prefill(ids[:20])
    expected = model.continue_prefill(ids[20:])  # blocks [20, 64), [64, 128), [128, 150)
    checks = [0]

    def second_block():  # True from the second block's second layer
        checks[0] += 1
        return checks[0] > model.config.layers + 1

    for run, left in ((lambda: model.continue_prefill(ids[20:]), 20), (lambda: model.prefill(ids), 0)):
        model.prefill(ids[:20])
        checks[0], model.interrupt = 0, second_block
        with pytest.raises(Interrupted):
            run()
        model.interrupt = None
        assert model.cache_len == left
    model.prefill(ids[:20])
    assert torch.equal(model.continue_prefill(ids[20:]), expected)


def test_a_file_without_what_the_lean_model_reads_is_refused_in_one_line(tmp_path, monkeypatch):
    """A Phi-3 file without its fused ffn_up, and a tensor of a type llama.cpp removed (Q4_0_4_4, type 31): a
    ConfigError that says so, not a KeyError or "a damaged header"."""
    import struct

    from speculant.models.backends.lean import coverage

    no_up = variant(tmp_path, monkeypatch, "no-up", "phi3", add_tensor=lambda w, o, name, *args, **kw: None
                    if name == "blk.1.ffn_up.weight" else o(w, name, *args, **kw))
    assert coverage(no_up) == (False, "the GGUF file has no blk.1.ffn_up.weight")
    removed = tmp_path / "removed.gguf"  # one tensor "w" [1, 32] of type 31, its data at the alignment of 32
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"w" + struct.pack("<I2QIQ", 2, 32, 1,
                                                                                               31, 0)
    removed.write_bytes(header + bytes(-len(header) % 32 + 64))
    with pytest.raises(ConfigError) as refused:
        GGUFFile(removed)
    assert str(refused.value).startswith(f"{removed}: the tensor w is of an unsupported tensor type (31; removed")
    assert coverage(removed) == (False, str(refused.value))  # left to llama.cpp (a type newer than gguf: it may run)
    # heads its key-value heads do not divide, or matrices not as many rows as the heads make: refused as it loads,
    # where the first prefill had raised a reshape's RuntimeError
    for kv_heads, message in ((3, "4 attention heads do not share its 3 key-value heads evenly"),
                              (4, "blk.0.attn_k.weight has 64 rows where its heads make 128")):
        path = variant(tmp_path, monkeypatch, f"kv{kv_heads}", add_head_count_kv=lambda w, o, n, k=kv_heads: o(w, k))
        assert coverage(path) == (False, f"the GGUF file's {message}")
        with pytest.raises(ConfigError, match=message):
            load_model(str(path), backend="lean")


def test_a_gguf_drafter_drafts_for_a_transformers_target_on_the_backend_that_runs_it(lean_files, monkeypatch):
    """`x.gguf@lean` drafting for an hf target loads on the lean backend (the target verifies every token, whatever
    runs the drafts): the target's own greedy output. A drafter dtype, which its GGUF's own types leave nothing to
    apply to, is refused, never dropped."""
    from speculant.models import loading
    from speculant.models.backends import lean as lean_module

    monkeypatch.setattr(lean_module, "DRAFT_HEAD", 64)
    monkeypatch.setattr(loading, "drafter_tokenizer", lambda target, source: target.tokenizer)  # (the tiny file's
    # own tokenizer does not convert; a drafter whose tokenizer files are the target's reads with the target's)
    path, model = lean_files["qwen2", 0]
    target = load_model(model, tokenizer=byte_tokenizer())
    prompt = prompt_ids(40)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=16).token_ids
    result = generate(target, prompt_ids=prompt, method="sd", drafter=f"{path}@lean", k=4, max_new_tokens=16)
    assert result.token_ids == expected and result.stats.acceptance_rate > 0
    with pytest.raises(ConfigError, match="runs its GGUF's own types"):
        generate(target, prompt_ids=prompt, method="sd", drafter=f"{path}@lean", drafter_dtype="fp32",
                 max_new_tokens=4)


def test_without_gguf_or_wordfreq_a_load_is_one_line_with_the_install_command(lean_files, tmp_path, monkeypatch):
    """A GGUF target without the gguf package, and a drafter's FR-Spec head without wordfreq, even where its counts
    are cached (their key is wordfreq's version): ModelNotAvailable, not a ModuleNotFoundError's traceback."""
    import importlib.metadata
    import sys

    from speculant.corpus import frequent_tokens
    from speculant.errors import ModelNotAvailable

    frequent_tokens(byte_tokenizer(), BYTE_VOCAB, 64)  # (counted and cached)
    found = importlib.metadata.version

    def version(name):
        if name == "wordfreq":
            raise importlib.metadata.PackageNotFoundError(name)
        return found(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ModelNotAvailable, match="wordfreq package, which is not installed; run: pip install wordfreq"):
        frequent_tokens(byte_tokenizer(), BYTE_VOCAB, 64)
    copy = tmp_path / "copy.gguf"  # (a file no test routed yet)
    copy.write_bytes(lean_files["qwen2", 0][0].read_bytes())
    monkeypatch.setitem(sys.modules, "gguf", None)
    for backend in (None, "lean"):
        with pytest.raises(ModelNotAvailable, match="needs the gguf package, which is not installed; run: pip install"):
            load_model(str(copy), backend=backend, tokenizer=byte_tokenizer())
