"""`tree`: token-tree speculation (SpecInfer; Yggdrasil): equal-growth draft trees verified in one target
forward with tree attention, optionally pruned to the subtree the latency-aware objective prefers."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.cache import readable
from speculant.config import AUTO, REQUEST_MOST, REQUEST_NODES, SCHEDULES, count_or_auto, option
from speculant.errors import ConfigError, OptionError
from speculant.methods.drafting import DrafterOptions
from speculant.methods.registry import Request, register


OBJECTIVES = ("speedup", "length")
SHAPES = ("egt", "sequoia", "nway")  # equal growth, or a static shape of `trees.baselines`


@dataclass(frozen=True)
class TreeOptions(DrafterOptions):
    MODEL_ONLY = "method 'tree'"
    depth: int | str = option(4, "drafting steps per tree, or auto", parse=count_or_auto, most=REQUEST_MOST)
    width: int | str = option(4, "nodes added per drafting step, or auto: each tree's width chosen after its context "
                               "by the latency-aware objective, from the drafter's distribution at the tree's root "
                               "and the costs (the execution plan's width, for the costs and the drafter's agreement "
                               "on the prompt (Yggdrasil 5.2), is the one a depth predictor assumes)",
                               parse=count_or_auto, most=REQUEST_MOST)
    verify_width: int | str | None = option(None, "verify at most this many drafted nodes, the subtree chosen by "
                                            "dynamic programming, or auto (default: all)", parse=count_or_auto,
                                            most=REQUEST_MOST)
    target_profile: Any = option(None, "the target's `speculant profile` JSON: its T(W) lets the latency-aware "
                                 "objective choose tree depth and verify width", parse=Path, operator=True)
    schedule: str = option("serial", "serial, or stage: while the target verifies a tree, the drafter drafts the "
                           "next one on a thread of its own from the likeliest path (Yggdrasil's stage-based "
                           "scheduling)", choices=SCHEDULES)
    objective: str = option("speedup", "speedup: Yggdrasil's latency-aware objective (accepted tokens per second of "
                            "drafting and verification, Eq. 3) decides how deep to draft and which nodes to verify, "
                            "within depth and verify-width, where it knows the costs (a profile or an auto size); "
                            "length: every tree drafted to depth and verified for the most expected accepted tokens "
                            "(within verify-width, auto the same cap as speedup's), the costs left out",
                            choices=OBJECTIVES)
    shape: str = option("egt", "egt: equal-growth trees (Yggdrasil); sequoia: every tree the static shape of depth x "
                        "width nodes that the drafter's rank coverage on the prompt favours (Sequoia); nway: width "
                        "greedy chains of depth nodes from the root's likeliest tokens", choices=SHAPES)
    draft_graph: bool = option(True, "where the drafter's backend grows trees on the device (static) and a tree's "
                               "depth is decided before drafting (a depth predictor, or objective length), its levels "
                               "run in one call, one graph where the drafter is compiled (Yggdrasil); off: level by "
                               "level from Python")
    depth_predictor: Any = option(AUTO, "a depth predictor's JSON, auto (the one `speculant train-depth` made for "
                                  "this target and drafter, if any: hidden-state where the backend gives them) or "
                                  "off", operator=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("depth", "width", "verify_width"):
            value = getattr(self, name)
            if value not in (None, AUTO) and not (isinstance(value, int) and value >= 1):
                raise OptionError(name, f"{name} must be an integer >= 1 or auto, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise OptionError("schedule", f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.shape not in SHAPES:
            raise OptionError("shape", f"shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if self.shape != "egt" and AUTO in (self.depth, self.width):
            raise OptionError("shape",
                              f"shape {self.shape} needs a depth and a width (its nodes: depth x width), not auto")
        if self.objective not in OBJECTIVES:
            raise OptionError("objective", f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        from speculant.latency import LatencyProfile
        from speculant.trees.depth import DepthPredictor

        # The files named are read now, once (a server's requests share what was read): one that is not there or
        # not what it should be is refused before anything loads.
        if isinstance(self.target_profile, (str, Path)):
            object.__setattr__(self, "target_profile", LatencyProfile.load(readable(
                self.target_profile, "target profile", " (make one with `speculant profile --out`)")))
        if isinstance(self.depth_predictor, (str, Path)) and self.depth_predictor not in (AUTO, "off"):
            object.__setattr__(self, "depth_predictor", DepthPredictor.load(readable(
                self.depth_predictor, "depth predictor", " (make one with `speculant train-depth`)")))
        if self.target_profile is not None and not isinstance(self.target_profile, LatencyProfile):
            raise OptionError("target_profile",
                              f"target_profile is a `speculant profile` JSON file or a LatencyProfile, not "
                              f"{type(self.target_profile).__name__}")
        if not isinstance(self.depth_predictor, (str, DepthPredictor)):
            raise OptionError("depth_predictor",
                              f"depth_predictor is auto, off, a predictor's JSON file or a DepthPredictor, not "
                              f"{type(self.depth_predictor).__name__}")
        if self.objective == "length":  # (every tree drafted to its depth, no cost weighed: these would be dropped)
            for name, given in (("depth auto", self.depth == AUTO), ("width auto", self.width == AUTO),
                                ("target-profile", self.target_profile is not None),
                                ("depth-predictor", isinstance(self.depth_predictor, DepthPredictor))):
                if given:  # (named by the objective: a server's client may ask for it beside the operator's others)
                    raise OptionError("objective", f"objective length drafts every tree to its depth with the costs "
                                      f"left out: {name} does not apply (objective speedup weighs them)")

    @property
    def target_needs(self) -> tuple[tuple[str, str, str], ...]:
        """The target's capabilities these options need (`drafting.needs`): its hidden states, for a depth predictor
        that reads them."""
        from speculant.trees.depth import DepthPredictor

        if not (isinstance(self.depth_predictor, DepthPredictor) and self.depth_predictor.inputs == "hidden"):
            return ()
        return (("hidden_states", "this depth predictor reads the target's hidden states", "depth_predictor"),)


def bounds(options: TreeOptions, names: Collection[str]) -> None:
    """A server's client that sizes a tree (names its depth or width) gets at most REQUEST_NODES drafted nodes: each
    level is a drafter forward and the tree one target forward that the other requests wait on. `auto` counts as the
    most it may choose."""
    from speculant.trees.plan import PLAN_WIDTHS
    from speculant.trees.shape import AUTO_MAX_DEPTH

    named = [name for name in ("width", "depth") if name in names]
    depth = AUTO_MAX_DEPTH if options.depth == AUTO else options.depth
    width = max(PLAN_WIDTHS) if options.width == AUTO else options.width
    if named and depth * width > REQUEST_NODES:
        sizes = [f"auto (up to {size})" if given == AUTO else str(size)
                 for given, size in ((options.depth, depth), (options.width, width))]
        raise OptionError(named[0], f"a tree's depth x width is at most {REQUEST_NODES} nodes per request, got "
                          f"{sizes[0]} x {sizes[1]}")


def check_width(width: int | str, model: Any, field: str = "width") -> None:
    """Refuse a width (of option `field`) beyond the drafter's vocabulary: a node's children are its likeliest
    tokens."""
    if width != AUTO and width > model.vocab_size:
        raise OptionError(field, f"{field} {width} exceeds the drafter's vocabulary of {model.vocab_size} tokens")


def loaded(options: TreeOptions, target: Any) -> None:
    """Its loaded drafter, refused where it cannot draft `target`'s trees as the options ask (`drafting_model`)."""
    drafting_model(options.drafter, options, target)


def drafting_model(model: Any, options: TreeOptions, target: Any) -> Any:
    """`model`, checked to draft `target`'s trees (`tree_drafter_model`) as `options` ask: draft_graph off only
    where its backend would draft an equal-growth tree's levels in one call (elsewhere it would change nothing)."""
    model = tree_drafter_model(model, target)
    if not options.draft_graph and options.shape != "egt":  # (a static shape's levels: always one by one)
        raise OptionError("draft_graph", f"draft_graph off applies to equal-growth trees (shape egt); shape "
                          f"{options.shape} drafts its levels one by one already")
    if not options.draft_graph and not model.capabilities.drafts_trees:
        raise OptionError("draft_graph", f"draft_graph off applies where the drafter's backend drafts a tree's levels "
                          f"in one call (static); {model.name}'s drafts them level by level already")
    return model


@register("tree", TreeOptions, "token trees: depth x width drafted nodes verified in one forward", bounds,
          loaded=loaded)
def build(request: Request, options: TreeOptions) -> Any:
    from speculant.trees.decoder import tree_speculative
    from speculant.trees.shape import tree_shape
    from speculant.trees.drafter import TreeDrafter

    model = drafting_model(request.session.drafter(options.drafter, options.drafter_dtype), options, request.target)
    check_width(options.width, model)
    profile = options.target_profile
    if profile is not None and profile.model != request.target.name:  # (the same weights may go by another name)
        said = f"the target profile was measured on {profile.model}, and the target is {request.target.name}: its " \
            "costs shape the trees"
        if said not in request.session.said:
            request.session.said.add(said)
            logging.getLogger("speculant").warning(said)
    shape = tree_shape(request.target, model, request.prompt_ids, options.depth, options.width, options.verify_width,
                       profile, request.session, options.schedule)
    static = fixed_shape(options, request.target, model, request.prompt_ids, request.session)
    predictor, cost = depth_predictor(options.depth_predictor, request.target, model, request.session), shape.cost
    if options.objective == "length":  # the sizes stand; no cost weighs a level or a node
        predictor, cost = None, None
    elif predictor is not None and cost is None:
        cost = request.session.profile(request.target).cost
    chooser = shape.chooser if options.objective == "speedup" else None  # (length: no cost weighs a width either)
    drafter = TreeDrafter(request.session.cache(model), shape.width, chooser, static, options.draft_graph,
                          request.target)
    return tree_speculative(request.target, drafter, request.prompt_ids,
                            shape.depth, shape.width, request.max_new_tokens, request.sampling, request.generator,
                            shape.verify_width, cost, predictor, schedule=options.schedule)


def fixed_shape(options: TreeOptions, target: Any, drafter: Any, prompt_ids: list[int], session: Any) -> Any:
    """The tree of ranks every tree is drafted as (`trees.baselines`), or None for equal growth."""
    from speculant.trees.baselines import nway_shape, sequoia_shape
    from speculant.trees.shape import measured_coverage

    if options.shape == "nway":
        return nway_shape(options.width, options.depth)
    if options.shape == "sequoia":
        coverage = measured_coverage(target, drafter, prompt_ids, session)
        return sequoia_shape(coverage, options.depth * options.width, options.depth)
    return None


def drafts_trees_for(model: Any, target: Any) -> bool:
    """Whether a loaded `model` can draft `target`'s trees: the target's vocabulary and rows (a tree's tokens are
    its nodes' ids)."""
    from speculant.drafters.vocab import same_vocabulary

    return same_vocabulary(target, model) and model.vocab_size == target.vocab_size


def tree_drafter_model(model: Any, target: Any) -> Any:
    """`model`, checked to draft trees for `target` (`drafts_trees_for`)."""
    from speculant.drafters.base import Drafter

    if isinstance(model, Drafter):
        raise ConfigError(f"method 'tree' needs a model drafter (self or a model's name), not {model.name}")
    if not drafts_trees_for(model, target):
        raise ConfigError(f"method 'tree' needs a drafter with the target's vocabulary; '{model.name}' has another "
                          "(it can draft chains: sd, auto, cascade, dsi)")
    return model


def depth_predictor(choice: Any, target: Any, drafter: Any, session: Any) -> Any:
    """The DepthPredictor `choice` names: off, one the options read from the file they named (a hidden-state one
    only on a target that gives them: `target_needs`), or auto (train-depth's for the pair, if any: the
    hidden-state one where the target's backend gives hidden states, else the features one), read once per version
    of its file and kept in the `session` beside the pair's measured costs (a server's requests share it)."""
    from speculant.models.base import owner_of
    from speculant.trees.depth import INPUTS, DepthPredictor, predictor_path

    if choice == "off":
        return None
    if isinstance(choice, DepthPredictor):
        return choice
    kinds = [k for k in INPUTS if k != "hidden" or target.capabilities.hidden_states]
    path = next((p for p in (predictor_path(target, drafter, k) for k in kinds) if p is not None and p.is_file()), None)
    if path is None:
        return None
    known = session.measured.setdefault(owner_of(target), {})
    key = ("depth predictor", str(path), path.stat().st_mtime_ns)  # (retrained: read again)
    if key not in known:
        known[key] = DepthPredictor.load(path)
    return known[key]
