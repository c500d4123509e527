"""Fitting step-time noise: the distribution of ``measured / predicted`` per step kind
(:mod:`simcap.engine.noise` draws from it), empirical quantiles or a lognormal, with the
Kolmogorov-Smirnov distance of each to the ratios."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from simcap.config.scenario import EmpiricalNoise, LognormalNoise
from simcap.engine.noise import KINDS, inverse_cdf, mean_factor

NUM_QUANTILES = 41  # every 2.5 % (21, every 5 %, below FEW_SAMPLES steps)
FEW_SAMPLES = 200
MIN_SAMPLES = 20  # fewer steps of a kind: no distribution for it


def empirical_from_ratios(ratios: np.ndarray, num_quantiles: int | None = None) -> EmpiricalNoise:
    """Quantiles of ``ratios`` at ``i / (n - 1)``, scaled so that the inverse CDF's mean is 1.

    Inner quantiles are the sample's; the two ends are not its min and max (one stray step,
    e.g. 8x the prediction, would spread the top 2.5 % evenly up to it and inflate the mean)
    but set so that each end segment has the mean of the samples it covers: top
    ``2 * mean(r >= q[n-2]) - q[n-2]``, bottom ``2 * mean(r <= q[1]) - q[1]`` (not below the
    smallest ratio).
    """
    r = np.sort(np.asarray(ratios, dtype=float))
    n = num_quantiles or (NUM_QUANTILES if r.size >= FEW_SAMPLES else 21)
    q = np.quantile(r, np.linspace(0.0, 1.0, n))
    if n > 2:
        q[-1] = max(2.0 * r[r >= q[-2]].mean() - q[-2], q[-2])
        q[0] = min(max(2.0 * r[r <= q[1]].mean() - q[1], r[0]), q[1])
    raw = EmpiricalNoise(kind="empirical", quantiles=tuple(float(x) for x in q))
    q = q / mean_factor(raw)
    return EmpiricalNoise(kind="empirical", quantiles=tuple(float(f"{x:.5g}") for x in q), samples=int(r.size))


def lognormal_from_ratios(ratios: np.ndarray) -> LognormalNoise:
    """Mean-one lognormal with the standard deviation of ``log(ratios)``."""
    r = np.asarray(ratios, dtype=float)
    return LognormalNoise(kind="lognormal", sigma=float(f"{np.std(np.log(r)):.5g}"), samples=int(r.size))


def ks_distance(ratios: np.ndarray, dist: EmpiricalNoise | LognormalNoise) -> float:
    """Kolmogorov-Smirnov distance between the ratios scaled to mean 1 and ``dist``."""
    r = np.sort(np.asarray(ratios, dtype=float) / np.mean(ratios))
    u = np.linspace(0.0, 1.0, 20001)[1:-1]
    x = np.sort(inverse_cdf(dist, u))
    model_cdf = np.searchsorted(x, r, side="right") / x.size
    n = r.size
    emp_hi = np.arange(1, n + 1) / n
    emp_lo = np.arange(0, n) / n
    return float(max(np.max(np.abs(emp_hi - model_cdf)), np.max(np.abs(emp_lo - model_cdf))))


def fit_noise(
    measured: np.ndarray, predicted: np.ndarray, kinds: Sequence[str], family: str = "empirical",
    min_samples: int = MIN_SAMPLES,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The ``step_time.noise`` section fitted from per-step measured and predicted forward
    seconds, and a report per kind (samples, ratio spread, KS of both families).

    Steps whose prediction or measurement is not positive are left out; a kind with fewer
    than ``min_samples`` steps gets no distribution (``spec`` then falls back to ``decode``'s).
    """
    measured = np.asarray(measured, dtype=float)
    predicted = np.asarray(predicted, dtype=float)
    kinds_arr = np.asarray(kinds)
    section: dict[str, Any] = {}
    report: dict[str, Any] = {"family": family, "min_samples": min_samples, "kinds": {}}
    for kind in KINDS:
        sel = (kinds_arr == kind) & (predicted > 0) & (measured > 0)
        r = measured[sel] / predicted[sel]
        entry: dict[str, Any] = {"samples": int(r.size)}
        if r.size:
            pct = np.percentile(r, [5, 50, 95])
            entry.update(mean_ratio=round(float(r.mean()), 4), p5=round(float(pct[0]), 4),
                         p50=round(float(pct[1]), 4), p95=round(float(pct[2]), 4),
                         cv=round(float(r.std() / r.mean()), 4))
        if r.size >= min_samples:
            emp = empirical_from_ratios(r)
            logn = lognormal_from_ratios(r)
            entry["ks_empirical"] = round(ks_distance(r, emp), 4)
            entry["ks_lognormal"] = round(ks_distance(r, logn), 4)
            entry["lognormal_sigma"] = logn.sigma
            chosen = emp if family == "empirical" else logn
            section[kind] = chosen.model_dump(exclude_none=True)
        else:
            entry["note"] = f"fewer than {min_samples} steps: no noise for this kind"
        report["kinds"][kind] = entry
    return (section or None), report
