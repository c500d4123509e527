"""``simcap serve`` as the tests run it: a subprocess on a free local port, stopped by SIGINT."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import yaml

from simcap.metrics.records import RequestRecord

ROOT = Path(__file__).resolve().parents[1]

# One engine whose steps are long next to a local HTTP round trip (10 ms and up), small
# enough that its runs take seconds.
SCENARIO = {
    "name": "served",
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 256, "block_size": 16, "num_gpu_blocks": 512,
               "max_model_len": 1024, "enable_prefix_caching": True},
    "step_time": {"base": 0.010, "per_prefill_token": 4.0e-5, "per_decode_token": 1.0e-3},
    "workload": {"arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 50,
                 "input_len": 64, "output_len": {"dist": "uniform", "low": 4, "high": 12}},
    "seed": 3,
}


def write_scenario(folder: Path, **changes) -> Path:
    data = {**SCENARIO, **changes}
    path = folder / "served.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    base_url: str
    proc: subprocess.Popen
    records_path: Path
    trace_path: Path
    stderr: str = ""
    exit_code: int | None = None
    status: dict = field(default_factory=dict)

    def records(self) -> list[RequestRecord]:
        lines = self.records_path.read_text().splitlines()
        return sorted((RequestRecord.from_dict(json.loads(line)) for line in lines), key=lambda r: r.request_id)


@contextmanager
def served(scenario: Path, *args: str, folder: Path, timeout: float = 60.0) -> Iterator[Served]:
    """``simcap serve SCENARIO ARGS --records --trace`` until the block ends; then SIGINT, and
    its last ``/simcap`` status, stderr and exit code are on the returned object."""
    port = free_port()
    records, trace = folder / "records.jsonl", folder / "trace.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "simcap", "serve", str(scenario), "--port", str(port),
         "--records", str(records), "--trace", str(trace), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    run = Served(base, proc, records, trace)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"simcap serve exited with {proc.returncode}: {proc.stderr.read()}")
            try:
                if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("simcap serve did not answer /health")
            time.sleep(0.1)
        yield run
        run.status = httpx.get(base + "/simcap", timeout=10.0).json()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, run.stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, run.stderr = proc.communicate()
        run.exit_code = proc.returncode
