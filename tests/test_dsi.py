"""Distributed speculative inference: greedy output equals autoregressive output with every executor,
under random twin latencies, through server deaths; Theorem 1 in the twin; sampling keeps p; planning."""

import random
from functools import partial

import pytest
import torch

from helpers import DEVICES, perturbed, random_prompt, tiny_model
from speculant import generate
from speculant.config import SamplingConfig
from speculant.decoding.dsi.engine import DrafterFailed, dsi
from speculant.decoding.dsi.executors import ServerSpec, hf_replica, make_executor, replica_factory
from speculant.decoding.dsi.jobs import Job, ServerDied, TargetServer
from speculant.analysis.online import run, simulate_online
from speculant.decoding.dsi.plan import plan
from speculant.decoding.dsi.timeline import plot_timeline
from speculant.decoding.dsi.twin import Latency, OracleLM, PaddedModel, SyntheticDrafter
from speculant.decoding.autoregressive import autoregressive
from speculant.drafters.model import ModelDrafter
from speculant.errors import ConfigError
from test_sampling import assert_follows_target, sampling_pair

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
    for seed in range(4):
        target, drafter, prompt = pair(seed, device=device)
        pool = make_executor("thread", ServerSpec(replica_factory(target), [device] * servers, GREEDY))
        tokens, stats = run_dsi(pool, drafter, prompt, 40, lookahead, close=True)
        assert tokens == reference(target, prompt, 40), f"seed {seed}"
        assert stats.dsi.lookahead == lookahead and len(stats.dsi.servers) == servers
        assert sum(s.used for s in stats.dsi.servers) >= 1


def test_greedy_dsi_equals_autoregressive_under_random_twin_latencies():
    """Random latencies reorder every event (results overtaking each other, drafts racing results)."""
    rng = random.Random(0)
    for trial in range(10):
        target, drafter, prompt = pair(trial, noise=rng.choice([0.1, 0.3, 1.0]))
        servers, lookahead = rng.randint(1, 3), rng.choice([1, 3, 5])
        latency = Latency(rng.uniform(0, 0.006), rng.uniform(0.001, 0.006))
        pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * servers, GREEDY, latency))
        tokens, _ = run_dsi(pool, drafter, prompt, 30, lookahead, Latency(0, rng.uniform(0, 0.003)), close=True)
        assert tokens == reference(target, prompt, 30), f"trial {trial}"


def test_one_executor_serves_many_generations_and_stops_at_eos():
    target, drafter, prompt = pair(7)
    pool = make_executor("thread", ServerSpec(replica_factory(target), ["cpu"] * 2, GREEDY, Latency(0.002, 0.002)))
    pool.start()
    try:
        for seed in range(3):
            target_s, drafter_s, prompt_s = pair(7 + seed)
            expected = reference(target, prompt_s, 25)
            assert run_dsi(pool, drafter_s, prompt_s, 25, 3)[0] == expected
        eos = reference(target, prompt, 20)[9]
        tokens = run(dsi(pool, ModelDrafter(drafter, GREEDY, None), prompt, 20, 3, GREEDY, None, frozenset({eos})))[0]
        assert tokens[-1] == eos and tokens == reference(target, prompt, 20)[: len(tokens)]
    finally:
        pool.close()


def test_server_catches_up_and_rolls_back_its_cache():
    """A job carries the whole sequence; the server runs only what its cache lacks, rolls back where
    the cache disagrees, and its rows equal a fresh computation."""
    target = tiny_model("qwen2", 3, VOCAB)
    server = TargetServer(0, target.share(), GREEDY)
    seq = random_prompt(3, VOCAB, 16)
    first = server.run(Job(0, tuple(seq[:10]), 6))
    assert first.rows_start == 6 and first.rows == 5
    changed = seq[:8] + [(seq[8] + 1) % VOCAB] + seq[9:]
    second = server.run(Job(1, tuple(changed), 12))
    assert second.rows_start == 9  # rolled back to the common prefix, 8 tokens, and re-ran from there
    fresh = tiny_model("qwen2", 3, VOCAB)
    for position, token in zip(range(second.rows_start, len(changed) + 1), second.tokens):
        assert token == int(fresh.prefill(changed[:position]).argmax())


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


class FailingDrafter:
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
    with pytest.raises(DrafterFailed, match="out of memory"):
        run(dsi(pool, failing, prompt, 40, 2, GREEDY, None, frozenset(), timeout_s=30))


def test_theorem_1_dsi_is_never_slower_than_non_si_in_the_twin():
    """Drafter faster than the target, worst case (a drafter that is always wrong) and a middling one:
    DSI's wall time stays within overhead of non-SI's (Timor et al., Theorem 1)."""
    for acceptance in (0.0, 0.5):
        target_latency = Latency(0.02, 0.02)
        servers = 4
        lookahead = plan(servers, None, 0.02, 0.005).lookahead
        pool = make_executor("thread", ServerSpec(partial(oracle_server, seed=1), ["cpu"] * servers, GREEDY, target_latency))
        pool.start()
        try:
            prompt = [1, 2, 3]
            expected, non_si = run(autoregressive(PaddedModel(OracleLM(100, 1), target_latency), prompt, 30, GREEDY, None))
            drafter = SyntheticDrafter(OracleLM(100, 1), acceptance, 0.005, seed=1)
            tokens, stats = run(dsi(pool, drafter, prompt, 30, lookahead, GREEDY, None, frozenset(), close_executor=False))
        finally:
            pool.close()
        assert tokens == expected
        assert stats.wall_s <= non_si.wall_s * 1.1 + 0.02, f"a = {acceptance}"


def test_preemption_cuts_twin_forwards_short():
    """Cancelling a job stops its padded forward at once: most preempted bars end well before 30 ms."""
    pool = make_executor("thread", ServerSpec(partial(oracle_server, seed=2), ["cpu"] * 5, GREEDY, Latency(0.03, 0.03)))
    drafter = SyntheticDrafter(OracleLM(100, 2), 0.7, 0.003, seed=2)
    _, stats = run(dsi(pool, drafter, [1, 2, 3], 40, 2, GREEDY, None, frozenset()))
    preempted = [bar for bar in stats.dsi.bars if bar.outcome == "preempted"]
    assert preempted and sum(bar.end - bar.start < 0.025 for bar in preempted) > len(preempted) / 2


def oracle_server(device, seed):
    return OracleLM(100, seed)


def test_simulate_online_beats_si_and_non_si_on_paper_like_settings():
    result = simulate_online(20, 2, 0.8, servers=5, tokens=30, repeats=2)
    assert result["identical_outputs"]
    assert result["dsi_speedup_over_non_si"] > 1.5
    assert result["dsi_speedup_over_si"] > 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_with_dsi_keeps_the_target_distribution(device):
    target, drafter, prompt = sampling_pair(31, device=device)
    assert_follows_target(target, prompt, method="dsi", drafter=drafter, servers=2, lookahead=2)


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


def test_process_executor_equal_output_and_survives_a_killed_server():
    target, drafter, prompt = pair(41, noise=0.1)
    spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * 2, GREEDY,
                      Latency(0.003, 0.003))
    pool = make_executor("process", spec)
    pool.start()
    try:
        for seed, lookahead in ((41, 1), (42, 3), (43, 5)):
            _, drafter_s, prompt_s = pair(seed, noise=0.1)
            assert run_dsi(pool, drafter_s, prompt_s, 30, lookahead)[0] == reference(target, prompt_s, 30)
        stream = dsi(pool, ModelDrafter(drafter, GREEDY, None), prompt, 40, 2, GREEDY, None, frozenset(), timeout_s=60,
                     close_executor=False)
        tokens = [next(stream) for _ in range(8)]
        pool.kill(1)  # a real SIGKILL mid-generation
        tokens += run(stream)[0]
    finally:
        pool.close()
    assert tokens == reference(target, prompt, 40)


@pytest.mark.parametrize("executor", ["process", "ray"])
def test_greedy_dsi_equals_autoregressive_on_every_executor(executor):
    """N in {1, 2, 3} (Ray: 3, its actors take seconds each to start; the test below runs 2) and lookahead
    in {1, 3, 5}, one pool per N serving every lookahead, random twin latencies to shake out races."""
    if executor == "ray":
        pytest.importorskip("ray")
    rng = random.Random(7)
    target = tiny_model("llama", 61, VOCAB)
    for servers in (1, 2, 3) if executor == "process" else (3,):
        spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * servers, GREEDY,
                          Latency(rng.uniform(0, 0.004), rng.uniform(0.001, 0.004)))
        pool = make_executor(executor, spec)
        pool.start()
        try:
            for lookahead in (1, 3, 5):
                drafter = perturbed(target, rng.choice([0.1, 0.3]), rng.randrange(1000))
                prompt = random_prompt(rng.randrange(1000), VOCAB, 8)
                tokens = run_dsi(pool, drafter, prompt, 24, lookahead, Latency(0, rng.uniform(0, 0.002)))[0]
                assert tokens == reference(target, prompt, 24), f"{servers} servers, lookahead {lookahead}"
        finally:
            pool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_dsi_servers_on_cuda_for_a_cpu_target(executor):
    """Servers on another device get their own copy of the weights; the caller's target stays put."""
    target, drafter, prompt = pair(71, noise=0.1)
    expected = reference(target, prompt, 30)
    spec = ServerSpec(replica_factory(target), ["cuda"] * 2, GREEDY)
    assert run_dsi(make_executor(executor, spec), drafter, prompt, 30, 3, close=True)[0] == expected
    assert next(target.model.parameters()).device.type == "cpu"


def test_process_server_crash_is_survived():
    target, drafter, prompt = pair(44, noise=0.1)
    spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * 2, GREEDY,
                      die_after={0: 1})
    tokens, stats = run_dsi(make_executor("process", spec), drafter, prompt, 40, 2, close=True)
    assert tokens == reference(target, prompt, 40)
    assert "exited" in stats.dsi.servers[0].lost


def test_ray_executor_equal_output():
    pytest.importorskip("ray")
    target, drafter, prompt = pair(51, noise=0.1)
    spec = ServerSpec(partial(hf_replica, target.model, target.name, frozenset()), ["cpu"] * 2, GREEDY,
                      Latency(0.003, 0.003), die_after={1: 5})
    pool = make_executor("ray", spec)
    pool.start()
    try:
        for seed, lookahead in ((51, 1), (52, 3)):
            _, drafter_s, prompt_s = pair(seed, noise=0.1)
            assert run_dsi(pool, drafter_s, prompt_s, 30, lookahead)[0] == reference(target, prompt_s, 30)
        assert pool.actors  # server 1 died along the way (fault injected) and the output stayed the same
    finally:
        pool.close()
