"""The CPU line printed before the live tests (no server needed)."""

from __future__ import annotations

from simcap.live.machine import cpu_info, describe_cpu

CPUINFO = """\
processor\t: 0
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_cpu_features_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = cpu_info(path)
    assert info == {"model": "Example CPU 9000", "cores": 2,
                    "features": {"AVX2": True, "AVX-512": True, "AVX-512 BF16": True, "AMX BF16": False}}
    assert describe_cpu(info) == "Example CPU 9000 (2 cores): AVX2 yes, AVX-512 yes, AVX-512 BF16 yes, AMX BF16 no"
    path.write_text(CPUINFO.replace("avx512f avx512_bf16 ", ""))
    assert cpu_info(path)["features"] == {"AVX2": True, "AVX-512": False, "AVX-512 BF16": False, "AMX BF16": False}


def test_no_cpuinfo_is_an_unknown_cpu(tmp_path):
    info = cpu_info(tmp_path / "missing")
    assert info["model"] is None and info["cores"] == 0 and not any(info["features"].values())
    assert describe_cpu(info).startswith("unknown CPU (0 cores): AVX2 no")
