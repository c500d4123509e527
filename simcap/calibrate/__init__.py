"""Calibration: measurements -> a fitted :class:`~simcap.profile.Profile`, with a fit report.

Reading guide. Two kinds of measurements, two fits, one output:

- **Step samples** (a profiler or live probe: one row per engine step with its batch features
  and measured seconds, as CSV or JSON; or vLLM's ``--enable-logging-iteration-details``
  lines) -> :func:`fit_step_samples`: direct non-negative least squares (``scipy.optimize.nnls``)
  of the free terms of the step-time form (:data:`simcap.engine.step_time.FEATURES`). The
  iteration log times the forward pass only; the host work between steps is an input
  (``host_overhead``) or, with step start times in the samples, measured from their gaps.
- **Benchmark results** (``vllm bench serve --save-result`` JSON; closed-loop concurrency
  tables such as the field's ``measurements.json``) -> :func:`fit_benchmarks`: simulation-based
  fitting. Each measured point becomes a small scenario (same concurrency, lengths, request
  count); ``scipy.optimize.least_squares`` moves the free coefficients until the simulated
  aggregates match the measured ones, residuals being log-ratios ``log(simulated / measured)``.

Both return a :class:`Fit`: coefficients, percentile confidence intervals from a bootstrap
(pairs bootstrap over step samples; for simulation-based fits a wild residual bootstrap whose
resamples are refitted by a few Gauss-Newton steps with the simulator's Jacobian frozen at the fit),
fitted vs measured for every point, and warnings. A poor fit is never hidden: every point whose
relative error exceeds ``warn_above`` produces a ``WARNING`` line naming it.

A **form** says which terms are free (``"base,per_decode_token,per_verify_token=per_decode_token"``:
``a=b`` ties ``a`` to the free term ``b``); the others keep the base profile's value, else 0.
A **recipe** (YAML with ``datasets:``) names the deployment (engine, speculative), the form,
the assumptions and the data files; ``calibration/recipes/`` holds the shipped profiles' recipes.

:func:`simulate_with_ci` re-runs a scenario with each bootstrap coefficient set of its profile
and returns intervals of the main summary metrics.

The modules, in the order ``simcap calibrate`` uses them:

1. :mod:`~simcap.calibrate.core` -- the terms, :class:`Form`, :class:`CalibrationError`.
2. :mod:`~simcap.calibrate.recipe` -- :class:`Recipe`; ``--base``, ``--fix`` and the inputs.
3. :mod:`~simcap.calibrate.pipeline` -- :func:`calibrate`: read the data, pick the fit, run it.
4. :mod:`~simcap.calibrate.readers` -- step samples, iteration logs, benchmark results.
5. :mod:`~simcap.calibrate.metrics` -- metric names of measurements, values of simulated runs.
6. :mod:`~simcap.calibrate.fit_steps` and :mod:`~simcap.calibrate.fit_bench` -- the two fits
   and their bootstraps; :mod:`~simcap.calibrate.result` -- the :class:`Fit` they return.
7. :mod:`~simcap.calibrate.profile_io` -- the profile YAML written from a fit.
8. :mod:`~simcap.calibrate.report` -- tables and the residual plot.
9. :mod:`~simcap.calibrate.uncertainty` -- :func:`simulate_with_ci` (``simcap simulate --ci``).
"""

from __future__ import annotations

from simcap.calibrate.core import TERMS, TYPICAL, CalibrationError, Form
from simcap.calibrate.fit_bench import default_benchmark_form, fit_benchmarks
from simcap.calibrate.fit_steps import fit_step_samples, noise_family
from simcap.calibrate.metrics import metric_of_key, metric_value
from simcap.calibrate.pipeline import calibrate
from simcap.calibrate.profile_io import profile_dict, write_profile
from simcap.calibrate.readers import (
    ITERATION_RE,
    BenchmarkPoint,
    StepSamples,
    parse_iteration_log,
    read_benchmarks,
    read_step_samples,
    split_input,
)
from simcap.calibrate.recipe import Recipe, base_from_profile, parse_fix, recipe_for
from simcap.calibrate.report import render_fit, render_intervals, residual_plot
from simcap.calibrate.result import Fit
from simcap.calibrate.uncertainty import CI_METRICS, simulate_with_ci

__all__ = [
    "CI_METRICS",
    "ITERATION_RE",
    "TERMS",
    "TYPICAL",
    "BenchmarkPoint",
    "CalibrationError",
    "Fit",
    "Form",
    "Recipe",
    "StepSamples",
    "base_from_profile",
    "calibrate",
    "default_benchmark_form",
    "fit_benchmarks",
    "fit_step_samples",
    "metric_of_key",
    "metric_value",
    "noise_family",
    "parse_fix",
    "parse_iteration_log",
    "profile_dict",
    "read_benchmarks",
    "read_step_samples",
    "recipe_for",
    "render_fit",
    "render_intervals",
    "residual_plot",
    "simulate_with_ci",
    "split_input",
    "write_profile",
]
