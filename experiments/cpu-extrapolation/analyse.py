"""Decode step time across concurrency, and how a linear step-time fit at low concurrency extrapolates.

Usage: PYTHONPATH=. python experiments/cpu-extrapolation/analyse.py [--write]

Reads ``data/<model>/run<k>/`` (written by ``collect.py``). Per model, run and level: the
pure-decode steps' (no prefill in the step) median, p5 and p95 logged time, the median at a
full batch (decode requests = level), the client's TPOT p50 and output throughput. Then, per
model and run, simcap's linear step-time form (``simcap.calibrate.fit_step_samples``, the
terms ``simcap live calibrate`` fits from an iteration log: base, per prefill token, per decode
token, mixed step) fitted on every logged step of levels 1, 2 and 4, and its error predicting
the median pure-decode step at 8, 16 and 32 (prediction: the median of the fitted times of that
level's pure-decode steps, each at its own batch). A second fit uses pure-decode steps only
(base + per decode token). ``--write``: also ``results.md`` and ``results.json`` here.

Reusable loaders: :func:`step_rows` (iteration-log rows of one level), :func:`step_samples`
(``{level: StepSamples}``, simcap's step-sample format, for any step-time model),
:func:`records` (the client's ``RequestRecord`` list of one level).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from simcap.calibrate import Form, StepSamples, fit_step_samples, parse_iteration_log
from simcap.calibrate.core import TERMS
from simcap.calibrate.readers import _rows_to_samples
from simcap.metrics.records import RequestRecord
from simcap.metrics.summary import summarize

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
LEVELS = (1, 2, 4, 8, 16, 32)
FIT_LEVELS = (1, 2, 4)
TARGET_LEVELS = (8, 16, 32)
LINEAR_FORM = "base,per_prefill_token,per_decode_token,mixed_step"
DECODE_FORM = "base,per_decode_token"


# --------------------------------------------------------------------------- loaders


def models(data: Path = DATA) -> list[str]:
    return sorted(p.name for p in data.iterdir() if p.is_dir()) if data.exists() else []


def runs(model: str, data: Path = DATA) -> list[int]:
    return sorted(int(p.name[3:]) for p in (data / model).glob("run*") if (p / "c1.iterations.log.gz").exists())


def round_files(model: str, run: int, level: int, suffix: str, data: Path = DATA) -> list[Path]:
    """The level's files of every round, in round order (``collect.py --rounds``; one for older runs)."""
    folder = data / model / f"run{run}"
    later = sorted(folder.glob(f"c{level}.round*.{suffix}"), key=lambda p: int(p.name.split(".")[1][5:]))
    return [folder / f"c{level}.{suffix}", *later]


def step_rows_by_round(model: str, run: int, level: int, data: Path = DATA) -> list[list[dict[str, float]]]:
    """The level's iteration-log rows (:func:`simcap.calibrate.parse_iteration_log` format), per round."""
    out = []
    for path in round_files(model, run, level, "iterations.log.gz", data):
        with gzip.open(path, "rt") as fh:
            out.append(parse_iteration_log(fh))
    return out


def step_rows(model: str, run: int, level: int, data: Path = DATA) -> list[dict[str, float]]:
    """The level's iteration-log rows, every round's."""
    return [row for rows in step_rows_by_round(model, run, level, data) for row in rows]


def samples_of(rows: list[dict[str, float]], where: str, *, pure_decode: bool = False) -> StepSamples:
    """Iteration-log rows as simcap's step samples; ``pure_decode``: steps with no prefill only."""
    if pure_decode:
        rows = [r for r in rows if r["num_prefill_tokens"] == 0 and r["num_decode_reqs"] > 0]
    return _rows_to_samples(rows, where, {"file": where, "format": "vllm iteration log"})


def step_samples(model: str, run: int, levels=LEVELS, *, pure_decode: bool = False,
                 data: Path = DATA) -> dict[int, StepSamples]:
    """``{level: StepSamples}`` of one model and run; ``pure_decode``: steps with no prefill only."""
    return {level: samples_of(step_rows(model, run, level, data), f"{model}/run{run}/c{level}",
                              pure_decode=pure_decode)
            for level in levels}


def records_by_round(model: str, run: int, level: int, data: Path = DATA) -> list[list[RequestRecord]]:
    out = []
    for path in round_files(model, run, level, "records.jsonl.gz", data):
        with gzip.open(path, "rt") as fh:
            out.append([RequestRecord.from_dict(json.loads(line)) for line in fh if line.strip()])
    return out


def records(model: str, run: int, level: int, data: Path = DATA) -> list[RequestRecord]:
    """The client's records of the level, every round's."""
    return [r for recs in records_by_round(model, run, level, data) for r in recs]


def output_throughput(rounds: list[list[RequestRecord]]) -> float:
    """Output tokens per second of the level's rounds together: their tokens over the sum of their spans
    (first send to last finish of each round; the pauses between rounds are not the server's)."""
    tokens = spans = 0.0
    for recs in rounds:
        s = summarize(recs)
        n = sum(r.num_output_tokens for r in recs if r.succeeded)
        tokens += n
        spans += n / s.throughput["output_tokens_per_s"]
    return tokens / spans


# --------------------------------------------------------------------------- analysis

_DEC = TERMS.index("per_decode_token")


def level_stats(model: str, run: int, level: int, data: Path = DATA) -> dict[str, Any]:
    rows_by_round = step_rows_by_round(model, run, level, data)
    all_rows = [row for rows in rows_by_round for row in rows]
    s = samples_of(all_rows, f"{model}/run{run}/c{level}", pure_decode=True)
    all_steps = len(all_rows)
    ms = s.y * 1e3
    batch = s.X[:, _DEC]
    full = ms[batch == level]
    rounds = records_by_round(model, run, level, data)
    summ = summarize([r for recs in rounds for r in recs])
    full_by_round = [[r["step_time_s"] * 1e3 for r in rows
                      if r["num_prefill_tokens"] == 0 and r["num_decode_reqs"] == level]
                     for rows in rows_by_round]
    return {
        "steps": all_steps, "decode_steps": len(s), "full_batch_steps": int(len(full)),
        "decode_ms_p50": float(np.median(ms)), "decode_ms_p5": float(np.percentile(ms, 5)),
        "decode_ms_p95": float(np.percentile(ms, 95)),
        "full_batch_ms_p50": float(np.median(full)) if len(full) else None,
        "mean_decode_batch": float(batch.mean()),
        "tpot_p50_ms": summ.tpot_s.p50 * 1e3 if summ.tpot_s.p50 is not None else None,
        "output_tok_s": output_throughput(rounds),
        "failed": summ.failed,
        "full_batch_ms_p50_by_round": [float(np.median(t)) if t else None for t in full_by_round],
    }


def extrapolation(model: str, run: int, form: str, pure_decode_fit: bool, data: Path = DATA) -> dict[str, Any]:
    """Fit ``form`` on levels 1-4; predicted vs measured median pure-decode step at every level."""
    fit_on = step_samples(model, run, FIT_LEVELS, pure_decode=pure_decode_fit, data=data)
    fit = fit_step_samples(list(fit_on.values()), Form.parse(form), bootstrap=50, seed=0)
    coef = np.array([fit.coefficients[t] for t in TERMS])
    out = {"form": form, "fit_on": "pure-decode steps" if pure_decode_fit else "all steps",
           "coefficients_ms": {t: fit.coefficients[t] * 1e3 for t in Form.parse(form).free},
           "r2": fit.quality.get("r2"), "levels": {}}
    for level, s in step_samples(model, run, LEVELS, pure_decode=True, data=data).items():
        measured = float(np.median(s.y))
        predicted = float(np.median(s.X @ coef))
        out["levels"][level] = {"measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                                "rel_error": predicted / measured - 1}
    return out


def analyse(data: Path = DATA) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for model in models(data):
        for run in runs(model, data):
            key = f"{model}/run{run}"
            result[key] = {
                "levels": {lv: level_stats(model, run, lv, data) for lv in LEVELS},
                "linear": extrapolation(model, run, LINEAR_FORM, False, data),
                "decode_only": extrapolation(model, run, DECODE_FORM, True, data),
            }
    return result


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def by_round(stats: dict[str, Any]) -> str:
    """`` (rounds a / b / c)`` for a level collected in several rounds, else empty."""
    r = stats.get("full_batch_ms_p50_by_round", [])
    return f" (rounds {' / '.join(_f(x, '{:.2f}') for x in r)})" if len(r) > 1 else ""


def render(result: dict[str, Any]) -> str:
    out = ["| model/run | level | steps | pure-decode steps | decode step p50 (p5-p95) ms | at full batch p50 ms "
           "| TPOT p50 ms | output tok/s |",
           "|---|---:|---:|---:|---|---:|---:|---:|"]
    for key, r in result.items():
        for lv, s in r["levels"].items():
            out.append(f"| {key} | {lv} | {s['steps']} | {s['decode_steps']} | {s['decode_ms_p50']:.2f} "
                       f"({s['decode_ms_p5']:.2f}-{s['decode_ms_p95']:.2f}) | {_f(s['full_batch_ms_p50'], '{:.2f}')}"
                       f"{by_round(s)} "
                       f"| {_f(s['tpot_p50_ms'], '{:.2f}')} | {s['output_tok_s']:.0f} |")
    out += ["", "Linear step-time fits on levels 1, 2, 4; median pure-decode step, predicted vs measured "
            "(error = predicted / measured - 1):", "",
            "| model/run | fit | coefficients (ms) | R2 | " + " | ".join(f"c={lv}" for lv in LEVELS) + " |",
            "|---|---|---|---:|" + "---:|" * len(LEVELS)]
    for key, r in result.items():
        for name in ("linear", "decode_only"):
            e = r[name]
            coefs = ", ".join(f"{t} {v:.3g}" for t, v in e["coefficients_ms"].items())
            cells = [f"{v['predicted_ms']:.1f} vs {v['measured_ms']:.1f} ({v['rel_error'] * 100:+.0f}%)"
                     for v in e["levels"].values()]
            out.append(f"| {key} | {e['fit_on']} | {coefs} | {_f(e['r2'], '{:.2f}')} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--write", action="store_true", help="write results.md and results.json here")
    args = ap.parse_args()
    result = analyse(args.data)
    text = render(result)
    print(text)
    if args.write:
        (HERE / "results.md").write_text(text + "\n")
        (HERE / "results.json").write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
