"""Counts returned by every decoder; timing is filled in by `decoding.run.timed` alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """What one generation cost and how speculation fared.

    Per speculation iteration i, `draft_lengths[i]` tokens were proposed and `accepted_lengths[i]`
    of them accepted; each iteration is one target verification forward.
    """

    method: str = "ar"
    new_tokens: int = 0
    target_forwards: int = 0  # the prefill included
    drafter_forwards: dict[str, int] = field(default_factory=dict)
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    drafted_nodes: int = 0  # token trees: all drafted nodes (draft_lengths then holds tree depths)
    ttft_s: float = 0.0
    wall_s: float = 0.0

    def record_draft(self, proposed: int, accepted: int, forwards: dict[str, int]) -> None:
        self.draft_lengths.append(proposed)
        self.accepted_lengths.append(accepted)
        for name, count in forwards.items():
            self.drafter_forwards[name] = self.drafter_forwards.get(name, 0) + count

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification forward: accepted drafts plus the target's own token (tau)."""
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

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
        }

    def summary(self) -> str:
        """One line for humans: tokens, speed, TTFT and, when speculating, acceptance."""
        line = (f"{self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.2f} tok/s, "
                f"TTFT {self.ttft_s:.2f} s, {self.target_forwards} target forwards)")
        if self.acceptance_rate is not None:
            line += (f", mean accepted length {self.mean_accepted_length:.2f}, "
                     f"acceptance {self.acceptance_rate:.0%}")
        return line
