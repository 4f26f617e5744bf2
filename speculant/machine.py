"""What this machine is: CPU model and vector extensions, threads, library versions. Reports carry it;
`dtype="auto"` and the machine profile key on it. Reads /proc/cpuinfo; imports torch only when asked."""

from __future__ import annotations

import platform
from functools import cache
from importlib import metadata
from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # a CPU with either multiplies bf16 natively


@cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first CPU, from /proc/cpuinfo where there is one. An Arm CPU's has no model
    name: its implementer and part numbers name it (profiles are kept per CPU model), its `Features` are its flags."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        arm: dict[str, str] = {}
        for line in cpuinfo.read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model in (platform.processor(), platform.machine()):
                model = value
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
            elif key in ("CPU implementer", "CPU part"):
                arm.setdefault(key, value)
        if len(arm) == 2 and model in (platform.processor(), platform.machine()):
            model = f"{platform.machine()} implementer {arm['CPU implementer']} part {arm['CPU part']}"
    return model, flags


def cpu_has(*flags: str) -> bool:
    """Whether the CPU reports every one of `flags` (e.g. "avx2", "fma")."""
    return set(flags) <= cpu_info()[1]


def native_bf16() -> bool:
    return any(cpu_has(flag) for flag in BF16_FLAGS)


def versions() -> dict[str, str]:
    found = {}
    for package in ("speculant", "torch", "transformers", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def machine_info() -> str:
    """One line for reports: CPU, vector extensions that matter here, threads, library versions."""
    import torch

    model, _ = cpu_info()
    extensions = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if cpu_has(f)]
    libraries = ", ".join(f"{name} {version}" for name, version in versions().items())
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{model} ({' '.join(extensions) or platform.machine()}), {torch.get_num_threads()} threads{gpu}; "
            f"{libraries}; python {platform.python_version()}")
