#!/usr/bin/env python
"""The field's capacity method on the 910B4 profile: safe rate and saturation rate (PREDICTED).

Regenerates every number in README.md and the figures beside it::

    python experiments/ascend910b4-capacity/run.py              # writes results.json and PNGs here
    python experiments/ascend910b4-capacity/run.py --profile P  # another profile (e.g. a draft)

Two passes, both with 300 s of Poisson arrivals per run and two replicates (seeds 0 and 1):

1. search: bracket and bisect the safe rate (relative tolerance 2%), probe the saturation
   rate, and rerun the search per bootstrap coefficient set of the profile for an interval;
   in the interval's searches a run stops once its TTFT p95 can no longer hold, after its
   arrival window (:mod:`simcap.simulation.early_stop`; each search takes the same path as with every
   run completed; the main search's runs all complete, to report their p95s);
2. the field's grid: nine requested rates evenly spaced from 0.2x to 1.2x the saturation
   rate found in pass 1, judged by the field's rule (highest rate that passed in both runs,
   every lower rate passing too); every run completes, so the table shows all its p95s;
3. the model-form interval (calibration/model_form.json, simcap.accuracy.model_form): the
   safe rate searched again under the SLO limits moved by each metric's model-form error at
   the safe rate's distance past the profile's fitted rows (requests running, its
   provenance.fit_load), strict and loose, and the saturation rate times the throughput
   family's interval (what `simcap capacity --model-form` prints).

Nothing here is tuned to a field figure: the field withheld the safe and saturation rates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import simcap
from simcap.accuracy.model_form import FormError, capacity_interval, profile_fit_load
from simcap.metrics.report import write_generated_block
from simcap.studies.capacity import find_capacity
from simcap.studies.plots import plot_capacity

HERE = Path(__file__).resolve().parent
DURATION_S = 300.0
REPLICATES = 2
ROOT = HERE.parents[1]
MODEL_FORM = ROOT / "calibration" / "model_form.json"


def model_form_interval(scenario, search, workers: int) -> dict | None:
    """Pass 3 of the module doc: the safe and saturation rates' model-form interval."""
    band = capacity_interval(FormError.read(MODEL_FORM), scenario, search, profile_fit_load(scenario.profile_file),
                             duration_s=DURATION_S, replicates=REPLICATES, workers=workers)
    return None if band is None else {"record": str(MODEL_FORM.relative_to(ROOT)), **band}


def update_readme(markdown: str) -> None:
    write_generated_block(HERE / "README.md", markdown)


def _r(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    return "stopped" if x is None else f"{x * 1e3:,.0f}"


def _ms1(x: float | None) -> str:
    return "stopped" if x is None else f"{x * 1e3:.1f}"


def results_markdown(res: dict) -> str:
    pred, search = res["prediction"], res["search"]
    lo_hi = pred["safe_rate_interval"]
    interval = f"{_r(lo_hi[0])}-{_r(lo_hi[1])}" if lo_hi else "-"
    prof = res["provenance"].get("profile") or {}
    lines = [
        "| predicted (req/s, measured arrival rate) | value |",
        "|---|---|",
        f"| safe rate, TTFT p95 <= 2 s and TPOT p95 <= 50 ms (bisection to 2%) | **{_r(pred['safe_rate'])}** |",
        f"| its interval over {search.get('safe_rate_interval_sets', 0)} profile bootstrap sets | {interval} |",
        f"| safe rate, TTFT p95 alone | {_r(search['safe_rate_by_slo'].get('ttft_p95'))} |",
        f"| safe rate by the field's nine-point grid (rule: passed in both runs) | {_r(pred['safe_rate_field_grid'])} |",
        f"| saturation rate (server's maximum completion rate) | **{_r(pred['saturation_rate'])}** |",
        "",
        "The field's nine points as simcap runs them (requested rates 0.2x-1.2x the saturation "
        "rate; `*` = too few samples for p95; every run goes to its last request):",
        "",
        "| requested | measured (run 1 / 2) | TTFT p95 ms (1 / 2) | TPOT p95 ms (1 / 2) | pass | kept up |",
        "|---|---|---|---|---|---|",
    ]
    by_rate: dict[float, list[dict]] = {}
    for p in res["points_grid"]:
        by_rate.setdefault(p["rate"], []).append(p)
    for rate in sorted(by_rate):
        runs = sorted(by_rate[rate], key=lambda p: p["replicate"])

        def cell(key: str, fmt) -> str:
            return " / ".join(
                fmt(p[key]) + ("" if p["samples_adequate"].get(key, True) else "*")
                if key in p["samples_adequate"] else fmt(p[key]) for p in runs
            )

        lines.append(
            f"| {rate:.3f} | {cell('measured_rate', lambda v: f'{v:.2f}')} | "
            f"{cell('ttft_p95', _ms)} | {cell('tpot_p95', _ms1)} | "
            f"{'yes' if all(p['pass'] for p in runs) else 'NO'} | "
            f"{'yes' if not any(p['saturated'] for p in runs) else 'no'} |"
        )
    mf = res.get("model_form")
    if mf:
        lo, hi = mf["safe_rate_interval"]
        lines += ["", f"Model-form interval ({mf['level']:.0%}, `{mf['record']}`): at the safe rate "
                  f"{mf['load_at_safe_rate']:.1f} requests run in the batch, against up to {mf['fit_load']:.1f} "
                  "in the recipe's rows; the safe rate searched under the SLO limits moved by the "
                  "model-form error ("
                  + ", ".join(f"{k} {mf['slo_strict'][k] * 1e3:,.0f}-{mf['slo_loose'][k] * 1e3:,.0f} ms" for k in mf["slo_strict"])
                  + f") is {_r(lo)}-{_r(hi)} req/s; the saturation rate's interval is "
                  f"{_r(mf['saturation_rate_interval'][0])}-{_r(mf['saturation_rate_interval'][1])} req/s."]
    per_set = [r for r in search.get("safe_rate_interval_safe_rates") or [] if r is not None]
    if per_set:
        lines += ["", "Safe rate per bootstrap coefficient set (req/s, sorted): "
                  + ", ".join(f"{r:.2f}" for r in sorted(per_set))
                  + f"; median {float(np.median(per_set)):.2f}."]
    near = res.get("near_boundary_search") or {}
    tpots = [p["tpot_p95"] for runs in near.values() for p in runs if p["tpot_p95"] is not None]
    if tpots:
        lines += ["", f"TPOT p95 at the predicted boundary (the safe rate and the next rate "
                  f"searched): {min(tpots) * 1e3:.1f}-{max(tpots) * 1e3:.1f} ms (field, measured "
                  "near its boundary: 49-52 ms)."]
    w = res["wall_s"]
    lines += [
        "",
        f"Profile `{prof.get('path')}` sha256 `{str(prof.get('sha256'))[:12]}`; simcap "
        f"{res['provenance'].get('simcap_version')}. Wall time on a shared 2-core machine: "
        f"search with interval {w['search_with_interval']:.0f} s, nine-point grid "
        f"{w['grid']:.0f} s, total {w['total']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def summary(result) -> dict:
    d = result.to_dict()
    keep = ("safe_rate", "safe_offered_rate", "saturation_rate", "saturation_bracket",
            "safe_rate_interval", "safe_rate_by_slo", "notes")
    out = {k: d[k] for k in keep}
    info = d.get("safe_rate_interval_info")
    if info:
        out["safe_rate_interval_sets"] = info["num_sets"]
        out["safe_rate_interval_safe_rates"] = info["safe_rates"]
        out["safe_rate_interval_runs"] = info["num_runs"]
        out["safe_rate_interval_runs_stopped_early"] = info.get("stopped_early")
    return out


def near_boundary(result, safe_offered: float | None) -> dict | None:
    """TPOT p95 and TTFT p95 of the runs at the safe rate and the next rate tested above it."""
    if safe_offered is None:
        return None
    rates = sorted({p.rate for p in result.points if p.role != "probe"})
    i = rates.index(safe_offered)
    chosen = rates[i : i + 2]
    return {
        f"{r:.4f}": [
            {"measured_rate": p.measured_rate, "ttft_p95": p.values["ttft_p95"],
             "tpot_p95": p.values["tpot_p95"], "pass": p.passed}
            for p in result.points if p.rate == r and p.role != "probe"
        ]
        for r in chosen
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile file instead of the scenario's")
    parser.add_argument("--form", choices=("linear", "roofline"), default="linear",
                        help="step-time form: linear (the scenario's profile, results here) or "
                             "roofline (the .roofline profile, results in roofline/)")
    parser.add_argument("--out", default=None, help="folder for results.json and figures")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval-sets", type=int, default=8,
                        help="bootstrap coefficient sets for the safe-rate interval")
    args = parser.parse_args()
    if args.form == "roofline" and not args.profile:
        args.profile = str(HERE.parents[1] / "calibration" / "profiles"
                           / "ascend910b4-minimax-m2.7.roofline.yaml")
    if args.out is None:
        args.out = str(HERE if args.form == "linear" else HERE / "roofline")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # (relative to the scenario's folder, where the scenario resolves it: no machine path in
    # the results)
    overrides = ([f"profile={os.path.relpath(Path(args.profile).resolve(), HERE)}"]
                 if args.profile else [])
    scenario = simcap.load_scenario(HERE / "scenario.yaml", overrides)
    slo = dict(scenario.slo)

    t0 = time.perf_counter()
    # Early stop in the interval's runs only: the main search's runs report their TTFT and
    # TPOT p95 (the TPOT at the boundary is the check against the field).
    search = find_capacity(scenario, slo, auto=True, duration_s=DURATION_S,
                           replicates=REPLICATES, workers=args.workers,
                           interval_max_sets=args.interval_sets, early_stop="interval")
    t_search = time.perf_counter() - t0
    print(f"search: safe rate {search.safe_rate} req/s (interval {search.safe_rate_interval}), "
          f"saturation {search.saturation_rate} req/s  [{t_search:.1f} s]")

    mu = search.saturation_rate
    if mu is None:
        raise SystemExit("no saturation found: cannot place the nine-point grid")
    rates = [round(float(r), 3) for r in np.linspace(0.2 * mu, 1.2 * mu, 9)]
    t1 = time.perf_counter()
    # The field's table shows every run's TTFT and TPOT p95: its runs go to the end.
    grid = find_capacity(scenario, slo, rates=rates, duration_s=DURATION_S,
                         replicates=REPLICATES, workers=args.workers, probe_saturation=False,
                         interval=False, early_stop=False)
    t_grid = time.perf_counter() - t1
    print(f"grid {rates}: safe rate {grid.safe_rate} req/s, saturation {grid.saturation_rate} "
          f"req/s  [{t_grid:.1f} s]")

    plot_capacity(
        grid, out / "capacity_grid.png",
        title="910B4 MiniMax-M2.7, 512 in / 256 out, Poisson: the field's nine-rate method "
              f"(2 x {DURATION_S:g} s per rate)",
    )
    plot_capacity(
        search, out / "capacity_search.png",
        title="910B4 MiniMax-M2.7, 512 in / 256 out, Poisson: bisection search "
              "(band: bootstrap interval)",
    )
    t2 = time.perf_counter()
    form_error = model_form_interval(scenario, search, args.workers)
    t_form = time.perf_counter() - t2
    results = {
        "model_form": form_error,
        "prediction": {
            "safe_rate": search.safe_rate,
            "safe_rate_interval": search.safe_rate_interval,
            "saturation_rate": search.saturation_rate,
            "safe_rate_field_grid": grid.safe_rate,
            "saturation_rate_field_grid": grid.saturation_rate,
        },
        "search": summary(search),
        "grid": {"rates": rates, **summary(grid)},
        "near_boundary_search": near_boundary(search, search.safe_offered_rate),
        "near_boundary_grid": near_boundary(grid, grid.safe_offered_rate),
        "points_search": [p.to_dict() for p in search.points],
        "points_grid": [p.to_dict() for p in grid.points],
        "rules": search.to_dict()["rules"],
        "provenance": {
            **search.provenance,
            "command": " ".join(["python experiments/ascend910b4-capacity/run.py", *sys.argv[1:]]),
        },
        "wall_s": {"search_with_interval": t_search, "grid": t_grid, "model_form": t_form,
                   "total": time.perf_counter() - t0},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if out == HERE:
        update_readme(results_markdown(results))
    print(f"wrote {out / 'results.json'}, capacity_grid.png, capacity_search.png "
          f"in {results['wall_s']['total']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
