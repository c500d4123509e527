"""Step-time model cost: the roofline form against the linear one, side by side.

Run by hand: ``python benchmarks/bench_step_time.py``. Prints medians of repeated runs:

- ns per ``step_period`` call on a pure-decode step (64 requests) and a mixed step (a
  2048-token prefill chunk among 63 decodes), for the linear form and the roofline form
  (``combine: sum`` and ``max``; MoE model, TP 2, EAGLE3 draft passes off);
- ns per step of ``decode_periods`` (the fast path's bulk pricing, 200 steps at once);
- wall seconds of one whole simulation (``--num-requests`` of 1000 in / 200 out, Poisson
  5 req/s, max_num_seqs 256, budget 8192: ``bench_simulate.py``'s reference workload, smaller)
  in each form, interleaved (the forms price the steps differently, so the runs differ in
  their number of steps: compare the microseconds per step).

The roofline scenario uses the catalog's ``h200-sxm`` and ``qwen3-30b-a3b``. Machines are
shared and noisy: trust medians of interleaved repeats, not lone figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from simcap.config.scenario import StepTimeConfig, parse_scenario  # noqa: E402
from simcap.engine.scheduler import SchedulerOutput  # noqa: E402
from simcap.engine.step_time import make_step_model  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402

LINEAR = {"base": 0.004, "per_prefill_token": 1.0e-5, "per_decode_token": 5.0e-5,
          "per_context_token": 1.0e-9}
ROOFLINE = {"form": "roofline", "base": 0.004, "hardware": "h200-sxm", "model": "qwen3-30b-a3b",
            "tensor_parallel_size": 2, "per_request": 1e-6}


def scenario(step_time: dict, num_requests: int):
    return parse_scenario({
        "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16,
                   "num_gpu_blocks": 16384, "max_model_len": 4096},
        "step_time": step_time,
        "workload": {"arrival": {"process": "poisson", "rate": 5.0},
                     "num_requests": num_requests, "input_len": 1000, "output_len": 200},
        "seed": 0,
    })


def steps() -> dict[str, SchedulerOutput]:
    decode = SchedulerOutput(reqs=[None] * 64, total_num_scheduled_tokens=64, num_decode_reqs=64,
                             num_decode_tokens=64, num_context_tokens=64 * 1100)
    mixed = SchedulerOutput(reqs=[None] * 64, total_num_scheduled_tokens=2048 + 63,
                            num_prefill_reqs=1, num_prefill_tokens=2048, num_decode_reqs=63,
                            num_decode_tokens=63, num_context_tokens=63 * 1100 + 2048,
                            num_prefill_pairs=2048 * 2049 // 2)
    return {"decode": decode, "mixed": mixed}


def per_call_ns(fn, arg, number: int, repeats: int) -> float:
    times = timeit.repeat(lambda: fn(arg), number=number, repeat=repeats)
    return statistics.median(times) / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()

    models = {
        "linear": make_step_model(StepTimeConfig(**LINEAR), async_scheduling=True),
        "roofline sum": make_step_model(StepTimeConfig(**ROOFLINE), async_scheduling=True),
        "roofline max": make_step_model(StepTimeConfig(**ROOFLINE, combine="max"),
                                        async_scheduling=True),
    }
    print(f"{'ns per call (median of ' + str(args.repeats) + ')':34}" + "".join(f"{n:>14}" for n in models))
    for label, out in steps().items():
        row = [per_call_ns(m.step_period, out, args.calls, args.repeats) for m in models.values()]
        print(f"{'step_period, ' + label + ' step':34}" + "".join(f"{v:14.0f}" for v in row))
    row = []
    for m in models.values():
        t = timeit.repeat(lambda m=m: m.decode_periods(64, 70_000, 200), number=args.calls // 200,
                          repeat=args.repeats)
        row.append(statistics.median(t) / (args.calls // 200) / 200 * 1e9)
    print(f"{'decode_periods, per step':34}" + "".join(f"{v:14.0f}" for v in row))

    runs: dict[str, list[float]] = {"linear": [], "roofline sum": []}
    configs = {"linear": LINEAR, "roofline sum": ROOFLINE}
    scenarios = {k: scenario(v, args.num_requests) for k, v in configs.items()}
    num_steps = {}
    for _ in range(args.repeats):
        for name, sc in scenarios.items():  # interleaved
            t0 = time.perf_counter()
            result = simulate(sc)
            runs[name].append(time.perf_counter() - t0)
            num_steps[name] = len(result.steps)
    print(f"\nwhole simulation, {args.num_requests} requests (median of {args.repeats}):")
    for name, walls in runs.items():
        wall = statistics.median(walls)
        print(f"  {name:14} {wall:8.3f} s wall   {num_steps[name]:>8} steps   "
              f"{wall / num_steps[name] * 1e6:6.2f} us per step")


if __name__ == "__main__":
    main()
