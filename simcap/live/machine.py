"""The host CPU as vLLM's CPU build sees it: model name and the instruction sets it dispatches on.

vLLM's CPU kernels pick their path from these flags: AVX2 only (bf16 emulated: prefill many
times slower), AVX-512, AVX-512 BF16 (native bf16 dot products) and AMX (tile matmuls). Live
measurements on two machines differ by that much, so every live result names the machine.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flag -> the name printed.
VLLM_CPU_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512 BF16",
    "amx_bf16": "AMX BF16",
}


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> tuple[str | None, int, set[str]]:
    """(model name, logical cores, flags) of the first processor listed; empty off Linux."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        text = ""
    model, flags, cores = None, set(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, cores, flags


def cpu_info(path: str | Path = "/proc/cpuinfo") -> dict:
    """``{"model": str | None, "cores": int, "features": {name: bool}}``; empty flags off Linux."""
    model, cores, flags = read_cpuinfo(path)
    return {
        "model": model,
        "cores": cores,
        "features": {name: flag in flags for flag, name in VLLM_CPU_FLAGS.items()},
    }


def describe_cpu(info: dict | None = None) -> str:
    """One line: ``AMD EPYC ... (2 cores): AVX2 yes, AVX-512 yes, AVX-512 BF16 yes, AMX BF16 no``."""
    info = cpu_info() if info is None else info
    flags = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in info["features"].items())
    return f"{info['model'] or 'unknown CPU'} ({info['cores']} cores): {flags}"
