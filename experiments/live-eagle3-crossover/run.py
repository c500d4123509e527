#!/usr/bin/env python
"""The EAGLE3 crossover on a real vLLM CPU server with a real EAGLE3 drafter: measured vs predicted.

Regenerates every number in README.md and the figure beside it::

    flock /tmp/simcap-cpu.lock python experiments/live-eagle3-crossover/run.py      # servers, then the report
    python experiments/live-eagle3-crossover/run.py --report-only                   # results.json -> README, figure

The servers (``examples/servers/cpu-tiny-eagle3.yaml``): the tiny dense Llama with the tiny
EAGLE3 head ``.ci/vllm-cpu-setup`` builds, k = 3, 32 sequences, vLLM's synthetic acceptance at
two per-position schedules of the same shape: the field's acceptance length (2.27) and a longer
one (2.99) where speculation pays at more clients. For each schedule and each server instance,
:func:`~simcap.live.crossover_arms.live_crossover` starts the EAGLE3 server, calibrates its
profile at 1-4 clients (its per-step log, the roofline form on the machine's measured
bandwidth and FLOPs: the catalog's ``cpu-intel-xeon-avx512bf16-2vcpu``), measures every concurrency, then does the same with
the server without speculation (its own profile). The prediction is ``simcap crossover`` with
each arm priced by its own server's profile and the acceptance the server counted at 1 client.
Beside it: the linear form refitted from the same recorded calibration runs, and one profile
(the speculative server's) for both arms. Nothing measured above 4 clients is fed to any. Each instance starts new servers: the spread over
instances is the servers' own run-to-run band.

The acceptance model is checked too: at every concurrency, the speculative server's per-position
counters (``vllm:spec_decode_num_accepted_tokens_per_pos``) and simcap's own counters of the same
scenario simulated with the configured rates (a seed of its own per run), each against the
configured rates, as z-scores of a binomial proportion over the drafts counted.

Raw records, server logs and profiles go to ``--data`` (default: a folder in the system's temp
directory); results.json, results.md, the figure and the README's results block are written here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from simcap.config.scenario import load_scenario  # noqa: E402
from simcap.live.crossover_arms import live_crossover  # noqa: E402
from simcap.live.launch import load_server_config, parse_server_config  # noqa: E402
from simcap.live.machine import cpu_info, describe_cpu  # noqa: E402
from simcap.metrics.report import write_generated_block  # noqa: E402
from simcap.studies.crossover import arm_scenarios  # noqa: E402

SERVER_YAML = REPO / "examples" / "servers" / "cpu-tiny-eagle3.yaml"
SCENARIO_YAML = REPO / "examples" / "cpu-tiny-eagle3.yaml"
# Unconditional per-position rates (P(first i+1 drafts accepted)), a published EAGLE3 head's
# shape (0.749 / 0.547 / 0.402) scaled to each acceptance length.
SCHEDULES = {
    "field": (0.56, 0.41, 0.30),   # 2.27: the field's measured 2.24-2.28
    "longer": (0.88, 0.64, 0.47),  # 2.99
}
CONCURRENCIES = (1, 2, 4, 8, 16, 32)
# The roofline form: the tiny dense model's catalog shape (the EAGLE3 head is the form's default
# draft: one dense layer of the target's width and an LM head), compute and memory combined by max.
ROOFLINE_MODEL = "tiny-llama-cpu"
ROOFLINE_COMBINE = "max"
CALIBRATE_UP_TO = 4
GOAL_POINTS = 10.0  # predicted gain within 10 points of the measured (or the band, where wider)


def run_instance(name: str, rates: tuple[float, ...], instance: int, loads: tuple[int, ...], data: Path,
                 requests_per_client: int, calibration_requests: int, roofline: dict[str, Any]) -> dict[str, Any]:
    raw = json.loads(json.dumps(load_server_config(SERVER_YAML)[0].model_dump(mode="json")))
    raw["speculative"]["synthetic_acceptance_rates"] = list(rates)
    config = parse_server_config(raw, str(SERVER_YAML))
    scenario = load_scenario(SCENARIO_YAML, [f"speculative.acceptance_rates={json.dumps(list(rates))}"])
    out = data / f"{name}-{instance}"
    lc = live_crossover(
        scenario, config, list(loads), base_dir=SERVER_YAML.parent, calibrate_up_to=CALIBRATE_UP_TO,
        calibration_requests=calibration_requests, requests_per_client=requests_per_client,
        prompt_period=None, out_dir=out, progress=lambda m: print(f"  [{name} #{instance}] {m}", flush=True),
        roofline=roofline,
    )  # fmt: skip
    result = lc.to_dict()
    result["form"] = "roofline"
    result["linear"] = linear_prediction(lc, scenario, loads, out, requests_per_client)
    result["acceptance_check"] = server_acceptance(rates, result, loads)
    (out / "crossover.json").write_text(json.dumps(result, indent=1))
    return {"schedule": name, "rates": list(rates), "instance": instance, **slim(result)}


def linear_prediction(lc, scenario, loads, out: Path, requests_per_client: int) -> dict[str, Any]:
    """The same crossover predicted with the linear form: each arm's profile refitted from its
    recorded calibration runs (the same steps and client records the roofline fit saw,
    :func:`simcap.live.calibration.fit_calibration_log`), the same acceptance fed."""
    import yaml

    from simcap.calibrate import Recipe, log_step_samples, profile_dict
    from simcap.live.calibration import fit_calibration_log
    from simcap.live.crossover_arms import _predicted_scenario, compare
    from simcap.live.recording import load_run
    from simcap.studies.crossover import find_crossover

    paths = {}
    for arm in ("spec", "baseline"):
        runs = [load_run(p) for p in sorted((out / f"calibration-{arm}").glob("phase*.run.json.gz"))]
        lines = [line for r in runs for line in r.iteration_lines]
        records = [rec for r in runs for rec in r.run.records]
        saved = yaml.safe_load((out / f"profile-{arm}.yaml").read_text())
        k = (saved.get("speculative") or {}).get("num_speculative_tokens", 0)
        fitted = fit_calibration_log(log_step_samples(lines, k), lines, records, k, bootstrap=0, noise=None)
        linear = profile_dict(fitted.fit, Recipe(name=f"{saved['name']} (linear refit)", engine=saved["engine"],
                                                 speculative=saved.get("speculative")))
        paths[arm] = out / f"profile-{arm}-linear.yaml"
        paths[arm].write_text(yaml.safe_dump(linear, sort_keys=False))
    lowest = next(p for p in lc.points if p.arm == "spec" and p.concurrency == loads[0])
    spec_sc, _ = _predicted_scenario(scenario, {"profile": str(paths["spec"])}, lowest, loads[0])
    base_sc, _ = _predicted_scenario(scenario, {"profile": str(paths["baseline"])}, None, loads[0])
    predicted = find_crossover(spec_sc, list(loads), requests_per_client=requests_per_client, baseline=base_sc)
    compared = compare(lc.measured, predicted)
    return {"points": compared["points"], "crossover": compared["crossover"]["predicted"],
            "step_time": {arm: {k: v for k, v in yaml.safe_load(paths[arm].read_text())["step_time"].items()
                                if k not in ("bootstrap", "noise", "ci")} for arm in paths}}


def slim(result: dict[str, Any]) -> dict[str, Any]:
    """What the report needs: no per-request records, no bootstrap sets."""
    cal = result["calibration"]
    keep_cal = {arm: {k: c[k] for k in ("concurrencies", "requests", "source", "step_time", "num_gpu_blocks",
                                         "notes", "wall_s")}
                for arm, c in (("spec", cal), ("baseline", cal["baseline"]))}
    for c in keep_cal.values():
        c["step_time"] = {k: v for k, v in c["step_time"].items() if k not in ("bootstrap", "noise")}
    return {
        "form": result["form"],
        "comparison": result["comparison"],
        "linear": result["linear"],
        "calibration": {**keep_cal, "acceptance_fed": cal["acceptance_fed"]},
        "runs": [{k: r[k] for k in ("arm", "concurrency", "completed", "failed", "wall_duration_s", "disturbed",
                                    "server")} for r in result["runs"]],
        "servers": [{k: s[k] for k in ("arm", "startup_s")} for s in result["servers"]],
        "acceptance_check": result["acceptance_check"],
        "notes": result["notes"],
        "wall_s": result["wall_s"],
    }


def server_acceptance(rates, result, loads) -> list[dict[str, Any]]:
    """Per concurrency: the speculative server's per-position acceptance (its counters over
    that run) as z-scores against the configured rates."""
    rows = []
    spec_runs = {r["concurrency"]: r for r in result["runs"] if r["arm"] == "spec"}
    for c in loads:
        server = spec_runs[c]["server"]
        drafts = server.get("spec_decode_num_drafts") or 0
        live = server.get("spec_decode_acceptance_rates") or []
        rows.append({"concurrency": c, "server": {"drafts": drafts, "per_position": live,
                                                  "z": zscores(live, rates, drafts)}})
    return rows


def simcap_acceptance(instance: dict[str, Any], requests_per_client: int) -> None:
    """simcap's side of the check, beside each of the instance's server rows: the same
    speculative arm scenario (configured rates, the point's concurrency and requests)
    simulated, its own counters as z-scores. Each run gets its own seed, so that runs pooled
    are independent draws."""
    from simcap.fleet.run import simulate

    rates = instance["rates"]
    scenario = load_scenario(SCENARIO_YAML, [f"speculative.acceptance_rates={json.dumps(rates)}"])
    for row in instance["acceptance_check"]:
        c = row["concurrency"]
        seed = 1000 * (list(SCHEDULES).index(instance["schedule"]) + 1) + 100 * instance["instance"] + c
        spec_sc, _, _ = arm_scenarios(scenario.model_copy(update={"seed": seed}), concurrency=c,
                                      requests_per_client=requests_per_client)
        sim = simulate(spec_sc).summary.spec_decode or {}
        per_pos = sim.get("per_position_rate") or []
        row["simcap"] = {"seed": seed, "drafts": sim.get("num_drafts"), "per_position": per_pos,
                         "z": zscores(per_pos, rates, sim.get("num_drafts") or 0)}


def zscores(observed, expected, n) -> list[float | None]:
    out = []
    for o, p in zip(observed, expected):
        sd = math.sqrt(p * (1 - p) / n) if n and 0 < p < 1 else None
        out.append(None if sd is None else round((o - p) / sd, 2))
    return out


# --------------------------------------------------------------------------- report


def _band(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


PREDICTIONS = ("roofline", "linear", "one_profile")  # each arm its own profile (two forms); one profile


def _predicted_points(instance: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """Per concurrency: the prediction ``kind`` of one instance (gain, each arm's figures)."""
    if kind == "linear":
        return instance["linear"]["points"]
    rows = []
    for p in instance["comparison"]["points"]:
        g = p["throughput_gain_pct"]
        rows.append({**p, "throughput_gain_pct": {"measured": g["measured"],
                                                  "predicted": g["predicted" if kind == "roofline" else kind]}})
    return rows


def _crossover(instance: dict[str, Any], kind: str) -> dict[str, Any]:
    xo = instance["comparison"]["crossover"]
    return {"roofline": xo["predicted"], "linear": instance["linear"]["crossover"], "one_profile": xo["one_profile"]}[kind]


def summarise(instances: list[dict[str, Any]]) -> dict[str, Any]:
    """Per schedule and concurrency: the measured gain over instances (median, band), and per
    prediction the median predicted gain, its error in points against the median measured, and
    (own-profile forms) each arm's throughput and TPOT error."""
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        mine = [i for i in instances if i["schedule"] == name]
        if not mine:
            continue
        rows = []
        for j, c in enumerate(mine[0]["comparison"]["points"]):
            gm = [i["comparison"]["points"][j]["throughput_gain_pct"]["measured"] for i in mine]
            med_m, lo_m, hi_m = _band(gm)
            band = hi_m - lo_m
            row: dict[str, Any] = {
                "concurrency": c["concurrency"], "held_out": c["concurrency"] > CALIBRATE_UP_TO,
                "gain_measured": [round(med_m, 1), round(lo_m, 1), round(hi_m, 1)], "band_points": round(band, 1),
            }
            for kind in PREDICTIONS:
                pts = [_predicted_points(i, kind)[j] for i in mine]
                gp = [p["throughput_gain_pct"]["predicted"] for p in pts]
                err = statistics.median(gp) - med_m
                entry: dict[str, Any] = {"gain": [round(x, 1) for x in _band(gp)], "error_points": round(err, 1),
                                         "within_goal": abs(err) <= max(GOAL_POINTS, band)}
                if kind != "one_profile":
                    for arm in ("spec", "baseline"):
                        for metric, key in (("tokens_per_s", f"{arm}_tokens_per_s"), ("tpot", f"{arm}_tpot_mean_s")):
                            m = statistics.median(p[key]["measured"] for p in pts)
                            pr = statistics.median(p[key]["predicted"] for p in pts)
                            entry[f"{arm}_{metric}_error_pct"] = round(100 * (pr - m) / m, 1) if m else None
                row[kind] = entry
            rows.append(row)
        crossovers = [{"measured": i["comparison"]["crossover"]["measured"],
                       **{kind: _crossover(i, kind) for kind in PREDICTIONS}} for i in mine]
        out[name] = {"rates": mine[0]["rates"], "acceptance_length": round(1 + sum(mine[0]["rates"]), 2),
                     "instances": len(mine), "points": rows, "crossovers": crossovers}
    return out


def _where(c: dict[str, Any]) -> str:
    return f"{c['value']:.2f} ({c['between'][0]}-{c['between'][1]})" if c["status"] == "found" else "none in range"


LABELS = {"roofline": "roofline form", "linear": "linear form", "one_profile": "one profile (roofline) for both arms"}


def render(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"Machine: {meta['machine']}. {meta['instances']} server instances per schedule; "
             f"{meta['wall_s'] / 60:.0f} min of server time in all. Concurrencies "
             f"{', '.join(str(c) for c in meta['concurrencies'])}; each arm calibrated at 1-{CALIBRATE_UP_TO} "
             f"clients, so {', '.join(str(c) for c in meta['concurrencies'] if c > CALIBRATE_UP_TO)} are "
             f"predicted blind. Roofline form: {meta['roofline']['hardware_name']} as the hardware, "
             f"{meta['roofline']['model']} as the model, combine {meta['roofline']['combine']}.", ""]

    def band(v):
        return f"{v[0]:+.1f} [{v[1]:+.1f}, {v[2]:+.1f}]"

    for name, s in summary.items():
        lines += [f"**Acceptance length {s['acceptance_length']}** (synthetic rates {s['rates']}): throughput "
                  "gain of EAGLE3 over no speculation, %, median over instances [min, max]; error: median "
                  "predicted minus median measured, in points (off: beyond both 10 points and the band)", "",
                  "| clients | measured | band | roofline form | error | linear form | error | one profile | error |",
                  "|---:|---|---:|---|---:|---|---:|---|---:|"]
        for r in s["points"]:
            held = "" if r["held_out"] else " (fit)"
            cells = []
            for kind in PREDICTIONS:
                e = r[kind]
                cells += [band(e["gain"]), f"{e['error_points']:+.1f}" + ("" if e["within_goal"] else " **off**")]
            lines.append(f"| {r['concurrency']}{held} | {band(r['gain_measured'])} | {r['band_points']:.1f} | "
                         + " | ".join(cells) + " |")
        lines += ["", "Each arm's error, % (median predicted / median measured - 1), roofline | linear:", "",
                  "| clients | spec tok/s | baseline tok/s | spec TPOT | baseline TPOT |", "|---:|---|---|---|---|"]
        for r in s["points"]:
            cells = [" / ".join(f"{r[kind][f'{arm}_{metric}_error_pct']:+.1f}" for kind in ("roofline", "linear"))
                     for arm, metric in (("spec", "tokens_per_s"), ("baseline", "tokens_per_s"), ("spec", "tpot"),
                                         ("baseline", "tpot"))]
            lines.append(f"| {r['concurrency']} | " + " | ".join(cells) + " |")
        lines += ["", "Throughput crossover (clients), per instance: " + "; ".join(
            f"measured {_where(c['measured'])}, roofline {_where(c['roofline'])}, linear {_where(c['linear'])}, "
            f"one profile {_where(c['one_profile'])}" for c in s["crossovers"]), ""]
    checks = meta.get("acceptance_z")
    if checks:
        lines += ["**Acceptance model**: per-position acceptance against the configured synthetic rates, as "
                  "z-scores of a binomial proportion over the drafts counted (|z| > 2 in about 5% of "
                  "points, > 3 in about 0.3%, by chance alone).", "",
                  "| counter | position-points | \\|z\\| > 2 | \\|z\\| > 3 | max \\|z\\| | pooled over all runs: "
                  "per position (z) |", "|---|---:|---:|---:|---:|---|"]
        for who, label in (("server", "vLLM's (`spec_decode_num_accepted_tokens_per_pos`)"),
                           ("simcap", "simcap's, same scenarios simulated")):
            c = checks[who]
            pooled = "; ".join(
                f"{name}: " + ", ".join(f"{o:.3f} ({z:+.1f})" for o, z in zip(p["per_position"], p["z"]))
                + f" of {p['drafts']:,.0f} drafts" for name, p in c["pooled"].items())
            lines.append(f"| {label} | {c['count']} | {c['over_2']} | {c['over_3']} | {c['max_abs_z']:.2f} | {pooled} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(5.4 * len(summary), 4.2), sharey=True, squeeze=False)
    for ax, (name, s) in zip(axes[0], summary.items()):
        c = [r["concurrency"] for r in s["points"]]
        series = [("measured (median; band over instances)", [r["gain_measured"] for r in s["points"]], "black")]
        series += [(f"predicted, {LABELS[kind]}", [r[kind]["gain"] for r in s["points"]], color)
                   for kind, color in (("roofline", "tab:blue"), ("linear", "tab:green"), ("one_profile", "tab:orange"))]
        for label, values, color in series:
            ax.plot(c, [v[0] for v in values], marker="o", color=color, label=label)
            ax.fill_between(c, [v[1] for v in values], [v[2] for v in values], color=color, alpha=0.15)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvspan(min(c) * 0.9, CALIBRATE_UP_TO, color="grey", alpha=0.08)
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel(f"clients (closed loop); shaded: calibrated at 1-{CALIBRATE_UP_TO}")
        ax.set_title(f"EAGLE3 on vLLM CPU, acceptance length {s['acceptance_length']}")
    axes[0][0].set_ylabel("throughput gain of speculation, %")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_summary(instances: list[dict[str, Any]]) -> dict[str, Any]:
    """Per counter (vLLM's, simcap's): the z-scores of every run's positions (how many past 2
    and 3), and per schedule the per-position rates pooled over all its runs' drafts with their
    z-scores against the configured rates."""
    out: dict[str, Any] = {}
    for who in ("server", "simcap"):
        zs = [abs(z) for i in instances for row in i["acceptance_check"] for z in row[who]["z"] if z is not None]
        pooled = {}
        for name in SCHEDULES:
            mine = [i for i in instances if i["schedule"] == name]
            if not mine:
                continue
            rates = mine[0]["rates"]
            n = sum(row[who]["drafts"] or 0 for i in mine for row in i["acceptance_check"])
            acc = [sum((row[who]["drafts"] or 0) * (row[who]["per_position"] or [0] * len(rates))[j]
                       for i in mine for row in i["acceptance_check"]) for j in range(len(rates))]
            observed = [round(a / n, 4) for a in acc] if n else []
            pooled[name] = {"drafts": n, "per_position": observed, "configured": rates,
                            "z": zscores(observed, rates, n)}
        out[who] = {"count": len(zs), "max_abs_z": max(zs, default=0.0), "over_2": sum(z > 2 for z in zs),
                    "over_3": sum(z > 3 for z in zs), "pooled": pooled}
    return out


def report(results: dict[str, Any]) -> None:
    for instance in results["instances"]:
        simcap_acceptance(instance, results["meta"]["requests_per_client"])
    summary = summarise(results["instances"])
    meta = {**results["meta"], "acceptance_z": acceptance_summary(results["instances"])}
    results["summary"] = summary
    results["meta"]["acceptance_z"] = meta["acceptance_z"]
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = render(summary, meta)
    (HERE / "results.md").write_text(text + "\n")
    write_generated_block(HERE / "README.md", text)
    plot(summary, HERE / "gain.png")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--concurrency", default=",".join(str(c) for c in CONCURRENCIES))
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--calibration-requests", type=int, default=32)
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "simcap-live-eagle3-crossover")
    ap.add_argument("--hardware", default="cpu-intel-xeon-avx512bf16-2vcpu",
                    help="the roofline form's hardware: a catalog name or a YAML file of one entry (default: "
                         "the machine these results were measured on, as benchmarks/measure_cpu.py measured it)")
    ap.add_argument("--report-only", action="store_true", help="results.json -> README, results.md, figure")
    args = ap.parse_args()
    if args.report_only:
        report(json.loads((HERE / "results.json").read_text()))
        return
    loads = tuple(int(c) for c in args.concurrency.split(","))
    from simcap.calibrate.fit_roofline import roofline_options

    roofline = roofline_options(args.hardware, ROOFLINE_MODEL, combine=ROOFLINE_COMBINE)
    started = time.monotonic()
    instances = []
    for instance in range(args.instances):  # instances interleaved over schedules: drift hits both alike
        for name in args.schedules.split(","):
            print(f"{name} schedule, instance {instance}", flush=True)
            instances.append(run_instance(name, SCHEDULES[name], instance, loads, args.data,
                                          args.requests_per_client, args.calibration_requests, roofline))
            partial = {"meta": {"instances": instance + 1}, "instances": instances}
            (args.data / "partial.json").write_text(json.dumps(partial, indent=1))
    meta = {
        "machine": describe_cpu(cpu_info()), "instances": args.instances, "concurrencies": list(loads),
        "requests_per_client": args.requests_per_client, "calibration_requests": args.calibration_requests,
        "calibrate_up_to": CALIBRATE_UP_TO, "wall_s": round(time.monotonic() - started, 1),
        "roofline": {"hardware_name": args.hardware, "hardware": roofline["hardware"],
                     "model": ROOFLINE_MODEL, "combine": ROOFLINE_COMBINE},
        "command": "python experiments/live-eagle3-crossover/run.py " + " ".join(
            "DATA_DIR" if a == str(args.data) else a for a in sys.argv[1:]),  # no machine path
    }
    report({"meta": meta, "instances": instances})


if __name__ == "__main__":
    main()
