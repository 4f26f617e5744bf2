"""JSON text read as written: what Python's `json` reads past without a word (a key given twice, a number read as
another), found so that a reader can refuse it, naming where. A server's request bodies and a model's tool calls, and
a bench's prompts files, are read so."""

from __future__ import annotations

import json
from typing import Any


class _Twice(dict):
    """A JSON object that named a key more than once (`twice`: the first such key)."""

    twice: str


class _Marked(float):
    """A JSON number Python reads as another: not 0 but read as 0.0 (below a double's range), or an integer of more
    digits than Python converts (read as 0 here, so that the rest of the text is read); `why`: what is wrong."""

    why: str


def json_fault(text: str | bytes) -> tuple[str, str] | None:
    """What Python's `json` reads past in JSON text without a word, as (where: the dotted path, "" for the whole
    text; why, a sentence after it): a key given twice in one object (the last would win, the others be dropped), a
    number that is not 0 but reads as 0 (`1e-400`: a temperature so would decode greedily), or an integer too long
    for Python to read (which `json` reports as no JSON at all). An object's own before those inside it, then in the
    text's order; None where the text has none, or is no JSON object (its readers say so)."""
    marked = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal marked
        value = dict(items)
        if len(value) == len(items):
            return value
        seen: set[str] = set()
        marked, value = True, _Twice(items)
        value.twice = next(key for key, _ in items if key in seen or seen.add(key))
        return value

    def number(literal: str) -> float:
        nonlocal marked
        value = float(literal)
        if value != 0 or not any(digit in "123456789" for digit in literal.lower().partition("e")[0]):
            return value
        marked, value = True, _Marked(value)
        value.why = (f"{literal} is not 0 but below the smallest double, which reads it as 0: send 0 where the field "
                     "takes it, or a larger number")
        return value

    def integer(literal: str) -> int | float:
        nonlocal marked
        try:
            return int(literal)
        except ValueError:  # (more digits than sys.get_int_max_str_digits())
            marked, value = True, _Marked(0.0)
            value.why = f"an integer of {len(literal.lstrip('-'))} digits is more than this server reads"
            return value

    try:
        try:
            parsed = json.loads(text, object_pairs_hook=pairs, parse_float=number)
        except ValueError as error:
            if "integer string conversion" not in str(error):
                raise
            parsed = json.loads(text, object_pairs_hook=pairs, parse_float=number, parse_int=integer)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    stack: list[tuple[Any, str]] = [(parsed, "")] if marked and isinstance(parsed, dict) else []
    while stack:
        value, where = stack.pop()
        named = where + "." if where else ""
        if isinstance(value, _Twice):
            return named + value.twice, "a key given twice (give each field once)"
        if isinstance(value, _Marked):
            return where, value.why
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend(reversed([(child, f"{named}{key}") for key, child in children]))  # (popped in the text's order)
    return None
