#!/usr/bin/env python
"""Is the engine slower under open-loop load, or was the machine slower that day?

The accuracy corpus's open-loop points of ``cpu-dense-frontend`` (Poisson at 3 and 7 req/s)
ran their decode steps 1.3x the fitted price, its closed loops 0.96-1.15x; each point ran on
its own server instance a few minutes apart, so load and time are confounded there. This
script runs the closed loop of 8 clients and Poisson at 7 req/s of that case, alternately, on
ONE server instance (the case's launch config), ``--repeats`` times, and measures each run's
engine speed against the case's own fitted profile (the linear fit of its recorded
calibration, as ``simcap accuracy`` fits it; :mod:`simcap.live.engine_speed`): the logged
decode steps over the replay's at the same batch sizes, per run and per second of the log,
with the TTFT the replay predicts blind and at the run's measured speed.

Run under ``flock /tmp/simcap-cpu.lock`` (it starts a vLLM server); about 3 minutes on two
cores. ``python experiments/live-engine-speed/run.py [--repeats 3]`` writes ``results.json``
beside itself and the results block of its README.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from simcap.accuracy.corpus import load_case  # noqa: E402
from simcap.accuracy.replay import fit_live  # noqa: E402
from simcap.calibrate.readers import parse_iteration_log  # noqa: E402
from simcap.config.scenario import parse_scenario  # noqa: E402
from simcap.live.client import run_live  # noqa: E402
from simcap.live.launch import launch_server  # noqa: E402
from simcap.live.machine import describe_cpu  # noqa: E402
from simcap.live.recording import iteration_lines, log_size, read_log_window  # noqa: E402
from simcap.live.validate import metric_value, replay_run, reset_prefix_cache, speed_of  # noqa: E402
from simcap.metrics.report import write_generated_block  # noqa: E402

CASE = REPO / "calibration" / "corpus" / "cpu-dense-frontend"
POINTS = ("closed-8", "poisson-near-saturation")
METRICS = ("ttft_p50", "ttft_p95", "tpot_p50")


def scenario_of(point, profile: dict):
    data = dict(point.scenario)
    data["engine"] = {**(data.get("engine") or {}), **profile["engine"]}
    data.update(step_time=profile["step_time"], speculative=None, frontend=profile["frontend"])
    data.pop("profile", None)
    return parse_scenario(data)


def markdown(out: dict) -> str:
    lines = ["| run | point | engine speed | per second p10-p90 | decode ms at 1 / 4 / 8 | "
             "TTFT p50 ms: live, error blind -> at speed | TTFT p95 ms: live, error blind -> at speed |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in out["runs"]:
        s = r["engine_speed"]
        ps = s["per_second"] if s else None
        med = " / ".join("-" if r["decode_median_ms"].get(str(b)) is None else f"{r['decode_median_ms'][str(b)]:.2f}"
                         for b in (1, 4, 8))

        def cell(m: str) -> str:
            live, blind, fast = r["live"][m], r["predicted"][m], r["at_speed"][m]
            return (f"{live * 1e3:,.0f}, {(blind / live - 1) * 100:+.0f}% -> "
                    + ("-" if fast is None else f"{(fast / live - 1) * 100:+.0f}%"))

        spread = "-" if not ps else f"{ps['p10']:.2f}-{ps['p90']:.2f}"
        lines.append(f"| {r['index']} | {r['point']} | {s['ratio']:.2f}x | {spread} | {med} | "
                     f"{cell('ttft_p50')} | {cell('ttft_p95')} |")
    by = {p: [r["engine_speed"]["ratio"] for r in out["runs"] if r["point"] == p] for p in POINTS}
    lines += ["", "Engine speed by point (median of runs): "
              + ", ".join(f"{p} {float(np.median(v)):.2f}x" for p, v in by.items())
              + f". Machine: {out['machine']}; wall {out['wall_s']:.0f} s."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    started = time.perf_counter()
    case = load_case(CASE)
    profile = fit_live(case, "linear")
    points = {p.name: p for p in case.points if p.name in POINTS}
    runs = []
    server = launch_server(CASE / "server.yaml")
    with server:
        log = Path(server.log_path)
        for rep in range(args.repeats):
            for name in POINTS:
                point = points[name]
                scenario = scenario_of(point, profile)
                reset_prefix_cache(server.base_url)
                offset = log_size(log)
                run = run_live(scenario, server.base_url, progress=False)
                lines = iteration_lines(read_log_window(log, offset))
                sim = replay_run(scenario, run, point.replay, steps=True)
                speed, fast = speed_of(scenario, run, point.replay, lines, sim)
                by: dict[int, list[float]] = {}
                for row in parse_iteration_log(lines):
                    if not row["num_prefill_tokens"]:
                        by.setdefault(row["num_decode_reqs"], []).append(row["step_time_s"])
                live = run.summary()
                runs.append({
                    "index": len(runs), "repeat": rep, "point": name, "engine_speed": speed,
                    "decode_median_ms": {str(b): float(np.median(v)) * 1e3 for b, v in sorted(by.items()) if len(v) >= 10},
                    "live": {m: metric_value(live, m) for m in METRICS},
                    "predicted": {m: metric_value(sim.summary, m) for m in METRICS},
                    "at_speed": {m: None if fast is None else metric_value(fast.summary, m) for m in METRICS},
                    "wall_s": run.wall_duration_s,
                })
                print(f"{len(runs) - 1} {name}: engine speed {speed and round(speed['ratio'], 3)}", flush=True)
    out = {"case": str(CASE.relative_to(REPO)), "points": list(POINTS), "profile_form": "linear",
           "machine": describe_cpu(), "runs": runs, "wall_s": time.perf_counter() - started,
           "command": " ".join(["python experiments/live-engine-speed/run.py", *sys.argv[1:]])}
    (HERE / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    write_generated_block(HERE / "README.md", markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
