"""Latency profiles: T(W) between and beyond the measured widths, and profiles no measurement gives refused."""

import json
import os

import pytest

from speculant.decoding.dsi.twin import Latency
from speculant.errors import ConfigError
from speculant.latency import LatencyProfile, interpolated


def test_beyond_a_single_profiled_width_each_token_costs_at_least_the_widest_s_share():
    """A forward wider than the widest measured runs as chunks of it: never free, even with one width measured."""
    assert interpolated([4], [0.02], 4) == 0.02
    assert interpolated([4], [0.02], 8) == pytest.approx(0.04)
    assert interpolated([1, 4], [0.01, 0.02], 8) == pytest.approx(0.04)  # (the segment's slope, 1/300 s, is less)
    profile = LatencyProfile("m", "", "cuda", 256, 0.01, 0.003, {16: 0.003})
    assert profile.cost(64) == pytest.approx(0.012)
    assert Latency.from_profile(profile).forward(64) == pytest.approx(0.012)  # the latency twin pads as much
    assert Latency(0.01, 0.003, ((1, 0.003), (4, 0.006))).forward(2) == pytest.approx(0.004)


@pytest.mark.parametrize("change, message", [
    ({"long_context_len": 256, "long_ttft_s": 0.2, "long_forward_s": {"1": 0.02}}, "long_context_len must exceed"),
    ({"long_context_len": 100, "long_ttft_s": 0.2, "long_forward_s": {"1": 0.02}}, "long_context_len must exceed"),
    ({"long_forward_s": {"1": 0.02}}, "long_forward_s needs the long_context_len"),
    ({"forward_s": {"0": 0.01}}, "a width must be >= 1 token, got 0"),
    ({"forward_s": {"-4": 0.01, "1": 0.02}}, r"forward_s must map widths \(whole numbers as written: 1, 16\) to "
                                             r'numbers of seconds, got "-4": 0.01'),
    ({"forward_s": {"1": 0.01, "01": 0.02}}, 'forward_s must map widths .* got "01": 0.02'),  # (read as 1: unsaid,
    # one of two widths' times was taken)
    ({"forward_s": {"1": "0.01"}}, 'forward_s must map widths .* got "1": "0.01"'),
    ({"long_context_len": 2048, "long_forward_s": {"0": 0.02}}, "a width must be >= 1 token, got 0"),
    ({"forward_s": [1]}, r"forward_s must map widths to seconds, got \[1\]"),
])
def test_a_profile_no_measurement_gives_is_refused_in_one_line(change, message, tmp_path):
    data = {"model": "m", "dtype": "fp32", "device": "cpu", "context_len": 256, "ttft_s": 0.1, "tpot_s": 0.01,
            "forward_s": {"1": 0.01, "4": 0.02}, **change}
    with pytest.raises(ValueError, match=message):
        LatencyProfile.from_dict(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"cannot read latency profile {path}: ValueError: {message}"):
        LatencyProfile.load(path)


def test_a_profile_file_with_a_key_given_twice_is_refused(tmp_path):
    """`json` keeps a repeated key's last value without a word (a TPOT edited in twice: the simulation took one)."""
    path = tmp_path / "profile.json"
    path.write_text('{"model": "m", "dtype": "fp32", "device": "cpu", "context_len": 256, "ttft_s": 0.1, '
                    '"tpot_s": 0.01, "tpot_s": 0.5, "forward_s": {"1": 0.01}}')
    with pytest.raises(ConfigError, match="ValueError: tpot_s: a key given twice"):
        LatencyProfile.load(path)


def test_profiling_refuses_a_prompt_the_model_has_no_positions_for():
    """`speculant profile --widths` timed prompts beyond the model's positions (a number of nothing) where `bench`
    refuses them: one line before any forward."""
    from helpers import tiny_model

    from speculant.latency import profile_model

    model = tiny_model("llama", 0)  # (512 positions)
    with pytest.raises(ConfigError, match="a prompt of 510 tokens and 4 decoded after it exceed .* 512 positions"):
        profile_model(model, [[1] * 8, [2] * 510], [1, 2], 16)
    assert profile_model(model, [[2] * 508], [1], 16, repeats=1).ttft_s > 0


def test_a_model_file_is_known_by_what_it_holds_not_by_how_its_path_is_spelled(tmp_path, monkeypatch):
    """A machine profile is kept under the model's identity: a local file by its resolved path and its size and time,
    so one replaced in place (or another file at the same relative path) is measured anew, and one path spelled
    relative, absolute or with `~` is one model (`--target=~/m.gguf`: no shell expands it); int4's group size is part
    of a quantized model's identity."""
    from tiny_gguf import write_tiny_gguf

    from helpers import byte_tokenizer, tiny_transformer
    from speculant.latency import profile_key
    from speculant.models import load_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", 1, "q8_0")
    keys = {spelled: profile_key(load_model(spelled, backend="lean", tokenizer=byte_tokenizer()))
            for spelled in ("m.gguf", str(path), "~/m.gguf")}
    assert len(set(keys.values())) == 1 and None not in keys.values()
    write_tiny_gguf(path, "llama", 2, "q8_0", hidden=128)  # replaced in place
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert profile_key(load_model("m.gguf", backend="lean", tokenizer=byte_tokenizer())) != keys["m.gguf"]
    tiny_transformer("llama", 3, 257).save_pretrained(tmp_path / "hf")
    byte_tokenizer().save_pretrained(tmp_path / "hf")
    groups = {profile_key(load_model("hf@int4", dtype="fp32", group_size=size)) for size in (32, 64)}
    assert len(groups) == 2


def test_a_profile_missing_a_field_names_it(tmp_path):
    """A field missing (another tool's JSON, a profile cut short), one no profile has, or a file without end (read
    without end before; a missing field other than forward_s was the constructor's TypeError)."""
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"forward_s": {"1": 0.01}}))
    with pytest.raises(ConfigError, match=r"cannot read latency profile .*: it has no field 'model' \(not a `"):
        LatencyProfile.load(path)
    data = {"model": "m", "dtype": "fp32", "device": "cpu", "context_len": 256, "ttft_s": 0.1, "tpot_s": 0.01,
            "forward_s": {"1": 0.01}, "tpot": 0.01}
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"cannot read latency profile .*: a profile has no field \"tpot\""):
        LatencyProfile.load(path)
    if os.path.exists("/dev/zero"):
        with pytest.raises(ConfigError, match="/dev/zero: TooLong: /dev/zero holds more than 1048576 bytes"):
            LatencyProfile.load("/dev/zero")
