"""Intervals of a simulation: :func:`simulate_with_ci` re-runs a scenario with each bootstrap
coefficient set of its profile."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from simcap.calibrate.metric_keys import metric_value
from simcap.config.profiles import load_profile
from simcap.config.scenario import Scenario, StepTimeConfig
from simcap.errors import ScenarioError
from simcap.fleet.run import simulate
from simcap.simulation.simulator import Result


CI_METRICS = (
    "output_throughput", "request_throughput",
    *(f"{m}_{s}" for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p95", "p99")),
)


def simulate_with_ci(
    scenario: Scenario,
    profile_path: str | Path | None = None,
    level: float = 0.9,
    max_sets: int | None = None,
    *,
    records: bool = False,
    steps: bool = False,
) -> tuple[Result, dict[str, tuple[float, float]]]:
    """Simulate ``scenario``, then again with each bootstrap coefficient set of its profile.

    Returns the central result and ``{metric: (low, high)}``: percentile intervals at ``level``
    over the re-runs, for the metrics of :data:`CI_METRICS`. A coefficient the scenario sets
    itself (differs from the profile's) is not varied. The re-runs keep the scenario's seed, so
    the intervals show the coefficients' uncertainty only, not the workload's sampling noise.
    ``records``, ``steps``: what the central result keeps (as for :func:`simulate`).
    """
    path = profile_path or scenario.profile_file
    if path is None:
        raise ScenarioError("profile: intervals need a profile with bootstrap coefficient sets; "
                            "the scenario names none (profile: PATH)")
    profile, _ = load_profile(path)
    if not profile.bootstrap:
        raise ScenarioError(f"profile: {path} has no bootstrap coefficient sets; refit it with "
                            "simcap calibrate")
    result = simulate(scenario, records=records, steps=steps)
    own = scenario.step_time.model_dump()
    sets = profile.bootstrap[:max_sets] if max_sets else profile.bootstrap
    values: dict[str, list[float]] = {m: [] for m in CI_METRICS}
    for coeffs in sets:
        st = dict(own)
        for key, value in coeffs.items():
            if key.startswith("efficiency."):  # the roofline form's multipliers
                name = key.split(".", 1)[1]
                mine = (st.get("efficiency") or {}).get(name)
                theirs = (profile.step_time.get("efficiency") or {}).get(name, 1.0)
                if mine is None or math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-15):
                    st["efficiency"] = {**(st.get("efficiency") or {}), name: value}
                continue
            from_profile = profile.step_time.get(key)
            if key in st and (from_profile is None or st[key] is None
                              or math.isclose(st[key], from_profile, rel_tol=1e-9, abs_tol=1e-15)):
                st[key] = value
        res = simulate(scenario.model_copy(update={"step_time": StepTimeConfig(**st)}))
        for m in CI_METRICS:
            v = metric_value(m, res)
            if v is not None and math.isfinite(v):
                values[m].append(v)
    q = (1.0 - level) / 2 * 100
    ci = {m: (float(np.percentile(v, q)), float(np.percentile(v, 100 - q))) for m, v in values.items() if v}
    return result, ci
