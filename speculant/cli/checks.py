"""What every command checks before it loads a model: files it reads and writes, flags that need another, a target
and its options, an address to listen on."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from speculant.cache import cache_root, exists, is_dir, is_file
from speculant.cli.parser import DIRECTORY, FILE
from speculant.config import ModelConfig, flag
from speculant.errors import ConfigError


def resolve_method(method: str | None, given: dict[str, str]) -> str:
    """The method to run: `--method`, else ar for `--drafter none`, else as `generate()` decides."""
    from speculant.api import method_for

    if given.get("drafter") == "none":
        del given["drafter"]
        if method not in (None, "ar"):
            raise ConfigError(f"method '{method}' needs a drafter, but --drafter is none")
        return "ar"
    return method_for(method, given)


def check_target(target: str, config: ModelConfig, options: Any, backend: str | None = None,
                 dtype: str | None = None) -> str:
    """The backend the target will load on; refuse, before it loads, a backend its name refuses (`@gguf` off
    llama.cpp, a .gguf file on transformers), a model drafter's suffix its weights refuse as well, and `options` its
    backend cannot run (`methods.drafting.needs`): DSI where the backend makes no replicas, `self@skip` off the lean
    backend. `backend` and `dtype`: a bench method's own."""
    from speculant.drafters.spec import MODEL, DrafterSpec
    from speculant.methods.drafting import elsewhere, held_drafters, needs, unmet
    from speculant.models import split_quant
    from speculant.models.backends import capabilities_of
    from speculant.models.loading import check_gguf_dtype, resolve_backend

    name, quant = split_quant(target)  # (a backend the target's name or suffix refuses is refused here too)
    backend = resolve_backend(backend or config.backend, name, quant, config.device, dtype or config.dtype)
    check_gguf_dtype(target, backend, dtype or config.dtype)
    for drafter in held_drafters(options) if options is not None else ():
        if isinstance(drafter, DrafterSpec) and drafter.kind == MODEL and (suffix := drafter.quant or drafter.backend):
            try:  # (@gguf or @lean of transformers weights, @int8 of a GGUF's: as its load would refuse it)
                resolve_backend(None, drafter.source, suffix, None, None)
            except ConfigError as error:
                raise ConfigError(f"drafter {drafter}: {error}") from None
    if needs(options):
        if need := unmet(options, capabilities_of(backend)):
            raise ConfigError(f"{need[1]}: the {backend} backend does not offer that "
                              f"({elsewhere(options, 'load the target with --backend {}')})")
    return backend


def check_listen(host: str, port: int) -> None:
    """Refuse, before any model loads, an address this process cannot listen on (a port in use, a host that is not
    this machine's)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a listener still refuses
            probe.bind(address)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output path that cannot be written: a directory's path taken by a file, a
    file's path taken by a directory or within a directory that does not exist (where the command does not make it),
    or a place where nothing can be written (`check_writable`), or among what speculant builds in its cache (a file
    written there replaced a cached model's)."""
    written = []  # the files it writes (where one is a file it reads, that is refused)
    for name in ("out", "timeline"):
        if getattr(args, name, None) is None:
            continue
        where, cache = Path(getattr(args, name)).resolve(), cache_root().resolve()
        if built := next((cache / part for part in BUILT_IN_CACHE if where.is_relative_to(cache / part)), None):
            raise ConfigError(f"--{name} {getattr(args, name)} is in {built}, where speculant keeps what it builds "
                              "and loads (models, repacks, kernels): write elsewhere")
        try:
            check_output(Path(getattr(args, name)), args.out_kind if name == "out" else FILE, name)
        except OSError as error:  # (a name the system cannot hold, as one too long)
            raise ConfigError(f"--{name} {getattr(args, name)}: {error.strerror or error}") from None
        written += [(Path(getattr(args, name)), name)] if name == "timeline" or args.out_kind != DIRECTORY else []
    for path in companions(args):
        check_output(path, args.out_kind, "out")
        written.append((path, "out"))
    if getattr(args, "out", None) and args.out_kind == DIRECTORY:  # (one of its files there already, or a directory
        for path in (Path(args.out) / name for name in written_in(args)):  # in its place: checked as a file --out
            if path.exists():  # names, before the work)
                check_output(path, FILE, "out")
                written.append((path, "out"))
    reads = read_files(args) if written else []  # (a dataset's files: bench.datasets, torch, only where one is written)
    for path, name in written:
        if not is_file(path):
            continue
        if read := next((named for named, given in reads if is_file(given) and path.samefile(given)), None):
            raise ConfigError(f"--{name} {path} is the file {read} reads: it would be written over")
        if read := next((named for named, given in reads if path.resolve().is_relative_to(given.resolve())), None):
            raise ConfigError(f"--{name} {path} is a file of the model {read} reads: it would be written over")


BUILT_IN_CACHE = ("models", "lean", "kernels", "llamacpp", "tokenizers", "bigram", "frequency")  # its cache's folders
# of what it builds and loads (not `machine`: profiles and predictors, which `profile` and `train-depth` write)

# The flags that name files a command reads: datasets, models (a file, or a folder of them), and the others (not
# bench's --report-from: a run is reported again in place, its rows read whole before they are written)
DATASET_FLAGS = ("prompts", "dataset")
MODEL_FLAGS = ("model", "target", "drafter", "drafters")
READ_FLAGS = ("json_schema", "grammar", "target_profile", "drafter_profile", "bigram_corpus")


def read_files(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(flag, path) for each existing file a command's flags name to read (a dataset's parts too), and each model
    folder (a model named with a suffix, `path@int8`, is its path's)."""
    found = []
    for name in (*DATASET_FLAGS, *MODEL_FLAGS, *READ_FLAGS):
        given = getattr(args, name, None)
        for value in given if isinstance(given, list) else [given] if isinstance(given, str) else []:
            if name in DATASET_FLAGS:  # (imported where a dataset is named: `simulate` runs without torch)
                from speculant.bench.datasets import dataset_files

                found += [(flag(name), path) for path in dataset_files(value)]  # (files only)
                continue
            for named in value.split(",") if name == "drafters" else [value]:
                path = Path(named) if name not in MODEL_FLAGS or exists(Path(named)) else \
                    Path(named.rpartition("@")[0] or named)
                if is_file(path) or name in MODEL_FLAGS and is_dir(path):
                    found.append((flag(name), path))
    return found


def written_in(args: argparse.Namespace) -> tuple[str, ...]:
    """The files a command whose --out names a directory writes there."""
    if args.command == "bench":
        from speculant.bench.report import PLOTS

        return ("results.json", "report.md", *PLOTS)
    if args.command == "bench-serve":
        from speculant.bench.serve import PLOT, REPORT, RESULTS

        return RESULTS, REPORT, PLOT
    from speculant.analysis.commands import HEATMAP_FILES

    return HEATMAP_FILES


def companions(args: argparse.Namespace) -> list[Path]:
    """The files a command writes beside --out's: a profiled drafter's, train-depth's predictor of each input kind
    where it trains several."""
    if not getattr(args, "out", None):
        return []
    if args.command == "profile" and args.drafter:
        return [drafter_profile_path(Path(args.out))]
    if args.command == "train-depth":
        kinds = list(dict.fromkeys(args.inputs or []))
        return [predictor_out(Path(args.out), kind, len(kinds)) for kind in kinds] if len(kinds) > 1 else []
    return []


def drafter_profile_path(out: Path) -> Path:
    """Where `profile --out OUT --drafter` writes the drafter's profile."""
    return out.with_suffix(".drafter.json")


def predictor_out(out: Path, kind: str, kinds: int) -> Path:
    """Where `train-depth --out OUT` writes the predictor of inputs `kind`, one of `kinds` it trains."""
    return out if kinds == 1 else out.with_name(f"{out.stem}-{kind}.json")


def check_output(path: Path, kind: str, name: str) -> None:
    """`check_outputs` for one path that --`name` writes, a FILE or a DIRECTORY."""
    if kind == DIRECTORY:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--{name} {path} is a file: it names a directory here")
    elif path.is_dir():
        raise ConfigError(f"--{name} {path} is a directory: it names a file here")
    if path.is_file() and not os.access(path, os.W_OK):  # (a file there already: written over in place)
        raise ConfigError(f"--{name} {path} cannot be written over (this process may not write it)")
    if not path.is_file():
        check_writable(path, kind, name)
    if name == "timeline":
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = path.suffix.lstrip(".").lower()  # (none: matplotlib's png)
        if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():
            raise ConfigError(f"--timeline {path}: '{suffix}' is no image format matplotlib writes (png, svg, pdf, "
                              "...)")


def check_writable(path: Path, kind: str, name: str) -> None:
    """Refuse a new output `path` where nothing can be made: under a file, in a directory that does not exist (a
    FILE's is not made), or in one that takes no file (/proc, no permission)."""
    import tempfile

    base = path if kind == DIRECTORY else path.parent  # where the command writes (and makes what is missing)
    while not base.exists() and kind != FILE:
        base = base.parent
    if base.exists() and not base.is_dir():
        raise ConfigError(f"--{name} {path}: {base} is a file, not a directory")
    if not base.is_dir():
        raise ConfigError(f"--{name} {path}: the directory {base} does not exist")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as error:
        raise ConfigError(f"--{name} {path}: nothing can be written in {base} ({error.strerror})") from None


def check_needs(args: argparse.Namespace) -> None:
    """Refuse, before any work, a flag given where it does nothing: its command's `needs` name the flag (or flag=value)
    it applies with."""
    for name, needed in args.needs.items():
        other, _, value = needed.partition("=")
        if name in args.given and (getattr(args, other) != value if value else not getattr(args, other)):
            raise ConfigError(f"{flag(name)} applies with {flag(other)}{' ' + value if value else ''} only")

