"""A long prompt arriving while a chat request streams (docs/results/serve-long-prompt.md).

    python scripts/serve_long_prompt.py after          # LABEL names the code measured (e.g. before / after)
    python scripts/serve_long_prompt.py llama-server --url http://127.0.0.1:8080/v1   # any OpenAI server

Qwen2.5-Coder-1.5B, greedy: a chat request streams 200 tokens; after its 8th a 2000-token prompt (the first 2000
tokens of this repository's README.md) arrives with 8 tokens to generate. Prints the stream's largest gap between
two texts, its median gap, and the long prompt's time to first token. Without --url, in the serving engine (lean
backend, `ar`); with --url, over HTTP to a server already running on the same GGUF (`speculant serve --method ar`,
or llama.cpp's `llama-server`), its prompt sent as token ids. Why: a prompt prefilled in one forward holds every
running request for its whole prefill; prefilled in parts (`models.base.PREFILL_PART`, the lean backend's
`SERVED_PART`) the stream decodes between them.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

TARGET = "qwen2.5-coder-1.5b"
ASK = "Write a short story about a lighthouse keeper."


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label", nargs="?", default="")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--url", default=None, help="an OpenAI-compatible server's base URL (.../v1)")
    args = parser.parse_args(argv)
    stamps, arrived, first_long = [], [], []
    (over_http if args.url else in_engine)(args, stamps, arrived, first_long)
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    print(args.label, f"largest gap {gaps[-1]:.2f} s, median gap {gaps[len(gaps) // 2] * 1e3:.0f} ms, "
          f"long prompt's first token after {first_long[0] - arrived[0]:.1f} s")


def in_engine(args: argparse.Namespace, stamps: list, arrived: list, first_long: list) -> None:
    from speculant.api import encode_prompt
    from speculant.config import SamplingConfig
    from speculant.models.loading import load_lean
    from speculant.serve.engine import Engine, ServeJob

    engine = Engine(lambda: load_lean(TARGET), "ar", max_batch=16)
    tok = engine.target.tokenizer
    chat = encode_prompt(tok, ASK, True)
    long = tok.encode(open("README.md").read())[:args.long_tokens]
    engine.batcher.run(lambda: engine.target.prefill(chat))  # warm-up
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
    engine.close()


def over_http(args: argparse.Namespace, stamps: list, arrived: list, first_long: list) -> None:
    import httpx
    from transformers import AutoTokenizer

    from speculant.models.catalog import CATALOG, gguf_checkpoint

    long = AutoTokenizer.from_pretrained(gguf_checkpoint(CATALOG[TARGET])).encode(
        open("README.md").read())[:args.long_tokens]
    client = httpx.Client(base_url=args.url, timeout=600)

    def texts(path: str, body: dict):
        """Each streamed chunk that carries text, as it arrives."""
        with client.stream("POST", path, json={"model": TARGET, "temperature": 0, "stream": True, **body}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        yield

    def send_long() -> None:
        for _ in texts("/completions", {"prompt": long, "max_tokens": 8}):
            if not first_long:
                first_long.append(time.perf_counter())

    for _ in texts("/chat/completions", {"messages": [{"role": "user", "content": ASK}], "max_tokens": 4}):
        pass  # warm-up
    sender = threading.Thread(target=send_long)
    for _ in texts("/chat/completions", {"messages": [{"role": "user", "content": ASK}],
                                         "max_tokens": args.stream_tokens}):
        stamps.append(time.perf_counter())
        if len(stamps) == 8:  # the running request is under way: the long prompt arrives
            arrived.append(time.perf_counter())
            sender.start()
    sender.join()


if __name__ == "__main__":
    main(sys.argv[1:])
