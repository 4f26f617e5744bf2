"""llama.cpp's own tools as peers, built for this machine (`speculant peers build-llamacpp`): `llamacpp-cli-ar`
runs `llama-completion` (plain decoding), `llamacpp-cli-spec` `llama-speculative-simple` with a draft
model, and `llamacpp-cli-ngram` the same tool with its draft-free `ngram-simple` drafts. Each gets the
target's GGUF, the prompt exactly as speculant tokenizes it (chat template applied; llama.cpp parses its
special tokens back; the run checks that it counts the same prompt tokens), greedy or the run's sampling,
and the context settings of speculant's llama.cpp backend (threads, context, micro-batch of 512, flash
attention, bf16 KV cache; `kv=f16` gives llama.cpp's default cache). Times are the tools' own: prompt evaluation and generation, without loading the model.
The tools print text, not token ids: a run counts as identical to `ar` when its text starts with ar's.
`llama-speculative-simple` is asked for one token fewer than the run, as it stops one token past its -n; its
drafts may still carry it a few tokens further (a model drafter's last draft is not cut to what is left): those
count as the tokens it emitted in its time, which favours it a little in whole-request rates (its prompt's time
spread over more tokens). `llamacpp-cli-ar` follows a prompt's JSON `response_format` with llama-completion's own
`--json-schema` (llama.cpp's grammar sampler)."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.config import SamplingConfig, option
from speculant.errors import ConfigError, OptionError
from speculant.methods.drafting import DrafterOptions
from speculant.models.backends import llamacpp
from speculant.models.backends.llamacpp_build import tool

KV_TYPES = ("bf16", "f16")
FOLLOWS_SCHEMAS = ("llamacpp-cli-ar",)  # the tool that takes --json-schema
TIMEOUT_S = 1800  # one generation
TRIES = 8  # runs of a tool whose output its logger cut short (`printed_all`) before the bench gives up
SPECULATIVE_END = "\n\n\n\n"  # what llama-speculative-simple writes after its text: two ends of two newlines each


@dataclass(frozen=True)
class CLIAROptions:
    kv: str = option("bf16", "KV cache type: bf16 (speculant's, the same tokens) or f16 (llama.cpp's default)",
                     choices=KV_TYPES)

    def __post_init__(self) -> None:
        if self.kv not in KV_TYPES:
            raise ConfigError(f"kv must be one of {', '.join(KV_TYPES)}, got {self.kv}")


@dataclass(frozen=True)
class CLISpecOptions(DrafterOptions, CLIAROptions):
    MODEL_ONLY = "llamacpp-cli-spec"
    k: int | None = option(None, "--spec-draft-n-max, the longest draft (default: llama.cpp's)")

    def __post_init__(self) -> None:
        DrafterOptions.__post_init__(self)
        CLIAROptions.__post_init__(self)
        check_draft_length(self.k)


MOST_PEER_DRAFT = 1024  # a peer's longest draft at most (more is no draft of a reply; the tool's own parse overflowed)


def check_draft_length(k: int | None) -> None:
    """A peer's longest draft `k`: None (the peer's default) or 1 to MOST_PEER_DRAFT (0 was taken for the default)."""
    if k is not None and not 1 <= k <= MOST_PEER_DRAFT:
        raise OptionError("k", f"k must lie in [1, {MOST_PEER_DRAFT}], got {k} (leave k out for the peer's default)")


@dataclass(frozen=True)
class CLINgramOptions(CLIAROptions):
    k: int | None = option(None, "--spec-ngram-simple-size-m, the longest draft (default: llama.cpp's)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_draft_length(self.k)


CLI_PEERS: dict[str, type] = {"llamacpp-cli-ar": CLIAROptions, "llamacpp-cli-spec": CLISpecOptions,
                              "llamacpp-cli-ngram": CLINgramOptions}


@dataclass
class ToolRun:
    """What one run of a tool printed, read back: the new text and its times (seconds)."""

    text: str
    new_tokens: int
    prompt_tokens: int
    wall_s: float  # prompt evaluation + generation
    ttft_s: float


def _number(pattern: str, log: str, tool_name: str) -> float:
    match = re.search(pattern, log)
    if match is None:
        raise ConfigError(f"{tool_name} printed no '{pattern}': {log.strip()[-300:]}")
    return float(match.group(1))


def printed_all(method: str, stdout: bytes, log: str) -> bool:
    """Whether a tool that exited 0 printed all it prints: its logger, which prints both its text and its log from a
    thread, drops what it has not printed when the tool exits (a singleton it never flushes), often on short runs.
    Each tool ends with common_perf_print's times; llama-speculative-simple then writes its text's second end."""
    return "total time =" in log and (method == "llamacpp-cli-ar" or stdout.endswith(SPECULATIVE_END.encode()))


def read_completion(stdout: bytes, log: str) -> ToolRun:
    """`llama-completion -no-cnv --no-display-prompt`: stdout is the new text, then ' [end of text]' at an
    end-of-generation token, then a blank line; the log ends with common_perf_print's times."""
    text = stdout.decode(errors="replace").removesuffix("\n\n").removesuffix(" [end of text]\n")
    prompt_ms = _number(r"prompt eval time =\s*([\d.]+) ms", log, "llama-completion")
    eval_ms = _number(r"(?<!prompt )eval time =\s*([\d.]+) ms", log, "llama-completion")
    # llama.cpp prints at least 1 run, in 0 ms where none ran (one token asked for, or an end token first)
    runs = int(_number(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) runs", log, "llama-completion")) \
        if eval_ms > 0 else 0
    sampling_ms = _number(r"sampling time =\s*([\d.]+) ms", log, "llama-completion")
    n = runs + 1  # the last token sampled (an end token, or the n-th) is never evaluated
    return ToolRun(text, n, int(_number(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", log, "llama-completion")),
                   (prompt_ms + eval_ms + sampling_ms) / 1000, (prompt_ms + sampling_ms / n) / 1000)


def read_speculative(stdout: bytes, log: str, prompt: bytes) -> ToolRun:
    """`llama-speculative-simple`: stdout echoes the prompt, then the new text, then blank lines; the log
    has the encode and decode times and the draft counts. The tool encodes the prompt but its last token, whose
    forward, the first step, it times with decoding: TTFT here is the encoding and one step of the mean length
    (steps = tokens - accepted drafts, as each step emits its accepted drafts and one token of its own)."""
    body = stdout.removeprefix(b"\n\n")
    if not body.startswith(prompt):
        raise ConfigError("llama-speculative-simple echoed another prompt than it was given")
    text = body[len(prompt):].decode(errors="replace").removesuffix(SPECULATIVE_END)
    encode_s = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log, "llama-speculative-simple")
    decode_s = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log, "llama-speculative-simple")
    n = int(_number(r"decoded\s+(\d+) tokens", log, "llama-speculative-simple"))
    steps = max(n - int(_number(r"n_accept\s*=\s*(\d+)", log, "llama-speculative-simple")), 1)
    return ToolRun(text, n, int(_number(r"encoded\s+(\d+) tokens", log, "llama-speculative-simple")),
                   encode_s + decode_s, encode_s + decode_s / steps)


def schema_args(method: str, response_format: dict[str, Any] | None) -> list[str]:
    """llama-completion's arguments for a JSON `response_format` (none for free text); a ConfigError for a tool
    or a kind of constraint llama.cpp's tools are not given here."""
    if response_format is None or response_format.get("type") == "text":
        return []
    kind = response_format.get("type")
    if method not in FOLLOWS_SCHEMAS or kind not in ("json_object", "json_schema"):
        raise ConfigError(f"{method} cannot follow a {kind} response_format (llamacpp-cli-ar follows JSON schemas)")
    schema = {"type": "object"} if kind == "json_object" else response_format["json_schema"]["schema"]
    return ["--json-schema", json.dumps(schema)]


def tool_args(method: str, target: Any, prompt_file: Path, max_new_tokens: int, options: Any,
              sampling: SamplingConfig, seed: int, response_format: dict[str, Any] | None = None) -> list[str]:
    # llama-speculative-simple stops once it has emitted more than -n tokens: it is asked for one fewer
    asked = max_new_tokens if method == "llamacpp-cli-ar" else max_new_tokens - 1
    common = ["-m", str(target.weights.path), "-f", str(prompt_file), "-n", str(asked),
              "-t", str(target.threads), "-tb", str(target.threads), "-c", str(target.max_positions),
              "-b", "2048", "-ub", str(llamacpp.N_BATCH), "-fa", "on", "-ctk", options.kv, "-ctv", options.kv,
              "--seed", str(seed), "--no-escape"]  # the prompt's backslashes are text
    if sampling.greedy:
        common += ["--temp", "0"]
    else:
        common += ["--temp", str(sampling.temperature), "--top-k", str(sampling.top_k or 0),
                   "--top-p", str(sampling.top_p or 1.0), "--min-p", "0"]
    if method == "llamacpp-cli-ar":
        return [str(tool("llama-completion")), *common, "-no-cnv", "--no-display-prompt",
                *schema_args(method, response_format)]
    schema_args(method, response_format)  # refuses
    speculative = [str(tool("llama-speculative-simple")), *common]
    if method == "llamacpp-cli-spec":
        drafter = getattr(options.drafter, "weights", None)
        if drafter is None:
            raise ConfigError("llamacpp-cli-spec drafts with a GGUF model: give drafter=NAME of a catalog model or a .gguf")
        speculative += ["--spec-type", "draft-simple", "-md", str(drafter.path), "-td", str(target.threads),
                        "-ctkd", options.kv, "-ctvd", options.kv]
        return speculative + (["--spec-draft-n-max", str(options.k)] if options.k else [])
    speculative += ["--spec-type", "ngram-simple"]
    return speculative + (["--spec-ngram-simple-size-m", str(options.k)] if options.k else [])


def cli_generate(method: str, target: Any, prompt_ids: list[int], max_new_tokens: int, options: Any,
                 sampling: SamplingConfig, seed: int, response_format: dict[str, Any] | None = None) -> Any:
    """One generation by one of llama.cpp's tools, as a GenerationResult timed by the tool itself."""
    from speculant.api import GenerationResult
    from speculant.decoding.stats import GenerationStats

    from speculant.models.backends.llamacpp import LlamaCppCausalLM

    if not isinstance(target, LlamaCppCausalLM) or target.tokenizer is None:
        raise ConfigError(f"{method} needs a llama.cpp target with a tokenizer (backend=llamacpp)")
    prompt = target.tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompt.txt"
        prompt_file.write_bytes(prompt.encode() + b"\n")  # `-f` drops the file's last newline
        args = tool_args(method, target, prompt_file, max_new_tokens, options, sampling, seed, response_format)
        name = Path(args[0]).name
        for _ in range(TRIES):
            try:
                done = subprocess.run(args, capture_output=True, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ConfigError(f"{name} did not finish in {TIMEOUT_S} s") from None
            log = done.stderr.decode(errors="replace")
            if done.returncode != 0:
                last = re.sub(r"^[\d.]+ [A-Z] ", "", (log.strip().splitlines() or ["no message"])[-1])  # (timestamp)
                raise ConfigError(f"{name} exited with {done.returncode}: {last}")
            if printed_all(method, done.stdout, log):
                break
        else:
            raise ConfigError(f"{name} exited 0 with its output cut short {TRIES} times: llama.cpp's logger drops "
                              "what it has not printed when the tool exits")
    run = read_completion(done.stdout, log) if method == "llamacpp-cli-ar" else \
        read_speculative(done.stdout, log, prompt.encode())
    if run.prompt_tokens != len(prompt_ids):
        raise ConfigError(f"{Path(args[0]).name} tokenized the prompt into {run.prompt_tokens} tokens, "
                          f"speculant into {len(prompt_ids)}: the runs would not be comparable")
    stats = GenerationStats(method=method, new_tokens=run.new_tokens, wall_s=run.wall_s, ttft_s=run.ttft_s)
    token_ids = target.tokenizer.encode(run.text, add_special_tokens=False)
    return GenerationResult(token_ids, run.text, stats)
