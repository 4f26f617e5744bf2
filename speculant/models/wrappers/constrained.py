"""Structured output: the target's logits masked, row by row, to the tokens a grammar allows after that row's
prefix (a JSON object, a JSON schema, a Lark grammar or a regular expression, compiled by llguidance).

`Constrained` wraps the target, so the constrained distribution is what every method verifies: a chain's
row j is masked after the committed text plus draft tokens 1..j, a tree node's after its own path. A draft
token the grammar forbids gets probability 0 from the row before it and is rejected there, so rows after
it are never read. Greedy output therefore equals constrained `ar` token for token, and sampling follows
the constrained distribution (Leviathan et al. 2023, Theorem 3.5, with p the masked target). The matcher
follows the cache: rollback and compaction only move where its next sync starts. Model drafters ask
`draft_guide` (a matcher of their own) and draft only what the grammar allows, which keeps their acceptance.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from speculant.errors import ConfigError, RequestError
from speculant.models.base import CausalLM, Wrapper, common_prefix_len
from speculant.trees.tree import TokenTree

KINDS = ("json_object", "json_schema", "grammar", "regex")
FORMAT_FIELDS = {"text": (), "json_object": (), "json_schema": ("json_schema",), "grammar": ("grammar",),
                 "regex": ("regex",)}  # a response_format's fields beside its type: any other is refused, not dropped
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}  # OpenAI's json_schema (always followed; strict:
# its schema must be one that leaves nothing out, `strict_fault`)
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a json_schema's or a function's name, as OpenAI's
# JSON as models write it (newlines and indentation between tokens), but never padded without end: at most 16
# whitespace characters between two tokens.
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[ \n]{0,16}"}
# The most Earley items one row of the parse may hold (llguidance's default: 2000). An ambiguous grammar (`e: e e |
# "a"`) adds items with every token, and a mask's cost grows faster than they do: at 2000, 0.1 s per token of the
# one thread that steps every request. A grammar past it fails its request, naming the limit; JSON schemas, tool
# calls and grammars that parse without such ambiguity stay far below it.
MAX_ITEMS_IN_ROW = 500
# The longest grammar compiled, as given (a Lark grammar, a regex, a JSON schema's JSON) and as llguidance takes it: a
# compile's time and memory grow faster than its text, and a server compiles what its clients send (CHANGELOG, 12-02).
MAX_GRAMMAR_CHARS = 128 * 1024
# llguidance compiles by recursion: a chain of rules or of `$ref`s far shorter than MAX_GRAMMAR_CHARS overflows a
# thread's default stack, and a stack overflow ends the process, server and all. Compiles run on a thread with this
# much stack (`on_deep_stack`): room for the deepest chain MAX_GRAMMAR_CHARS can spell (test_constrained.py compiles
# it), several times over.
COMPILE_STACK = 256 * 1024 * 1024
_STACK_SIZE = threading.Lock()  # (threading.stack_size is the process's: set for one thread's start, then put back)


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` one of KINDS; `value` the JSON schema (a dict), the Lark grammar or
    the regular expression (text), None for any JSON object."""

    kind: str
    value: Any = None
    source: str = field(default="response_format", compare=False)  # the request field it comes from (a server's
    # answer to a grammar llguidance fails to follow names it)
    text: str = field(init=False, repr=False, compare=False)  # llguidance's grammar text (`grammar`)

    def __post_init__(self) -> None:
        """A grammar, schema or pattern that does not compile, or is longer than MAX_GRAMMAR_CHARS, is refused when
        given, before any tokenizer (or model) loads: llguidance checks it without one."""
        try:
            text, error = on_deep_stack(self._compile)
        except ConfigError:
            raise
        except (ValueError, TypeError, RecursionError) as error:  # (not JSON; nested past llguidance's limit)
            raise ConfigError(f"the {self.kind} does not compile: {one_line(str(error))}") from None
        if error:
            raise ConfigError(f"the {self.kind} does not compile: {one_line(error)}")
        object.__setattr__(self, "text", text)

    def _compile(self) -> tuple[str, str]:
        """(llguidance's grammar text, its complaint: "" where it compiles), each length checked before its step."""
        given = json.dumps(self.schema, allow_nan=False) if self.schema is not None else self.value
        _check_length(self.kind, given, "")
        text = self.grammar()
        _check_length(self.kind, text, " as compiled")
        return text, _llguidance().LLMatcher.validate_grammar(text)

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any]) -> Constraint | None:
        """From OpenAI's `response_format` ({"type": "text"}: None; "json_object"; "json_schema" with
        {"json_schema": {"schema": ...}}), plus speculant's {"type": "grammar", "grammar": LARK} and {"type":
        "regex", "regex": PATTERN}. A ConfigError says what is wrong."""
        if not isinstance(response_format, Mapping):
            raise ConfigError(f"response_format must be a mapping such as {{\"type\": \"json_object\"}}, got "
                              f"{type(response_format).__name__}")
        kind = response_format.get("type")
        if not isinstance(kind, str):
            raise ConfigError(f"response_format type must be one of text, {', '.join(KINDS)}; got {kind!r}")
        unknown = sorted(set(response_format) - {"type", *FORMAT_FIELDS.get(kind, ())})
        if unknown and kind in FORMAT_FIELDS:
            raise ConfigError(f"response_format of type {kind} takes no field {unknown[0]!r} (it takes: "
                              f"{', '.join(('type', *FORMAT_FIELDS[kind]))})")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if isinstance(spec, Mapping) and (extra := sorted(set(spec) - JSON_SCHEMA_FIELDS)):
                raise ConfigError(f"response_format json_schema takes no field {extra[0]!r} (it takes: "
                                  f"{', '.join(sorted(JSON_SCHEMA_FIELDS))})")
            if not isinstance(schema, Mapping):
                raise ConfigError("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}")
            if spec.get("description"):  # (OpenAI's model reads it; here only the schema constrains; "" says nothing)
                raise ConfigError("response_format json_schema's description would go unread: the schema constrains "
                                  "the reply, and no prompt holds the description (say it in the prompt instead)")
            for name, kind in (("name", str), ("strict", bool)):
                if spec.get(name) is not None and not isinstance(spec[name], kind):
                    raise ConfigError(f"response_format json_schema's {name} must be a {kind.__name__}, got "
                                      f"{spec[name]!r}")
            if spec.get("name") is not None and not SCHEMA_NAME.fullmatch(spec["name"]):
                raise ConfigError(f"response_format json_schema's name must be 1 to 64 letters, digits, '_' or '-', "
                                  f"got {spec['name']!r:.80}")
            try:
                fault = strict_fault(schema) if spec.get("strict") else None
            except RecursionError:  # (nested past Python's stack, or a cycle: its compile below says so)
                fault = None
            if fault:
                raise ConfigError(f"response_format json_schema is strict, and {fault}")
            return cls("json_schema", dict(schema))
        if kind in ("grammar", "regex"):
            value = response_format.get(kind)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"response_format {kind} needs a non-empty \"{kind}\" string")
            return cls(kind, value)
        raise ConfigError(f"response_format type must be one of text, {', '.join(KINDS)}; got {kind!r}")

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (any object for `json_object`); None for a grammar or a regex."""
        return {"type": "object"} if self.kind == "json_object" else self.value if self.kind == "json_schema" else None

    def grammar(self) -> str:
        """The constraint as llguidance's grammar text."""
        llguidance = _llguidance()
        if self.schema is not None:
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(self.schema, allow_nan=False), JSON_OPTIONS)
        elif self.kind == "grammar":
            text = llguidance.LLMatcher.grammar_from_lark(self.value)
        else:
            text = llguidance.LLMatcher.grammar_from_regex(self.value)
        return text


def _check_length(kind: str, text: str, how: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConfigError(f"the {kind} is {len(text)} characters{how}; at most {MAX_GRAMMAR_CHARS} compile (its time "
                          "and memory grow faster than its text)")


def on_deep_stack(function: Callable[[], Any]) -> Any:
    """`function()` on a thread of its own with COMPILE_STACK of stack, waited for (what it raises, raised here):
    llguidance's compiles, which recurse as deep as a grammar's chains of rules."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, function()))
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            out.append((False, error))

    with _STACK_SIZE:
        before = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="speculant-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    done, value = out[0]
    if not done:
        raise value
    return value


def strict_fault(schema: Any, where: str = "the schema") -> str | None:
    """Where a schema given with `strict: true` leaves something to the model, as OpenAI's structured outputs refuse
    it: an object without `additionalProperties: false` (extra keys would be allowed: a model writes them, and
    `f(**arguments)` fails), or with a property it does not require. None where it has neither."""
    if isinstance(schema, list):
        return next(filter(None, (strict_fault(part, f"{where}[{i}]") for i, part in enumerate(schema))), None)
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if "properties" in schema or kind == "object" or isinstance(kind, list) and "object" in kind:
        if schema.get("additionalProperties") is not False:
            return f"{where} sets no additionalProperties: false"
        if missing := sorted(set(schema.get("properties") or {}) - set(schema.get("required") or [])):
            return f"{where} does not require {missing[0]!r} (a strict schema requires every property)"
    inner = []  # (the schemas within: a mapping of names to schemas is walked by name, so that a property named
    for key, value in schema.items():  # "properties" or "type" is not read as a keyword)
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, Mapping):
            inner += [(part, f"{where}.{key}.{name}") for name, part in value.items()]
        elif key not in ("enum", "const", "default", "examples") and isinstance(value, (Mapping, list)):
            inner.append((value, f"{where}.{key}"))
    return next(filter(None, (strict_fault(part, at) for part, at in inner)), None)


def one_line(error: str) -> str:
    """An llguidance error in one line: without its source echo, caret and state dump."""
    lines = [line.strip() for line in error.split("<state>")[0].splitlines()]
    return " ".join(line for line in lines if line and set(line) != {"^"} and not re.match(r"\d+ \|", line))


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConfigError("structured output needs llguidance: pip install 'speculant[serve]'") from None
    return llguidance


@lru_cache(maxsize=8)
def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: it walks the vocabulary), whose
    end-of-sequence tokens, where a grammar lets the text end, are the model's (those that end a generation)."""
    try:
        return _llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    except ValueError as error:  # (a slow tokenizer; a decoder it cannot read: Metaspace, WordPiece, ...)
        raise ConfigError(f"structured output: llguidance cannot read this tokenizer ({one_line(str(error)):.200})") \
            from None


class Matcher:
    """A grammar's state over generated tokens (llguidance's LLMatcher): which tokens may come next."""

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]):
        llguidance = _llguidance()
        if tokenizer is None:
            raise ConfigError("structured output needs the model's tokenizer")
        ends = tuple(sorted(t for t in eos_token_ids if t < vocab_size))  # (one past the logits is never generated)
        if not ends:  # (the text would go on past the grammar's end: nothing could end it there)
            raise ConfigError("structured output needs a model with an end-of-sequence token: the text ends with it")
        self.vocab_size, self.eos_token_ids = vocab_size, ends
        self.constraint, self.tokenizer = constraint, tokenizer
        llg_tokenizer = _llg_tokenizer(tokenizer, vocab_size, self.eos_token_ids)
        self._matcher = on_deep_stack(lambda: llguidance.LLMatcher(
            llg_tokenizer, constraint.text, log_level=0,
            limits=llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)))
        if self._matcher.is_error():
            raise ConfigError(f"the {constraint.kind} does not compile: {one_line(self._matcher.get_error())}")
        self._matcher.compute_bitmask()  # (a grammar no text matches stops here: no token, not even the end, allowed)
        if self._matcher.is_error():
            raise ConfigError(f"the {constraint.kind} matches no text: nothing could be generated")
        self._start = self._matcher.deep_copy()  # the compiled grammar before any token: what twins start from
        self.consumed: list[int] = []  # the tokens it has consumed, all allowed

    def twin(self) -> Matcher:
        """A matcher of its own on the same grammar, at its start (drafting follows other prefixes than verification):
        a copy of the compiled grammar, not a compile."""
        twin = copy.copy(self)
        twin._matcher, twin.consumed = self._start.deep_copy(), []
        return twin

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens that may come next."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(len(bits), self.vocab_size)
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        return allowed

    def follow(self, tokens: Sequence[int]) -> bool:
        """Move to the state after `tokens` (rolling back to what it shares with them first): whether the
        grammar allows all of them (if not, it stops after the longest allowed prefix). Where llguidance fails
        to follow the grammar itself (a limit of its lexer), a ConfigError: never text outside the grammar."""
        common = common_prefix_len(self.consumed, tokens)
        if common < len(self.consumed):
            self._matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        rest = list(tokens[common:])
        taken = self._matcher.try_consume_tokens(rest) if rest else 0
        if self._matcher.is_error():
            raise RequestError(self.constraint.source, f"llguidance could not follow the {self.constraint.kind}: "
                               f"{one_line(self._matcher.get_error())}")
        self.consumed.extend(rest[:taken])
        return taken == len(rest)


class Constrained(Wrapper):
    """A CausalLM whose every logits row is masked by `matcher` after that row's generated prefix."""

    def __init__(self, model: CausalLM, matcher: Matcher):
        super().__init__(model)
        self.matcher = matcher
        self._drafting: Matcher | None = None  # the drafters' own, made at their first question
        self._ids: list[int] = []  # the cached tokens
        self._prompt = 0  # how many of them are the prompt: the grammar starts after it

    def draft_guide(self, context: Sequence[int]) -> torch.Tensor | None:
        """For a drafter: the tokens the grammar allows after `context` (the prompt and what follows it), or None
        where the context has left the grammar (a draft token the target will reject anyway)."""
        if self._drafting is None:
            self._drafting = self.matcher.twin()
        return self._drafting.allowed() if self._drafting.follow(context[self._prompt:]) else None

    def _mask(self, row: torch.Tensor, generated: Sequence[int]) -> None:
        if self.matcher.follow(generated):
            allowed = self.matcher.allowed().to(row.device)
            row[:len(allowed)].masked_fill_(~allowed, float("-inf"))
            row[len(allowed):] = float("-inf")

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        logits = self.model.prefill(ids).clone()
        self._ids, self._prompt = list(ids), len(ids)
        self._mask(logits.view(-1, logits.shape[-1])[-1], [])
        return logits

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        start = self.model.cache_len
        logits = self.model.forward(ids, positions, tree=tree).clone()
        self._ids = self._ids[:start] + list(ids)
        # Each row's generated text: what is cached after the prompt before the new tokens (before a tree's
        # root), then the new tokens up to the row (the path from the root to the row's node).
        first = start if tree is None else start - (len(tree) - len(ids))
        generated = self._ids[self._prompt:first]
        for j in range(len(ids)):
            if tree is None:
                self._mask(logits[j], generated + list(ids[:j + 1]))
            else:
                path = tree.path_to(len(tree) - len(ids) + j)
                self._mask(logits[j], generated + [tree.tokens[node] for node in path])
        return logits

    def rollback(self, n: int) -> None:
        self.model.rollback(n)
        del self._ids[n:]

    def keep(self, kept: int, path: Sequence[int]) -> None:
        self.model.keep(kept, path)
        path_ids = [self._ids[i] for i in path]
        del self._ids[kept:]  # (in place: the context before the tree is not copied)
        self._ids += path_ids
