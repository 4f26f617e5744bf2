"""The one place where decoding is timed: wall time and time to first token around a decoder."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from speculant.decoding.stats import GenerationStats

Decoder = Generator[int, None, GenerationStats]


def timed(decoder: Decoder, committed: list[int]) -> Generator[int, None, GenerationStats | None]:
    """Pass a decoder's tokens through, appending them to `committed`; set `ttft_s` and `wall_s` (from
    the start, prefill included, to the last token: a decoder's clean-up after it, such as stopping
    DSI's servers, is not decoding time) on its stats."""
    start = time.perf_counter()
    ttft = None
    last = None
    while True:
        try:
            token = next(decoder)
        except StopIteration as stop:
            stats: GenerationStats | None = stop.value  # (None: closed between its steps, from another thread)
            break
        last = time.perf_counter() - start
        if ttft is None:
            ttft = last
        committed.append(token)
        yield token
    if stats is not None:
        stats.wall_s = last if last is not None else time.perf_counter() - start
        stats.ttft_s = ttft or 0.0
    return stats


def emit(tokens: list[int], out: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> Generator[int, None, bool]:
    """Commit tokens in order; stop at an end-of-sequence token or at `max_new_tokens`. Returns done."""
    for token in tokens:
        out.append(token)
        yield token
        if token in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


def ending(decoder: Decoder, drafters: list[Any], prompt_ids: list[int]) -> Decoder:
    """Pass a decoder's tokens through and, once it stops (finished, or closed by its caller), tell each drafter
    the generation's output (`Drafter.end`)."""
    output: list[int] = []
    try:
        while True:
            try:
                token = next(decoder)
            except StopIteration as stop:
                return stop.value
            output.append(token)
            yield token
    finally:
        for drafter in drafters:
            drafter.end(prompt_ids, output)
