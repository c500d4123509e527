"""What a fit returns: :class:`Fit`, with the percentile intervals and fit-quality summary
that both fits (step samples, benchmarks) share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from simcap.calibrate.core import Form, _fmt


@dataclass
class Fit:
    """A fitted step-time form: coefficients, their uncertainty, and fitted vs measured."""

    kind: str  # "step_samples" or "benchmarks"
    method: str
    form: Form
    coefficients: dict[str, float]  # every StepTimeConfig key
    fixed: dict[str, float]
    ci: dict[str, tuple[float, float]]
    bootstrap: list[dict[str, float]]
    bootstrap_method: str
    level: float
    residuals: list[dict[str, Any]]  # point, metric, measured, fitted, rel_error, fitted_in_objective
    sources: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    quality: dict[str, Any] = field(default_factory=dict)
    # step_time.noise fitted from the residual ratios (None: not fitted, or too few steps),
    # and its report per step kind (simcap.calibrate.noise_fit.fit_noise).
    noise: dict[str, Any] | None = None
    noise_report: dict[str, Any] | None = None
    # The roofline form: the profile's whole step_time section (None: the linear form's keys
    # from ``coefficients``), what else its provenance records (step-sample fits), and per
    # free term how far the data narrowed its prior (simulation-based fits).
    step_time: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    identification: dict[str, Any] | None = None

    def fitted_terms(self) -> list[str]:
        return [*self.form.free, *(t for t in self.form.tied if t not in self.form.free)]

    def to_dict(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "method": self.method,
            "form": str(self.form),
            "coefficients": {k: (None if v is None else _fmt(v)) for k, v in self.coefficients.items()},
            "ci": {k: [_fmt(lo), _fmt(hi)] for k, (lo, hi) in self.ci.items()},
            "ci_level": self.level,
            "bootstrap": {"method": self.bootstrap_method, "resamples": len(self.bootstrap)},
            "quality": self.quality,
            "residuals": self.residuals,
            "warnings": self.warnings,
            "notes": self.notes,
            "sources": self.sources,
            "noise": {"step_time_noise": self.noise, **(self.noise_report or {})}
            if self.noise_report else None,
            **({"identification": self.identification} if self.identification else {}),
        }
        if self.step_time is not None:
            out["step_time"] = self.step_time
            out.update(self.extra)
        return out


def _percentile_ci(
    sets: list[dict[str, float]], terms: Sequence[str], level: float
) -> dict[str, tuple[float, float]]:
    if not sets:
        return {}
    q = (1.0 - level) / 2 * 100
    out = {}
    for t in terms:
        lo, hi = np.percentile([s[t] for s in sets], [q, 100 - q])
        out[t] = (float(lo), float(hi))
    return out


def _quality(fit_rows: list[dict[str, Any]], warn_above: float, warnings: list[str]) -> dict[str, Any]:
    errs = [(abs(r["rel_error"]), r) for r in fit_rows if r["rel_error"] is not None]
    if not errs:
        return {"n": 0}
    worst_err, worst = max(errs, key=lambda e: e[0])
    fitted = [e for e, r in errs if r.get("fitted_in_objective", True)]
    for err, r in errs:
        if err > warn_above:
            tag = "" if r.get("fitted_in_objective", True) else " (reported, not fitted)"
            warnings.append(
                f"WARNING: relative error {err:.0%} at {r['point']} {r['metric']}{tag}: "
                f"fitted {r['fitted']:.4g} vs measured {r['measured']:.4g}"
            )
    if worst_err > warn_above:
        warnings.insert(0, f"WARNING: max relative error {worst_err:.0%} at {worst['point']} "
                           f"({worst['metric']}); the fit is poor there")
    return {
        "n": len(errs),
        "max_rel_error": round(worst_err, 4),
        "max_rel_error_at": f"{worst['point']} {worst['metric']}",
        "mean_abs_rel_error_fitted": round(float(np.mean(fitted)), 4) if fitted else None,
        "warn_above": warn_above,
    }
