"""Greedy speculative decoding reproduces autoregressive decoding token for token (fp32 tiny models)."""

import logging
import random

import pytest
import torch

from helpers import ARCHS, DEVICES, MarkovLM, ScriptedDrafter, perturbed, random_prompt, tiny_model
from speculant import generate
from speculant.config import SamplingConfig
from speculant.drafters.base import Draft, Drafter
from speculant.drafters.model import ModelDrafter
from speculant.errors import ConfigError
from speculant.models import HFCausalLM
from speculant.models.base import common_prefix_len

VOCAB = 64
MAX_NEW = 40


def reference(target, prompt, max_new_tokens=MAX_NEW):
    return generate(target, prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens).token_ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("error_rate", [0.0, 1.0, 0.3, 0.7])
def test_scripted_drafters_match_autoregressive(arch, k, error_rate):
    for seed in range(4):
        target = tiny_model(arch, seed, VOCAB)
        prompt = random_prompt(seed, VOCAB)
        expected = reference(target, prompt)
        drafter = ScriptedDrafter(prompt, expected, error_rate, VOCAB, seed)
        result = generate(target, prompt_ids=prompt, drafter=drafter, k=k, max_new_tokens=MAX_NEW)
        assert result.token_ids == expected, f"seed {seed}"
        rate = result.stats.acceptance_rate
        if error_rate == 0.0:
            assert rate == 1.0
        if error_rate == 1.0:
            assert rate == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_model_drafters_match_autoregressive(arch, k, device):
    for seed in range(3):
        target = tiny_model(arch, seed, VOCAB, device=device)
        prompt = random_prompt(seed + 100, VOCAB)
        expected = reference(target, prompt)
        drafters = {
            "itself": target.share(),  # always agrees
            "perturbed": perturbed(target, 0.3, seed),  # agrees at random
            "other": tiny_model(arch, seed + 1000, VOCAB, device=device),  # rarely agrees
        }
        for label, drafter in drafters.items():
            result = generate(target, prompt_ids=prompt, drafter=drafter, k=k, max_new_tokens=MAX_NEW)
            assert result.token_ids == expected, f"seed {seed}, drafter {label}"
            if label == "itself":
                assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", [2, 4, 7])
def test_eos_inside_accepted_draft_stops_exactly(k):
    for seed in range(4):
        target = tiny_model("qwen2", seed, VOCAB)
        prompt = random_prompt(seed, VOCAB)
        free_run = reference(target, prompt)
        stop_at = 5 + seed  # make the token emitted there the end-of-sequence token
        target.eos_token_ids = frozenset({free_run[stop_at]})
        expected = reference(target, prompt)
        assert expected == free_run[: free_run.index(free_run[stop_at]) + 1]
        drafter = ScriptedDrafter(prompt, free_run, 0.0, VOCAB, seed)  # drafts past the EOS: the decoder cuts them there
        result = generate(target, prompt_ids=prompt, drafter=drafter, k=k, max_new_tokens=MAX_NEW)
        assert result.token_ids == expected
        assert result.stats.new_tokens == len(expected)


@pytest.mark.parametrize("k", [1, 3, 4, 7])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])
def test_max_new_tokens_inside_draft_is_exact(k, max_new_tokens):
    target = tiny_model("llama", 5, VOCAB)
    prompt = random_prompt(5, VOCAB)
    expected = reference(target, prompt, max_new_tokens)
    assert len(expected) == max_new_tokens
    result = generate(target, prompt_ids=prompt, drafter=target.share(), k=k, max_new_tokens=max_new_tokens)
    assert result.token_ids == expected
    assert max(result.stats.draft_lengths, default=0) <= k


def test_stats_count_forwards_and_acceptance():
    target = tiny_model("llama", 7, VOCAB)
    prompt = random_prompt(7, VOCAB)
    result = generate(target, prompt_ids=prompt, drafter=target.share(), k=4, max_new_tokens=21)
    stats = result.stats
    # Prefill gives token 1; each of 5 iterations accepts 4 drafts and adds a bonus token: 1 + 5 * 5 = 26 > 21,
    # so the iterations shrink their drafts near the end and every drafted token is accepted.
    assert stats.new_tokens == 21
    assert stats.acceptance_rate == 1.0
    assert stats.target_forwards == 1 + len(stats.accepted_lengths)
    assert sum(stats.accepted_lengths) + len(stats.accepted_lengths) + 1 == 21
    assert stats.drafter_forwards[target.name] == sum(stats.draft_lengths)
    assert stats.acceptance_per_position == [1.0] * 4
    assert stats.wall_s > 0 and 0 < stats.ttft_s <= stats.wall_s
    assert stats.target_steps == stats.target_forwards - 1 and stats.target_seconds > 0  # (the prefill not a step)
    plain = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=21).stats
    assert plain.target_steps == plain.target_forwards - 1 == 20 and plain.target_seconds > 0
    assert plain.target.endswith(" kernel") and generate(MarkovLM(VOCAB, 0), prompt_ids=prompt, method="ar",
                                                         max_new_tokens=2).stats.target == "fp32"  # (no kernel named)


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_confidence_ends_drafts_early_and_stays_lossless(arch):
    forwards = {"full": 0, "early": 0}
    for seed in range(4):
        target = tiny_model(arch, seed, VOCAB, init_std=0.3)  # peaked distributions: confident drafts exist
        prompt = random_prompt(seed, VOCAB)
        expected = reference(target, prompt)
        drafter = perturbed(target, 0.3, seed)
        for label, confidence in (("full", 0.0), ("early", 0.6)):
            result = generate(target, prompt_ids=prompt, drafter=drafter, k=6, max_new_tokens=MAX_NEW,
                              draft_confidence=confidence)
            assert result.token_ids == expected, f"seed {seed}, {label}"
            forwards[label] += result.stats.drafter_forwards[drafter.name]
    assert forwards["early"] < 0.8 * forwards["full"]


def test_model_drafter_stops_after_the_first_doubtful_token():
    target = tiny_model("qwen2", 9, VOCAB, init_std=0.3)
    context = random_prompt(9, VOCAB, 10)
    full = ModelDrafter(target.share(), SamplingConfig(), None, keep_probs=True).propose(context, 6)
    confidence = full.probs.max(-1).values
    threshold = float(confidence.sort().values[len(confidence) // 2])  # some draft tokens fall below it
    first_doubt = int((confidence < threshold).nonzero()[0])
    early = ModelDrafter(target.share(), SamplingConfig(), None, draft_confidence=threshold).propose(context, 6)
    assert early.tokens == full.tokens[: first_doubt + 1]
    assert early.probs is None  # greedy drafts carry no distribution unless asked


def test_model_drafter_resyncs_its_cache_after_rejections():
    target = tiny_model("qwen2", 9, VOCAB)
    drafter = ModelDrafter(target.share(), SamplingConfig(), None)
    context = random_prompt(9, VOCAB, 10)
    first = drafter.propose(context, 4)
    # The target accepted two of the drafts, then emitted its own token: the next proposal must equal
    # a proposal from a drafter that never saw the rejected tokens.
    context = context + first.tokens[:2] + [(first.tokens[2] + 1) % VOCAB]
    fresh = ModelDrafter(target.share(), SamplingConfig(), None)
    assert drafter.propose(context, 3).tokens == fresh.propose(context, 3).tokens


def test_a_cache_catches_up_by_a_prefill_where_it_keeps_little():
    """A drafter's cache that shares a few tokens with a new prompt prefills all of it; one that shares most of the
    context catches up on the rest (`catch_up`: the last row's logits). The logits are those of the context either
    way."""
    from speculant.models.base import PREFILL_AFTER, DraftCache

    class Counted(HFCausalLM):
        calls: list = []  # (tokens run, logits rows kept: 0 for all)

        def _run(self, ids, positions, mask, logits_to_keep):
            self.calls.append((len(ids), logits_to_keep))
            return super()._run(ids, positions, mask, logits_to_keep)

    target = tiny_model("llama", 4, VOCAB)
    cache = DraftCache(Counted(target.model, None, "counted"))
    old, new = random_prompt(4, VOCAB, 40), random_prompt(5, VOCAB, 40)
    cache.run(old)
    Counted.calls.clear()
    logits = cache.run(old[:2] + new)  # 2 shared tokens, 40 to run: a prefill of 42
    assert Counted.calls == [(42, 1)] and torch.equal(logits, target.share().prefill(old[:2] + new)[None])
    Counted.calls.clear()
    longer = old[:2] + new + new[:2 * PREFILL_AFTER]
    logits = cache.run(longer)  # 42 kept, 16 to run
    assert Counted.calls == [(2 * PREFILL_AFTER, 1)]
    torch.testing.assert_close(logits, target.share().prefill(longer)[None], atol=1e-5, rtol=0)


def test_an_interrupted_catch_up_leaves_the_cache_holding_what_it_kept():
    """A drafter's catch-up cut short (`Interrupted`: DSI restarting its drafter) leaves the model's cache at the
    positions it kept, and the DraftCache knows it: the next run catches up from there instead of prefilling the whole
    context again, to the logits of a fresh model."""
    from speculant.models.base import DraftCache, Interrupted

    target = tiny_model("llama", 4, VOCAB)
    model = target.share()
    cache, context = DraftCache(model), random_prompt(4, VOCAB, 30)
    cache.run(context)
    longer = context + random_prompt(5, VOCAB, 3)
    model.interrupt = lambda: True
    with pytest.raises(Interrupted):
        cache.run(longer)
    model.interrupt = None
    assert cache.ids == context and model.cache_len == len(context)
    assert cache.lag(longer) == 3
    torch.testing.assert_close(cache.run(longer), target.share().prefill(longer)[None], atol=1e-5, rtol=0)


def test_drafts_end_at_end_of_sequence_and_generation_at_the_last_position(caplog):
    target = tiny_model("llama", 3, VOCAB, init_std=0.1)
    prompt = random_prompt(3, VOCAB)
    free = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids
    eos = free[5]
    stopping = HFCausalLM(target.model, None, "eos", frozenset({eos}))
    first = free.index(eos)
    # The drafter (the same weights) stops its draft right after the end-of-sequence token.
    drafter = ModelDrafter(stopping.share(), SamplingConfig(), None)
    assert drafter.propose(prompt + free[:first], 8).tokens == [eos]
    result = generate(stopping, prompt_ids=prompt, drafter=stopping, k=8, max_new_tokens=12)
    assert result.token_ids == free[: first + 1] and sum(result.stats.draft_lengths) <= first + 1

    class Beyond(Drafter):  # drafts past an end-of-sequence token: the decoder verifies only up to it
        name = "beyond"

        def propose(self, context, k):
            done = len(context) - len(prompt)
            return Draft(free[done:done + k] + [0] * max(0, k - len(free[done:])), None)

        def observe(self, n):
            pass

    beyond = generate(stopping, prompt_ids=prompt, drafter=Beyond(), k=8, max_new_tokens=12)
    assert beyond.token_ids == free[: first + 1] and beyond.stats.draft_lengths[0] == first  # free[1 : first + 1]
    # The last position ends a generation; a prompt that fills every position is refused.
    short = HFCausalLM(target.model, None, "short")
    short.max_positions = len(prompt) + 5
    with caplog.at_level(logging.WARNING, logger="speculant"):
        assert len(generate(short, prompt_ids=prompt, drafter=short, k=4, max_new_tokens=50).token_ids) == 5
    assert f"at most 5 new tokens after this {len(prompt)}-token prompt, not 50" in caplog.text  # (said, not silent)
    short.max_positions = len(prompt)
    with pytest.raises(ConfigError, match="holds at most"):
        generate(short, prompt_ids=prompt, method="ar")


def test_common_prefix_len_is_the_index_of_the_first_difference():
    rng = random.Random(0)
    for _ in range(5000):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == common_prefix_len(bytes(a), bytes(b)) == first
