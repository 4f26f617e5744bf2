"""What one client's request costs the server's shared threads, for the CHANGELOG's "one client could stall every
other request" entry: a stream's text over N tokens of a byte no character begins with (against N of 'a'), the
slowest grammar mask of an ambiguous Lark grammar at the parser's row limit (against llguidance's default), and the
validation of a chat body of 128 tool schemas on the event loop. Tiny tokenizer, no model.

    python scripts/serve_stalls.py [--tokens 4000]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import llguidance  # noqa: E402
from helpers import byte_tokenizer  # noqa: E402

from speculant.models.wrappers.constrained import MAX_ITEMS_IN_ROW, Constraint, _llg_tokenizer  # noqa: E402
from speculant.serve.schema import ChatRequest  # noqa: E402
from speculant.serve.text import TextStream  # noqa: E402

AMBIGUOUS = 'start: e\ne: e e | e e e | "a" | "b" | "ab"'


def stream_seconds(token: int, n: int) -> float:
    stream, start = TextStream(byte_tokenizer()), time.perf_counter()
    for _ in range(n):
        stream.push(token)
    stream.flush()
    return time.perf_counter() - start


def worst_mask_seconds(items_in_row: int, steps: int = 300) -> tuple[float, int]:
    """The slowest mask over up to `steps` tokens of the ambiguous grammar, and the steps before it failed."""
    tokenizer = _llg_tokenizer(byte_tokenizer(), 257, (256,))  # (256: its <eos>)
    matcher = llguidance.LLMatcher(tokenizer, Constraint("grammar", AMBIGUOUS).text, log_level=0,
                                   limits=llguidance.LLParserLimits(max_items_in_row=items_in_row))
    worst = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        matcher.compute_bitmask()
        matcher.consume_token(ord("a") if step % 3 else ord("b"))
        worst = max(worst, time.perf_counter() - start)
        if matcher.is_error():
            return worst, step
    return worst, steps


def validation_seconds() -> float:
    props = {f"p{i}": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,50}[0-9]{1,50}$"},
                                 {"type": "integer", "minimum": i}, {"type": "array", "items": {"type": "number"}}]}
             for i in range(40)}
    tools = [{"type": "function", "function": {"name": f"f{j}", "parameters": {
        "type": "object", "properties": props, "required": list(props)[:5]}}} for j in range(128)]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                       "tool_choice": "none", "max_tokens": 2})
    ChatRequest.model_validate_json(body)  # (warm)
    start = time.perf_counter()
    ChatRequest.model_validate_json(body)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    n = parser.parse_args().tokens
    print(f"text stream, {n} tokens: 'a' {stream_seconds(ord('a'), n):.2f} s, byte 0x80 "
          f"{stream_seconds(0x80, n):.2f} s")
    for items in (MAX_ITEMS_IN_ROW, 2000):
        worst, steps = worst_mask_seconds(items)
        print(f"ambiguous grammar, {items} items a row: slowest mask {worst * 1000:.1f} ms over {steps} tokens")
    print(f"a chat body of 128 tool schemas validated on the event loop: {validation_seconds():.3f} s")


if __name__ == "__main__":
    main()
