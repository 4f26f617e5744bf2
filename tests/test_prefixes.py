"""Prefix caching (`speculant.prefixes`): a prompt restored from another's cached blocks holds the bits of its own
prefill; a server's outputs and log-probabilities with the cache equal those without it, for the target and the
drafters; the cache keeps shared prefixes once and stays within its budget."""

import random
import threading
import time

import pytest
import torch
from helpers import BYTE_VOCAB, byte_tokenizer, costs, invent
from tiny_gguf import write_tiny_gguf

from speculant.config import SamplingConfig
from speculant.methods import get_method
from speculant.models import load_model
from speculant.models.backends import lean as lean_module
from speculant.models.base import DraftCache
from speculant.prefixes import PrefixCache
from speculant.serve.batcher import Row
from speculant.serve.engine import Engine, ServeJob
from speculant.serve.metrics import Metrics


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefixes")
    paths = [root / "qwen2-0.gguf", root / "qwen2-0-q8_0.gguf", root / "llama-window.gguf"]
    for quant, path in zip(("k", "q8_0"), paths):  # (the second, a drafter that agrees with the first often)
        write_tiny_gguf(path, "qwen2", 0, quant, hidden=256)
    write_tiny_gguf(paths[2], "llama", 0, "k", hidden=256, window=40)  # a prompt part sees less than its blocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULANT_CACHE", str(root / "cache"))
        yield paths


def lean(path):
    return load_model(str(path), backend="lean", tokenizer=byte_tokenizer())


def served(engine: Engine, job: ServeJob):
    """`job` through `engine`, its Outcome (or error) waited for on an event, then the engine idle again: the tests
    had polled the batcher with `run` calls, each queued as a request, so that auto's choices, which read the server's
    load, saw a second request at moments a loaded machine's timing decided (and a seeded sampled turn differed)."""
    done, finished = [], threading.Event()
    engine.submit(job, lambda piece, logprobs: None, lambda outcome: (done.append(outcome), finished.set()))
    assert finished.wait(120)
    while engine.batcher.load:  # (a request leaves the batcher's count just after its end is heard)
        time.sleep(0.001)
    return done[0]


def ids_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BYTE_VOCAB - 1) for _ in range(n)]


@pytest.mark.parametrize("file", [0, 2], ids=["qwen2", "llama-window"])
def test_a_restored_prefix_holds_the_bits_of_the_prompts_own_prefill(files, file):
    """Prompt B shares 150 tokens with A: restored from A's cached blocks (128 positions) and continued, B's
    logits and cache equal B's fresh prefill bit for bit, with a sliding window too. Only whole blocks are kept:
    the positions of a block a prompt cuts short ran in a shorter call than a longer prompt's, whose bits may
    differ."""
    model = lean(files[file])
    a = ids_of(1, 150) + ids_of(2, 40)
    b = a[:150] + ids_of(3, 60)
    fresh = model.share()
    expected = fresh.prefill(b)
    keys = fresh._keys[:, :, :len(b)].clone()
    cache = PrefixCache(64)
    other = model.share()
    other.prefill(a)
    cache.store(other, a)
    row = model.share()
    assert cache.restore(row, b) == 128 == 2 * lean_module.PREFILL_BLOCK
    assert torch.equal(row.continue_prefill(b[128:]), expected)
    assert torch.equal(row._keys[:, :, :len(b)], keys)
    assert cache.tokens() == 128  # A's whole blocks only: its last 62 positions ran in a block cut short


def test_a_block_put_together_from_two_prompts_holds_the_bits_of_a_fresh_prefill(files):
    """A and B share 100 tokens and part within the block [64, 128): stored one after the other, the tree splits
    there, and C (B's first 250 tokens) restores [0, 100) from A's computation and [100, 128) from B's; each
    position is a function of the tokens up to it, so C's logits and cache equal its fresh prefill's. The parts a
    restored prompt continues in stay on the block grid (PREFILL_PART and SERVED_PART multiples of PREFILL_BLOCK)."""
    from speculant.models import base

    assert base.PREFILL_PART % lean_module.PREFILL_BLOCK == lean_module.SERVED_PART % lean_module.PREFILL_BLOCK == 0
    model, cache = lean(files[0]), PrefixCache(64)
    a = ids_of(11, 100) + ids_of(12, 150)
    b = a[:100] + ids_of(13, 200)
    for ids in (a, b):
        row = model.share()
        row.prefill(ids)
        cache.store(row, ids)
    c = b[:250]
    fresh = model.share()
    expected = fresh.prefill(c)
    row = model.share()
    assert cache.restore(row, c) == 192
    assert torch.equal(row.continue_prefill(c[192:]), expected)
    assert torch.equal(row._keys[:, :, :250], fresh._keys[:, :, :250])
    assert torch.equal(row._values[:, :, :250], fresh._values[:, :, :250])


def test_shared_prefixes_are_kept_once_and_the_budget_holds():
    """A fake model with one float per position: two prompts sharing 8 blocks of 4 hold 8 + 2 + 2 blocks; a
    third beyond the budget evicts the least recently used leaf."""

    class Positions:
        class capabilities:
            reuses_prefixes = True

        prefix_block, weights_key, numerics = 4, 0, "fake"

        def __init__(self):
            self.held = torch.zeros(1, 1, 0, 1)

        @property
        def cache_len(self):
            return self.held.shape[2]

        def prefill(self, ids):
            self.held = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)

        def export_kv(self, start, end):
            return (self.held[:, :, start:end].clone(),)

        def import_kv(self, pieces):
            self.held = torch.cat([p[0] for p in pieces], 2)

    model, cache = Positions(), PrefixCache(60 * 4 / 2**20)  # 60 positions of 4 bytes
    first, second, third = list(range(40)), list(range(32)) + [90] * 9, list(range(100, 121))
    for ids in (first, second):
        model.prefill(ids)
        cache.store(model, ids)
    assert cache.tokens() == 48 and cache.bytes == 48 * 4  # 32 shared, 8 + 8 apart (the 41st: not a whole block)
    model.prefill(third)
    cache.store(model, third)
    assert cache.tokens() == 60 and cache.bytes <= cache.budget  # first's own 8, the least recently used, left
    restored = Positions()
    assert cache.restore(restored, third) == 20
    assert restored.held.flatten().tolist() == list(range(100, 120))
    assert cache.restore(Positions(), first) == 32
    assert cache.restore(Positions(), second) == 40
    short = list(range(17)) + [999]  # its whole blocks lie within a held edge: nothing to add, nothing lost
    model.prefill(short)
    cache.store(model, short)
    assert cache.tokens() == 60 and cache.bytes == 60 * 4
    assert cache.restore(Positions(), second) == 40 and cache.restore(Positions(), short) == 16


@pytest.mark.parametrize("method", ["ar", "sd", "auto"])
def test_served_outputs_and_logprobs_equal_with_and_without_the_cache(files, method, monkeypatch):
    """A conversation's second turn resends the first's prompt and reply: with the cache its prefill starts from
    the first turn's blocks (the target's and the drafter's), and every token and log-probability equals a server
    without the cache's, greedy and sampled with a seed. The drafter agrees with the target often (and auto is
    told that it pays), so its restored rows draft what is accepted."""
    target, drafter = lean(files[0]), lean(files[1])
    if method == "auto":
        invent(monkeypatch, costs(target))
    options = {"ar": {}, "sd": {"drafter": drafter, "k": 3}, "auto": {"drafters": (drafter, "maxgram")}}[method]
    outcomes, prefilled = {}, {0: 0, 64: 0}  # the tokens prefills computed (the cache's restored not among them)
    submit = Row._submit

    def counted(row, call):
        if call.prefill:
            prefilled[budget] += len(call.ids)
        return submit(row, call)
    monkeypatch.setattr(Row, "_submit", counted)
    for budget in (0, 64):
        metrics = Metrics()
        engine = Engine(target, method, get_method(method).make_options(options), 8, 16, metrics, budget)
        turns, history = [], ids_of(4, 140)
        for turn, sampling in enumerate((SamplingConfig(), SamplingConfig(temperature=0.8), SamplingConfig())):
            outcome = served(engine, ServeJob(history, 12, sampling, seed=turn, logprobs=2))
            assert not isinstance(outcome, BaseException), outcome
            turns.append((outcome.text, [(e.token, e.logprob, e.top) for e in outcome.logprobs]))
            assert method == "ar" or outcome.speculative["accepted_tokens"] > 0, turn
            history = history + [e.token for e in outcome.logprobs] + ids_of(5 + turn, 30)
        engine.close()
        outcomes[budget] = turns
        cache = engine.session.prefixes
        if budget:
            assert cache.hits >= 2 and cache.saved >= 2 * 128
            assert metrics.prefix_tokens._value.get() == cache.saved
            if method == "sd":  # the drafter's prefixes are kept too
                assert len(cache.roots) == 2
    assert outcomes[64] == outcomes[0]
    assert prefilled[64] == prefilled[0] - cache.saved  # (what was restored was not computed again)


def test_open_loop_conversations_reuse_their_history(files):
    """`bench-serve --rate R --turns 3` against a served tiny model: every turn answered, and each later turn
    restores its history (the turn before's prompt) from the prefix cache."""
    from test_serve import TEMPLATE, serving

    from speculant.bench.datasets import Prompt
    from speculant.bench.serve import run_sessions

    target = lean(files[0])
    target.tokenizer.chat_template = TEMPLATE
    engine = Engine(target, "ar", get_method("ar").make_options({}), 8, 16, Metrics(), 64)
    prompts = [Prompt(f"p{i}", "".join(chr(97 + (7 * i + j) % 26) for j in range(150)), chat=True) for i in range(4)]
    with serving(engine) as url:
        result = run_sessions(url, prompts, conversations=4, turns=3, rate=20.0, max_tokens=8)
    engine.close()
    assert result["errors"] == result["lost"] == 0 and result["requests"] == 12
    assert result["ttft_later_turns_ms"]["p50"] is not None
    assert engine.session.prefixes.hits >= 8  # the 8 later turns


@pytest.mark.parametrize("backend, arch", [("hf", "llama"), ("hf", "qwen2"), ("static", "llama"),
                                           ("static", "mistral")])
def test_a_backend_of_one_token_bits_restores_any_prefix_with_a_fresh_prefills_bits(backend, arch):
    """transformers on batch-invariant kernels, and the static backend (every row of a call its token's one-row
    bits): a prompt's rows have their bits however it is split, so any position may be restored (`prefix_block`
    1); a served conversation is the same with and without the cache. (The static backend prefilled every prompt
    whole, its served conversations paying their history again each turn.)"""
    from helpers import byte_tokenizer, tiny_model, tiny_transformer
    from test_serve import TEMPLATE

    from speculant.models.backends.static import StaticCausalLM, StaticWeights

    if backend == "hf":
        model = tiny_model(arch, 5, BYTE_VOCAB, init_std=0.2, tokenizer=byte_tokenizer())
    else:
        weights = tiny_transformer(arch, 5, BYTE_VOCAB, init_std=0.2)
        weights.config.sliding_window = 16 if arch == "mistral" else None  # (a window shorter than the history)
        model = StaticCausalLM(StaticWeights(weights), byte_tokenizer(), span=256)
    assert model.capabilities.reuses_prefixes and model.prefix_block == 1
    a = ids_of(21, 90)
    b = a[:70] + ids_of(22, 30)
    cache, other = PrefixCache(64), model.share()
    other.prefill(a)
    cache.store(other, a)
    row, fresh = model.share(), model.share()
    expected = fresh.prefill(b)
    assert cache.restore(row, b) == 70
    assert torch.equal(row.continue_prefill(b[70:]), expected)
    assert all(torch.equal(x, y) for x, y in zip(row.export_kv(0, len(b)), fresh.export_kv(0, len(b))))
    model.tokenizer.chat_template = TEMPLATE
    outcomes = []
    for budget in (0, 64):
        engine = Engine(model, "sd", get_method("sd").make_options({"drafter": "maxgram", "k": 3}), 8, 16, Metrics(),
                        budget)
        history, texts = ids_of(23, 120), []
        for turn in range(3):
            outcome = served(engine, ServeJob(history, 10, SamplingConfig(), logprobs=1))
            texts.append((outcome.text, [(e.token, e.logprob) for e in outcome.logprobs]))
            history = history + [e.token for e in outcome.logprobs] + ids_of(24 + turn, 20)
        engine.close()
        outcomes.append(texts)
        assert engine.session.prefixes.hits >= (2 if budget else 0)
    assert outcomes[0] == outcomes[1]


def test_auto_weighs_a_drafters_catch_up_less_what_the_prefix_cache_restores(files):
    """A drafter that lacks a 300-token context catches up by a prefill; with 256 of its positions in the prefix
    cache, auto's estimate of that catch-up is the prefill of the rest (prefill_s(300) - prefill_s(256))."""
    from speculant.drafters.base import Drafter
    from speculant.methods.auto import catch_up_cost

    class Profile:  # a prefill costs a millisecond a token
        long_ttft_s = 1.0

        @staticmethod
        def prefill_s(tokens):
            return tokens / 1000

    model = lean(files[1])

    class Lagging(Drafter):  # a model drafter whose cache holds nothing
        def __init__(self):
            self.model = model.share()
            self.cache = DraftCache(self.model)  # (its rule: a prefill, nothing kept)

    context, cache = ids_of(31, 300), PrefixCache(64)
    assert catch_up_cost(Lagging(), Profile, cache)(context) == pytest.approx(0.3)
    seen = model.share()
    seen.prefill(context)
    cache.store(seen, context)
    assert cache.cached(seen, context) == 256 and cache.lookups == 0  # (asking restores nothing)
    assert catch_up_cost(Lagging(), Profile, cache)(context) == pytest.approx(0.3 - 0.256)
    assert catch_up_cost(Lagging(), Profile, PrefixCache(0))(context) == pytest.approx(0.3)  # a cache that is off
