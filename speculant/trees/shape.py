"""A token tree's shape, `auto` included (Yggdrasil, Guan et al., section 4): the drafting depth, the
width of each drafting step and the verify width, chosen from profiled forward costs. Without a
`speculant profile` of the target, its T(n) and the drafter's are measured once per model object and session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from speculant.latency import LatencyProfile, forward_costs
from speculant.config import AUTO
from speculant.models.base import CausalLM, owner_of

AUTO_MAX_DEPTH = 16  # `depth=auto`: the objective stops drafting earlier when another step cannot pay
TARGET_WIDTHS = (1, 2, 4, 8, 16, 32)  # measured T(n); `verify_width=auto` stays within them
DRAFTER_WIDTHS = (1, 2, 4, 8)  # `width=auto` chooses among these
WIDTH_SLACK = 1.25

@dataclass(frozen=True)
class TreeShape:
    depth: int  # drafting steps (a cap when `cost` is known: the objective may stop earlier)
    width: int  # nodes per drafting step
    verify_width: int | None  # most drafted nodes verified; None: all
    cost: Callable[[int], float] | None  # the target's T(n) in seconds, for the latency-aware objective


def measured_costs(model: CausalLM, context: list[int], widths: Sequence[int], measured: Any) -> dict[int, float]:
    """T(W) of `model` after `context` for each W, measured once per model object (after a warm-up) and kept in
    `measured` ({model: {widths: costs}}, a `Session`'s)."""
    per_model = measured.setdefault(owner_of(model), {})
    if tuple(widths) not in per_model:
        forward_costs(model, context, widths[:1], repeats=1)  # warm-up
        per_model[tuple(widths)] = forward_costs(model, context, widths, repeats=1)
    return per_model[tuple(widths)]


def auto_width(drafter_costs: dict[int, float], slack: float = WIDTH_SLACK) -> int:
    """The widest drafting step that costs the drafter at most `slack` times a one-token step.

    Widening a step adds candidates at almost no drafting cost while the drafter's T(W) is flat; the
    verify-width dynamic program, not the drafter, then bounds what the target pays for them. Where
    T(W) grows with W (bf16 on CPUs without AMX) this gives 1: a chain."""
    return max(w for w, t in drafter_costs.items() if t <= slack * drafter_costs[1])


def tree_shape(target: CausalLM, drafter: CausalLM, prompt_ids: list[int], depth: int | str, width: int | str,
               verify_width: int | str | None, profile: LatencyProfile | None, measured: Any) -> TreeShape:
    """Resolve `auto` sizes. With a profile or any `auto`, the objective decides how deep to draft (up
    to `depth`) and how many nodes to verify (up to `verify_width`, else the whole tree). Costs measured here are
    kept in `measured` (`measured_costs`)."""
    auto = AUTO in (depth, width, verify_width)
    cost, most_nodes = (profile.cost, None) if profile is not None else (None, None)
    if cost is None and auto:
        costs = measured_costs(target, prompt_ids, TARGET_WIDTHS, measured)
        widths, seconds = list(costs), list(costs.values())
        cost, most_nodes = (lambda n: float(np.interp(n, widths, seconds))), TARGET_WIDTHS[-1]
    if width == AUTO:
        width = auto_width(measured_costs(drafter, prompt_ids, DRAFTER_WIDTHS, measured))
    if depth == AUTO:
        depth = AUTO_MAX_DEPTH
    if verify_width == AUTO or (verify_width is None and cost is not None):
        verify_width = min(depth * width, most_nodes or depth * width)
    return TreeShape(depth, width, verify_width, cost)
