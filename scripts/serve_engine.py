"""`auto` against `ar` in the serving engine, without HTTP (docs/results/serve-1.5b-repeats/in-process.md and
docs/results/serve-1.5b-http-paired/paired.md).

    python scripts/serve_engine.py alternate 16 10      # one engine serves both methods, passes alternating
    python scripts/serve_engine.py pass auto 4          # one engine per process, one pass: tok/s, forwards, other
    python scripts/serve_engine.py overhead 16 3        # alternating passes: wall, forward seconds, the rest
    python scripts/serve_engine.py ttft 4 2             # alternating passes: TTFT p50 and ITL p50
    python scripts/serve_engine.py two-engines 16 4     # an ar engine, an auto engine, the auto engine's ar jobs

Every pass sends the 24 prompts of prompts/mixed.jsonl (64 new tokens, greedy) to
`speculant.serve.engine.Engine` (the server's batching engine, Qwen2.5-Coder-1.5B on the lean backend with the
default drafters) with at most C requests in flight, a new one as soon as one ends, and measures tokens over wall
time. `ar` jobs are `ServeJob.method = "ar"` on an `auto` engine (its server's default method) unless said otherwise;
the order of the methods alternates by round after one warm-up pass. Why: a fresh server per pass spreads between
processes by more than the few percent `auto` and `ar` differ by under load, so the comparison is made inside one
process, pass against pass.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

PROMPTS = "prompts/mixed.jsonl"
TOKENS = 64


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("pass", help="one engine of METHOD, one pass: tok/s, seconds in batched forwards, the rest")
    one.add_argument("method")
    one.add_argument("concurrency", type=int)
    for name, text in (("alternate", "one auto engine, ar and auto passes alternating; auto/ar per round"),
                       ("overhead", "as alternate, with each pass's forward seconds and the rest"),
                       ("ttft", "as alternate, with each pass's TTFT p50 and ITL p50"),
                       ("two-engines", "an ar engine, an auto engine, and ar jobs on the auto engine")):
        p = sub.add_parser(name, help=text)
        p.add_argument("concurrency", type=int)
        p.add_argument("rounds", type=int)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = parser.parse_args(argv)

    from speculant.api import encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.config import SamplingConfig
    from speculant.models.loading import load_lean
    from speculant.serve.engine import Engine, ServeJob
    from speculant.serve.metrics import Metrics

    C = args.concurrency

    def engine_of(method: str, metrics: Metrics | None = None) -> Engine:
        return Engine(lambda: load_lean(args.model), method, max_batch=16, metrics=metrics)

    def prompts_for(engine: Engine) -> list[list[int]]:
        return [encode_prompt(engine.target.tokenizer, p.text, p.chat) for p in load_dataset(PROMPTS)]

    def run(engine: Engine, prompts: list[list[int]], method: str | None, timed: bool = False) -> dict:
        """One pass; tok/s, wall seconds and (timed) the median time to first text and between texts."""
        slots, done, firsts, gaps = threading.Semaphore(C), [], [], []
        start = time.perf_counter()
        for ids in prompts:
            slots.acquire()
            sent, last = time.perf_counter(), [None]

            def on_text(text, logprobs, sent=sent, last=last):
                if timed:
                    now = time.perf_counter()
                    (firsts.append(now - sent) if last[0] is None else gaps.append(now - last[0]))
                    last[0] = now

            engine.submit(ServeJob(ids, TOKENS, SamplingConfig(0.0), method=method), on_text,
                          lambda o: (done.append(o), slots.release()))
        while len(done) < len(prompts):
            time.sleep(0.002)
        wall = time.perf_counter() - start
        out = {"tok/s": sum(o.completion_tokens for o in done) / wall, "wall": wall}
        if timed:
            out["ttft"], out["itl"] = statistics.median(firsts), statistics.median(gaps)
        return out

    if args.what == "pass":
        metrics = Metrics()
        engine = engine_of(args.method, metrics)
        prompts = prompts_for(engine)
        before = metrics.forward_seconds._value.get()
        r = run(engine, prompts, None)
        forwards = metrics.forward_seconds._value.get() - before
        print(args.method, C, f"{r['tok/s']:.1f} tok/s, forwards {forwards:.1f} s, other {r['wall'] - forwards:.1f} s")
        engine.close()
        return

    if args.what == "two-engines":
        engines = {"ar": engine_of("ar"), "auto": engine_of("auto")}
        prompts = prompts_for(engines["ar"])
        variants = {"ar engine": (engines["ar"], None), "auto engine": (engines["auto"], None),
                    "auto engine, ar jobs": (engines["auto"], "ar")}
        for engine, method in variants.values():  # warm-up
            run(engine, prompts, method)
        rates = {k: [] for k in variants}
        for r in range(args.rounds):
            for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                engine, method = variants[k]
                rates[k].append(run(engine, prompts, method)["tok/s"])
            print(r, {k: round(v[-1], 1) for k, v in rates.items()}, flush=True)
        for k, v in rates.items():
            print(k, round(statistics.mean(v), 2), [round(x / y, 3) for x, y in zip(v, rates["ar engine"])])
        for engine in engines.values():
            engine.close()
        return

    metrics = Metrics()
    engine = engine_of("auto", metrics)
    prompts = prompts_for(engine)
    run(engine, prompts, "ar")  # warm-up
    ratios = []
    for r in range(args.rounds):
        rates = {}
        for method in (("ar", None) if r % 2 == 0 else (None, "ar")):
            before = metrics.forward_seconds._value.get()
            out = run(engine, prompts, method, timed=args.what == "ttft")
            forwards = metrics.forward_seconds._value.get() - before
            name = method or "auto"
            rates[name] = out["tok/s"]
            if args.what == "overhead":
                print(name, f"{out['tok/s']:.1f} tok/s wall {out['wall']:.2f} forwards {forwards:.2f} "
                      f"other {out['wall'] - forwards:.2f}", flush=True)
            elif args.what == "ttft":
                print(name, f"{out['tok/s']:.1f} tok/s TTFT p50 {out['ttft']:.2f} s ITL p50 {out['itl'] * 1000:.0f} ms",
                      flush=True)
        ratios.append(rates["auto"] / rates["ar"])
    if args.what == "alternate":
        spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        print(C, [round(r, 3) for r in ratios], round(statistics.mean(ratios), 3), round(spread, 3))
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
