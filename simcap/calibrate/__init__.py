"""Calibration: measurements -> a fitted :class:`~simcap.config.profiles.Profile`, with a fit report.

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
5. :mod:`~simcap.calibrate.metric_keys` -- metric names of measurements, values of simulated runs.
6. :mod:`~simcap.calibrate.fit_steps` and :mod:`~simcap.calibrate.fit_bench` -- the two fits
   and their bootstraps; :mod:`~simcap.calibrate.result` -- the :class:`Fit` they return.
7. :mod:`~simcap.calibrate.profile_io` -- the profile YAML written from a fit.
8. :mod:`~simcap.calibrate.fit_report` -- tables and the residual plot.
9. :mod:`~simcap.calibrate.score` -- :func:`score_profile`: a fixed profile against tables, row
   by row (``simcap score``).
10. :mod:`~simcap.calibrate.uncertainty` -- :func:`simulate_with_ci` (``simcap simulate --ci``).
"""

from __future__ import annotations

from simcap.runtime.lazy import lazy_exports

# Imported on first use, so that a command needing one part (``simulate --ci``, a report) does not
# load the fits and scipy.optimize.
_LAZY = {
    "CalibrationError": "simcap.calibrate.core",
    "Form": "simcap.calibrate.core",
    "TERMS": "simcap.calibrate.core",
    "TYPICAL": "simcap.calibrate.core",
    "default_benchmark_form": "simcap.calibrate.fit_bench",
    "fit_benchmarks": "simcap.calibrate.fit_bench",
    "fit_step_samples": "simcap.calibrate.fit_steps",
    "noise_family": "simcap.calibrate.fit_steps",
    "metric_of_key": "simcap.calibrate.metric_keys",
    "metric_value": "simcap.calibrate.metric_keys",
    "calibrate": "simcap.calibrate.pipeline",
    "check_fit_metrics": "simcap.calibrate.pipeline",
    "Score": "simcap.calibrate.score",
    "score_profile": "simcap.calibrate.score",
    "render_score": "simcap.calibrate.score",
    "score_plot": "simcap.calibrate.score",
    "TableReading": "simcap.calibrate.readers",
    "profile_dict": "simcap.calibrate.profile_io",
    "write_profile": "simcap.calibrate.profile_io",
    "BenchmarkPoint": "simcap.calibrate.readers",
    "ITERATION_RE": "simcap.calibrate.readers",
    "StepSamples": "simcap.calibrate.readers",
    "parse_iteration_log": "simcap.calibrate.readers",
    "fit_proposal_concentration": "simcap.calibrate.ngram",
    "read_benchmarks": "simcap.calibrate.readers",
    "read_step_samples": "simcap.calibrate.readers",
    "log_step_samples": "simcap.calibrate.readers",
    "split_input": "simcap.calibrate.readers",
    "Recipe": "simcap.calibrate.recipe",
    "base_from_profile": "simcap.calibrate.recipe",
    "parse_fix": "simcap.calibrate.recipe",
    "recipe_for": "simcap.calibrate.recipe",
    "render_fit": "simcap.calibrate.fit_report",
    "render_intervals": "simcap.calibrate.fit_report",
    "residual_plot": "simcap.calibrate.fit_report",
    "Fit": "simcap.calibrate.result",
    "CI_METRICS": "simcap.calibrate.uncertainty",
    "simulate_with_ci": "simcap.calibrate.uncertainty",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
