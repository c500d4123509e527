"""The accuracy table (markdown) and the ratchet: recorded errors that may only shrink.

``calibration/accuracy.json`` records every figure's prediction error (``case/form/point/
metric`` -> error, rounded to 0.1 %). :func:`ratchet` compares a fresh replay with it: a
figure whose absolute error grew by more than :data:`MARGIN` is a regression; one that shrank
by more than the margin is a stale record (the improvement must tighten the record in the same
change: ``simcap accuracy --write``); a figure missing on either side means the corpus and its
record disagree. Replays are deterministic, so on any machine the same tree gives the same
errors; the margin only absorbs last-digit differences of floating point between machines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from simcap._version import __version__
from simcap.accuracy import model_form
from simcap.accuracy.corpus import FORMS, Case, LiveCase
from simcap.accuracy.replay import CaseReplay, Figure

RECORD_FORMAT = "simcap accuracy record 1"
MODEL_FORM_FILE = "model_form.json"
MARGIN = 0.01  # |error| may grow by at most one percentage point


def _figures(replays: Sequence[CaseReplay]) -> list[dict[str, Any]]:
    return [f for r in replays for f in r.figures]


def record_of(replays: Sequence[CaseReplay]) -> dict[str, Any]:
    """The ratchet's record: every figure's error (rounded to 0.1 %), keys sorted."""
    figures = {f["key"]: None if f["error"] is None else round(f["error"], 3) for f in _figures(replays)}
    return {"format": RECORD_FORMAT, "margin": MARGIN, "figures": dict(sorted(figures.items()))}


def ratchet(replays: Sequence[CaseReplay], record: dict[str, Any], margin: float = MARGIN) -> list[str]:
    """Every way the replay departs from the record, one line each (empty: it holds). Only
    the record's figures of the cases and forms replayed are compared."""
    problems = []
    replayed = {(r.case, r.form) for r in replays}
    recorded: dict[str, float | None] = {
        k: v for k, v in record.get("figures", {}).items() if tuple(k.split("/")[:2]) in replayed}
    now = {f["key"]: f["error"] for f in _figures(replays)}
    for key in sorted(set(recorded) | set(now)):
        if key not in now:
            problems.append(f"{key}: recorded but not replayed (the corpus lost it; rewrite the record)")
            continue
        if key not in recorded:
            problems.append(f"{key}: replayed but not recorded (a new figure; rewrite the record)")
            continue
        old, new = recorded[key], now[key]
        if old is None or new is None:
            if (old is None) != (new is None):
                problems.append(f"{key}: error {_pct(old)} recorded, {_pct(new)} now")
            continue
        if abs(new) > abs(old) + margin:
            problems.append(f"{key}: error {_pct(new)}, worse than the recorded {_pct(old)} "
                            f"by more than {margin * 100:.0f} point(s)")
        elif abs(new) < abs(old) - margin:
            problems.append(f"{key}: error {_pct(new)}, better than the recorded {_pct(old)}: "
                            "tighten the record (simcap accuracy --write)")
    return problems


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _value(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if "throughput" in metric or metric.endswith("_tps"):
        return f"{v:,.1f}"
    if metric.endswith("_rate"):
        return f"{v:.3f}"
    if metric == "preemptions":
        return f"{v:.1f}"
    return f"{v * 1e3:,.1f} ms"


def summary_rows(replays: Sequence[CaseReplay]) -> list[dict[str, Any]]:
    """Per case and form: figures, median and max |error|, share of errors within the spread."""
    rows = []
    for r in replays:
        errs = [abs(f["error"]) for f in r.figures if f["error"] is not None]
        within = [abs(f["error"]) <= f["spread"] for f in r.figures
                  if f["error"] is not None and f["spread"] is not None]
        rows.append({"case": r.case, "form": r.form, "figures": len(errs),
                     "median_abs_error": float(np.median(errs)) if errs else None,
                     "max_abs_error": max(errs) if errs else None,
                     "within_spread": (sum(within), len(within))})
    return rows


def form_error(cases: Sequence[Case], replays: Sequence[CaseReplay]) -> dict[str, Any] | None:
    """The model-form error fitted on every replayed figure, with its leave-one-case-out
    coverage (:mod:`simcap.accuracy.model_form`): what ``calibration/model_form.json`` holds.
    None with fewer than three cases (no case could be left out of a fit worth the name)."""
    kinds = {c.name: c.kind for c in cases}
    data = model_form.samples(_figures(replays), kinds)
    if len({s.case for s in data}) < 3:
        return None
    cov = model_form.coverage(data)
    return {**model_form.fit(data).to_dict(),
            "coverage": {k: v for k, v in cov.items() if k not in ("rows", "level")},
            "samples": [s.to_row() for s in data]}


def _share(row: dict[str, Any]) -> str:
    return f"{row['inside']} of {row['figures']} ({row['share'] * 100:.0f}%)"


def _form_error_markdown(record: dict[str, Any]) -> list[str]:
    cov = record["coverage"]
    out = ["", "## Model-form intervals", "",
           f"How wrong the form is beyond what a fit's bootstrap sees, learned from the figures above "
           f"(`simcap.accuracy.model_form`; fitted on all of them in `calibration/model_form.json`): per "
           f"metric family, log(predicted / measured) ~ N(0, s0^2 + (a d)^2) with d the doublings of "
           f"load (requests running in the batch) past the fit part, and the {record['level']:.0%} interval "
           f"+-q sigma(d) with q the conformal quantile. Coverage is counted leaving each case out: its "
           f"figures against intervals fitted on the other cases only. Width: the interval's length "
           f"relative to the prediction (exp(h) - exp(-h)), median.", "",
           "| held out | inside the interval | median width |", "|---|---:|---:|",
           f"| every figure | {_share(cov['all'])} | {cov['all']['median_width']:.2f} |",
           f"| beyond the fit part (d > 0) | {_share(cov['beyond_fit'])} | "
           f"{cov['beyond_fit']['median_width']:.2f} |"]
    for group in ("kind", "family", "case"):
        for name, row in cov[group].items():
            out.append(f"| {group} {name} | {_share(row)} | {row['median_width']:.2f} |")
    out += ["", "| family | s0 | a (per doubling) | q | figures |", "|---|---:|---:|---:|---:|"]
    for name, t in record["terms"].items():
        out.append(f"| {name} | {t['s0']:.3f} | {t['a']:.3f} | {t['q']:.2f} | {t['figures']} |")
    return out


SPEED_METRICS = ("ttft_p50", "ttft_p95", "tpot_p50", "later_turns_ttft_p50")


def _speed_markdown(replays: Sequence[CaseReplay]) -> list[str]:
    """Per live point: the engine's speed during its runs and the errors at that speed."""
    rows: dict[tuple[str, str, str], dict[str, Figure]] = {}
    for r in replays:
        for f in r.figures:
            if f.get("engine_speed") is not None and f["metric"] in SPEED_METRICS:
                rows.setdefault((f["case"], f["point"], f["metric"]), {})[r.form] = f
    if not rows:
        return []
    out = ["", "## Engine speed", "",
           "How fast the server's engine ran during each point's held-out runs, against the prediction's "
           "own steps (`simcap.live.engine_speed`: the logged decode steps' time over the replay's at the "
           "same batch sizes, median over the runs; above 1: slower than the fitted profile priced them), "
           "and each error again with every run replayed at its measured speed (decode and prompt steps "
           "each by their own ratio). The replay at the measured speed reads the held-out run's own step "
           "log, so it is no prediction and no part of the record: it separates the engine's speed on the "
           "day from what the model gets wrong. Where a point's batches are larger than the fit part's, "
           "the ratio holds the step-time form's own miss at those batch sizes as well as the engine's "
           "speed.", "",
           "| case | point | metric | engine speed | " + " | ".join(f"{f} error -> at measured speed" for f in FORMS)
           + " |", "|---|---|---|---:|" + "---:|" * len(FORMS)]
    for (case, point, metric), by_form in rows.items():
        speed = next(iter(by_form.values()))["engine_speed"]
        cells = [f"{_pct(f['error'])} -> {_pct(f.get('error_at_speed'))}" if (f := by_form.get(form)) else "-"
                 for form in FORMS]
        out.append(f"| {case} | {point} | {metric} | {speed:.2f}x | " + " | ".join(cells) + " |")
    return out


def markdown(cases: Sequence[Case], replays: Sequence[CaseReplay]) -> str:
    """The accuracy table: a summary per case and form, then every figure of every case."""
    out = [
        "# Accuracy: predictions of held-out measurements",
        "",
        f"Written by `simcap accuracy --write` (simcap {__version__}) from `calibration/corpus/`; "
        "checked by `tests/test_accuracy.py` against `calibration/accuracy.json` (the ratchet: an "
        f"error may not grow by more than {MARGIN * 100:.0f} point, and an improvement rewrites the "
        "record). Every error is a PREDICTION error: each case is fitted on its fit part only, with "
        "the shipped calibration path, and predicts its held-out part. `spread`: the range of the "
        "server instances' medians relative to the measured median (restarts of the same server "
        "with the same flags and workload): the noise a prediction cannot be asked to beat.",
        "",
        "| case | form | figures | median abs error | max abs error | within spread |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in summary_rows(replays):
        hit, n = row["within_spread"]
        out.append(f"| {row['case']} | {row['form']} | {row['figures']} | "
                   f"{_pct(row['median_abs_error']).lstrip('+')} | {_pct(row['max_abs_error']).lstrip('+')} | "
                   f"{f'{hit} of {n}' if n else '-'} |")
    by_case: dict[str, dict[str, CaseReplay]] = {}
    for r in replays:
        by_case.setdefault(r.case, {})[r.form] = r
    for case in cases:
        forms = by_case.get(case.name, {})
        if not forms:
            continue
        out += ["", f"## {case.name}", "", case.description, "",
                f"Mechanisms: {', '.join(case.mechanisms) or '-'}."]
        if isinstance(case, LiveCase):
            runs = sum(len(p.runs) for p in case.points)
            instances = len({r.instance for p in case.points for r in p.runs})
            out.append(f"Fit part: {len(case.fit.runs)} recorded run(s) of the calibration workload; "
                       f"held out: {len(case.points)} workload(s), {runs} run(s) on {instances} server instance(s).")
            out += [f"Point {p.name}: sent at {p.rate_of_saturation:g} x the saturation rate measured on each "
                    "server instance (`simcap live validate --rate-of-saturation`; each run's rate is in its "
                    "recording)." for p in case.points if p.rate_of_saturation is not None]
        else:
            out.append(f"Fit rows: {', '.join(case.fit_rows)}; held out: "
                       f"{', '.join(r.row for r in case.held_out)}.")
        shown = [f for f in FORMS if f in forms]
        out += ["", "| point | metric | measured | " + " | ".join(f"{f} predicted | {f} error" for f in shown)
                + " | spread |", "|---|---|---:|" + "---:|---:|" * len(shown) + "---:|"]
        # One row per (point, metric), in the order the forms give them (a row only the
        # roofline recipe reads comes after the others).
        rows: dict[tuple[str, str], dict[str, Figure]] = {}
        for f in shown:
            for fig in forms[f].figures:
                rows.setdefault((fig["point"], fig["metric"]), {})[f] = fig
        for (point, metric), by_form in rows.items():
            fig = next(iter(by_form.values()))
            cells = []
            for f in shown:
                mine = by_form.get(f)
                cells += [_value(metric, mine and mine["predicted"]), _pct(mine and mine["error"])]
            spread = "-" if fig["spread"] is None else f"{fig['spread'] * 100:.1f}%"
            out.append(f"| {point} | {metric} | {_value(metric, fig['measured'])} | " + " | ".join(cells)
                       + f" | {spread} |")
    record = form_error(cases, replays)
    if record is not None:
        out += _form_error_markdown(record)
    out += _speed_markdown(replays)
    return "\n".join(out) + "\n"


def write(folder: Path, cases: Sequence[Case], replays: Sequence[CaseReplay]) -> tuple[Path, ...]:
    """``accuracy.md``, ``accuracy.json`` and ``model_form.json`` in ``folder``."""
    md, js, mf = folder / "accuracy.md", folder / "accuracy.json", folder / MODEL_FORM_FILE
    md.write_text(markdown(cases, replays))
    js.write_text(json.dumps(record_of(replays), indent=1) + "\n")
    record = form_error(cases, replays)
    if record is not None:
        mf.write_text(json.dumps(record, indent=1) + "\n")
    return (md, js, mf) if record is not None else (md, js)


def read_record(path: Path) -> dict[str, Any]:
    from simcap.accuracy.corpus import CorpusError

    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read the accuracy record: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CorpusError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        raise CorpusError(f"{path}: not an accuracy record (format {RECORD_FORMAT!r})")
    return data
