"""The `speculant` command line. Errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import select
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from speculant import __version__
from speculant.cache import exists, is_dir, is_file, readable
from speculant.config import (
    API_KEY_ENV,
    BACKENDS,
    DEFAULT_TARGET,
    LATENCY_RANGE,
    REQUEST_MOST,
    Given,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    ServeConfig,
    add_options,
    check_sampled,
    default_of,
    flag,
    from_args,
    from_flags,
    integer,
    latency_fits,
    number,
    reach_ray,
    sampling_of,
    with_default,
)
from speculant.drafters.spec import DEFAULT, check_dtype, model_free
from speculant.errors import ConfigError, SpeculantError, interrupted
from speculant.methods.drafting import held_drafters, takes_model_free, with_default_drafter
from speculant.methods.registry import METHODS, all_options, chain_methods, get_method


FILE, FILE_ANYWHERE, DIRECTORY = "file", "file anywhere", "directory"  # what a command's --out names (out_kind)
PARSER_KEYS = ("command", "out_kind", "given", "needs")  # what the parser notes beside the flags (no run's settings)


class Defaults(argparse.HelpFormatter):
    """Every flag's help ends in its default (`with_default`), unless it says it already, the default is None (the
    help says what then happens) or the flag is a switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        default = " ".join(map(str, action.default)) or "none" if isinstance(action.default, list) else action.default
        return text + with_default(text, default)[len(text):].replace("%", "%%")  # (argparse %-formats help)


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose usage errors are one line as speculant's own errors are,
    and whose help shows every flag's default. A flag is spelled whole (no prefix of it stands for it), given once
    (but for the repeatable ones, `action="append"`: a second `--methods` would drop the first list unseen) and never
    empty (`--prompts ''` would read as no flag given, and run on the default prompts)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, formatter_class=Defaults, allow_abbrev=False, **kwargs)
        self.flags_given: set[argparse.Action] = set()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.flags_given = set()  # (a parser parses once per command line, a subcommand's parser included)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's, but a flag no parser knows is named by the subcommand's parser, which points to its help."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            where: argparse.ArgumentParser = self
            while chosen := next((a for a in where._actions if isinstance(a, argparse._SubParsersAction)), None):
                where = chosen.choices[getattr(parsed, chosen.dest)]
            where.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # argparse calls this once per flag on the command line, with the strings given to it: the one place that
        # sees a flag given twice, and an empty value before its action reads it as nothing given.
        if action.option_strings:
            if action in self.flags_given and not isinstance(action, argparse._AppendAction):
                self.error(f"{'/'.join(action.option_strings)} given twice: give it once")
            self.flags_given.add(action)
            if "" in arg_strings:
                self.error(f"{'/'.join(action.option_strings)} has an empty value: give one, or leave the flag out")
        return super()._get_values(action, arg_strings)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"speculant: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="speculant", description="Lossless speculative inference of language models.")
    # Flags given; what a flag applies with (`check_needs`); what --out names (`check_outputs`).
    parser.set_defaults(given=frozenset(), needs={}, out_kind=FILE)
    parser.add_argument("--version", action="version", version=f"speculant {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text, streaming it as tokens are committed")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: catalog name, HF id or path (default: {DEFAULT_TARGET})")
    gen.add_argument("--method", default=None, choices=list(METHODS),
                     help="decoding method (default: auto; sd when an option of sd's that auto does not take is "
                     "given: --drafter, --k; --drafter none means ar): " +
                          "; ".join(f"{m.name}: {m.help}" for m in METHODS.values()))
    add_method_options(gen)
    gen.add_argument("--bigram-corpus", nargs="+", default=None, metavar="FILE",
                     help="text files for maxgram's bigram fallback (default: the Python standard library)")
    gen.add_argument("--timeline", default=None, metavar="PNG", help="dsi: draw the servers' forwards over time")
    add_options(gen, SamplingConfig)
    add_options(gen, RunConfig)
    add_options(gen, ModelConfig)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print text, token ids and full stats as one JSON object")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="structured output: the text is JSON that matches this schema (speculation stays exact)")
    shape.add_argument("--grammar", default=None, metavar="FILE", help="structured output: a Lark grammar (llguidance's)")

    bench = commands.add_parser("bench", help="run a method matrix over a prompt set and compare speed")
    bench.add_argument("--target", default=DEFAULT_TARGET, action=Given,
                       help=f"target model (default: {DEFAULT_TARGET})")
    bench.add_argument("--methods", nargs="+", default=["ar", "sd:k=4"], action=Given,
                       help="methods with options, e.g. ar sd:drafter=qwen2.5-coder-0.5b,k=4,dtype=bf16, and peers: "
                       "hf-ar, hf-assisted, hf-pld, llamacpp-ar, llamacpp-pld (in-process), llamacpp-cli-ar, "
                       "llamacpp-cli-spec, llamacpp-cli-ngram (llama.cpp's own tools)")
    data = bench.add_mutually_exclusive_group()
    data.add_argument("--dataset", default="humaneval[:10]", action=Given,
                      help="humaneval[:N], a JSONL file of prompts (FILE.jsonl[:N]), or several joined with + "
                      "(default: humaneval[:10])")
    data.add_argument("--prompts", default=None, metavar="FILE.jsonl[:N]", action=Given,
                      help="JSONL records with 'prompt' (and 'chat': true for the chat template), MT-bench style "
                      "'turns' (the first, chat template) or 'messages'; optional 'id', 'category' and "
                      "'response_format' (structured output, as OpenAI's)")
    add_options(bench, RunConfig, seed=0)
    add_options(bench, SamplingConfig)
    bench.add_argument("--repeats", type=count, default=1, action=Given,
                       help="run the whole interleaved matrix this many times")
    bench.add_argument("--isolate", action=Given, nargs=0, const=True, default=False,
                       help="run each of speculant's generations in a fresh process after a warm-up generation, as "
                            "llama.cpp's tools (llamacpp-cli-*) and `speculant generate` run")
    bench.add_argument("--ignore-response-format", action=Given, nargs=0, const=True, default=False,
                       help="generate free text where the prompts ask for structured output (to compare the two)")
    bench.add_argument("--report-from", default=None, metavar="RESULTS.json",
                       help="run nothing: report a finished run's results.json again (with --baseline, --out)")
    bench.add_argument("--baseline", default=None, metavar="METHOD",
                       help="speedups over this method of the list, e.g. llamacpp-cli-ar, or default: each method's "
                            "over the first ar that samples as it does (on its target weights where one ran), else "
                            "the first ar (a run reported again: the baseline it was reported over)")
    add_options(bench, ModelConfig)
    bench.add_argument("--out", default=None, help="directory for results.json and report.md")
    bench.set_defaults(out_kind=DIRECTORY)

    prof = commands.add_parser("profile", help="show the machine profile auto uses (T(W) of a model, measured once "
                               "per machine), or measure TTFT, TPOT and T(W) on prompts with --widths")
    prof.add_argument("--model", "--target", default=DEFAULT_TARGET, help=f"model to profile (default: "
                      f"{DEFAULT_TARGET}; --target as the other commands spell it)")
    prof.add_argument("--drafter", default=None, help="also profile this drafter and report its cost ratio c")
    prof.add_argument("--drafter-dtype", choices=("bf16", "fp32"), default=None, action=Given,
                      help="dtype of the drafter (default: the target's)")
    prof.add_argument("--widths", default=None, help="measure now, on prompts, these new-token counts W, e.g. 1-64 "
                      "or 1,2,4,8 (default: show the machine profile, measuring it once if it is missing)")
    prof.add_argument("--dataset", default="humaneval[:5]", action=Given, help="with --widths: prompts for TTFT and "
                      "TPOT")
    prof.add_argument("--context-len", type=count, default=256, action=Given,
                      help="with --widths: cached tokens before the T(W) forwards")
    prof.add_argument("--repeats", type=count, default=3, action=Given, help="with --widths: timings per width")
    prof.set_defaults(needs={"dataset": "widths", "context_len": "widths", "repeats": "widths",
                             "drafter_dtype": "drafter"})
    add_options(prof, ModelConfig)
    prof.add_argument("--out", default=None, help="write the profile as JSON (the drafter's beside it, its suffix "
                      ".drafter.json: p.json, p.drafter.json)")

    acc = commands.add_parser("acceptance", help="estimate how often a drafter agrees with the target")
    acc.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    acc.add_argument("--drafter", default=DEFAULT, help="one model drafter or several, comma-separated (the target "
                     "generates once for all; default: the target's catalog drafter)")
    acc.add_argument("--drafter-dtype", choices=("bf16", "fp32"), default=None,
                     help="dtype of model drafters (default: the target's)")
    acc.add_argument("--dataset", default="humaneval[:10]", help="humaneval[:N]: the target's outputs the drafters "
                     "are judged on")
    acc.add_argument("--max-new-tokens", type=integer, default=128, help="tokens the target generates per prompt")
    acc.add_argument("--temperature", type=non_negative, default=0.0, help="> 0 also reports sum_x min(p, q)")
    acc.add_argument("--depth", type=count, default=None,
                     help="draft positions in the per-position curve (default: 8, or --max-new-tokens if fewer)")
    add_options(acc, ModelConfig)
    acc.add_argument("--json", action="store_true", help="print the estimates as JSON")

    depth = commands.add_parser("train-depth", help="train Yggdrasil's depth predictor for a target and drafter "
                                "(the tree method then drafts the depth it predicts pays best)")
    depth.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    depth.add_argument("--drafter", default=DEFAULT, help="a model drafter with the target's vocabulary (default: the "
                       "target's catalog drafter)")
    depth.add_argument("--drafter-dtype", choices=("bf16", "fp32"), default=None,
                       help="dtype of the drafter (default: the target's)")
    data = depth.add_mutually_exclusive_group()
    data.add_argument("--dataset", default=None, help="prompts to log trees on (default: the prompts shipped in "
                      "speculant/analysis/depth_corpus.jsonl and humaneval[30:60], apart from every benchmark's)")
    data.add_argument("--prompts", default=None, metavar="FILE.jsonl[:N]",
                      help="prompts to log trees on, as bench reads them")
    depth.add_argument("--max-new-tokens", type=count, default=64, help="tokens generated per prompt")
    depth.add_argument("--max-depth", type=count, default=8, help="depth of the logged trees: the most it predicts")
    depth.add_argument("--width", type=count, default=1, help="nodes per drafting step of the logged trees")
    depth.add_argument("--inputs", nargs="+", choices=("hidden", "features"), default=None,
                       help="what the predictor reads: the target's last hidden state (the paper's; default where the "
                       "backend gives it) or four features of its distribution; several: one predictor each, from "
                       "the same logged trees")
    add_options(depth, ModelConfig)
    depth.add_argument("--out", default=None, help="write it here (default: where the tree method finds it)")
    depth.set_defaults(out_kind=FILE_ANYWHERE)  # (its directories are made)

    serve = commands.add_parser("serve", help="an OpenAI-compatible server (completions, chat, streaming, /metrics) "
                                "with speculative decoding and continuous batching")
    serve.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default: {DEFAULT_TARGET})")
    serve.add_argument("--method", default=None, choices=list(METHODS),
                       help="the server's decoding method (default: auto; sd when --drafter or --k is given); a "
                            "request may pick another through extra_body={'speculant': {'method': ..., 'k': ...}}")
    add_method_options(serve)
    add_options(serve, ModelConfig)
    add_options(serve, ServeConfig)

    load = commands.add_parser("bench-serve", help="load a running server: N requests at concurrency C, or "
                               "conversations arriving at a Poisson rate; throughput, "
                               "TTFT and inter-token latency percentiles, errors")
    load.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's base URL")
    load.add_argument("--api-key", default=None, help="the server's key, sent as a bearer token")
    load.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    data = load.add_mutually_exclusive_group()
    data.add_argument("--dataset", default="humaneval[:10]", help="humaneval[:N] (default: humaneval[:10])")
    data.add_argument("--prompts", default=None, metavar="FILE.jsonl[:N]", help="JSONL prompts (chat when 'turns')")
    load.add_argument("--requests", type=count, default=32, help="requests to send, cycling over the prompts (with "
                      "--rate: conversations)")
    arrivals = load.add_mutually_exclusive_group()
    arrivals.add_argument("--concurrency", type=count, nargs="+", default=[1, 4, 16],
                          help="clients at once; one run each")
    arrivals.add_argument("--rate", type=positive, nargs="+", default=None, help="open loop instead: conversations "
                          "arrive at this Poisson rate per second, whatever the backlog; one run each")
    load.add_argument("--turns", type=count, default=1, action=Given, help="with --rate: turns per conversation, each "
                      "resending the history with the reply and a follow-up question")
    load.set_defaults(needs={"turns": "rate"})
    load.add_argument("--max-tokens", type=count, default=64, help="max_tokens of each request")
    load.add_argument("--temperature", type=non_negative, default=0.0, help="temperature of each request")
    load.add_argument("--check-solo", action="store_true",
                      help="then send each distinct prompt alone and count outputs that differ (greedy)")
    load.add_argument("--label", default=None, help="a name for this server's configuration in the results "
                      "(default: the --url)")
    load.add_argument("--out", default=None, help="append the results to OUT/results.jsonl and redraw OUT/report.md and "
                      "OUT/throughput.png from all of them")
    load.set_defaults(out_kind=DIRECTORY)

    peers = commands.add_parser("peers", help="set up the peers speculant bench compares with")
    what = peers.add_subparsers(dest="peers", required=True)
    tools = what.add_parser("build-llamacpp", help="build llama.cpp natively for this machine, once, into the cache, "
                            "from llama-cpp-python's sdist (the installed release, else 0.3.36): its own tools "
                            "(llama-bench, llama-completion, llama-speculative-simple, llama-server; the peers "
                            "llamacpp-cli-ar, -spec and -ngram, and the serving peer) and the library the llama.cpp "
                            "backend runs on; installs llama-cpp-python's bindings, without a library of their own, "
                            "where they are missing")
    tools.add_argument("--jobs", type=integer, default=None,
                       help="parallel compile jobs (default: the cores this process may run on)")

    kern = commands.add_parser("bench-kernels", help="T(W) of speculant's quantized kernels on a GGUF model's own "
                               "matrices, W rows through every linear layer, per ISA path of this machine")
    kern.add_argument("--model", default=DEFAULT_TARGET, help=f"catalog name or .gguf file, its matrices as the lean "
                      f"backend runs them (default: {DEFAULT_TARGET})")
    kern.add_argument("--widths", default="1-8,16", help="rows per call, e.g. 1-16 or 1,2,4,8 (default: 1-8,16)")
    kern.add_argument("--isa", nargs="+", default=None, help="paths to time (default: all but scalar)")
    kern.add_argument("--repeats", type=count, default=5, help="timings per width")
    kern.add_argument("--out", default=None, help="write the result as JSON")

    simulate = commands.add_parser("simulate", help="offline simulation of non-SI, SI and DSI (no model needed)")
    sims = simulate.add_subparsers(dest="simulation", required=True)
    from speculant.analysis.commands import LOOKAHEADS  # numpy only
    one = sims.add_parser("run", help="expected latency of non-SI, SI and DSI for one configuration")
    target = one.add_mutually_exclusive_group()
    target.add_argument("--target-latency", type=latency_ms, default=None, metavar="MS",
                        help="target forward (TPOT), ms")
    target.add_argument("--target-profile", default=None, metavar="JSON",
                        help="take the target's TPOT and TTFT from a `speculant profile` file")
    drafter = one.add_mutually_exclusive_group()
    drafter.add_argument("--drafter-latency", type=latency_ms, default=None, metavar="MS",
                         help="drafter forward, ms")
    drafter.add_argument("--drafter-profile", default=None, metavar="JSON", help="take the drafter's TPOT from a "
                         "profile")
    one.add_argument("--acceptance", type=number, required=True, help="per-token acceptance rate in [0, 1]")
    one.add_argument("--lookahead", type=integer, required=True, help="draft tokens per verification")
    one.add_argument("--servers", type=integer, default=1, help="target servers for DSI (default: 1)")
    one.add_argument("--tokens", type=integer, default=100, help="tokens to generate (default: 100)")
    one.add_argument("--ttft", type=latency_ms, default=None, metavar="MS",
                     help="the target's first forward (default: --target-profile's TTFT, else TPOT)")
    one.add_argument("--repeats", type=integer, default=1000, help="simulated generations per method")
    one.add_argument("--seed", type=integer, default=0, help="seed of the simulated acceptances")
    one.add_argument("--json", action="store_true", help="print one JSON object (keys non_si_ms, si_ms, dsi_ms, ...)")
    online = sims.add_parser("online", help="the latency twin: non-SI, SI and DSI through the real engine, "
                             "every forward padded to the given latencies (pure mode: i.i.d. acceptance, no model)")
    online.add_argument("--target-latency", type=latency_ms, required=True, metavar="MS", help="target forward (TPOT), ms")
    online.add_argument("--drafter-latency", type=latency_ms, required=True, metavar="MS", help="drafter forward, ms")
    online.add_argument("--ttft", type=latency_ms, default=None, metavar="MS", help="the target's first forward (default: TPOT)")
    online.add_argument("--acceptance", type=number, required=True, help="per-token acceptance rate in [0, 1]")
    online.add_argument("--servers", type=integer, default=7, help="target servers (default: 7, an 8-GPU node)")
    online.add_argument("--lookahead", type=integer, default=None, help="default: planned for the servers")
    online.add_argument("--tokens", type=integer, default=50, help="tokens to generate (default: 50, as in the paper)")
    online.add_argument("--repeats", type=count, default=5, help="prompts, each run by every method (default: 5)")
    online.add_argument("--executor", choices=("thread", "process", "ray"), default="thread",
                        help="where DSI's target servers run")
    online.add_argument("--ray-address", default=None, action=Given, help="with --executor ray: join this cluster "
                        "(default: start one)")
    online.set_defaults(needs={"ray_address": "executor=ray"})
    online.add_argument("--more-drafter", action="append", default=[], metavar="MS:ACCEPTANCE",
                        help="a costlier drafter beside the first (repeatable): DSI with each alone and with all "
                        "together (Algorithm 1 with m > 2 models)")
    online.add_argument("--timeline", default=None, metavar="PNG", help="draw the last DSI run")
    online.add_argument("--seed", type=integer, default=0, help="seed of the acceptances")
    online.add_argument("--json", action="store_true", help="print one JSON object")
    heat = sims.add_parser("heatmap", help="the DSI paper's Figure 2 and 7 heatmaps, CSV and summary")
    heat.add_argument("--out", required=True, help="directory for grid.csv, figure2.png, figure7.png, summary.json")
    heat.set_defaults(out_kind=DIRECTORY)
    heat.add_argument("--ndim", type=integer, default=20, help="grid intervals per axis on the paper's axes (default: 20; "
                      "the paper's heatmaps: 100, about 100 x 99 cells)")
    heat.add_argument("--lookaheads", default=",".join(map(str, LOOKAHEADS)),
                      help="lookaheads searched per cell, comma-separated (default: 18 from 1 to 100; the paper "
                      "searched every one from 1 to ndim)")
    heat.add_argument("--tokens", type=integer, default=100, help="tokens per simulated generation")
    heat.add_argument("--repeats", type=integer, default=10, help="repeats per configuration, common random numbers "
                      "(default: 10)")
    heat.add_argument("--servers", type=integer, default=7, help="target servers, SP degree (default: 7, an 8-GPU node)")
    heat.add_argument("--fixed-lookahead", type=integer, default=5, help="lookahead of Figure 7 (default: 5)")
    heat.add_argument("--seed", type=integer, default=0, help="seed of the common random numbers")
    return parser


def add_method_options(parser: argparse.ArgumentParser) -> None:
    """One flag per option of any registered method, kept as text: the chosen method parses and validates
    what was given, so a flag its method does not take is one clear error."""
    for name in all_options():
        meanings: dict[str, list[str]] = {}  # what the flag means -> the methods it means that for
        for method in METHODS.values():
            for f in fields(method.options):
                if f.name == name:
                    meanings.setdefault(with_default(f.metadata.get("help", ""), default_of(f)), []).append(method.name)
        parser.add_argument(flag(name), dest=name, default=None, metavar=name.upper(),
                            help="; ".join(f"{', '.join(methods)}: {text}" for text, methods in meanings.items()))


def resolve_method(method: str | None, given: dict[str, str]) -> str:
    """The method to run: `--method`, else ar for `--drafter none`, else as `generate()` decides."""
    from speculant.api import method_for

    if given.get("drafter") == "none":
        del given["drafter"]
        if method not in (None, "ar"):
            raise ConfigError(f"method '{method}' needs a drafter, but --drafter is none")
        return "ar"
    return method_for(method, given)


def read_constraint(schema: str | None, grammar: str | None) -> Any:
    """The structured output `generate --json-schema/--grammar` asks for (None: free text); a ConfigError for a
    file that is missing or not JSON."""
    from speculant.models.wrappers.constrained import Constraint

    path = schema or grammar
    if path is None:
        return None
    try:
        text = readable(path, f"{'schema' if schema else 'grammar'} file").read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path} as text: {error}") from None
    if grammar:
        return Constraint("grammar", text)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"{path} is not JSON: {type(error).__name__}: {error}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds no JSON schema object")
    return Constraint("json_schema", value)


def run_generate(args: argparse.Namespace) -> None:
    from speculant.api import check_models, check_prompt, check_request, generate
    from speculant.drafters.spec import MAXGRAM, DrafterSpec
    from speculant.session import Session
    from speculant.methods.drafting import as_keywords, with_drafters
    from speculant.models import load_model

    given = {name: getattr(args, name) for name in all_options() if getattr(args, name) is not None}
    method = get_method(from_flags(lambda: resolve_method(args.method, given), all_options()))
    options = from_flags(lambda: method.parse_options(given), all_options())
    sampling = from_args(SamplingConfig, args)
    check_sampled(sampling, args.given, flag)
    method.check_verifier(args.given, flag)
    run = from_args(RunConfig, args)
    model_config = from_args(ModelConfig, args)
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    check_prompt(args.prompt)  # (bytes the shell passed that are not UTF-8: Python keeps them as lone surrogates)
    check_models([args.target], held_drafters(options), takes_model_free(options))
    options = from_flags(lambda: with_default_drafter(options, args.target), all_options())
    sources = held_drafters(options)
    check_target(args.target, model_config, options)
    own = method.name == "auto" and options.drafters is None  # auto's own drafters: Max-Gram among them
    if args.bigram_corpus and not own and not any(isinstance(d, DrafterSpec) and d.kind == MAXGRAM for d in sources):
        raise ConfigError("--bigram-corpus applies to the maxgram drafter only")
    files = [readable(f, "bigram corpus file") for f in args.bigram_corpus or []]
    if empty := [str(f) for f in files if is_file(f) and f.stat().st_size == 0]:  # (a pipe's size is not known)
        raise ConfigError(f"bigram corpus file is empty: {', '.join(empty)}")
    if args.timeline and method.name != "dsi":
        raise ConfigError("--timeline applies to --method dsi only")
    constraint = read_constraint(args.json_schema, args.grammar)
    check_request(method.name, None, None, constraint)
    if getattr(options, "executor", None) == "ray":
        reach_ray(options.ray_address, "--ray-address")

    print(f"loading target {args.target} (backend {model_config.backend}, dtype {model_config.dtype}, "
          f"{model_config.device})", file=sys.stderr)
    target = load_model(args.target, dtype=model_config.dtype, device=model_config.device,
                        backend=model_config.backend, compile=model_config.compile)
    print(f"target {target.name}: {target.numerics}, {target.kernel} kernel", file=sys.stderr)
    session = Session(target)

    def load(drafter: Any) -> Any:
        if isinstance(drafter, DrafterSpec) and drafter.kind == MAXGRAM and files:
            from speculant.drafters.maxgram import MaxGramDrafter, load_bigram

            return MaxGramDrafter(load_bigram(target.tokenizer, target.vocab_size, files))
        if isinstance(drafter, DrafterSpec) and not model_free(drafter):
            print(f"loading drafter {drafter}", file=sys.stderr)
        return session.drafter(drafter, getattr(options, "drafter_dtype", None))

    if files and own:
        from speculant.methods.auto import with_own_drafters

        options = with_own_drafters(options, target)
    options = with_drafters(options, load)
    stream = generate(target, args.prompt, method=method.name, max_new_tokens=run.max_new_tokens, seed=run.seed,
                      stream=True, chat=args.chat, response_format=constraint, session=session,
                      **as_keywords(sampling), **as_keywords(options))
    if args.json:
        for _ in stream:
            pass
    else:
        from speculant.serve.text import TextStream

        text = TextStream(target.tokenizer)
        try:
            for token in stream:
                sys.stdout.write(text.push(token))
                sys.stdout.flush()
        except BaseException as error:
            if text.sent and not isinstance(error, BrokenPipeError):  # (an error's line, or the shell's prompt,
                print(flush=True)  # starts on a line of its own)
            raise
        sys.stdout.write(text.flush() + "\n")
    result = stream.result
    assert result is not None
    if args.json:
        print(json.dumps({"target": args.target, "dtype": target.numerics, "kernel": target.kernel,
                          "method": method.name, "drafters": list(map(str, sources)),
                          "text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()},
                         indent=1))
    print(result.stats.summary(), file=sys.stderr)
    compiled = getattr(getattr(target, "weights", None), "compile_seconds", None)
    if compiled is not None:  # the static backend's first compiled step (inductor caches it for later runs)
        print(f"compiled the step in {compiled:.1f} s (its first call; inductor's cache keeps it for later runs)",
              file=sys.stderr)
    if args.timeline and result.stats.dsi is not None:
        from speculant.decoding.dsi.timeline import plot_timeline

        print(f"wrote {plot_timeline(result.stats.dsi, Path(args.timeline))}", file=sys.stderr)


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


def free_text(prompts: list[Any], command: str) -> list[Any]:
    """`prompts`, which `command` decodes as free text: one with a response_format (which bench and servers follow)
    is refused rather than run unconstrained without a word."""
    if odd := next((p for p in prompts if p.response_format is not None), None):
        raise ConfigError(f"{command} decodes its prompts as free text: prompt {odd.id} has a response_format, which "
                          "it would not follow (bench follows it; leave it out of the file)")
    return prompts


def read_results(path: Path) -> dict[str, Any]:
    """The results.json of an earlier `speculant bench --out` run, or a ConfigError saying why not."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
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


MAX_WIDTH = 4096  # the widest forward a profile times (tokens in one call)


def parse_width_ranges(text: str) -> list[int]:
    """`1-16,24,32` -> [1, ..., 16, 24, 32], each within [1, MAX_WIDTH]."""
    widths: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.partition("-")
        try:
            first, last = integer(low), integer(high if dash else low)
        except ValueError:
            raise ConfigError(f"widths must look like 1-16,24,32, got '{text}'") from None
        if not 1 <= first <= last <= MAX_WIDTH:
            raise ConfigError(f"widths must lie in [1, {MAX_WIDTH}], each range's first no larger than its last; "
                              f"got '{part}'")
        widths.update(range(first, last + 1))
    return sorted(widths)


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


def run_serve(args: argparse.Namespace) -> None:
    from speculant.api import check_models
    from speculant.models.backends import capabilities_of
    from speculant.serve import serving_backend

    if args.api_key is None and API_KEY_ENV in os.environ:  # (`ps` shows a flag's value to any user; set but
        # empty, as a secret that failed to load: refused, not a server without a key)
        args.api_key = os.environ[API_KEY_ENV]
    config = from_args(ServeConfig, args)
    if "replica_cpus" in args.given and not config.on_ray:
        raise ConfigError("--replica-cpus applies to Ray Serve replicas: with --replicas above 1 or --ray-cluster")
    model_config = from_args(ModelConfig, args)
    given = {name: getattr(args, name) for name in all_options() if getattr(args, name) is not None}
    method = get_method(from_flags(lambda: resolve_method(args.method, given), all_options()))
    options = from_flags(lambda: method.parse_options(given), all_options())
    check_models([args.target], held_drafters(options), takes_model_free(options))
    options = from_flags(lambda: with_default_drafter(options, args.target), all_options())
    backend = check_target(args.target, model_config, options, serving_backend(model_config))
    if "prefix_cache_mb" in args.given and config.prefix_cache_mb and not capabilities_of(backend).reuses_prefixes:
        raise ConfigError(f"--prefix-cache-mb: the {backend} backend keeps no prompts' KV for reuse (backends that "
                          f"do: {', '.join(b for b in BACKENDS if capabilities_of(b).reuses_prefixes)})")
    served_name = config.served_name or args.target
    if config.own_ray:  # (on a cluster, its own HTTP proxy binds the port, maybe on another node)
        check_listen(config.host, config.port)
    if config.on_ray:
        from speculant.serve.replicas import serve_replicas

        serve_replicas(args.target, model_config, method.name, options, config, served_name)
    else:
        from speculant.serve.app import serve

        serve(args.target, model_config, method.name, options, config, served_name)


def check_target(target: str, config: ModelConfig, options: Any, backend: str | None = None,
                 dtype: str | None = None) -> str:
    """The backend the target will load on; refuse, before it loads, a backend its name refuses (`@gguf` off
    llama.cpp, a .gguf file on transformers), a model drafter's suffix its weights refuse as well, and `options` its
    backend cannot run (`methods.drafting.needs`): DSI where the backend makes no replicas, `self@skip` off the lean
    backend. `backend` and `dtype`: a bench method's own."""
    from speculant.drafters.spec import MODEL, DrafterSpec
    from speculant.methods.drafting import elsewhere, held_drafters, needs, unmet
    from speculant.models import split_quant
    from speculant.models.backends import capabilities_of
    from speculant.models.loading import check_gguf_dtype, resolve_backend

    name, quant = split_quant(target)  # (a backend the target's name or suffix refuses is refused here too)
    backend = resolve_backend(backend or config.backend, name, quant, config.device, dtype or config.dtype)
    check_gguf_dtype(target, backend, dtype or config.dtype)
    for drafter in held_drafters(options) if options is not None else ():
        if isinstance(drafter, DrafterSpec) and drafter.kind == MODEL and (suffix := drafter.quant or drafter.backend):
            try:  # (@gguf or @lean of transformers weights, @int8 of a GGUF's: as its load would refuse it)
                resolve_backend(None, drafter.source, suffix, None, None)
            except ConfigError as error:
                raise ConfigError(f"drafter {drafter}: {error}") from None
    if needs(options):
        if need := unmet(options, capabilities_of(backend)):
            raise ConfigError(f"{need[1]}: the {backend} backend does not offer that "
                              f"({elsewhere(options, 'load the target with --backend {}')})")
    return backend


def check_listen(host: str, port: int) -> None:
    """Refuse, before any model loads, an address this process cannot listen on (a port in use, a host that is not
    this machine's)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a listener still refuses
            probe.bind(address)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


MOST_ARRIVAL_S = 24 * 3600  # bench-serve --rate: the conversations of one run arrive within a day


def run_bench_serve(args: argparse.Namespace) -> None:
    from speculant.bench.datasets import load_dataset
    from speculant.bench.serve import RESULTS, format_load, read_runs, run_load, run_sessions, write_report

    if not 0 <= args.temperature <= 2:  # (a server refuses more: OpenAI's range)
        raise ConfigError(f"--temperature must lie in [0, 2], got {args.temperature:g}")
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
    if args.api_key is not None and not args.api_key.isascii():
        raise ConfigError("--api-key must be ASCII (it goes in an HTTP header)")
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


def run_simulate(args: argparse.Namespace) -> None:
    from speculant.analysis.commands import format_heatmap, format_one, run_heatmap, simulate_one

    if args.simulation == "online":
        from speculant.analysis.online import format_online, simulate_online

        more = tuple(more_drafter(text) for text in args.more_drafter)
        if args.executor == "ray":
            reach_ray(args.ray_address, "--ray-address")
        plain_s = args.repeats * ((args.ttft or args.target_latency) + (args.tokens - 1) * args.target_latency) / 1000
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


def run_bench_kernels(args: argparse.Namespace) -> None:
    from speculant.bench.kernels import bench_kernels, report

    result = bench_kernels(args.model, parse_width_ranges(args.widths), args.isa, args.repeats)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output path that cannot be written: a directory's path taken by a file, a
    file's path taken by a directory or within a directory that does not exist (where the command does not make it),
    or a place where nothing can be written (`check_writable`)."""
    written = []  # the files it writes (where one is a file it reads, that is refused)
    for name in ("out", "timeline"):
        if getattr(args, name, None) is None:
            continue
        try:
            check_output(Path(getattr(args, name)), args.out_kind if name == "out" else FILE, name)
        except OSError as error:  # (a name the system cannot hold, as one too long)
            raise ConfigError(f"--{name} {getattr(args, name)}: {error.strerror or error}") from None
        written += [(Path(getattr(args, name)), name)] if name == "timeline" or args.out_kind != DIRECTORY else []
    for path in companions(args):
        check_output(path, args.out_kind, "out")
        written.append((path, "out"))
    if getattr(args, "out", None) and args.out_kind == DIRECTORY:  # (one of its files there already, or a directory
        for path in (Path(args.out) / name for name in written_in(args)):  # in its place: checked as a file --out
            if path.exists():  # names, before the work)
                check_output(path, FILE, "out")
                written.append((path, "out"))
    reads = read_files(args) if written else []  # (a dataset's files: bench.datasets, torch, only where one is written)
    for path, name in written:
        if not is_file(path):
            continue
        if read := next((named for named, given in reads if is_file(given) and path.samefile(given)), None):
            raise ConfigError(f"--{name} {path} is the file {read} reads: it would be written over")
        if read := next((named for named, given in reads if path.resolve().is_relative_to(given.resolve())), None):
            raise ConfigError(f"--{name} {path} is a file of the model {read} reads: it would be written over")


# The flags that name files a command reads: datasets, models (a file, or a folder of them), and the others (not
# bench's --report-from: a run is reported again in place, its rows read whole before they are written)
DATASET_FLAGS = ("prompts", "dataset")
MODEL_FLAGS = ("model", "target", "drafter", "drafters")
READ_FLAGS = ("json_schema", "grammar", "target_profile", "drafter_profile", "bigram_corpus")


def read_files(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(flag, path) for each existing file a command's flags name to read (a dataset's parts too), and each model
    folder (a model named with a suffix, `path@int8`, is its path's)."""
    found = []
    for name in (*DATASET_FLAGS, *MODEL_FLAGS, *READ_FLAGS):
        given = getattr(args, name, None)
        for value in given if isinstance(given, list) else [given] if isinstance(given, str) else []:
            if name in DATASET_FLAGS:  # (imported where a dataset is named: `simulate` runs without torch)
                from speculant.bench.datasets import dataset_files

                found += [(flag(name), path) for path in dataset_files(value)]  # (files only)
                continue
            for named in value.split(",") if name == "drafters" else [value]:
                path = Path(named) if name not in MODEL_FLAGS or exists(Path(named)) else \
                    Path(named.rpartition("@")[0] or named)
                if is_file(path) or name in MODEL_FLAGS and is_dir(path):
                    found.append((flag(name), path))
    return found


def written_in(args: argparse.Namespace) -> tuple[str, ...]:
    """The files a command whose --out names a directory writes there."""
    if args.command == "bench":
        from speculant.bench.report import PLOTS

        return ("results.json", "report.md", *PLOTS)
    if args.command == "bench-serve":
        from speculant.bench.serve import PLOT, REPORT, RESULTS

        return RESULTS, REPORT, PLOT
    from speculant.analysis.commands import HEATMAP_FILES

    return HEATMAP_FILES


def companions(args: argparse.Namespace) -> list[Path]:
    """The files a command writes beside --out's: a profiled drafter's, train-depth's predictor of each input kind
    where it trains several."""
    if not getattr(args, "out", None):
        return []
    if args.command == "profile" and args.drafter:
        return [drafter_profile_path(Path(args.out))]
    if args.command == "train-depth":
        kinds = list(dict.fromkeys(args.inputs or []))
        return [predictor_out(Path(args.out), kind, len(kinds)) for kind in kinds] if len(kinds) > 1 else []
    return []


def drafter_profile_path(out: Path) -> Path:
    """Where `profile --out OUT --drafter` writes the drafter's profile."""
    return out.with_suffix(".drafter.json")


def predictor_out(out: Path, kind: str, kinds: int) -> Path:
    """Where `train-depth --out OUT` writes the predictor of inputs `kind`, one of `kinds` it trains."""
    return out if kinds == 1 else out.with_name(f"{out.stem}-{kind}.json")


def check_output(path: Path, kind: str, name: str) -> None:
    """`check_outputs` for one path that --`name` writes, a FILE or a DIRECTORY."""
    if kind == DIRECTORY:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--{name} {path} is a file: it names a directory here")
    elif path.is_dir():
        raise ConfigError(f"--{name} {path} is a directory: it names a file here")
    if path.is_file() and not os.access(path, os.W_OK):  # (a file there already: written over in place)
        raise ConfigError(f"--{name} {path} cannot be written over (this process may not write it)")
    if not path.is_file():
        check_writable(path, kind, name)
    if name == "timeline":
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = path.suffix.lstrip(".").lower()  # (none: matplotlib's png)
        if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():
            raise ConfigError(f"--timeline {path}: '{suffix}' is no image format matplotlib writes (png, svg, pdf, "
                              "...)")


def check_writable(path: Path, kind: str, name: str) -> None:
    """Refuse a new output `path` where nothing can be made: under a file, in a directory that does not exist (a
    FILE's is not made), or in one that takes no file (/proc, no permission)."""
    import tempfile

    base = path if kind == DIRECTORY else path.parent  # where the command writes (and makes what is missing)
    while not base.exists() and kind != FILE:
        base = base.parent
    if base.exists() and not base.is_dir():
        raise ConfigError(f"--{name} {path}: {base} is a file, not a directory")
    if not base.is_dir():
        raise ConfigError(f"--{name} {path}: the directory {base} does not exist")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as error:
        raise ConfigError(f"--{name} {path}: nothing can be written in {base} ({error.strerror})") from None


def check_needs(args: argparse.Namespace) -> None:
    """Refuse, before any work, a flag given where it does nothing: its command's `needs` name the flag (or flag=value)
    it applies with."""
    for name, needed in args.needs.items():
        other, _, value = needed.partition("=")
        if name in args.given and (getattr(args, other) != value if value else not getattr(args, other)):
            raise ConfigError(f"{flag(name)} applies with {flag(other)}{' ' + value if value else ''} only")


def latency_ms(text: str) -> float:
    """A latency flag: milliseconds, 0 (a first forward's, or a drafter's refused by name) or a number from
    LEAST_LATENCY_MS to MOST_LATENCY_MS."""
    value = non_negative(text)
    if value and not latency_fits(value):
        raise argparse.ArgumentTypeError(f"must be 0 or lie in {LATENCY_RANGE}, got {text!r}")
    return value


def count(text: str) -> int:
    """A flag's integer >= 1 (requests, clients, repeats, tokens)."""
    value = read_flag(text, integer, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def positive(text: str) -> float:
    """A flag's finite number > 0 (a rate)."""
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A flag's finite number >= 0 (a latency, a rate, a temperature)."""
    value = read_flag(text, number, "a number")
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def read_flag(text: str, read: Any, kind: str) -> Any:
    """`read(text)`, or argparse's usage error saying the text is not `kind`."""
    try:
        return read(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)  # (a usage error exits 2 from inside)
        check_outputs(args)
        check_needs(args)
        if args.command == "generate":
            run_generate(args)
        elif args.command == "bench":
            run_bench(args, argv)
        elif args.command == "simulate":
            run_simulate(args)
        elif args.command == "profile":
            run_profile(args)
        elif args.command == "acceptance":
            run_acceptance(args)
        elif args.command == "train-depth":
            run_train_depth(args)
        elif args.command == "serve":
            run_serve(args)
        elif args.command == "bench-serve":
            run_bench_serve(args)
        elif args.command == "bench-kernels":
            run_bench_kernels(args)
        elif args.command == "peers":
            from speculant.models.backends.llamacpp_build import build

            if args.jobs is not None and args.jobs < 1:
                raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
            build(args.jobs, say=lambda line: print(line, file=sys.stderr))
    except SpeculantError as error:  # (one line, whatever a library's message spanned)
        print(f"speculant: error: {' '.join(line.strip() for line in str(error).splitlines())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        return interrupted(error)
    except BrokenPipeError:
        if not reader_gone():  # (another pipe: a server process's, a socket's)
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail again)
        return 141  # quietly, as a shell's tools end on SIGPIPE (128 + 13)
    except OSError as error:  # the machine's answer to a write (a disk full, /dev/full): one line, not a traceback
        where = "".join(f": {name}" for name in (error.filename, error.filename2) if name)
        print(f"speculant: error: {' '.join(str(error.strerror or error).split())}{where}", file=sys.stderr)
        return 2 if error.errno == errno.ENAMETOOLONG else 1  # (a name given too long is the input's error)
    return 0


def reader_gone() -> bool:
    """Whether standard output is a pipe whose reader went away (`speculant generate ... | head`): its end reports
    an error (POLLERR, as Linux and the BSDs report a pipe with no reader)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return bool(poller.poll(0))
    except (AttributeError, OSError, ValueError):  # (no poll; stdout no file: a test's capture)
        return False


if __name__ == "__main__":
    sys.exit(main())
