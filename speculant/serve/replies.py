"""The OpenAI response and chunk objects of one request (`Shape`), with its tokens' log-probabilities spelled as
OpenAI spells them (`Spelling`), and a server-sent event's framing (`sse`)."""

from __future__ import annotations

import codecs
import json
import time
from typing import Any

from speculant.models.wrappers.logprobs import TokenLogprob
from speculant.serve import tools
from speculant.serve.engine import Outcome
from speculant.serve.text import skipped_ids


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Spelling:
    """Each token's bytes and the text a client is shown for it: its decoded text where its bytes are whole UTF-8,
    else OpenAI's `bytes:\\xe2\\x80` form (a token that splits a character decodes to U+FFFD, which many tokens
    share), so that distinct tokens never get one name."""

    def __init__(self, tokenizer: Any, width: int):
        from speculant.drafters.vocab import token_bytes

        self.tokenizer = tokenizer
        self.spelled = token_bytes(tokenizer, width)[0] if tokenizer is not None else [None] * width
        self.skipped = skipped_ids(tokenizer) if tokenizer is not None else frozenset()  # (no text in the reply)

    def bytes(self, token: int) -> bytes:
        spelled = self.spelled[token] if token < len(self.spelled) else None
        return spelled if spelled is not None else self.text(token).encode()

    def decoded(self, token: int) -> str:
        """What the token adds to the text (a split character's bytes as U+FFFD)."""
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def text(self, token: int) -> str:
        spelled = self.spelled[token] if token < len(self.spelled) else None
        if spelled is not None and self.tokenizer is not None:
            try:
                spelled.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in spelled)
        return self.decoded(token)


class Shape:
    """The OpenAI response and chunk objects of one request; with `spelling` (logprobs asked for), each choice
    carries its tokens' log-probabilities in the endpoint's form (chat: `content` entries; completions: parallel
    lists)."""

    def __init__(self, ident: str, model: str, chat: bool, spelling: Spelling | None = None,
                 calling: list[str] | None = None, parallel: bool = True, forced: bool = False):
        self.ident, self.model, self.chat, self.created = ident, model, chat, int(time.time())
        self.calling = calling  # the tools the reply may call (None: none): its calls of them parsed into `tool_calls`
        self.forced = forced  # the reply had to call (`tools.parse`)
        self.most_calls = None if parallel else 1
        self.spelling, self.logprobs = spelling, spelling is not None
        self.offset = 0  # characters of completion text before the next token (completions' text_offset)
        self.characters = codecs.getincrementaldecoder("utf-8")("replace")  # (a split character counts at its end)

    def cut_short(self, data: bytes) -> int:
        """1 where `data` cannot go on the character whose first bytes are pending (that one becomes a U+FFFD of the
        tokens before, so this token's text begins after it), else 0."""
        pending = self.characters.getstate()[0]
        if not pending or not data:
            return 0
        try:
            codecs.getincrementaldecoder("utf-8")().decode(pending + data[:1])
        except UnicodeDecodeError:
            return 1
        return 0

    def usage(self, outcome: Outcome) -> dict[str, Any]:
        return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens, "speculative": outcome.speculative}

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        logprobs = self.entries(outcome.logprobs or [])
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
            finish = outcome.finish_reason
            if self.calling is not None and \
                    (parsed := tools.parse(outcome.text, self.calling, self.most_calls, self.forced)).calls:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
                finish = self.finish(finish, parsed.calls)
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": logprobs}
        return {"id": self.ident, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(outcome)}

    @staticmethod
    def finish(reason: str, calls: list[dict[str, Any]]) -> str:
        """A reply's finish_reason where it holds calls: `tool_calls`, unless it was cut short (`length`)."""
        return "tool_calls" if calls and reason == "stop" else reason

    def step(self, event: dict[str, Any]) -> dict[str, Any]:
        """A chunk with no choices that carries one step's provenance (`stream_options.include_provenance`): each
        token with the text it made final (`engine.Steps.on_token`: joined, they are the generated text, tool calls
        included)."""
        tokens = [{"id": t, "text": text, "kind": kind}
                  for t, text, kind in zip(event["tokens"], event["texts"], event["kinds"])]
        return {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "speculant": {"tokens": tokens, "drafted": event["drafted"], "accepted": event["accepted"],
                              "drafter": event["drafter"]}}

    def chunk(self, delta: Any, entries: list[TokenLogprob], finish_reason: str | None = None) -> dict[str, Any]:
        logprobs = self.entries(entries) if entries else None
        if self.chat:
            content = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason, "logprobs": logprobs}
        return {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def entries(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """Log-probabilities in the endpoint's form (None where the request asked for none)."""
        if not self.logprobs:
            return None
        spelling = self.spelling
        if self.chat:
            def entry(t: int, logprob: float) -> dict[str, Any]:
                return {"token": spelling.text(t), "logprob": logprob, "bytes": list(spelling.bytes(t))}

            return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        pieces = [spelling.text(e.token) for e in entries]
        offsets = []
        for e in entries:
            if e.token in spelling.skipped:  # (a special token: the text leaves it out)
                offsets.append(self.offset)
                continue
            data = spelling.bytes(e.token)
            offsets.append(self.offset + self.cut_short(data))
            self.offset += len(self.characters.decode(data))
        # Each position's alternatives and, as OpenAI's (up to logprobs + 1 of them), the token it emitted.
        top = [{spelling.text(t): lp for t, lp in [*e.top, (e.token, e.logprob)]} for e in entries]
        return {"tokens": pieces, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": offsets}

