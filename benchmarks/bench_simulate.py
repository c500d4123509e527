"""Simulator speed on the reference workload (run by hand: ``python benchmarks/bench_simulate.py``).

10,000 requests of 1000 input / 200 output tokens, Poisson 5 req/s, max_num_seqs 256,
max_num_batched_tokens 8192, block 16, 16,384 blocks. Prints wall seconds, simulated seconds
per wall second, engine steps per second and peak resident memory. Machines are shared and
noisy: compare medians of repeats measured side by side, not lone figures.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from simcap.scenario import parse_scenario
from simcap.simulator import simulate

REFERENCE = {
    "name": "bench-reference",
    "engine": {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "num_gpu_blocks": 16384,
        "max_model_len": 4096,
    },
    "step_time": {"base": 0.004, "per_prefill_token": 1.0e-5, "per_decode_token": 5.0e-5},
    "workload": {
        "arrival": {"process": "poisson", "rate": 5.0},
        "num_requests": 10000,
        "input_len": 1000,
        "output_len": 200,
    },
    "seed": 0,
}


def _peer(num_requests: int):
    """The same workload on Dynamo's Rust mocker (vLLM engine type), or None if absent."""
    try:
        from dynamo._core import run_mocker_synthetic_trace_replay
    except ImportError:
        print("compiled peer     not installed; skipped")
        return None
    engine = REFERENCE["engine"]
    config = {"engine": {"backend": "vllm", **{k: engine[k] for k in (
        "block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks")}}}
    wl = REFERENCE["workload"]
    return lambda: run_mocker_synthetic_trace_replay(
        wl["input_len"], wl["output_len"], num_requests, extra_engine_args=config,
        request_rate=wl["arrival"]["rate"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument(
        "--peer", action="store_true",
        help="also time the compiled peer (NVIDIA Dynamo's mocker, when importable: "
        "pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1), interleaved",
    )
    parser.add_argument(
        "--reference", action="store_true",
        help="also time the step-by-step reference path, interleaved, and print the ratio",
    )
    args = parser.parse_args()
    data = dict(REFERENCE)
    data["workload"] = {**REFERENCE["workload"], "num_requests": args.num_requests}
    scenario = parse_scenario(data)
    peer = _peer(args.num_requests) if args.peer else None
    walls, ref_walls, peer_walls = [], [], []
    for _ in range(args.repeats):
        if peer is not None:
            t0 = time.perf_counter()
            peer()
            peer_walls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        result = simulate(scenario)
        walls.append(time.perf_counter() - t0)
        if args.reference:
            t0 = time.perf_counter()
            simulate(scenario, fast=False)
            ref_walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    sim_s = result.summary.duration_s
    steps = len(result.steps)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"requests          {args.num_requests:,}")
    print(f"wall s (median)   {wall:.3f}   all: {', '.join(f'{w:.3f}' for w in walls)}")
    print(f"simulated s       {sim_s:,.1f}")
    print(f"sim s / wall s    {sim_s / wall:,.0f}")
    print(f"engine steps      {steps:,}   steps/s {steps / wall:,.0f}")
    print(f"peak RSS MiB      {peak_mib:,.0f}")
    if peer_walls:
        pw = statistics.median(peer_walls)
        print(f"compiled peer     {pw:.3f} s (median, same workload); simcap / peer = {wall / pw:.2f}")
    if ref_walls:
        ref = statistics.median(ref_walls)
        print(f"reference path    {ref:.3f} s (median); fast path is {ref / wall:.1f}x faster")


if __name__ == "__main__":
    main()
