"""A long prompt arriving while a chat request streams, in the serving engine (docs/results/serve-long-prompt.md).

    python scripts/serve_long_prompt.py after          # LABEL names the code measured (e.g. before / after)

Qwen2.5-Coder-1.5B on the lean backend, greedy, `ar`: a chat request streams 200 tokens; after its 8th a
2000-token prompt (the first 2000 tokens of this repository's README.md) arrives with 8 tokens to generate. Prints
the stream's largest gap between two texts, its median gap, and the long prompt's time to first token. Why: a
prompt prefilled in one forward holds every running request for its whole prefill; prefilled in parts
(`models.base.PREFILL_PART`) the stream decodes between them.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label", nargs="?", default="")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=200)
    args = parser.parse_args(argv)

    from speculant.api import encode_prompt
    from speculant.config import SamplingConfig
    from speculant.models.loading import load_lean
    from speculant.serve.engine import Engine, ServeJob

    engine = Engine(lambda: load_lean("qwen2.5-coder-1.5b"), "ar", max_batch=16)
    tok = engine.target.tokenizer
    chat = encode_prompt(tok, "Write a short story about a lighthouse keeper.", True)
    long = tok.encode(open("README.md").read())[:args.long_tokens]
    engine.batcher.run(lambda: engine.target.prefill(chat))  # warm-up
    stamps, arrived, first_long = [], [], []
    ends, long_done = threading.Event(), threading.Event()

    def on_long_text(piece, logprobs):
        if not first_long:
            first_long.append(time.perf_counter())

    def on_text(piece, logprobs):
        stamps.append(time.perf_counter())
        if len(stamps) == 8:  # the running request is under way: the long prompt arrives
            engine.submit(ServeJob(long, 8, SamplingConfig(0.0)), on_long_text, lambda o: long_done.set())
            arrived.append(time.perf_counter())

    engine.submit(ServeJob(chat, args.stream_tokens, SamplingConfig(0.0)), on_text, lambda o: ends.set())
    ends.wait()
    long_done.wait()
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    print(args.label, f"largest gap {gaps[-1]:.2f} s, median gap {gaps[len(gaps) // 2] * 1e3:.0f} ms, "
          f"long prompt's first token after {first_long[0] - arrived[0]:.1f} s")
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
