"""Frozen dataclasses for the knobs every generation shares, and the machinery that turns any options
dataclass into command-line flags, bench-spec values and server request fields.

A field made with `option(...)` carries its help text and, when its values come as text, how to parse
them (`parse`) and which values are allowed (`choices`). Methods declare their own options dataclasses
the same way (`speculant.methods`); nothing else lists options.
"""

from __future__ import annotations

import argparse
import functools
import math
import numbers
import operator
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from speculant.errors import ConfigError, OptionError

T = TypeVar("T")
AUTO = "auto"  # a size, dtype or method that speculant chooses from measurements
CATCH_UPS = ("expected", "safe")  # when `auto` pays a model drafter's catch-up on the prompt (AutoOptions.catch_up)
SCHEDULES = ("serial", "stage")  # a `tree`'s or `auto`'s drafting: after verification, or during it (Yggdrasil 5.1)
DEFAULT_TARGET = "qwen2.5-coder-1.5b"  # catalog names (speculant.models.catalog)
DTYPES = ("auto", "bf16", "fp32")
BACKENDS = {"hf": "HFCausalLM", "llamacpp": "LlamaCppCausalLM", "lean": "LeanCausalLM", "static": "StaticCausalLM"}
# each backend's name and CausalLM class, in `models/backends/NAME.py`: transformers; GGUF on llama.cpp; GGUF on
# speculant's own kernels; transformers weights on torch kernels with a static cache
EXECUTORS = ("thread", "process", "ray")  # where DSI's target servers run
API_KEY_ENV = "SPECULANT_API_KEY"  # `serve`'s API key where --api-key is not given
MOST_SERVERS = 64  # DSI's target servers in one run: each a thread, process or actor of the executor's
# A model's weights as `name@SUFFIX` picks them (a target's quant, a drafter spec's suffix):
QUANTS = ("int8", "int4")  # transformers weights, their linear layers quantized at load (models/numerics/quant.py)
GGUF = "gguf"  # the packaged GGUF weights as they are, on the llama.cpp backend
LEAN = "lean"  # the packaged GGUF on the lean backend as a drafter (models/backends/lean.py: head cut, types re-quantized)
SUFFIXES = (*QUANTS, GGUF, LEAN)  # what may follow a model's name after an `@`


def split_quant(spec: str) -> tuple[str, str | None]:
    """`qwen2.5-coder-0.5b@int8` -> ("qwen2.5-coder-0.5b", "int8"). An `@` followed by none of `SUFFIXES` in a path
    that exists (a folder `model@v2`) is part of its name."""
    name, at, quant = spec.rpartition("@")
    if not at or (quant not in SUFFIXES and Path(spec).expanduser().exists()):
        return spec, None
    return name, quant


def ascii_text(text: str) -> str:
    """`text` where it is written in ASCII without `_` (Python's `int` and `float` also take `1_0` and `٣`); a
    ValueError otherwise."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"not a number in ASCII digits: {text!r}")
    return text


def integer(text: str) -> int:
    """An integer written in ASCII digits; a ValueError otherwise."""
    return int(ascii_text(text))


def number(text: str) -> float:
    """A number written in ASCII; a ValueError otherwise."""
    return float(ascii_text(text))


def as_integer(value: Any) -> int | None:
    """`value` as an int where it is an integer (Python's, NumPy's, a 0-d tensor's; not a bool), else None. The one
    test of an integer given from Python (text is read by `integer`)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_number(value: Any) -> float | None:
    """`value` as a float where it is a real number (an integer as `as_integer` takes one, a float, NumPy's, a 0-d
    tensor's; not a bool, not text), else None."""
    if isinstance(value, (bool, str, bytes)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    return float(value) if getattr(value, "shape", None) == () and hasattr(value, "__float__") else None


def typed(options: type, values: dict[str, Any]) -> dict[str, Any]:
    """`values` given from Python for fields of the dataclass `options`, each number checked against its field's
    type (`as_integer` for an `int` field, `as_number` for a `float` one); an OptionError names the field otherwise
    (a float's `range(...)` test walks every integer, and a count of 2.5 fails deep in decoding)."""
    kinds = field_kinds(options)
    checked = dict(values)
    for name, value in values.items():
        kind = kinds.get(name, ())
        if value is None and type(None) in kind or isinstance(value, str) and str in kind:
            continue
        if bool in kind:  # (before int's test: a bool is an int; "no" would be true)
            if not isinstance(value, bool):
                raise OptionError(name, f"{name} must be True or False, got {value!r}")
        elif int in kind and float not in kind:
            checked[name] = as_integer(value)
            if checked[name] is None:
                raise OptionError(name, f"{name} must be an integer, got {value!r}")
        elif float in kind:
            checked[name] = as_number(value)
            if checked[name] is None:
                raise OptionError(name, f"{name} must be a number, got {value!r}")
    return checked


def count_or_auto(text: str) -> int | str:
    """Parse a count, or `auto`."""
    return AUTO if text == AUTO else integer(text)


REQUEST_MOST = 64  # the largest value a server's client may give a draft-size option (`most`): a tree of a
# thousand levels is a request for the server's memory and time, not for tokens
MOST_LATENCY_MS = 60_000  # the longest forward a latency twin or a simulation is given (a minute: none takes longer)
LEAST_LATENCY_MS = 1e-6  # the shortest (a nanosecond: none is shorter; below it, ratios of latencies overflow)
LATENCY_RANGE = f"[{LEAST_LATENCY_MS:g}, {MOST_LATENCY_MS}] ms"  # (as refusals say it)


def latency_fits(ms: float) -> bool:
    """Whether a forward's latency (ms) lies from LEAST_LATENCY_MS to MOST_LATENCY_MS."""
    return LEAST_LATENCY_MS <= ms <= MOST_LATENCY_MS


REQUEST_ITEMS = 8  # the most items a server's client may give a list option (drafter levels, tree widths, K rows)
REQUEST_NODES = 128  # the most nodes a server's client's draft tree may have (depth x width): its verification is one
# forward that the other requests' streams wait on, so no wider than a long prompt's part (lean's SERVED_PART)


def option(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that also describes its command-line flag, bench-spec key and request field. `operator=True`
    marks an option that names something on the machine (a file, a device, an executor, an address, how many
    processes or threads to start, how a model loads): the operator's, set on the command line, never by a
    server's client (`methods.registry.request_options`); `most=N`, the largest value a client may give it."""
    return field(default=default, metadata={"help": help, **extra})


VERIFIERS = ("block", "token")


MIN_TEMPERATURE = 1e-3  # below it (but above 0) sampling is greedy decoding in all but name: ask for temperature 0


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = option(0.0, "sampling temperature; 0 means greedy (argmax)")
    top_k: int | None = option(None, "sample only among the k most likely tokens")
    top_p: float | None = option(None, "sample only from the smallest set of tokens with this total probability")
    verifier: str = option("block", "how a sampled draft chain is verified (sd, cascade, auto's chains; tree verifies "
                           "by multi-draft sampling, dsi token by token): block (Sun et al. 2024: the chain judged "
                           "as a whole, as many accepted tokens or more) or token (token by token); both emit the "
                           "target's distribution", choices=VERIFIERS)

    def __post_init__(self) -> None:
        if self.verifier not in VERIFIERS:
            raise ConfigError(f"verifier must be one of {', '.join(VERIFIERS)}, got {self.verifier!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SAMPLED_ONLY = ("top_k", "top_p", "verifier", "seed")  # settings that do nothing at temperature 0


def sampling_of(saved: dict[str, Any]) -> SamplingConfig:
    """The SamplingConfig a run's saved settings hold (a bench's config, an isolated generation's request), by field
    name; a field absent or None at its default."""
    return SamplingConfig(**{f.name: saved[f.name] for f in fields(SamplingConfig) if saved.get(f.name) is not None})


def check_sampled(sampling: SamplingConfig, given: Iterable[str], spell: Callable[[str], str] = str,
                  where: str = "") -> None:
    """Refuse settings given for sampling (`SAMPLED_ONLY`) where `sampling` is greedy: they would do nothing."""
    if sampling.greedy and (names := [spell(name) for name in SAMPLED_ONLY if name in given]):
        raise ConfigError(f"{', '.join(names)}{where} appl{'y' if len(names) > 1 else 'ies'} when sampling: give a "
                          "temperature above 0")


SEEDS = range(-(1 << 63), 1 << 64)  # what a torch.Generator takes


@dataclass(frozen=True)
class RunConfig:
    """What bounds one generation, whatever the method."""

    max_new_tokens: int = option(128, "stop after this many new tokens")
    seed: int | None = option(None, "seed of the one random generator (sampling only: a named method repeats its "
                                     "output under one seed, but for auto and a tree whose choices follow measured "
                                     "times (an auto size or verify width, a target profile, a depth predictor: "
                                     "train-depth's is read by default), and dsi, whose drafts arrive as its drafter "
                                     "threads and servers run: theirs may differ, their distribution never)")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and self.seed not in SEEDS:
            raise ConfigError(f"seed must be a 64-bit integer (from {SEEDS.start} to {SEEDS.stop - 1}), got {self.seed}")


@dataclass(frozen=True)
class ModelConfig:
    dtype: str = option(AUTO, "weight dtype: auto (the fastest exact path this device has), bf16 or fp32",
                        choices=DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    backend: str = option(AUTO, "auto (catalog/GGUF models run as stored on the CPU: on lean where its kernels read "
                                "them, else on llama.cpp where it is built; a catalog model with --dtype, @int8/@int4 "
                                "or on a GPU, on transformers; `serve` takes transformers on AMX CPUs too, where a "
                                "batch of rows costs about one row), hf (transformers), llamacpp, lean (GGUFs on "
                                "speculant's exact kernels: Q4_0-Q8_0, Q4_K/Q5_K/Q6_K, F16/BF16/F32) or static (torch "
                                "kernels, a static cache: the GPU's fast path)",
                        choices=(AUTO, *BACKENDS))
    compile: bool = option(False, "static backend: compile its step with torch.compile and, on a GPU, replay it as "
                                  "a CUDA graph")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        if self.backend not in (AUTO, *BACKENDS):
            raise ConfigError(f"unknown backend '{self.backend}' (choose from auto, {', '.join(BACKENDS)})")
        if self.compile and self.backend != "static":
            raise ConfigError("--compile compiles the static backend's step: add --backend static")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):  # (whether it is there: when the model loads)
            raise ConfigError(f"unknown device '{self.device}' (use cpu, cuda or cuda:N)")


MIN_BODY_MB = 0.001  # the smallest limit on a request's body (1 kB: a short request's JSON)


@dataclass(frozen=True)
class ServeConfig:
    """`speculant serve`: where it listens and how many requests it takes at once."""

    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = option(8000, "TCP port")
    api_key: str | None = option(None, f"require 'Authorization: Bearer KEY' (401 otherwise; default: ${API_KEY_ENV} "
                                 "where set, which, unlike a flag, other users' `ps` does not show)")
    served_name: str | None = option(None, "the model name clients send (default: the target's name)")
    max_batch: int = option(16, "requests decoded together, their forwards batched (1: one request at a time)")
    max_queue: int = option(64, "requests waiting for a batch slot; more are answered 429")
    prefix_cache_mb: float = option(1024.0, "memory for the KV of earlier prompts, reused by requests that share "
                                    "their prefix (a conversation's history; 0: off; lean and transformers backends)")
    max_body_mb: float = option(4.0, "largest request body taken, in MB (413 beyond it, before it is read)")
    open_metrics: bool = option(False, "with --api-key: let /metrics answer without the key (a scraper's)")
    docs: bool = option(False, "serve the API's generated pages (/docs, /redoc, /openapi.json)")
    allowed_hosts: str | None = option(None, "answer only requests whose Host header, its port aside, is one of "
                                             "these, comma separated (e.g. localhost,api.example.com,[::1]; "
                                             "default: any)")
    replicas: int = option(1, "serve from this many processes, each with its own models, as a Ray Serve "
                              "deployment behind one port (pip install 'speculant[ray]'); each counts its own "
                              "/metrics")
    replica_cpus: float = option(1.0, "CPU cores Ray reserves for each replica (its kernels' threads)")
    ray_cluster: str | None = option(None, "deploy the replicas on the Ray cluster at this address (default, "
                                           "or local: start one here)")

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must lie in [1, 65535], got {self.port}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.prefix_cache_mb < math.inf:
            raise ConfigError(f"prefix_cache_mb must be a number >= 0, got {self.prefix_cache_mb}")
        if not MIN_BODY_MB <= self.max_body_mb < math.inf:
            raise ConfigError(f"max_body_mb must be a number >= {MIN_BODY_MB} (a request's body), got "
                              f"{self.max_body_mb}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if not 0 < self.replica_cpus < math.inf:
            raise ConfigError(f"replica_cpus must be a number > 0, got {self.replica_cpus}")
        for name in ("api_key", "served_name", "allowed_hosts", "ray_cluster"):  # (empty: a key anyone sends, a name no one, any host)
            value = getattr(self, name)
            parts = value.split(",") if name == "allowed_hosts" and value is not None else [value]
            if value is not None and not all(part.strip() for part in parts):
                raise ConfigError(f"{flag(name)}{f' (or ${API_KEY_ENV})' if name == 'api_key' else ''} has an empty "
                                  "value: give one, or leave the flag out")
        if self.api_key is not None and not sendable_key(self.api_key):
            raise ConfigError(f"--api-key (or ${API_KEY_ENV}) must be printable ASCII without spaces: a client sends "
                              "it in an HTTP header")
        for host in self.allowed_hosts.split(",") if self.allowed_hosts else ():
            if not re.fullmatch(r"\[[0-9A-Za-z:.%_-]+\]|[0-9A-Za-z._-]+", host.strip()):  # (a Host header's port is
                # not compared; a name with any other character is none a Host header holds: nothing would be served)
                raise ConfigError(f"--allowed-hosts names hosts without a port (letters, digits, '.', '-', '_'; an "
                                  f"IPv6 address in brackets, as [::1]), got '{host.strip()}'")
        check_ray_address(self.ray_cluster, "--ray-cluster")
        if self.open_metrics and self.api_key is None:
            raise ConfigError("--open-metrics opens /metrics to callers without the --api-key: give one")

    @property
    def on_ray(self) -> bool:
        """Served as a Ray Serve deployment (several replicas, or a cluster named)."""
        return self.replicas > 1 or self.ray_cluster is not None

    @property
    def own_ray(self) -> bool:
        """The replicas run on a Ray cluster this process starts (no `--ray-cluster`, or `local`): its CPUs are this
        machine's, and it ends with the process."""
        return self.ray_cluster in (None, "local")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


RAY_ADDRESS = re.compile(r"(ray://)?([^\s:/\[\]]+|\[[0-9a-fA-F:.]+\]):(\d{1,5})")  # a cluster's GCS, or its client


def sendable_key(key: str) -> bool:
    """Whether an API key can go in an HTTP header as a bearer token: printable ASCII, no spaces."""
    return all(" " < char < "\x7f" for char in key)


def check_ray_address(address: str | None, name: str) -> None:
    """Refuse an address `ray.init` cannot take (it raises deep inside Ray, or retries for minutes)."""
    if address is None or address in ("auto", "local"):
        return
    found = RAY_ADDRESS.fullmatch(address)
    if found is None or not 0 < int(found[3]) < 65536:
        raise ConfigError(f"{name} {address!r} is no Ray cluster's address: HOST:PORT, ray://HOST:PORT or auto")


def reach_ray(address: str | None, name: str, timeout_s: float = 5.0) -> None:
    """A ConfigError where nothing answers at a HOST:PORT address, or something that speaks no gRPC (a web server):
    `ray.init` would retry for minutes first. A Ray cluster's GCS and its client server are gRPC servers, which
    answer HTTP/2's connection preface with a SETTINGS frame (RFC 9113 section 3.4); a TLS cluster (RAY_USE_TLS)
    is only reached."""
    found = RAY_ADDRESS.fullmatch(address or "")
    if found is None:
        return
    import socket

    try:
        with socket.create_connection((found[2].strip("[]"), int(found[3])), timeout=timeout_s) as connection:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("0", "false", ""):
                connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
                head = connection.recv(9)
                if len(head) < 4 or head[3] != 4:  # a frame's type is its 4th byte; 4 is SETTINGS
                    raise ConfigError(f"{name}: what answers at {address} is no Ray cluster (it speaks no gRPC)")
    except OSError as error:
        raise ConfigError(f"{name}: no Ray cluster answers at {address} ({error.strerror or error})") from None


@functools.cache
def field_kinds(options: type) -> dict[str, tuple[Any, ...]]:
    """Each field of the dataclass `options` by name: its types (`hinted`), read once per class."""
    return {f.name: hinted(f) for f in fields(options)}


def hinted(f: Field) -> tuple[Any, ...]:
    """A field's types: `int | None` -> (int, NoneType); `float` -> (float,) (annotations are strings under postponed
    evaluation)."""
    hint = eval(f.type, vars(typing)) if isinstance(f.type, str) else f.type  # noqa: S307
    return hint.__args__ if isinstance(hint, types.UnionType) else (hint,)


def scalar_type(f: Field) -> type:
    """`int | None` -> int; `float` -> float."""
    hint = next(arg for arg in hinted(f) if arg is not type(None))
    return hint if hint in (int, float, str, bool) else str


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_value(f: Field, text: str) -> Any:
    """A field's value from text (a flag, a bench spec); an OptionError names the field on bad text."""
    parse = f.metadata.get("parse") or {int: integer, float: number}.get(scalar_type(f), scalar_type(f))
    try:
        value = parse_bool(text) if parse is bool else parse(text)
    except OptionError:
        raise
    except ConfigError as error:  # (a field's own parser: its message names the field)
        raise OptionError(f.name, str(error)) from None
    except (ValueError, TypeError):
        raise OptionError(f.name, f"bad value '{text}' for {f.name}" + (": on or off" if parse is bool else "")
                          ) from None
    if isinstance(value, float) and math.isnan(value):
        raise OptionError(f.name, f"bad value '{text}' for {f.name}: not a number")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise OptionError(f.name, f"{f.name} must be one of {', '.join(map(str, choices))}, got '{text}'")
    return value


def default_of(f: Field) -> Any:
    return None if f.default is MISSING else f.default


class Given(argparse.Action):
    """argparse's store (`store_const` with nargs=0: a switch), which also records the flag in `namespace.given` where
    the command line gives it (a default records nothing): what a flag that applies only with another is checked by
    (the CLI's `needs`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        record_given(namespace, self.dest)


class GivenSwitch(argparse.BooleanOptionalAction):
    """A `--name` / `--no-name` switch that records the flag in `namespace.given`, as `Given` does."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        record_given(namespace, self.dest)


def record_given(namespace: argparse.Namespace, dest: str) -> None:
    """Record that the command line gave the flag of `dest`."""
    namespace.given = getattr(namespace, "given", frozenset()) | {dest}


def add_options(parser: argparse.ArgumentParser, config: type, **overrides: Any) -> None:
    """Add one `--flag` per field of a config dataclass; `overrides` replace defaults."""
    for f in fields(config):
        default = overrides.get(f.name, default_of(f))
        if scalar_type(f) is bool:  # a switch: --name / --no-name
            parser.add_argument(flag(f.name), dest=f.name, action=GivenSwitch, default=default,
                                help=f"{f.metadata.get('help', '')} (default: {'on' if default else 'off'})")
            continue
        parser.add_argument(flag(f.name), dest=f.name, type=functools.partial(parse_flag, f), default=default,
                            action=Given, metavar=f.name.upper(), help=with_default(f.metadata.get("help", ""), default))


def with_default(help: str, default: Any) -> str:
    """A flag's help ending in "(default: X)", unless it already says what the default is, or the default is None
    (what then happens is the help's to say)."""
    if default is None or "(default:" in help or "; default:" in help:
        return help
    if isinstance(default, bool):
        return f"{help} (on or off; default: {'on' if default else 'off'})"
    return f"{help} (default: {','.join(map(str, default)) or 'none' if isinstance(default, tuple) else default})"


def parse_flag(f: Field, text: str) -> Any:
    """`parse_value` for argparse, whose message then says what is wrong (not "invalid <lambda> value")."""
    try:
        return parse_value(f, text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def from_args(config: type[T], args: argparse.Namespace) -> T:
    """Build a config dataclass from parsed options (validation happens in the dataclass; its refusal names flags)."""
    return from_flags(lambda: config(**{f.name: getattr(args, f.name) for f in fields(config)}),
                      [f.name for f in fields(config)])


OPTION = re.compile(r"(?<![\w-])[a-z][a-z0-9]*(_[a-z0-9]+)*(?![\w-])")  # a word, or a name like k_max
QUOTED = ("option '", "give '", " or '", "use '")  # how messages quote an option's name: "option 'k'", "give 'k' or"


def from_flags(make: Callable[[], T], names: Collection[str]) -> T:
    """`make()`, whose options `names` came from the command line's flags: a refusal names them as flags. A message
    names an option as Python callers and the server's clients give it (`k_max`); here `--k-max` where the name opens
    it ('k must be >= 1', 'tree_widths applies to ...'; a word alone: only before "must"), is quoted as an option
    ("option 'k'", "give 'k' or 'k_matrix'"; not a value: "bad value 'depth'") or follows "for" as the option refused
    ("bad value 'x' for tree_widths"); not in prose ('the drafter's vocabulary'), a path or a list of what a method
    takes."""
    try:
        return make()
    except ConfigError as error:
        message, option = str(error), getattr(error, "option", None)

        def named(found: re.Match) -> str:
            word, before, after = found[0], message[:found.start()], message[found.end():]
            opens = not before and after.startswith(" must " if "_" not in word else " ")
            quoted = before.endswith(QUOTED) and after.startswith("'")  # (an option named so; not a value quoted)
            spelled = opens or quoted or word == option and before.endswith("for ")
            return flag(word) if spelled and word in names else word

        raise ConfigError(OPTION.sub(named, message)) from None
