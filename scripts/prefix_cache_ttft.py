"""A conversation's follow-up turn with and without the server's prefix cache (docs/results/prefix-cache.md).

    python scripts/prefix_cache_ttft.py --repeats 3

Qwen2.5-Coder-1.5B on the lean backend, served by the engine with `auto` (the server's defaults), greedy. Turn 1
asks about a ~1,100-token text (this repository's README, cut); turn 2 resends it with turn 1's reply and a
question. Turn 2's time to first token is measured on the server that served turn 1 (its history in the prefix
cache) and on a fresh server (no cache: every prompt token computed), alternately, each time on a new engine;
prints both, their ratio and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--history-tokens", type=int, default=1100)
    parser.add_argument("--reply-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from speculant.api import encode_prompt
    from speculant.config import SamplingConfig
    from speculant.models.base import CausalLM
    from speculant.models.loading import load_lean
    from speculant.serve.engine import Engine, ServeJob

    target = load_lean("qwen2.5-coder-1.5b")
    tok = target.tokenizer
    text = tok.decode(tok.encode(open("README.md").read())[:args.history_tokens])
    first = [{"role": "user", "content": f"Here is a project's README:\n\n{text}\n\nWhat does the project do?"}]

    def ask(engine: Engine, ids: list[int], tokens: int) -> tuple[float, str]:
        done, stamps = threading.Event(), []
        out = []
        start = time.perf_counter()
        engine.submit(ServeJob(ids, tokens, SamplingConfig()), lambda piece, lp: stamps.append(time.perf_counter()),
                      lambda outcome: (out.append(outcome), done.set()))
        done.wait()
        if isinstance(out[0], BaseException):
            raise out[0]
        return stamps[0] - start, out[0].text

    cached, fresh, same = [], [], []
    reply = ""  # turn 1's answer, from the first (cached) run: greedy, the same on every server
    for repeat in range(args.repeats):
        for kind in ("cached", "fresh") if repeat % 2 == 0 else ("fresh", "cached"):
            engine = Engine(target, "auto")
            first_ids = encode_prompt(tok, first, True)
            engine.batcher.run(lambda: [engine.session.profile(m) for m in [target, *engine.drafters.values()]
                                        if isinstance(m, CausalLM)])
            ask(engine, encode_prompt(tok, "Say hi.", True), 4)  # warm-up: kernels, drafters' first forwards
            if kind == "cached":  # turn 1, on this server
                reply = ask(engine, first_ids, args.reply_tokens)[1]
            follow = first + [{"role": "assistant", "content": reply},
                              {"role": "user", "content": "Which command runs its tests?"}]
            follow_ids = encode_prompt(tok, follow, True)
            ttft, answer = ask(engine, follow_ids, 32)
            (cached if kind == "cached" else fresh).append(ttft)
            same.append(answer)
            print(f"{kind}: turn 2 of {len(follow_ids)} tokens ({len(first_ids)} in turn 1), TTFT {ttft:.2f} s, "
                  f"restored {engine.session.prefixes.saved} positions", file=sys.stderr)
            engine.close()
    c, f = statistics.median(cached), statistics.median(fresh)
    print(f"turn 2 TTFT, median of {args.repeats}: cached {c:.2f} s, fresh {f:.2f} s, ratio {c / f:.3f}; "
          f"outputs identical: {len(set(same)) == 1}")


if __name__ == "__main__":
    main(sys.argv[1:])
