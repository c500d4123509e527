#!/usr/bin/env python
"""Which low-load rows to calibrate on: one workload shape, or three?

    PYTHONPATH=. python experiments/workload-shapes/run.py     # ~3.5 min on 2 cores

InferenceMAX's gpt-oss-120b rows hold three workload shapes served by the same deployment on
each GPU (vLLM 0.11 or 0.10.1, tensor parallel 2, closed loops of 4 to 64 clients, 128 on
the B200): 1k in / 1k out, 1k in / 8k out (long decodes over a growing context) and 8k in /
1k out (long prompts, chunked into the decode steps). The recipes
``calibration/recipes/inferencemax-gptoss-<gpu>[.roofline].yaml`` read all three. For each GPU
and each step-time form the profile is fitted on some rows and the others are predicted:

- ``one shape, low load``: the 1k / 1k rows at 16 clients or fewer (what the accuracy
  corpus's gpt-oss cases fitted before the other shapes were read);
- ``three shapes, low load``: every shape's rows at 16 clients or fewer;
- ``one shape, every load``: all the 1k / 1k rows (how well a profile fitted on one shape
  carries to the others at the same loads).

Every figure scored is a prediction of a row the fit did not see: TPOT, output throughput
and E2E (means), as the corpus cases score them. The fit reads TPOT and throughput (the
recipes' ``fit_metrics``). Results: ``results.json``; the README's table is its summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from simcap.calibrate import Recipe, profile_dict  # noqa: E402
from simcap.calibrate.metric_keys import metric_value  # noqa: E402
from simcap.calibrate.pipeline import benchmark_points, calibrate  # noqa: E402
from simcap.config.scenario import parse_scenario  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402
from simcap.metrics.report import write_generated_block  # noqa: E402

RECIPES = ROOT / "calibration" / "recipes"
GPUS = ("h100", "h200", "b200", "mi300x", "mi325x")
FORMS = {"linear": "inferencemax-gptoss-{}.yaml", "roofline": "inferencemax-gptoss-{}.roofline.yaml"}
METRICS = ("tpot_mean", "output_throughput", "e2e_mean")
LOW = 16  # the most clients a low-load row has
SHAPES = {"vllm tp2": "1k1k", "vllm tp2 1k8k": "1k8k", "vllm tp2 8k1k": "8k1k"}


def shape_of(label: str) -> str:
    return SHAPES[label.rsplit(" c=", 1)[0]]


def load_of(label: str) -> int:
    return int(label.rsplit(" c=", 1)[1])


# variant -> (which rows the fit reads, which rows are scored)
VARIANTS = {
    "one shape, low load": (lambda lab: shape_of(lab) == "1k1k" and load_of(lab) <= LOW,
                            lambda lab: not (shape_of(lab) == "1k1k" and load_of(lab) <= LOW)),
    "three shapes, low load": (lambda lab: load_of(lab) <= LOW, lambda lab: load_of(lab) > LOW),
    "one shape, every load": (lambda lab: shape_of(lab) == "1k1k", lambda lab: shape_of(lab) != "1k1k"),
}


def run_variant(recipe: Recipe, points: dict, fitted, scored) -> dict:
    fit_rows = sorted(lab for lab in points if fitted(lab))
    fit = calibrate([], recipe, bootstrap=0, rows=fit_rows)
    step_time = profile_dict(fit, recipe)["step_time"]
    rows = []
    for lab in sorted((lab for lab in points if scored(lab)), key=lambda x: (shape_of(x), load_of(x))):
        pt = points[lab]
        result = simulate(parse_scenario({**pt.scenario, "step_time": step_time}))
        for m in METRICS:
            if m in pt.measured:
                v = metric_value(m, result, steady_state=pt.steady_state)
                rows.append({"row": lab, "shape": shape_of(lab), "load": load_of(lab), "metric": m,
                             "measured": pt.measured[m], "predicted": v,
                             "error_pct": (v / pt.measured[m] - 1) * 100})
    return {"fit_rows": fit_rows, "rows": rows, "step_time": step_time}


def summarise(rows: list[dict]) -> dict:
    """Largest |error| per group of scored rows: each shape at high load (> LOW clients), each
    other shape at low load, and all of them."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        where = "high" if r["load"] > LOW else "low"
        groups.setdefault(f"{r['shape']} {where}", []).append(abs(r["error_pct"]))
        groups.setdefault("all", []).append(abs(r["error_pct"]))
    return {k: round(max(v), 2) for k, v in sorted(groups.items())}


def markdown(out: dict) -> str:
    """The README's tables: per GPU and form, the largest |error| of each variant's predictions,
    and the roofline fits' efficiencies."""
    lines = ["Largest |error| over TPOT, output throughput and E2E (means) of the rows each fit did "
             "not see; \"1k/1k high\": the 1k / 1k rows above 16 clients, \"all high\": every shape's "
             "rows above 16 clients, \"other shapes\": the 1k / 8k and 8k / 1k rows at every load.", "",
             "| GPU | form | one shape, low load: 1k/1k high | all high | three shapes, low load: 1k/1k high "
             "| all high | one shape, every load: other shapes |", "|---|---|---:|---:|---:|---:|---:|"]
    for gpu in GPUS:
        for form, e in out["gpus"][gpu].items():
            one, three, every = (e[v]["max_abs_pct"] for v in VARIANTS)
            high = max(x for k, x in one.items() if k.endswith("high"))
            lines.append(f"| {gpu} | {form} | {one['1k1k high']:.1f}% | {high:.1f}% | "
                         f"**{three['1k1k high']:.1f}%** | **{three['all']:.1f}%** | {every['all']:.1f}% |")
    lines += ["", "The roofline fits' efficiencies (time over the datasheet's), one shape at low load -> three shapes "
              "at low load:", "", "| GPU | experts | compute | kv_read |", "|---|---|---|---|"]
    for gpu in GPUS:
        one, three = (out["gpus"][gpu]["roofline"][v]["step_time"]["efficiency"] for v in list(VARIANTS)[:2])
        lines.append(f"| {gpu} | " + " | ".join(f"{one[t]:.2f} -> {three[t]:.2f}" for t in ("experts", "compute", "kv_read"))
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    out: dict = {"low_load_max_clients": LOW, "metrics": list(METRICS), "gpus": {}}
    for gpu in GPUS:
        out["gpus"][gpu] = {}
        for form, name in FORMS.items():
            t0 = time.perf_counter()
            recipe = Recipe.load(RECIPES / name.format(gpu))
            points = {p.label: p for p in benchmark_points(recipe)}
            entry = {}
            for variant, (fitted, scored) in VARIANTS.items():
                res = run_variant(recipe, points, fitted, scored)
                res["max_abs_pct"] = summarise(res["rows"])
                entry[variant] = res
            out["gpus"][gpu][form] = entry
            print(f"{gpu} {form} ({time.perf_counter() - t0:.0f} s): " + "; ".join(
                f"{v}: " + ", ".join(f"{k} {x:.1f}%" for k, x in e["max_abs_pct"].items())
                for v, e in entry.items()), flush=True)
    (HERE / "results.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    write_generated_block(HERE / "README.md", markdown(out))


if __name__ == "__main__":
    main()
