"""Adaptive speculation: every step chooses the drafter, the method (a chain, a token tree of some
width, or a cascade) and the draft length that maximise expected goodput, accepted tokens per second, from
per-position acceptance estimated online and forward costs measured on this machine; plain decoding
(k = 0) when no draft pays, with a periodic re-probe.

Goodput of a draft of k steps from a drafter with conditional acceptance a_1, a_2, ... (a_j: the chance
that the step-j token is accepted given that steps 1..j-1 were):
    G(k) = (1 + sum_{j<=k} prod_{i<=j} a_i) / (k t_draft + T(1 + k w))
with T(W) the target's forward over W tokens, t_draft the drafter's cost per step and w the nodes each
step adds (1: a chain; w > 1: an equal-growth token tree, Yggdrasil, whose w candidates per step raise
a_j where the verifier's T(W) is flat) (Leviathan et al. 2023, Eq. 1 and Theorem 3.8, with measured
costs instead of a constant ratio; vLLM's adaptive draft length uses the same goodput). Plain decoding
has G = 1 / T(1). T(W) and t_draft come from a machine profile measured once (T(W) at two context lengths, so
T(W, L) follows the cached length L), rescaled by what this process's forwards take now (`Rescaled`, `Timings`,
`Scale`). A deterministic, model-free drafter (Max-Gram) proposes
first, for nothing, and its draft is judged by the estimates for its match length. Whatever is chosen,
verification is the usual chain or tree verification, so output stays lossless.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count, islice
from typing import Any

import torch

from speculant.config import SamplingConfig
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.decoding.step import Verified, until_eos, verify_step
from speculant.drafters.base import Draft
from speculant.models.base import CausalLM, common_prefix_len
from speculant.models.wrappers.metered import Usage, metered
from speculant.sampling import next_token
from speculant.trees.stage import Ahead, StageRecord
from speculant.trees.tree import TokenTree

PLAIN = "plain"
CARRY_OVER = 4.0  # observations per draft position a new generation's estimates start with, at the long-run rates
LONG_RUN = 0.995  # decay of the long-run estimates: over the last few hundred drafts, of many texts
TEXT_AGE = 8  # a new text ages the long-run estimates as this many drafts would (`Acceptance.restart`)
PROMISE_WEIGHT = 4.0  # observations of one half beside a drafter's long-run first-position acceptance (`promise`)
COST_FOLLOWS = 0.2  # how far a measured candidate's cost estimate moves toward each draft's cost
PROBE_SHARE = 0.1  # probes that brought no drafter back may cost at most this share of a generation's plain time
LOOK_FIRST = 4  # steps a text shows before a drafter's catch-up dearer than PROBE_SHARE of the rest is paid
TIME_FOLLOWS = 0.2  # how far a measured/profiled time ratio moves toward each forward's
SCALE_RANGE = (0.5, 2.0)  # a forward's measured/profiled ratio is clipped to this: drift, not a spike
PACE_STEPS = 32  # auto compares its own pace over this many recent steps with plain decoding's T(1) per token
PACE_MARGIN = 1.02  # ... and decodes plainly for the rest of a generation where it was this much slower
PACE_FIRST = 8  # plain steps in a row read early, without waiting for PACE_STEPS
PACE_HOST = 1.05  # ... stopping the choosing where they took over this many times their own forwards
NEGLIGIBLE = 1e-3  # a draft position less likely than this to be accepted is not weighed (`expected_tokens`)
REST_STEPS = 4  # steps after a model candidate lost to plain decoding before it is weighed again (a model draft: next)
LENGTH_BUCKET = 64  # a served target's T(W, L) is worked out again when the context crosses a multiple of this
SAFE_SHARE = 0.05  # catch_up="safe": a catch-up waits until it costs at most this share of the reply's plain time
CATCH_UP_QUANTILE = 0.25  # a drafter's catch-up is repaid over the tokens a reply adds at this quantile of replies


@dataclass
class Scale:
    """How much longer one kind of forward takes now than its machine profile says, followed with
    exponential forgetting: a profile is measured once per machine, and a shared machine's speed drifts
    between hours, mostly for every model alike (`Timings.speed`) and partly by different amounts for
    the target's widths and its drafters (what decides whether a draft pays). Unobserved: 1."""

    value: float = 1.0
    seen: bool = False

    def observe(self, measured_s: float, profiled_s: float) -> None:
        if profiled_s <= 0 or measured_s <= 0:
            return
        ratio = min(max(measured_s / profiled_s, SCALE_RANGE[0]), SCALE_RANGE[1])
        self.value = ratio if not self.seen else self.value + TIME_FOLLOWS * (ratio - self.value)
        self.seen = True


class Timings:
    """How this process's target forwards compare with the target's machine profile: `speed`, followed over
    every forward whatever its width, is how much slower the machine runs now than when it was profiled (a
    shared machine's drift, which the drafters' forwards share); per verified width, the ratio left after
    it (the profile's own error at that width). A width never verified takes the nearest verified width's.

    A plain step, T(1), is estimated no dearer than the width verified last (`plain_ceiling`; a forward of fewer
    tokens costs no more). Width 1's own ratio may be stale (last followed in another stretch of the machine's
    speed, it kept the part of that stretch's drift `speed` had not yet followed) or the profile's noise where T(W)
    is flat (a GPU's, or a static backend's padded width: T(1) measured above T(3)). Left dear, plain decoding looks
    slower than a draft that is never accepted, that draft goes on being chosen, width 1 is never timed again to
    correct it, and `AutoPolicy.pace`, which compares with T(1), does not see the loss. The ceiling caps what is
    read, not the ratio: once the wider width's own estimate rises again (its first sample, or one taken while
    `speed` lagged, can be low), so does T(1)'s."""

    def __init__(self) -> None:
        self.speed = Scale()
        self.scales: dict[int, Scale] = {}
        self.widths: list[int] = []
        self.plain_ceiling = math.inf  # width 1's ratio at most: the last wider width's estimate, in its units

    def at(self, width: float) -> float:
        if not self.widths:
            return self.speed.value
        i = bisect_left(self.widths, width)
        nearest = min(self.widths[max(i - 1, 0):i + 1], key=lambda w: abs(w - width))
        scale = self.scales[nearest].value
        return self.speed.value * (min(scale, self.plain_ceiling) if nearest == 1 else scale)

    def observe(self, width: int, measured_s: float, profiled: Callable[[int], float]) -> None:
        """Follow a forward of `width` tokens that took `measured_s`, where `profiled(W)` is the profile's T(W) now."""
        if width not in self.scales:
            self.scales[width] = Scale()
            insort(self.widths, width)
        profiled_s = profiled(width)
        self.speed.observe(measured_s, profiled_s)
        self.scales[width].observe(measured_s, profiled_s * self.speed.value)
        if width == 1:
            self.plain_ceiling = math.inf  # timed itself: its own ratio holds
        elif 1 in self.scales and self.scales[width].seen:
            self.plain_ceiling = self.scales[width].value * profiled_s / profiled(1)


class Rescaled:
    """The target's T(W, L) from its machine profile (`LatencyProfile.cost_at`) at the `length` of the context now
    cached (set by the policy every step), times what `timings` measured so far: the profile follows the context's
    length, the timings the machine's drift and the profile's own error."""

    def __init__(self, profiled: Callable[[float, int], float], timings: Timings | None = None):
        self.profiled = profiled
        self.timings = timings if timings is not None else Timings()
        self.length = 0

    def __call__(self, width: float) -> float:
        return self.profiled(width, self.length) * self.timings.at(width)

    def observe(self, width: int, seconds: float) -> None:
        self.timings.observe(width, seconds, lambda w: self.profiled(w, self.length))


@dataclass
class Acceptance:
    """Per-position conditional acceptance of one drafter, estimated with exponential forgetting: each
    observation of a position scales its counts by `decay` first, so estimates follow the text. Beside them,
    long-run counts (`LONG_RUN`) over many texts: what a new text starts from (`restart`), rather than how
    the last text happened to end."""

    prior: float
    weight: float = 1.0  # pseudo-observations of the prior
    decay: float = 0.95
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    long_reached: list[float] = field(default_factory=list)
    long_accepted: list[float] = field(default_factory=list)

    def rate(self, j: int) -> float:
        """a_{j+1}: acceptance of draft position j (0-based) given the positions before it were accepted."""
        return next(islice(self.rates(), j, None))

    def rates(self) -> Iterator[float]:
        """a_1, a_2, ..., each computed only when asked for. Position 0 starts from the prior; each deeper one from the
        estimate of the position before it, worth what a new text carries over (`CARRY_OVER` observations): a position
        not yet reached is like the one before (so that drafts grow where acceptance is high: the first longer draft
        shows whether it holds), and one that was reached a few times, in another text, does not hold drafts short in
        this one (a single rejection of a probe's second token would otherwise keep every later draft at one token,
        whose verification never shows the second position again)."""
        rate, weight = self.prior, self.weight
        for j in count():
            accepted, reached = (self.accepted[j], self.reached[j]) if j < len(self.reached) else (0.0, 0.0)
            rate = (accepted + rate * weight) / (reached + weight)
            weight = CARRY_OVER
            yield rate

    def expected_tokens(self, most: int) -> list[float]:
        """For k = 0..most, 1 + expected accepted tokens of a k-token draft: what one verification commits; cut
        before the first position whose chance of being reached and accepted is below `NEGLIGIBLE` (the first is
        always kept): a longer draft adds less than that per token and is not weighed, so a drafter that is never
        right is weighed at one or two lengths, not at every length up to k_max (on a GPU's few-ms step, time)."""
        totals, run = [1.0], 1.0
        for rate in islice(self.rates(), most):  # (a position past the cut is never computed)
            run *= rate
            if run < NEGLIGIBLE and len(totals) > 1:
                break
            totals.append(totals[-1] + run)
        return totals

    def promise(self) -> float:
        """How likely this drafter is to be worth a probe, from its long-run first-position acceptance (with
        `PROMISE_WEIGHT` observations of one half beside them): 1 for a drafter not yet seen or whose first token is
        accepted half the time or more; near 0 for one that many texts have shown is never right (random weights,
        another language), whose probes then cost next to nothing (on a GPU, where a forward takes a few ms, even one
        probe's catch-up weighs as much as many plain steps). The weight keeps one text's few failed probes from
        starving every later text's probe of its budget."""
        if not self.long_reached:
            return 1.0
        return min(1.0, 2 * (self.long_accepted[0] + PROMISE_WEIGHT / 2) / (self.long_reached[0] + PROMISE_WEIGHT))

    def restart(self, observations: float) -> None:
        """A new text: the long-run rates, counted as at most `observations` drafts per position, so that
        what the new text shows soon outweighs them. The long-run counts age by `TEXT_AGE` drafts' decay: a drafter
        that many texts showed never right, and so no longer probed (its `promise`, and with it its probe budget, near
        0), is probed again after some texts rather than never again in the session."""
        age = LONG_RUN ** TEXT_AGE
        self.long_reached = [age * r for r in self.long_reached]
        self.long_accepted = [age * a for a in self.long_accepted]
        self.reached = [min(r, observations) for r in self.long_reached]
        self.accepted = [a / r * n if r else 0.0
                         for a, r, n in zip(self.long_accepted, self.long_reached, self.reached)]

    def observe(self, drafted: int, n_accepted: int) -> None:
        for j in range(min(n_accepted + 1, drafted)):  # positions the verifier looked at
            if j == len(self.reached):
                self.reached.append(0.0)
                self.accepted.append(0.0)
            if j == len(self.long_reached):
                self.long_reached.append(0.0)
                self.long_accepted.append(0.0)
            self.reached[j] = self.decay * self.reached[j] + 1
            self.accepted[j] = self.decay * self.accepted[j] + (j < n_accepted)
            self.long_reached[j] = LONG_RUN * self.long_reached[j] + 1
            self.long_accepted[j] = LONG_RUN * self.long_accepted[j] + (j < n_accepted)


@dataclass
class Candidate:
    """One way `auto` may draft: `step_s` seconds per drafting step (0 for a model-free drafter, which then
    proposes before the choice: `match` tells how much context its draft follows); `width` nodes per step:
    1 drafts a chain, more a token tree (`drafter` is then a TreeDrafter). A `measured` candidate's cost
    per drafted token varies with the text (a cascade's reviews of Max-Gram drafts) or is known only from its drafts
    (a user's Drafter: their time): `step_s` then follows what its drafts cost. A candidate that `needs_match` (a
    cascade over Max-Gram) is considered only where a model-free candidate matches the context."""

    name: str
    drafter: Any
    step_s: float
    prior: float
    match: Callable[[list[int]], int] | None = None
    estimates: dict[int, Acceptance] = field(default_factory=dict)  # by match-length bucket (0: model drafters)
    width: int = 1
    measured: bool = False
    needs_match: bool = False
    catch_up: Callable[[list[int]], float] | None = None  # seconds to bring its cache up to a context
    chain: Candidate | None = None  # a tree's: the chain of the same drafter, whose draft is the tree's first children
    scale: Scale = field(default_factory=Scale)  # its drafter's time over its profile's, beyond `speed`'s
    speed: Scale = field(default_factory=Scale)  # the machine's drift, measured on the target (`Timings`)
    load: Callable[[], int] | None = None  # a served request's: how many rows its target's batches hold now
    growth: Callable[[int], float] | None = None  # its step's cost after L cached tokens over its profiled cost
    length: int = 0  # the context's length now (set by the policy every step)
    break_evens: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)  # by (load, most, L bucket)

    @property
    def drift(self) -> float:
        """How much longer its drafter's forwards take now than profiled: the machine's, then its own."""
        return self.speed.value * self.scale.value

    @property
    def cost_s(self) -> float:
        """Seconds per drafting step as measured now (a measured candidate's `step_s` already is), after the
        context's `length` (its drafter's T(W, L) over T(W): `growth`)."""
        return self.step_s if self.measured else self.step_s * self.drift * self._grown()

    def _grown(self) -> float:
        return self.growth(self.length) if self.growth is not None else 1.0

    def catch_up_s(self, context: list[int]) -> float:
        return self.catch_up(context) * self.drift if self.catch_up is not None else 0.0

    def hopeless(self, cost: Callable[[int], float], most: int) -> bool:
        """Whether, at a served target's current load, not even drafts that are always accepted would beat plain
        decoding (`break_even`; a batch of 16 rows verifying 2 tokens each costs nearly twice a plain batch). The
        break-even cost per step is remembered per load, draft length and context-length bucket (`Batched`'s), so
        that under load a model drafter costs a lookup per step instead of its weighing on every row of every
        step, whatever its drift. A measured candidate's cost follows its drafts: never."""
        if self.load is None or self.measured:
            return False
        key = (self.load(), most, self.length // LENGTH_BUCKET)
        if key not in self.break_evens:
            self.break_evens[key] = break_even(cost, most, self.width)
        return self.cost_s >= self.break_evens[key]

    def acceptance(self, bucket: int = 0) -> Acceptance:
        return self.estimates.setdefault(bucket, Acceptance(MATCH_PRIORS.get(bucket, self.prior)))

    def observe_cost(self, usage: dict[str, Any], steps: int, lag: int) -> None:
        """Follow what a draft of `steps` drafting steps cost (`usage`: its drafters' metered forwards), begun
        `lag` tokens behind the context: a measured candidate's cost per step, or else its drafter's scale.
        A draft that began by catching up on more than a verification's leftovers says little of a step."""
        seconds = sum(u.seconds for u in usage.values())
        if self.measured and steps and not self.step_s:  # its first draft: what it costs, from nothing known
            self.step_s = seconds / steps
        elif self.measured and steps:  # a stall counts as SCALE_RANGE's slowest: drift, not a spike
            self.step_s += COST_FOLLOWS * (min(seconds / steps, SCALE_RANGE[1] * self.step_s) - self.step_s)
        elif steps and lag <= 2 and self.step_s > 0:
            self.scale.observe(seconds / steps, self.step_s * self.speed.value * self._grown())


MATCH_PRIORS = {1: 0.3, 2: 0.5, 3: 0.7, 4: 0.85}  # acceptance before any observation, by bucket


def match_bucket(length: int) -> int:
    """Max-Gram drafts after a longer match are likelier right: estimate them apart (<= 2, 3-5, 6-15, 16+
    matched tokens); 0 means no match."""
    return 0 if length == 0 else 1 if length <= 2 else 2 if length <= 5 else 3 if length <= 15 else 4


def first_children_accepted(tree: TokenTree, emitted: list[int]) -> tuple[int, int]:
    """(drafted, accepted) of the chain a greedy tree drafter's tree holds - from the root, each node's first
    child, its likeliest - as greedy verification would have judged it, `emitted` being the tokens the target
    emitted after the tree's root (the accepted path, then its own token). While a tree drafts, this keeps its
    chain's estimates current, so that auto goes back to the chain where that pays more."""
    path = tree.first_child_path()
    return len(path), common_prefix_len(path, emitted)


class Batched:
    """T(W) as seen by one of `rows()` requests whose forwards a server batches, taking the others to draft
    alike: the batch runs rows x W tokens, scaled so that plain decoding still costs T(1). Where T(W) is
    flat a batch of drafts costs little more than one; under load a draft competes with the other
    requests' tokens and stops paying, and plain decoding takes over. It follows the context's `length` as the
    drafters' costs do (`Rescaled`'s T(W, L)); a served target's T(W) otherwise stays as profiled while it is served
    (its forwards time whole batches, so nothing observes them)."""

    def __init__(self, cost: Rescaled, rows: Callable[[], int]):
        self.cost, self.rows = cost, rows
        self.known: dict[tuple[int, float, int], float] = {}  # by (load, W, length bucket): every row of every step
        # asks for the same few values

    @property
    def length(self) -> int:
        return self.cost.length

    @length.setter
    def length(self, value: int) -> None:
        self.cost.length = value

    def __call__(self, width: float) -> float:
        n, cost = max(self.rows(), 1), self.cost
        key = (n, width, cost.length // LENGTH_BUCKET)
        if key not in self.known:
            self.known[key] = cost(n * width) * cost(1) / cost(n)
        return self.known[key]


def batched_catch_up(catch_up: Callable[[list[int]], float], cost: Callable[[int], float],
                    rows: Callable[[], int]) -> Callable[[list[int]], float]:
    """A drafter's catch-up on the context as one of `rows()` requests a server batches sees it, in
    `Batched`'s terms: every row waits while it runs (a prompt's prefill runs alone; a lagging cache adds
    its tokens to the batch's drafter forward), and the others, taken to catch up alike, make each row wait
    `rows()` times as long, in forwards that cost T(rows) where plain decoding is counted at T(1)."""

    def shared(context: list[int]) -> float:
        n = max(rows(), 1)
        return catch_up(context) * n * cost(1) / cost(n)

    return shared


def break_even(cost: Callable[[int], float], most: int, width: int = 1) -> float:
    """The most seconds a drafting step may cost for drafts that are always accepted to beat plain decoding: k
    steps of `width` nodes then emit 1 + k tokens in k s + T(1 + k width), plain decoding in (1 + k) T(1), so
    s must stay below ((1 + k) T(1) - T(1 + k width)) / k for some k = 1..most."""
    return max(((1 + k) * cost(1) - cost(1 + k * width)) / k for k in range(1, most + 1))


def can_pay(step_s: float, cost: Callable[[int], float], most: int, width: int = 1) -> bool:
    """Whether drafting at `step_s` a step could beat plain decoding at all (`break_even`). A drafter that fails
    this is never worth its cost (nor its cache: it would catch up on the context every time it is tried)."""
    return step_s < break_even(cost, most, width)


def best_length(acceptance: Acceptance, step_s: float, cost: Callable[[int], float], most: int,
                width: int = 1, catch_up_s: float = 0.0, remaining: int = 1) -> tuple[float, int]:
    """(goodput, k) of the best draft length 1..most that `expected_tokens` weighs (steps of `width` nodes). A
    drafter whose cache lags the context first spends `catch_up_s` on it: a cost the `remaining` tokens of the
    generation share, so a step is charged its tokens' part of it."""
    expected = acceptance.expected_tokens(most)
    return max((expected[k] / (k * step_s + cost(1 + k * width) + catch_up_s * expected[k] / max(remaining, 1)), k)
               for k in range(1, len(expected)))


def expected_remaining(lengths: Sequence[float], produced: int, budget: int, quantile: float | None = None) -> float:
    """Tokens a generation that has produced `produced` of at most `budget` is expected to add: the mean of
    what earlier generations that got past `produced` added after it (`lengths`: inf for one that ran to its
    own budget, cut at this one's), or the whole rest of the budget where none did. A short reply to a short
    question thus does not count on the budget to repay a drafter's prefill; a long one earns it as it goes.
    With `quantile` q, what a q-quantile of them added instead: where a cost is paid once and lost if the reply
    ends early (a drafter's catch-up), auto counts on the short replies, not the average one."""
    later = sorted(min(length, budget) - produced for length in lengths if length > produced)
    if not later:
        return float(budget - produced)
    return later[int(quantile * (len(later) - 1))] if quantile is not None else sum(later) / len(later)


@dataclass(frozen=True)
class StepPlan:
    """One step as the policy chose it: draft `k` steps with `candidate` (None: plain decoding); a lookup
    drafter's `draft`, already made to be judged, and its match-length `bucket`; how far its drafter's cache
    was `behind` the context when chosen."""

    candidate: Candidate | None
    k: int = 0
    draft: Draft | None = None
    bucket: int = 0
    behind: int = 0


class AutoPolicy:
    """`auto`'s choices for one generation, apart from running them (`auto_decoder` runs each step it plans).

    `choose` weighs every candidate's expected goodput (`best_length`) against plain decoding's 1 / T(1) and plans the
    best, or a probe. A model candidate that lost to plain decoding is weighed again `REST_STEPS` steps later, or at the
    step after a model draft, which moves the acceptance estimates: what else it is weighed by (the machine's speed, the
    context's length, the tokens left to repay a catch-up) rarely moves much in a few steps, and weighing a losing
    candidate at every step is host time that a GPU's few-ms step feels. The probe: after `probe_every` steps without
    any model drafter, the model drafter likeliest to be accepted drafts two tokens, so that one that stopped paying can
    come back when the text changes. A generation starts with a probe; one that does not bring the drafter back doubles
    the wait before the next, and the probes since a drafter last paid may cost (catching up, drafting, the wider
    verification) at most `PROBE_SHARE` of the generation's plain decoding time, times the drafter's `promise` (its
    long-run acceptance): where no drafter pays, a generation is at most that much slower than plain decoding, and once
    earlier texts have shown a drafter never right, its probes cost next to nothing (on a GPU, where a forward takes a
    few ms, a probe's catch-up weighs as much as many steps). A drafter's catch-up is weighed against the tokens the
    generation is still expected to produce, from the `lengths` of earlier generations (this one's is appended at its
    `end`; their lower quartile, `CATCH_UP_QUANTILE`: a catch-up is lost where the reply ends early), less the share
    that model-free drafts have committed so far (where Max-Gram copies an article into its summary, a model drafter is
    left few tokens to repay its catch-up on the article); a catch-up dearer than `PROBE_SHARE` of that time waits
    `LOOK_FIRST` steps, until the text has shown what free drafts commit. With `catch_up="safe"` no reply is counted on:
    a catch-up waits until it would cost at most `SAFE_SHARE` of the reply were the reply to end after the step (a
    reply's length is unknown before it ends; replies shorter than what a catch-up needs to be repaid over are where
    `auto` runs slower than plain decoding).

    `observe` learns from each step: acceptance per candidate, and, where `cost` is `Rescaled` (measured seconds),
    every verification's time rescales it (its `Timings`, whose `speed` the candidates share) and every draft's its
    candidate's `scale`. `pace` keeps auto's own pace there: once it has timed a plain step, if its last
    `PACE_STEPS` steps took over `PACE_MARGIN` times T(1) per token they committed (its own work of choosing and
    Max-Gram's lookups included, which no estimate counts; not steps whose drafter first caught up on more than a
    step's tokens, an investment paid once), it decodes plainly to the end of the generation. Sooner where its last
    `PACE_FIRST` steps were all plain and took over `PACE_HOST` times their own forwards: beyond the forward, such a
    step holds auto's choosing and the draw `ar` makes too, and a few-ms step (a GPU's) makes the choosing a loss no
    draft is likely to repay. That reading needs no estimate of T(1) (early in a generation it may lag the machine);
    steps that drafted, whose acceptance varies far more than a step's time, and plain steps that choosing slows by
    a few percent (a CPU's tens of ms: a plain stretch before a drafter pays again), wait for the whole window."""

    def __init__(self, candidates: list[Candidate], cost: Callable[[int], float], max_new_tokens: int,
                 k_max: int = 16, probe_every: int = 16, lengths: deque[float] | None = None,
                 catch_up: str = "expected"):
        self.candidates = sorted(candidates, key=lambda c: c.match is None)  # model-free first: they tell `matched`
        self.cost, self.max_new_tokens, self.k_max, self.probe_every = cost, max_new_tokens, k_max, probe_every
        self.lengths = lengths
        self.safe = catch_up == "safe"  # a catch-up waits until this reply, ending now, would repay it (SAFE_SHARE)
        self.learn_costs = isinstance(cost, Rescaled)  # (not where a server batches the forwards: they time the batch)
        self.wait = probe_every  # steps without a model draft before the next probe
        self.probed = 0.0  # estimated seconds spent on probes since a model drafter last paid on its own
        self.without_model = self.wait  # a new text starts with a probe: its drafts' acceptance is measured
        self.free = 0  # tokens this generation committed through model-free drafts: a model drafter is left the rest
        self.steps = 0
        self.recent: deque[tuple[float, int]] = deque(maxlen=PACE_STEPS)  # (seconds, tokens) of the last steps
        self.plain: deque[tuple[float, float]] = deque(maxlen=PACE_FIRST)  # (seconds, its forward's): plain in a row
        self.forward_s: float | None = None  # the last step's forward, where it was plain
        self.governed = False  # slower than plain decoding over the recent steps: plain to the end of this generation
        self.resting: dict[int, int] = {}  # model candidate -> the step from which it is weighed again
        for candidate in candidates:  # estimates may come from earlier generations: a new text, a new start
            for estimate in candidate.estimates.values():
                estimate.restart(CARRY_OVER)

    def choose(self, context: list[int], produced: int, eos: frozenset[int]) -> StepPlan:
        """The step after `context`, of which the generation `produced` the last tokens."""
        cost = self.cost
        if isinstance(cost, (Rescaled, Batched)):
            cost.length = len(context)  # T(W, L): verification after this many cached tokens
        for candidate in self.candidates:
            candidate.length = len(context)  # and drafting
        room = min(self.k_max, self.max_new_tokens - produced - 1)
        plain = 1 / cost(1)  # plain decoding's goodput
        best: tuple[float, Candidate | None, int, Draft | None, int] = (plain, None, 0, None, 0)
        matched = False
        remaining = expected_remaining(self.lengths or (), produced, self.max_new_tokens)
        repays = expected_remaining(self.lengths or (), produced, self.max_new_tokens, CATCH_UP_QUANTILE)
        # under load, a served model drafter that could not pay even if always right is neither weighed nor probed
        weighed = [c for c in self.candidates if c.match is not None or not c.hopeless(cost, self.k_max)]
        catch_ups: dict[int, float] = {}  # by candidate, where asked for: its cache compared with the context once

        def catch_up_s(candidate: Candidate) -> float:
            if id(candidate) not in catch_ups:
                catch_ups[id(candidate)] = candidate.catch_up_s(context)
            return catch_ups[id(candidate)]

        def most(candidate: Candidate) -> int:
            """The longest draft it may be weighed at: the step's room, cut to what its drafter can hold."""
            bound = candidate.drafter.most(context)
            return room if bound is None else min(room, bound)

        def allowed(candidate: Candidate) -> bool:
            """With catch_up="safe": were the reply to end after this step, the catch-up would cost at most
            SAFE_SHARE of it."""
            return not self.safe or catch_up_s(candidate) <= SAFE_SHARE * cost(1) * (produced + 1)

        for candidate in weighed if room > 0 else ():
            if candidate.needs_match and not matched:
                continue
            if candidate.match is not None:  # model-free: its draft is known before choosing
                bucket = match_bucket(candidate.match(context))
                matched = matched or bucket > 0
                if bucket and (draft := until_eos(candidate.drafter.propose(context, room), eos)).tokens:
                    goodput, k = best_length(candidate.acceptance(bucket), 0.0, cost, len(draft.tokens))
                    if goodput > best[0]:
                        best = (goodput, candidate, k, Draft(draft.tokens[:k], None, draft.usage), bucket)
            elif self.resting.get(id(candidate), 0) <= self.steps and (longest := most(candidate)) > 0 and \
                    allowed(candidate):
                catch_up = catch_up_s(candidate)
                if catch_up > PROBE_SHARE * cost(1) * repays and self.steps < LOOK_FIRST:
                    continue  # a large catch-up waits until the text has shown what free drafts commit
                goodput, k = best_length(candidate.acceptance(), candidate.cost_s, cost, longest, candidate.width,
                                         catch_up, repays * (1 - self.free / produced))
                if goodput > best[0]:
                    best = (goodput, candidate, k, None, 0)
                if goodput <= plain:
                    self.resting[id(candidate)] = self.steps + REST_STEPS
        _, chosen, k, draft, bucket = best
        if chosen is not None and chosen.match is None:
            self.wait, self.probed = self.probe_every, 0.0  # a model drafter pays on its own: probes start again
        elif self.without_model >= self.wait and room > 0:  # a probe is due: the model drafter likeliest accepted
            probe = max((c for c in weighed if c.match is None and most(c) > 0 and allowed(c)),
                        key=lambda c: c.acceptance().rate(0), default=None)
            budget = 0.0 if probe is None else \
                PROBE_SHARE * probe.acceptance().promise() * cost(1) * (produced + remaining)
            if self.probed < budget:  # (where it is spent, no price is read: no catch-up compared with the context)
                steps = min(2, most(probe))
                price = catch_up_s(probe) + steps * probe.cost_s + cost(1 + steps * probe.width) - cost(1)
                if self.probed + price <= budget:
                    chosen, k, draft, bucket = probe, steps, None, 0
                    self.wait, self.probed = 2 * self.wait, self.probed + price
        self.without_model = 0 if chosen is not None and chosen.match is None else self.without_model + 1
        return StepPlan(chosen, k, draft, bucket, chosen.drafter.lag(context) if chosen is not None else 0)

    def observe(self, plan: StepPlan, draft: Draft, step: Verified, verify_s: float, greedy: bool) -> None:
        """Learn from a step that ran `plan`'s `draft` (verified as `step`, in `verify_s` seconds of the target)."""
        chosen, n = plan.candidate, len(step.accepted)
        self.steps += 1
        if self.learn_costs:
            self.cost.observe(step.width, verify_s)
        self.forward_s = verify_s if chosen is None else None
        if chosen is None:
            return
        if chosen.match is None:  # a model draft: acceptance estimates moved, so every model candidate is weighed again
            self.resting.clear()
        if draft.tree is not None and chosen.chain is not None and greedy:
            chosen.chain.acceptance().observe(*first_children_accepted(draft.tree, step.tokens))
        if chosen.measured or self.learn_costs:  # (a cascade follows its own cost)
            chosen.observe_cost(draft.usage, step.drafted, 0 if chosen.measured else plan.behind)
        chosen.acceptance(plan.bucket).observe(step.drafted, n)
        self.free += len(step.tokens) if chosen.match is not None else 0

    def pace(self, plan: StepPlan, seconds: float, tokens: int) -> None:
        """Keep auto's own pace over a step of `seconds` that committed `tokens` (see the class docstring)."""
        if self.forward_s is None:  # a draft, counted or not, ends a plain run
            self.plain.clear()
        if self.learn_costs and not self.governed and plan.behind <= self.k_max + 1:  # (a prompt's catch-up: once)
            self.recent.append((seconds, tokens))  # what no estimate sees is in its time
            if self.forward_s is not None:
                self.plain.append((seconds, self.forward_s))
            self.governed = (len(self.plain) == PACE_FIRST and
                             sum(s for s, _ in self.plain) > PACE_HOST * sum(f for _, f in self.plain)) or \
                (len(self.recent) == PACE_STEPS and 1 in self.cost.timings.scales and
                 sum(s for s, _ in self.recent) > PACE_MARGIN * self.cost(1) * sum(t for _, t in self.recent))
            if self.governed:  # nothing more to choose from, nor to probe: plain steps
                self.candidates = []

    def end(self, produced: int) -> None:
        """The generation ended after `produced` tokens: its length joins those `expected_remaining` reads."""
        if self.lengths is not None and produced:  # one that ran to its budget might have gone on: as long as any
            self.lengths.append(produced if produced < self.max_new_tokens else math.inf)


def adaptive(
    target: CausalLM,
    candidates: list[Candidate],
    prompt_ids: list[int],
    max_new_tokens: int,
    cost: Callable[[int], float],
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    k_max: int = 16,
    probe_every: int = 16,
    lengths: deque[float] | None = None,
    schedule: str = "serial",
    catch_up: str = "expected",
) -> Decoder:
    """Lossless speculation that re-chooses drafter and draft length every step (`cost` is the target's T(W) in
    seconds): `AutoPolicy` chooses, `auto_decoder` runs."""
    policy = AutoPolicy(candidates, cost, max_new_tokens, k_max, probe_every, lengths, catch_up)
    return auto_decoder(target, policy, prompt_ids, max_new_tokens, sampling, generator, schedule)


def auto_decoder(target: CausalLM, policy: AutoPolicy, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingConfig, generator: torch.Generator | None, schedule: str = "serial") -> Decoder:
    """The decoder around a policy: every step drafts as it plans, verifies (`verify_step`) and tells it what
    happened. Whatever is chosen, verification is the usual chain or tree verification: output stays lossless.
    With `schedule="stage"` (Yggdrasil's stage-based scheduling, `trees.stage`), while the target verifies a
    tree, its drafter drafts the next one from the likeliest path; the next step takes it where the policy
    chooses that tree candidate again after exactly that context, else it is dropped."""
    stats = GenerationStats(method="auto")
    out: list[int] = []
    target = metered(target)
    logits = target.prefill(prompt_ids)
    pending = [next_token(logits, sampling, generator)]
    stage = schedule == "stage"
    aheads: dict[int, Ahead] = {}  # per tree candidate (its drafter): its thread, where stage scheduling is on
    try:
        while not (yield from emit(pending, out, max_new_tokens, target.eos_token_ids)):
            if policy.governed:  # plain decoding to the end, as `ar` runs it: no choosing, no bookkeeping
                pending = [next_token(target.forward(pending[-1:])[-1], sampling, generator)]
                stats.record_draft(0, 0, {})
                stats.choices.append(PLAIN)
                continue
            began = time.perf_counter()  # (a step's own time: not the caller's between tokens)
            context = prompt_ids + out
            for ahead in aheads.values():  # every drafter's cache its own again before choosing reads them
                ahead.wait()
            plan = policy.choose(context, len(out), target.eos_token_ids)
            chosen = plan.candidate
            ahead_draft = None  # the chosen tree candidate's tree drafted ahead; any other's is dropped (room -1)
            for key, ahead in aheads.items():
                mine = chosen is not None and key == id(chosen.drafter)
                ahead_draft = ahead.take(context, plan.k if mine else -1) or ahead_draft
            if plan.draft is not None:
                draft = plan.draft
            elif chosen is None:
                draft = Draft([])
            elif ahead_draft is not None:
                draft = ahead_draft
            else:
                proposing = time.perf_counter()
                draft = until_eos(chosen.drafter.propose(context, plan.k), target.eos_token_ids)
                if chosen.measured and not draft.usage:  # a user's drafter, metering nothing: its time is its cost
                    draft.usage = {chosen.name: Usage(0, 1, time.perf_counter() - proposing)}
            if stage and chosen is not None and draft.tree is not None and len(draft.tree) > 1:
                if id(chosen.drafter) not in aheads:
                    aheads[id(chosen.drafter)] = Ahead(chosen.drafter, stats.record_usage)
                aheads[id(chosen.drafter)].start(context, draft.tree, plan.k, chosen.width, None)
            before = target.usage.seconds  # (a draft may run the target: self-speculation)
            step = verify_step(target, out[-1], draft, sampling, generator)
            if chosen is not None:
                chosen.drafter.observe(len(step.accepted))
            policy.observe(plan, draft, step, target.usage.seconds - before, sampling.greedy)
            stats.record_draft(step.drafted, len(step.accepted), draft.usage)
            stats.drafted_nodes += step.width - 1 if draft.tree is not None else 0
            stats.choices.append(chosen.name if chosen is not None else PLAIN)
            pending = step.tokens
            policy.pace(plan, time.perf_counter() - began, len(pending))
    finally:  # (also where its caller stopped reading: at an end-of-sequence token, a stop string, a cancel)
        for ahead in aheads.values():
            ahead.close()
        stats.stage = sum((ahead.record for ahead in aheads.values()), StageRecord()) if aheads else None
        policy.end(len(out))
    stats.new_tokens = len(out)
    stats.record_target(target.usage)
    return stats
