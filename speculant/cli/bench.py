"""`speculant bench`, `bench-serve` and `bench-kernels`: methods (and peers) run over prompts, a server driven by
conversations, the kernels timed."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from speculant.bench import MOST_RESULTS_BYTES
from speculant.cache import read_text
from speculant.cli.checks import check_target
from speculant.cli.parser import PARSER_KEYS, parse_width_ranges
from speculant.config import (ModelConfig, RunConfig, SamplingConfig, check_sampled, flag, from_args, from_flags,
                              sampling_of, sendable_key)
from speculant.errors import ConfigError, SpeculantError
from speculant.methods.drafting import held_drafters, takes_model_free, with_default_drafter
from speculant.methods.registry import chain_methods


def run_bench(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from speculant.bench.methods import parse_method
    from speculant.bench.report import markdown_report, plot, print_table
    from speculant.bench.summary import rows_from_json, summarize, summarize_by_category, to_json
    from speculant.machine import machine_info

    saved = read_results(Path(args.report_from)) if args.report_from else None
    if saved and args.given:
        raise ConfigError(f"--report-from reports a finished run again, as it ran: "
                          f"{', '.join(map(flag, sorted(args.given)))} would change nothing (only --baseline and --out "
                          "apply)")
    methods = [parse_method(m, build=not saved) for m in (saved["config"]["methods"] if saved else args.methods)]
    ran_over = saved["config"].get("baseline") if saved else None  # (a run reported again keeps its baseline)
    ran_over = None if ran_over == "default" else ran_over  # (as a run before this was saved said the default)
    baseline = ran_over if args.baseline is None else None if args.baseline == "default" else args.baseline
    model, run_sampling = from_args(ModelConfig, args), from_args(SamplingConfig, args)
    runs = [method.runs(model.dtype, model.backend, run_sampling) for method in methods]
    for i, method in enumerate(methods):
        if same := next((earlier for earlier, its in zip(methods[:i], runs) if its == runs[i]), None):
            raise ConfigError(f"each method may be listed once: '{method.label}' runs what '{same.label}' runs")
    if baseline is not None and baseline not in {m.label for m in methods}:
        raise ConfigError(f"the baseline '{baseline}' is not among the methods")
    if saved:  # a finished run, reported again
        try:
            rows = rows_from_json(saved)
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"{args.report_from}: a row is not a bench run's ({type(error).__name__}: {error})") \
                from None
        if not rows:
            raise ConfigError(f"{args.report_from} holds no rows: nothing to report")
        if stray := sorted({row.method for row in rows} - {m.label for m in methods}):
            raise ConfigError(f"{args.report_from}: rows of {stray[0]}, which its config's methods do not list")
        check_cells(rows, [m.label for m in methods], args.report_from)
        command = saved["config"]["command"]
        if baseline != ran_over:  # another than it ran over: noted, unless the command's own (an earlier note replaced)
            command = re.sub(r" \(reported with --baseline [^)]*\)$", "", command)
            own = baseline_in(command)
            if baseline != (own if own != "default" else None):
                command += f" (reported with --baseline {baseline or 'default'})"
        machine, title = saved["config"]["machine"], f"{args.report_from}; {saved['config']['machine']}"
        drafters = saved["config"].get("drafters")
        if not (isinstance(drafters, dict) and all(isinstance(v, str) for v in drafters.values())):
            drafters = {}  # (a run from before drafters were recorded, or a file edited)
    else:
        rows = measure_bench(args, methods)  # (each method's `default` drafter resolved in place: what it ran)
        drafters = {m.label: ", ".join(map(str, held)) for m in methods if (held := held_drafters(m.options))}
        command, machine = "speculant " + shlex.join(argv), machine_info()  # (as a shell reads it back)
        title = (f"{args.target} on {args.prompts or args.dataset}, {from_args(RunConfig, args).max_new_tokens} new "
                 f"tokens; {machine}")
    sampling = saved_sampling(saved["config"], args.report_from) if saved else run_sampling
    try:
        summaries = summarize(rows, methods, baseline, sampling)
        by_category = summarize_by_category(rows, methods, baseline, sampling)
    except (ArithmeticError, KeyError, statistics.StatisticsError) as error:
        if not saved:
            raise
        raise ConfigError(f"{args.report_from}: its rows do not add up to a run ({type(error).__name__}: "
                          f"{error})") from None
    print_table(summaries, title)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        config = {"command": command, "machine": machine, "drafters": drafters,
                  **{k: v for k, v in vars(args).items() if k not in PARSER_KEYS}, "baseline": baseline}
        if args.prompts:
            config["dataset"] = None  # (the flag's default, which the prompts replaced)
        if saved:
            config = {**saved["config"], "command": command, "baseline": baseline}
        (out / "results.json").write_text(json.dumps(to_json(config, rows, summaries, by_category), indent=1))
        (out / "report.md").write_text(markdown_report(summaries, by_category, command, machine, baseline, drafters))
        plots = plot(summaries, by_category, out, baseline)
        print(f"wrote {', '.join(str(path) for path in [out / 'results.json', out / 'report.md', *plots])}",
              file=sys.stderr)


def baseline_in(command: str) -> str | None:
    """The --baseline a saved bench command gives, if any, its words read as a shell reads them (a run saved before
    commands were quoted: split at spaces)."""
    try:
        words = shlex.split(command)
    except ValueError:  # (an unquoted command's stray quote)
        words = command.split()
    for i, word in enumerate(words):
        if word == "--baseline" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--baseline="):
            return word.removeprefix("--baseline=")
    return None


def saved_sampling(config: dict[str, Any], path: str) -> SamplingConfig:
    """The sampling flags a saved run ran with (its methods' own settings apart), as its config holds them."""
    try:
        return sampling_of(config)
    except (TypeError, ValueError) as error:  # (a ConfigError among them)
        raise ConfigError(f"{path}: its config's sampling is not a run's: {error}") from None


def check_cells(rows: Sequence[Any], methods: Sequence[str], path: str) -> None:
    """A saved run's rows as a run makes them, or a ConfigError naming what is not: each method one row per prompt
    and repeat, all methods the same ones, each measured in more than 0 s."""
    cells = {label: [(row.prompt_id, row.repeat) for row in rows if row.method == label] for label in methods}
    for label, mine in cells.items():
        if not mine:
            raise ConfigError(f"{path}: {label} has no rows")
        if len(set(mine)) != len(mine):
            raise ConfigError(f"{path}: {label} has two rows of one prompt and repeat")
        if set(mine) != set(cells[methods[0]]):
            raise ConfigError(f"{path}: {label}'s rows cover other prompts or repeats than {methods[0]}'s")
    if slow := next((row for row in rows if not row.stats.wall_s > 0), None):
        raise ConfigError(f"{path}: a row of {slow.method} was measured in {slow.stats.wall_s} s")


def read_results(path: Path) -> dict[str, Any]:
    """The results.json of an earlier `speculant bench --out` run, or a ConfigError saying why not."""
    try:
        saved = json.loads(read_text(path, MOST_RESULTS_BYTES))
    except (OSError, ValueError, RecursionError) as error:  # (TooLong too)
        raise ConfigError(f"cannot read the results of a run from {path}: {type(error).__name__}: {error}") from None
    config = saved.get("config") if isinstance(saved, dict) else None
    if not (isinstance(config, dict) and isinstance(config.get("methods"), list)
            and all(isinstance(m, str) for m in config["methods"])
            and all(isinstance(config.get(key), str) for key in ("command", "machine"))
            and isinstance(saved.get("rows"), list) and all(isinstance(row, dict) for row in saved["rows"])):
        raise ConfigError(f"{path} is not the results.json of a `speculant bench --out` run (its config names the "
                          "methods, command and machine; its rows follow)")
    return saved


def measure_bench(args: argparse.Namespace, methods: list[Any]) -> list[Any]:
    """Run the method matrix of `speculant bench` (see run_bench) and return its rows."""
    from dataclasses import replace

    from tqdm import tqdm

    from speculant.api import check_models
    from speculant.bench.datasets import load_dataset
    from speculant.bench.isolated import isolated_generate
    from speculant.bench.llamacpp_cli import CLI_PEERS
    from speculant.bench.peers import HF_PEERS
    from speculant.bench.runner import run_matrix
    from speculant.methods.drafting import as_keywords
    from speculant.models import CausalLM, load_model, split_quant
    from speculant.models.backends.llamacpp_build import tool
    from speculant.models.loading import resolve_backend

    if any(m.method in CLI_PEERS for m in methods):
        tool("llama-completion")  # llama.cpp's tools are built: one line now, before any model loads
    check_models([args.target])
    for i, method in enumerate(methods):  # (each method's drafters, named as that method takes them)
        check_models([], held_drafters(method.options), takes_model_free(method.options))
        try:  # (`default`: the target's drafter, or refused before it loads)
            methods[i] = replace(method, options=with_default_drafter(method.options, args.target))
        except ConfigError as error:
            raise ConfigError(f"{error} in '{method.label}'") from None
    model_config = from_args(ModelConfig, args)
    for method in methods:
        try:  # (a peer's backend too: llama.cpp's refuses weights that are no GGUF)
            backend = check_target(args.target, model_config, method.options, method.backend, method.dtype)
        except ConfigError as error:
            raise ConfigError(f"{error} in '{method.label}'") from None
        if method.method in HF_PEERS and backend != "hf":
            raise ConfigError(f"{method.label} runs transformers' generate, and the target loads on the {backend} "
                              f"backend: give {method.method}:backend=hf or --backend hf")
    for name in ("temperature", "top_k", "top_p", "dtype", "backend"):  # (--verifier's: below)
        if name in args.given and all(method.sets(name) for method in methods):
            raise ConfigError(f"{flag(name)} reaches no method: each of this run's sets its own {name}")
    run = from_args(RunConfig, args)
    sampling = from_args(SamplingConfig, args)
    for method in methods:  # (a method's own settings, and the run's where no method samples)
        check_sampled(method.sampled(sampling), dict(method.sampling), where=f" in '{method.label}'")
    some = not all(method.sampled(sampling).greedy for method in methods)  # (then name the greedy one)
    for method in methods:  # the run's settings reach every method that does not set its own
        if method.sampled(sampling).greedy:
            run_only = [name for name in args.given if name not in dict(method.sampling)]
            check_sampled(method.sampled(sampling), run_only, flag,
                          f" (for '{method.label}', which decodes greedily)" if some else "")
    if "verifier" in args.given and not any(m.chains and "verifier" not in dict(m.sampling) for m in methods):
        own = [m.label for m in methods if m.chains]
        raise ConfigError(f"--verifier applies to {chain_methods()}: " + (
            f"those of this run set their own ({', '.join(own)})" if own else "none of this run's takes it"))
    if args.isolate and all(method.peer for method in methods):
        raise ConfigError("--isolate runs speculant's methods in processes of their own: this run lists peers only")
    prompts = load_dataset(args.prompts or args.dataset)
    if args.ignore_response_format:
        if all(p.response_format is None for p in prompts):
            raise ConfigError("--ignore-response-format: no prompt of this run has a response_format")
        prompts = [replace(p, response_format=None) for p in prompts]
    targets: dict[tuple[str, str], CausalLM] = {}

    def target_for(dtype: str | None, backend: str | None) -> CausalLM:
        dtype = dtype or model_config.dtype
        name, quant = split_quant(args.target)  # one target per resolved backend: auto and llamacpp share it
        backend = resolve_backend(backend or model_config.backend, name, quant, model_config.device, dtype)
        if (dtype, backend) not in targets:
            targets[dtype, backend] = load_model(args.target, dtype=dtype, device=model_config.device, backend=backend,
                                                 compile=model_config.compile and backend == "static")
        return targets[dtype, backend]

    def isolated(spec: Any, ids: list[int], n: int, response_format: dict[str, Any] | None) -> Any:
        return isolated_generate({"target": args.target, "dtype": model_config.dtype, "device": model_config.device,
                                  "backend": model_config.backend, "compile": model_config.compile,
                                  "method": spec.label, "prompt_ids": ids,
                                  "max_new_tokens": n, **as_keywords(sampling), "seed": run.seed,
                                  "response_format": response_format})

    with tqdm(total=len(prompts) * len(methods) * args.repeats, desc="prompts x methods", file=sys.stderr) as bar:
        return run_matrix(target_for, methods, prompts, run.max_new_tokens, run.seed, sampling, args.repeats,
                          on_row=lambda row: bar.update(), isolated=isolated if args.isolate else None)


MOST_ARRIVAL_S = 24 * 3600  # bench-serve --rate: the conversations of one run arrive within a day
MOST_REQUESTS = 1 << 20  # bench-serve --requests: the most of one run (a list of their results is made first)
MOST_JOBS = 1024  # peers build-llamacpp --jobs: compile jobs at once
MOST_CLIENTS = 4096  # bench-serve --concurrency: clients, each a thread of its own


def run_bench_serve(args: argparse.Namespace) -> None:
    from speculant.bench.datasets import load_dataset
    from speculant.bench.serve import RESULTS, format_load, read_runs, run_load, run_sessions, write_report

    from_flags(lambda: SamplingConfig(temperature=args.temperature), ["temperature"])  # (as servers refuse it)
    if args.temperature > 2:  # (OpenAI's range: a server refuses more)
        raise ConfigError(f"--temperature must lie in [0, 2], got {args.temperature:g}")
    for name, value, most in (("requests", args.requests, MOST_REQUESTS),
                              ("concurrency", max(args.concurrency), MOST_CLIENTS)):
        if value > most:  # (memory or threads ran out)
            raise ConfigError(f"--{name} must be at most {most}, got {value}")
    if args.rate is not None and args.requests / min(args.rate) > MOST_ARRIVAL_S:
        raise ConfigError(f"--rate {min(args.rate):g} spreads {args.requests} conversations' arrivals over more than "
                          f"{MOST_ARRIVAL_S // 3600} hours")
    if args.out:
        read_runs(Path(args.out))  # (one that is not this command's: said now, not after the run)
    if args.check_solo and (args.rate is not None or args.temperature > 0):
        raise ConfigError("--check-solo compares greedy replies of a closed loop: not with --rate or --temperature > 0")
    import httpx

    try:
        url = httpx.URL(args.url)
    except httpx.InvalidURL as error:
        raise ConfigError(f"--url {args.url!r} is not a URL: {error}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"--url {args.url!r} is not an http(s) URL, e.g. http://127.0.0.1:8000/v1")
    if args.api_key is not None and not sendable_key(args.api_key):
        raise ConfigError("--api-key must be printable ASCII without spaces (it goes in an HTTP header)")
    prompts = load_dataset(args.prompts or args.dataset)
    label = args.url if args.label is None else args.label  # (what names the server in the report and plot)
    runs = [lambda rate=rate: run_sessions(args.url, prompts, args.requests, args.turns, rate, args.max_tokens,
                                           args.temperature, args.model, args.api_key, label)
            for rate in args.rate] if args.rate is not None else \
        [lambda c=c: run_load(args.url, prompts, args.requests, c, args.max_tokens, args.temperature, args.model,
                              args.api_key, args.check_solo, label) for c in args.concurrency]
    for run in runs:
        result = {**run(), "prompts": args.prompts or args.dataset}  # (what the report tells runs apart by)
        print(format_load(result))
        if result["errors"] == result["requests"]:  # (a server that refuses every request: not a measurement)
            samples = "; ".join(result["error_samples"]) or "no answer"
            raise SpeculantError(f"all {result['requests']} requests failed: {samples}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            with (out / RESULTS).open("a") as f:
                f.write(json.dumps(result) + "\n")
            write_report(out)


def run_bench_kernels(args: argparse.Namespace) -> None:
    from speculant.bench.kernels import bench_kernels, report

    result = bench_kernels(args.model, parse_width_ranges(args.widths), args.isa, args.repeats)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def run_peers(args: argparse.Namespace) -> None:
    """`speculant peers build-llamacpp`: llama.cpp's own tools and the library its backend runs on, built natively."""
    from speculant.models.backends.llamacpp_build import build

    if args.jobs is not None and not 1 <= args.jobs <= MOST_JOBS:
        raise ConfigError(f"--jobs must lie in [1, {MOST_JOBS}], got {args.jobs}")
    build(args.jobs, say=lambda line: print(line, file=sys.stderr))
