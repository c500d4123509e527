"""Direct fit of step samples: non-negative least squares on measured step seconds, with a
pairs bootstrap over rows for the intervals."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy.optimize import nnls

from simcap.calibrate.core import TERMS, CalibrationError, Form, _fmt
from simcap.calibrate.noise_fit import fit_noise
from simcap.calibrate.readers import _NEEDS, StepSamples
from simcap.calibrate.result import Fit, _percentile_ci


def fit_step_samples(
    samples: Sequence[StepSamples],
    form: Form | None = None,
    *,
    fixed: dict[str, float] | None = None,
    host_overhead: float | None = None,
    bootstrap: int = 200,
    level: float = 0.9,
    seed: int = 0,
    warn_above: float = 0.1,
    noise: str | None = "empirical",
) -> Fit:
    """Non-negative least squares of the free terms on measured step seconds.

    Terms that are not free contribute ``fixed`` values (default 0) and are subtracted first.
    ``host_overhead`` (s per step, not in an iteration log's elapsed time) is written to the
    profile as given; without it, when samples carry ``start_s``, it is the median gap between
    one step's end and the next's start. Intervals: pairs bootstrap over rows.

    ``noise`` (``"empirical"``, ``"lognormal"`` or None): fit ``step_time.noise`` from the ratios
    measured / fitted per step kind (:func:`noise_of_fit`).
    """
    fixed = dict(fixed or {})
    X = np.vstack([s.X for s in samples])
    y = np.concatenate([s.y for s in samples])
    available = set.intersection(*(s.available for s in samples))
    where = ", ".join(s.source["file"] for s in samples)
    if form is None:
        spread = [t for i, t in enumerate(TERMS) if t in available and np.ptp(X[:, i]) > 0]
        form = Form.parse(["base", *[t for t in spread if t != "base"]])
    for term in [*form.free, *form.tied]:
        if term not in available:
            need = " and ".join(" or ".join(alt) for alt in _NEEDS[term])
            raise CalibrationError(f"{where}: missing column {need} for the free term {term}")
    p = len(form.free)
    if len(y) < p + 1:
        raise CalibrationError(
            f"{where}: {len(y)} step samples are too few for {p} free terms (need at least {p + 1})"
        )
    idx = [TERMS.index(t) for t in form.free]
    A = X[:, idx].copy()
    ties = form.ties(fixed)
    for t, other in ties.items():
        if other in form.free:
            A[:, form.free.index(other)] += X[:, TERMS.index(t)]
    const = form.coefficients(np.zeros(p), fixed)  # free and tied-to-free terms are 0 here
    offset = X @ np.array([const[t] for t in TERMS])
    rank = np.linalg.matrix_rank(A)
    if rank < p:
        null = np.linalg.svd(A)[2][-1]
        names = [form.free[j] for j in np.argsort(-np.abs(null))[:2]]
        raise CalibrationError(
            f"{where}: the free terms {' and '.join(names)} cannot be told apart in these samples "
            "(their columns are collinear or constant); fix one with --form"
        )

    def solve(A_: np.ndarray, b: np.ndarray) -> np.ndarray:
        try:
            return nnls(A_, b, maxiter=50 * A_.shape[1])[0]
        except RuntimeError as exc:
            raise CalibrationError(f"{where}: the NNLS fit did not converge: {exc}") from None

    coef = solve(A, y - offset)
    coeffs = form.coefficients(coef, fixed)
    fitted = X @ np.array([coeffs[t] for t in TERMS])
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(bootstrap):
        rows = rng.integers(0, len(y), len(y))
        sets.append(form.coefficients(solve(A[rows], (y - offset)[rows]), fixed))
    terms = [*form.free, *form.tied]
    sets = [{t: _fmt(s[t]) for t in terms} for s in sets]
    notes = []
    host = host_overhead_of(samples, host_overhead, notes)
    coeffs_all = {**coeffs, "host_overhead": host}
    residuals, quality, warnings = step_residuals(y, fitted, warn_above, where)
    fit = Fit(
        kind="step_samples",
        method="nnls (scipy.optimize.nnls) on measured step seconds",
        form=form, coefficients=coeffs_all, fixed=fixed,
        ci=_percentile_ci(sets, terms, level), bootstrap=sets,
        bootstrap_method=f"pairs bootstrap over step rows ({bootstrap} resamples, seed {seed})",
        level=level, residuals=residuals, sources=[s.source for s in samples],
        warnings=warnings, notes=notes, quality=quality,
    )
    if noise:
        noise_of_fit(fit, X, y, fitted, noise)
    return fit


NOISE_FAMILIES = ("empirical", "lognormal", "none")


def noise_family(value: str) -> str | None:
    """``--noise`` -> the family fitted (None for ``none``)."""
    if value not in NOISE_FAMILIES:
        raise CalibrationError(f"--noise: must be one of {', '.join(NOISE_FAMILIES)} (got {value!r})")
    return None if value == "none" else value


def step_kinds(X: np.ndarray) -> np.ndarray:
    """Each row's step kind for the noise (simcap.engine.noise.step_kind): prefill, spec, decode."""
    pre = X[:, TERMS.index("per_prefill_token")] > 0
    ver = X[:, TERMS.index("per_verify_token")] > 0
    return np.where(pre, "prefill", np.where(ver, "spec", "decode"))


def noise_of_fit(fit: Fit, X: np.ndarray, y: np.ndarray, fitted: np.ndarray, family: str) -> Fit:
    """Set ``fit.noise`` and ``fit.noise_report`` from the ratios measured / fitted per step
    kind (in-sample residuals of the final coefficients); returns ``fit``."""
    section, report = fit_noise(y, fitted, step_kinds(X), family)
    fit.noise, fit.noise_report = section, report
    kinds = report["kinds"]
    parts = [f"{k} n={e['samples']}" + (f" p5/p50/p95 {e['p5']:.2f}/{e['p50']:.2f}/{e['p95']:.2f}"
                                        if e["samples"] else "") for k, e in kinds.items()]
    fit.notes.append(f"step_time.noise ({family}, ratio measured/fitted): " + "; ".join(parts))
    return fit


def host_overhead_of(samples: Sequence[StepSamples], given: float | None, notes: list[str]) -> float:
    """Host seconds per step between forwards: ``given``, else the median gap between a step's
    end and the next one's start (``start_s`` column), else 0; says which in ``notes``."""
    if given is not None:
        notes.append(f"host_overhead {float(given):.4g} s per step: given (--host-overhead), not fitted")
        return float(given)
    starts = [s for s in samples if s.start_s is not None]
    if not starts:
        notes.append("host_overhead 0: the samples time the forward pass only and no "
                     "--host-overhead was given; the engine's real step period is longer")
        return 0.0
    gaps = np.concatenate([np.diff(s.start_s) - s.y[:-1] for s in starts])
    host = float(max(np.median(gaps), 0.0))
    notes.append(f"host_overhead {host:.4g} s: median gap between a step's end and the next "
                 "step's start (start_s column)")
    return host


def step_residuals(
    y: np.ndarray, fitted: np.ndarray, warn_above: float, where: str
) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Residual rows, fit quality and warnings of a step-sample fit (either form)."""
    rel = (fitted - y) / np.where(y > 0, y, np.nan)
    residuals = [
        {"point": f"row {i}", "metric": "step_time_s", "measured": _fmt(y[i]), "fitted": _fmt(fitted[i]),
         "rel_error": None if math.isnan(rel[i]) else round(float(rel[i]), 4), "fitted_in_objective": True}
        for i in range(len(y))
    ]
    ok = ~np.isnan(rel)
    quality = {
        "n": int(len(y)),
        "rmse_s": _fmt(float(np.sqrt(np.mean((fitted - y) ** 2)))),
        "r2": round(float(1 - np.sum((fitted - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-300)), 4),
        "median_abs_rel_error": round(float(np.median(np.abs(rel[ok]))), 4) if ok.any() else None,
        "p95_abs_rel_error": round(float(np.percentile(np.abs(rel[ok]), 95)), 4) if ok.any() else None,
        "max_rel_error": round(float(np.max(np.abs(rel[ok]))), 4) if ok.any() else None,
        "warn_above": warn_above,
    }
    warnings: list[str] = []
    # Single steps are noisy: judge the fit by the spread of errors, warn on the worst rows.
    if ok.any() and quality["p95_abs_rel_error"] > warn_above:
        worst = int(np.nanargmax(np.abs(rel)))
        warnings.append(
            f"WARNING: max relative error {abs(rel[worst]):.0%} at row {worst} of {where} (fitted "
            f"{fitted[worst]:.4g} s vs measured {y[worst]:.4g} s); 5% of the step samples are off "
            f"by more than {quality['p95_abs_rel_error']:.0%}: the form may be missing a term"
        )
    return residuals, quality, warnings
