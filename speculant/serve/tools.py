"""Tool calling on chat completions: the tools rendered by the model's chat template, the model's calls parsed
into OpenAI's `tool_calls`, and, where `tool_choice` asks for calls, the output constrained by a grammar whose
arguments follow each function's JSON schema (llguidance, through the structured-output wrapper), so that every
method, speculative or not, generates the same calls (`models.wrappers.constrained`).

The call syntax is Hermes' (Qwen2.5, Qwen3, Hermes and the models trained on their templates): each call a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. A template that does not
speak it gets a 400 naming `tools`.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from speculant.json_text import json_fault
from speculant.models.wrappers.constrained import JSON_OPTIONS, Constraint
from speculant.serve.text import tag_tail

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CLOSING = re.compile(r"\s*" + re.escape(CLOSE))  # after a call's JSON
WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's


def _refuse(constant: str) -> Any:
    """NaN and the infinities, which Python's `json` reads and writes but JSON has not: refused."""
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    """A JSON number as a float; one that overflows a double (1e400: JSON, but a client reads it as infinity,
    which it cannot write back) refused."""
    if not math.isfinite(value := float(number)):
        raise ValueError(f"{number} overflows a double")
    return value


DECODER = json.JSONDecoder(parse_constant=_refuse, parse_float=_finite)  # strict JSON: no NaN, no infinities
WRITTEN = json.JSONDecoder(parse_constant=_refuse)  # JSON text as a grammar's numbers allow it: 1e999 too


def speaks_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools and asks for Hermes-style calls: of named templates (a
    dict), the one transformers renders tools with (`tool_use`, else `default`)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return "tools" in template and OPEN in template


def _marker(tokenizer: Any, text: str) -> str | None:
    """`text`'s token in a Lark grammar (`<[id]>`) where the vocabulary has it as one, else None."""
    token = tokenizer.convert_tokens_to_ids(text)
    if isinstance(token, int) and token != tokenizer.unk_token_id and tokenizer.decode([token]) == text:
        return f"<[{token}]>"
    return None


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function that omits them


def _arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters with every local `$ref` pointing where they now sit, at `#/$defs/arguments` of the call
    object's schema (a reference resolves from the root of the schema it is in: `#/$defs/Address` or a recursive
    `#` meant the parameters' own root)."""
    def moved(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: "#/$defs/arguments" + value[1:] if key == "$ref" and isinstance(value, str)
                    and value.startswith("#") else moved(value) for key, value in node.items()}
        return [moved(value) for value in node] if isinstance(node, list) else node

    return moved(parameters)


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of a call of function `name`: its name and its arguments, an object that matches
    `parameters` (none: the empty object, OpenAI's "empty parameter list"; `{}`: any object). The arguments are an
    object whatever `parameters` allow (OpenAI's describe one, and `parse` takes no other), so parameters no object
    matches make a schema that does not compile."""
    arguments = _arguments(NO_PARAMETERS if parameters is None else parameters)
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": {
                "allOf": [{"type": "object"}, {"$ref": "#/$defs/arguments"}]}},
            "required": ["name", "arguments"], "additionalProperties": False,
            "$defs": {"arguments": arguments}, "x-guidance": JSON_OPTIONS}


def constraint(tokenizer: Any, functions: list[dict[str, Any]], choice: Any, parallel: bool,
               answer: dict[str, Any] | None = None) -> Constraint | None:
    """The grammar a reply must match: `auto`, text or calls (text may come before them), or where the request's
    `response_format` gives the `answer`'s JSON schema, an answer that matches it or calls; `required`, calls only
    (a format has no text to constrain); a named function, one call of it; with `parallel` false, at most one call.
    None for `none`.

    Text never holds the call tag (spelled in plain tokens it would parse as a call the grammar never checked): where
    the vocabulary has the tag as one token the text excludes its spelling, else the text before a call ends, lazily,
    at the first tag, which the call follows. Each call's JSON is written as `response_format`'s is
    (`JSON_OPTIONS`: no whitespace without end), as `call_schema` has it."""
    if choice == "none":
        return None
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    bodies = []
    for function in functions:
        if named is not None and function["name"] != named:
            continue
        bodies.append(f"%json {json.dumps(call_schema(function['name'], function.get('parameters')))}")
    opening, closing = _marker(tokenizer, OPEN), _marker(tokenizer, CLOSE) or json.dumps(CLOSE)
    rest = f'"\\n" body "\\n" {closing} "\\n"?'  # a call after its opening tag
    call = f"{opening or json.dumps(OPEN)} {rest}"
    more = "" if named is not None or not parallel else " call*"
    text = f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(OPEN)}(?s:.*)/"
    if choice != "auto":
        lark = [f"start: call{more}"]
    elif answer is not None:
        lark = [f"start: answer | call{more}", f"answer: %json {json.dumps({**answer, 'x-guidance': JSON_OPTIONS})}"]
    elif opening is not None:
        lark = [f"start: TEXT | TEXT? call{more}", text]
    else:  # text up to the first tag, lazily (a greedy lexeme would run past it), then the rest of that call
        lark = [f"start: TEXT | head rest{more}", text, f"head[lazy]: /(?s:.*)/ {json.dumps(OPEN)}", f"rest: {rest}"]
    lark += [f"call: {call}", f"body: {' | '.join(bodies)}"]
    return Constraint("grammar", "\n".join(lark), "tools")


@dataclass
class Parsed:
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI's tool_calls entries


def _members(text: str, at: int, decoder: json.JSONDecoder = DECODER) -> tuple[dict[str, tuple[Any, str]], int]:
    """The JSON object that starts at `text[at]`, read by `decoder` (strictly by default): each key's value and the
    text it is written in (a key given twice: its last, as `json` reads it), and where the object ends. A ValueError
    where no such object starts there."""
    if not text.startswith("{", at):
        raise ValueError("not an object")
    members: dict[str, tuple[Any, str]] = {}
    at = WHITESPACE.match(text, at + 1).end()
    if text.startswith("}", at):
        return members, at + 1
    while True:
        key, at = decoder.raw_decode(text, at)
        at = WHITESPACE.match(text, at).end()
        if not isinstance(key, str) or not text.startswith(":", at):
            raise ValueError("not an object's key")
        start = WHITESPACE.match(text, at + 1).end()
        value, at = decoder.raw_decode(text, start)
        members[key] = value, text[start:at]
        at = WHITESPACE.match(text, at).end()
        if text.startswith("}", at):
            return members, at + 1
        if not text.startswith(",", at):
            raise ValueError("not an object's member")
        at = WHITESPACE.match(text, at + 1).end()


def parse(text: str, names: Collection[str], most: int | None = None, forced: bool = False) -> Parsed:
    """The calls in a reply, at most `most` (each with an id, its arguments as JSON text of an object: the text the
    model wrote, strict JSON, read as written: `json_fault`) and the text before them (None where there is none). A
    block that is not a call's JSON object, or that calls a function other than `names`, stays in the content; so
    does one whose arguments JSON readers would read otherwise than written (a key twice, a number past a double),
    unless the reply had to call (`forced`: tool_choice required or a function named), where the grammar allowed it:
    then it is the call, as written (sent back, it is refused naming the fault). A call's JSON is read whole before
    its closing tag is looked for: an argument may hold the tag's text."""
    calls, kept, at, search = [], [], 0, 0
    while (start := text.find(OPEN, search)) >= 0 and (most is None or len(calls) < most):
        search = start + len(OPEN)
        try:
            call, end = _members(text, WHITESPACE.match(text, search).end(), WRITTEN if forced else DECODER)
        except (ValueError, RecursionError):
            continue
        name, _ = call.get("name", (None, ""))
        arguments, written = call.get("arguments", ({}, "{}"))
        close = CLOSING.match(text, end)
        if close is None or name not in names or not isinstance(arguments, dict) or \
                (not forced and json_fault(written) is not None):
            continue  # (arguments read otherwise than written, a key twice say, would be refused sent back)
        kept.append(text[at:start])
        at = search = close.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": name, "arguments": written}})
    if not calls:
        return Parsed(text, [])
    content = ("".join(kept) + text[at:]).rstrip()  # (the newlines between calls are the format's)
    return Parsed(content or None, calls)


class ToolStream:
    """A streamed reply's text split into content, handed out as it comes, and calls, held until the end: the
    text from the first `<tool_call>` on (or a tail that could begin it, or whitespace) is kept back."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.calling = False

    def push(self, piece: str) -> str:
        """The content that `piece` makes final."""
        self.text += piece
        if self.calling:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.calling = True
            end = at
        else:
            end = len(self.text) - tag_tail(self.text, OPEN)
        end = self.sent + len(self.text[self.sent:max(end, self.sent)].rstrip())  # (whitespace before a call is the
        piece, self.sent = self.text[self.sent:end], end  # format's: `parse` strips it, so it waits for what follows)
        return piece

    def finish(self, names: Collection[str], most: int | None = None,
               forced: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the content not yet handed out, the calls of functions `names`: at most `most`; `parse`'s `forced`)."""
        parsed = parse(self.text, names, most, forced)
        if not parsed.calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        rest = (parsed.content or "")[self.sent:]
        self.sent = len(self.text)
        return rest, parsed.calls


def template_message(message: Any) -> dict[str, Any]:
    """A request's message as chat templates take it: an assistant's calls with their arguments as objects (the
    templates write them with `tojson`), a tool's result with its call's id, a participant's name."""
    content = message.content if isinstance(message.content, str) or message.content is None else \
        "".join(p.text for p in message.content)
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"type": "function", "id": call.id, "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out
