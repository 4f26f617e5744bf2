"""`auto`: per-step choice of drafter and draft length stays lossless (greedy and sampling), turns
speculation off when nothing pays, lets drafts grow when everything is accepted, and profiles a model
once per machine."""

import json
from dataclasses import asdict
import math
from collections import deque

import pytest

from helpers import (MarkovLM, ScriptedDrafter, byte_tokenizer, costs, invent, perturbed, random_prompt, tiny_model,
                     tiny_transformer)
from speculant import cli, generate, latency, load_model
from speculant.config import SamplingConfig
from speculant.decoding import adaptive as adaptive_module
from speculant.decoding.adaptive import (COST_FOLLOWS, LOOK_FIRST, PACE_FIRST, PACE_STEPS, PROBE_SHARE,
                                         REST_STEPS, SAFE_SHARE, SCALE_RANGE, TIME_FOLLOWS, Acceptance, AutoPolicy,
                                         Batched, Candidate, Rescaled, StepPlan, Timings, adaptive, best_length,
                                         can_pay, expected_remaining, first_children_accepted)
from speculant.decoding.run import timed
from speculant.decoding.step import Verified
from speculant.drafters.base import Draft, Drafter
from speculant.latency import LatencyProfile
from speculant.trees.tree import TokenTree
from speculant.models.wrappers.metered import Usage
from speculant.session import Session
from test_sampling import assert_follows_target, sampling_pair

VOCAB = 64


def run(target, candidates, prompt, n=40, cost=lambda w: 1.0 + 0.01 * w, **kwargs):
    tokens = []
    stats = yield_all(timed(adaptive(target, candidates, prompt, n, cost, SamplingConfig(), None, **kwargs), tokens))
    return tokens, stats


def scripted(seed, error_rate, step_s, n, **kwargs):
    """auto with one scripted drafter (see helpers.ScriptedDrafter) on a Markov target: (tokens, ar's tokens, stats)."""
    target = MarkovLM(VOCAB, seed)
    prompt = random_prompt(seed, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=n).token_ids
    drafter = ScriptedDrafter(prompt, reference, error_rate=error_rate, vocab=VOCAB, seed=0)
    tokens, stats = run(target, [Candidate("scripted", drafter, step_s, 0.6)], prompt, n=n, **kwargs)
    return tokens, reference, stats


def never_right(n: int):
    """A Markov target, a prompt, the target's `n` greedy tokens after it, and a drafter that never agrees with them."""
    target = MarkovLM(VOCAB, 1)
    prompt = random_prompt(1, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=n).token_ids
    return target, prompt, reference, ScriptedDrafter(prompt, reference, error_rate=1.0, vocab=VOCAB, seed=0)


def yield_all(decoder):
    while True:
        try:
            next(decoder)
        except StopIteration as stop:
            return stop.value


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_greedy_auto_equals_ar_whatever_it_chooses(arch, dtype, monkeypatch):
    used = set()
    for seed in range(2):
        target = load_model(tiny_transformer(arch, seed, VOCAB, init_std=0.1), dtype=dtype)
        prompt = random_prompt(seed, VOCAB, 6) * 3
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
        with monkeypatch.context() as patch:  # what auto learns of the machine's speed stays invented: it carries over
            invent(patch, costs(target))
            assert generate(target, prompt_ids=prompt, max_new_tokens=40).token_ids == expected  # the default method
        # chains only, with a drafter right often enough for a cascade; token trees, with one often wrong
        for widths, noise in (((), 0.1), ((2, 4), 0.3)):
            drafter = load_model(perturbed(target, noise, seed).model, dtype=dtype)
            drafter.name = f"drafter {noise}"  # auto learns of each apart
            with monkeypatch.context() as patch:
                invent(patch, costs(target))
                result = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter, "maxgram"],
                                  tree_widths=widths, max_new_tokens=40)
            assert result.token_ids == expected and result.stats.method == "auto"
            used.update(result.stats.choices)
    # The test exercised a chain, a tree and a cascade of a model drafter and a model-free or plain step.
    assert {"plain", "maxgram"} & used and {"drafter 0.1", "drafter 0.3"} & used
    assert {"drafter 0.1 cascade", "drafter 0.3 cascade"} & used
    assert {"drafter 0.3 tree2", "drafter 0.3 tree4"} & used


def test_the_chain_its_cascade_and_its_trees_prefill_the_prompt_once(monkeypatch):
    both = False
    for seed in range(4):
        target = load_model(tiny_transformer("llama", seed, VOCAB, init_std=0.1))
        drafter = load_model(perturbed(target, 0.3, seed).model)
        prefills, prefill = [], drafter.prefill
        monkeypatch.setattr(drafter, "prefill", lambda ids: prefills.append(len(ids)) or prefill(ids))
        invent(monkeypatch, costs(target))
        prompt = random_prompt(seed, VOCAB, 6) * 3
        choices = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter, "maxgram"], tree_widths=(2,),
                           max_new_tokens=40).stats.choices
        used = any(c.startswith(drafter.name) for c in choices)
        assert len(prefills) == used, choices  # one cache: whichever drafts next catches up from the last
        both = both or len({c for c in choices if c.startswith(drafter.name)}) >= 2  # two of chain, cascade, tree
    assert both


def test_a_served_row_sees_the_batch_s_cost_at_the_load_of_the_moment():
    """One of n batched rows, all taken to draft alike: T(n * W) scaled so that plain decoding costs T(1); after
    the context's cached tokens, as the drafters' costs are (it was T(W) at the profile's context, whatever the
    context)."""
    profile = lambda w: 0.03 + 0.005 * max(w - 4, 0)  # noqa: E731 - flat up to 4 rows, then compute-bound
    rows = [1]
    cost = Batched(Rescaled(lambda w, length: profile(w)), lambda: rows[0])
    assert cost(1) == profile(1) and cost(4) == profile(4)
    rows[0] = 4
    assert cost(1) == profile(1) and cost(4) == pytest.approx(profile(16) * profile(1) / profile(4))
    rows[0] = 1  # the load falls: the values of the moment, not those first asked for
    assert cost(4) == profile(4)
    measured = LatencyProfile("m", "", "cpu", 256, 0.256, 0.01, {1: 0.01, 4: 0.012}, 2048, 3.84, {1: 0.0125, 4: 0.018})
    served = Batched(Rescaled(measured.cost_at), lambda: 1)
    short = served(4)
    served.length = 2048
    assert short == pytest.approx(0.012) and served(4) == pytest.approx(0.018)


def test_under_load_a_served_drafter_that_could_not_pay_even_if_always_right_is_neither_weighed_nor_probed():
    """At 16 rows a compute-bound batch verifying 2 tokens a row costs twice a plain one: a drafter that is
    always right at a fifth of a forward cannot pay, and auto neither weighs it nor probes it; at 1 row it pays.
    The verdict follows the load of the moment."""
    target = MarkovLM(VOCAB, 2)
    prompt = random_prompt(2, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    profile = lambda w: 0.03 + 0.005 * max(w - 4, 0)  # noqa: E731 - flat up to 4 rows, then compute-bound
    rows, proposed = [16], []
    for load, drafts in ((16, False), (1, True)):
        rows[0] = load
        drafter = ScriptedDrafter(prompt, reference, error_rate=0.0, vocab=VOCAB, seed=0)
        propose = drafter.propose
        drafter.propose = lambda context, k: proposed.append(k) or propose(context, k)
        candidate = Candidate("perfect", drafter, 0.006, 0.9, load=lambda: rows[0])
        proposed.clear()
        tokens, stats = run(target, [candidate], prompt, n=30, cost=Batched(Rescaled(lambda w, length: profile(w)), lambda: rows[0]))
        assert tokens == reference
        assert bool(proposed) == drafts and (set(stats.choices) == {"plain"}) != drafts, stats.choices
        assert candidate.hopeless(Batched(Rescaled(lambda w, length: profile(w)), lambda: rows[0]), 16) != drafts
    rows[0] = 16
    assert candidate.hopeless(Batched(Rescaled(lambda w, length: profile(w)), lambda: rows[0]), 16)


def test_the_verdict_under_load_is_remembered_by_load_not_by_each_step_s_drift():
    """A served model drafter's verdict under load is kept per load (and draft length, context bucket): its cost per
    step drifts a little every step, and a memo keyed by that cost grew by an entry a step for as long as the server
    ran. The verdict still follows the drift across the break-even cost."""
    from speculant.decoding.adaptive import break_even

    profile = lambda w: 0.03 + 0.005 * max(w - 4, 0)  # noqa: E731
    cost = Batched(Rescaled(lambda w, length: profile(w)), lambda: 16)
    edge = break_even(cost, 16)
    assert 0 < edge < 0.03 and can_pay(0.999 * edge, cost, 16) and not can_pay(edge, cost, 16)
    candidate = Candidate("drifting", None, edge, 0.9, load=lambda: 16)
    for step in range(1000):
        candidate.speed.value = 1 + (step % 50 - 25) / 1000  # its drift, around the break-even cost
        assert candidate.hopeless(cost, 16) == (candidate.speed.value >= 1)
    assert len(candidate.break_evens) == 1


def test_a_drafter_that_could_not_pay_even_if_always_right_is_never_tried(monkeypatch):
    """Where verification costs as much per token as decoding (ggml on 2 cores), a model drafter whose
    step costs half a target forward cannot pay however often it agrees: auto never runs it."""
    linear = lambda w: 0.06 * w  # noqa: E731
    assert not can_pay(0.0, linear, 8) and can_pay(0.0, lambda w: 0.06 + 0.01 * w, 8)
    assert can_pay(0.01, lambda w: 0.06 + 0.001 * w, 8) and not can_pay(0.03, lambda w: 0.01 + 0.05 * w, 16)
    target = load_model(tiny_transformer("llama", 0, VOCAB, init_std=0.1))
    drafter = target.share()  # agrees with the target every time
    prompt = random_prompt(0, VOCAB)

    def profile(model, *args, **kwargs):
        step = 1.0 if model is target else 0.5
        return LatencyProfile(model.name, "", "cpu", 256, step, step, {1: step, 16: 16 * step})

    invent(monkeypatch, profile)
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter], max_new_tokens=20)
    assert set(result.stats.choices) == {"plain"} and not result.stats.drafter_forwards
    invent(monkeypatch, costs(target))  # flat verification (a machine profiled anew: a new session): it pays
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter], max_new_tokens=20,
                      session=Session(target))
    assert any(choice.startswith(drafter.name) for choice in result.stats.choices)


def test_a_drafter_that_never_agrees_is_turned_off_and_probed_again():
    tokens, reference, stats = scripted(1, error_rate=1.0, step_s=0.1, n=100, probe_every=4)
    assert tokens == reference
    assert stats.choices.count("plain") > 0.75 * len(stats.choices)
    # After the estimates fall, the drafter returns only as a probe after 4 plain steps in a row, then 8, 16...
    runs, current = [], 0
    for choice in stats.choices[5:]:
        if choice == "plain":
            current += 1
        else:
            runs.append(current)
            current = 0
    assert len(runs) >= 3 and all(later == 2 * earlier for earlier, later in zip(runs[1:], runs[2:]))


def test_probes_that_bring_nothing_back_cost_at_most_a_tenth_of_plain_decoding():
    """Where no drafter pays, probing costs at most PROBE_SHARE of the generation's plain time in all: on a GPU a
    probe's catch-up weighs as much as many 3 ms steps (CHANGELOG.md: auto was 0.84x ar on an H100)."""
    target, prompt, reference, drafter = never_right(200)
    # each probe: a 6 s catch-up, two 0.5 s drafting steps and a 3-token verification at T(W) = 1 + 0.01 W
    candidate = Candidate("scripted", drafter, 0.5, 0.1, catch_up=lambda context: 6.0)
    tokens, stats = run(target, [candidate], prompt, n=200)
    assert tokens == reference
    price, plain = 6.0 + 2 * 0.5 + 0.02, 200 * 1.01
    probes = stats.choices.count("scripted")
    assert probes >= 1 and probes * price <= PROBE_SHARE * plain  # 2; one at each of steps 0, 16, 48, 112 before


def test_a_drafter_that_texts_have_shown_never_right_is_hardly_probed():
    """Probes are budgeted by the drafter's long-run acceptance (`Acceptance.promise`): after generations in which it
    was never right, a new one probes it far less than the first did (auto must not lose to `ar` on a GPU, where
    a probe's catch-up weighs as much as many plain steps)."""
    target, prompt, reference, drafter = never_right(200)
    candidate = Candidate("scripted", drafter, 0.5, 0.6, catch_up=lambda context: 2.0)
    probes = []
    for _ in range(6):
        tokens, stats = run(target, [candidate], prompt, n=200)
        assert tokens == reference
        probes.append(stats.choices.count("scripted"))
    assert candidate.acceptance().promise() < 0.3
    assert probes[0] >= 3 and probes[-1] <= 1, probes


def test_the_governor_reads_plain_steps_sooner_than_drafting_ones():
    """Plain steps that took over PACE_HOST times their own forwards (beyond the forward: auto's choosing) stop auto's
    choosing after PACE_FIRST in a row, whatever T(1) is estimated at; plain steps a few percent slower (a CPU's
    choosing) and steps that drafted and accepted nothing, as slow per token (their acceptance varies more than a
    step's time), wait for the whole window of PACE_STEPS; steps within PACE_MARGIN never stop it. A draft ends a
    plain run, also one left out of the pace (a drafter's catch-up on the prompt)."""
    free = Candidate("free", None, 0.0, 0.5, match=lambda context: 0)

    def every(n: int, draft: StepPlan):  # a draft every n-th step, plain steps between
        return lambda step: draft if step % n == 0 else StepPlan(None)

    plain, drafting, catch_up = StepPlan(None), StepPlan(free, 2), StepPlan(free, 2, behind=100)
    cases = [(lambda step: plain, 1.10, 1.0, PACE_FIRST), (lambda step: plain, 1.10, 8.0, PACE_FIRST),
             (lambda step: plain, 1.03, 1.0, PACE_STEPS), (lambda step: plain, 1.01, 1.0, None),
             (lambda step: drafting, 1.10, 1.0, PACE_STEPS), (every(8, drafting), 1.10, 1.0, PACE_STEPS),
             (lambda step: catch_up if step == 5 else plain, 1.10, 1.0, 5 + PACE_FIRST)]
    for plan_at, slower, profiled, fired in cases:
        cost = Rescaled(lambda width, length: profiled)  # (a profile of 8 s: T(1) estimated at its clip, 2 s)
        cost.observe(1, 1.0)  # (a plain step timed: T(1) known)
        policy = AutoPolicy([free], cost, 1000)
        for steps in range(1, 2 * PACE_STEPS + 1):
            plan = plan_at(steps)
            draft = Draft([] if plan.candidate is None else [1, 2])
            policy.observe(plan, draft, Verified([], 0, len(draft.tokens), 1 + len(draft.tokens)), 1.0, True)
            policy.pace(plan, slower, 1)
            if policy.governed:
                break
        assert (steps if policy.governed else None) == fired, (slower, profiled, fired)


def test_auto_that_falls_behind_plain_decoding_decodes_plainly(monkeypatch):
    """Work no estimate sees (here a model-free drafter whose lookup takes three forwards' time and never
    matches) shows in auto's own pace: after PACE_FIRST plain steps over PACE_HOST times their own forwards, it stops
    choosing."""
    import time

    target = tiny_model("llama", 2, VOCAB, init_std=0.1)
    prompt = random_prompt(2, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=120).token_ids
    target.prefill(prompt)
    began = time.perf_counter()
    for _ in range(20):
        target.forward([1])
    step = (time.perf_counter() - began) / 20
    lookups = []

    def slow_match(context):
        lookups.append(len(context))
        time.sleep(3 * step)
        return 0

    candidate = Candidate("slow", None, 0.0, 0.0, match=slow_match)
    tokens, stats = run(target, [candidate], prompt, n=120, cost=Rescaled(lambda width, length: step))
    assert tokens == reference
    assert PACE_FIRST <= len(lookups) <= PACE_FIRST + 2  # 119 steps without the governor
    tokens, stats = run(target, [candidate], prompt, n=120, cost=lambda width: step)  # no measured seconds: off
    assert len(lookups) > 100


def test_a_named_drafter_keeps_its_cache_for_the_next_generation(monkeypatch, tmp_path):
    target = load_model(tiny_transformer("llama", 5, VOCAB, init_std=0.1))
    perturbed(target, 0.05, 5).model.save_pretrained(tmp_path / "drafter")
    invent(monkeypatch, costs(target))
    prompt = random_prompt(5, VOCAB, 6) * 3
    first = generate(target, prompt_ids=prompt, method="auto", drafters=[str(tmp_path / "drafter")],
                     max_new_tokens=20)
    (drafter,) = Session.of(target).drafters.values()
    prefills, prefill = [], drafter.prefill
    monkeypatch.setattr(drafter, "prefill", lambda ids: prefills.append(len(ids)) or prefill(ids))
    turn = prompt + first.token_ids + random_prompt(6, VOCAB, 4)  # the conversation's next turn
    second = generate(target, prompt_ids=turn, method="auto", drafters=[str(tmp_path / "drafter")], max_new_tokens=20)
    assert second.token_ids == generate(target, prompt_ids=turn, method="ar", max_new_tokens=20).token_ids
    assert any(c != "plain" for c in second.stats.choices) and prefills == []  # it drafted, catching up only


def test_a_prefill_is_risked_only_where_generations_run_long_enough_to_repay_it():
    assert expected_remaining([], 10, 100) == 90  # no history: the whole budget
    assert expected_remaining([20, 40, 500], 30, 100) == (10 + 70) / 2  # those that got past 30, cut at 100
    assert expected_remaining([20], 30, 100) == 70  # outlived them all
    assert expected_remaining([math.inf, 20], 10, 100) == (90 + 10) / 2  # one ran to its budget: it could go on
    lengths = [20, 25, 30, math.inf, math.inf, math.inf, math.inf, math.inf, math.inf]
    assert expected_remaining(lengths, 10, 100, 0.25) == 20 < expected_remaining(lengths, 10, 100)  # the short ones
    assert expected_remaining(lengths, 40, 100, 0.25) == 60  # past them: the long ones are left
    target = MarkovLM(VOCAB, 3)
    prompt = random_prompt(3, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=100).token_ids

    def first_choice(lengths):  # an unpromising drafter whose cache lags by a prefill of 4 plain steps (T(1) = 1 s)
        drafter = ScriptedDrafter(prompt, reference, error_rate=0.0, vocab=VOCAB, seed=0)
        candidate = Candidate("scripted", drafter, 0.1, 0.1, catch_up=lambda context: 4.0)
        history = deque(lengths)
        tokens, stats = run(target, [candidate], prompt, n=100, lengths=history)
        assert tokens == reference and list(history) == [*lengths, math.inf]  # it ran to its budget
        return stats.choices[0]

    assert first_choice([]) == "scripted"  # 100 tokens to come: a probe may spend 10 s on catching up
    assert first_choice([10, 20]) == "plain"  # replies of 15 tokens: a 4 s prefill would not pay back


def test_a_safe_catch_up_waits_until_the_reply_could_repay_it():
    """catch_up="safe": a model drafter whose catch-up costs more than SAFE_SHARE of the plain time of the reply so
    far (and the step to come) waits, so that a reply ending early is never slowed by more than that; by default the
    catch-up is paid at once where the replies seen so far (none here: the whole budget) would repay it."""
    target = MarkovLM(VOCAB, 3)
    prompt = random_prompt(3, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=100).token_ids

    def choices(catch_up):  # a drafter always right, whose catch-up costs two plain steps (T(1) = 1.01 s)
        candidate = Candidate("scripted", ScriptedDrafter(prompt, reference, 0.0, VOCAB, 0), 0.1, 0.9,
                              catch_up=lambda context: 2.0)
        tokens, stats = run(target, [candidate], prompt, n=100, catch_up=catch_up)
        assert tokens == reference
        return stats.choices

    assert choices("expected")[0] == "scripted"
    safe = choices("safe")
    first = safe.index("scripted")  # step i follows i + 1 plain tokens
    assert set(safe[:first]) == {"plain"} and first + 1 < 2.0 / (SAFE_SHARE * 1.01) <= first + 2


def test_a_large_catch_up_waits_to_see_what_free_drafts_commit():
    """A model drafter whose catch-up costs more than PROBE_SHARE of the generation's plain time joins only after
    LOOK_FIRST steps; where model-free drafts (Max-Gram copying an article into its summary) have committed most
    of the text by then, the catch-up is weighed against the few tokens they leave it, and is not paid."""
    target = MarkovLM(VOCAB, 4)
    prompt = random_prompt(4, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=100).token_ids

    def choices(copied):  # the free drafter matches (and is right) while fewer than `copied` tokens are out
        model = Candidate("model", ScriptedDrafter(prompt, reference, 0.0, VOCAB, 0), 0.1, 0.9,
                          catch_up=lambda context: 15.0)  # T(1) = 1.01 s: 15% of 100 plain steps
        free = Candidate("maxgram", ScriptedDrafter(prompt, reference, 0.0, VOCAB, 1), 0.0, 0.0,
                         match=lambda context: 20 if len(context) - len(prompt) < copied else 0)
        tokens, stats = run(target, [model, free], prompt, n=100)
        assert tokens == reference
        return stats.choices

    alone = choices(0)
    assert alone[:LOOK_FIRST] == ["plain"] * LOOK_FIRST and alone[LOOK_FIRST] == "model"
    summary = choices(60)
    assert summary[0] == "maxgram" and "model" not in summary


def test_drafts_grow_while_everything_is_accepted():
    tokens, reference, stats = scripted(2, error_rate=0.0, step_s=0.05, n=150, k_max=12)
    assert tokens == reference and "plain" not in stats.choices[:-1]  # (the last step may have one token left)
    assert stats.draft_lengths[0] < 12 and max(stats.draft_lengths) == 12 and stats.acceptance_rate == 1.0


def test_a_drafter_is_weighed_only_at_lengths_it_could_be_accepted_at():
    """`best_length` prices the draft lengths whose last position has at least a `NEGLIGIBLE` chance: a drafter that
    is never right costs one or two of T(W)'s lookups a step, not k_max (host time a GPU's few-ms step feels)."""
    widths = []
    cost = lambda width: widths.append(width) or 0.05  # noqa: E731
    assert best_length(Acceptance(prior=0.01), 0.01, cost, 16)[1] == 1 and widths == [2]
    widths.clear()
    best_length(Acceptance(prior=0.9), 0.01, cost, 16)
    assert widths == list(range(2, 18))


def test_a_drafter_that_lost_to_plain_decoding_rests_before_it_is_weighed_again(monkeypatch):
    """Weighing a model candidate at every step is host time a GPU's few-ms step feels: one that lost to plain
    decoding is weighed again `REST_STEPS` steps later, or at the step after a model draft (here the probe that starts
    the generation). With a rest of one step it is weighed at every step, as before there was a rest."""
    at_step, weighed = [], []
    choose, weigh = AutoPolicy.choose, adaptive_module.best_length

    def choosing(policy, *args):
        at_step.append(policy.steps)
        return choose(policy, *args)

    def weighing(*args, **kwargs):
        weighed.append(at_step[-1])
        return weigh(*args, **kwargs)

    monkeypatch.setattr(AutoPolicy, "choose", choosing)
    monkeypatch.setattr(adaptive_module, "best_length", weighing)
    target, prompt, reference, drafter = never_right(60)
    for rest in (REST_STEPS, 1):
        monkeypatch.setattr(adaptive_module, "REST_STEPS", rest)
        weighed.clear()
        tokens, stats = run(target, [Candidate("scripted", drafter, 0.5, 0.1)], prompt, n=60, probe_every=1000)
        assert tokens == reference
        assert stats.choices[0] == "scripted" and set(stats.choices[1:]) == {"plain"}  # the probe, then plain
        last = len(stats.choices) - 1  # (the last step has no room to draft: nothing is weighed)
        assert weighed == [0, *range(1, last, rest)], (rest, weighed)


def test_a_drafter_pays_its_catch_up_only_where_enough_tokens_remain_to_share_it():
    """A drafter whose cache lags the context first runs what it lacks: that time is shared by the tokens
    left to generate, so catching up on a long prompt pays for a long generation and not for a short one."""
    flat = lambda width: 0.05  # noqa: E731  T(W) = 50 ms at every width: plain decoding makes 20 tokens/s
    estimate = Acceptance(prior=0.8)
    synced, _ = best_length(estimate, 0.01, flat, 8)
    short, _ = best_length(estimate, 0.01, flat, 8, catch_up_s=1.0, remaining=10)
    long, _ = best_length(estimate, 0.01, flat, 8, catch_up_s=1.0, remaining=2000)
    assert synced > long > 20 > short
    candidate = Candidate("lagging", None, 0.01, 0.8, catch_up=lambda context: 0.001 * len(context))
    assert candidate.catch_up_s(list(range(500))) == pytest.approx(0.5)
    assert Candidate("synced", None, 0.01, 0.8).catch_up_s(list(range(500))) == 0.0


def test_costs_follow_what_the_machine_takes_now_not_only_its_profile():
    """A machine profile is measured once; a shared machine then runs slower or faster by tens of percent:
    auto rescales the profile by what verifications and drafts measure, within SCALE_RANGE (a spike is
    drift, not a new machine)."""
    timing = Rescaled(lambda width, length: 0.01 * width)
    assert timing(3) == pytest.approx(0.03)  # nothing measured: the profile
    timing.observe(1, 0.02)
    assert timing(1) == pytest.approx(0.02) and timing(3) == pytest.approx(0.06)  # the machine runs at half speed
    timing.observe(4, 0.04)  # as profiled: the machine's speed moves by TIME_FOLLOWS, width 4 keeps the rest
    speed = 2 + TIME_FOLLOWS * (1 - 2)
    assert timing.timings.speed.value == pytest.approx(speed)
    assert timing(4) == pytest.approx(0.04) and timing(1) == pytest.approx(0.01 * speed)
    timing.observe(1, 1.0)  # 100x the profile: taken as 2x
    assert timing.timings.speed.value == pytest.approx(speed + TIME_FOLLOWS * (SCALE_RANGE[1] - speed))

    candidate = Candidate("model", None, 0.01, 0.6, catch_up=lambda context: 0.1)
    candidate.observe_cost({"model": Usage(4, 4, 0.4)}, steps=4, lag=30)  # began by catching up: no step's cost
    assert candidate.cost_s == pytest.approx(0.01) and candidate.catch_up_s([1]) == pytest.approx(0.1)
    candidate.observe_cost({"model": Usage(3, 3, 0.045)}, steps=3, lag=1)
    assert candidate.cost_s == pytest.approx(0.015) and candidate.catch_up_s([1]) == pytest.approx(0.15)

    cascade = Candidate("cascade", None, 0.01, 0.6, measured=True)  # follows what its drafts cost, spikes clipped
    cascade.observe_cost({"model": Usage(1, 1, 0.015)}, steps=1, lag=0)
    assert cascade.cost_s == pytest.approx(0.01 + COST_FOLLOWS * 0.005)
    cascade.observe_cost({"model": Usage(1, 1, 5.0)}, steps=1, lag=0)  # a stall: taken as twice its cost
    assert cascade.cost_s == pytest.approx(0.011 * (1 + COST_FOLLOWS * (SCALE_RANGE[1] - 1)))


def test_a_drafter_follows_the_machine_while_it_does_not_draft():
    """Drift is mostly the machine's, shared by the target and its drafters: a drafter timed while the machine
    ran slowly is not taken to stay slow once the target's forwards show the machine fast again (else a drafter
    that looked dear stops drafting, and nothing ever measures it again)."""
    timings = Timings()
    candidate = Candidate("model", None, 0.01, 0.6, catch_up=lambda context: 0.1, speed=timings.speed)
    for _ in range(30):
        timings.observe(1, 0.2, lambda width: 0.1)  # the machine runs at half its profiled speed
    candidate.observe_cost({"model": Usage(3, 3, 0.06)}, steps=3, lag=1)  # and so does the drafter
    assert candidate.cost_s == pytest.approx(0.02) and candidate.scale.value == pytest.approx(1.0, rel=0.01)
    for _ in range(30):
        timings.observe(1, 0.1, lambda width: 0.1)  # back to its profiled speed; the drafter does not run meanwhile
    assert candidate.cost_s == pytest.approx(0.01, rel=0.01)
    assert candidate.catch_up_s([1]) == pytest.approx(0.1, rel=0.01)


def test_a_plain_step_left_unmeasured_in_a_slow_stretch_does_not_stay_dear():
    """A drafter that is never right, drafting one token a step, verifies width 2 only. Width 1 was last timed as
    the machine slowed, before `speed` had followed, so its own ratio kept the rest of the slowdown; once the machine
    is fast again, only width 2 shows it. T(1) is then read as no dearer than T(2) (a forward of fewer tokens never
    costs more), and plain decoding, the step that pays, is chosen again (else the draft kept being chosen, T(1) never
    timed again, and the governor compared auto's pace with the stale T(1)). The cap is on what is read: width 1's
    own ratio is left as it was, for its next timing to correct."""
    timing = Rescaled(lambda width, length: 0.1 * (1 + 0.1 * (width - 1)))
    for _ in range(30):
        timing.observe(1, 0.1)  # as profiled
    for _ in range(3):
        timing.observe(1, 0.2)  # the machine slows down
    stale = timing.timings.scales[1].value
    assert timing(1) > 0.12
    for _ in range(60):
        timing.observe(2, 0.11)  # fast again; a one-token draft every step
    assert timing(1) == pytest.approx(timing(2)) and timing(2) == pytest.approx(0.11, rel=1e-3)
    assert timing.timings.scales[1].value == stale

    target, prompt, reference, drafter = never_right(8)
    candidate = Candidate("never right", drafter, 0.02, 0.6)
    for _ in range(60):
        candidate.acceptance().observe(1, 0)
    policy = AutoPolicy([candidate], timing, max_new_tokens=64)
    policy.without_model = 0  # (no probe due: the choice alone)
    assert policy.choose(prompt + reference[:4], 4, frozenset()).candidate is None
    timing.observe(1, 0.1)  # timed again: its own ratio follows, no ceiling
    assert timing.timings.plain_ceiling == math.inf


def test_auto_measures_every_verification_and_draft():
    seed, n = 3, 40
    target = MarkovLM(VOCAB, seed)
    prompt = random_prompt(seed, VOCAB)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=n).token_ids

    class Timed(ScriptedDrafter):  # says each step took 1.5x its profiled 50 ms
        def propose(self, context, k):
            draft = super().propose(context, k)
            return Draft(draft.tokens, None, {"scripted": Usage(k, k, 0.075 * k)})

    drafter = Timed(prompt, reference, error_rate=0.3, vocab=VOCAB, seed=0)
    candidate = Candidate("scripted", drafter, 0.05, 0.6)
    timing = Rescaled(lambda width, length: 1.0 + 0.01 * width)
    tokens, stats = run(target, [candidate], prompt, n=n, cost=timing)
    assert tokens == reference
    verified = {1 + drafted for drafted in stats.draft_lengths}
    assert set(timing.timings.widths) == verified and candidate.scale.value == pytest.approx(1.5)


def test_acceptance_estimates_follow_what_is_observed():
    estimate = Acceptance(prior=0.6)
    assert estimate.expected_tokens(2) == pytest.approx([1, 1 + 0.6, 1 + 0.6 + 0.36])
    for _ in range(30):
        estimate.observe(drafted=4, n_accepted=1)  # the first token accepted, the second rejected
    assert estimate.rate(0) > 0.9 and estimate.rate(1) < 0.25 and estimate.rate(5) == estimate.rate(1)


def test_one_rejection_of_a_deeper_position_does_not_hold_drafts_short():
    """A probe's second token rejected once, early: later one-token drafts that are always accepted never show
    the second position again, so its estimate starts from the first position's, and drafts grow."""
    estimate = Acceptance(prior=0.6)
    estimate.observe(drafted=2, n_accepted=1)
    estimate.restart(4)  # a new text
    for _ in range(20):
        estimate.observe(drafted=1, n_accepted=1)
    assert estimate.rate(1) > 0.6 and estimate.rate(3) == estimate.rate(2)
    flat = lambda width: 0.034  # noqa: E731
    assert best_length(estimate, 0.01, flat, 8)[1] >= 2


def test_a_new_text_starts_from_the_long_run_acceptance_not_the_last_texts_end():
    estimate = Acceptance(prior=0.6)
    for _ in range(300):
        estimate.observe(drafted=2, n_accepted=2)
    for _ in range(20):
        estimate.observe(drafted=2, n_accepted=0)  # the last text ended where the drafter was wrong
    assert estimate.rate(0) < 0.4
    estimate.restart(4)
    assert estimate.rate(0) > 0.75
    for _ in range(10):
        estimate.observe(drafted=2, n_accepted=0)  # the new text is like that ending: soon followed
    assert estimate.rate(0) < 0.4


def test_a_verified_tree_tells_how_its_chain_would_have_fared():
    """A greedy tree's first children are the chain its drafter would have drafted: root 0 -> 1 (10) -> 3 (30)
    -> 5 (50), beside 2 (20) -> 4 (40)."""
    tree = TokenTree((0, 10, 20, 30, 40, 50), (-1, 0, 0, 1, 2, 3))
    assert first_children_accepted(tree, [10, 30, 50, 7]) == (3, 3)
    assert first_children_accepted(tree, [10, 31]) == (3, 1)
    assert first_children_accepted(tree, [20, 40, 9]) == (3, 0)  # the tree's second branch: the chain failed
    assert first_children_accepted(TokenTree((0,), (-1,)), [5]) == (0, 0)


def test_auto_keeps_a_chains_estimates_current_while_its_tree_drafts(monkeypatch):
    target, drafter, prompt = sampling_pair()
    candidates = []
    original = adaptive_module.adaptive

    def recorded(target, given, *args, **kwargs):
        candidates.extend(given)
        return original(target, [c for c in given if c.width > 1], *args, **kwargs)  # only the tree drafts

    monkeypatch.setattr(adaptive_module, "adaptive", recorded)
    invent(monkeypatch, costs(target))
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
    result = generate(target, prompt_ids=prompt, method="auto", max_new_tokens=24, drafters=[drafter])
    assert result.token_ids == reference and any(choice.endswith("tree2") for choice in result.stats.choices)
    tree = next(c for c in candidates if c.width > 1)
    assert tree.chain is not None and tree.chain.acceptance().reached  # observed, though the chain never drafted


@pytest.mark.parametrize("widths", [(), (2,)])
def test_auto_sampling_follows_the_target(widths, monkeypatch):
    target, drafter, prompt = sampling_pair()
    invent(monkeypatch, costs(target))
    assert_follows_target(target, prompt, method="auto", drafters=[drafter, "maxgram"], tree_widths=widths)


def test_a_model_is_profiled_once_per_machine_with_a_progress_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    model = tiny_transformer("llama", 0, 257)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    argv = ["generate", "def f(x):", "--target", str(tmp_path / "m"), "--dtype", "fp32", "--max-new-tokens", "8"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().err
    assert "profiling" in first and "once on this machine" in first and "auto:" in first
    assert cli.main(argv) == 0
    assert "profiling" not in capsys.readouterr().err
    profiles = json.loads((tmp_path / "cache" / "machine" / latency.MACHINE_PROFILES).read_text())
    assert len(profiles) == 1 and set(next(iter(profiles.values()))["forward_s"]) == {str(w) for w in latency.MACHINE_WIDTHS}
    assert cli.main(["profile", "--model", str(tmp_path / "m"), "--dtype", "fp32"]) == 0
    assert "T(W)" in capsys.readouterr().out


def test_verification_cost_follows_the_cached_length():
    """T(W, L) from T(W) at 256 and at 2048 cached tokens: linear in L (attention), the nearest measured width's
    growth for the others, never below T(W) at 256; a prefill grows as a n + b n^2 through both prefills (a line
    through both where a token costs less in the longer one); `Rescaled`
    asks the profile at the length the policy set."""
    profile = LatencyProfile("m", "", "cpu", 256, 0.256, 0.01, {1: 0.01, 4: 0.012, 16: 0.02},
                             2048, 2.56 * 1.5, {1: 0.0125, 4: 0.018})
    assert profile.cost_at(1, 100) == profile.cost_at(1, 256) == 0.01
    assert profile.cost_at(1, 2048) == pytest.approx(0.0125) and profile.cost_at(4, 2048) == pytest.approx(0.018)
    assert profile.cost_at(4, 1152) == pytest.approx(0.012 * 1.25)  # halfway: half the growth
    assert profile.cost_at(16, 2048) == pytest.approx(0.02 * 1.5)  # width 4's growth, the nearest measured
    assert profile.prefill_s(256) == pytest.approx(0.256) and profile.prefill_s(2048) == pytest.approx(3.84)
    assert profile.prefill_s(4096) > 2 * profile.prefill_s(2048)  # superlinear
    gpu = LatencyProfile("m", "", "cuda", 256, 0.01, 0.003, {1: 0.003}, 2048, 0.04, {1: 0.004})  # a call's own cost
    assert gpu.prefill_s(256) == pytest.approx(0.01) and gpu.prefill_s(2048) == pytest.approx(0.04)
    flat = LatencyProfile("m", "", "cpu", 256, 0.256, 0.01, {1: 0.01, 4: 0.012})
    assert flat.cost_at(4, 3000) == 0.012 and flat.prefill_s(512) == pytest.approx(0.512)
    cost = Rescaled(profile.cost_at)
    cost.length = 2048
    assert cost(4) == pytest.approx(0.018)

    drafter = Candidate("d", None, 0.004, 0.5, growth=lambda length: profile.cost_at(1, length) / profile.cost(1))
    assert drafter.cost_s == pytest.approx(0.004)  # before the policy set a length: as profiled
    drafter.length = 2048
    assert drafter.cost_s == pytest.approx(0.004 * 1.25)  # a drafting step grows with the context as its T(1) does
    assert LatencyProfile.from_dict(json.loads(json.dumps(asdict(profile)))) == profile


def test_a_cache_catches_up_by_a_prefill_where_its_profile_says_that_is_sooner():
    """`LatencyProfile.prefills`: a prefill of the whole context where it costs less than a catch-up's rows, whose
    attention grows with the keys they read, however much is kept; where a model was never profiled the fixed rule
    (`models.base.prefills`) would run a long catch-up after a kept prefix as rows. A DraftCache runs the rule it
    holds, and auto prices the way it runs."""
    from speculant.methods.auto import catch_up_cost
    from speculant.models.base import DraftCache, prefills

    # the lean 0.5B on the AVX2 EPYC: T(W) after 256 and 2048 cached tokens, prefills of 256 and 2048, a catch-up
    # of 255 rows (s); measured there (scripts/catch_up_prefill.py --lags): after 6 kept, a catch-up of 100 is
    # cheaper than a prefill, of 1000 dearer; after 300 kept, of 300 cheaper, of 1500 dearer
    profile = LatencyProfile("0.5b", "", "cpu", 256, 1.223, 0.018, {1: 0.0183, 4: 0.0312, 8: 0.0517, 16: 0.0725},
                             2048, 10.82, {1: 0.025, 4: 0.0579, 8: 0.0992, 16: 0.1945}, catch_up_rows_s=0.946)
    assert not profile.prefills(6, 100) and profile.prefills(6, 1000) and prefills(6, 100)  # (the fixed rule)
    assert not profile.prefills(300, 300) and profile.prefills(300, 1500) and not prefills(300, 1500)
    assert not profile.prefills(1500, 40) and not profile.prefills(300, 2) and not profile.prefills(10, 0)
    assert profile.catch_up_s(6, 16) == profile.cost_at(16, 14) and profile.catch_up_s(6, 0) == 0.0
    assert profile.catch_up_s(0, 255) == pytest.approx(0.946) and profile.catch_up_s(0, 510) > 2 * 0.946  # attention
    flat = LatencyProfile("gpu", "", "cuda", 256, 0.004, 0.002, {1: 0.002, 16: 0.0022})  # a 256-token prefill: 2 steps
    assert not flat.prefills(40, 5) and flat.prefills(0, 600)  # a short prefill is no cheaper than 16 rows
    model = tiny_model("llama", 3, VOCAB)
    ran = []
    for name in ("prefill", "catch_up"):
        def spy(*args, run=getattr(model, name), name=name, **kwargs):
            ran.append(name)
            return run(*args, **kwargs)
        setattr(model, name, spy)
    context = random_prompt(5, VOCAB, 40)
    for rule, way in ((lambda keep, lag: True, "prefill"), (lambda keep, lag: False, "catch_up")):
        cache = DraftCache(model)
        cache.run(context[:30])
        ran.clear()
        cache.prefills = rule
        cache.run(context)
        assert ran[0] == way and ("prefill" in ran) == (way == "prefill")  # (a prefill may run catch_up within)

    long = list(range(1700))

    class Lagging(Drafter):  # a model drafter 1500 tokens behind, 200 kept
        def __init__(self, rule):
            self.cache, self.model = DraftCache(model), model
            self.cache.prefills, self.cache.ids = rule, long[:200]

    assert catch_up_cost(Lagging(profile.prefills), profile)(long) == pytest.approx(profile.prefill_s(1700))
    assert catch_up_cost(Lagging(prefills), profile)(long) == pytest.approx(profile.cost(1500))  # (a forward's rows)
    assert profile.prefill_s(1700) < profile.catch_up_s(200, 1500)
    old = LatencyProfile.from_dict({k: v for k, v in asdict(profile).items() if k != "catch_up_rows_s"})
    assert old.catch_up_s(6, 100) == old.cost_at(100, 56)  # (a profile without the catch-up measured)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_auto_with_stage_scheduling_keeps_the_output_and_uses_trees_drafted_ahead(arch, monkeypatch):
    """`auto:schedule=stage`: where auto drafts a token tree, the next one is drafted during its verification and
    taken where auto chooses that tree again after exactly the committed context, else dropped. Greedy output
    equals `ar`'s (Mistral with a window of 6, on the static backend); with the target drafting for itself, trees
    drafted ahead are used. Auto's choices are made here: trees of depth 3 on most steps, its own on others."""
    from test_static import static, transformer

    target = static(transformer(arch, 3)) if arch == "mistral" else tiny_model(arch, 3, 64)
    prompt = random_prompt(54, 64)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
    choose = AutoPolicy.choose

    def trees_mostly(policy, context, produced, eos):
        plan = choose(policy, context, produced, eos)
        tree = next((c for c in policy.candidates if c.width == 2), None)  # (none once auto keeps to plain steps)
        if tree is None or produced % 5 == 4:
            return plan
        return StepPlan(tree, 3, None, 0, tree.drafter.lag(context))

    monkeypatch.setattr(AutoPolicy, "choose", trees_mostly)
    invent(monkeypatch, costs(target))  # (a machine where trees pay: auto keeps its tree candidate)
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[target.share()], tree_widths=(2,),
                      max_new_tokens=40, schedule="stage")
    assert result.token_ids == expected
    stage = result.stats.stage
    trees = sum(1 for c in result.stats.choices if c.endswith("tree2"))
    assert trees > 3 and stage.drafted >= trees - 1 and stage.hits >= 1, (stage, result.stats.choices)
    assert "stage:" in result.stats.summary()


def test_auto_with_stage_scheduling_keeps_the_sampling_distribution(monkeypatch):
    """With a drafter near the target and costs that make its trees pay, so that auto drafts trees and takes some
    drafted ahead (measured costs on these models have it decode plainly), of one level (`k_max`): a tree taken
    ahead drafts the fourth token at the earliest (test_tree's stage sampling test), and five are checked."""
    from test_sampling import TEMPERATURE, assert_follows_target, sampling_pair

    target, drafter, prompt = sampling_pair(near=True)
    invent(monkeypatch, costs(target))
    options = dict(method="auto", drafters=[drafter], tree_widths=(2,), k_max=1, schedule="stage")
    runs = [generate(target, prompt_ids=prompt, max_new_tokens=7, temperature=TEMPERATURE, seed=seed, **options).stats
            for seed in range(30)]
    assert sum(stats.stage.hits for stats in runs if stats.stage is not None) > 0
    assert_follows_target(target, prompt, n=5, **options)


def test_one_text_where_a_drafter_was_never_right_does_not_shut_it_out_of_the_next():
    """A drafter's long-run promise counts pseudo-observations at one half (`PROMISE_WEIGHT`): one short text whose
    few probes all failed (a chat reply, say) leaves the next text a probe, where the drafter may be right every time
    (code, say). Beside one pseudo-observation of one half, those failures starved every later probe of its budget,
    and auto decoded plainly for the rest of the process."""
    target, prompt, reference, wrong = never_right(60)
    candidate = Candidate("scripted", wrong, 0.1, 0.6, catch_up=lambda context: 2.0)
    tokens, stats = run(target, [candidate], prompt, n=60)
    assert tokens == reference and stats.choices.count("scripted") >= 2
    candidate.drafter = ScriptedDrafter(prompt, reference, error_rate=0.0, vocab=VOCAB, seed=0)
    tokens, stats = run(target, [candidate], prompt, n=60)
    assert tokens == reference
    assert stats.choices.count("scripted") > len(stats.choices) / 2


def test_options_for_model_drafters_are_refused_where_auto_has_none():
    """draft_confidence, tree_widths, probe_every, schedule and catch_up act on model drafters: set away from their
    defaults for auto with only Max-Gram, they would do nothing, so they are refused (by spec before anything
    loads, by object when the method builds); their defaults pass. (With a model drafter they apply: the tests
    above.)"""
    from speculant.drafters.maxgram import MaxGramDrafter
    from speculant.errors import ConfigError, OptionError

    target = tiny_model("llama", 0, 64)
    prompt = random_prompt(0, 64, 8)
    for option, value in (("tree_widths", (4,)), ("draft_confidence", 0.5), ("probe_every", 4), ("catch_up", "safe")):
        with pytest.raises(ConfigError, match=f"{option} applies to model drafters"):
            generate(target, prompt_ids=prompt, method="auto", drafters=["maxgram"], max_new_tokens=4,
                     **{option: value})
    session = Session(target)  # (its profile of the target measured once)
    only = "^probe_every applies to model drafters; auto drafts here with maxgram only$"
    with pytest.raises(OptionError, match=only) as refused:  # (a loaded drafter by its name, not its repr; the option
        # named: a server's answer names it)
        generate(target, prompt_ids=prompt, method="auto", drafters=[MaxGramDrafter()], max_new_tokens=4,
                 probe_every=4, session=session)
    assert refused.value.option == "probe_every"
    generate(target, prompt_ids=prompt, method="auto", drafters=[MaxGramDrafter()], max_new_tokens=4, tree_widths=(2,),
             session=session)
    # no trees (`none`, as a flag spells it: its empty value is refused as a slip) asks for nothing; where the
    # target's own drafters are model-free, a refusal names them
    for widths in ((), "none", " "):
        generate(target, prompt_ids=prompt, method="auto", max_new_tokens=4, tree_widths=widths, session=session)
    with pytest.raises(ConfigError, match="tree_widths applies to model drafters; auto drafts here with maxgram only"):
        generate(target, prompt_ids=prompt, method="auto", max_new_tokens=4, tree_widths=(4,), session=session)


def test_options_for_token_trees_are_refused_where_every_model_drafter_has_another_vocabulary(monkeypatch):
    """Trees are drafted in the target's ids, so auto drafts none with a drafter of another tokenizer: tree_widths
    and schedule=stage set for it would do nothing, and are refused once the drafter loads, before a token is
    generated; their defaults pass, and a drafter in the target's vocabulary beside it takes them."""
    from helpers import bpe_tokenizer

    from speculant.errors import ConfigError
    from speculant.models import HFCausalLM

    other = bpe_tokenizer(["def foo(x):\n    return x + 1\n"] * 20, 300)
    target = HFCausalLM(tiny_transformer("llama", 0, vocab=257), byte_tokenizer(), name="t")
    cross = HFCausalLM(tiny_transformer("llama", 1, vocab=len(other)), other, name="cross")
    invent(monkeypatch, costs(target))
    session = Session(target)
    for options in (dict(tree_widths=(4,)), dict(tree_widths="auto"), dict(schedule="stage")):
        with pytest.raises(ConfigError, match=f"{next(iter(options))} applies to token trees"):
            generate(target, "def foo(x):", method="auto", drafters=[cross], max_new_tokens=4, session=session,
                     **options)
    expected = generate(target, "def foo(x):", method="ar", max_new_tokens=8).token_ids
    assert generate(target, "def foo(x):", method="auto", drafters=[cross], max_new_tokens=8,
                    session=session).token_ids == expected
    assert generate(target, "def foo(x):", method="auto", drafters=[cross, perturbed(target, 0.05, 1)],
                    max_new_tokens=8, tree_widths=(4,), schedule="stage", session=session).token_ids == expected


def test_stage_scheduling_with_no_tree_widths_is_refused_before_loading():
    """tree_widths=() asks for chains only, so auto:schedule=stage had nothing to schedule and was dropped without a
    word; where trees are asked for, it stands."""
    from speculant.errors import ConfigError
    from speculant.methods import get_method

    for make, widths in ((get_method("auto").make_options, ()), (get_method("auto").parse_options, "none")):
        with pytest.raises(ConfigError, match="schedule stage applies to token trees, and tree_widths asks for none"):
            make({"tree_widths": widths, "schedule": "stage"})
    assert get_method("auto").make_options({"tree_widths": (2,), "schedule": "stage"}).schedule == "stage"


def test_a_drafter_many_texts_showed_never_right_is_probed_again_once_texts_change():
    """After a run of texts where a drafter was never right its promise, and so its probe budget, fall near 0; the
    long-run counts age with every new text (`TEXT_AGE`), so it is probed again and drafts where it is now right,
    rather than never again in the session. (A Markov target: 34 texts of 200 tokens, each forward ~free.)"""
    target = MarkovLM(VOCAB, 1)
    prompt = random_prompt(1, VOCAB)
    n = 200
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=n).token_ids
    estimates = {}
    for text in range(34):
        right = text >= 32
        drafter = ScriptedDrafter(prompt, reference, error_rate=0.0 if right else 1.0, vocab=VOCAB, seed=text)
        candidate = Candidate("scripted", drafter, 0.1, 0.6, catch_up=lambda context: 2.0, estimates=estimates)
        tokens, stats = run(target, [candidate], prompt, n=n)
        assert tokens == reference
    assert stats.choices.count("scripted") > len(stats.choices) / 2


def test_a_k_max_beyond_the_reply_is_weighed_only_up_to_it(monkeypatch):
    """`can_pay` weighs every draft length up to k_max: a CLI's or a script's k_max of a billion took its time before
    the first token. No draft is longer than the reply's tokens, so that bounds what is weighed."""
    from speculant.decoding import adaptive as module

    target = load_model(tiny_transformer("llama", 0, VOCAB, init_std=0.1))
    drafter = load_model(perturbed(target, 0.1, 0).model)
    prompt = random_prompt(0, VOCAB, 6) * 3
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids
    weighed, can_pay = [], module.can_pay
    monkeypatch.setattr(module, "can_pay", lambda step, cost, most, width=1: weighed.append(most) or
                        can_pay(step, cost, most, width))
    invent(monkeypatch, costs(target))
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter], k_max=10 ** 9, max_new_tokens=12)
    assert result.token_ids == expected and weighed and max(weighed) <= 12


def test_a_reply_s_length_is_learned_where_its_reader_stops_it():
    """A server stops reading at an end-of-sequence token or a stop string and closes the decoder: the length it
    reached joins the session's `lengths` as a whole generation's does (only replies that ran to their budget were)."""
    target, prompt, reference, drafter = never_right(30)
    history = deque()
    decoder = adaptive(target, [Candidate("never", drafter, 0.1, 0.6)], prompt, 30, lambda w: 1.0,
                       SamplingConfig(), None, lengths=history)
    assert [next(decoder) for _ in range(7)] == reference[:7]
    decoder.close()
    assert list(history) == [7]


def test_a_user_drafter_s_cost_is_learned_from_its_drafts(monkeypatch):
    """A Drafter object without `match_length` (a user's) has no profile: it was weighed as free forever, so one
    that costs forty target forwards a draft drafted every step. Its drafts' time is now its cost."""
    import time

    from speculant import Drafter

    target = load_model(tiny_transformer("llama", 0, VOCAB, init_std=0.1))
    prompt = random_prompt(0, VOCAB, 6)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids

    class Slow(Drafter):  # always right, 0.2 s a draft
        name = "slow"
        proposals = 0

        def propose(self, context, k):
            Slow.proposals += 1
            time.sleep(0.2)
            done = len(context) - len(prompt)
            return Draft(reference[done:done + k])

    invent(monkeypatch, costs(target, target_step=0.005))
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[Slow()], k_max=2, max_new_tokens=40)
    assert result.token_ids == reference
    assert Slow.proposals <= 4, result.stats.choices


def test_auto_weighs_a_drafter_only_at_the_draft_lengths_its_positions_hold(monkeypatch):
    """A model drafter of 20 positions after a 16-token prompt: once the context fills them it drafts nothing, and
    auto stopped choosing it (its chain and its tree were chosen on, plain steps under their names); a user's
    drafter whose `most` says 0 is never asked, and one whose `most` is no count is refused by name. Outputs are
    ar's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from speculant import Drafter
    from speculant.errors import ConfigError
    from speculant.models import HFCausalLM

    target = tiny_model("llama", 0, VOCAB, init_std=0.5)
    short = HFCausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=20,
                                                  eos_token_id=None, bos_token_id=None)).eval(), None, name="gpt2-20")
    prompt = random_prompt(3, VOCAB, 16)
    reference = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    invent(monkeypatch, costs(target, drafter_step=0.02))  # (a drafter this cheap is chosen, right or not)
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[short], max_new_tokens=30)
    assert result.token_ids == reference
    chosen = [(choice, drafted) for choice, drafted in zip(result.stats.choices, result.stats.draft_lengths)
              if choice != "plain"]
    assert chosen and all(drafted for _, drafted in chosen), result.stats.choices

    class Full(Drafter):  # always right, but says it can hold nothing
        name, proposals, bound = "full", 0, 0

        def propose(self, context, k):
            Full.proposals += 1
            done = len(context) - len(prompt)
            return Draft(reference[done:done + k])

        def most(self, context):
            return self.bound

    assert generate(target, prompt_ids=prompt, method="auto", drafters=[Full()], max_new_tokens=30).token_ids == \
        reference
    assert Full.proposals == 0
    Full.bound = -1
    with pytest.raises(ConfigError, match="drafter 'full': most returned -1"):
        generate(target, prompt_ids=prompt, method="auto", drafters=[Full()], max_new_tokens=30)
