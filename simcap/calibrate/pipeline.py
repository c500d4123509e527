"""The entry point: :func:`calibrate` reads a recipe's datasets (or the given files), picks the
fit for their kind (step samples or benchmark results) and runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from simcap.calibrate.core import CalibrationError, Form
from simcap.calibrate.fit_bench import fit_benchmarks, fit_benchmarks_roofline
from simcap.calibrate.fit_steps import fit_step_samples
from simcap.calibrate.readers import _is_step_input, read_benchmarks, read_step_samples, split_input
from simcap.calibrate.recipe import Recipe
from simcap.calibrate.result import Fit


def calibrate(
    inputs: Sequence[str],
    recipe: Recipe,
    *,
    form: str | None = None,
    fix: dict[str, float] | None = None,
    host_overhead: float | None = None,
    workload: dict[str, Any] | None = None,
    num_speculative_tokens: int = 0,
    bootstrap: int | None = None,
    iterations: int | None = None,
    level: float = 0.9,
    warn_above: float | None = None,
    noise: str | None = "empirical",
) -> Fit:
    """Read the inputs (or the recipe's datasets), pick the fit for their kind, and run it."""
    roofline = recipe.step_time.get("form") == "roofline"
    fixed = {k: v for k, v in recipe.step_time.items() if v is not None}
    fixed.update(fix or {})
    if host_overhead is not None:
        fixed["host_overhead"] = host_overhead
    if roofline:
        if fix:
            raise CalibrationError("--fix: the roofline form takes its fixed values from the "
                                   "recipe's step_time section")
        if not (form or recipe.form):
            raise CalibrationError("form: the roofline form needs its free terms named "
                                   "(e.g. efficiency.weights, efficiency.experts, base)")
    form_obj = (Form.parse(form or recipe.form) if (form or recipe.form) and not roofline
                else None)
    warn = warn_above if warn_above is not None else recipe.warn_above
    base_dir = recipe.path.parent if recipe.path and recipe.datasets else Path(".")
    datasets = [dict(d) for d in recipe.datasets] or [
        {"input": i} for i in inputs
    ]
    if recipe.datasets and inputs:
        raise CalibrationError("calibrate: give a recipe or measurement files, not both")
    if not datasets:
        raise CalibrationError("calibrate: no input files")
    step_inputs, points = [], []
    for d in datasets:
        if "input" in d:
            file, selector = split_input(d["input"])
            path = Path(file)
        else:
            path, selector = base_dir / d["file"], d.get("select")
        if not path.exists():
            raise CalibrationError(f"{path}: cannot read: No such file or directory")
        if selector is None and _is_step_input(path):
            step_inputs.append(read_step_samples(path, num_speculative_tokens))
            continue
        if not recipe.engine:
            raise CalibrationError(
                f"{path}: benchmark results are fitted by simulation and need the deployment's "
                "engine section: give --base PROFILE.yaml (or a recipe)"
            )
        spec = recipe.speculative
        if "speculative" in d:
            own = d["speculative"]
            spec = None if own in (False, None) else {
                **(recipe.speculative or {}), **(own if isinstance(own, dict) else {})}
        wl = {**(d.get("workload") or {}), **(workload or {})}  # the command line wins
        points += read_benchmarks(path, selector, engine=recipe.engine, speculative=spec,
                                  workload=wl, seed=recipe.seed, label=d.get("label"))
    if step_inputs and points:
        raise CalibrationError("calibrate: give step samples or benchmark results, not both")
    if step_inputs:
        return fit_step_samples(step_inputs, form_obj, fixed=fixed,
                                host_overhead=fixed.get("host_overhead"),
                                bootstrap=200 if bootstrap is None else bootstrap, level=level,
                                seed=recipe.seed, warn_above=warn, noise=noise)
    if roofline:
        if step_inputs:
            raise CalibrationError("calibrate: the roofline form is fitted here from benchmark "
                                   "results only")
        return fit_benchmarks_roofline(
            points, fixed, form or recipe.form, prior=recipe.prior, fit_metrics=recipe.fit_metrics,
            weights=recipe.weights,
            bootstrap=(recipe.bootstrap or 40) if bootstrap is None else bootstrap,
            iterations=(recipe.bootstrap_iterations if recipe.bootstrap_iterations is not None
                        else 2) if iterations is None else iterations,
            level=level, seed=recipe.seed, warn_above=warn)
    return fit_benchmarks(points, form_obj, fixed=fixed, fit_metrics=recipe.fit_metrics,
                          weights=recipe.weights,
                          bootstrap=(recipe.bootstrap or 40) if bootstrap is None else bootstrap,
                          iterations=(recipe.bootstrap_iterations if recipe.bootstrap_iterations
                                      is not None else 2) if iterations is None else iterations,
                          level=level, seed=recipe.seed, warn_above=warn)
