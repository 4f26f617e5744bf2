"""`speculant profile`, `acceptance`, `train-depth` and `simulate`: the measurements and models the methods plan
with."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from speculant.cli.checks import check_target, drafter_profile_path, predictor_out
from speculant.cli.parser import parse_width_ranges
from speculant.config import (
    LATENCY_RANGE,
    REQUEST_MOST,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    from_args,
    from_flags,
    integer,
    latency_fits,
    number,
    reach_ray,
)
from speculant.drafters.spec import DEFAULT, check_dtype
from speculant.errors import ConfigError
from speculant.methods.registry import get_method


def free_text(prompts: list[Any], command: str) -> list[Any]:
    """`prompts`, which `command` decodes as free text: one with a response_format (which bench and servers follow)
    is refused rather than run unconstrained without a word."""
    if odd := next((p for p in prompts if p.response_format is not None), None):
        raise ConfigError(f"{command} decodes its prompts as free text: prompt {odd.id} has a response_format, which "
                          "it would not follow (bench follows it; leave it out of the file)")
    return prompts


def run_profile(args: argparse.Namespace) -> None:
    from speculant.api import check_models, encode_prompt
    from speculant.latency import check_room, machine_profile, profile_model
    from speculant.bench.datasets import load_dataset
    from speculant.drafters.spec import as_drafter, model_free, resolved
    from speculant.models import load_model
    from speculant.session import Session

    widths = parse_width_ranges(args.widths) if args.widths is not None else None
    config = from_args(ModelConfig, args)
    prompts = load_dataset(args.dataset) if widths else []
    drafter = args.drafter and str(resolved(as_drafter(args.drafter), args.model))  # (`default`: the model's own)
    if drafter and model_free(as_drafter(drafter)):
        raise ConfigError(f"'{args.drafter}' runs no model forwards to profile" +
                          (f" (the catalog pairs no drafter with {args.model})" if drafter != args.drafter else ""))
    args.drafter = drafter
    check_dtype(args.drafter_dtype, [as_drafter(args.drafter)] if args.drafter else [])
    check_models([args.model], [args.drafter] if args.drafter else [], model_free=False)
    model = load_model(args.model, dtype=config.dtype, device=config.device, backend=config.backend,
                        compile=config.compile)
    models = [model]
    if args.drafter:
        models.append(Session(model).drafter(args.drafter, args.drafter_dtype))
    for m in models if widths else ():
        if m.max_positions is not None and args.context_len + max(widths) > m.max_positions:
            raise ConfigError(f"--context-len {args.context_len} and width {max(widths)} exceed {m.name}'s "
                              f"{m.max_positions} positions")
    if widths is None:
        profiles = [machine_profile(m) for m in models]
    else:
        encoded = [[encode_prompt(m.tokenizer if m.tokenizer is not None else model.tokenizer, p.text, p.chat)
                    for p in prompts] for m in models]  # (each in its own tokens: a drafter's tokenizer may be another)
        for m, ids in zip(models, encoded):  # every model's checked before any is timed
            check_room(m, ids)
        profiles = [profile_model(m, ids, widths, args.context_len, repeats=args.repeats, dtype=m.numerics)
                    for m, ids in zip(models, encoded)]
    for profile, measured in zip(profiles, models):
        for line in measured.describe():
            print(line)
        print(f"{profile.model} ({profile.dtype}, {getattr(measured, 'kernel', '')} kernel, {profile.device}): TTFT "
              f"{profile.ttft_s * 1000:.0f} ms, TPOT {profile.tpot_s * 1000:.1f} ms; T(W) at {profile.context_len} "
              "cached tokens:")
        print("  " + "  ".join(f"{w}:{t * 1000:.1f}ms" for w, t in profile.forward_s.items()))
    if args.drafter:
        target, drafter_profile = profiles
        print(f"cost ratio c = drafter TPOT / target TPOT = {drafter_profile.tpot_s / target.tpot_s:.3f}")
    if args.out:
        profiles[0].save(Path(args.out))
        if args.drafter:
            profiles[1].save(drafter_profile_path(Path(args.out)))


def run_acceptance(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from speculant.analysis.acceptance import estimate
    from speculant.api import check_models, encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.drafters.spec import as_drafter, model_free, resolved
    from speculant.models import load_model
    from speculant.session import Session

    sampling = from_flags(lambda: SamplingConfig(temperature=args.temperature), ["temperature"])
    from_flags(lambda: RunConfig(max_new_tokens=args.max_new_tokens), ["max_new_tokens"])
    if args.depth is not None and args.depth > args.max_new_tokens:  # (no draft position past a reply is reached)
        raise ConfigError(f"--depth {args.depth} exceeds --max-new-tokens {args.max_new_tokens}: a reply has no draft "
                          "position past its last token")
    depth = min(8, args.max_new_tokens) if args.depth is None else args.depth
    config = from_args(ModelConfig, args)
    prompts = free_text(load_dataset(args.dataset), "acceptance")
    check_models([args.target])
    given = [name.strip() for name in args.drafter.split(",")]
    names = [str(resolved(as_drafter(name), args.target)) if name else name for name in given]  # (`default`: its own)
    if any(name == DEFAULT and model_free(as_drafter(drafter)) for name, drafter in zip(given, names)):
        raise ConfigError(f"acceptance estimation needs a model drafter, and the catalog pairs none with "
                          f"{args.target}: name one with --drafter (self, or a model's name)")
    if not all(names) or any(model_free(as_drafter(name)) for name in names):
        raise ConfigError(f"'{args.drafter}' must name models; acceptance estimation needs them")
    if len(set(names)) < len(names):
        raise ConfigError(f"'{args.drafter}' names a drafter twice")
    check_dtype(args.drafter_dtype, [as_drafter(name) for name in names])
    check_models([], names, model_free=False)
    for name in names:
        check_target(args.target, config, from_flags(lambda: get_method("sd").parse_options({"drafter": name}),
                                                     ["drafter"]))
    target = load_model(args.target, dtype=config.dtype, device=config.device, backend=config.backend,
                        compile=config.compile)
    session = Session(target)
    drafters = [session.drafter(name, args.drafter_dtype) for name in names]
    ids = [encode_prompt(target.tokenizer, p.text, p.chat) for p in prompts]
    reports = estimate(target, drafters, ids, args.max_new_tokens, sampling, depth)
    if args.json:
        print(json.dumps({name: asdict(report) for name, report in zip(names, reports)}, indent=1))
        return
    print(f"target {args.target} ({target.numerics})")  # (a local model's dtype is the device's fastest exact one)
    for name, drafter, report in zip(names, drafters, reports):
        print(f"{name} ({drafter.numerics}): {report.positions} positions: agreement {report.agreement:.1%}, mean "
              f"accepted run {report.mean_run:.2f}, geometric acceptance rate a = {report.geometric_rate:.3f}")
        print("  acceptance per draft position: " + " ".join(f"{x:.2f}" for x in report.per_position))
        if report.expected_sampling_acceptance is not None:
            print(f"  expected acceptance when sampling (mean of sum min(p, q)): "
                  f"{report.expected_sampling_acceptance:.3f}")
        if report.outside_mass is not None:
            print(f"  another vocabulary: mean drafter probability off the shared tokens {report.outside_mass:.3f} "
                  "(sampling drafts only shared tokens)")


def run_train_depth(args: argparse.Namespace) -> None:
    from speculant.analysis.depth import CORPUS, fit, log_trees
    from speculant.api import check_models
    from speculant.bench.datasets import fitted_ids, load_dataset
    from speculant.drafters.spec import as_drafter, resolved
    from speculant.trees.method import check_width, tree_drafter_model
    from speculant.models import load_model
    from speculant.models.backends import capabilities_of
    from speculant.session import Session
    from speculant.trees.depth import predictor_path

    for flag, size, what in (("--max-depth", args.max_depth, "deepest"), ("--width", args.width, "widest")):
        if size > REQUEST_MOST:
            raise ConfigError(f"{flag} {size}: at most {REQUEST_MOST}, the {what} tree a server's client may ask for")
    if args.max_new_tokens < args.max_depth + 2:  # (a tree follows the first token and leaves room for the next)
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} leaves no tree of --max-depth {args.max_depth} to "
                          "log: give at least the depth + 2")
    config = from_args(ModelConfig, args)
    prompts = free_text(load_dataset(args.prompts or args.dataset or CORPUS), "train-depth")
    check_models([args.target], [args.drafter], model_free=False)
    args.drafter = str(from_flags(lambda: resolved(as_drafter(args.drafter), args.target, "train-depth"), ["drafter"]))
    backend = check_target(args.target, config, from_flags(
        lambda: get_method("tree").parse_options({"drafter": args.drafter}), ["drafter"]))
    if "hidden" in (args.inputs or ()) and not capabilities_of(backend).hidden_states:
        raise ConfigError(f"--inputs hidden: the {backend} backend gives no hidden states (use --inputs features)")
    check_dtype(args.drafter_dtype, [as_drafter(args.drafter)])
    target = load_model(args.target, dtype=config.dtype, device=config.device, backend=config.backend,
                        compile=config.compile)
    drafter = tree_drafter_model(Session(target).drafter(args.drafter, args.drafter_dtype), target)
    check_width(args.width, drafter)
    kinds = list(dict.fromkeys(args.inputs)) if args.inputs else \
        ["hidden" if target.capabilities.hidden_states else "features"]
    outs = {kind: predictor_path(target, drafter, kind) for kind in kinds} if not args.out else \
        {kind: predictor_out(Path(args.out), kind, len(kinds)) for kind in kinds}
    if None in outs.values():
        raise ConfigError("models built in memory have no place in the cache: pass --out")
    ids = fitted_ids(target, prompts)
    samples = log_trees(target, drafter, ids, args.max_new_tokens, args.max_depth, args.width)
    print(f"{len(samples)} trees logged")
    for kind, out in outs.items():
        try:
            predictor, report = fit(samples, args.max_depth, kind)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        predictor.save(out)
        print(f"{kind}: on {report.held_out} held out, the accepted depth is the predicted one {report.accuracy:.1%} "
              f"of the time (the most common depth: {report.baseline:.1%}), {report.mean_error:.2f} levels from the "
              f"expected one on average (from the mean depth: {report.baseline_error:.2f}); wrote {out}")


def more_drafter(text: str) -> tuple[float, float]:
    """`--more-drafter MS:ACCEPTANCE` as numbers; a ConfigError naming the text where it is not two numbers."""
    try:
        ms, acceptance = map(number, text.split(":"))
    except ValueError:
        raise ConfigError(f"--more-drafter takes MS:ACCEPTANCE, got '{text}'") from None
    if not latency_fits(ms):
        raise ConfigError(f"--more-drafter's latency must lie in {LATENCY_RANGE}, got '{text}'")
    if not 0 <= acceptance <= 1:
        raise ConfigError(f"--more-drafter's acceptance must lie in [0, 1], got '{text}'")
    return ms, acceptance


SIMULATION_FLAGS = ("acceptance", "lookahead", "servers", "tokens", "repeats", "seed", "ray_address",
                    "more_drafter")  # what its refusals name
PATIENT_S = 30  # seconds a command may run before a word on how long it will take
MOST_TWIN_S = 24 * 3600  # the real time an online simulation may take (its non-SI runs alone)


def run_simulate(args: argparse.Namespace) -> None:
    from speculant.analysis.commands import format_heatmap, format_one, run_heatmap, simulate_one

    if args.simulation == "online":
        from speculant.analysis.online import format_online, simulate_online

        more = tuple(more_drafter(text) for text in args.more_drafter)
        if args.executor == "ray":
            reach_ray(args.ray_address, "--ray-address")
        plain_s = args.repeats * ((args.ttft or args.target_latency) + (args.tokens - 1) * args.target_latency) / 1000
        if plain_s > MOST_TWIN_S:
            raise ConfigError(f"the twin runs in real time: its non-SI runs alone would take {plain_s:.0f} s, more "
                              "than a day (give fewer --repeats or --tokens, or shorter latencies)")
        if plain_s > PATIENT_S:  # (its forwards wait out their latencies: a run this long says so before it starts)
            print(f"the twin runs in real time: its non-SI runs alone take {plain_s:.0f} s, SI and DSI theirs",
                  file=sys.stderr)
        result = from_flags(lambda: simulate_online(
            args.target_latency, args.drafter_latency, args.acceptance, args.servers, args.tokens, args.lookahead,
            args.ttft, args.repeats, args.executor, args.seed, Path(args.timeline) if args.timeline else None,
            args.ray_address, more), SIMULATION_FLAGS)
        print(json.dumps(result, indent=1) if args.json else format_online(result))
        if "timeline" in result and not args.json:
            print(f"wrote {result['timeline']}")
        return
    if args.simulation == "run":
        target_ms, drafter_ms, ttft_ms = args.target_latency, args.drafter_latency, args.ttft
        if args.target_profile:
            from speculant.latency import LatencyProfile

            profile = LatencyProfile.load(Path(args.target_profile))
            target_ms, ttft_ms = profile.tpot_s * 1000, profile.ttft_s * 1000 if ttft_ms is None else ttft_ms
        if args.drafter_profile:
            from speculant.latency import LatencyProfile

            drafter_ms = LatencyProfile.load(Path(args.drafter_profile)).tpot_s * 1000
        if target_ms is None or drafter_ms is None:
            raise ConfigError("give --target-latency and --drafter-latency, or profiles with --target-profile/--drafter-profile")
        if zero := next((name for name, ms in (("target", target_ms), ("drafter", drafter_ms)) if not ms), None):
            raise ConfigError(f"--{zero}-latency must be > 0 ms in a simulation (its {zero}'s forwards take time), "
                              "got 0")
        result = from_flags(lambda: simulate_one(target_ms, drafter_ms, args.acceptance, args.lookahead,
                                                 args.servers, args.tokens, ttft_ms, args.repeats, args.seed),
                            SIMULATION_FLAGS)
        print(json.dumps(result, indent=1) if args.json else format_one(result))
    else:
        try:
            lookaheads = tuple(integer(k) for k in args.lookaheads.split(","))
        except ValueError:
            raise ConfigError(f"--lookaheads takes comma-separated integers, got '{args.lookaheads}'") from None
        numbers, paths = from_flags(lambda: run_heatmap(Path(args.out), args.ndim, lookaheads, args.tokens,
                                                        args.repeats, args.servers, args.fixed_lookahead, args.seed),
                                    (*SIMULATION_FLAGS, "ndim"))
        print(format_heatmap(numbers))
        print("wrote " + ", ".join(str(p) for p in paths))

