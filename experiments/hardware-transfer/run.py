#!/usr/bin/env python
"""Moving a fitted roofline profile to other hardware: what carries, and what one point fixes.

    PYTHONPATH=. python experiments/hardware-transfer/run.py            # ~10 min on 2 cores
    PYTHONPATH=. python experiments/hardware-transfer/run.py --only gpt-oss
    PYTHONPATH=. python experiments/hardware-transfer/run.py --leave-high-out   # ~3 min

Two public tables hold one model served the same way on several kinds of accelerator:
InferenceMAX's gpt-oss-120b rows (vLLM 0.11, tensor parallel 2, 1k in / 1k out, closed loops
of 4 to 64 clients; H100, H200, B200, MI300X, MI325X), its Llama-3.3-70B-Instruct FP8 rows (vLLM
0.10.2, tensor parallel 4, the same shape and loads; H100, H200) and dstack's DeepSeek-R1 rows
(vLLM, 8 GPUs, 3.2k in / 800 out, 4 to 128 clients; H200, MI300X). For each ordered pair of
accelerators (source, target):

1. the source profile is fitted on ALL of the source's rows (the recipe's free terms);
2. it is moved to the target by the catalog alone (``step_time.hardware``): every byte and
   FLOP term re-priced on the target's datasheet, every fitted efficiency and seconds term
   kept (``datasheet``);
3. or, with ONE measured row of the target (its lowest load, or its highest), one term is
   refitted there and the rest kept (``base@c``, ``experts@c``, ...), or with two (lowest and
   highest) base and the experts' efficiency (``base+experts@low+high``; the dense Llama:
   the weights' efficiency, ``base+weights@low+high``);
4. or, with no row, the efficiencies of the target's kernel class taken from the fit of the
   class's other member alone (``class (sibling)``; the classes of two members only);
5. gpt-oss only: the source fitted on all three of its workload shapes (1k / 1k, 1k / 8k,
   8k / 1k; ``experiments/workload-shapes``) instead, moved by the datasheet alone or with the
   experts' efficiency refitted on the target's highest 1k / 1k row (``..., three-shape
   source``);

and the target's OTHER rows are predicted. The errors are prediction errors: the target's
figures used are one row at most, and that row is left out of the scoring. Results:
``results.json``; the summary, per variant, is the median over pairs of each pair's largest
error, and how many pairs stay within 15%.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from simcap.calibrate import Recipe  # noqa: E402
from simcap.calibrate.fit_bench import fit_benchmarks_roofline  # noqa: E402
from simcap.calibrate.metric_keys import metric_value  # noqa: E402
from simcap.calibrate.pipeline import benchmark_points  # noqa: E402
from simcap.calibrate.transfer import term_value  # noqa: E402
from simcap.config.scenario import parse_scenario  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402
from simcap.metrics.report import write_generated_block  # noqa: E402

RECIPES = ROOT / "calibration" / "recipes"
METRICS = ("tpot_mean", "output_throughput")
WITHIN = 15.0  # the goal's band for a transfer, %

# table name -> the table's hardware value -> (recipe, catalog hardware). A recipe of another
# GPU is read on this GPU's rows (the table's hardware filter and the catalog entry changed).
TABLES = {
    "gpt-oss": {gpu: ("inferencemax-gptoss-h100.roofline.yaml", hw) for gpu, hw in (
        ("h100", "h100-sxm"), ("h200", "h200-sxm"), ("b200", "b200"), ("mi300x", "mi300x"),
        ("mi325x", "mi325x"))},
    "deepseek-r1": {"h200": ("dstack-r1-h200.roofline.yaml", "h200-sxm"),
                    "mi300x": ("dstack-r1-mi300x.roofline.yaml", "mi300x")},
    "llama-70b": {gpu: (f"inferencemax-llama70b-{gpu}.roofline.yaml", hw) for gpu, hw in (
        ("h100", "h100-sxm"), ("h200", "h200-sxm"))},
}
# The InferenceMAX recipes' 1k in / 1k out rows: the only shape this study reads.
ONE_SHAPE = {"gpt-oss": "vllm tp2", "llama-70b": "vllm tp4"}
# The tables whose rows are InferenceMAX's (their hardware column is ``hw``, dstack's ``GPU``).
INFERENCEMAX = ("gpt-oss", "llama-70b")
# One term refitted on one target row: which, and where (a dense model has no experts' term).
REFITS = ("base", "efficiency.experts", "efficiency.weights")
DENSE = ("llama-70b",)


# The other member of each GPU's kernel class (simcap/catalog/kernel_classes.yaml), whose fit on
# all its rows centres this GPU's priors when the class is judged without the GPU's own rows.
SIBLING = {"gpt-oss": {"h100": "h200", "h200": "h100", "mi300x": "mi325x", "mi325x": "mi300x"}}
CLASS_SIGMA = 0.3  # the catalog classes' sigma
CLASS_TERMS = ("weights", "experts", "compute", "kv_read")


def recipe_on(table: str, gpu: str, every_shape: bool = False) -> Recipe:
    """The roofline recipe of ``gpu``'s rows, priced on its catalog entry (the InferenceMAX
    recipes: their 1k / 1k rows, or with ``every_shape`` all three shapes)."""
    name, hardware = TABLES[table][gpu]
    r = copy.copy(Recipe.load(RECIPES / name))
    r.name = f"{table}-{gpu}"
    r.step_time = {**r.step_time, "hardware": hardware}
    if table == "gpt-oss":  # the server's max_num_seqs was the client count (up to 128 on B200)
        r.engine = {**r.engine, "max_num_seqs": 128}
    datasets = []
    for d in r.datasets:
        if table in ONE_SHAPE and d["label"] != ONE_SHAPE[table] and not every_shape:
            continue  # the study moves the 1k / 1k fit (the recipes hold two more shapes)
        d = copy.deepcopy(d)
        key = "hw" if table in INFERENCEMAX else "GPU"
        d["table"]["where"] = [f"{key}=={gpu}" if w.startswith(f"{key}==") else w
                               for w in d["table"]["where"]]
        datasets.append(d)
    r.datasets = datasets
    return r


def load_of(pt) -> int:
    return pt.scenario["workload"]["arrival"]["concurrency"]


def fit(recipe: Recipe, points, step_time: dict, form) -> dict:
    f = fit_benchmarks_roofline(points, step_time, form, prior=recipe.prior, fit_metrics=list(METRICS),
                                weights=recipe.weights, bootstrap=0, seed=recipe.seed,
                                starts=recipe.starts)
    return f.step_time


def predict(points, step_time: dict) -> list[dict]:
    rows = []
    for pt in points:
        res = simulate(parse_scenario({**pt.scenario, "step_time": step_time}))
        for m in METRICS:
            if m in pt.measured:
                v = metric_value(m, res, steady_state=pt.steady_state)
                rows.append({"point": pt.label, "load": load_of(pt), "metric": m,
                             "measured": pt.measured[m], "predicted": v,
                             "error_pct": (v / pt.measured[m] - 1) * 100})
    return rows


def refit(recipe: Recipe, measured: list, others: list, step_time: dict, terms: list[str]) -> dict:
    """One variant of a move: ``terms`` refitted on the target's ``measured`` rows, its
    ``others`` predicted."""
    st = fit(recipe, measured, step_time, terms)
    rows = predict(others, st)
    labels = [p.label for p in measured]
    return {"rows": rows, "max_abs_pct": worst(rows), "measured_row": labels[0] if len(labels) == 1 else labels,
            "refitted": {t: term_value(st, t) for t in terms}}


def worst(rows: list[dict]) -> float:
    return max(abs(r["error_pct"]) for r in rows)


def run_table(table: str) -> dict:
    catalog = {gpu: hw for gpu, (_, hw) in TABLES[table].items()}
    gpus = list(catalog)
    recipes = {g: recipe_on(table, g) for g in gpus}
    points = {g: sorted(benchmark_points(recipes[g]), key=load_of) for g in gpus}
    sources = {}
    for g in gpus:
        t0 = time.perf_counter()
        st = fit(recipes[g], points[g], recipes[g].step_time, recipes[g].form)
        rows = predict(points[g], st)
        sources[g] = {"step_time": st, "fit": rows, "fit_max_abs_pct": worst(rows),
                      "loads": [load_of(p) for p in points[g]], "wall_s": time.perf_counter() - t0}
        eff = st["efficiency"]
        print(f"{table} {g}: fitted on {len(points[g])} rows, max |err| {worst(rows):.1f}%; "
              f"base {st['base'] * 1e3:.2f} ms, experts {eff['experts']:.2f}, weights {eff['weights']:.2f}, "
              f"compute {eff['compute']:.2f}, kv_read {eff['kv_read']:.2f}", flush=True)
    # The gpt-oss sources fitted on all three of their shapes too (experiments/workload-shapes):
    # moved the same ways, and scored on the target's 1k / 1k rows like the others.
    shaped = {}
    if table == "gpt-oss":
        for g in gpus:
            r3 = recipe_on(table, g, every_shape=True)
            shaped[g] = fit(r3, benchmark_points(r3), r3.step_time, r3.form)
    pairs = []
    for src in gpus:
        for dst in gpus:
            if src == dst:
                continue
            moved = {**sources[src]["step_time"], "hardware": catalog[dst]}
            pts = points[dst]
            entry = {"source": src, "target": dst, "variants": {}}
            rows = predict(pts, moved)
            entry["variants"]["datasheet"] = {"rows": rows, "max_abs_pct": worst(rows)}
            if shaped:
                moved3 = {**shaped[src], "hardware": catalog[dst]}
                rows = predict(pts, moved3)
                entry["variants"]["datasheet, three-shape source"] = {"rows": rows, "max_abs_pct": worst(rows)}
                entry["variants"]["experts@high, three-shape source"] = refit(
                    recipes[dst], [pts[-1]], pts[:-1], moved3, ["efficiency.experts"])
            sibling = SIBLING.get(table, {}).get(dst)
            if sibling and sibling != src:  # the target's kernel class, without its own rows
                eff = sources[sibling]["step_time"]["efficiency"]
                st = {**moved, "efficiency": {**moved["efficiency"],
                                              **{t: max(eff[t], 1.0) for t in CLASS_TERMS}}}
                rows = predict(pts, st)
                entry["variants"]["class (sibling)"] = {"rows": rows, "max_abs_pct": worst(rows),
                                                        "sibling": sibling}
            for where, pt in (("low", pts[0]), ("high", pts[-1])):
                rest = [p for p in pts if p is not pt]
                for term in REFITS:
                    if table in DENSE and term == "efficiency.experts":
                        continue
                    name = f"{term.removeprefix('efficiency.')}@{where}"
                    entry["variants"][name] = refit(recipes[dst], [pt], rest, moved, [term])
            if len(pts) > 2:  # two rows, lowest and highest load: base and experts (weights) refitted
                second = "efficiency.weights" if table in DENSE else "efficiency.experts"
                entry["variants"][f"base+{second.removeprefix('efficiency.')}@low+high"] = refit(
                    recipes[dst], [pts[0], pts[-1]], pts[1:-1], moved, ["base", second])
            pairs.append(entry)
            print(f"{table} {src} -> {dst}: " + ", ".join(
                f"{k} {v['max_abs_pct']:.0f}%" for k, v in entry["variants"].items()), flush=True)
    summary = {}
    for variant in dict.fromkeys(v for p in pairs for v in p["variants"]):
        worsts = [p["variants"][variant]["max_abs_pct"] for p in pairs if variant in p["variants"]]
        summary[variant] = {"median_max_abs_pct": statistics.median(worsts),
                            "pairs_within": sum(w <= WITHIN for w in worsts), "pairs": len(worsts)}
    return {"gpus": gpus, "sources": sources, "pairs": pairs, "summary": summary,
            **({"three_shape_sources": shaped} if shaped else {})}


def leave_high_out(table: str, sources: dict | None = None) -> dict:
    """Each GPU of the table on its own: fitted at 16 clients or fewer, its higher loads
    predicted, with the recipe's form and with a per-request seconds term freed too; and the
    choice the fit rows alone would make (the two lowest rows fitted, the third predicted).
    With ``sources`` (each GPU's fit on all its rows, from the moves), also with the priors of
    its kernel class centred on its sibling's fit alone (the class without the GPU's own rows)."""
    out = {}
    for gpu in TABLES[table]:
        r = recipe_on(table, gpu)
        pts = sorted(benchmark_points(r), key=load_of)
        low, high = [p for p in pts if load_of(p) <= 16], [p for p in pts if load_of(p) > 16]
        entry = {}
        for name, form in (("recipe form", r.form.split(",")),
                           ("with per_request", [*r.form.split(","), "per_request"])):
            st = fit(r, low, r.step_time, form)
            rows = predict(high, st)
            inner = predict(low[2:], fit(r, low[:2], r.step_time, form))
            entry[name] = {"rows": rows, "max_abs_pct": worst(rows), "per_request": st["per_request"],
                           "third_row_from_two_max_abs_pct": worst(inner)}
        sibling = SIBLING.get(table, {}).get(gpu) if sources else None
        if sibling:
            eff = sources[sibling]["step_time"]["efficiency"]
            r.prior = {**(r.prior or {}), "terms": {
                f"efficiency.{t}": {"value": max(eff[t], 1.0), "sigma": CLASS_SIGMA} for t in CLASS_TERMS}}
            st = fit(r, low, r.step_time, r.form)
            rows = predict(high, st)
            entry["class prior (sibling)"] = {"rows": rows, "max_abs_pct": worst(rows), "sibling": sibling,
                                              "experts": st["efficiency"]["experts"]}
        out[gpu] = entry
        print(f"{table} {gpu}: " + ", ".join(
            f"{k} {v['max_abs_pct']:.1f}%" + (f" (third row from two: {v['third_row_from_two_max_abs_pct']:.1f}%)"
                                              if "third_row_from_two_max_abs_pct" in v else "")
            for k, v in entry.items()), flush=True)
    return out


GPU_NAMES = {"h100": "H100", "h200": "H200", "b200": "B200", "mi300x": "MI300X", "mi325x": "MI325X"}
# The moves table's columns: (variant, header).
MOVE_COLUMNS = (("datasheet", "datasheet alone"),
                ("class (sibling)", "the target's kernel class (its other member's fit)"),
                ("base@low", "base @ lowest"), ("experts@low", "experts @ lowest"),
                ("experts@high", "experts @ highest"),
                ("base+experts@low+high", "base + experts @ lowest + highest"),
                ("datasheet, three-shape source", "three-shape source: datasheet alone"),
                ("experts@high, three-shape source", "three-shape source: experts @ highest"))


DENSE_MOVE_COLUMNS = (("datasheet", "datasheet alone"), ("base@low", "base @ lowest"),
                      ("weights@low", "weights @ lowest"), ("base@high", "base @ highest"),
                      ("weights@high", "weights @ highest"),
                      ("base+weights@low+high", "base + weights @ lowest + highest"))


def _pct(entry: dict | None) -> str:
    return "-" if entry is None else f"{entry['max_abs_pct']:.1f}%"


def _moves_table(pairs: list[dict], columns: tuple) -> list[str]:
    """A table of moves: one row per (source, target), one column per variant of ``columns``."""
    lines = ["| source -> target | " + " | ".join(h for _, h in columns) + " |", "|---|" + "---:|" * len(columns)]
    for p in pairs:
        v = p["variants"]
        lines.append(f"| {GPU_NAMES[p['source']]} -> {GPU_NAMES[p['target']]} | "
                     + " | ".join(_pct(v.get(k)) for k, _ in columns) + " |")
    return lines


def markdown(out: dict) -> str:
    """The README's tables, from ``results.json``: each gpt-oss source fit, every move, the
    summary per variant, and (after ``--leave-high-out``) each GPU fitted low and predicted high."""
    oss = out["gpt-oss"]
    lines = ["Each accelerator's own fit (gpt-oss, TP2, all its 1k / 1k rows; with all three "
             "shapes in brackets):", "",
             "| GPU | max error of the fit | base | experts | compute | kv_read |", "|---|---:|---:|---:|---:|---:|"]
    shaped = oss.get("three_shape_sources", {})
    for g in oss["gpus"]:
        s = oss["sources"][g]
        e, e3 = s["step_time"]["efficiency"], shaped.get(g, {}).get("efficiency", {})

        def both(term: str) -> str:
            return f"{e[term]:.2f}" + (f" ({e3[term]:.2f})" if term in e3 else "")
        lines.append(f"| {GPU_NAMES[g]} | {s['fit_max_abs_pct']:.1f}% | {s['step_time']['base'] * 1e3:.2f} ms | "
                     f"{both('experts')} | {both('compute')} | {both('kv_read')} |")
    lines += ["", "Moves, largest error over the target's other 1k / 1k rows (TPOT mean and output throughput):", "",
              *_moves_table(oss["pairs"], MOVE_COLUMNS)]
    llama = out.get("llama-70b")
    if llama:
        lines += ["", "A second model, dense (Llama-3.3-70B-Instruct FP8, TP4, 1k / 1k rows): each GPU's own fit, "
                  "then the moves (largest error over the target's other rows):", "",
                  "| GPU | max error of the fit | base | weights | compute | kv_read |", "|---|---:|---:|---:|---:|---:|"]
        for g in llama["gpus"]:
            s = llama["sources"][g]
            e = s["step_time"]["efficiency"]
            lines.append(f"| {GPU_NAMES[g]} | {s['fit_max_abs_pct']:.1f}% | {s['step_time']['base'] * 1e3:.2f} ms | "
                         f"{e['weights']:.2f} | {e['compute']:.2f} | {e['kv_read']:.2f} |")
        lines += ["", *_moves_table(llama["pairs"], DENSE_MOVE_COLUMNS)]
    lines += ["", "Summary over the moves (median of each move's largest error; moves within 15%):", "",
              "| table | variant | median | within 15% |", "|---|---|---:|---:|"]
    for table in TABLES:
        for variant, s in out.get(table, {}).get("summary", {}).items():
            lines.append(f"| {table} | {variant} | {s['median_max_abs_pct']:.1f}% | "
                         f"{s['pairs_within']} of {s['pairs']} |")
    lho = out.get("leave_high_out")
    if lho:
        lines += ["", "Each GPU fitted at 16 clients or fewer, its higher loads predicted (largest error over TPOT "
                  "mean and output throughput):", "",
                  "| table, GPU | recipe form | with per_request (fitted, us per request per step) | "
                  "the choice from the fit rows alone | kernel-class prior, from the sibling's fit |",
                  "|---|---:|---:|---|---:|"]
        for table, gpus in lho.items():
            for g, e in gpus.items():
                rf, pr = e["recipe form"], e["with per_request"]
                pick = ("recipe form" if rf["third_row_from_two_max_abs_pct"] <= pr["third_row_from_two_max_abs_pct"]
                        else "per_request")
                cls = e.get("class prior (sibling)")
                lines.append(
                    f"| {table}, {GPU_NAMES[g]} | {rf['max_abs_pct']:.1f}% | {pr['max_abs_pct']:.1f}% "
                    f"({pr['per_request'] * 1e6:,.0f}) | {pick} ({rf['third_row_from_two_max_abs_pct']:.1f}% vs "
                    f"{pr['third_row_from_two_max_abs_pct']:.1f}%) | "
                    + (f"{cls['max_abs_pct']:.1f}% ({GPU_NAMES[cls['sibling']]}'s)" if cls else "-") + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=tuple(TABLES))
    ap.add_argument("--leave-high-out", action="store_true",
                    help="each GPU fitted at <= 16 clients, its higher loads predicted (with and without "
                         "a per-request term), instead of the moves")
    args = ap.parse_args()
    out_path = HERE / "results.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.leave_high_out:
        out["leave_high_out"] = {**out.get("leave_high_out", {}), **{
            t: leave_high_out(t, (out.get(t) or {}).get("sources")) for t in TABLES if not args.only or t == args.only}}
        out_path.write_text(json.dumps(out, indent=2) + "\n")
        write_generated_block(HERE / "README.md", markdown(out))
        return
    for table in TABLES:
        if args.only and table != args.only:
            continue
        out[table] = run_table(table)
        print(f"{table}: median over pairs of the largest error, pairs within {WITHIN:.0f}%")
        for variant, s in out[table]["summary"].items():
            print(f"   {variant:18s} {s['median_max_abs_pct']:6.1f}%   {s['pairs_within']}/{s['pairs']}")
        out_path.write_text(json.dumps(out, indent=2) + "\n")
    if "gpt-oss" in out:
        write_generated_block(HERE / "README.md", markdown(out))


if __name__ == "__main__":
    main()
