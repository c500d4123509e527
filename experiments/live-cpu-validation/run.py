#!/usr/bin/env python
"""simcap's headline answers checked on a real vLLM CPU server: safe rate, saturation rate and
the speculative-decoding crossover, predicted vs measured (MEASURED, on this machine).

Regenerates every number in README.md and the figures beside it::

    flock /tmp/simcap-cpu.lock python experiments/live-cpu-validation/run.py          # the full run
    flock /tmp/simcap-cpu.lock python experiments/live-cpu-validation/run.py --quick  # a few minutes, to data-quick/

The server is the tiny Qwen3-MoE (64 experts, top-8) served by vLLM's CPU build from
``server.yaml``: 16 sequences, a 1024-token step budget, 64-token blocks. Every server is started
here and stopped (its whole process group) before the next one starts.

1. **Capacity** (``capacity.yaml``: Poisson arrivals, prompts 128-512 tokens, 16-48 output
   tokens, SLO TTFT p95 <= 1 s). The first server instance is calibrated at light load only
   (:func:`~simcap.live.calibration.calibrate_live` with at most 2 clients, its per-step log):
   that profile is the prediction. Then :func:`~simcap.live.rate_search.live_capacity` runs the
   field's method on the server (open loop, each rate held for the duration, every rate
   replicated, prefix cache reset between runs, the measured arrival rate as the axis), bisecting
   from the predicted safe rate, with the prediction (the same search and rules on the
   simulator) beside it. The server is then restarted and the search repeated with the same
   prediction: the spread between instances is the server's own run-to-run spread.
2. **Crossover** (``crossover.yaml``: closed loops, ngram k=3 on repeating prompts):
   :func:`~simcap.live.crossover_arms.live_crossover` starts the speculative server, calibrates a
   profile at the lowest concurrencies only, measures every concurrency, then starts the
   baseline server and measures it again; the prediction is ``simcap crossover`` on the
   calibrated profile and the acceptance measured at the lowest concurrency. Repeated (new
   servers each time) for the spread.

Raw records, server logs and profiles go to ``data/`` (``data-quick/`` with ``--quick``);
results.json, the figures and the README's results block are written here by the full run only.
Nothing is tuned to the measurement: the prediction is fixed before the live search starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from simcap.config.scenario import load_scenario
from simcap.live.calibration import calibrate_live
from simcap.live.crossover_arms import comparison_lines, live_crossover
from simcap.live.launch import launch_server, load_server_config
from simcap.live.machine import cpu_info, describe_cpu
from simcap.live.rate_search import live_capacity
from simcap.metrics.report import write_generated_block
from simcap.studies.plots import plot_capacity, plot_crossover

HERE = Path(__file__).resolve().parent
CALIBRATE_UP_TO = 2  # clients: the capacity profile sees light load only

FULL = dict(duration_s=12.0, replicates=2, max_points=4, max_probes=1, instances=2,
            calibration_requests=24, bootstrap=30, concurrencies=(1, 2, 4, 8, 16),
            requests_per_client=4, crossover_repeats=2)
QUICK = dict(duration_s=5.0, replicates=1, max_points=2, max_probes=1, instances=1,
             calibration_requests=8, bootstrap=10, concurrencies=(1, 4),
             requests_per_client=2, crossover_repeats=1)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _rel(path: Path) -> str:
    """A path as the results name it: relative to this folder (no machine path)."""
    try:
        return os.path.relpath(path, HERE)
    except ValueError:
        return str(path)


def _inside(value: float | None, lo: float | None, hi: float | None) -> bool | None:
    if value is None or (lo is None and hi is None):
        return None
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def _span(brackets: list[list[float | None]]) -> list[float | None]:
    """The range the instances' brackets cover together: an open end stays open."""
    los, his = [b[0] for b in brackets], [b[1] for b in brackets]
    return [None if None in los else min(los), None if None in his else max(his)]


# --------------------------------------------------------------------------- capacity


def run_capacity(config, base, s: dict[str, Any], raw: Path) -> dict[str, Any]:
    profile = raw / "capacity-profile.yaml"
    instances: list[dict[str, Any]] = []
    calibration: dict[str, Any] = {}
    results = []
    for i in range(s["instances"]):
        server = launch_server(config, base, speculative=False, log_path=raw / f"capacity-server{i}.log")
        say(f"capacity: starting server instance {i}")
        with server:
            startup = round(server.startup_seconds or 0.0, 1)
            if i == 0:
                say(f"capacity: calibrating at <= {CALIBRATE_UP_TO} clients")
                eng = config.engine
                cal = calibrate_live(
                    server.base_url, config.served_model_name, profile, max_num_seqs=eng.max_num_seqs,
                    max_num_batched_tokens=eng.max_num_batched_tokens, max_model_len=eng.max_model_len,
                    log_path=server.log_path, num_requests=s["calibration_requests"], bootstrap=s["bootstrap"],
                    server_pids=sorted(server.pids()), max_concurrency=CALIBRATE_UP_TO, seed=0,
                    name=f"{config.served_model_name} calibrated at <= {CALIBRATE_UP_TO} clients",
                )  # fmt: skip
                calibration = {
                    "profile": _rel(profile), "concurrencies": sorted({p["concurrency"] for p in cal.phases}),
                    "requests": sum(p["num_requests"] for p in cal.phases), "source": cal.source,
                    "step_time": cal.profile["step_time"], "notes": list(cal.notes),
                    "wall_s": round(cal.wall_s, 1),
                }
            scenario = load_scenario(HERE / "capacity.yaml", profile=profile)
            t0 = time.perf_counter()
            res = live_capacity(
                scenario, server.base_url, raw / f"capacity-{i}", duration_s=s["duration_s"],
                replicates=s["replicates"], max_points=s["max_points"], max_probes=s["max_probes"],
                model=config.served_model_name, say=lambda m, i=i: say(f"capacity {i}: {m}"),
            )
            wall = time.perf_counter() - t0
        results.append(res)
        data = res.to_dict()
        m = data["measured"]
        instances.append({
            "instance": i,
            "startup_s": startup,
            "safe_rate": m["safe_rate"],
            "safe_rate_bracket": m["safe_rate_bracket"],
            "saturation_rate": m["saturation_rate"],
            "saturation_bracket": m["saturation_bracket"],
            "comparison": data["comparison"],
            "points": [{k: p[k] for k in ("rate", "replicate", "measured_rate", "ttft_p95", "pass",
                                          "saturated", "role", "live")} for p in m["points"]],
            "notes": data["notes"],
            "server": data["server"],
            "runs": data["runs_made"],
            "live_time_s": data["live_time_s"],
            "wall_s": round(wall, 1),
        })
        say(f"capacity {i}: safe {m['safe_rate']} in {m['safe_rate_bracket']}, saturation "
            f"{m['saturation_rate']} in {m['saturation_bracket']} ({wall:.0f} s)")
    predicted = results[0].to_dict()["predicted"]
    same = all(r.to_dict()["predicted"] == predicted for r in results)
    headline = {}
    for key, bkey in (("safe_rate", "safe_rate_bracket"), ("saturation_rate", "saturation_bracket")):
        span = _span([inst[bkey] for inst in instances])
        pred = predicted[key]
        measured = [inst[key] for inst in instances]
        headline[key] = {
            "predicted": pred,
            "measured_per_instance": measured,
            "brackets_per_instance": [inst[bkey] for inst in instances],
            "in_bracket_per_instance": [inst["comparison"][key]["in_bracket"] for inst in instances],
            "bracket_over_instances": span,
            "in_bracket_over_instances": _inside(pred, *span),
            "rel_error_vs_median": (None if pred is None or None in measured
                                    else pred / statistics.median(measured) - 1),
        }
    return {"calibration": calibration, "predicted": {k: predicted[k] for k in (
                "safe_rate", "safe_offered_rate", "saturation_rate")} | {"points": predicted["points"]},
            "prediction_identical_across_instances": same, "instances": instances, "headline": headline,
            "_results": results}


# --------------------------------------------------------------------------- crossover


def run_crossover(config, base, s: dict[str, Any], raw: Path) -> dict[str, Any]:
    scenario = load_scenario(HERE / "crossover.yaml")
    repeats = []
    objs = []
    for j in range(s["crossover_repeats"]):
        t0 = time.perf_counter()
        xo = live_crossover(
            scenario, config, s["concurrencies"], base_dir=base, out_dir=raw / f"crossover-{j}",
            calibration_requests=s["calibration_requests"], requests_per_client=s["requests_per_client"],
            bootstrap=s["bootstrap"], progress=lambda m, j=j: say(f"crossover {j}: {m}"),
        )
        wall = time.perf_counter() - t0
        objs.append(xo)
        data = xo.to_dict()
        for line in comparison_lines(data):
            say(f"crossover {j}: {line}")
        comp = data["comparison"]
        mx, px = comp["crossover"]["measured"], comp["crossover"]["predicted"]
        repeats.append({
            "repeat": j,
            "measured_crossover": mx,
            "predicted_crossover": px,
            "points": comp["points"],
            "calibration": {k: data["calibration"].get(k) for k in (
                "concurrencies", "requests", "source", "step_time", "acceptance_fed", "notes", "wall_s")},
            "acceptance_length": {
                str(r["concurrency"]): r["server"].get("spec_decode_mean_acceptance_length")
                for r in data["runs"] if r["arm"] == "spec"},
            "disturbed_runs": sum(1 for r in data["runs"] if r["disturbed"]),
            "foreign_cores": [r["cpu"].get("foreign_cores") for r in data["runs"]],
            "servers": [{k: v for k, v in srv.items() if k in ("arm", "startup_s")} for srv in data["servers"]],
            "notes": data["notes"],
            "wall_s": round(wall, 1),
        })
    # The measured crossover's bracket over the repeats: the concurrencies it was found between
    # (None: not found in range in that repeat).
    found = [r["measured_crossover"] for r in repeats if r["measured_crossover"]["status"] == "found"]
    bracket = ([min(c["between"][0] for c in found), max(c["between"][1] for c in found)]
               if len(found) == len(repeats) else None)
    # Inside: the predicted crossover lies in the measured bracket. Where no repeat measured a
    # crossover in range there is no bracket: the prediction agrees when it found none either.
    verdicts, agrees = [], []
    for r in repeats:
        px = r["predicted_crossover"]
        verdicts.append(None if bracket is None else
                        px["status"] == "found" and bracket[0] <= px["value"] <= bracket[1])
        agrees.append((px["status"] == "found") == (r["measured_crossover"]["status"] == "found"))
    headline = {
        "measured_status": [r["measured_crossover"]["status"] for r in repeats],
        "measured_values": [r["measured_crossover"]["value"] for r in repeats],
        "measured_bracket_over_repeats": bracket,
        "predicted_values": [r["predicted_crossover"]["value"] for r in repeats],
        "predicted_status": [r["predicted_crossover"]["status"] for r in repeats],
        "in_bracket_per_repeat": verdicts,
        "same_status_per_repeat": agrees,
    }
    return {"repeats": repeats, "headline": headline, "_results": objs}


# --------------------------------------------------------------------------- report


def _r(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _b(b: list[float | None] | None, d: int = 2) -> str:
    return "-" if b is None else f"{_r(b[0], d)} - {_r(b[1], d)}"


def _yn(v: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[v]


def results_markdown(res: dict[str, Any]) -> str:
    cap, xo, env = res["capacity"], res["crossover"], res["environment"]
    lines = [
        f"Machine: {env['cpu']}. vLLM {env['vllm_version']}. Run {env['started_utc']} - "
        f"{env['finished_utc']} UTC, {res['wall_s']['total'] / 60:.1f} min wall "
        f"(capacity {res['wall_s']['capacity'] / 60:.1f}, crossover {res['wall_s']['crossover'] / 60:.1f}).",
        f"Load: 1-min load average {env['loadavg_start'][0]:.2f} at the start, {env['loadavg_end'][0]:.2f} "
        f"at the end; {env['disturbed_runs']} of {env['live_runs']} live runs disturbed by foreign CPU use "
        f"(median foreign load {_r(env['foreign_cores_median'])} cores).",
        "",
        f"**Capacity** (SLO TTFT p95 <= 1 s; {cap['settings']['duration_s']:g} s of arrivals per run, "
        f"{cap['settings']['replicates']} replicates per rate, {len(cap['instances'])} server instances). "
        f"Predicted from a profile calibrated at <= {CALIBRATE_UP_TO} clients "
        f"({cap['calibration'].get('requests')} requests, {cap['calibration'].get('source')}).",
        "",
        "| req/s (measured arrival rate) | predicted | " + " | ".join(
            f"instance {i['instance']}: measured [bracket]" for i in cap["instances"])
        + " | bracket over instances | prediction inside |",
        "|---|---|" + "---|" * len(cap["instances"]) + "---|---|",
    ]
    for key, label in (("safe_rate", "safe rate"), ("saturation_rate", "saturation rate")):
        h = cap["headline"][key]
        cells = [f"{_r(m)} [{_b(b)}] ({'in' if v else 'out' if v is False else '-'})"
                 for m, b, v in zip(h["measured_per_instance"], h["brackets_per_instance"],
                                    h["in_bracket_per_instance"])]
        lines.append(f"| {label} | {_r(h['predicted'])} | " + " | ".join(cells)
                     + f" | {_b(h['bracket_over_instances'])} | {_yn(h['in_bracket_over_instances'])} |")
    lines += ["", "Live runs (TTFT p95 ms; `*` rate not reached, `S` saturated):", "",
              "| instance | requested | measured | TTFT p95 | pass |", "|---|---|---|---|---|"]
    for inst in cap["instances"]:
        for p in sorted(inst["points"], key=lambda p: (p["rate"], p["replicate"])):
            mark = ("" if p["live"]["rate_reached"] else "*") + (" S" if p["saturated"] else "")
            lines.append(f"| {inst['instance']} | {p['rate']:.3f} | {p['measured_rate']:.3f}{mark} | "
                         f"{_r(p['ttft_p95'] * 1e3 if p['ttft_p95'] is not None else None, 0)} | "
                         f"{'pass' if p['pass'] else 'FAIL'} |")
    x = xo["headline"]
    lines += [
        "",
        f"**Crossover** (ngram k=3, closed loops at {', '.join(str(c) for c in xo['settings']['concurrencies'])} "
        f"clients, {len(xo['repeats'])} repeats on fresh servers; in each repeat each arm's profile is "
        "calibrated on its own server at the lowest concurrencies only; beside it, one profile (the "
        "speculative server's) for both arms):",
        "",
        "| repeat | measured crossover | predicted crossover | both found / both none | prediction inside measured bracket |",
        "|---|---|---|---|---|",
    ]

    def where(c: dict[str, Any]) -> str:
        return (f"{c['value']:.3g} (between {c['between'][0]:g} and {c['between'][1]:g})"
                if c["status"] == "found" else "none in range")

    for r, v, a in zip(xo["repeats"], x["in_bracket_per_repeat"], x["same_status_per_repeat"]):
        lines.append(f"| {r['repeat']} | {where(r['measured_crossover'])} | {where(r['predicted_crossover'])} | "
                     f"{_yn(a)} | {'no measured bracket' if v is None else _yn(v)} |")
    mb = x["measured_bracket_over_repeats"]
    lines += ["", ("Measured bracket over repeats: " + _b(mb, 0) + " clients." if mb is not None else
                   "Measured bracket over repeats: none (not every repeat found a crossover in range)."), "",
              "| clients | " + " | ".join(f"gain measured / predicted / one profile (repeat {r['repeat']})"
                                         for r in xo["repeats"])
              + " | acceptance length (measured) |",
              "|---|" + "---|" * len(xo["repeats"]) + "---|"]
    for k, c in enumerate(xo["settings"]["concurrencies"]):
        cells = []
        for r in xo["repeats"]:
            g = r["points"][k]["throughput_gain_pct"]
            one = f" / {_r(g['one_profile'], 1)}%" if "one_profile" in g else ""
            cells.append(f"{_r(g['measured'], 1)}% / {_r(g['predicted'], 1)}%{one}")
        acc = ", ".join(_r(r["acceptance_length"].get(str(c))) for r in xo["repeats"])
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {acc} |")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes: one short search, two concurrencies")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--skip-crossover", action="store_true")
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    raw = HERE / ("data-quick" if args.quick else "data")
    if raw.exists():
        shutil.rmtree(raw)
    raw.mkdir(parents=True)
    config, base = load_server_config(HERE / "server.yaml")
    info = cpu_info()
    env: dict[str, Any] = {"cpu": describe_cpu(info), "cpu_info": info, "loadavg_start": os.getloadavg(),
                           "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    say(env["cpu"])
    t0 = time.perf_counter()
    cap = run_capacity(config, base, s, raw) if not args.skip_capacity else None
    t_cap = time.perf_counter() - t0
    xo = run_crossover(config, base, s, raw) if not args.skip_crossover else None
    total = time.perf_counter() - t0
    env.update(loadavg_end=os.getloadavg(), finished_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    foreign, disturbed, runs = [], 0, 0
    if cap:
        env["vllm_version"] = cap["instances"][0]["server"].get("vllm_version")
        for inst in cap["instances"]:
            for p in inst["points"]:
                runs += 1
                disturbed += bool(p["live"].get("disturbed"))
                if p["live"].get("foreign_cores") is not None:
                    foreign.append(p["live"]["foreign_cores"])
    if xo:
        for r in xo["repeats"]:
            runs += len(r["foreign_cores"])
            disturbed += r["disturbed_runs"]
            foreign += [f for f in r["foreign_cores"] if f is not None]
    env.update(live_runs=runs, disturbed_runs=disturbed,
               foreign_cores_median=statistics.median(foreign) if foreign else None)
    env.setdefault("vllm_version", None)
    out = raw if args.quick else HERE
    if cap:
        cap_results = cap.pop("_results")
        cap["settings"] = {k: s[k] for k in ("duration_s", "replicates", "max_points", "max_probes", "instances")}
        plot_capacity(cap_results[0].measured, out / "capacity.png",
                      title="tiny-moe on vLLM CPU: measured, instance 0 (TTFT p95 <= 1 s)")
    if xo:
        xo_results = xo.pop("_results")
        xo["settings"] = {k: s[k] for k in ("concurrencies", "requests_per_client", "crossover_repeats")}
        ref: dict[str, list[tuple[float, float, float]]] = {"spec": [], "baseline": []}
        for r in xo_results:
            for p in r.measured.points:
                ref["spec"].append((p.load, p.spec.output_tokens_per_s, p.spec.latency_mean_s))
                ref["baseline"].append((p.load, p.baseline.output_tokens_per_s, p.baseline.latency_mean_s))
        plot_crossover(xo_results[0].predicted, out / "crossover.png", reference=ref,
                       title="tiny-moe ngram k=3 on vLLM CPU: predicted (lines, repeat 0), measured (stars, all repeats)")
    results = {
        "environment": env,
        "capacity": cap,
        "crossover": xo,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
        "command": " ".join(["python experiments/live-cpu-validation/run.py", *sys.argv[1:]]),
        "wall_s": {"capacity": round(t_cap, 1), "crossover": round(total - t_cap, 1), "total": round(total, 1)},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, default=list) + "\n")
    if cap and xo:
        md = results_markdown(results)
        (out / "results.md").write_text(md)
        if not args.quick:
            write_generated_block(HERE / "README.md", md)
    say(f"wrote {out / 'results.json'} in {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
