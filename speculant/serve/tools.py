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
import re
import uuid
from dataclasses import dataclass
from typing import Any

from speculant.models.wrappers.constrained import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
ANY_OBJECT = {"type": "object"}  # a function declared without `parameters`


def speaks_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools and asks for Hermes-style calls."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template and OPEN in template


def _marker(tokenizer: Any, text: str) -> str:
    """`text` in a Lark grammar: its token where the vocabulary has it as one (`<[id]>`), else the string."""
    token = tokenizer.convert_tokens_to_ids(text)
    if isinstance(token, int) and token != tokenizer.unk_token_id and tokenizer.decode([token]) == text:
        return f"<[{token}]>"
    return json.dumps(text)


def constraint(tokenizer: Any, functions: list[dict[str, Any]], choice: Any, parallel: bool) -> Constraint | None:
    """The grammar a reply must match: `auto`, text or calls (text may come before them); `required`, calls
    only; a named function, one call of it; with `parallel` false, at most one call. None for `none`."""
    if choice == "none":
        return None
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    bodies = []
    for function in functions:
        if named is not None and function["name"] != named:
            continue
        schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                   "arguments": function.get("parameters") or ANY_OBJECT},
                  "required": ["name", "arguments"], "additionalProperties": False}
        bodies.append(f"%json {json.dumps(schema)}")
    calls = "call" if named is not None or not parallel else "call+"
    start = calls if choice != "auto" else f"TEXT | TEXT? {calls}"
    lark = "\n".join([f"start: {start}",
                      "TEXT: /(.|\\n)+/",
                      f'call: {_marker(tokenizer, OPEN)} "\\n" body "\\n" {_marker(tokenizer, CLOSE)} "\\n"?',
                      f"body: {' | '.join(bodies)}"])
    return Constraint("grammar", lark, "tools")


@dataclass
class Parsed:
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI's tool_calls entries


def parse(text: str, most: int | None = None) -> Parsed:
    """The calls in a reply, at most `most` (each with an id, its arguments as JSON text of an object) and the text
    before them (None where there is none). A block that is not a call's JSON object stays in the content."""
    calls, kept, at = [], [], 0
    for match in CALL.finditer(text):
        if most is not None and len(calls) >= most:
            break
        try:
            call = json.loads(match.group(1))
        except (ValueError, RecursionError):
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
                not isinstance(call.get("arguments", {}), dict):
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
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
            end = len(self.text) - max((n for n in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                                        if self.text.endswith(OPEN[:n])), default=0)
        end = self.sent + len(self.text[self.sent:max(end, self.sent)].rstrip())  # (whitespace before a call is the
        piece, self.sent = self.text[self.sent:end], end  # format's: `parse` strips it, so it waits for what follows)
        return piece

    def finish(self, most: int | None = None) -> tuple[str, list[dict[str, Any]]]:
        """(the content not yet handed out, the calls: at most `most`)."""
        parsed = parse(self.text, most)
        if not parsed.calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        rest = (parsed.content or "")[self.sent:]
        self.sent = len(self.text)
        return rest, parsed.calls


def template_message(message: Any) -> dict[str, Any]:
    """A request's message as chat templates take it: an assistant's calls with their arguments as objects (the
    templates write them with `tojson`), a tool's result with its call's id."""
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
    return out
