"""Counts returned by every decoder; timing is filled in by `decoding.run.timed` alone."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from speculant.config import as_number
from speculant.theory import swi
from speculant.models.wrappers.metered import Usage

if TYPE_CHECKING:
    from speculant.decoding.dsi.record import DSIRecord


@dataclass
class GenerationStats:
    """What one generation cost and how speculation fared.

    Per speculation iteration i, `draft_lengths[i]` tokens were proposed and `accepted_lengths[i]`
    of them accepted; each iteration is one target verification forward.
    """

    method: str = "ar"
    target: str = ""  # the target's numerics and kernel, e.g. "bf16, amx kernel"
    new_tokens: int = 0
    target_forwards: int = 0  # the prefill included
    drafter_forwards: dict[str, int] = field(default_factory=dict)  # per drafter name, prefills included
    # Incremental forwards (prefills excluded) and their seconds: the measured cost ratios c.
    target_steps: int = 0
    target_seconds: float = 0.0
    drafter_steps: dict[str, int] = field(default_factory=dict)
    drafter_seconds: dict[str, float] = field(default_factory=dict)
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    drafted_nodes: int = 0  # token trees: all drafted nodes (draft_lengths then holds tree depths)
    verified_sizes: list[int] = field(default_factory=list)  # token trees: nodes verified per iteration, after pruning
    tree_shape: tuple[int, int, int | None] | None = None  # token trees: (depth cap, width, verify-width cap)
    tree_widths: list[int] = field(default_factory=list)  # token trees: each tree's first level (auto: per context)
    dsi: DSIRecord | None = None  # DSI: per-server records and the timeline
    choices: list[str] = field(default_factory=list)  # auto: per iteration, the drafter used ("plain": none)
    stage: Any = None  # token trees with stage scheduling: trees.stage.StageRecord (hits, overlap)
    ttft_s: float = 0.0
    wall_s: float = 0.0

    def record_draft(self, proposed: int, accepted: int, usage: dict[str, Usage]) -> None:
        self.draft_lengths.append(proposed)
        self.accepted_lengths.append(accepted)
        self.record_usage(usage)

    def record_usage(self, usage: dict[str, Usage]) -> None:
        """Drafter forwards and their time, per drafter name."""
        for name, u in usage.items():
            self.drafter_forwards[name] = self.drafter_forwards.get(name, 0) + u.forwards
            self.drafter_steps[name] = self.drafter_steps.get(name, 0) + u.steps
            self.drafter_seconds[name] = self.drafter_seconds.get(name, 0.0) + u.seconds

    def record_target(self, usage: Usage) -> None:
        """The target's forwards over the whole generation (a Metered target's usage)."""
        self.target_forwards = usage.forwards
        self.target_steps, self.target_seconds = usage.steps, usage.seconds

    @property
    def cost_ratios(self) -> dict[str, float]:
        """Measured c per drafter: its mean incremental forward time over the target's (prefills excluded)."""
        if not self.target_steps or self.target_seconds <= 0:
            return {}
        per_target = self.target_seconds / self.target_steps
        return {name: self.drafter_seconds[name] / steps / per_target
                for name, steps in self.drafter_steps.items() if steps}

    @property
    def swi(self) -> float | None:
        """Standardized wall-time improvement with the measured cost ratios (CS Drafting, section 5);
        None when the target's forwards are unknown (peers)."""
        if not self.target_forwards:
            return None
        return swi(self.new_tokens, self.target_forwards, self.drafter_forwards, self.cost_ratios)

    @property
    def verified_nodes(self) -> int:
        return sum(self.verified_sizes)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification forward: accepted drafts plus the target's own token (tau; a last step whose
        accepted draft ends at an end-of-sequence token counts the target's token after it, which is not emitted)."""
        if not self.accepted_lengths:
            return 1.0
        return 1.0 + sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; None when nothing was drafted."""
        proposed = sum(self.draft_lengths)
        return sum(self.accepted_lengths) / proposed if proposed else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of drafts, among those that reached position j, whose token j was accepted."""
        rates = []
        for j in range(max(self.draft_lengths, default=0)):
            reached = [(d, a) for d, a in zip(self.draft_lengths, self.accepted_lengths) if d > j and a >= j]
            rates.append(sum(a > j for _, a in reached) / len(reached) if reached else 0.0)
        return rates

    def choice_summary(self) -> str:
        """What `auto` chose, in one phrase: share of steps per choice, mean draft length, switches."""
        steps = len(self.choices)
        parts = []
        for name in dict.fromkeys(self.choices):
            drafts = [d for c, d in zip(self.choices, self.draft_lengths) if c == name]
            share = f"{name} {len(drafts) / steps:.0%}"
            parts.append(share if name == "plain" else f"{share} (k {sum(drafts) / len(drafts):.1f})")
        switches = sum(a != b for a, b in zip(self.choices, self.choices[1:]))
        return f"auto: {', '.join(parts)} of {steps} steps, {switches} switches"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "verified_nodes": self.verified_nodes,
            "cost_ratios": self.cost_ratios,
            "swi": self.swi,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationStats:
        """What `to_dict` wrote, less the DSI and stage records: enough to summarize the generation again. A value
        unlike its field's (a file edited, or not one speculant wrote) is a ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"stats must be an object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls) if f.name not in ("dsi", "stage")}
        read = {name: value for name, value in data.items() if name in known}
        for name, value in read.items():
            if not _like(value, _example(known[name]), known[name].type == "list[str]"):  # (annotations are text)
                raise ValueError(f"stats' {name} cannot be {value!r}")
        stats = cls(**{k: (tuple(v) if k == "tree_shape" and v else v) for k, v in read.items()})
        drafted, accepted = stats.draft_lengths, stats.accepted_lengths
        if len(drafted) != len(accepted) or any(a > d for d, a in zip(drafted, accepted)):
            raise ValueError(f"stats' accepted_lengths {accepted!r:.60} do not go with draft_lengths {drafted!r:.60} "
                             "(one per step, none above it)")
        if stats.ttft_s > stats.wall_s:
            raise ValueError(f"stats' ttft_s {stats.ttft_s} is longer than its wall_s {stats.wall_s}")
        return stats

    def summary(self) -> str:
        """One line for humans: tokens, speed, TTFT and, when speculating, acceptance."""
        line = (f"{self.method}: {self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.2f} tok/s, "
                f"TTFT {self.ttft_s:.2f} s, {self.target_forwards} target forwards{', ' + self.target if self.target else ''})")
        if self.acceptance_rate is not None:
            line += (f", mean accepted length {self.mean_accepted_length:.2f}, "
                     f"acceptance {self.acceptance_rate:.0%}, SWI {self.swi or 0:.2f}")
        if self.tree_shape is not None:  # also when the objective chose to verify nothing
            n = max(len(self.verified_sizes), 1)
            depth, width, verify = self.tree_shape
            widths = self.tree_widths
            shown = f"{sum(widths) / len(widths):.1f} ({min(widths)}-{max(widths)})" if len(set(widths)) > 1 else \
                widths[0] if widths else width  # (each tree's first level: `width=auto` chooses it per tree)
            line += (f", trees: depth {sum(self.draft_lengths) / n:.1f}, {self.verified_nodes / n:.1f} of "
                     f"{self.drafted_nodes / n:.1f} drafted nodes verified "
                     f"(depth <= {depth}, first level {shown}, verify <= {verify or depth * width})")
        if self.stage is not None:
            line += (f", stage: {self.stage.hits} of {self.stage.drafted} trees drafted ahead used, "
                     f"{self.stage.overlap:.0%} of their drafting overlapped")
        if self.dsi is not None:
            line += ", " + self.dsi.summary()
        if self.choices:
            line += ", " + self.choice_summary()
        for name, forwards in self.drafter_forwards.items():
            c = self.cost_ratios.get(name)
            line += f", {name}: {forwards} forwards" + (f" (c = {c:.2f})" if c is not None else "")
        return line


def _example(f: Any) -> Any:
    """A field's default: what its values look like."""
    return f.default_factory() if f.default_factory is not MISSING else None if f.default is MISSING else f.default


def _like(value: Any, example: Any, texts: bool = False) -> bool:
    """Whether a value read back is of its field's kind: text; a count or seconds (finite, >= 0); a list of texts
    (`texts`) or of those; a mapping of those; None or a list (a tree's shape)."""
    if isinstance(example, str):
        return isinstance(value, str)
    if isinstance(example, (int, float)):
        number = as_number(value)
        return number is not None and 0 <= number < math.inf
    if isinstance(example, list):
        return isinstance(value, list) and all(isinstance(v, str) if texts else _like(v, 0) for v in value)
    if isinstance(example, dict):
        return isinstance(value, dict) and all(_like(v, 0) for v in value.values())
    return value is None or isinstance(value, list) and all(v is None or _like(v, 0) for v in value)
