"""Fleet scale: one fleet of 64 replicas and a million requests (run by hand:
``python benchmarks/bench_fleet.py``).

The workload is bench_simulate.py's reference one (1000 input / 200 output tokens,
max_num_seqs 256, budget 8192, block 16, 16,384 blocks per replica), Poisson at 5 req/s per
replica (320 req/s for 64). Each case runs in a fresh child process, so its peak resident
memory is its own; printed: wall seconds of the ``simulate`` call and of the child process,
engine steps, simulated seconds, peak RSS.

``--router roundrobin`` decides every request up front: each replica runs as a lone engine on
its own arrivals. A router that reads the replicas' load (``least_request``) cuts every
replica's bulk stretches at every fleet arrival; ``--num-requests`` sizes that case (a
million requests at 320 req/s is some 64 million replica wake-ups).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

from bench_simulate import BASE  # the reference workload (num_requests set per case)


def child(replicas: int, router: str, num_requests: int) -> None:
    from simcap.config.scenario import parse_scenario
    from simcap.fleet.run import simulate

    data = json.loads(json.dumps(BASE))
    data["name"] = f"bench-fleet-{replicas}-{router}"
    data["workload"]["arrival"]["rate"] = 5.0 * replicas
    data["workload"]["num_requests"] = num_requests
    data["deployment"] = {"replicas": replicas, "router": router}
    scenario = parse_scenario(data)
    start = time.perf_counter()
    result = simulate(scenario)
    wall = time.perf_counter() - start
    out = result.to_dict()
    print(json.dumps({
        "replicas": replicas,
        "router": router,
        "num_requests": num_requests,
        "completed": out["completed"],
        "simulate_wall_s": round(wall, 2),
        "simulated_s": round(out["duration_s"], 1),
        "engine_steps": out["num_steps"],
        "load_imbalance": out["fleet"]["load_imbalance"],
        "ttft_p95_s": out["ttft_s"]["p95"],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--router", default="roundrobin")
    parser.add_argument("--num-requests", type=int, default=1_000_000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.replicas, args.router, args.num_requests)
        return
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--replicas", str(args.replicas), "--router",
         args.router, "--num-requests", str(args.num_requests)],
        capture_output=True, text=True, check=True,
    )
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_wall_s"] = round(time.perf_counter() - start, 2)
    row["machine"] = f"{platform.machine()}, Python {platform.python_version()}"
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
