"""Measured and simulated aggregates by name: which metric a measurement key stands for
(:func:`metric_of_key`) and its value in a simulated run (:func:`metric_value`)."""

from __future__ import annotations

import math
import re

import numpy as np

from simcap.calibrate.core import CalibrationError
from simcap.simulation.simulator import Result


_STATS = ("mean", "p50", "p90", "p95", "p99")
_DISTS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
_THROUGHPUTS = {
    "output_throughput": "output_tokens_per_s",
    "request_throughput": "requests_per_s",
    "input_throughput": "input_tokens_per_s",
    "total_throughput": "total_tokens_per_s",
}
_ALIASES = {
    "throughput": "output_throughput",
    "output_throughput": "output_throughput",
    "qps": "request_throughput",
    "request_throughput": "request_throughput",
    "input_throughput": "input_throughput",
    "total_token_throughput": "total_throughput",
    "per_user_output_tps": "per_user_output_tps",
}


def metric_of_key(key: str) -> tuple[str, float] | None:
    """The simcap metric a measurement key stands for, and the factor to seconds; else None.

    Knows ``vllm bench`` keys (``mean_ttft_ms``, ``median_itl_ms``, ``p99_e2el_ms``,
    ``output_throughput``; the same in seconds with ``_s``: ``mean_tpot_s``), table keys (``throughput``, ``qps``, ``latency_p95`` = E2E,
    ``itl_median_ms``) and ITL fractions (``itl_fraction_over_1500ms``,
    ``itl_fraction_100_to_1500ms``).
    """
    if key in _ALIASES:
        return _ALIASES[key], 1.0

    def stat(s: str) -> str | None:
        s = "p50" if s == "median" else s
        return s if s in _STATS else None

    m = re.fullmatch(r"latency_(mean|median|p\d+)", key)
    if m and stat(m[1]):
        return f"e2e_{stat(m[1])}", 1.0
    m = re.fullmatch(r"(mean|median|p\d+)_(ttft|tpot|itl|e2el)_(ms|s)", key) or re.fullmatch(
        r"(ttft|tpot|itl|e2el)_(mean|median|p\d+)_(ms|s)", key
    )
    if m:
        s, what = (m[1], m[2]) if m[2] in ("ttft", "tpot", "itl", "e2el") else (m[2], m[1])
        if stat(s):
            return f"{what.replace('e2el', 'e2e')}_{stat(s)}", 1e-3 if m[3] == "ms" else 1.0
    m = re.fullmatch(r"itl_fraction_over_(\d+)ms", key)
    if m:
        return f"itl_frac_gt_{int(m[1]) / 1000:g}", 1.0
    m = re.fullmatch(r"itl_fraction_(\d+)_to_(\d+)ms", key)
    if m:
        return f"itl_frac_{int(m[1]) / 1000:g}_{int(m[2]) / 1000:g}", 1.0
    return None


def _itl_samples(result: Result) -> tuple[np.ndarray, np.ndarray]:
    """Per-chunk ITL samples of a run as (distinct values, counts)."""
    return result.metrics.itl_table()


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def metric_value(
    name: str, result: Result, *, smooth: float = 0.0, steady_state: bool = False,
    _itl: list | None = None,
) -> float:
    """A named metric of a simulated run (seconds, tokens/s or a fraction).

    ``smooth > 0`` replaces the hard edges of ITL fractions by logistic ones of that width in
    log seconds, so the objective of a fit is continuous in the coefficients. ``steady_state``
    (a closed loop): throughputs are concurrency x tokens per request / mean E2E latency.
    """
    s = result.summary
    if name in _THROUGHPUTS:
        arrival = result.scenario.workload.arrival
        if steady_state and getattr(arrival, "concurrency", None) and s.completed and s.e2e_s.mean:
            per_req = {"output_throughput": s.output_tokens, "request_throughput": s.completed,
                       "input_throughput": s.input_tokens,
                       "total_throughput": s.output_tokens + s.input_tokens}[name] / s.completed
            return float(arrival.concurrency * per_req / s.e2e_s.mean)
        return float(s.throughput[_THROUGHPUTS[name]])
    if name == "per_user_output_tps":
        return 1.0 / s.tpot_s.mean if s.tpot_s.mean else 0.0
    m = re.fullmatch(r"itl_frac_(gt_)?([\d.]+)(?:_([\d.]+))?", name)
    if m:
        if _itl is not None and _itl:
            itl = _itl[0]
        else:
            itl = _itl_samples(result)
            if _itl is not None:
                _itl.append(itl)
        values, counts = itl
        if values.size == 0:
            return 0.0
        lo, hi = float(m[2]), (float(m[3]) if m[3] else math.inf)
        if smooth > 0:
            z = np.log(np.maximum(values, 1e-9))
            above = _sigmoid((z - math.log(lo)) / smooth)
            below = _sigmoid((z - math.log(hi)) / smooth) if hi < math.inf else 0.0
            return float(np.dot(counts, above - below) / counts.sum())
        return float(counts[(values > lo) & (values <= hi)].sum() / counts.sum())
    metric, _, stat = name.partition("_")
    if metric in _DISTS and stat in _STATS:
        value = getattr(getattr(s, _DISTS[metric]), stat)
        return float(value) if value is not None else math.nan
    raise CalibrationError(f"metric {name!r}: unknown")


def _is_fraction(metric: str) -> bool:
    return metric.startswith("itl_frac_")
