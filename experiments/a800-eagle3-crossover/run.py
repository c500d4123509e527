"""A800 MiniMax-M3: where does EAGLE3 stop paying? Regenerates results.{json,md} and the figures.

    python experiments/a800-eagle3-crossover/run.py [--bootstrap N] [--form roofline] [--workers N]

1. The main run: ``find_crossovers`` on scenario.yaml (profile a800-minimax-m3, acceptance
   length 2.26) at concurrency 1-128, with and without EAGLE3, per-stream target 60 tok/s.
2. Published vs simulated: the rows the profile was fitted on (no spec at 1-16, EAGLE3 at
   1, 2, 4), with percent errors. These measure the fit, not a prediction.
3. The prediction: EAGLE3 at 8-128 (the field withheld those rows) and the crossover.
4. Sensitivity of the crossover to the acceptance length: 2.24 and 2.28 (the measured range)
   and 2.8 (the vendor's SPEED-Bench figure).
5. Coefficient uncertainty: the crossover under each of the profile's bootstrap coefficient
   sets (if it has them), as a 5-95% range.
6. Model-form uncertainty: the throughput gain's 90% interval at each concurrency from the
   corpus's model-form error (calibration/model_form.json, simcap.accuracy.model_form), each
   arm at its distance past the rows that fitted it (the profile's provenance.fit_load,
   requests running: no-spec rows up to 16 clients, EAGLE3 rows up to 4), and where each end
   of the interval crosses zero (what ``simcap crossover --model-form`` prints).

Nothing here is tuned to anything: the scenario is the profile plus the field's load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from simcap.accuracy.model_form import FormError, crossover_band, profile_fit_load  # noqa: E402
from simcap.config.profiles import load_profile  # noqa: E402
from simcap.config.scenario import StepTimeConfig, load_scenario  # noqa: E402
from simcap.studies.crossover import CrossoverResult, find_crossovers, locate_crossover  # noqa: E402
from simcap.studies.plots import plot_crossover  # noqa: E402

SCENARIO = HERE / "scenario.yaml"
FIELD = ROOT / "calibration" / "data" / "field" / "measurements.json"
CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128]
PER_STREAM_TPS = 60.0
SENSITIVITY = {"measured low": 2.24, "measured high": 2.28, "vendor SPEED-Bench": 2.8}


def pct_err(sim: float | None, pub: float) -> float | None:
    return None if sim is None else (sim / pub - 1.0) * 100.0


def published() -> dict[str, dict[int, dict]]:
    runs = json.loads(FIELD.read_text())["a800_minimax_m3"]["runs"]
    return {arm: {r["concurrency"]: r for r in rows} for arm, rows in runs.items()}


def compare(result: CrossoverResult, pub: dict) -> list[dict]:
    """Published vs simulated for every published row (no_spec 1-16, eagle3 1-4)."""
    rows = []
    by_load = {int(p.load): p for p in result.points}
    for arm, key in (("no_spec", "baseline"), ("eagle3", "spec")):
        for c, row in sorted(pub[arm].items()):
            sim = getattr(by_load[c], key)
            rows.append({
                "arm": arm, "concurrency": c,
                "throughput": {"published": row["throughput"], "simulated": sim.output_tokens_per_s,
                               "error_pct": pct_err(sim.output_tokens_per_s, row["throughput"])},
                "latency_mean": {"published": row["latency_mean"], "simulated": sim.latency_mean_s,
                                 "error_pct": pct_err(sim.latency_mean_s, row["latency_mean"])},
                "latency_p95": {"published": row["latency_p95"], "simulated": sim.latency_p95_s,
                                "error_pct": pct_err(sim.latency_p95_s, row["latency_p95"])},
            })
    return rows


def predictions(result: CrossoverResult, pub: dict) -> list[dict]:
    """EAGLE3 at the concurrencies the field withheld, against both baselines we have."""
    out = []
    for p in result.points:
        c = int(p.load)
        if c in pub["eagle3"]:
            continue
        s, b = p.spec, p.baseline
        meas_base = pub["no_spec"].get(c)
        out.append({
            "concurrency": c,
            "eagle3_throughput": s.output_tokens_per_s,
            "eagle3_latency_mean": s.latency_mean_s,
            "eagle3_latency_p95": s.latency_p95_s,
            "eagle3_tpot_mean": s.tpot_mean_s,
            "eagle3_per_stream_tps": s.per_stream_tps_mean,
            "sim_no_spec_throughput": b.output_tokens_per_s,
            "gain_vs_sim_no_spec_pct": p.gain_pct["throughput"],
            "gain_vs_published_no_spec_pct": (
                None if meas_base is None else pct_err(s.output_tokens_per_s, meas_base["throughput"])
            ),
        })
    return out


def crossover_vs_published(result: CrossoverResult, pub: dict) -> dict:
    """The crossover against the PUBLISHED no-spec rows (1-16): published EAGLE3 gains at
    1, 2, 4, predicted EAGLE3 throughput at 8 and 16. What the field can check directly."""
    loads, gains = [], []
    for p in result.points:
        c = int(p.load)
        base = pub["no_spec"].get(c)
        if base is None:
            continue
        spec = pub["eagle3"][c]["throughput"] if c in pub["eagle3"] else p.spec.output_tokens_per_s
        loads.append(c)
        gains.append(pct_err(spec, base["throughput"]))
    out = locate_crossover(loads, gains)
    out["gains"] = {str(c): g for c, g in zip(loads, gains)}
    out["sources"] = "EAGLE3: published at 1, 2, 4, simulated at 8, 16; no spec: published"
    return out


def bootstrap_scenarios(scenario_path: Path, n: int) -> tuple[list, set[str]]:
    """The scenario under each bootstrap coefficient set the profile ships (first n), and the
    set keys that are not step-time coefficients."""
    data = yaml.safe_load(scenario_path.read_text())
    profile, _ = load_profile((scenario_path.parent / data["profile"]).resolve())
    sets = profile.bootstrap or []
    if n <= 0:
        return [], set()
    fields = set(StepTimeConfig.model_fields)
    scenarios, ignored = [], set()
    for coef in sets[:n]:
        overrides = []
        for k, v in coef.items():
            if k in fields or k.startswith("efficiency."):
                overrides.append(f"step_time.{k}={v!r}")
            else:
                ignored.add(k)
        scenarios.append(load_scenario(scenario_path, overrides))
    return scenarios, ignored


def bootstrap_crossovers(results: list[CrossoverResult], ignored: set[str]) -> dict | None:
    """The crossover under each bootstrap coefficient set, as a 5-95% range."""
    if not results:
        return None
    values = [r.crossover["value"] for r in results]
    found = [v for v in values if v is not None]
    return {
        "sets_used": len(values),
        "found": len(found),
        "p05": float(np.percentile(found, 5)) if found else None,
        "p50": float(np.percentile(found, 50)) if found else None,
        "p95": float(np.percentile(found, 95)) if found else None,
        "values": values,
        "ignored_keys": sorted(ignored),
    }


MODEL_FORM = ROOT / "calibration" / "model_form.json"


def model_form_band(result: CrossoverResult, scenario) -> dict:
    """The gain's model-form interval per concurrency (step 6 of the module doc; what
    ``simcap crossover --model-form`` prints)."""
    fit = {"eagle3": profile_fit_load(scenario.profile_file, "speculative"),
           "no-spec": profile_fit_load(scenario.profile_file, "plain")}
    band = crossover_band(FormError.read(MODEL_FORM), result, fit["eagle3"], fit["no-spec"])
    return {"fit_load": fit, "record": str(MODEL_FORM.relative_to(ROOT)), **band}


def f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(out: dict) -> str:
    lines = [
        "<!-- generated by run.py; do not edit by hand -->",
        f"Profile: `{out['profile']['path']}` ({out['profile']['name']}, sha256 "
        f"{out['profile']['sha256'][:12]}); scenario sha256 {out['scenario_sha256'][:12]}, seed 0; "
        f"simcap {out['simcap_version']}. Request counts: max(20, 8 x concurrency).",
        "",
        "### Published vs simulated (the rows the profile was fitted on)",
        "",
        "| arm | conc. | tok/s pub | tok/s sim | err % | mean s pub | mean s sim | err % | p95 s pub | p95 s sim | err % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["published_vs_simulated"]:
        t, m, p = r["throughput"], r["latency_mean"], r["latency_p95"]
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {t['published']:.1f} | {f(t['simulated'])} | "
            f"{f(t['error_pct'], '+.1f')} | {m['published']:.2f} | {f(m['simulated'], '.2f')} | "
            f"{f(m['error_pct'], '+.1f')} | {p['published']:.2f} | {f(p['simulated'], '.2f')} | "
            f"{f(p['error_pct'], '+.1f')} |"
        )
    errs = [abs(r[k]["error_pct"]) for r in out["published_vs_simulated"]
            for k in ("throughput", "latency_mean") if r[k]["error_pct"] is not None]
    lines += ["", f"Mean |error| over throughput and mean latency: {np.mean(errs):.1f}% "
              f"(max {np.max(errs):.1f}%).", ""]
    lines += [
        "### PREDICTION: EAGLE3 at the withheld concurrencies (acceptance length 2.26)",
        "",
        "| conc. | EAGLE3 tok/s | mean s | p95 s | TPOT ms | tok/s per stream | sim no-spec tok/s | gain vs sim no-spec | gain vs published no-spec |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["prediction"]:
        lines.append(
            f"| {r['concurrency']} | {r['eagle3_throughput']:.1f} | {f(r['eagle3_latency_mean'], '.2f')} | "
            f"{f(r['eagle3_latency_p95'], '.2f')} | {f(r['eagle3_tpot_mean'] and r['eagle3_tpot_mean'] * 1e3, '.0f')} | "
            f"{f(r['eagle3_per_stream_tps'])} | {r['sim_no_spec_throughput']:.1f} | "
            f"{f(r['gain_vs_sim_no_spec_pct'], '+.1f')}% | {f(r['gain_vs_published_no_spec_pct'], '+.1f')}"
            f"{'%' if r['gain_vs_published_no_spec_pct'] is not None else ''} |"
        )
    lines += ["", "### Crossover (throughput gain crosses zero; linear in log2 concurrency)", "",
              "| acceptance length | crossover (clients) | between | gain at 1 / 2 / 4 / 8 % |",
              "|---|---|---|---|"]
    for label, s in out["sensitivity"].items():
        g = s["gains"]
        lines.append(
            f"| {s['acceptance_length']} ({label}) | "
            f"{f(s['crossover']['value'], '.2f') if s['crossover']['value'] else 'none in range'} | "
            f"{s['crossover']['between'] or '-'} | "
            f"{' / '.join(f(g.get(str(c)), '+.0f') for c in (1, 2, 4, 8))} |"
        )
    b = out.get("bootstrap")
    if b:
        lines += ["", f"Coefficient uncertainty (profile bootstrap, {b['sets_used']} sets, "
                  f"{b['found']} with a crossover in range): crossover 5-50-95% = "
                  f"{f(b['p05'], '.2f')} / {f(b['p50'], '.2f')} / {f(b['p95'], '.2f')} clients."]
    mf = out.get("model_form")
    if mf:
        def cross(c: dict) -> str:
            return f"{c['value']:.1f} clients" if c["value"] else "none in 1-128"

        lines += ["", f"Model-form uncertainty ({mf['level']:.0%}, `{mf['record']}`; fitted at up to "
                  f"{mf['fit_load']['no-spec']:.1f} requests running without speculation and "
                  f"{mf['fit_load']['eagle3']:.1f} with EAGLE3): throughput gain % [interval] at "
                  + ", ".join(f"{int(r['load'])}: {r['gain_pct']:+.0f} [{r['low_pct']:+.0f}, {r['high_pct']:+.0f}]"
                              for r in mf["points"])
                  + f". Crossover of the pessimistic end: {cross(mf['crossover_low'])}; of the optimistic "
                  f"end: {cross(mf['crossover_high'])}; the gain's sign is undecided at "
                  f"{', '.join(str(int(x)) for x in mf['undecided']) or 'no tested concurrency'}."]
    v = out["crossover_vs_published_no_spec"]
    g = v["gains"]
    lines += ["", "Against the PUBLISHED no-spec rows instead of the simulated ones (EAGLE3 published at "
              "1, 2, 4 and predicted at 8, 16): gains "
              + " / ".join(f"{c}: {f(g[c], '+.1f')}%" for c in g)
              + f"; crossover {f(v['value'], '.2f') if v['value'] else 'none in range'} clients."]
    t = out["per_stream_target"]
    lines += ["", f"Per-stream target {t['target_tps']:g} tok/s (mean over requests): highest tested "
              f"concurrency with EAGLE3 {t['spec']['max_load'] or 'none'}, without "
              f"{t['baseline']['max_load'] or 'none (below it even at 1 client)'}."]
    lines.append(f"\nWall time: {out['wall_s']:.1f} s.")
    return "\n".join(lines) + "\n"


def sensitivity_plot(out: dict, pub: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for label, s in out["sensitivity"].items():
        loads = [int(c) for c in s["gains"]]
        ax.plot(loads, list(s["gains"].values()), "o-", label=f"L = {s['acceptance_length']} ({label})")
    meas = [(c, (pub["eagle3"][c]["throughput"] / pub["no_spec"][c]["throughput"] - 1) * 100)
            for c in sorted(pub["eagle3"])]
    ax.plot([c for c, _ in meas], [g for _, g in meas], "k*", ms=12, label="published (fitted on)")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(CONCURRENCIES)
    ax.set_xticklabels([str(c) for c in CONCURRENCIES])
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel("EAGLE3 throughput gain (%)")
    ax.set_title("A800 MiniMax-M3: EAGLE3 throughput gain vs acceptance length (simulated)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", type=int, default=40,
                    help="bootstrap coefficient sets to propagate (0: skip)")
    ap.add_argument("--form", choices=("linear", "roofline"), default="linear",
                    help="step-time form of the profile: linear (scenario.yaml, results here) "
                         "or roofline (scenario.roofline.yaml, results in roofline/)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--scenario", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=2,
                    help="worker processes running the arms (results do not depend on it)")
    args = ap.parse_args()
    if args.scenario is None:
        args.scenario = SCENARIO if args.form == "linear" else HERE / "scenario.roofline.yaml"
    if args.out is None:
        args.out = HERE if args.form == "linear" else HERE / "roofline"

    started = time.perf_counter()
    pub = published()
    scenario = load_scenario(args.scenario)
    lengths = [load_scenario(args.scenario, [f"speculative.acceptance_length={length}"])
               for length in SENSITIVITY.values()]
    boot_scenarios, ignored = bootstrap_scenarios(args.scenario, args.bootstrap)
    # Every arm of every crossover below in one batch of worker processes.
    results = find_crossovers([scenario, *lengths, *boot_scenarios], CONCURRENCIES,
                              per_stream_tps=PER_STREAM_TPS, workers=args.workers)
    main_run = results[0]
    data = main_run.to_dict()
    sens = {"profile, midpoint": main_run, **dict(zip(SENSITIVITY, results[1:1 + len(lengths)]))}
    boot = bootstrap_crossovers(results[1 + len(lengths):], ignored)
    out = {
        "simcap_version": data["provenance"]["simcap_version"],
        "scenario_sha256": data["provenance"]["scenario_sha256"],
        "profile": data["provenance"]["profile"],
        "published_vs_simulated": compare(main_run, pub),
        "prediction": predictions(main_run, pub),
        "crossover": main_run.crossover,
        "latency_crossover": main_run.latency_crossover,
        "per_stream_target": main_run.per_stream_target,
        "sensitivity": {
            label: {
                "acceptance_length": r.provenance["speculative"]["acceptance_length"],
                "crossover": {k: r.crossover[k] for k in ("status", "value", "between")},
                "gains": {str(int(p.load)): p.gain_pct["throughput"] for p in r.points},
                "simulated_acceptance_length": {
                    str(int(p.load)): p.spec.mean_acceptance_length for p in r.points
                },
            }
            for label, r in sorted(sens.items(), key=lambda kv: kv[1].provenance["speculative"]["acceptance_length"])
        },
        "bootstrap": boot,
        "model_form": model_form_band(main_run, scenario),
        "crossover_result": data,
    }
    out["crossover_vs_published_no_spec"] = crossover_vs_published(main_run, pub)
    out["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2, allow_nan=False) + "\n")
    (args.out / "results.md").write_text(markdown(out))
    reference = {
        key: [(c, r["throughput"], r["latency_mean"]) for c, r in sorted(pub[arm].items())]
        for arm, key in (("eagle3", "spec"), ("no_spec", "baseline"))
    }
    plot_crossover(main_run, args.out / "crossover.png", reference=reference,
                   title="A800 MiniMax-M3, EAGLE3 k=3 (L=2.26) vs none: simulated lines, "
                         "published stars (EAGLE3 >= 8 withheld)"
                         + (f"; crossover ~{main_run.crossover['value']:.3g} clients"
                            if main_run.crossover["value"] else ""))
    sensitivity_plot(out, pub, args.out / "sensitivity.png")
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
