"""Distributed speculative inference: greedy output equals autoregressive output with every executor,
under random twin latencies, through server deaths; Theorem 1 in the twin; sampling keeps p; planning."""

import os
import random
import sys
import threading
from contextlib import contextmanager
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers import (DEVICES, RAY, MarkovLM, best_of, perturbed, random_prompt, tiny_model, tiny_transformer,
                     total_variation)
from speculant import generate
from speculant.config import SamplingConfig
from speculant.decoding.dsi.engine import DrafterFailed, dsi
from speculant.decoding.dsi.executors import ServerSpec, make_executor, replica_factory
from speculant.decoding.dsi.jobs import Canceller, Job, ServerDied, TargetServer
from speculant.models.base import Interrupted
from speculant.analysis.online import run, simulate_online
from speculant.decoding.dsi.plan import plan
from speculant.decoding.dsi.timeline import plot_timeline
from speculant.decoding.dsi.twin import Latency, OracleLM, PaddedModel, SyntheticDrafter
from speculant.decoding.autoregressive import autoregressive
from speculant.drafters.base import Draft, Drafter
from speculant.drafters.maxgram import MaxGramDrafter
from speculant.drafters.model import ModelDrafter
from speculant.errors import ConfigError
from speculant.sampling import logits_to_probs
from speculant.models.backends.hf import HFCausalLM, hf_replica
from test_sampling import TEMPERATURE, assert_follows_target, sampling_pair

VOCAB = 64
GREEDY = SamplingConfig()


def pair(seed: int, noise: float = 0.3, device: str = "cpu"):
    """A tiny target and a drafter that agrees with it often (noise on its weights), plus a prompt."""
    target = tiny_model("llama", seed, VOCAB, device=device)
    return target, perturbed(target, noise, seed + 100), random_prompt(seed, VOCAB, 8)


def reference(target, prompt, n):
    return generate(target, prompt_ids=prompt, method="ar", max_new_tokens=n).token_ids


def run_dsi(pool, drafter_model, prompt, n, lookahead, drafter_latency=None, close=False):
    model = drafter_model if drafter_latency is None else PaddedModel(drafter_model, drafter_latency)
    return run(dsi(pool, ModelDrafter(model, GREEDY, None), prompt, n, lookahead, GREEDY, None, frozenset(),
                   timeout_s=60, close_executor=close))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_greedy_dsi_equals_autoregressive_threads(servers, lookahead, device):
    """The target's forwards padded to 10 ms (a twin's latency), as costly as a GPU target's are beside a drafter:
    with forwards as fast as the drafter's, the drafts came too late to be accepted on a loaded machine."""
    accepted = 0
    for seed in range(4):
        target, drafter, prompt = pair(seed, device=device)
        pool = make_executor("thread", ServerSpec(replica_factory(target), [device] * servers, GREEDY,
                                                  Latency(0, 0.01)))
        tokens, stats = run_dsi(pool, drafter, prompt, 40, lookahead, close=True)
        assert tokens == reference(target, prompt, 40), f"seed {seed}"
        assert stats.dsi.lookahead == lookahead and len(stats.dsi.servers) == servers
        assert sum(s.used for s in stats.dsi.servers) >= 1
        accepted += sum(stats.accepted_lengths)
    assert accepted > 0


def test_greedy_dsi_equals_autoregressive_under_random_twin_latencies():
    """Random latencies reorder every event (results overtaking each other, drafts racing results)."""
    rng = random.Random(0)
    accepted = []
    for trial in range(10):
        target, drafter, prompt = pair(trial, noise=rng.choice([0.1, 0.3, 1.0]))
        servers, lookahead = rng.randint(1, 3), rng.choice([1, 3, 5])
        latency = Latency(rng.uniform(0, 0.006), rng.uniform(0.001, 0.006))
        pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * servers, GREEDY, latency))
        tokens, stats = run_dsi(pool, drafter, prompt, 30, lookahead, Latency(0, rng.uniform(0, 0.003)), close=True)
        assert tokens == reference(target, prompt, 30), f"trial {trial}"
        accepted.append(sum(stats.accepted_lengths))
    assert sum(accepted) > 0, accepted  # (drafts that won their races: some trials' lost every one)


def test_one_executor_serves_many_generations_and_stops_at_eos():
    target, drafter, prompt = pair(7)
    pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY, Latency(0.002, 0.002)))
    pool.start()
    try:
        accepted = 0
        for seed in range(3):
            prompt_s = pair(7 + seed)[2]  # (another prompt each; the drafter is the target's)
            tokens, stats = run_dsi(pool, drafter, prompt_s, 25, 3)
            assert tokens == reference(target, prompt_s, 25)
            accepted += sum(stats.accepted_lengths)
        assert accepted > 0
        eos = reference(target, prompt, 20)[9]
        tokens = run(dsi(pool, ModelDrafter(drafter, GREEDY, None), prompt, 20, 3, GREEDY, None, frozenset({eos})))[0]
        assert tokens[-1] == eos and tokens == reference(target, prompt, 20)[: len(tokens)]
    finally:
        pool.close()


def test_a_started_executor_serves_its_own_target_and_starts_again_once_closed():
    """A started executor passed to generate: its servers run the target it was built for, so a generation of
    another is refused (it decoded the other's text, reported as this one's), as are options its servers were
    built without; closed, it starts again (its requests waited forever on servers that had stopped)."""
    from speculant.methods.dsi import DSIOptions, server_spec

    (target, _, prompt), other = pair(7), tiny_model("qwen2", 8, VOCAB)
    options = DSIOptions(drafter="maxgram", lookahead=2)
    pool = make_executor("thread", server_spec(target, options, GREEDY))
    given = dict(prompt_ids=prompt, method="dsi", drafter="maxgram", lookahead=2, executor=pool, max_new_tokens=12)
    pool.start()
    try:
        for model, extra, what in ((other, {}, "another target"),
                                   (target, {"servers": 2, "target_devices": ["cpu"] * 2}, "another server count"),
                                   (target, {"twin_latency": "5,1", "lookahead": 5}, "another twin_latency")):
            with pytest.raises(ConfigError, match=what):
                generate(model, **{**given, **extra})
        pool.close()
        assert generate(target, **given).token_ids == reference(target, prompt, 12)
    finally:
        pool.close()


def test_server_keeps_the_sequence_catches_up_and_rolls_back_its_cache():
    """A job carries only the tokens after the `base` the server holds for its request; the server runs only
    what its cache lacks, rolls back where the cache disagrees, and its rows equal a fresh computation.
    A job building on a sequence the server never saw is refused."""
    target = tiny_model("qwen2", 3, VOCAB)
    server = TargetServer(0, target.share(), GREEDY)
    seq = random_prompt(3, VOCAB, 16)
    first = server.run(Job(0, 7, 0, tuple(seq[:10]), 6))
    assert first.rows_start == 6 and first.rows == 5 and first.forwarded == 10
    changed = seq[:8] + [(seq[8] + 1) % VOCAB] + seq[9:]
    second = server.run(Job(1, 7, 8, tuple(changed[8:]), 12))
    assert second.rows_start == 9 and second.forwarded == 8  # rolled back to the 8 shared tokens, re-ran the rest
    fresh = tiny_model("qwen2", 3, VOCAB)
    for position, token in zip(range(second.rows_start, len(changed) + 1), second.tokens):
        assert token == int(fresh.prefill(changed[:position]).argmax())
    # Another request's prompt is prefilled whole even where it shares a prefix with the cache: llama.cpp's
    # prefill and forward differ in numerics, and plain decoding prefills.
    third = server.run(Job(2, 9, 0, tuple(seq[:12]), 12))
    assert third.forwarded == 12 and third.forwards == 1
    # A server new to a request after its first tokens (the in-process fallback once every server is lost) prefills
    # the prompt alone and runs the tokens generated since as a forward, as plain decoding ran them.
    spied, prefilled = TargetServer(2, target.share(), GREEDY), []
    prefill = spied.model.prefill
    spied.model.prefill = lambda ids: prefilled.append(len(ids)) or prefill(ids)
    late = spied.run(Job(4, 11, 0, tuple(seq[:14]), 12, 8))
    assert prefilled == [8] and late.rows_start == 12 and late.forwards == 2 and late.forwarded == 14
    assert late.tokens == [int(fresh.prefill(seq[:position]).argmax()) for position in (12, 13, 14)]
    # a prefill is no step (GenerationStats: incremental forwards and their seconds), whatever else the job ran
    assert [(r.usage.forwards, r.usage.steps) for r in (first, second, third)] == [(2, 1), (1, 1), (1, 0)]
    assert 0 < first.usage.seconds < first.end - first.start and 0 <= third.usage.seconds < third.end - third.start
    cut = TargetServer(1, target.share(), GREEDY)
    cut.model.prefill = lambda ids: (_ for _ in ()).throw(Interrupted())  # (preempted inside the prefill)
    assert cut.run(Job(0, 7, 0, tuple(seq[:10]), 6)).usage.steps == 0
    with pytest.raises(ValueError, match="never saw"):
        server.run(Job(2, 8, 3, (1, 2), 4))
    with pytest.raises(ValueError, match="holds 12"):
        server.run(Job(3, 9, 13, (1, 2), 14))


def test_lost_thread_server_gives_identical_output():
    target, drafter, prompt = pair(11, noise=0.1)
    spec = ServerSpec(replica_factory(target), ["cpu"] * 3, GREEDY, Latency(0.003, 0.003), die_after={0: 1})
    tokens, stats = run_dsi(make_executor("thread", spec), drafter, prompt, 40, 2, close=True)
    assert tokens == reference(target, prompt, 40)
    assert stats.dsi.servers[0].lost and not stats.dsi.servers[1].lost  # the first idle server takes the next job


def test_every_server_lost_finishes_as_speculative_decoding_in_process():
    target, drafter, prompt = pair(12, noise=0.1)
    spec = ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY, die_after={0: 2, 1: 1})
    tokens, stats = run_dsi(make_executor("thread", spec), drafter, prompt, 40, 3, close=True)
    assert tokens == reference(target, prompt, 40)
    assert stats.dsi.fallback and all(s.lost for s in stats.dsi.servers[:2])
    assert stats.dsi.servers[2].used > 0  # the in-process server did the rest


def broken_factory(device):
    raise OSError("no such model file")


def test_a_server_that_cannot_start_is_a_clear_error():
    pool = make_executor("thread", ServerSpec(broken_factory, ["cpu"] * 2, GREEDY))
    with pytest.raises(ServerDied, match="failed to start: OSError: no such model file"):
        pool.start()


class FailingDrafter(Drafter):
    name = "failing"

    def __init__(self, inner, after):
        self.inner, self.after, self.calls = inner, after, 0

    def propose(self, context, k):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("out of memory")
        return self.inner.propose(context, k)

    def observe(self, n):
        pass


def test_drafter_failure_is_a_clear_error_not_a_hang():
    target, drafter, prompt = pair(13)
    pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY, Latency(0.01, 0.01)))
    failing = FailingDrafter(ModelDrafter(drafter, GREEDY, None), after=3)
    with pytest.raises(DrafterFailed, match="RuntimeError: out of memory") as failed:
        run(dsi(pool, failing, prompt, 40, 2, GREEDY, None, frozenset(), timeout_s=30))
    assert isinstance(failed.value.__cause__, RuntimeError)  # (its traceback kept)


def test_a_user_drafter_s_bad_draft_is_the_config_error_other_methods_raise():
    class Listing(Drafter):
        name = "listing"

        def propose(self, context, k):
            return list(context[-k:])

    target, _, prompt = pair(13)
    for method in ("sd", "dsi"):  # (DSI had wrapped it in DrafterFailed, its drafting thread's error as text)
        with pytest.raises(ConfigError, match="drafter 'listing': propose returned list, not a speculant.Draft"):
            generate(target, prompt_ids=prompt, method=method, drafter=Listing(), max_new_tokens=8)


def test_a_drafter_that_changes_the_context_it_is_given_drafts_as_any_other():
    """A drafter that appended to the context list it was handed (its own scratch) made DSI's drafting thread take
    every draft for a stale one, for ever: DSI hung where sd runs. It gets a copy, as the other methods give it."""

    class Appender(Drafter):
        name = "appender"

        def propose(self, context, k):
            for _ in range(k):
                context.append(context[-1])
            return Draft(context[-k:])

    target = tiny_model("llama", 3, 64, init_std=0.5)
    prompt = random_prompt(3, 64, 8)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(generate(
        target, prompt_ids=prompt, method="dsi", drafter=Appender(), max_new_tokens=12).token_ids), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert outcome == [expected]


def test_theorem_1_dsi_is_never_slower_than_non_si_in_the_twin():
    """Drafter faster than the target, worst case (a drafter that is always wrong) and a middling one:
    DSI's wall time stays within overhead of non-SI's (Timor et al., Theorem 1; the best of three tries under load)."""
    target_latency = Latency(0.02, 0.02)
    servers = 4
    lookahead = plan(servers, None, 0.02, 0.005).lookahead
    prompt = [1, 2, 3]

    def measure(acceptance: float) -> tuple[float, float]:
        pool = make_executor("thread", ServerSpec(partial(oracle_server, seed=1), ["cpu"] * servers, GREEDY, target_latency))
        pool.start()
        try:
            expected, non_si = run(autoregressive(PaddedModel(OracleLM(100, 1), target_latency), prompt, 30, GREEDY, None))
            drafter = SyntheticDrafter(OracleLM(100, 1), acceptance, 0.005, seed=1)
            tokens, stats = run(dsi(pool, drafter, prompt, 30, lookahead, GREEDY, None, frozenset(), close_executor=False))
        finally:
            pool.close()
        assert tokens == expected
        return stats.wall_s, non_si.wall_s

    def within(times: tuple[float, float]) -> bool:
        return times[0] <= times[1] * 1.1 + 0.02

    for acceptance in (0.0, 0.5):
        assert within(best_of(3, lambda: measure(acceptance), within)), f"a = {acceptance}"


def test_preemption_cuts_twin_forwards_short():
    """Cancelling a job stops its padded forward at once: most preempted bars end before their 30 ms."""
    pool = make_executor("thread", ServerSpec(partial(oracle_server, seed=2), ["cpu"] * 5, GREEDY, Latency(0.03, 0.03)))
    drafter = SyntheticDrafter(OracleLM(100, 2), 0.7, 0.003, seed=2)
    _, stats = run(dsi(pool, drafter, [1, 2, 3], 40, 2, GREEDY, None, frozenset()))
    preempted = [bar for bar in stats.dsi.bars if bar.outcome == "preempted"]
    assert preempted and sum(bar.end - bar.start < 0.030 for bar in preempted) > len(preempted) / 2  # (not cut: 30)


def slowed(model, seconds):
    """`model` with each decoder layer taking `seconds` longer: a forward long enough to be cut in the middle."""
    for layer in next(m for m in model.model.modules() if isinstance(m, torch.nn.ModuleList)):
        layer.register_forward_hook(lambda *_: time.sleep(seconds))
    return model


@pytest.mark.parametrize("kind", ["twin", "model"])
def test_a_restart_cuts_the_drafter_s_stale_draft_short(kind):
    """DSI restarts a drafter whose context a rejection changed (Algorithm 1 terminates it): the draft in flight
    stops, a twin's emulated latency at once, a model's forward at its next layer boundary, so the first draft
    after the restart is of the new context, a drafter latency later, not after the stale draft's remainder; a
    stop cuts it alike. The model's interrupt check is its own again once the thread ends."""
    from speculant.decoding.dsi.engine import DraftWorker

    events, model = __import__("queue").Queue(), None
    if kind == "twin":
        drafter = SyntheticDrafter(OracleLM(100, 1), 1.0, 1.0)  # a second a token
    else:
        model = slowed(HFCausalLM(tiny_transformer("llama", 1, VOCAB, layers=8)), 0.125)  # a second a forward
        drafter = ModelDrafter(model, GREEDY, None)
    worker = DraftWorker(0, drafter, events, model)
    worker.sync([1, 2, 3], 3, 10)
    worker.thread.start()
    time.sleep(0.3)
    worker.sync([1, 2, 4], 2, 10)  # diverged: the draft after [1, 2, 3] is stale
    started = time.monotonic()
    event = events.get(timeout=10)
    assert event[0] == "draft" and event[2] == worker.epoch and event[3] == 3, event[:4]  # (-1: a stale draft)
    assert time.monotonic() - started < 2.5  # (a drafter latency, ~1 s; the stale draft told apart above)
    time.sleep(0.3)
    started = time.monotonic()
    worker.stop()
    worker.thread.join(timeout=10)
    assert not worker.thread.is_alive() and time.monotonic() - started < 0.6
    assert model is None or model.interrupt is None


def oracle_server(device, seed):
    return OracleLM(100, seed)


def test_one_server_never_gets_a_job_on_the_bare_prefix(monkeypatch):
    """With one server a job on the bare committed prefix would make the drafts wait a whole forward (`dispatch`):
    a job goes once `lookahead` drafts wait that no job carries yet, or when the drafter waits. A drafter that is
    always wrong leaves nothing new after each rejection, so the next job waits for its next draft."""
    from speculant.decoding.dsi import engine

    sent = []  # per job: its sequence's length, the tokens committed, whether the drafter waits
    send = engine.Coordinator.send

    def recording(self, server, tokens, first_row):
        sent.append((len(tokens), self.n_committed, len(tokens) >= self.limit() or self.stuck == len(tokens)))
        send(self, server, tokens, first_row)

    monkeypatch.setattr(engine.Coordinator, "send", recording)
    prompt = [1, 2, 3]
    expected, _ = run(autoregressive(OracleLM(100, 3), prompt, 20, GREEDY, None))
    pool = make_executor("thread", ServerSpec(partial(oracle_server, seed=3), ["cpu"], GREEDY, Latency(0.002, 0.002)))
    tokens, _ = run(dsi(pool, SyntheticDrafter(OracleLM(100, 3), 0.0, 0.0005, seed=3), prompt, 20, 1, GREEDY, None,
                        frozenset()))
    assert tokens == expected and len(sent) == 20  # the prefill, then one job per rejected draft
    assert all(length > committed or waits for length, committed, waits in sent[1:])


def test_simulate_online_with_several_drafters_reports_their_gain():
    """A cheap, often wrong drafter and a costlier, often right one: each alone, then both (Algorithm 1 with
    m > 2 models); outputs identical to non-SI's, and the pair's gain over the better single one reported."""
    def gains(result):
        return result["dsi_all_ms"] < result["non_si_ms"] and result["dsi_all_gain_over_best_single"] > 0.8

    result = best_of(3, lambda: simulate_online(20, 1, 0.4, servers=4, tokens=30, repeats=2, more_drafters=((4, 0.9),)),
                     gains)
    assert result["identical_outputs"] and result["lookaheads_alone"] == [2]
    assert gains(result)
    assert result["dsi_all_gain_over_best_single"] == pytest.approx(
        min(result["dsi_ms"], result["dsi_drafter_1_ms"]) / result["dsi_all_ms"])


def test_a_more_drafter_as_slow_as_the_target_runs_at_the_lookahead_given():
    """Planning refuses a drafter no faster than the target ("give a lookahead to run it anyway"); a more-drafter's
    run took no lookahead given, so the advice could not be followed. It runs at the lookahead given now, and without
    one the refusal comes before any server starts."""
    result = simulate_online(5, 1, 0.8, servers=2, tokens=6, repeats=1, lookahead=3, more_drafters=((10, 0.9),))
    assert result["identical_outputs"] and result["lookaheads_alone"] == [3]
    with pytest.raises(ConfigError, match="give a lookahead"):
        simulate_online(5, 1, 0.8, servers=2, tokens=6, repeats=1, executor="nosuch",  # (none would start)
                        more_drafters=((10, 0.9),))


def test_simulate_online_beats_si_and_non_si_on_paper_like_settings():
    def beats(result):
        return result["dsi_speedup_over_non_si"] > 1.5 and result["dsi_speedup_over_si"] > 1.0

    result = best_of(3, lambda: simulate_online(20, 2, 0.8, servers=5, tokens=30, repeats=2), beats)
    assert result["identical_outputs"] and beats(result), result


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_with_dsi_keeps_the_target_distribution(device):
    target, drafter, prompt = sampling_pair(31, device=device)
    with sampling_servers(target, device) as pool:
        assert_follows_target(target, prompt, method="dsi", drafter=drafter, servers=2, lookahead=2, executor=pool)
        assert_drafts_are_verified(target, prompt, pool, drafter=drafter)


@pytest.mark.parametrize("seed", [-(1 << 63), (1 << 64) - 1])
def test_dsi_takes_every_seed_a_request_may_give(seed):
    """Each drafter thread's generator is seeded after the request's seed, wrapped to the 64 bits a generator takes."""
    target, drafter, prompt = pair(23)
    result = generate(target, prompt_ids=prompt, drafter=drafter, method="dsi", servers=2, lookahead=2,
                      max_new_tokens=6, temperature=TEMPERATURE, seed=seed)
    assert len(result.token_ids) == 6


def test_generate_api_runs_dsi_with_planned_lookahead():
    target, drafter, prompt = pair(21)
    result = generate(target, prompt_ids=prompt, drafter=drafter, method="dsi", servers=2, max_new_tokens=30,
                      twin_latency=(Latency(0.004, 0.004), Latency(0.001, 0.001)))
    assert result.token_ids == reference(target, prompt, 30)
    assert result.stats.dsi.lookahead == 2  # ceil(4 / (2 * 1))
    assert "DSI (thread, lookahead 2)" in result.stats.summary()


def test_timeline_png(tmp_path):
    target, drafter, prompt = pair(22)
    result = generate(target, prompt_ids=prompt, drafter=drafter, method="dsi", servers=2, lookahead=2, max_new_tokens=20)
    path = plot_timeline(result.stats.dsi, tmp_path / "timeline.png")
    assert path.stat().st_size > 1000


def test_planning_picks_the_smallest_feasible_lookahead_and_refuses_impossible_plans():
    assert plan(7, None, 0.030, 0.003).lookahead == 2  # ceil(30 / (7 * 3))
    assert plan(1, None, 0.030, 0.003).lookahead == 10
    assert plan(2, 7, 0.030, 0.003).lookahead == 7
    with pytest.raises(ConfigError, match="needs 10"):
        plan(2, 1, 0.030, 0.003)
    with pytest.raises(ConfigError, match="as slow as the target"):
        plan(2, None, 0.030, 0.040)
    with pytest.raises(ConfigError, match="at least one"):
        plan(0, 3, None, None)
    with pytest.raises(ConfigError, match="does not apply to method 'sd' \\(it belongs to dsi"):
        generate(tiny_model("llama", 1, VOCAB), prompt_ids=[1, 2], method="sd", drafter="maxgram", servers=2)


def test_process_executor_survives_a_server_killed_mid_generation():
    target, drafter, prompt = pair(41, noise=0.1)
    spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * 2, GREEDY,
                      Latency(0.003, 0.003))
    pool = make_executor("process", spec)
    pool.start()
    try:
        stream = dsi(pool, ModelDrafter(drafter, GREEDY, None), prompt, 40, 2, GREEDY, None, frozenset(), timeout_s=60,
                     close_executor=False)
        tokens = [next(stream) for _ in range(8)]
        pool.kill(1)  # a real SIGKILL mid-generation
        tokens += run(stream)[0]
    finally:
        pool.close()
    assert tokens == reference(target, prompt, 40)


def exercise_pool(make_pool, servers: int, rng: random.Random, check=None) -> None:
    """DSI on a pool of `servers` (made by `make_pool(spec)`) serving generations of lookahead 1, 3 and 5, random
    twin latencies shaking out races (the target's forwards padded past 10 ms: drafts as costly as they are came too
    late to be accepted on a loaded machine); a pool of 3 loses server 1 on the way (it exits at its third job: a fault
    injected) and the generations after it hear so at once (they waited for a timeout when only the first was
    told). `check(pool)` runs once the pool has started."""
    target = tiny_model("llama", 61, VOCAB)
    spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * servers, GREEDY,
                      Latency(rng.uniform(0, 0.004), 0.01 + rng.uniform(0.001, 0.004)),  # (drafts in time)
                      die_after={1: 2} if servers == 3 else {})
    pool = make_pool(spec)
    lost, accepted = [], 0
    try:
        pool.start()
        if check is not None:
            check(pool)
        for lookahead in (1, 3, 5):
            drafter = perturbed(target, rng.choice([0.1, 0.3]), rng.randrange(1000))
            prompt = random_prompt(rng.randrange(1000), VOCAB, 8)
            tokens, stats = run_dsi(pool, drafter, prompt, 24, lookahead, Latency(0, rng.uniform(0, 0.002)))
            assert tokens == reference(target, prompt, 24), f"{servers} servers, lookahead {lookahead}"
            lost += [server.lost for server in stats.dsi.servers if server.lost]
            accepted += sum(stats.accepted_lengths)
        assert bool(lost) == (servers == 3), lost  # the output stayed the same where server 1 died
        assert accepted > 0
        if servers == 3:  # the next generation on the pool is told that server 1 is gone, it does not time out
            prompt = random_prompt(rng.randrange(1000), VOCAB, 8)
            tokens, stats = run(dsi(pool, ModelDrafter(target, GREEDY, None), prompt, 24, 3, GREEDY, None,
                                    frozenset(), timeout_s=20, close_executor=False))
            assert tokens == reference(target, prompt, 24) and stats.dsi.servers[1].lost == lost[0]
    finally:
        pool.close()


def test_a_process_server_gets_a_model_of_more_tensors_than_a_forkserver_start_takes():
    """Each shared weight tensor travels to a process server as a file descriptor: a model of 300 (the catalog's
    0.5B has 290) reaches it, where a forkserver's start arguments take at most 256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=33,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    assert len(list(model.parameters())) > 256
    target = HFCausalLM(model, None, name="tiny-llama-33-layers")
    prompt = random_prompt(3, VOCAB, 8)
    pool = make_executor("process", ServerSpec(replica_factory(target), ["cpu"], GREEDY))
    assert run_dsi(pool, target, prompt, 8, 2, close=True)[0] == reference(target, prompt, 8)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_greedy_dsi_equals_autoregressive_on_every_executor(executor):
    """Pools of 1 and 3 servers (`exercise_pool`); Ray's executor runs the same on a cluster of two nodes
    (`test_dsi_on_two_ray_nodes_equals_autoregressive`)."""
    rng = random.Random(7)

    def forked(pool):  # process servers fork from multiprocessing's forkserver (torch imported there once)
        parents = {int(Path(f"/proc/{p.pid}/stat").read_text().rpartition(")")[2].split()[1]) for p in pool.processes}
        assert len(parents) == 1 and os.getpid() not in parents, parents

    for servers in (1, 3):
        exercise_pool(partial(make_executor, executor), servers, rng, forked if executor == "process" else None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_dsi_servers_on_cuda_for_a_cpu_target(executor):
    """Servers on another device get their own copy of the weights; the caller's target stays put."""
    target, drafter, prompt = pair(71, noise=0.1)
    expected = reference(target, prompt, 30)
    spec = ServerSpec(replica_factory(target), ["cuda"] * 2, GREEDY)
    assert run_dsi(make_executor(executor, spec), drafter, prompt, 30, 3, close=True)[0] == expected
    assert next(target.model.parameters()).device.type == "cpu"


class SometimesSilent(Drafter):
    """A drafter with nothing to propose after some contexts (Max-Gram without a match does this); counts
    how often it is asked about a context it already had nothing for."""

    name = "sometimes-silent"

    def __init__(self, inner):
        self.inner, self.silent, self.repeats, self.calls = inner, set(), 0, 0

    def propose(self, context, k):
        self.calls += 1
        if (len(context) * 7 + context[-1]) % 3 == 0:
            self.repeats += tuple(context) in self.silent
            self.silent.add(tuple(context))
            return Draft([], None, {})
        return self.inner.propose(context, k)

    def observe(self, n):
        pass


@pytest.mark.parametrize("servers", [1, 3])
def test_greedy_dsi_with_maxgram_and_with_a_drafter_that_sometimes_has_nothing(servers):
    """Empty drafts never stall DSI: commits (bonus tokens included) reach the drafter, which drafts on from
    them, and a context it had nothing for is not asked again (no spinning)."""
    accepted = 0
    for seed in range(4):
        target, drafter, prompt = pair(80 + seed, noise=0.1)
        pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * servers, GREEDY,
                                                  Latency(0.004, 0.004)))
        pool.start()
        try:
            expected = reference(target, prompt, 40)
            for lookahead in (1, 4):
                tokens, stats = run(dsi(pool, MaxGramDrafter(), prompt, 40, lookahead, GREEDY, None, frozenset(),
                                        timeout_s=30, close_executor=False))
                assert tokens == expected, f"maxgram, seed {seed}, lookahead {lookahead}"
                silent = SometimesSilent(ModelDrafter(drafter, GREEDY, None))
                tokens, stats = run(dsi(pool, silent, prompt, 40, lookahead, GREEDY, None, frozenset(),
                                        timeout_s=30, close_executor=False))
                assert tokens == expected, f"silent drafter, seed {seed}, lookahead {lookahead}"
                assert silent.silent and silent.repeats <= len(silent.silent), "asked again without a change"
                accepted += sum(stats.accepted_lengths)
        finally:
            pool.close()
    assert accepted > 0  # it drafted, and its drafts were used (in one run or another: on a loaded machine a
    # single run's drafts may all come too late for the one server)


def test_dsi_stops_at_eos_inside_a_lookahead():
    target, drafter, prompt = pair(90, noise=0.05)
    full = reference(target, prompt, 30)
    eos = full[4]
    expected = full[: full.index(eos) + 1]
    pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY))
    pool.start()
    try:
        for drafters in ([ModelDrafter(drafter, GREEDY, None)], [MaxGramDrafter(), ModelDrafter(drafter, GREEDY, None)]):
            tokens = run(dsi(pool, drafters, prompt, 30, 8, GREEDY, None, frozenset({eos}), close_executor=False))[0]
            assert tokens == expected
    finally:
        pool.close()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_greedy_dsi_with_several_drafters_equals_autoregressive(executor):
    """Algorithm 1 with m > 2 models: Max-Gram leads, a close drafter and a far one correct it at their pace."""
    rng = random.Random(3)
    target = tiny_model("llama", 95, VOCAB)
    spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * 2, GREEDY,
                      Latency(0.01, 0.01))
    pool = make_executor(executor, spec)
    pool.start()
    kept = set()
    try:
        for trial in range(4):
            prompt = random_prompt(200 + trial, VOCAB, 8)
            close, far = perturbed(target, 0.05, trial), perturbed(target, 0.5, trial + 50)
            drafters = [MaxGramDrafter(), ModelDrafter(PaddedModel(far, Latency(0, 0.001)), GREEDY, None),
                        ModelDrafter(PaddedModel(close, Latency(0, rng.uniform(0.002, 0.005))), GREEDY, None)]
            tokens, stats = run(dsi(pool, drafters, prompt, 30, rng.choice([1, 3]), GREEDY, None, frozenset(),
                                    timeout_s=60, close_executor=False))
            assert tokens == reference(target, prompt, 30), f"trial {trial}"
            kept |= {bar.row for bar in stats.dsi.bars if bar.outcome == "kept"}
    finally:
        pool.close()
    assert {-1, -2, -3} <= kept  # every drafter's tokens made it into the speculated sequence


def test_sampling_with_several_drafters_keeps_the_target_distribution():
    target, drafter, prompt = sampling_pair(33)
    other = MarkovLM(12, 35)
    with sampling_servers(target, "cpu") as pool:
        assert_follows_target(target, prompt, method="dsi", drafters=(drafter, other), servers=2, lookahead=2,
                              executor=pool)
        assert_drafts_are_verified(target, prompt, pool, drafters=(drafter, other))


def test_one_drafter_model_given_twice_is_refused():
    """Two drafter threads on one model would share its cache (a rollback past its end, sooner or later)."""
    target, drafter, prompt = pair(24)
    with pytest.raises(ConfigError, match="drafters: .* is given twice"):
        generate(target, prompt_ids=prompt, method="dsi", drafters=[drafter, drafter], servers=2, max_new_tokens=8)


def test_a_deterministic_drafter_s_agreement_is_verified_as_its_draft():
    """Drafters (a sampling one, then one without a q, as Max-Gram is): where the second agrees with the first's
    token, the position becomes the second's, verified as its one-hot draft. Verified with the first's q instead,
    a token the first draws rarely and the target gives little was accepted almost surely."""

    class Constant(Drafter):
        name = "constant"

        def propose(self, context, k):
            time.sleep(0.002)  # (after the sampling drafter has drafted the position)
            return Draft([0] * k, None)

    target, flat, prompt = MarkovLM(6, 5, scale=1.0), MarkovLM(6, 9, scale=0.2), [1, 2, 3]  # flat: q ~ uniform
    p = logits_to_probs(target.prefill(prompt), SamplingConfig(1.0))
    pool = make_executor("thread", ServerSpec(lambda _: target.share(), ["cpu"], SamplingConfig(1.0),
                                              Latency(0.01, 0.001)))  # (both speak before the first verification)
    pool.start()
    try:
        counts = torch.zeros(6)
        for seed in range(800):
            counts[generate(target, prompt_ids=prompt, method="dsi", drafters=(flat, Constant()), servers=1,
                            lookahead=1, executor=pool, max_new_tokens=2, temperature=1.0, seed=seed).token_ids[0]] += 1
    finally:
        pool.close()
    assert float(p[0]) < 0.2 and total_variation(counts / counts.sum(), p) < 0.06


def assert_drafts_are_verified(target, prompt, pool, **drafters):
    """Sampled DSI generations verify drafts (the statistical tests above mean nothing where none arrives in time)."""
    stats = generate(target, prompt_ids=prompt, method="dsi", servers=2, lookahead=2, executor=pool, max_new_tokens=30,
                     temperature=TEMPERATURE, seed=0, **drafters).stats
    assert sum(stats.draft_lengths) >= 10


@contextmanager
def sampling_servers(target, device):
    """Two thread servers sampling at the statistical tests' temperature, kept across their generations, each
    forward padded to 1 ms: the Markov target would otherwise answer before any draft arrives, and a test in which
    no draft is verified could not fail."""
    pool = make_executor("thread", ServerSpec(lambda _: target.share(), [device] * 2, SamplingConfig(TEMPERATURE),
                                              Latency(0.001, 0.001)))
    pool.start()
    try:
        yield pool
    finally:
        pool.close()


def test_canceller_never_loses_a_cancellation():
    """The running job's cancellation wakes a waiter whatever else was cancelled before; the model's
    per-layer check sees it at once."""
    canceller = Canceller()
    canceller.running = 5
    canceller.cancel(4)  # a cancellation meant for an earlier job: the event is set, the id is not ours
    assert not canceller.wait(0.01) and not canceller.cancelled_now()
    timer = threading.Timer(0.02, canceller.cancel, args=(5,))
    timer.start()
    start = time.monotonic()
    assert canceller.wait(5.0) and time.monotonic() - start < 1.0 and canceller.cancelled_now()


def test_a_cancelled_job_stops_inside_the_real_forward_and_rolls_its_cache_back():
    """The target's own layers check the cancellation: the forward ends at a layer boundary, the server's
    cache is as before the job, and the next job's rows equal a fresh computation."""
    target = tiny_model("qwen2", 4, VOCAB)
    canceller = Canceller()
    server = TargetServer(0, target.share(), GREEDY, canceller=canceller)
    seq = random_prompt(4, VOCAB, 14)
    server.run(Job(0, 1, 0, tuple(seq[:8]), 8))
    layers = []
    hook = server.model.model.model.layers[1].register_forward_pre_hook(lambda *_: layers.append(1))
    canceller.cancel(1)  # cancelled before it starts: the first layer boundary stops it
    cut = server.run(Job(1, 1, 8, tuple(seq[8:12]), 9))
    hook.remove()
    assert cut.preempted and cut.rows == 0 and not layers and server.model.cache_len == 8
    answer = server.run(Job(2, 1, 12, tuple(seq[12:]), 9))
    assert answer.forwarded == 6 and answer.rows_start == 9
    fresh = tiny_model("qwen2", 4, VOCAB)
    assert answer.tokens == [int(fresh.prefill(seq[:p]).argmax()) for p in range(9, 15)]


def test_jobs_carry_only_what_a_server_lacks():
    target, drafter, prompt = pair(97, noise=0.1)
    prompt = random_prompt(97, VOCAB, 64)
    pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY))
    tokens, stats = run_dsi(pool, drafter, prompt, 40, 3, close=True)
    assert tokens == reference(target, prompt, 40)
    jobs = sum(s.jobs for s in stats.dsi.servers)
    sent = sum(s.sent_tokens for s in stats.dsi.servers)
    whole = sum(s.sequence_tokens for s in stats.dsi.servers)
    assert sent < whole / 5 and sent - 2 * 64 < 8 * jobs  # the prompt once per server, then a few tokens a job


def test_the_twin_paces_drafters_that_run_no_model():
    """The twin's drafter latency held for model drafters only: Max-Gram's and suffix decoding's drafts came at once
    (the latency dropped without a word); each drafted token now takes it, one given for all or one per drafter."""
    target = tiny_model("llama", 3, VOCAB)
    prompt = random_prompt(3, VOCAB, 8) * 3  # (repeated: what Max-Gram and suffix decoding draft from)
    expected = reference(target, prompt, 12)
    for options, least in ((dict(drafter="maxgram", twin_latency="20,5"), (0.005,)),
                           (dict(drafters="maxgram,suffix", twin_latency="20,2/5", lookahead=10), (0.002, 0.005))):
        result = generate(target, prompt_ids=prompt, method="dsi", max_new_tokens=12, **options)
        assert result.token_ids == expected
        for d, seconds in enumerate(least):
            bars = [b.end - b.start for b in result.stats.dsi.bars if b.row == -1 - d]
            assert bars and min(bars) >= seconds * 0.95, (options, d, bars)


def test_dsi_with_maxgram_is_faster_than_the_target_alone_in_the_twin():
    """A repetitive continuation (tiny random models loop) is what Max-Gram drafts: with every target forward
    padded to 15 ms, DSI beats the target alone on the same servers."""
    target = tiny_model("llama", 3, VOCAB)
    prompt = random_prompt(3, VOCAB, 8)
    latency = Latency(0.015, 0.015)
    expected, alone = run(autoregressive(PaddedModel(target.share(), latency), prompt, 60, GREEDY, None))
    pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY, latency))
    pool.start()

    def faster(out) -> bool:
        return out[1].wall_s < 0.8 * alone.wall_s

    try:  # (the best of three under load)
        tokens, stats = best_of(3, lambda: run(dsi(pool, MaxGramDrafter(), prompt, 60, 4, GREEDY, None, frozenset(),
                                                   close_executor=False)), faster)
    finally:
        pool.close()
    assert tokens == expected
    assert faster((tokens, stats)), (stats.wall_s, alone.wall_s)


@pytest.fixture
def two_ray_nodes():
    """A Ray head and a second Ray node started on this machine with `ray start`, as a cluster of two machines would
    be (`--executor ray --ray-address HOST:PORT`)."""
    pytest.importorskip("ray")
    import shutil
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    beside = Path(sys.executable).with_name("ray")  # a venv's python called without activating the venv
    ray_cli = str(beside) if beside.exists() else shutil.which("ray")
    if ray_cli is None:
        pytest.skip("no `ray` command beside this Python or on PATH")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # throwaway local clusters (see conftest.py)
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    try:
        subprocess.run([ray_cli, "start", "--head", "--port", str(port), "--include-dashboard", "false", *common],
                       check=True, capture_output=True, timeout=120, env=env)
        subprocess.run([ray_cli, "start", "--address", f"127.0.0.1:{port}", *common], check=True, capture_output=True,
                       timeout=120, env=env)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120, env=env)


@RAY
def test_ray_executors_started_at_once_share_one_ray_until_the_last_closes():
    """Two generations' Ray executors (a server's concurrent DSI requests) starting at once: one local Ray, started
    once (both calling ray.init failed one), up while either runs, shut down with the last. The threads that started
    them end first, as requests' threads do: Ray's processes, bound to the thread that spawned them, died with it
    (`RayUse.keeper`). In a process of its own on a Ray of its own (`RAY_ADDRESS=local`): a driver whose Ray died
    ends its whole process a minute on, which must not be a test worker."""
    import subprocess

    pytest.importorskip("ray")
    done = subprocess.run([sys.executable, "-c", "import test_dsi; test_dsi.share_one_ray()"], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parent, env={**os.environ, "RAY_ADDRESS": "local"})
    assert done.returncode == 0 and done.stdout.strip().endswith("shared"), done.stderr[-2000:]
    assert "SIGTERM handler is not set" not in done.stderr and "Token authentication" not in done.stderr  # (Ray's)


def share_one_ray() -> None:
    """The body of the test above, in its child process."""
    import ray

    target = tiny_model("llama", 61, VOCAB)
    pools = [make_executor("ray", ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"],
                                             GREEDY, Latency(0, 0))) for _ in range(3)]

    def start(*started):  # each on a thread of its own, as a request's, which ends when it has started
        done = []  # (a pool that failed to start does not answer here)
        threads = [threading.Thread(target=lambda pool=pool: done.append(pool.start())) for pool in started]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(done) == len(started) and all(pool.owns_ray for pool in started)

    try:
        start(pools[0], pools[1])
        pools[0].close()
        start(pools[2])  # a later request, while the second runs: its actors need Ray's head, which must be alive
        assert ray.is_initialized() and len(pools[1].nodes() + pools[2].nodes()) == 2
    finally:
        for pool in pools:
            pool.close()
    assert not ray.is_initialized()
    print("shared")


@RAY
def test_dsi_on_two_ray_nodes_equals_autoregressive(two_ray_nodes):
    """Ray's executor joins the cluster (and leaves it on close), its 3 servers spread over both nodes, and DSI on
    them runs as on the other executors, a server lost on the way (`exercise_pool`)."""
    import ray

    ray.init(address=two_ray_nodes, log_to_driver=False, configure_logging=False)
    try:
        for _ in range(100):  # the second node registers within seconds of `ray start` returning
            if sum(node["Alive"] for node in ray.nodes()) == 2:
                break
            time.sleep(0.2)
        assert sum(node["Alive"] for node in ray.nodes()) == 2, ray.nodes()
    finally:
        ray.shutdown()  # the executor connects on its own

    def on_both_nodes(pool):
        assert pool.owns_ray and len(set(pool.nodes())) == 2, "the servers should run on both nodes"

    exercise_pool(lambda spec: make_executor("ray", spec, two_ray_nodes), 3, random.Random(7), on_both_nodes)
    assert not ray.is_initialized()


def test_paused_dsi_streams_end_before_the_interpreter_exits():
    """A DSI stream read part way runs a drafter thread and target server threads; left open at exit, they were
    still in torch while Python tore down, and the process aborted (two exits in three). Paused generations end at
    exit (`api.LIVE`)."""
    import subprocess

    script = """
import sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from speculant import generate
streams = []
for seed in range(3):
    target, drafter = tiny_model("llama", 2 * seed + 1, 64), tiny_model("llama", 2 * seed + 2, 64)
    streams.append(generate(target, prompt_ids=[1, 2, 3], max_new_tokens=40, method="dsi", drafter=drafter,
                            lookahead=2, stream=True))
    next(streams[-1])
""".format(tests=str(Path(__file__).parent))
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-500:]


def test_dsi_plans_with_a_drafter_of_fewer_positions_than_the_prompt(monkeypatch):
    """Without a lookahead DSI times a drafter forward after the prompt: after its last tokens where the drafter holds
    fewer positions (the whole prompt, past a static cache of 8, crashed the plan). The forwards timed run; the times
    planned with are fixed (the target's ten times the drafter's), so that a loaded machine's cannot refuse the plan."""
    import speculant.decoding.dsi.plan
    from speculant.models.backends.static import StaticCausalLM, StaticWeights
    from speculant.models.base import owner_of

    def measure_step(model, prompt, repeats=3, measured=speculant.decoding.dsi.plan.measure_step):
        measured(model, prompt, repeats)
        return 0.01 if owner_of(model) is target else 0.001

    monkeypatch.setattr(speculant.decoding.dsi.plan, "measure_step", measure_step)
    target = HFCausalLM(tiny_transformer("llama", 1, 64, init_std=0.1))
    drafter = StaticCausalLM(StaticWeights(tiny_transformer("llama", 1, 64, init_std=0.1)), name="tiny-8", span=8,
                             width=4)
    for prompt in ([5, 9], random_prompt(3, 64, 24)):
        ar = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=6)
        dsi_run = generate(target, prompt_ids=prompt, method="dsi", drafter=drafter, servers=2, max_new_tokens=6)
        assert dsi_run.token_ids == ar.token_ids, len(prompt)
