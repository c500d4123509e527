"""Writing a fit out: the profile dict (deployment, coefficients, intervals, bootstrap sets,
provenance) and its YAML file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from simcap._version import __version__
from simcap.calibrate.core import TERMS, CalibrationError, _fmt
from simcap.calibrate.recipe import Recipe
from simcap.calibrate.result import Fit
from simcap.config.scenario import StepTimeConfig


def profile_dict(
    fit: Fit, recipe: Recipe, *, command: str | None = None, noise: bool = True
) -> dict[str, Any]:
    """The profile (YAML-ready dict) of a fit: deployment, coefficients, CI, bootstrap, provenance.

    ``noise``: write the fit's ``step_time.noise`` (when it has one).
    """
    step_time = {}
    for key in StepTimeConfig.model_fields if fit.step_time is None else ():
        if key == "noise":
            continue
        value = fit.coefficients.get(key)
        if value is None:
            continue
        if key == "per_verify_token" and key not in fit.fitted_terms() and fit.fixed.get(key) is None:
            continue  # None: the decode token's cost, as StepTimeConfig says
        step_time[key] = _fmt(value)
    out: dict[str, Any] = {"name": recipe.name}
    for key in ("hardware", "model", "description"):
        if getattr(recipe, key):
            out[key] = getattr(recipe, key)
    out["engine"] = dict(recipe.engine)
    if fit.step_time is not None:  # the roofline form: its whole section
        step_time = dict(fit.step_time)
    out["step_time"] = step_time
    if noise and fit.noise:
        step_time["noise"] = fit.noise
    if recipe.speculative:
        out["speculative"] = dict(recipe.speculative)
    out["step_time_ci"] = {k: [_fmt(lo), _fmt(hi)] for k, (lo, hi) in fit.ci.items()}
    out["bootstrap"] = fit.bootstrap
    out["provenance"] = {
        "simcap_version": __version__,
        "fit_method": fit.method,
        "fitted_with": command,
        "recipe": str(recipe.path) if recipe.path else None,
        "data": fit.sources,
        "form": {"free": list(fit.form.free), "tied": dict(fit.form.tied),
                 "fixed": {t: _fmt(v) for t, v in fit.coefficients.items()
                           if (t in TERMS or fit.step_time is not None) and v is not None
                           and t not in fit.fitted_terms() and t != "host_overhead"}},
        "ci": {"level": fit.level, "method": fit.bootstrap_method},
        "assumptions": list(recipe.assumptions),
        "notes": fit.notes,
        "warnings": fit.warnings,
        "fit_quality": fit.quality,
        **({"identification": fit.identification} if fit.identification else {}),
        "noise": None if fit.noise_report is None else {**fit.noise_report, "written": bool(noise and fit.noise)},
        "residuals": fit.residuals if len(fit.residuals) <= 500 else fit.residuals[:500],
    }
    if "roofline" in fit.extra:
        out["provenance"]["roofline"] = fit.extra["roofline"]
    if "fit_load" in fit.extra:  # requests running at the fitted rows (simcap.accuracy.model_form)
        out["provenance"]["fit_load"] = fit.extra["fit_load"]
    return out


def write_profile(data: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    text = yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=False, width=100, allow_unicode=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot write profile: {exc.strerror}") from None
