"""Linear vs roofline step-time form: fitted on levels 1, 2, 4, predicted at 8, 16, 32.

Usage: PYTHONPATH=. python experiments/cpu-extrapolation/extrapolate.py [--write] [--bootstrap N]

Per model and run (``data/<model>/run<k>/``):

- **Fit** on every logged step of levels 1, 2 and 4 (one run): the linear form
  (``base, per_prefill_token, per_decode_token, mixed_step``: what ``simcap live calibrate``
  fits from an iteration log) with ``simcap.calibrate.fit_step_samples``, and the roofline form
  on the catalog's measured CPU the run was collected on (``run.json``'s CPU:
  ``cpu-amd-epyc-zen4-2vcpu`` or ``cpu-intel-xeon-avx512bf16-2vcpu``) and the model's catalog shape with
  ``simcap.calibrate.fit_roofline.fit_roofline_samples``: ``combine`` sum and max, routing skew
  0 and fitted (MoE). The iteration log has no attended context: each decoding request's is the
  mean over decode request-steps of prompt + tokens generated so far in the client records of
  the fitted levels (and, when predicting a level, of that level's records: the workload is
  known when predicting). ``host_overhead``: client decode period minus logged forward time
  (``simcap.live.calibration.host_overhead_from_itl``) over levels 1-4. Step-time noise:
  fitted with each form (ratio measured / that form's prediction).
- **Predict** at every level: the median pure-decode step (the form's time of each logged
  pure-decode step of the level, at its own batch; median over them), and TPOT p50 and output
  throughput by simulating the level's closed loop with the fitted profile (simcap's
  ``simulate``; concurrency, request count and the measured prompt and output lengths of the
  level's records as empirical distributions; the server's engine settings).
- **Spread**: where two or more runs exist on one kind of machine and protocol (rounds), the
  run-to-run difference of each measured figure (``|later / earlier - 1|``, the largest over
  the pairs of runs), the bar a prediction cannot be asked to beat.

``--write``: ``results-roofline.md`` and ``results-roofline.json`` here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyse as A  # noqa: E402

from simcap.calibrate import Form, fit_step_samples  # noqa: E402
from simcap.calibrate.core import TERMS  # noqa: E402
from simcap.calibrate.fit_roofline import (  # noqa: E402
    ContextSource, coef_names, decode_context_of_records, fit_roofline_samples, roofline_config, step_inputs)
from simcap.calibrate.metric_keys import metric_value  # noqa: E402
from simcap.config.scenario import parse_scenario  # noqa: E402
from simcap.engine.step_time import roofline_basis, roofline_forward  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402
from simcap.live.calibration import host_overhead_from_itl  # noqa: E402

HERE = Path(__file__).resolve().parent
# run.json's cpu.model_name -> the catalog entry measured on that kind of machine
HARDWARE = {"AMD EPYC": "cpu-amd-epyc-zen4-2vcpu", "Intel(R) Xeon(R) Processor": "cpu-intel-xeon-avx512bf16-2vcpu"}


def run_meta(model: str, run: int) -> dict[str, Any]:
    return json.loads((A.DATA / model / f"run{run}" / "run.json").read_text())


def machine_of(model: str, run: int) -> str:
    """The CPU a run was collected on (``run.json``), as ``HARDWARE`` names it."""
    name = run_meta(model, run)["cpu"]["model_name"]
    if name not in HARDWARE:
        raise SystemExit(f"{model}/run{run}: no catalog entry for a {name!r} CPU; add it to HARDWARE")
    return name


def rounds_of(model: str, run: int) -> int:
    """How many interleaved rounds of the levels the run holds (``collect.py --rounds``)."""
    return int(run_meta(model, run).get("rounds", 1))


SHAPES = {"dense": "tiny-llama-cpu", "moe": "tiny-qwen3-moe-cpu"}
# 1 GiB of KV cache in blocks of 32 tokens: KV bytes per token 6 x 2 x 2 x 64 x 2 (dense),
# 4 x 2 x 4 x 64 x 2 (MoE).
BLOCKS = {"dense": 2**30 // (32 * 3072), "moe": 2**30 // (32 * 4096)}
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=512, block_size=32, max_model_len=2048,
              enable_prefix_caching=True, async_scheduling=False)
VARIANTS = (("linear", None, None), ("roofline sum", "sum", 0.0), ("roofline max", "max", 0.0),
            ("roofline sum, skew fitted", "sum", "fit"), ("roofline max, skew fitted", "max", "fit"))


def fit_forms(model: str, run: int, bootstrap: int) -> dict[str, dict[str, Any]]:
    """Every variant's step_time section (with host_overhead and noise) and fit facts."""
    fit_on = A.step_samples(model, run, A.FIT_LEVELS)
    recs = [r for lv in A.FIT_LEVELS for r in A.records(model, run, lv)]
    rows = [r for lv in A.FIT_LEVELS for r in A.step_rows(model, run, lv)]
    host = host_overhead_from_itl(recs, rows)["host_overhead_s"]
    ctx = ContextSource(decode_context_of_records(recs), "client records of levels 1, 2, 4")
    out: dict[str, dict[str, Any]] = {}
    for name, combine, skew in VARIANTS:
        if skew == "fit" and model != "moe":
            continue
        if combine is None:
            fit = fit_step_samples(list(fit_on.values()), Form.parse(A.LINEAR_FORM), host_overhead=host,
                                   bootstrap=bootstrap, seed=0)
            st = {t: fit.coefficients[t] for t in Form.parse(A.LINEAR_FORM).free}
            st["host_overhead"] = host
            facts = {"coefficients_ms": {t: round(v * 1e3, 4) for t, v in st.items()}}
        else:
            fit = fit_roofline_samples(list(fit_on.values()), HARDWARE[machine_of(model, run)], SHAPES[model],
                                       combine=combine,
                                       routing_skew=skew, context=ctx, host_overhead=host,
                                       bootstrap=bootstrap, seed=0)
            st = dict(fit.step_time)
            terms = fit.extra["roofline"]["terms"]
            facts = {
                "base_ms": round(fit.coefficients["base"] * 1e3, 3),
                "per_request_ms": round(fit.coefficients["per_request"] * 1e3, 4),
                "routing_skew": st.get("routing_skew", 0.0),
                "efficiency": {k.split(".", 1)[1]: {"value": round(e["value"], 3),
                                                    "prior_share": e.get("prior_share"),
                                                    "pinned": e.get("pinned"),
                                                    "ci": [round(x, 3) for x in fit.ci.get(k, (np.nan, np.nan))]}
                               for k, e in terms.items() if k.startswith("efficiency.") and e.get("in_data")},
            }
        if fit.noise:
            st["noise"] = fit.noise
        facts.update(r2=fit.quality.get("r2"), median_abs_rel_error=fit.quality.get("median_abs_rel_error"),
                     host_overhead_ms=round(host * 1e3, 3))
        out[name] = {"step_time": st, "combine": combine, "fit": facts}
    return out


def decode_median(model: str, run: int, level: int, variant: dict[str, Any]) -> float:
    s = A.step_samples(model, run, [level], pure_decode=True)[level]
    st = variant["step_time"]
    if variant["combine"] is None:
        coef = np.array([st.get(t, 0.0) for t in TERMS])
        return float(np.median(s.X @ coef))
    phys = roofline_config(st["hardware"], st["model"], combine=st.get("combine", "sum"),
                           routing_skew=st.get("routing_skew", 0.0)).physics
    ctx = ContextSource(decode_context_of_records(A.records(model, run, level)), "level records")
    counts, _ = step_inputs(s, ctx)
    coef = np.array([st["base"], st["per_request"], st["mixed_step"],
                     *(st["efficiency"][n.split(".", 1)[1]] for n in coef_names()[3:])])
    return float(np.median(roofline_forward(roofline_basis(phys, **counts), coef, st.get("combine", "sum"))))


def simulate_level(model: str, run: int, level: int, step_time: dict[str, Any]) -> dict[str, float]:
    recs = [r for r in A.records(model, run, level) if r.succeeded]
    scen = parse_scenario({
        "name": f"{model}-c{level}",
        "engine": {**ENGINE, "num_gpu_blocks": BLOCKS[model]},
        "step_time": step_time,
        "workload": {"arrival": {"process": "closed", "concurrency": level}, "num_requests": len(recs),
                     "input_len": {"dist": "empirical", "values": [r.num_prompt_tokens for r in recs]},
                     "output_len": {"dist": "empirical", "values": [r.num_output_tokens for r in recs]}},
        "seed": level,
    })
    res = simulate(scen)
    return {"tpot_p50_ms": metric_value("tpot_p50", res) * 1e3,
            "output_tok_s": metric_value("output_throughput", res)}


def analyse(bootstrap: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for model in A.models():
        for run in A.runs(model):
            key = f"{model}/run{run}"
            measured = {lv: A.level_stats(model, run, lv) for lv in A.LEVELS}
            forms = fit_forms(model, run, bootstrap)
            preds: dict[str, Any] = {}
            for name, v in forms.items():
                preds[name] = {"fit": v["fit"], "levels": {}}
                for lv in A.LEVELS:
                    sim = simulate_level(model, run, lv, v["step_time"])
                    m = measured[lv]
                    p = {"decode_ms": decode_median(model, run, lv, v) * 1e3, **sim}
                    p["error"] = {"decode": p["decode_ms"] / m["decode_ms_p50"] - 1,
                                  "tpot": p["tpot_p50_ms"] / m["tpot_p50_ms"] - 1,
                                  "throughput": p["output_tok_s"] / m["output_tok_s"] - 1}
                    preds[name]["levels"][lv] = p
            result[key] = {"measured": {lv: {k: measured[lv][k] for k in ("decode_ms_p50", "tpot_p50_ms",
                                                                        "output_tok_s")}
                                        for lv in A.LEVELS},
                           "forms": preds}
    # Run-to-run spread of the measured figures, between runs of one kind of machine and protocol.
    spread: dict[str, Any] = {}
    for model in A.models():
        by_kind: dict[tuple[str, int], list[int]] = {}
        for run in A.runs(model):
            by_kind.setdefault((machine_of(model, run), rounds_of(model, run)), []).append(run)
        for (machine, rounds), rr in by_kind.items():
            if len(rr) >= 2:
                measured = [result[f"{model}/run{r}"]["measured"] for r in rr]
                facts = [] if machine == "AMD EPYC" else [f"runs {', '.join(map(str, rr))}: Xeon"]
                if rounds > 1:
                    facts.append(f"{rounds} rounds")
                label = f"{model} ({', '.join(facts)})" if facts else model
                # |later / earlier - 1|, the largest over the pairs of runs
                spread[label] = {lv: {k: max(abs(b[lv][k] / a[lv][k] - 1) for i, a in enumerate(measured)
                                             for b in measured[i + 1:])
                                      for k in measured[0][lv]} for lv in A.LEVELS}
    return {"results": result, "spread": spread}


def render(data: dict[str, Any]) -> str:
    res, spread = data["results"], data["spread"]
    out = ["Fitted on all logged steps of levels 1, 2, 4 of the run; predicted at every level "
           "(8, 16, 32 held out). Cells: predicted vs measured (error = predicted / measured - 1).", ""]
    for metric, label, mkey, fmt in (("decode", "median pure-decode step, ms", "decode_ms_p50", "{:.1f}"),
                                     ("tpot", "TPOT p50 (simulated), ms", "tpot_p50_ms", "{:.1f}"),
                                     ("throughput", "output throughput (simulated), tok/s", "output_tok_s",
                                      "{:.0f}")):
        pkey = {"decode": "decode_ms", "tpot": "tpot_p50_ms", "throughput": "output_tok_s"}[metric]
        out += [f"**{label}**", "",
                "| model/run | form | " + " | ".join(f"c={lv}" for lv in A.LEVELS) + " |",
                "|---|---|" + "---:|" * len(A.LEVELS)]
        for key, r in res.items():
            for name, f in r["forms"].items():
                cells = []
                for lv in A.LEVELS:
                    p, m = f["levels"][lv][pkey], r["measured"][lv][mkey]
                    cells.append(f"{fmt.format(p)} vs {fmt.format(m)} ({f['levels'][lv]['error'][metric] * 100:+.0f}%)")
                out.append(f"| {key} | {name} | " + " | ".join(cells) + " |")
        for model, sp in spread.items():
            out.append(f"| {model} | run-to-run spread | " + " | ".join(
                f"{sp[lv][mkey] * 100:.0f}%" for lv in A.LEVELS) + " |")
        out.append("")
    out += ["**Mean |error| at the held-out levels 8, 16, 32** (decode / TPOT / throughput):", "",
            "| model/run | form | decode | TPOT | throughput |", "|---|---|---:|---:|---:|"]
    for key, r in res.items():
        for name, f in r["forms"].items():
            e = [np.mean([abs(f["levels"][lv]["error"][m]) for lv in A.TARGET_LEVELS])
                 for m in ("decode", "tpot", "throughput")]
            out.append(f"| {key} | {name} | " + " | ".join(f"{x * 100:.0f}%" for x in e) + " |")
    out += ["", "**Fitted roofline efficiencies** (value [90% bootstrap interval], prior share; "
            "pinned: prior share < 0.5):", "",
            "| model/run | form | base ms | per_request ms | skew | efficiencies |", "|---|---|---:|---:|---:|---|"]
    for key, r in res.items():
        for name, f in r["forms"].items():
            fa = f["fit"]
            if "efficiency" not in fa:
                coefs = ", ".join(f"{t} {v:.3g}" for t, v in fa["coefficients_ms"].items())
                out.append(f"| {key} | {name} | | | | linear (ms): {coefs} |")
                continue
            eff = "; ".join(f"{t} {e['value']:.2f} [{e['ci'][0]:.2f}-{e['ci'][1]:.2f}] share {e['prior_share']:.2f}"
                            f"{' pinned' if e['pinned'] else ''}" for t, e in fa["efficiency"].items())
            out.append(f"| {key} | {name} | {fa['base_ms']:.2f} | {fa['per_request_ms']:.3f} | "
                       f"{fa['routing_skew']:g} | {eff} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--bootstrap", type=int, default=100)
    args = ap.parse_args()
    data = analyse(args.bootstrap)
    text = render(data)
    print(text)
    if args.write:
        (HERE / "results-roofline.md").write_text(text + "\n")
        (HERE / "results-roofline.json").write_text(json.dumps(data, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
