"""Measure this machine's CPU for the roofline catalog (simcap/catalog/hardware.yaml).

Usage: python benchmarks/measure_cpu.py [--name cpu-...] [--repeats 7] [--mib 256] [--gemm 2048]

Prints one hardware.yaml entry (same schema as the GPU entries) on stdout, and the raw
timings on stderr. What it measures:

* memory bandwidth, STREAM style: ``copy`` (a[:] = b) and ``triad`` (a = b + s*c) over arrays of
  ``--mib`` MiB each (far larger than any CPU cache), counting bytes the way STREAM does
  (copy: 16 bytes per float64 element, one read + one write; triad: 24, two reads + one write;
  write-allocate traffic is not counted). Run single-threaded with numpy and, if torch is
  importable, multi-threaded with torch (one fused kernel per triad, so no temporaries).
  The entry's ``memory_bandwidth_gbps`` is the best copy/triad figure over all of them.
* dense GEMM throughput: fp32 with numpy's matmul (its BLAS, all threads) and, if torch is
  importable, fp32 and bf16 with torch.matmul, on square N x N matrices (2 N^3 FLOPs each);
  N grows from 256 by doubling up to ``--gemm`` while one product stays under half a second,
  so a CPU without native bf16 (about 1 GFLOP/s) is measured in seconds, not minutes.
* the CPU model and its vector/matrix ISA flags from /proc/cpuinfo.

Each figure is timed ``--repeats`` times; the best and the median are reported, and the entry
quotes the best (on a machine shared with other work the best is the least disturbed run).
A CPU runs the model on one socket with tp = 1: the interconnect fields are null.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import statistics
import sys
import time

import numpy as np

FLAGS_OF_INTEREST = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
)


def cpu_info() -> dict:
    model, vendor, family, model_no, flags, mhz = "unknown", "", "", "", set(), None
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "model name" and model == "unknown":
            model = val
        elif key == "vendor_id" and not vendor:
            vendor = val
        elif key == "cpu family" and not family:
            family = val
        elif key == "model" and not model_no:
            model_no = val
        elif key == "flags" and not flags:
            flags = set(val.split())
        elif key == "cpu MHz" and mhz is None:
            mhz = float(val)
    mem_gb = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem_gb = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return {
        "model": model, "vendor": vendor, "family": family, "model_no": model_no,
        "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
        "hypervisor": "hypervisor" in flags, "mhz": mhz,
        "cores": os.cpu_count(), "mem_gb": mem_gb,
    }


def microarch(info: dict) -> str:
    """A name for the core generation where the CPUID family/model pins it (else '')."""
    try:
        fam, mod = int(info["family"]), int(info["model_no"])
    except ValueError:
        return ""
    if info["vendor"] == "AuthenticAMD":
        if fam == 25 and 0x10 <= mod <= 0x1F:
            return "Zen 4 (EPYC 9004 Genoa)"
        if fam == 25 and 0xA0 <= mod <= 0xAF:
            return "Zen 4c (EPYC 97x4 Bergamo)"
        if fam == 25 and mod <= 0x0F:
            return "Zen 3 (EPYC 7003 Milan)"
        if fam == 26:
            return "Zen 5"
    return ""


def slug(info: dict) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", info["model"].lower()).strip("-")
    arch = re.sub(r"[^a-z0-9]+", "", microarch(info).split(" (")[0].lower())
    return f"cpu-{s}{'-' + arch if arch else ''}-{info['cores']}vcpu"


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: page faults, thread pools, BLAS kernel selection
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summarise(label: str, work: float, times: list[float], unit: str, scale: float) -> dict:
    rates = sorted((work / t / scale for t in times), reverse=True)
    r = {"label": label, "best": rates[0], "median": statistics.median(rates), "n": len(rates)}
    print(f"{label:34s} best {r['best']:9.2f} {unit}  median {r['median']:9.2f} {unit}  "
          f"(n={r['n']})", file=sys.stderr)
    return r


def bandwidth(mib: int, repeats: int, torch) -> list[dict]:
    n = mib * (1 << 20) // 8
    res = []
    a = np.zeros(n)
    b = np.full(n, 1.0)
    c = np.full(n, 2.0)
    s = 3.0
    res.append(summarise("copy  numpy 1 thread", 16 * n, timed(lambda: np.copyto(a, b), repeats),
                         "GB/s", 1e9))
    # numpy has no fused triad; a = s*c then a += b moves 5 arrays' worth, not 3. Count the
    # real traffic (40 bytes) so the figure is a bandwidth, not a STREAM-rule underestimate.

    def np_triad():
        np.multiply(c, s, out=a)
        np.add(a, b, out=a)

    res.append(summarise("triad numpy 1 thread (5 passes)", 40 * n, timed(np_triad, repeats),
                         "GB/s", 1e9))
    del a, b, c
    if torch is not None:
        ta = torch.zeros(n, dtype=torch.float64)
        tb = torch.full((n,), 1.0, dtype=torch.float64)
        tc = torch.full((n,), 2.0, dtype=torch.float64)
        nt = torch.get_num_threads()
        res.append(summarise(f"copy  torch {nt} threads", 16 * n,
                             timed(lambda: ta.copy_(tb), repeats), "GB/s", 1e9))
        res.append(summarise(f"triad torch {nt} threads", 24 * n,
                             timed(lambda: torch.add(tb, tc, alpha=s, out=ta), repeats),
                             "GB/s", 1e9))
    return res


# One product may take this long: N doubles from GEMM_MIN_N up to the requested size while the
# next size's product (8x the work) stays within it. A CPU without native bf16 (AVX2 only)
# multiplies bf16 at about 1 GFLOP/s: 17 s a product at N = 2048, 0.2 s at 512.
GEMM_BUDGET_S = 0.5
GEMM_MIN_N = 256


def sized(make, size: int):
    """The operands of the largest square product of ``make(n)``, n from ``GEMM_MIN_N``
    doubling up to ``size``, whose product takes at most ``GEMM_BUDGET_S`` (as its half-size
    one, timed warm, foretells: 8x the work), and n."""
    n = min(GEMM_MIN_N, size)
    x, y = make(n)
    x @ y  # warm-up
    while 2 * n <= size:
        t0 = time.perf_counter()
        x @ y
        if 8 * (time.perf_counter() - t0) > GEMM_BUDGET_S:
            break
        n *= 2
        x, y = make(n)
        x @ y
    return x, y, n


def gemm(size: int, repeats: int, torch) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    rng = np.random.default_rng(0)

    def numpy_fp32(n):
        return (rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32))

    def add(kind: str, label: str, make) -> None:
        x, y, n = sized(make, size)
        out[kind].append(summarise(f"gemm {label} N={n}", 2.0 * n ** 3, timed(lambda: x @ y, repeats),
                                   "GFLOP/s", 1e9))

    add("fp32", "fp32 numpy", numpy_fp32)
    if torch is not None:
        add("fp32", "fp32 torch", lambda n: tuple(torch.from_numpy(a) for a in numpy_fp32(n)))
        add("bf16", "bf16 torch", lambda n: tuple(torch.from_numpy(a).to(torch.bfloat16) for a in numpy_fp32(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default=None, help="entry name (default: from the CPU model)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mib", type=int, default=256, help="MiB per bandwidth array")
    ap.add_argument("--gemm", type=int, default=2048,
                    help="largest GEMM matrix size N (smaller where one product would take over 0.5 s)")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        torch = None
    info = cpu_info()
    print(f"CPU: {info['model']} ({info['vendor']} family {info['family']} model "
          f"{info['model_no']}), {info['cores']} logical CPUs, flags {info['flags']}",
          file=sys.stderr)
    bw = bandwidth(args.mib, args.repeats, torch)
    gf = gemm(args.gemm, args.repeats, torch)

    best_bw = max(bw, key=lambda r: r["best"])
    fp32 = max(gf["fp32"], key=lambda r: r["best"])
    bf16 = max(gf["bf16"], key=lambda r: r["best"]) if gf["bf16"] else None
    date = _dt.date.today().isoformat()
    how = (f"best of {args.repeats} repeats after a warm-up on {info['cores']} logical CPUs "
           f"shared with other work (the best is the least disturbed run)")
    bw_txt = "; ".join(f"{r['label']}: best {r['best']:.1f}, median {r['median']:.1f} GB/s"
                       for r in bw)
    gf_txt = "; ".join(f"{r['label']}: best {r['best']:.1f}, median {r['median']:.1f} GFLOP/s"
                       for r in gf["fp32"] + gf["bf16"])
    name = args.name or slug(info)
    arch = microarch(info)
    desc = (f"{info['model']} (family {info['family']} model {info['model_no']}"
            f"{', ' + arch if arch else ''}), "
            f"{info['cores']} logical CPUs{', virtual machine' if info['hypervisor'] else ''}; "
            f"ISA: {', '.join(info['flags'])}")
    mem = round(info["mem_gb"], 1) if info["mem_gb"] else "null"
    bf16_val = f"{bf16['best'] / 1e3:.4f}" if bf16 else "null"
    versions = f"numpy {np.__version__}" + (f", torch {torch.__version__}" if torch else "")
    print(f"""{name}:
  description: "{desc}"
  memory_gb: {mem}
  memory_bandwidth_gbps: {best_bw['best']:.1f}
  peak_tflops: {{bf16: {bf16_val}, fp16: null, fp8: null, int8: null, fp32: {fp32['best'] / 1e3:.4f}}}
  interconnect: {{name: null, bandwidth_gbps: null, latency_us: null}}
  rates: measured
  sources:
    memory_bandwidth_gbps: "measured by benchmarks/measure_cpu.py on {date}, STREAM-style copy/triad over {args.mib} MiB float64 arrays (STREAM byte counting: copy 16 B/element, triad 24 B/element; numpy triad counted at its real 5 passes), {how}, {versions}. {bw_txt}. Quoted: {best_bw['label']}. memory_gb: MemTotal from /proc/meminfo."
    peak_tflops: "measured by benchmarks/measure_cpu.py on {date}, dense square GEMM (2 N^3 FLOPs; N up to {args.gemm}, smaller where one product would take over {GEMM_BUDGET_S} s: each label gives its N), {how}, {versions}. {gf_txt}. fp16/int8/fp8 not measured (null). Achieved GEMM throughput, not the ISA's theoretical peak."
    interconnect: "not used on CPU (tp = 1, one socket): null"
""")
    print(f"host: {platform.node()} python {platform.python_version()}", file=sys.stderr)


if __name__ == "__main__":
    main()
