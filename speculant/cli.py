"""The `speculant` command line. Errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from speculant.config import DecodeConfig, ModelConfig, SamplingConfig, add_options, from_args
from speculant.errors import ConfigError, SpeculantError

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


class Detokenizer:
    """Turns a growing list of token ids into text increments, holding back incomplete characters."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown:], len(text)
        return piece


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description="Lossless speculative inference of language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text, streaming it as tokens are committed")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: catalog name, HF id or path (default: {DEFAULT_TARGET})")
    gen.add_argument("--drafter", default=None,
                     help="drafter: a model (NAME[@int8|@int4]), self@int8 / self@int4 (the target quantized), "
                          "maxgram (prompt lookup with a bigram fallback), "
                          f"or 'none' for autoregressive decoding (default: {DEFAULT_DRAFTER} with --method sd)")
    gen.add_argument("--drafter-dtype", choices=("bf16", "fp32"), default=None, help="drafter dtype (default: --dtype)")
    gen.add_argument("--bigram-corpus", nargs="+", default=None, metavar="FILE",
                     help="text files for maxgram's bigram fallback (default: the Python standard library)")
    add_options(gen, DecodeConfig, method=None)
    add_options(gen, SamplingConfig)
    add_options(gen, ModelConfig)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print text, token ids and full stats as one JSON object")

    bench = commands.add_parser("bench", help="run a method matrix over a prompt set and compare speed")
    bench.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default: {DEFAULT_TARGET})")
    bench.add_argument("--methods", nargs="+", default=["ar", "sd:k=4"],
                       help="methods with options, e.g. ar sd:drafter=qwen2.5-coder-0.5b,k=4,dtype=bf16")
    data = bench.add_mutually_exclusive_group()
    data.add_argument("--dataset", default="humaneval[:10]", help="humaneval[:N] (default: humaneval[:10])")
    data.add_argument("--prompts", default=None, metavar="FILE.jsonl[:N]",
                      help="JSONL records with 'prompt', or MT-bench style 'turns' and 'category' (first turn, chat template)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--repeats", type=int, default=1, help="run the whole interleaved matrix this many times")
    add_options(bench, ModelConfig)
    bench.add_argument("--out", default=None, help="directory for results.json and report.md")

    simulate = commands.add_parser("simulate", help="offline simulation of non-SI, SI and DSI (no model needed)")
    sims = simulate.add_subparsers(dest="simulation", required=True)
    one = sims.add_parser("run", help="expected latency of non-SI, SI and DSI for one configuration")
    one.add_argument("--target-latency", type=float, required=True, metavar="MS", help="target forward (TPOT), ms")
    one.add_argument("--drafter-latency", type=float, required=True, metavar="MS", help="drafter forward, ms")
    one.add_argument("--acceptance", type=float, required=True, help="per-token acceptance rate in [0, 1]")
    one.add_argument("--lookahead", type=int, required=True, help="draft tokens per verification")
    one.add_argument("--servers", type=int, default=1, help="target servers for DSI (default: 1)")
    one.add_argument("--tokens", type=int, default=100, help="tokens to generate (default: 100)")
    one.add_argument("--ttft", type=float, default=None, metavar="MS", help="the target's first forward (default: TPOT)")
    one.add_argument("--repeats", type=int, default=1000)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--json", action="store_true", help="print one JSON object (keys non_si_ms, si_ms, dsi_ms, ...)")
    heat = sims.add_parser("heatmap", help="the DSI paper's Figure 2 and 7 heatmaps, CSV and summary")
    heat.add_argument("--out", required=True, help="directory for grid.csv, figure2.png, figure7.png, summary.json")
    heat.add_argument("--ndim", type=int, default=20, help="grid points per axis (default: 20, as in the paper)")
    heat.add_argument("--max-lookahead", type=int, default=200)
    heat.add_argument("--tokens", type=int, default=100)
    heat.add_argument("--repeats", type=int, default=5)
    heat.add_argument("--servers", type=int, default=7, help="target servers, SP degree (default: 7, an 8-GPU node)")
    heat.add_argument("--fixed-lookahead", type=int, default=5, help="lookahead of Figure 7 (default: 5)")
    heat.add_argument("--seed", type=int, default=0)
    return parser


def resolve_method(method: str | None, drafter: str | None) -> tuple[str, str | None]:
    """`--drafter none` means autoregressive; `--method sd` defaults the drafter; conflicts are errors."""
    if drafter == "none":
        if method == "sd":
            raise ConfigError("method 'sd' needs a drafter, but --drafter is none")
        return "ar", None
    if method == "ar":
        if drafter is not None:
            raise ConfigError("method 'ar' takes no drafter (drop --drafter or pass --drafter none)")
        return "ar", None
    return method or "sd", drafter or DEFAULT_DRAFTER


def run_generate(args: argparse.Namespace) -> None:
    from speculant.api import generate, load_drafter
    from speculant.drafters.maxgram import NAME as MAXGRAM
    from speculant.drafters.maxgram import MaxGramDrafter, load_bigram
    from speculant.models import load_model

    method, drafter_name = resolve_method(args.method, args.drafter)
    args.method = method
    decode_config = from_args(DecodeConfig, args)
    sampling = from_args(SamplingConfig, args)
    model_config = from_args(ModelConfig, args)
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")

    print(f"loading target {args.target} ({model_config.dtype}, {model_config.device})", file=sys.stderr)
    target = load_model(args.target, dtype=model_config.dtype, device=model_config.device)
    drafter = None
    if drafter_name is not None:
        dtype = args.drafter_dtype or model_config.dtype
        print(f"loading drafter {drafter_name} ({dtype}, {model_config.device})", file=sys.stderr)
        reuse = drafter_name == args.target and dtype == model_config.dtype  # same weights, own cache
        drafter = load_drafter(target if reuse else drafter_name, target, dtype)
    if args.bigram_corpus:
        if drafter_name != MAXGRAM:
            raise ConfigError("--bigram-corpus applies to --drafter maxgram only")
        files = [Path(f) for f in args.bigram_corpus]
        if missing := [str(f) for f in files if not f.is_file()]:
            raise ConfigError(f"bigram corpus file not found: {', '.join(missing)}")
        drafter = MaxGramDrafter(load_bigram(target.tokenizer, target.vocab_size, files))

    stream = generate(
        target, prompt=args.prompt, drafter=drafter, method=decode_config.method, k=decode_config.k,
        max_new_tokens=decode_config.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, seed=decode_config.seed, stream=True, chat=args.chat,
    )
    if args.json:
        for _ in stream:
            pass
    else:
        detokenizer = Detokenizer(target.tokenizer)
        for token in stream:
            sys.stdout.write(detokenizer.push(token))
            sys.stdout.flush()
        sys.stdout.write("\n")
    result = stream.result
    assert result is not None
    if args.json:
        print(json.dumps({"target": args.target, "drafter": drafter_name, "text": result.text,
                          "token_ids": result.token_ids, "stats": result.stats.to_dict()}, indent=1))
    print(result.stats.summary(), file=sys.stderr)


def run_bench(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from tqdm import tqdm

    from speculant.bench.datasets import load_dataset
    from speculant.bench.methods import parse_method
    from speculant.bench.report import markdown_report, plot, print_table
    from speculant.bench.runner import run_matrix, summarize, summarize_by_category, to_json
    from speculant.models import CausalLM, load_model

    methods = [parse_method(m) for m in args.methods]
    if len({m.label for m in methods}) != len(methods):
        raise ConfigError("each method may be listed once")
    DecodeConfig(max_new_tokens=args.max_new_tokens)
    SamplingConfig(temperature=args.temperature)
    model_config = from_args(ModelConfig, args)
    if args.repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {args.repeats}")
    dataset = args.prompts or args.dataset
    prompts = load_dataset(dataset)
    targets: dict[str, CausalLM] = {}

    def target_for(dtype: str | None) -> CausalLM:
        dtype = dtype or model_config.dtype
        if dtype not in targets:
            targets[dtype] = load_model(args.target, dtype=dtype, device=model_config.device)
        return targets[dtype]

    with tqdm(total=len(prompts) * len(methods) * args.repeats, desc="prompts x methods", file=sys.stderr) as bar:
        rows = run_matrix(target_for, methods, prompts, args.max_new_tokens, args.seed, args.temperature,
                          args.repeats, on_row=lambda row: bar.update())
    summaries = summarize(rows, methods)
    by_category = summarize_by_category(rows, methods)
    command = "speculant " + " ".join(argv)
    print_table(summaries, f"{args.target} on {dataset}, {args.max_new_tokens} new tokens")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        config = {"command": command, "machine": machine_info(),
                  **{k: v for k, v in vars(args).items() if k != "command"}}
        (out / "results.json").write_text(json.dumps(to_json(config, rows, summaries, by_category), indent=1))
        (out / "report.md").write_text(markdown_report(summaries, by_category, command, machine_info()))
        plots = plot(summaries, by_category, out)
        print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(plots)} plots", file=sys.stderr)


def run_simulate(args: argparse.Namespace) -> None:
    from speculant.analysis.commands import format_one, run_heatmap, simulate_one

    if args.simulation == "run":
        result = simulate_one(args.target_latency, args.drafter_latency, args.acceptance, args.lookahead,
                              args.servers, args.tokens, args.ttft, args.repeats, args.seed)
        print(json.dumps(result, indent=1) if args.json else format_one(result))
    else:
        numbers, paths = run_heatmap(Path(args.out), args.ndim, args.max_lookahead, args.tokens, args.repeats,
                                     args.servers, args.fixed_lookahead, args.seed)
        print(f"{numbers['configurations']} simulated configurations in {numbers['seconds']:.1f} s")
        print(f"SI slower than non-SI in {numbers['si_slower_than_non_si_share']:.0%} of (drafter latency, acceptance) points")
        print(f"DSI speedup: at least {numbers['min_dsi_speedup_over_si']:.3f}x over SI, at least "
              f"{numbers['min_dsi_speedup_over_non_si']:.3f}x over non-SI, up to "
              f"{numbers['max_dsi_speedup_over_best_baseline']:.2f}x over the better of the two")
        print("wrote " + ", ".join(str(p) for p in paths))


def machine_info() -> str:
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return (f"{cpu or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__} "
            f"({torch.backends.cpu.get_cpu_capability()})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "bench":
            run_bench(args, argv)
        elif args.command == "simulate":
            run_simulate(args)
    except SpeculantError as error:
        print(f"speculant: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
