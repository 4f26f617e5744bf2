"""The command line's parser: every command's flags, argparse made strict (one-line errors, each flag given once and
never empty), and the readers of flag values."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from typing import Any, NoReturn

from speculant import __version__
from speculant.config import (
    DEFAULT_TARGET,
    LATENCY_RANGE,
    Given,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    ServeConfig,
    add_options,
    default_of,
    flag,
    integer,
    latency_fits,
    number,
    with_default,
)
from speculant.drafters.spec import DEFAULT
from speculant.errors import ConfigError
from speculant.methods.registry import METHODS, all_options


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
    (but for the repeatable ones, `action="append"`: a second `--methods` would drop the first list unseen), a list's
    entry once, and never empty (`--prompts ''` would read as no flag given, and run on the default prompts)."""

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
        values = super()._get_values(action, arg_strings)
        if action.nargs in ("+", "*") and (twice := next((i for i, v in enumerate(values) if v in values[:i]),
                                                          None)) is not None:
            self.error(f"{'/'.join(action.option_strings)} lists {arg_strings[twice]!r} twice: list each once")
        return values  # (a list's entry given twice ran twice, or was dropped, unsaid)

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


MAX_WIDTH = 4096  # the widest forward a profile times (tokens in one call)


def parse_width_ranges(text: str) -> list[int]:
    """`1-16,24,32` -> [1, ..., 16, 24, 32], each within [1, MAX_WIDTH] and listed once."""
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
        if twice := widths.intersection(range(first, last + 1)):
            raise ConfigError(f"widths must be listed once each; {min(twice)} is listed twice in '{text}'")
        widths.update(range(first, last + 1))
    return sorted(widths)


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

