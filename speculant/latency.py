"""Latency profiles of a model (needs torch and the model): TTFT, TPOT and the forward cost T(W) of W
new tokens at a given context length, saved as JSON that simulators, planners and tree drafters read."""

from __future__ import annotations

import json
import math
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path

from speculant.cache import read_text
from speculant.config import LEAST_LATENCY_MS, MOST_LATENCY_MS, as_integer, as_number
from speculant.errors import ConfigError
from speculant.json_text import json_fault


def interpolated(widths: Sequence[float], times: Sequence[float], width: float) -> float:
    """T(W) from T at ascending `widths`: linear between them; beyond them, along the last segment but never below
    T(widest) per token of it (a curve flat at its end, such as a GPU's, would make a 200-token catch-up cost one
    forward, or a tree's nodes past the widest free to verify; a forward can always run as chunks of the widest).
    Plain Python: `auto` asks this hundreds of times per step, and numpy's interp costs twice as much."""
    if width > widths[-1]:
        b, tb = widths[-1], times[-1]
        slope = max(tb - times[-2], 0.0) / (b - widths[-2]) if len(widths) > 1 else 0.0
        return max(tb + slope * (width - b), tb * width / b)
    i = bisect_left(widths, width)
    if i == 0 or i == len(widths):
        return float(times[min(i, len(widths) - 1)])
    a, b = widths[i - 1], widths[i]
    return float(times[i - 1] + (times[i] - times[i - 1]) * (width - a) / (b - a))


@dataclass
class LatencyProfile:
    model: str
    dtype: str
    device: str
    context_len: int
    ttft_s: float  # median prefill time over the prompts
    tpot_s: float  # median one-token decode time
    forward_s: dict[int, float] = field(default_factory=dict)  # W -> median time of W new tokens
    long_context_len: int | None = None  # a second, longer context, where attention weighs more
    long_ttft_s: float | None = None  # the prefill of that many tokens
    long_forward_s: dict[int, float] = field(default_factory=dict)  # W -> time of W new tokens after it
    catch_up_rows_s: float | None = None  # a catch-up on context_len - 1 rows after one cached (`catch_up_s`)

    def cost_at(self, width: float, length: int) -> float:
        """T(W, L): T(W) after `length` cached tokens, from T(W) at `context_len` and at `long_context_len`, linear in
        L between and beyond them (attention reads every cached key for each new token; the rest does not depend on
        L), never below T(W) at `context_len`; T(W) alone where no long context was measured."""
        base = self.cost(width)
        if not self.long_forward_s or length <= self.context_len:
            return base
        widths, growths = self._growth
        i = bisect_left(widths, width)  # the measured width nearest: the growth per cached token of it
        near = min(range(max(i - 1, 0), min(i + 1, len(widths))), key=lambda j: abs(widths[j] - width))
        return base * (1.0 + growths[near] * (length - self.context_len))

    @cached_property
    def _growth(self) -> tuple[list[int], list[float]]:
        """The long context's widths, ascending, and T(W)'s relative growth per cached token at each (`auto` asks
        `cost_at` for every candidate draft length of every step)."""
        widths = sorted(self.long_forward_s)
        span = self.long_context_len - self.context_len
        return widths, [max(self.long_forward_s[w] / self.cost(w) - 1.0, 0.0) / span for w in widths]

    def prefill_s(self, tokens: int) -> float:
        """A prefill of `tokens` new tokens onto an empty cache: a * n + b * n^2 through (context_len, ttft_s) and
        (long_context_len, long_ttft_s) (each token's attention reads the tokens before it); where a token costs less
        in the longer prompt (a GPU's fixed cost per call), the line through both; linear in n where no long prefill
        was measured."""
        n1, t1 = self.context_len, self.ttft_s
        if self.long_ttft_s is None or not self.long_context_len:
            return t1 * tokens / n1
        n2, t2 = self.long_context_len, self.long_ttft_s
        b = (t2 / n2 - t1 / n1) / (n2 - n1)
        if b < 0:
            return max(t1 + max(t2 - t1, 0.0) / (n2 - n1) * (tokens - n1), 0.0)
        a = t1 / n1 - b * n1
        return max(a * tokens + b * tokens * tokens, 0.0)

    def catch_up_s(self, keep: int, lag: int) -> float:
        """A catch-up on `lag` tokens after `keep` cached ones (`CausalLM.catch_up`: a forward of its rows, the output
        head for the last only). Up to the widest measured W, T(lag) after the keys its rows read on average
        (`cost_at`); beyond it, linear from there to the measured catch-up of context_len - 1 rows (a CPU's rows
        share each weight's reads, a GPU's curve is flat), then per row as that, plus each row's attention to the
        keys past those it read there, at the long forward's cost per key and row."""
        measured, times = self._curve
        if lag <= measured[-1] or self.catch_up_rows_s is None:
            return self.cost_at(lag, keep + lag // 2) if lag else 0.0
        rows, widest = self.context_len - 1, measured[-1]  # (measured only where rows > widest)
        base = times[-1] + (self.catch_up_rows_s - times[-1]) * (lag - widest) / (rows - widest) if lag <= rows \
            else self.catch_up_rows_s * lag / rows
        if not self.long_forward_s:
            return base
        widths, growths = self._growth  # per cached token, relative to T(W): per key and row at the widest
        per_key = growths[-1] * self.cost(widths[-1]) / widths[-1]
        return base + lag * per_key * max(keep + lag / 2 - rows / 2, 0.0)

    def prefills(self, keep: int, lag: int) -> bool:
        """Whether a cache that keeps `keep` positions of a context and lacks `lag` more catches up sooner by a
        prefill of the whole context than by a catch-up on the rest (`models.base.resync`), by these costs: a
        catch-up's rows read the cache one by one, a prefill's attention runs as blocks, so a long catch-up loses
        even where much is kept. A prefill costs at least a forward of as many rows up to the widest measured
        (`prefill_s`, linear below the measured prompt, does not floor a short one: a GPU's is flat there)."""
        if lag <= 0:
            return False
        rows = min(keep + lag, max(self.forward_s))
        return max(self.prefill_s(keep + lag), self.cost(rows)) < self.catch_up_s(keep, lag)

    def cost(self, width: float) -> float:
        """T(W) from the measured widths (`interpolated`)."""
        return interpolated(*self._curve, width)

    @cached_property
    def _curve(self) -> tuple[list[int], list[float]]:
        """The measured widths, ascending, and their times (a profile's widths are fixed once measured)."""
        widths = sorted(self.forward_s)
        return widths, [self.forward_s[w] for w in widths]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def from_dict(cls, data: dict) -> LatencyProfile:
        """What `save` wrote; a ValueError naming a value no measurement gives (a file edited, or another's)."""
        if not isinstance(data, dict):
            raise ValueError(f"a profile is a JSON object, not {type(data).__name__}")
        names = {f.name: f.default is MISSING and f.default_factory is MISSING for f in fields(cls)}  # -> required
        if missing := next((name for name, required in names.items() if required and name not in data), None):
            raise KeyError(missing)
        if unknown := next((name for name in data if name not in names), None):
            raise ValueError(f"a profile has no field {json.dumps(unknown)[:60]}")
        times: dict[str, dict[int, float]] = {}  # forward_s, long_forward_s: width -> seconds
        for name in ("forward_s", "long_forward_s"):
            if not isinstance(data.get(name, {}), dict):
                raise ValueError(f"{name} must map widths to seconds, got {data[name]!r}")
            times[name] = {}
            for width, seconds in data.get(name, {}).items():  # (keys as `save` writes them: "01", read as 1, took
                if width_of(width) is None or as_number(seconds) is None:  # one of two widths' times unsaid)
                    raise ValueError(f"{name} must map widths (whole numbers as written: 1, 16) to numbers of "
                                     f"seconds, got {json.dumps(width)[:40]}: {json.dumps(seconds)[:40]}")
                times[name][width_of(width)] = float(seconds)
        profile = cls(**dict(data, **times))
        seconds = {"ttft_s": profile.ttft_s, "tpot_s": profile.tpot_s,
                   **{f"forward_s[{w}]": t for w, t in profile.forward_s.items()},
                   **{f"long_forward_s[{w}]": t for w, t in profile.long_forward_s.items()},
                   **{name: getattr(profile, name) for name in ("long_ttft_s", "catch_up_rows_s")
                      if getattr(profile, name) is not None}}  # (measured only with a long context, or rows)
        for name, value in seconds.items():
            if not LEAST_LATENCY_MS / 1000 <= (as_number(value) or 0) < math.inf:
                raise ValueError(f"{name} must be a number of seconds >= {LEAST_LATENCY_MS / 1000:g}, got {value!r}")
        for name in ("tpot_s", "ttft_s"):  # (what a simulation takes as a forward's latency, as its flags do)
            if getattr(profile, name) > MOST_LATENCY_MS / 1000:
                raise ValueError(f"{name} is at most {MOST_LATENCY_MS / 1000:g} s, got {getattr(profile, name)!r}")
        if not profile.forward_s:
            raise ValueError("forward_s holds no width's time")
        narrowest = min([*profile.forward_s, *profile.long_forward_s])
        if narrowest < 1:
            raise ValueError(f"a width must be >= 1 token, got {narrowest}")
        counts = {"context_len": profile.context_len, **({"long_context_len": profile.long_context_len}
                                                         if profile.long_context_len is not None else {})}
        for name, value in counts.items():
            if (as_integer(value) or 0) < 1:
                raise ValueError(f"{name} must be a count of tokens >= 1, got {value!r}")
        if profile.long_forward_s and profile.long_context_len is None:
            raise ValueError("long_forward_s needs the long_context_len it was measured after")
        if profile.long_context_len is not None and profile.long_context_len <= profile.context_len:
            raise ValueError(f"long_context_len must exceed context_len {profile.context_len}, "
                             f"got {profile.long_context_len!r}")
        return profile

    @classmethod
    def load(cls, path: Path) -> LatencyProfile:
        try:
            text = read_text(path, MOST_PROFILE_BYTES)
            if fault := json_fault(text):  # (a key given twice: the last won unsaid)
                raise ValueError(f"{fault[0] or 'the profile'}: {fault[1]}")
            return cls.from_dict(json.loads(text))
        except KeyError as error:
            raise ConfigError(f"cannot read latency profile {path}: it has no field {error} (not a `speculant "
                              "profile` JSON file?)") from None
        except (OSError, ValueError, TypeError, RecursionError) as error:
            raise ConfigError(f"cannot read latency profile {path}: {type(error).__name__}: {error}") from None


def width_of(key: object) -> int | None:
    """A profile's width as `save` writes it (JSON's key: its digits, no leading zero) or `asdict` leaves it (an
    int); None for anything else."""
    if isinstance(key, str):
        return int(key) if key.isascii() and key.isdigit() and str(int(key)) == key else None
    return as_integer(key)


MOST_PROFILE_BYTES = 1 << 20  # a profile file's size at most (its widths' times are a few kilobytes)
DECODE_STEPS = 4  # the forwards of one token timed after each prompt (TPOT)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def profile_model(model, prompts: list[list[int]], widths: list[int], context_len: int, repeats: int = 3,
                  dtype: str = "") -> LatencyProfile:
    """Measure a CausalLM: median TTFT over `prompts`, median TPOT over DECODE_STEPS per prompt, and
    the median T(W) over `repeats` at `context_len` cached tokens (after one warm-up forward)."""
    if not prompts or not widths or context_len < 1:
        raise ConfigError("profiling needs prompts, widths and a positive context length")
    check_room(model, prompts)
    model.prefill(prompts[0][:8])
    model.forward(prompts[0][:2])
    ttfts, tpots = [], []
    for ids in prompts:
        ttfts.append(_timed(lambda: model.prefill(ids)))
        for step in range(DECODE_STEPS):
            tpots.append(_timed(lambda: model.forward([ids[step % len(ids)]])))
    context = (sum(prompts, []) * (context_len // max(1, sum(map(len, prompts))) + 1))[:context_len]
    model.prefill(context)
    return LatencyProfile(model.name, dtype, str(model.device), context_len, statistics.median(ttfts),
                          statistics.median(tpots), forward_costs(model, context, widths, repeats))


def check_room(model, prompts: list[list[int]]) -> None:
    """Refuse prompts that, with DECODE_STEPS decoded after them, do not fit `model`'s positions (what
    `profile_model` would time beyond them)."""
    longest = max(map(len, prompts), default=0)
    if model.max_positions is not None and longest + DECODE_STEPS > model.max_positions:
        raise ConfigError(f"a prompt of {longest} tokens and {DECODE_STEPS} decoded after it exceed {model.name}'s "
                          f"{model.max_positions} positions")


def forward_costs(model, context: list[int], widths: Sequence[int], repeats: int = 3,
                  done: Callable[[], object] = lambda: None) -> dict[int, float]:
    """T(W): the median seconds of a forward of W new tokens after `context`, which the model's cache holds (the
    caller's prefill, often one it timed: a long context's prefill is the dearest step of a machine profile), for
    each W; the cache holds `context` again after each (`done` is called after each)."""
    costs = {}
    for width in widths:
        new = (context * (width // len(context) + 1))[:width]
        samples = []
        for _ in range(repeats):
            samples.append(_timed(lambda: model.forward(new)))
            model.rollback(len(context))
        costs[width] = statistics.median(samples)
        done()
    return costs


MACHINE_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # what `auto` chooses draft lengths from
MACHINE_CONTEXT = 256
LONG_CONTEXT = 2048  # T(W) measured again after this many cached tokens, at LONG_WIDTHS: T(W, L) (`cost_at`)
LONG_WIDTHS = (1, 2, 4, 8, 16)
PROFILE_VERSION = 3  # of what a machine profile holds: a profile of an older one is measured again
MACHINE_PROFILES = "profiles.json"


def profile_key(model) -> str | None:
    """What a measured T(W) depends on: the weights and their numerics, the kernel, the device, the
    threads, the CPU, torch and the widest exact forward. None for a model without an identity (built in
    memory): never cached."""
    import torch

    from speculant.machine import cpu_info

    identity = getattr(model, "identity", None)
    if identity is None:
        return None
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else cpu_info()[0]
    return (f"{identity}|{getattr(model, 'numerics', '')}|{getattr(model, 'kernel', '')}|{model.device}|"
            f"{torch.get_num_threads()} threads|{where}|torch {torch.__version__}|"
            f"rows exact up to {getattr(model, 'width', None)}|"  # llama.cpp: forwards past it run in chunks
            f"profile {PROFILE_VERSION}")


def machine_profile(model, repeats: int = 3, progress: bool = True) -> LatencyProfile:
    """T(W) of `model` on this machine for W in MACHINE_WIDTHS, and again at LONG_WIDTHS after LONG_CONTEXT tokens,
    measured once (about a second per width for a 1.5B model and its long prefill, with a progress bar on stderr)
    and remembered in the speculant cache for models
    loaded by name (a model built in memory is measured every call: a `Session` keeps what it measured);
    `speculant profile` shows it."""
    from speculant.cache import cache_root, remembered
    from speculant.models.base import owner_of

    model = owner_of(model)
    key = profile_key(model)
    if key is None:
        return _measure(model, repeats, False)
    known = remembered(f"machine/{MACHINE_PROFILES}", key, lambda: asdict(_measure(model, repeats, progress)))
    try:
        return LatencyProfile.from_dict(known)
    except (ValueError, KeyError, TypeError) as error:  # an edited or corrupted file
        raise ConfigError(f"the machine profile of {model.name} in {cache_root() / 'machine' / MACHINE_PROFILES} is "
                          f"malformed ({type(error).__name__}: {error}): delete the file to measure again") from None


def _measure(model, repeats: int, progress: bool) -> LatencyProfile:
    import sys

    from tqdm import tqdm

    room = getattr(model, "max_positions", None)  # a short cache profiles at the context it can hold, and
    fit = [w for w in MACHINE_WIDTHS if room is None or w < room] or [1]  # the widths it holds after a token
    length = MACHINE_CONTEXT if room is None else max(1, min(MACHINE_CONTEXT, room - max(fit)))
    long = LONG_CONTEXT if room is None else min(LONG_CONTEXT, room - max(LONG_WIDTHS))
    context = [(7919 * i + 11) % model.vocab_size for i in range(max(length, long))]
    label = f"profiling {model.name} ({getattr(model, 'numerics', '')}, {getattr(model, 'kernel', '')}) once on this machine"
    steps = len(fit) + 1 + (len(LONG_WIDTHS) + 1 if long > 2 * length else 0)
    with tqdm(total=steps, desc=label, disable=not progress, file=sys.stderr, leave=False) as bar:
        model.prefill(context[:min(8, length)])  # warm-up
        ttft = _timed(lambda: model.prefill(context[:length]))
        bar.update()
        measured = forward_costs(model, context[:length], fit, repeats, done=bar.update)
        seconds = [measured[w] for w in fit]  # (the widths past them extrapolated: `interpolated`)
        costs = {w: measured[w] if w in measured else interpolated(fit, seconds, w) for w in MACHINE_WIDTHS}
        catch_up = None
        if length - 1 > max(MACHINE_WIDTHS):
            model.prefill(context[:1])
            catch_up = _timed(lambda: model.catch_up(context[1:length]))
        profile = LatencyProfile(model.name, getattr(model, "numerics", ""), str(model.device), length, ttft,
                                 costs[1], costs, catch_up_rows_s=catch_up)
        if long > 2 * length:  # (a cache too short for a long context keeps T(W) alone)
            profile.long_context_len = long
            profile.long_ttft_s = _timed(lambda: model.prefill(context[:long]))
            bar.update()
            profile.long_forward_s = forward_costs(model, context[:long], LONG_WIDTHS, repeats, done=bar.update)
    return profile
