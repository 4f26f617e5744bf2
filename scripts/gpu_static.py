"""The measurements behind docs/results/gpu.md, run on a lent GPU (`python scripts/gpu_static.py OUT.json`).

The catalog's weights cannot reach the GPU machine, so the models are Qwen2.5-Coder-1.5B's and 0.5B's
configurations with random bf16 weights: a forward's cost does not depend on the weights' values, acceptance
does (it is the CPU's, measured on the real weights). Measured, each at 256 cached positions, median of
`--repeats`: T(W) of speculant's hf backend (eager, transformers' dynamic cache, exact row by row), of the static
model eager, and compiled with CUDA graphs; greedy `ar` tok/s compiled against transformers' own `generate`
with a static cache under torch.compile (the gpt-fast-style reference); the drafter's cost ratio; and that greedy
`sd` and `tree` on the compiled pair give `ar`'s tokens; `auto` against `ar` where nothing is accepted (A B B A);
8 sequences' rows batched in the compiled step against each alone; whether a quantized (int8, int4)
transformers target's greedy `sd` and `tree` give its `ar`'s tokens; a tree's draft levels as one CUDA graph against one
replay per level; the host syncs per target forward of `ar`, `sd` and `tree`, greedy and sampled; and first the
suite's CUDA cases (`--sections tests`). `--smoke` runs the same code on tiny configurations (on the CPU, to check
the script; the tests only collected)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from speculant import Session, generate
from speculant.models import HFCausalLM
from speculant.models.backends.static import StaticCausalLM, StaticWeights

CONFIGS = {  # Qwen2.5-Coder-1.5B / 0.5B (Instruct)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768, rms_norm_eps=1e-6),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768, rms_norm_eps=1e-6),
}
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024)
CONTEXT = 256
TESTS_TIMEOUT_S = 240  # the CUDA cases together
TEST_WORKERS = 6  # pytest-xdist workers sharing the cores (a CUDA case is mostly host work: compiles, launches)
TEST_TIMEOUT_S = 120  # one of them (where pytest-timeout is installed)


class Loaded(dict):
    """name -> what `make(name)` returns, made on first use."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, name):
        self[name] = value = self.make(name)
        return value


def model_of(name: str, device: str, smoke: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**(SMOKE if smoke else CONFIGS[name]), eos_token_id=None, bos_token_id=None)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of fn() over `repeats` calls after 3 warm-ups."""
    samples = []
    for i in range(repeats + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def decode_rate(stats) -> float:
    """Tokens per second after the first (whose time is the prompt's)."""
    return (stats.new_tokens - 1) / (stats.wall_s - stats.ttft_s)


def forward_cost(model, width: int, repeats: int, device: str) -> float:
    """T(width): a forward of `width` tokens after CONTEXT cached positions."""
    ids = torch.randint(0, model.vocab_size, (CONTEXT + width,)).tolist()
    model.prefill(ids[:CONTEXT])

    def step():
        model.rollback(CONTEXT)
        model.forward(ids[CONTEXT:])

    return timed(step, repeats, device)


def alternated(target, runs: dict[str, dict], repeats: int, tokens: int, session: Session) -> dict:
    """Decode tok/s of each of two `runs` (generate's options) on one random 200-token prompt, alternated A B B A
    `repeats` times in one `session` after a warm-up generation of each as long as the measured ones (a shorter one
    may never run auto's drafter, whose handle's first use, a CUDA graph captured, would fall in a measured
    generation): each one's rates and CPU seconds of this thread per generation (prefill included; on a CPU, the
    work itself, which a shared machine's neighbours do not slow as much as the wall clock), the second's mean
    ratio to the first's, the second's choices (auto's), and whether every output equals the first run's."""
    (a, b), prompt = list(runs), torch.randint(0, 500, (200,)).tolist()
    for options in runs.values():
        generate(target, prompt_ids=prompt, max_new_tokens=tokens, session=session, **options)
    rates, host, outputs, choices = {a: [], b: []}, {a: [], b: []}, [], Counter()
    for _ in range(repeats):
        for label in (a, b, b, a):
            began = time.thread_time()
            result = generate(target, prompt_ids=prompt, max_new_tokens=tokens, session=session, **runs[label])
            host[label].append(time.thread_time() - began)
            rates[label].append(decode_rate(result.stats))
            outputs.append(result.token_ids)
            choices.update(result.stats.choices if label == b else ())
    return {**{f"{label} decode tok/s": values for label, values in rates.items()},
            **{f"{label} thread cpu s": values for label, values in host.items()},
            f"{b} / {a}": statistics.mean(rates[b]) / statistics.mean(rates[a]), f"{b} choices": dict(choices),
            "outputs equal": all(output == outputs[0] for output in outputs)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ab-repeats", type=int, default=3, help="A B B A rounds of the auto section")
    parser.add_argument("--sections", nargs="*", help="the sections to run (default: all)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a section failed (CI's smoke run)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__}

    def save() -> None:  # (whole or not at all: the call's limit may kill the script in the middle of a write)
        with open(f"{args.out}.tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(f"{args.out}.tmp", args.out)

    class Saved(dict):
        """A section's results, the file saved as each entry comes (a section the time limit cuts off keeps what it
        measured)."""

        def __setitem__(self, key, value) -> None:
            super().__setitem__(key, value)
            save()

    def section(name: str, fn) -> None:
        """Run `fn(out)`, which fills `out` (the section's results) entry by entry."""
        began = time.perf_counter()
        out = results[name] = Saved()
        try:
            fn(out)
        except Exception:  # noqa: BLE001 - one failing section must not lose the others' numbers
            out["error"] = traceback.format_exc(limit=4)
        out["seconds"] = round(time.perf_counter() - began, 1)  # (what the next call's plan can budget)
        print(f"{name} ({out['seconds']:.0f} s): {json.dumps(out)[:600]}", flush=True)

    def tests(out: dict) -> None:
        """The CUDA cases of the test suite (`-k cuda`, and the one with the drafter on another device than the
        target; the served static case needs the server's `greenlet`, which a bare GPU image may lack: carry its
        wheel), on `TEST_WORKERS` workers sharing the cores (tests/conftest.py), each test under a limit of its own
        where pytest-timeout is installed. `--smoke` runs them where they all skip (no CUDA), to read their outcomes."""
        import importlib.util
        import subprocess

        files = ["tests/test_static.py", "tests/test_tree.py", "tests/test_tree_depth.py", "tests/test_hf_backend.py",
                 "tests/test_speculative.py", "tests/test_cascade.py", "tests/test_sampling.py"]
        workers = min(TEST_WORKERS, os.cpu_count() or 1)
        command = [sys.executable, "-m", "pytest", "-n", str(workers), "-v", "-rfE", "--tb=line",
                   "-p", "no:cacheprovider", *files, "-k", "cuda or another_device",
                   *(["--timeout", str(TEST_TIMEOUT_S)] if importlib.util.find_spec("pytest_timeout") else [])]
        out["command"] = " ".join(command[1:])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S,
                                  cwd=Path(__file__).resolve().parents[1])
            stdout = done.stdout
        except subprocess.TimeoutExpired as cut:  # (what ran so far: -v names each test as it ends)
            done, stdout = None, cut.stdout or ""
            stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
        # (-v names each test as a worker ends it: "[gw0] [  5%] PASSED tests/x.py::name")
        outcomes = re.findall(r"^\[gw\d+\] \[ *\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+)", stdout, re.MULTILINE)
        out.update({"counts": dict(Counter(outcome for outcome, _ in outcomes)),
                    "failed": [name for outcome, name in outcomes if outcome in ("FAILED", "ERROR")]})
        if done is None:
            out["error"] = f"cut off after {TESTS_TIMEOUT_S} s, {len(outcomes)} tests run"
            return
        lines = stdout.strip().splitlines()
        out.update({"exit": done.returncode, "summary": lines[-1] if lines else "",
                    "failure lines": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
                    **({"error": stdout[-4000:]} if done.returncode not in (0, 5) else
                       {"error": "no test's outcome read"} if not outcomes else {})})

    models = Loaded(lambda name: model_of(name, device, args.smoke))  # (a section loads what it uses)
    weights = Loaded(lambda name: StaticWeights(models[name]))
    widths = (1, 2, 4, 8, 16, 32)

    def eager_costs(out: dict) -> None:
        for name in CONFIGS:
            hf = HFCausalLM(models[name])
            out[f"{name} hf"] = {w: forward_cost(hf, w, 5, device) * 1e3 for w in (1, 4, 16)}
            out[f"{name} static"] = {w: forward_cost(StaticCausalLM(weights[name], width=w, span=1024), w,
                                                     args.repeats, device) * 1e3 for w in widths}

    def compiled_costs(out: dict) -> None:
        for name, compiled_widths in (("1.5b", (1, 16)), ("0.5b", (16,))):
            for w in compiled_widths:
                fresh = (1024, w, True) not in weights[name].pools  # (else an earlier section compiled its step)
                began = time.perf_counter()
                model = StaticCausalLM(weights[name], width=w, span=1024, compiled=True)
                model.prefill([1, 2, 3])
                first = time.perf_counter() - began
                out[f"{name} compiled x{w}"] = {"first call s" if fresh else "first call s, compiled before": first,
                                                "regions": model.pool.capacity, **{
                    k: forward_cost(model, k, args.repeats, device) * 1e3 for k in sorted({1, w})}}

    def tokens_per_second(out: dict) -> None:
        prompt = torch.randint(0, 500, (200,)).tolist()
        for label, model in (("static eager x16", StaticCausalLM(weights["1.5b"], width=16, span=1024)),
                             ("static compiled x1", StaticCausalLM(weights["1.5b"], width=1, span=1024, compiled=True)),
                             ("static compiled x16", StaticCausalLM(weights["1.5b"], width=16, span=1024,
                                                                    compiled=True))):
            generate(model, prompt_ids=prompt, method="ar", max_new_tokens=8)
            result = generate(model, prompt_ids=prompt, method="ar", max_new_tokens=args.tokens)
            out[label] = {"decode tok/s": decode_rate(result.stats), "tokens": len(result.token_ids)}
        reference = models["1.5b"]
        ids = torch.tensor([prompt], device=device)
        for label, options in (("transformers generate, dynamic cache", {}),
                               ("transformers generate, static cache, compiled", {"cache_implementation": "static"})):
            try:
                def run():
                    return reference.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                              do_sample=False, **options)
                run()
                seconds = timed(run, 2, device)
                out[label] = {"tok/s (whole request)": args.tokens / seconds}
            except Exception:  # noqa: BLE001
                out[label] = {"error": traceback.format_exc(limit=3)}

    def speculation(out: dict) -> None:
        """Greedy sd and tree on the compiled pair give ar's tokens; their tok/s at random weights' acceptance and
        with the target drafting for itself (every draft accepted: the mechanics' ceiling), its trees drafted level
        by level and as one CUDA graph; trees of the 0.5B with and without stage scheduling (its drafter's thread on
        a CUDA stream of its own, beside the target's: the hit rate and the overlap in `stage`)."""
        target = StaticCausalLM(weights["1.5b"], width=16, span=1024, compiled=True)
        drafter = StaticCausalLM(weights["0.5b"], width=16, span=1024, compiled=True)
        prompt = torch.randint(0, 500, (200,)).tolist()
        runs = {"ar": dict(method="ar"), "sd k4 0.5b": dict(method="sd", drafter=drafter, k=4),
                "sd k4 self": dict(method="sd", drafter=target.share(), k=4),
                "sd k8 self": dict(method="sd", drafter=target.share(), k=8),
                "tree self d4 w2": dict(method="tree", drafter=target.share(), depth=4, width=2, draft_graph=False),
                "tree self d4 w2, one graph": dict(method="tree", drafter=target.share(), depth=4, width=2),
                "tree self d4 w2, one graph, stage": dict(method="tree", drafter=target.share(), depth=4, width=2,
                                                          schedule="stage"),
                "tree 0.5b d4 w2": dict(method="tree", drafter=drafter, depth=4, width=2),
                "tree 0.5b d4 w2, stage": dict(method="tree", drafter=drafter, depth=4, width=2, schedule="stage")}
        expected = None
        for label, options in runs.items():
            generate(target, prompt_ids=prompt, max_new_tokens=8, **options)
            result = generate(target, prompt_ids=prompt, max_new_tokens=args.tokens, **options)
            expected = expected or result.token_ids
            out[label] = {"decode tok/s": decode_rate(result.stats),
                          "mean accepted": result.stats.mean_accepted_length,
                          "equals ar": result.token_ids == expected,
                          **({"stage": {"drafted": stage.drafted, "hits": stage.hits, "hit rate": stage.hit_rate,
                                        "overlap": stage.overlap}} if (stage := result.stats.stage) else {})}

    def drafter_cost(out: dict) -> None:
        """The drafter's cost ratio with the drafter at width 1 (its rows need no invariance: drafts are checked)."""
        target = StaticCausalLM(weights["1.5b"], width=16, span=1024, compiled=True)
        drafter = StaticCausalLM(weights["0.5b"], width=1, span=1024, compiled=True)
        costs = {name: forward_cost(model, 1, args.repeats, device) * 1e3
                 for name, model in (("1.5b x16", target), ("0.5b x1", drafter))}
        out.update({**costs, "c": costs["0.5b x1"] / costs["1.5b x16"]})

    def auto(out: dict) -> None:
        """`auto` on the compiled pair profiles the compiled steps and chooses; at random weights' acceptance it must
        fall back to `ar`'s speed (the bar: >= 0.97x), with `ar`'s tokens. Alternated `ar`, `auto`, `auto`, `ar` in
        one session, `--ab-repeats` times, after a warm-up of each."""
        target = StaticCausalLM(weights["1.5b"], width=16, span=1024, compiled=True)
        drafter = StaticCausalLM(weights["0.5b"], width=16, span=1024, compiled=True)
        out.update(alternated(target, {"ar": dict(method="ar"),
                                       "auto": dict(method="auto", drafters=[drafter, "maxgram"])},
                              args.ab_repeats, args.tokens, Session(target)))

    def rows(out: dict) -> None:
        """Batch rows (`static.forward_rows`, what `serve --backend static` runs): 8 sequences decoding greedily in
        lockstep, their rows packed into the compiled x16 step, against each decoding alone: equal tokens, and the
        tokens per second of both."""
        from speculant.models.backends.static import forward_rows
        from speculant.models.base import Call

        target = StaticCausalLM(weights["1.5b"], width=16, span=1024, compiled=True)
        handles = [target.share() for _ in range(8)]
        prompts = [torch.randint(0, 500, (100 + 10 * i,)).tolist() for i in range(8)]

        def decode(together: bool) -> tuple[list[list[int]], float]:
            logits = forward_rows([(h, Call(p, prefill=True)) for h, p in zip(handles, prompts)]) if together else \
                [h.prefill(p) for h, p in zip(handles, prompts)]
            tokens = [[int(row.argmax())] for row in logits]
            began = time.perf_counter()
            for _ in range(args.tokens // 4):
                if together:
                    logits = [row[-1] for row in forward_rows([(h, Call(t[-1:])) for h, t in zip(handles, tokens)])]
                else:
                    logits = [h.forward(t[-1:])[-1] for h, t in zip(handles, tokens)]
                for t, row in zip(tokens, logits):
                    t.append(int(row.argmax()))
            return tokens, time.perf_counter() - began

        decode(True)
        alone, alone_s = decode(False)
        batched, batched_s = decode(True)
        n = sum(len(t) - 1 for t in alone)
        out.update({"rows": len(handles), "regions": target.pool.capacity, "equal": batched == alone,
                    "alone tok/s": n / alone_s,
                    "batched tok/s": n / batched_s})

    def quantized(out: dict) -> None:
        """Whether a quantized transformers target stays exact: the 0.5B with its linears int8 or int4 (the hf backend;
        `make_exact` leaves quantized layers to their own kernels, which on CUDA may sum a row differently with the
        call's other rows), greedy `sd` and `tree` with the target drafting for itself (every draft verified in one
        call) against its `ar`: equal tokens, or where the first difference falls."""
        from speculant.models.numerics.quant import quantize

        prompt = torch.randint(0, 500, (100,)).tolist()
        for quant in ("int8", "int4"):
            target = HFCausalLM(quantize(model_of("0.5b", device, args.smoke), quant))
            ar = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=args.tokens // 2).token_ids
            for label, options in (("sd k4 self", dict(method="sd", drafter="self", k=4)),
                                   ("tree self d4 w2", dict(method="tree", drafter="self", depth=4, width=2))):
                tokens = generate(target, prompt_ids=prompt, max_new_tokens=args.tokens // 2, **options).token_ids
                out[f"{quant} {label}"] = {"equals ar": tokens == ar, "first difference": next(
                    (i for i, (x, y) in enumerate(zip(tokens, ar)) if x != y), None), "tokens": len(tokens)}

    def draft(out: dict) -> None:
        """T(draft) of the compiled 0.5B (x16 rows): a tree of width 4 level by level (a CUDA graph replayed per
        level, the frontier chosen on the host between them) against its levels as one CUDA graph, each level the
        compiled step (`KVPool.levels_in_steps`; scripts/draft_graph.py)."""
        from draft_graph import draft_costs

        out.update(draft_costs(weights["0.5b"], 4, [2] if args.smoke else [4], args.repeats, compiled=True, rows=16))

    def syncs(out: dict) -> None:
        """Host syncs of a generation on the compiled pair (`torch.cuda.set_sync_debug_mode`'s warnings, counted),
        per target forward: `ar`, `sd` and `tree` of the 0.5B (level by level, and with `objective=length` its levels
        as one CUDA graph), greedy and at temperature 0.7. Every step counts the copies of its inputs from pageable
        host memory and `KVPool.run`'s wait for its result, so what a method adds is its count beyond `ar`'s per
        forward at the same temperature. What reads back after a forward: greedy verification once, a draw twice
        (`sample`: its block, then its token), a sampled tree's walk once more."""
        import warnings

        target = StaticCausalLM(weights["1.5b"], width=16, span=1024, compiled=True)
        drafter = StaticCausalLM(weights["0.5b"], width=16, span=1024, compiled=True)
        prompt = torch.randint(0, 500, (200,)).tolist()
        for label, options in (("ar", dict(method="ar")), ("sd k4", dict(method="sd", drafter=drafter, k=4)),
                               ("tree d4 w2, levels", dict(method="tree", drafter=drafter, depth=4, width=2,
                                                           draft_graph=False)),
                               ("tree d4 w2, one graph", dict(method="tree", drafter=drafter, depth=4, width=2,
                                                              objective="length"))):
            for temperature in (0.0, 0.7):
                run = dict(options, temperature=temperature, seed=0, prompt_ids=prompt)
                generate(target, max_new_tokens=8, **run)  # compiled and captured before counting
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode("warn")
                    try:
                        result = generate(target, max_new_tokens=32, **run)
                    finally:
                        if device == "cuda":
                            torch.cuda.set_sync_debug_mode(0)
                forwards = result.stats.target_forwards
                per_forward = len(caught) / max(forwards, 1)
                ar = out.get(f"ar T={temperature}", {}).get("syncs per forward", per_forward)  # (ar: its own)
                out[f"{label} T={temperature}"] = {"syncs": len(caught), "target forwards": forwards,
                                                   "syncs per forward": per_forward, "beyond ar's": per_forward - ar}

    sections = {  # what no GPU has measured yet first (a lent call's limit may cut the last ones off)
        "tests": tests, "speculation": speculation, "draft": draft, "auto": auto, "syncs": syncs, "rows": rows,
        "quantized": quantized, "drafter": drafter_cost, "compiled T(W) ms": compiled_costs, "ar": tokens_per_second,
        "eager T(W) ms": eager_costs}
    if unknown := set(args.sections or ()) - set(sections):
        parser.error(f"unknown sections {sorted(unknown)}: choose from {', '.join(sections)}")
    for name in args.sections or sections:
        section(name, sections[name])
    print(json.dumps(results, indent=1))
    failed = [name for name, value in results.items() if isinstance(value, dict) and "error" in value]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
