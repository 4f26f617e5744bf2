"""Latency profiles and acceptance estimation on tiny models."""


import numpy as np
import pytest

from helpers import BYTE_VOCAB, MarkovLM, byte_tokenizer, random_prompt, tiny_model
from speculant import cli, latency
from speculant.analysis.acceptance import estimate, geometric_fit, position_counts
from speculant.config import SamplingConfig
from speculant.errors import ConfigError
from speculant.latency import LatencyProfile, profile_model


def test_geometric_fit_and_position_counts():
    flags = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=bool)
    assert geometric_fit([flags]) == pytest.approx((2.0, 2 / 3))  # 6 matches, 3 rejections: the trailing run of 3 is censored
    reached, matched = position_counts(flags, 3)
    # Position 0 is reached from every start; position 1 from starts whose first token matched.
    assert reached.tolist() == [9, 5, 2] and matched.tolist() == [6, 3, 1]


def test_self_drafting_agrees_everywhere_and_other_models_rarely():
    target = tiny_model("llama", 0, 64)
    prompts = [random_prompt(s, 64, 8) for s in range(3)]
    same, other = estimate(target, [target.share(), tiny_model("llama", 99, 64)], prompts, 20, SamplingConfig())
    assert same.agreement == 1.0 and same.per_position == [1.0] * 8 and same.geometric_rate > 0.95
    assert other.agreement < 0.5
    (other,) = estimate(target, [tiny_model("llama", 99, 64)], prompts, 20, SamplingConfig(temperature=1.0))
    assert other.agreement < 0.5 and other.geometric_rate == pytest.approx(1 - 1 / (1 + other.mean_run))
    assert 0 < other.expected_sampling_acceptance < 1
    (deep,) = estimate(target, [target.share()], prompts, 20, SamplingConfig(), depth=10**12)  # (was 16 TB of zeros)
    assert deep.per_position == [1.0] * 20  # every position of the replies, none past them


def test_acceptance_counts_the_positions_past_a_drafters_cache_as_mismatches():
    """A drafter of the target's weights in 8 positions, after a prompt of 4: it predicts the 5 tokens its cache
    holds, as the target, and no more (it was run past its cache, which crashed); after a prompt of 12, none."""
    from helpers import tiny_transformer

    from speculant.models.backends.static import StaticCausalLM, StaticWeights

    def model(positions):
        return StaticCausalLM(StaticWeights(tiny_transformer("llama", 1, 64, init_std=0.1)), name=f"tiny-{positions}",
                              span=positions, width=4)

    target, drafter = model(64), model(8)
    for temperature in (0.0, 1.0):
        (short,) = estimate(target, [drafter], [random_prompt(1, 64, 4)], 10, SamplingConfig(temperature=temperature))
        assert short.positions == 10 and short.agreement == 0.5 and short.per_position[0] == 0.5
        if temperature:
            assert short.expected_sampling_acceptance == pytest.approx(0.5, abs=1e-5)
        (long,) = estimate(target, [drafter], [random_prompt(1, 64, 12)], 10, SamplingConfig(temperature=temperature))
        assert long.agreement == 0.0 and long.expected_sampling_acceptance in (None, 0.0)


def test_profile_measures_and_round_trips(tmp_path):
    model = tiny_model("qwen2", 0, 64)
    profile = profile_model(model, [random_prompt(1, 64, 10)], [1, 4, 8], context_len=20, repeats=2)
    assert set(profile.forward_s) == {1, 4, 8} and profile.ttft_s > 0 and profile.tpot_s > 0
    assert min(profile.forward_s.values()) <= profile.cost(2) <= max(profile.forward_s.values())
    path = tmp_path / "p.json"
    profile.save(path)
    assert LatencyProfile.load(path) == profile
    drafter_path = tmp_path / "d.json"
    LatencyProfile("d", "", "cpu", 20, 0.01, 0.005, {1: 0.005}).save(drafter_path)
    code = cli.main(["simulate", "run", "--target-profile", str(path), "--drafter-profile", str(drafter_path),
                     "--acceptance", "0.8", "--lookahead", "50", "--servers", "50", "--json"])
    assert code == 0
    path.write_text("{}")
    with pytest.raises(ConfigError):
        LatencyProfile.load(path)


def test_a_machine_profile_prefills_each_context_it_times_once():
    """The forwards a machine profile times after a context run on the prefill it timed of that context (on a CPU
    the long context's prefill is most of a profile's time): a warm-up, the short context, the catch-up's one
    cached token and the long context, each prefilled once."""
    prefilled, cached = [], set()

    class Counted(MarkovLM):
        def prefill(self, ids):
            prefilled.append(len(ids))
            return super().prefill(ids)

        def forward(self, ids, positions=None, tree=None):
            cached.add(self.cache_len)  # what each timed forward (and the catch-up) runs after
            return super().forward(ids, positions, tree)

    profile = latency._measure(Counted(12, 0), repeats=1, progress=False)
    assert sorted(prefilled) == sorted([8, latency.MACHINE_CONTEXT, 1, latency.LONG_CONTEXT])
    assert cached == {latency.MACHINE_CONTEXT, 1, latency.LONG_CONTEXT}
    assert set(profile.forward_s) == set(latency.MACHINE_WIDTHS)
    assert set(profile.long_forward_s) == set(latency.LONG_WIDTHS)


def test_a_machine_profile_of_a_model_of_fewer_positions_than_the_widest_width_extrapolates_the_rest():
    """A model of 12 positions holds a forward of 10 after 2 tokens: the widths past 10 are extrapolated, not run
    past its cache (the profile had run a forward of 16, which crashed `auto`, its default method, as it profiled)."""
    from helpers import tiny_transformer

    from speculant import generate
    from speculant.models.backends.static import StaticCausalLM, StaticWeights

    module = tiny_transformer("llama", 1, 64, init_std=0.1)
    model = StaticCausalLM(StaticWeights(module), name="tiny-12", span=12, width=4)
    assert model.max_positions == 12
    profile = latency._measure(model, repeats=1, progress=False)
    assert profile.context_len == 2 and set(profile.forward_s) == set(latency.MACHINE_WIDTHS)
    assert profile.forward_s[16] >= profile.forward_s[10] * 16 / 10  # (`interpolated`: chunks of the widest run)
    expected = generate(model, prompt_ids=[5, 9], method="ar", max_new_tokens=6).token_ids
    assert generate(model, prompt_ids=[5, 9], max_new_tokens=6).token_ids == expected


def test_a_malformed_machine_profile_in_the_cache_is_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    model = MarkovLM(12, 0)
    model.identity = "markov-12-0"
    good = latency.machine_profile(model, repeats=1, progress=False)
    assert latency.machine_profile(model, repeats=1, progress=False) == good  # (read back, not measured again)
    path = tmp_path / "machine" / latency.MACHINE_PROFILES
    path.write_text(path.read_text().replace('"long_context_len": ', '"long_context_len": -'))
    with pytest.raises(ConfigError, match="delete the file"):
        latency.machine_profile(model, repeats=1, progress=False)


def test_profile_cli_rejects_bad_widths(capsys):
    assert cli.main(["profile", "--widths", "a-b"]) == 2
    assert "widths" in capsys.readouterr().err


def test_t_of_w_beyond_the_widest_measured_width_never_falls_below_chunks_of_it():
    rising = LatencyProfile("m", "", "cpu", 256, 0.1, 0.01, {1: 0.01, 8: 0.02, 16: 0.04})
    assert rising.cost(4) == pytest.approx(0.01 + 0.01 * 3 / 7) and rising.cost(32) == pytest.approx(0.08)
    flat = LatencyProfile("m", "", "cuda", 256, 0.1, 0.003, {1: 0.003, 12: 0.003, 16: 0.003})  # a GPU's curve
    assert flat.cost(16) == 0.003 and flat.cost(200) == pytest.approx(0.003 * 200 / 16)  # not one forward's cost


def test_acceptance_names_the_numerics_each_model_ran_in(tmp_path, capsys):
    """`speculant acceptance` printed its estimates without the dtype the models ran in (a local model loads in the
    device's fastest exact one, bf16 on some CPUs), which moves sum min(p, q); each model's numerics now lead its
    line. Self-drafting agrees at every position."""
    model = tiny_model("llama", 3, vocab=BYTE_VOCAB, tokenizer=byte_tokenizer())
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text('{"prompt": "abc"}\n')
    assert cli.main(["acceptance", "--target", str(tmp_path / "m"), "--drafter", str(tmp_path / "m"), "--dataset",
                     str(tmp_path / "p.jsonl"), "--max-new-tokens", "6", "--dtype", "fp32", "--backend", "hf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"target {tmp_path / 'm'} (fp32)\n") and f"{tmp_path / 'm'} (fp32): " in out, out
    assert "agreement 100.0%" in out, out
