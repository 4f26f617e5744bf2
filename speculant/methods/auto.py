"""`auto`: speculation that configures itself. From T(W) of the target and each candidate drafter,
measured once per machine (`speculant.latency.machine_profile`), and acceptance observed online, every
step chooses the drafter, chain, token tree or cascade, and the draft length with the best expected
goodput, or plain decoding when no draft pays (`decoding.adaptive`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from speculant.config import AUTO, CATCH_UPS, REQUEST_MOST, REQUEST_NODES, SCHEDULES, as_integer, integer, option
from speculant.drafters.spec import as_drafter, model_free, named
from speculant.errors import ConfigError, OptionError
from speculant.methods.drafting import (as_drafters, check_draft_confidence, check_drafters, draft_confidence_option,
                                        drafter_dtype_option, parse_drafters)
from speculant.methods.registry import Request, register

MODEL_PRIOR = 0.6  # a model drafter's acceptance before any observation
TREE_PRIOR = 0.7  # the same for a tree step: one of its candidates is accepted
FREE_PRIOR = 0.5  # a Drafter object of unknown cost
REVIEW = 6  # Max-Gram tokens a model drafter reviews in one forward in auto's cascades


def catch_up_cost(drafter: Any, profile: Any, prefixes: Any = None) -> Any:
    """Seconds for `drafter` (a ModelDrafter or TreeDrafter) to run the context its cache lacks, as its cache runs
    it (`DraftCache.prefills`, the profile's rule): a catch-up on the rest, priced as a forward of its rows (T(lag);
    beyond the widest measured W that overstates it, the head's rows and the rows' shared weight reads: the price of
    `LatencyProfile.catch_up_s` made auto gamble on more short replies, docs/results/cpu.md), or a prefill of the
    context (`LatencyProfile.prefill_s`: measured at two lengths, each token's attention growing with the context;
    where only one was measured, no more than a forward of the context), less what a server's prefix cache
    (`prefixes`) restores of it. A drafter of another tokenizer (a CrossVocabDrafter) is priced on its own tokens of
    the context's text, which its cache holds."""

    def seconds(context: list[int]) -> float:
        ids = drafter.own_ids(context)  # (encoded once here for a drafter of another tokenizer)
        lag = drafter.cache.lag(ids)
        keep = len(ids) - lag
        if drafter.cache.prefills(keep, lag):
            prefill = profile.prefill_s(len(ids))
            if profile.long_ttft_s is None:
                prefill = min(profile.cost(len(ids)), prefill)
            restored = prefixes.cached(drafter.model, ids) if prefixes is not None else 0
            return prefill - profile.prefill_s(restored) if restored else prefill
        return profile.cost(lag) if lag else 0.0

    return seconds


def parse_widths(text: str) -> tuple[int, ...] | str:
    """`auto`, `none` or nothing (chains only: a flag's empty value is refused as a slip, so `none` spells it), or
    comma-separated widths, each a number (an empty one is a mistake)."""
    if text.strip() in ("", "none"):
        return ()
    return AUTO if text.strip() == AUTO else tuple(integer(w) for w in text.split(","))


@dataclass(frozen=True)
class AutoOptions:
    drafters: Any = option(None, "candidate drafters (default: the target's catalog drafter as its backend runs it "
                           "best - on the lean kernels for a lean target, its GGUF for a llama.cpp one, else int8 on "
                           "AMX CPUs and int4 elsewhere - and maxgram; suffix may be added)",
                           parse=parse_drafters)
    drafter_dtype: str | None = drafter_dtype_option()
    k_max: int = option(16, "the longest draft auto may choose", most=REQUEST_MOST)
    draft_confidence: float = draft_confidence_option(model_only=True)
    tree_widths: Any = option((2,), "widths of the token trees auto may also draft with each model drafter (nodes "
                              "per step; none: chains only), or auto: the execution plan's width for the pair "
                              "(Yggdrasil 5.2: from the machine profiles and the drafter's rank coverage of the target "
                              "on the prompt; none where chains pay best)", parse=parse_widths, most=REQUEST_MOST,
                              model_only=True, tree_only=True)
    probe_every: int = option(16, "steps without a model draft before a model drafter is tried again (the wait "
                              "doubles after each try that does not pay on its own, and tries cost at most a tenth of "
                              "the reply's plain time, less for a drafter many texts showed rarely right)",
                              model_only=True)
    schedule: str = option("serial", "serial, or stage: while the target verifies a token tree, its drafter drafts the "
                           "next one on a thread of its own from the likeliest path (Yggdrasil's stage-based "
                           "scheduling; used where auto chooses that tree again)", choices=SCHEDULES, model_only=True,
                           tree_only=True)
    catch_up: str = option("expected", "expected: a model drafter's catch-up on the prompt is paid where the replies "
                           "seen so far would repay it (fastest on average); safe: only once this reply has run long "
                           "enough that the catch-up costs at most 5 percent of its plain time, so that no catch-up "
                           "slows a reply by more than that (it gives up a drafter's gains on short replies and at the "
                           "start of long ones)", choices=CATCH_UPS, model_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", as_drafters(self.drafters))
        if self.drafters is not None:
            if not self.drafters:
                raise ConfigError("auto's drafters name none: give at least one (method ar decodes without)")
            check_drafters(self)
        elif self.drafter_dtype is not None:  # (its own drafters are the target's backend's to choose and load)
            raise ConfigError(f"drafter dtype {self.drafter_dtype} applies to the model drafters named in auto's "
                              "drafters; those auto picks itself run as the target's backend runs them")
        if self.k_max < 1:
            raise OptionError("k_max", f"k_max must be >= 1, got {self.k_max}")
        check_draft_confidence(self.draft_confidence)
        if isinstance(self.tree_widths, str):
            try:
                object.__setattr__(self, "tree_widths", parse_widths(self.tree_widths))
            except ValueError:
                raise OptionError("tree_widths", f"tree widths are comma-separated integers, or auto; got "
                                  f"{self.tree_widths!r}") from None
        elif not isinstance(self.tree_widths, (list, tuple)):
            object.__setattr__(self, "tree_widths", (self.tree_widths,))  # one width
        if self.tree_widths != AUTO:
            object.__setattr__(self, "tree_widths", typed_widths(self.tree_widths))
        if self.tree_widths != AUTO and any(w < 2 for w in self.tree_widths):
            raise OptionError("tree_widths", f"tree widths must be >= 2 (1 is a chain), got {min(self.tree_widths)}")
        if self.schedule not in SCHEDULES:
            raise OptionError("schedule", f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != "serial" and not self.tree_widths:  # (it would be dropped without a word)
            raise OptionError("schedule", f"schedule {self.schedule} applies to token trees, and tree_widths asks for "
                              "none (chains only)")
        if self.catch_up not in CATCH_UPS:
            raise OptionError("catch_up", f"catch_up must be one of {', '.join(CATCH_UPS)}, got {self.catch_up!r}")
        if self.probe_every < 1:
            raise OptionError("probe_every", f"probe_every must be >= 1, got {self.probe_every}")
        if self.drafters is not None and all(map(model_free, self.drafters)):
            check_model_only(self, self.drafters, models=0)


def typed_widths(widths: Any) -> tuple[int, ...]:
    """Tree widths given from Python: integers (Python's or NumPy's; not bools, not text)."""
    checked = tuple(as_integer(width) for width in widths)
    if None in checked:
        raise OptionError("tree_widths", f"tree widths must be integers, got {list(widths)[checked.index(None)]!r}")
    return checked


def check_model_only(options: AutoOptions, drafters: Sequence[Any], models: int, trees: int | None = None) -> None:
    """Options that act only on model drafters (`model_only`), set away from their defaults where auto has no model
    drafter (`models`: how many it has) to apply them to, are refused: never silently ignored. So are those that act
    only on token trees (`tree_only`) where no model drafter drafts in the target's vocabulary and rows, as a tree's
    tokens must (`trees`: how many do, known once they load). `drafters`: the ones auto runs (a refusal names them)."""

    def changed(kind: str, *fine: Any) -> list[str]:
        return [f.name for f in fields(options)
                if f.metadata.get(kind) and getattr(options, f.name) not in (f.default, *fine)]

    def applies(names: list[str]) -> str:
        return f"{', '.join(names)} appl{'ies' if len(names) == 1 else 'y'}"

    if (names := changed("model_only", ())) and not models:  # (an empty tree_widths asks for no trees)
        raise OptionError(names[0], f"{applies(names)} to model drafters; auto drafts here with "
                          f"{', '.join(map(named, drafters)) or 'none'} only")
    if (names := changed("tree_only", ())) and trees == 0:  # (an empty tree_widths asks for no trees)
        raise OptionError(names[0], f"{applies(names)} to token trees, which need a model drafter with the target's "
                          "vocabulary and rows; auto's model drafters here have other ones")


def with_own_drafters(options: AutoOptions, target: Any) -> AutoOptions:
    """`options` with the drafters auto runs named: the target's defaults (`default_drafters`) where none are given
    (what a loaded drafter, a server's or a bigram corpus's Max-Gram, then stands in for)."""
    if options.drafters is not None:
        return options
    return replace(options, drafters=tuple(as_drafter(d) for d in target.default_drafters()))


def bounds(options: AutoOptions, names: Collection[str]) -> None:
    """A server's client that sizes auto's trees (names `tree_widths` or `k_max`) gets trees of at most REQUEST_NODES
    nodes: a tree of width w may be drafted k_max levels deep. `auto` widths count as the widest a plan may choose."""
    from speculant.trees.plan import PLAN_WIDTHS

    named = [name for name in ("tree_widths", "k_max") if name in names]
    widest = max(PLAN_WIDTHS) if options.tree_widths == AUTO else max(options.tree_widths, default=0)
    if named and widest * options.k_max > REQUEST_NODES:
        raise OptionError(named[0], f"auto's trees are at most {REQUEST_NODES} nodes per request (width x k_max), "
                          f"got {widest} x {options.k_max}")


@register("auto", AutoOptions, "chooses drafter, chain, tree or cascade and draft length every step from measured "
          "costs and acceptance (plain decoding where nothing pays)", bounds, chains=True)
def build(request: Request, options: AutoOptions) -> Any:
    """The candidates auto chooses from, from the session's drafters (loaded once, each model drafter's cache kept:
    a drafter catches up only on what its cache lacks, as the next turn of a conversation shares its history) and
    what the session learned of them (acceptance, forward times, generation lengths): a new request starts from
    what the last ones observed."""
    from speculant.decoding.adaptive import Batched, Candidate, Rescaled, adaptive, can_pay, batched_catch_up
    from speculant.decoding.run import ending
    from speculant.drafters.base import Checked, Drafter
    from speculant.drafters.cascade import CascadeDrafter
    from speculant.drafters.cross_vocab import model_drafter
    from speculant.drafters.maxgram import MaxGramDrafter
    from speculant.drafters.model import ModelDrafter
    from speculant.trees.drafter import TreeDrafter
    from speculant.trees.method import check_width, drafts_trees_for
    from speculant.trees.shape import plan_width

    target, session = request.target, request.session
    k_max = min(options.k_max, request.max_new_tokens)  # (no longer draft could be committed)
    cost = Rescaled(session.profile(target).cost_at, session.timings)
    speed = cost.timings.speed  # the machine's drift: the drafters' forwards share it
    candidates, begun, models, trees = [], [], 0, 0
    specs = options.drafters if options.drafters is not None else target.default_drafters()
    for spec in specs:
        source = session.drafter(spec, options.drafter_dtype)  # named: loaded once; an object: the caller's
        name = session.own_name(source)
        # what auto learns is kept by name: a user's Drafter apart from a built-in of its name
        estimates = session.estimates(name if not isinstance(source, Checked) else
                                      f"{name} ({type(source.inner).__qualname__})")
        if isinstance(source, Drafter):  # model-free: a lookup (known before the choice) or a user's drafter
            drafter = source.begin(request.prompt_ids)
            begun.append(drafter)
            match = drafter.match_length
            candidates.append(Candidate(name, drafter, 0.0, 0.0 if match is not None else FREE_PRIOR, match,
                                        estimates, measured=match is None))  # (a user's: its drafts' time, once seen)
            continue
        models += 1
        with_trees = drafts_trees_for(source, target)
        trees += with_trees
        for width in options.tree_widths if options.tree_widths != AUTO else ():  # (whether or not it pays)
            check_width(width, source, "tree_widths")  # (a node's children: its likeliest tokens)
        profile = session.profile(source)
        if not can_pay(profile.tpot_s, cost, k_max):  # too slow to pay even if always right
            continue
        cache = session.cache(source)
        cache.prefills = profile.prefills  # its way (prefill or rows) by this machine's costs: `catch_up_cost`'s too
        drafter = model_drafter(cache, target, request.sampling, request.generator,
                                draft_confidence=options.draft_confidence, pairs=session.vocab_pairs)
        step_s = profile.tpot_s * drafter.tokens_per_target_token(request.prompt_ids)
        scale = session.scale(name)
        chain = Candidate(name, drafter, step_s, MODEL_PRIOR, estimates=estimates,
                          catch_up=catch_up_cost(drafter, profile, session.prefixes), scale=scale, speed=speed,
                          growth=lambda length, profile=profile: profile.cost_at(1, length) / profile.cost(1))
        candidates.append(chain)
        widths = options.tree_widths if with_trees else ()
        if widths == AUTO:
            widths = (plan_width(target, source, request.prompt_ids, cost, profile.cost, session,
                                 schedule=options.schedule),)
        for width in widths:
            if width < 2:  # (the plan's chain)
                continue
            if not can_pay(profile.cost(width), cost, k_max, width):
                continue
            tree_name = f"{name} tree{width}"
            # the chain's cache: whichever drafts next catches up from it
            tree = TreeDrafter(drafter.cache, width, verifier=target)
            candidates.append(Candidate(tree_name, tree, profile.cost(width), TREE_PRIOR,
                                        estimates=session.estimates(tree_name), width=width,
                                        catch_up=catch_up_cost(tree, profile, session.prefixes), chain=chain,
                                        scale=scale,
                                        speed=speed, growth=lambda length, profile=profile, width=width:
                                        profile.cost_at(width, length) / profile.cost(width)))
    check_model_only(options, specs, models, trees)
    # A vertical cascade (CS Drafting) where Max-Gram finds a match: each model drafter reviews Max-Gram's
    # draft in one forward, keeping what it would itself have drafted, so its drafts are its chain's (the
    # same acceptance estimates), cheaper where Max-Gram guesses right. Its cost per token is measured as
    # it drafts; until then a review is taken to yield two tokens.
    lookup = next((c.drafter for c in candidates if isinstance(c.drafter, MaxGramDrafter)), None)
    for chain in [c for c in candidates if isinstance(c.drafter, ModelDrafter)] if lookup else ():
        cascade = CascadeDrafter([chain.drafter, lookup], [[k_max, 0], [0, REVIEW]], 1.0,
                                 request.sampling, request.generator, target.eos_token_ids)
        candidates.append(Candidate(f"{chain.name} cascade", cascade, chain.step_s / 2, chain.prior,
                                    estimates=chain.estimates, measured=True, needs_match=True,
                                    catch_up=chain.catch_up, scale=chain.scale, speed=speed))  # the chain's
    if target.batch_load is not None:  # a served request: its forwards are batched with other requests'
        for candidate in candidates:
            if candidate.catch_up is not None:
                candidate.catch_up = batched_catch_up(candidate.catch_up, cost, target.batch_load)
            candidate.load = target.batch_load
        cost = Batched(cost, target.batch_load)
    decoder = adaptive(target, candidates, request.prompt_ids, request.max_new_tokens, cost, request.sampling,
                       request.generator, k_max, options.probe_every, session.lengths, options.schedule,
                       options.catch_up)
    return ending(decoder, begun, request.prompt_ids)
