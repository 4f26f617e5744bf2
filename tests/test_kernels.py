"""speculant's kernels: the repack keeps GGUF's weights (K-quants, the blocks of 32 of Q4_0 to Q8_0, and
F16/BF16/F32), and on every ISA path this machine has (and the AMX kernels emulated where the CPU lacks AMX), row r
of a W-row call equals the 1-row call and the scalar reference bit for bit."""

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from speculant import kernels
from speculant.kernels import formats
from speculant.machine import cpu_has

GGML = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_k": gguf.GGMLQuantizationType.Q5_K,
        "q6_k": gguf.GGMLQuantizationType.Q6_K}
K_QUANTS = tuple(GGML)
BLOCKS32 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FLOATS = ("F16", "BF16", "F32")
D_OFFSETS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # where each super-block's f16 scales lie in the file


def random_tensor(kind: str, outputs: int, supers: int, seed: int) -> np.ndarray:
    """GGUF bytes of a random K-quant tensor with scales of a real model's size."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(outputs, supers * formats.GGUF_BYTES[kind]), dtype=np.uint8)
    blocks = raw.reshape(outputs, supers, -1)
    for offset in D_OFFSETS[kind]:
        d = rng.uniform(1e-4, 2e-2, size=(outputs, supers)).astype(np.float16)
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(outputs, supers, 2)
    return raw


@pytest.mark.parametrize("kind", K_QUANTS)
def test_the_repack_keeps_ggml_s_weights(kind):
    raw = random_tensor(kind, 32, 3, seed=0)
    np.testing.assert_array_equal(formats.dequantize(kind, raw), gguf.quants.dequantize(raw, GGML[kind]))


def test_every_path_the_cpu_can_run_compiles_and_loads():
    """A path that fails to build would fall back, silently, to a slower one; AMX is chosen where its tiles pay."""
    runs = [isa.name for isa in kernels.ISAS if cpu_has(*isa.cpu_flags)]
    assert [isa for isa in kernels.paths(emulated=True) if isa != "amx_int8_emulated"] == runs
    amx_pays = "amx_int8" in runs and all(rows := kernels.amx_rows("amx_int8")) and min(rows) <= 16  # (some kind's)
    assert kernels.paths() == [isa for isa in runs if isa != "amx_int8" or amx_pays]
    assert kernels.paths()[-1] == "scalar"


EMULATES = pytest.mark.skipif(kernels.library("amx_int8_emulated") is None, reason="no AVX-512 VNNI to emulate AMX on")
# The real tiles where the CPU has them, run in this process: a fault here fails the suite (the user's process is
# guarded by `amx_rows`'s child).
AMX_PATHS = [isa for isa in ("amx_int8", "amx_int8_emulated") if kernels.library(isa) is not None]


@EMULATES
def test_an_amx_path_is_checked_and_timed_in_a_child_process_before_it_is_chosen(monkeypatch, caplog):
    """`amx_rows` runs `check` and each kind's `cut_over` in a child (here on the emulated tiles: exact, and
    slower than vpdpbusd at every width), remembered per library build and CPU; a child that fails gives zeros, with
    a warning; `usable` lists the path only where the tiles pay at some width for some kind, and sets the library's
    cut-over of each kind."""
    asked = []
    monkeypatch.setattr(kernels, "remembered", lambda name, key, measure: asked.append(key) or measure())
    assert kernels.amx_rows.__wrapped__("amx_int8_emulated") == (17, 17) and "|" in asked[0]
    monkeypatch.setattr(kernels.sys, "executable", "false")
    assert kernels.amx_rows.__wrapped__("amx_int8_emulated") == (0, 0)
    assert "amx_int8_emulated kernels failed their check (exit 1" in caplog.text
    for rows, listed in (((0, 0), False), ((17, 17), False), ((0, 6), False), ((17, 6), True)):
        monkeypatch.setattr(kernels, "amx_rows", lambda name, rows=rows: rows)
        assert kernels.usable(kernels.EMULATED) == listed
    assert kernels.set_amx_rows("amx_int8_emulated", (4, 4)) == (17, 6)  # the tests' tile height again


@EMULATES
def test_an_amx_check_whose_child_hangs_or_cannot_start_fails_the_path_not_the_process(tmp_path, monkeypatch, caplog):
    """A child that gives no answer in time (or cannot be started) fails the check: a warning, zeros remembered like a
    failed check's, and nothing raised into the user's process."""
    import subprocess

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    started, run = [], subprocess.run

    def hung(args, **kw):
        started.append(args)
        raise subprocess.TimeoutExpired(args, kw["timeout"])

    monkeypatch.setattr(kernels.subprocess, "run", hung)
    assert kernels.amx_rows.__wrapped__("amx_int8_emulated") == (0, 0)
    assert kernels.amx_rows.__wrapped__("amx_int8_emulated") == (0, 0) and len(started) == 1  # remembered
    assert "amx_int8_emulated kernels failed their check (no answer in 300 s)" in caplog.text
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(kernels.sys, "executable", str(tmp_path / "no-python"))
    monkeypatch.setattr(kernels.subprocess, "run", run)
    assert kernels.amx_rows.__wrapped__("amx_int8_emulated") == (0, 0)
    assert "No such file or directory" in caplog.text


@pytest.mark.parametrize("isa", AMX_PATHS)
@pytest.mark.parametrize("rows", [1, 17])
def test_the_amx_library_gives_the_reference_s_bits_at_any_cut_over(rows, isa):
    """Every row on tiles (1), or none (17: the library's vpdpbusd kernels, 8 rows at a time)."""
    before = kernels.set_amx_rows(isa, (rows, rows))
    try:
        kernels.check(isa)
    finally:
        kernels.set_amx_rows(isa, before)


@EMULATES
def test_the_cut_over_is_the_fewest_rows_from_which_tiles_win_at_every_width(monkeypatch):
    lib, setting, clock = kernels.library("amx_int8_emulated"), {0: [4], 1: [4]}, [0.0]

    def set_rows(kind, rows):  # as amx_set_rows: returns the value it replaces
        setting[kind][:] = [rows, *setting[kind]]
        return setting[kind].pop()

    def matmul(act, weight, isa):  # q6_k's tiles take half the time of vpdpbusd from 6 rows, and at 3
        assert weight.kind == "q6_k"
        clock[0] += 0.5 if setting[1][0] <= act.rows and act.rows in (3, *range(6, 17)) else 1.0

    monkeypatch.setattr(lib, "amx_set_rows", set_rows)
    monkeypatch.setattr(kernels, "matmul", matmul)
    monkeypatch.setattr(kernels, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert kernels.cut_over("amx_int8_emulated", "q6_k", repeats=3, panels=1) == 6
    assert setting == {0: [4], 1: [4]}  # put back as found
    monkeypatch.undo()
    for kind in kernels.AMX_KINDS:  # the emulated tiles: far slower
        assert kernels.cut_over("amx_int8_emulated", kind, repeats=5, panels=16) == 17
    assert kernels.set_amx_rows("amx_int8_emulated", (4, 4)) == (4, 4)


@pytest.mark.skipif("avx2" not in kernels.paths(), reason="no AVX2")
def test_the_check_finds_a_path_whose_wider_calls_differ(monkeypatch):
    matmul = kernels.matmul
    monkeypatch.setattr(kernels, "matmul", lambda act, weight, isa, threads=None: matmul(act, weight, isa, threads)
                        + (act.rows > 16 and isa != "scalar") * 1e-6)
    with pytest.raises(RuntimeError, match="avx2: rows of a 17-row q4_k call differ"):
        kernels.check("avx2")


@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize("isa", kernels.paths(emulated=True))
@pytest.mark.parametrize("inputs", [1280, 1152])  # 5 super-blocks; 4.5, the last half left out
def test_every_row_equals_its_one_row_call_and_the_scalar_reference(kind, isa, inputs):
    raw = random_tensor(kind, 48, 5, seed=1)
    weight = kernels.QuantWeight.from_gguf(kind.upper(), raw, inputs)
    assert weight.data.shape == (3, formats.panel_bytes(kind, inputs))
    x = torch.randn(19, inputs, generator=torch.Generator().manual_seed(2)) * 3
    x[4, 100] = 80.0  # an outlier, as LLM activations have
    reference = kernels.matmul(kernels.quantize_rows(x, "scalar"), weight, "scalar", threads=1)
    for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19):  # every tile height up to 8 (AVX2, AVX-512); AMX: 4 to 16
        rows = kernels.matmul(kernels.quantize_rows(x[:width], isa), weight, isa)
        assert torch.equal(rows, reference[:width]), (isa, width)
    dense = x @ torch.from_numpy(formats.dequantize(kind, raw)[:, :inputs]).T
    assert (reference - dense).norm() / dense.norm() < 0.02  # int8 activations, per 256
    if inputs % formats.SUPER:  # what the whole super-blocks give where the left-out inputs are zeros
        padded = torch.nn.functional.pad(x, (0, formats.SUPER - inputs % formats.SUPER))
        whole = kernels.QuantWeight.from_gguf(kind.upper(), raw)
        assert torch.equal(kernels.matmul(kernels.quantize_rows(padded, isa), whole, isa), reference)


LARGEST = {"q4_k": (slice(16, 144),), "q5_k": (slice(16, 176),), "q6_k": (slice(0, 192),)}  # every quant's bits
# set: 15, 31 and 63


@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize("isa", kernels.paths(emulated=True))
def test_the_largest_products_overflow_no_path(kind, isa):
    """Every weight at its largest quant times activations at +-127: where a path adds int16 partial sums
    before widening them (AVX2: eight pairs of q4_k's, four of q5_k's, two of q6_k's), these are the sums closest to
    int16's limit."""
    raw = random_tensor(kind, 16, 2, seed=4)
    blocks = raw.reshape(16, 2, -1)
    for quants in LARGEST[kind]:
        blocks[..., quants] = 0xFF
    weight = kernels.QuantWeight.from_gguf(kind.upper(), raw)
    x = torch.ones(6, 512)  # 6 rows: an AMX tile
    x[1] = -1.0
    x[2, ::64] = -1.0  # a sign change within some blocks
    x[3:] = -x[:3]
    rows = kernels.matmul(kernels.quantize_rows(x, isa), weight, isa)
    assert torch.equal(rows, kernels.matmul(kernels.quantize_rows(x, "scalar"), weight, "scalar", threads=1))
    dense = x @ torch.from_numpy(formats.dequantize(kind, raw)).T
    assert (rows - dense).norm() / dense.norm() < 0.02


@pytest.mark.parametrize("rows", [7, 40])  # 40 rows of 640 are enough super-blocks to be split among threads
@pytest.mark.parametrize("isa", kernels.paths())
def test_activations_quantize_the_same_on_every_path(isa, rows):
    x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(3))  # 2.5 super-blocks
    x[0, :256] = 0.0  # a super-block of zeros has scale 0
    x[1, 300] = 60.0  # an outlier coarsens its super-block's scale only
    ours, reference = kernels.quantize_rows(x, isa), kernels.quantize_rows(x, "scalar")
    one_by_one = [kernels.quantize_rows(x[r:r + 1], isa) for r in range(rows)]
    for field in ("quants", "scales", "sums32", "offsets16"):
        assert torch.equal(getattr(ours, field), getattr(reference, field))
        assert torch.equal(getattr(ours, field), torch.cat([getattr(act, field) for act in one_by_one]))
    supers = x.split(formats.SUPER, dim=1)
    scale = torch.stack([s.abs().amax(-1) for s in supers], 1) / 127  # ggml's Q8_K rule, rounding half to even
    assert torch.equal(reference.scales, scale)
    per_input = torch.cat([scale[:, i:i + 1].expand(-1, s.shape[1]) for i, s in enumerate(supers)], 1)
    assert torch.equal(reference.quants.float(), torch.round(x * torch.where(per_input > 0, 1 / per_input, 0)))
    assert torch.equal(reference.sums32, reference.quants.view(rows, -1, 32).sum(-1, dtype=torch.int16))
    assert torch.equal(reference.offsets16, -32 * reference.quants.view(rows, -1, 16).sum(-1, dtype=torch.int32))
    restored = reference.quants.float() * per_input
    assert (restored - x)[2:].abs().max() < 0.05


def test_a_mismatched_width_is_refused():
    weight = kernels.QuantWeight.from_gguf("Q4_K", random_tensor("q4_k", 16, 2, seed=4))
    with pytest.raises(ValueError, match="256 inputs for a weight of 512"):
        kernels.matmul(kernels.quantize_rows(torch.zeros(1, 256)), weight)
    with pytest.raises(ValueError, match="128 inputs do not fit 2 super-blocks"):
        kernels.QuantWeight.from_gguf("Q4_K", random_tensor("q4_k", 16, 2, seed=4), 128)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])  # (what a drafter's matrices and head become)
def test_a_drafter_s_weights_of_another_type_are_quantized_again_with_padded_inputs(kind):
    """Q8_0 weights with 96 inputs become `kind` blocks of 256 inputs, the last 160 zero, of which the kernels
    read the first 128; activations are padded alike, so the product is the de-quantized weights' up to the 4-
    or 6-bit rounding."""
    import gguf

    rng = np.random.default_rng(5)
    weights = rng.normal(size=(48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    again = formats.dequantize(kind, formats.requantize(kind, raw, "Q8_0"))
    assert again.shape == (48, 256) and not again[:, 96:].any()
    error = np.linalg.norm(again[:, :96] - weights) / np.linalg.norm(weights)
    assert error < (0.12 if kind == "q4_k" else 0.03)
    x = torch.from_numpy(rng.normal(size=(3, 96)).astype(np.float32))
    act = kernels.quantize_rows(x)
    assert act.quants.shape == (3, 128) and not act.quants[:, 96:].any()
    y = kernels.matmul(act, kernels.QuantWeight.from_gguf(kind.upper(), formats.requantize(kind, raw, "Q8_0"), 128))
    expected = x @ torch.from_numpy(again[:, :96]).T
    assert (y - expected).norm() / expected.norm() < 0.02


def quantized(ggml_type: str, weights: np.ndarray) -> np.ndarray:
    """GGUF data of `ggml_type` (gguf's own quantizers; Q5_K: formats.quantize_q5_k) as GGUFReader gives it."""
    if ggml_type == "Q5_K":
        return formats.quantize_q5_k(weights)
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[ggml_type])


@pytest.mark.parametrize("ggml_type", BLOCKS32)
def test_blocks_of_32_unpack_to_ggml_s_weights(ggml_type):
    """d * q + m, per block of 32, is ggml's de-quantized weight exactly."""
    raw = quantized(ggml_type, np.random.default_rng(6).normal(size=(16, 512)).astype(np.float32))
    q, d, m = formats.unpack_blocks32(ggml_type, raw)
    ours = (d[..., None] * q.reshape(16, -1, 32).astype(np.float32) + m[..., None]).reshape(16, -1)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]))


@pytest.mark.parametrize("ggml_type", BLOCKS32 + ("Q5_K",) + FLOATS)
@pytest.mark.parametrize("isa", kernels.paths(emulated=True))
def test_every_type_s_rows_equal_their_one_row_calls_and_the_scalar_reference(ggml_type, isa):
    """320 inputs (padded to 384: a last half super-block; Q5_K, as the file writes it: 512) and 40 outputs (padded
    to 48), from quantizers' output."""
    weights = np.random.default_rng(7).normal(size=(40, 512 if ggml_type == "Q5_K" else 320)).astype(np.float32)
    raw = quantized(ggml_type, weights)
    weight = kernels.QuantWeight.from_gguf(ggml_type, raw)
    assert weight.in_features == (512 if ggml_type == "Q5_K" else 384)
    x = torch.randn(19, weights.shape[1], generator=torch.Generator().manual_seed(2)) * 3
    x[4, 100] = 80.0
    reference = kernels.matmul(kernels.quantize_rows(x, "scalar"), weight, "scalar", threads=1)
    for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 19):  # every tile height up to 8
        assert torch.equal(kernels.matmul(kernels.quantize_rows(x[:width], isa), weight, isa), reference[:width])
    dense = x @ torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])).float().T
    assert (reference - dense).norm() / dense.norm() < (1e-6 if ggml_type in FLOATS else 0.02)


@pytest.mark.parametrize("isa", kernels.paths(emulated=True))
@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1", "Q5_1"])
def test_extreme_quants_overflow_no_path(isa, ggml_type):
    """Q8_0's quants of -128 and 127, Q4_1's of 15, Q5_1's of 31, times activations of +-127: AVX2 multiplies |q| (128
    at most) by signed bytes in int16 pairs (at most 2 * 128 * 127), and adds eight pairs of nibble products
    (8 * 2 * 15 * 127), four of five-bit ones (4 * 2 * 31 * 127), in int16 before widening them."""
    raw = quantized(ggml_type, np.ones((16, 512), dtype=np.float32))
    blocks = raw.reshape(16, -1, formats.BLOCK_BYTES[ggml_type])
    if ggml_type == "Q8_0":
        blocks[:8, :, 2:] = 0x80  # -128
        blocks[8:, :, 2:] = 0x7F
    else:
        blocks[:, :, 4:] = 0xFF  # every quant 15 (Q4_1) or 31 (Q5_1: its high bits, then its nibbles)
    weight = kernels.QuantWeight.from_gguf(ggml_type, raw)
    x = torch.ones(6, 512)
    x[1] = -1.0
    x[2, ::64] = -1.0
    x[3:] = -x[:3]
    rows = kernels.matmul(kernels.quantize_rows(x, isa), weight, isa)
    assert torch.equal(rows, kernels.matmul(kernels.quantize_rows(x, "scalar"), weight, "scalar", threads=1))
    dense = x @ torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])).T
    assert (rows - dense).norm() / dense.norm() < 0.02


def test_an_arm_cpu_is_named_by_its_implementer_and_part(tmp_path, monkeypatch):
    """Linux on Arm writes no `model name` in /proc/cpuinfo: every Arm CPU was "aarch64", so machine profiles kept
    per CPU model could not tell two apart in a shared cache; its `Features` are its flags."""
    from speculant import machine

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\n"
                    "CPU part\t: 0xd40\n\nprocessor\t: 1\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n")
    monkeypatch.setattr(machine, "Path", lambda _: info)
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(machine, "cpu_info", machine.cpu_info.__wrapped__)  # (this machine's is cached)
    assert machine.cpu_info() == ("aarch64 implementer 0x41 part 0xd40", frozenset({"fp", "asimd", "sve", "bf16"}))


def test_without_a_working_c_compiler_the_kernels_say_so_in_one_line(tmp_path, monkeypatch, caplog):
    """A compiler that fails: each library's failure is logged once with the compiler's last line of error, no path
    is listed, `auto` routes elsewhere, and the kernels' dispatcher raises one ConfigError line (not an IndexError)."""
    from functools import cache

    from speculant.errors import ConfigError
    from speculant.kernels.build import compile_library
    from speculant.models.loading import _simd_kernels

    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'In file included from x.c:1:' >&2\necho 'fatal error: omp.h: missing' >&2\n"
                        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "library", cache(kernels.library.__wrapped__))  # (this process's are cached)
    monkeypatch.setattr(kernels, "best", kernels.best.__wrapped__)
    assert kernels.paths() == [] and not _simd_kernels()
    with pytest.raises(ConfigError, match=r"^speculant's kernels need a C compiler with OpenMP \(gcc\): fatal error: "
                                          r"omp.h: missing$"):
        kernels.build()
    assert compile_library(kernels.Path(kernels.__file__).with_name("scalar.c"), kernels.FLAGS) is None
    warnings = [r.getMessage() for r in caplog.records if "scalar.c" in r.getMessage()]
    assert warnings == ["speculant: scalar.c with -fno-trapping-math did not build (fatal error: omp.h: missing); its "
                        "kernels will not be used"]


def test_threads_that_first_build_a_library_at_once_all_load_it(tmp_path, monkeypatch):
    """Each build writes a temporary file of its own, and one build runs at a time: no thread loads another's
    half-written library or loses its temporary file to another's rename."""
    import subprocess
    import threading
    import time

    from speculant.kernels.build import compile_library

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    run = subprocess.run

    def slow_run(*args, **kw):  # builds that overlap, each finishing before any renames its file into place
        time.sleep(0.2)
        done = run(*args, **kw)
        time.sleep(0.3)
        return done

    monkeypatch.setattr(subprocess, "run", slow_run)
    source, barrier, loaded = kernels.Path(kernels.__file__).with_name("scalar.c"), threading.Barrier(3), []

    def first_use():
        barrier.wait()
        loaded.append(compile_library(source, kernels.FLAGS))

    threads = [threading.Thread(target=first_use) for _ in range(3)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    assert len(loaded) == 3 and None not in loaded
    assert [path.name for path in (tmp_path / "kernels").iterdir()] == [kernels.Path(loaded[0]._name).name]


def test_a_build_removes_the_source_s_libraries_no_process_loaded_for_weeks(tmp_path, monkeypatch):
    """Libraries of earlier bytes or flags of the source (an upgrade's, an edit's): the one unused for weeks goes when
    another is built, the one loaded since stays, and so do other sources' and what is not a library."""
    import os
    import time

    from speculant.cache import UNUSED_DAYS
    from speculant.kernels.build import compile_library

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    root = tmp_path / "kernels"
    root.mkdir()
    old, loaded, other, note = (root / "scalar-00000000000000aa.so", root / "scalar-00000000000000bb.so",
                                root / "avx2-00000000000000aa.so", root / "scalar-notes.so")
    weeks_ago = time.time() - (UNUSED_DAYS + 1) * 86400
    for path in (old, loaded, other, note):
        path.write_bytes(b"")
        os.utime(path, (weeks_ago, weeks_ago))
    os.utime(loaded)  # (a process loaded it since)
    library = compile_library(kernels.Path(kernels.__file__).with_name("scalar.c"), kernels.FLAGS)
    built = kernels.Path(library._name)
    assert sorted(path.name for path in root.iterdir()) == sorted([built.name, loaded.name, other.name, note.name])
    os.utime(built, (weeks_ago, weeks_ago))
    compile_library(kernels.Path(kernels.__file__).with_name("scalar.c"), kernels.FLAGS)
    assert built.stat().st_mtime > time.time() - 86400  # loading dates it to now


def test_bench_kernels_times_a_gguf_s_matrices_and_refuses_a_machine_with_the_scalar_path_alone(tmp_path, capsys,
                                                                                                monkeypatch):
    """`speculant bench-kernels`: T(W) of every matrix of a tiny GGUF on each path, the first width in ms and the
    others as ratios to it (labelled so); where only the scalar reference runs (no SIMD path builds), one line
    naming `--isa scalar` before any weight is read (it failed with a StopIteration after repacking them)."""
    from speculant import cli
    from tiny_gguf import write_tiny_gguf

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "qwen2", 3, "q8_0")
    assert cli.main(["bench-kernels", "--model", str(path), "--widths", "1,2", "--repeats", "1", "--isa",
                     "scalar"]) == 0
    out = capsys.readouterr().out
    assert "15 matrices" in out and "| path | T(1) | T(2) / T(1) |" in out and "| scalar | " in out, out
    monkeypatch.setattr(kernels, "paths", lambda emulated=False: ["scalar"])
    monkeypatch.setattr(kernels, "best", lambda: "scalar")
    monkeypatch.setattr("speculant.bench.kernels.linear_weights", lambda model: pytest.fail("read the weights"))
    assert cli.main(["bench-kernels", "--model", str(path), "--widths", "1"]) == 2
    assert "runs only the scalar reference: give --isa scalar" in capsys.readouterr().err
