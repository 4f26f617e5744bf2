"""The model cache: complete caches are reused, partial or corrupt ones rebuilt, never half-written."""

import pytest

from speculant.errors import ModelNotAvailable
from speculant.models import catalog


def writer(calls):
    def build(tmp):
        calls.append(tmp)
        (tmp / "model.safetensors").write_bytes(b"x" * 100)
        (tmp / "config.json").write_text("{}")
    return build


def test_build_once_then_reuse(tmp_path):
    calls = []
    target = tmp_path / "m-bf16"
    assert catalog.build_atomically(target, writer(calls)) == target
    assert catalog.is_complete(target)
    catalog.build_atomically(target, writer(calls))
    assert len(calls) == 1


def test_truncated_file_is_detected_and_rebuilt(tmp_path):
    calls = []
    target = tmp_path / "m-bf16"
    catalog.build_atomically(target, writer(calls))
    (target / "model.safetensors").write_bytes(b"x" * 10)  # truncated
    assert not catalog.is_complete(target)
    catalog.build_atomically(target, writer(calls))
    assert len(calls) == 2 and (target / "model.safetensors").stat().st_size == 100


def test_directory_without_manifest_is_rebuilt(tmp_path):
    calls = []
    target = tmp_path / "m-bf16"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"partial")
    catalog.build_atomically(target, writer(calls))
    assert len(calls) == 1 and catalog.is_complete(target)


def test_failed_build_leaves_nothing_behind(tmp_path):
    target = tmp_path / "m-bf16"

    def broken(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        catalog.build_atomically(target, broken)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_missing_part_names_the_install_command():
    entry = catalog.CatalogEntry("x", "x", (("speculant_absent_module", "data/part01.bin"),), "pip install absent==1")
    with pytest.raises(ModelNotAvailable, match="pip install absent==1"):
        entry.part_paths()


def test_catalog_lists_the_design_models():
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= set(catalog.CATALOG)
    assert len(catalog.CATALOG["qwen2.5-coder-1.5b"].parts) == 22
    assert len(catalog.CATALOG["qwen2.5-coder-0.5b"].parts) == 6
