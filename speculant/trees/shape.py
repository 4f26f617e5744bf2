"""A token tree's shape, `auto` included (Yggdrasil, Guan et al., sections 4 and 5.2): the drafting depth, the
width of each drafting step (by the execution-plan search, then per context) and the verify width, chosen from
profiled forward costs. Without a `speculant profile` of the target, its T(n) and the drafter's are measured once
per model object and session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from speculant.latency import MACHINE_WIDTHS, LatencyProfile, forward_costs, interpolated
from speculant.config import AUTO
from speculant.models.base import CausalLM, owner_of
from speculant.trees.plan import COVERAGE_RANKS, PLAN_DEPTHS, PLAN_WIDTHS, choose_width, rank_coverage, search

AUTO_MAX_DEPTH = 16  # `depth=auto`: the objective stops drafting earlier when another step cannot pay
TARGET_WIDTHS = (1, 2, 4, 8, 16, 32)  # measured T(n); `verify_width=auto` stays within them
COVERAGE_TOKENS = 128  # of the first prompt, teacher forced: the plan's acceptance model

@dataclass(frozen=True)
class TreeShape:
    depth: int  # drafting steps (a cap when `cost` is known: the objective may stop earlier)
    width: int  # nodes per drafting step
    verify_width: int | None  # most drafted nodes verified; None: all
    cost: Callable[[int], float] | None  # the target's T(n) in seconds, for the latency-aware objective
    chooser: WidthChooser | None = None  # `width=auto`: each tree's width chosen after its context


@dataclass(frozen=True)
class WidthChooser:
    """Per context, the drafting width among `widths` that the objective prefers for a tree of at most
    `most_nodes` drafted nodes and `depth` levels (`exact`: of that depth, a predictor's), from the drafter's
    distribution at the tree's root (`plan.choose_width`)."""

    widths: tuple[int, ...]
    target_cost: Callable[[int], float]
    draft_cost: Callable[[int], float]
    most_nodes: int

    def __call__(self, probs: torch.Tensor, depth: int, exact: bool) -> int:
        return choose_width(probs, self.widths, self.target_cost, self.draft_cost, self.most_nodes, depth, exact)


def measured_costs(model: CausalLM, context: list[int], widths: Sequence[int], session: Any) -> dict[int, float]:
    """T(W) of `model` after `context` (its last positions, where the widest forward would run past the model's
    cache) for each W, measured once per model object (after a warm-up) and kept in the `session`'s `measured`
    ({model: {widths: costs}}); a measurement runs the model's cache apart (`Session.ran_apart`). A W the model's
    positions cannot hold after a token of context is never run: its T is extrapolated (`interpolated`)."""
    per_model = session.measured.setdefault(owner_of(model), {})
    if tuple(widths) not in per_model:
        fit = [w for w in widths if model.max_positions is None or w < model.max_positions] or [1]
        if model.max_positions is not None:
            context = context[max(len(context) - (model.max_positions - max(fit)), 0):]
        model.prefill(context)
        forward_costs(model, context, fit[:1], repeats=1)  # warm-up
        costs = forward_costs(model, context, fit, repeats=1)
        seconds = [costs[w] for w in fit]
        per_model[tuple(widths)] = {w: costs[w] if w in costs else interpolated(fit, seconds, w) for w in widths}
        session.ran_apart(model)
    return per_model[tuple(widths)]


def measured_coverage(target: CausalLM, drafter: CausalLM, context: list[int], session: Any) -> list[float]:
    """The drafter's rank coverage of the target (`plan.rank_coverage`) over the last `COVERAGE_TOKENS` tokens of
    `context` (fewer where a model holds fewer positions), teacher forced (one forward of each model over them, the
    last token not run), measured once per pair and kept in the `session`'s `measured` beside their T(W) (the models'
    caches are run apart: `Session.ran_apart`)."""
    per_target = session.measured.setdefault(owner_of(target), {}).setdefault("coverage", WeakKeyDictionary())
    key = owner_of(drafter)  # (weakly: a drafter made after this one died may take its id)
    if key not in per_target:
        held = [model.max_positions + 1 for model in (target, drafter) if model.max_positions is not None]
        text = context[-min([COVERAGE_TOKENS, *held]):]
        if len(text) < 3:  # no position to score: nothing known to pay
            per_target[key] = [0.0] * COVERAGE_RANKS
        else:
            logits = []
            for model in (target, drafter):
                model.prefill(text[:1])
                logits.append(model.forward(text[1:-1]))
                session.ran_apart(model)
            per_target[key] = rank_coverage(*logits)
    return per_target[key]


def plan_width(target: CausalLM, drafter: CausalLM, prompt_ids: list[int], target_cost: Callable[[int], float],
               draft_cost: Callable[[int], float], session: Any, depths: Sequence[int] = PLAN_DEPTHS,
               most_nodes: int = max(MACHINE_WIDTHS) - 1, schedule: str = "serial") -> int:
    """The drafting width of the execution plan (`plan.search`, Yggdrasil 5.2) for this pair at these costs and a
    run of `schedule`, from the drafter's rank coverage of the target on the prompt (`measured_coverage`): 1 where
    chains, or nothing, pay best."""
    coverage = measured_coverage(target, drafter, prompt_ids, session)
    return search(coverage, target_cost, draft_cost, depths, PLAN_WIDTHS, schedule, most_nodes).width


def tree_shape(target: CausalLM, drafter: CausalLM, prompt_ids: list[int], depth: int | str, width: int | str,
               verify_width: int | str | None, profile: LatencyProfile | None, session: Any,
               schedule: str = "serial") -> TreeShape:
    """Resolve `auto` sizes. With a profile or any `auto`, the objective decides how deep to draft (up
    to `depth`) and how many nodes to verify (up to `verify_width`; else the whole tree, within the widest T(W)
    measured here where no profile is given). `width=auto` chooses each tree's width after its context (the
    `chooser`, over PLAN_WIDTHS); the shape's `width` is then the execution plan's for a run of `schedule`
    (`plan_width`), the one a depth predictor assumes before the tree's is chosen. Costs measured here are kept in
    the `session` (`measured_costs`)."""
    auto = AUTO in (depth, width, verify_width)
    cost, most_nodes = (profile.cost, None) if profile is not None else (None, None)
    if cost is None and auto:
        costs = measured_costs(target, prompt_ids, TARGET_WIDTHS, session)
        widths, seconds = list(costs), list(costs.values())
        cost, most_nodes = (lambda n: interpolated(widths, seconds, n)), TARGET_WIDTHS[-1]
    chooser = None
    if width == AUTO:  # the plan's width (a depth predictor's guess), and each tree's own after its context
        draft_costs = measured_costs(drafter, prompt_ids, PLAN_WIDTHS, session)
        draft_cost = draft_costs.__getitem__
        depths = range(1, depth + 1) if isinstance(depth, int) else PLAN_DEPTHS
        nodes = (most_nodes or max(MACHINE_WIDTHS)) - 1  # drafted nodes within the target's measured T(W)
        width = plan_width(target, drafter, prompt_ids, cost, draft_cost, session, depths, nodes, schedule)
        chooser = WidthChooser(PLAN_WIDTHS, cost, draft_cost, nodes)
    if depth == AUTO:
        depth = AUTO_MAX_DEPTH
    if verify_width == AUTO or (verify_width is None and cost is not None):
        widest = max(chooser.widths) if chooser is not None else width
        verify_width = min(depth * widest, most_nodes or depth * widest)
    return TreeShape(depth, width, verify_width, cost, chooser)
