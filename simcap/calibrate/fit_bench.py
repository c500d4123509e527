"""Simulation-based fit of benchmark results: ``least_squares`` on log(simulated / measured),
every point re-simulated, with a wild residual bootstrap for the intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from simcap.calibrate.core import TYPICAL, CalibrationError, Form, _fmt
from simcap.calibrate.metric_keys import _is_fraction, metric_value
from simcap.calibrate.readers import BenchmarkPoint, ignored_keys
from simcap.calibrate.result import Fit, _percentile_ci, _quality
from simcap.config.scenario import StepTimeConfig, parse_scenario
from simcap.engine.step_time import ROOFLINE_COEFFICIENTS, ROOFLINE_SECONDS, ROOFLINE_TERMS
from simcap.errors import ScenarioError
from simcap.fleet.run import simulate
from simcap.metrics.summary import requests_running
from simcap.simulation.simulator import SimulationError


class _Objective:
    """Simulates every point at given coefficients (cached) and forms log-ratio residuals."""

    def __init__(self, points, form, fixed, metrics, smooth):
        self.points, self.form, self.fixed = points, form, fixed
        self.metrics = metrics  # per point: list of (metric, weight)
        self.smooth = smooth
        self.scale = np.array([fixed.get(t) or TYPICAL.get(t, 1.0) for t in form.free],
                              dtype=float)
        self.scenarios = []
        for pt in points:
            try:
                self.scenarios.append(parse_scenario({**pt.scenario, "step_time": {}}))
            except ScenarioError as exc:
                raise CalibrationError(f"{pt.source['file']} ({pt.label}): {exc}") from None
        self.cache: dict[tuple, list[dict[str, float]]] = {}
        self.evaluations = 0

    def coefficients(self, x: np.ndarray) -> dict[str, float]:
        return self.form.coefficients(np.maximum(x, 0.0) * self.scale, self.fixed)

    def step_time(self, coeffs: dict[str, float]) -> StepTimeConfig:
        return StepTimeConfig(**coeffs, host_overhead=self.fixed.get("host_overhead") or 0.0)

    def simulate(self, x: np.ndarray) -> list[dict[str, float]]:
        key = tuple(np.round(x, 12))
        if key in self.cache:
            return self.cache[key]
        coeffs = self.coefficients(x)
        step_time = self.step_time(coeffs)
        out = []
        for pt, sc, mets in zip(self.points, self.scenarios, self.metrics):
            try:
                res = simulate(sc.model_copy(update={"step_time": step_time}))
            except SimulationError as exc:
                raise CalibrationError(f"{pt.label}: simulation failed at {coeffs}: {exc}") from None
            itl: list = []
            values = {RUNNING: requests_running(res.summary)}
            for m in pt.measured:
                values[m] = metric_value(m, res, steady_state=pt.steady_state, _itl=itl)
                if _is_fraction(m):
                    values["~" + m] = metric_value(m, res, smooth=self.smooth, _itl=itl)
            out.append(values)
        self.evaluations += 1
        self.cache[key] = out
        return out

    def residuals(self, x: np.ndarray) -> np.ndarray:
        sims = self.simulate(x)
        r = []
        for pt, sim, mets in zip(self.points, sims, self.metrics):
            for m, w in mets:
                value = sim.get("~" + m, sim[m])
                eps = 0.02 if _is_fraction(m) else 1e-12
                r.append(w * (math.log(max(value, 0.0) + eps) - math.log(pt.measured[m] + eps)))
        return np.asarray(r)


def _rows_note(points: Sequence[BenchmarkPoint]) -> str:
    """What each row was simulated as, and how its throughput is read."""
    parts = []
    for p in points:
        wl = p.scenario["workload"]
        arrival = wl["arrival"]
        how = (f"closed loop of {arrival['concurrency']}" if arrival.get("process") == "closed"
               else f"{arrival.get('process')} at {arrival.get('rate')} req/s")
        parts.append(f"{p.label}: {how}, {wl.get('num_requests')} requests, input {wl.get('input_len')}, "
                     f"output {wl.get('output_len')}"
                     + ("; throughput = concurrency x tokens per request / mean E2E (steady state: the "
                        "row gives no request count)" if p.steady_state else "; throughput over the run"))
    return "rows simulated: " + "; ".join(parts)


def _ignored_note(points: Sequence[BenchmarkPoint]) -> str:
    """``; read as no metric: KEY, ...`` for the table keys the reader left out (else empty)."""
    keys = ignored_keys(points)
    return f"; keys read as no metric: {', '.join(keys)}" if keys else ""


def default_benchmark_form(points: Sequence[BenchmarkPoint]) -> Form:
    terms = ["base", "per_decode_token"]
    if any({"ttft_mean", "ttft_p50", "input_throughput"} & set(p.measured) for p in points):
        terms.insert(1, "per_prefill_token")
    if any(p.scenario.get("speculative") for p in points):
        terms += ["draft_per_pass", "draft_per_request"]
    return Form.parse(terms)


def fit_benchmarks(
    points: Sequence[BenchmarkPoint],
    form: Form | None = None,
    *,
    fixed: dict[str, float] | None = None,
    fit_metrics: Sequence[str] | None = None,
    weights: dict[str, float] | None = None,
    bootstrap: int = 40,
    iterations: int = 2,
    level: float = 0.9,
    seed: int = 0,
    warn_above: float = 0.1,
    smooth: float = 0.03,
    max_nfev: int | None = None,
) -> Fit:
    """Fit the free terms so that simulating each point reproduces its measured aggregates.

    Objective: ``sum (w_m log(simulated / measured))^2`` over points and fitted metrics
    (``fit_metrics``, default every measured one except ``request_throughput`` where
    ``output_throughput`` is measured too: with fixed output lengths they carry the same
    information). ITL fractions use ``log((x + 0.02) / (y + 0.02))`` and smoothed edges
    (``smooth``, width in log seconds). ``fixed`` holds the start values of free terms and the
    values of the others. Intervals: residual bootstrap (see module docstring).
    """
    from scipy.optimize import least_squares, lsq_linear  # slow to import: only where a fit runs

    if not points:
        raise CalibrationError("calibrate: no benchmark points")
    fixed = dict(fixed or {})
    form = form or default_benchmark_form(points)
    metrics = _fitted_metrics(points, fit_metrics, weights)
    n = sum(len(m) for m in metrics)
    p = len(form.free)
    if n < p:
        raise CalibrationError(
            f"calibrate: {n} fitted measurements are too few for {p} free terms ({', '.join(form.free)})"
            + _ignored_note(points)
        )
    obj = _Objective(points, form, fixed, metrics, smooth)
    x0 = np.ones(p)
    res = least_squares(obj.residuals, x0, bounds=(0.0, np.inf), method="trf", diff_step=0.02,
                        x_scale=1.0, xtol=1e-4, ftol=1e-5, max_nfev=max_nfev or 30 * p)
    if res.status < 0 or not np.all(np.isfinite(res.x)):
        raise CalibrationError(f"calibrate: the fit failed: {res.message}")
    if res.status == 0:
        files = ", ".join(sorted({pt.source["file"] for pt in points}))
        raise CalibrationError(
            f"{files}: the fit did not converge within {res.nfev} evaluations (free terms "
            f"{', '.join(form.free)}); fix a term with --form or give better start values"
        )
    warnings: list[str] = []
    notes = [f"least_squares: {res.nfev} evaluations ({obj.evaluations} distinct), {res.message}",
             _rows_note(points)]
    x_hat = res.x
    J = res.jac
    coeffs = obj.coefficients(x_hat)
    if "per_prefill_token" not in form.free and "per_prefill_token" not in form.tied and not coeffs["per_prefill_token"]:
        warnings.append(
            "WARNING: per_prefill_token is 0 (not a free term, and the base or --fix gives no value): "
            "every prompt prefills in no time, so TTFT is the step's base cost alone; free it in "
            "--form or give it with --fix")
    # identifiability: a near-null direction of the scaled Jacobian means terms trade off.
    active = x_hat > 1e-6
    if p > 1 and active.sum() > 1:
        Ja = J[:, active]
        sv = np.linalg.svd(Ja, compute_uv=True)
        if sv[1][-1] < 1e-3 * sv[1][0]:
            names = [t for t, a in zip(form.free, active) if a]
            null = sv[2][-1]
            pair = [names[j] for j in np.argsort(-np.abs(null))[:2]]
            warnings.append(
                f"WARNING: {' and '.join(pair)} are not separately identified by these points "
                "(one can be traded for the other); their intervals are wide or meaningless"
            )
    # Wild residual bootstrap. Data y* = simulated-at-fit x exp(e*/w) with e*_i = +-r_i (random
    # signs, Rademacher), so each measurement keeps its own misfit (metrics differ in kind: a
    # structural miss on one must not be dealt to another) and r*(x) = r(x) - r_hat - e*. Each
    # resample is refitted by Gauss-Newton steps with the Jacobian frozen at the fit (the chord
    # method), every step re-simulating all points; 0 iterations keeps the first, linearised step.
    r_hat = obj.residuals(x_hat)
    dof = max(n - p, 1)
    pool = r_hat * math.sqrt(n / dof)
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(bootstrap):
        e = pool * rng.choice([-1.0, 1.0], size=n)
        x = x_hat + lsq_linear(J, e, bounds=(-x_hat, np.inf)).x
        best, best_cost = x, math.inf
        for _ in range(iterations):
            r_star = obj.residuals(x) - r_hat - e
            cost = float(r_star @ r_star)
            if cost < best_cost:
                best, best_cost = x, cost
            x = x + lsq_linear(J, -r_star, bounds=(-x, np.inf)).x
        sets.append(obj.coefficients(best if iterations else x))
    terms = [*form.free, *form.tied]
    sets = [{t: _fmt(s[t]) for t in terms} for s in sets]
    method = (f"refitted by up to {iterations} Gauss-Newton steps with the Jacobian frozen at the "
              "fit, each re-simulating every point" if iterations else "one linearised "
              "Gauss-Newton step with the simulator's finite-difference Jacobian at the fit")
    rows = _residual_rows(points, obj.simulate(x_hat), metrics)
    quality = _quality(rows, warn_above, warnings)
    quality["rms_log_error"] = round(float(np.sqrt(np.mean(r_hat**2))), 4) if n else None
    coeffs_all = {**coeffs, "host_overhead": float(fixed.get("host_overhead") or 0.0)}
    return Fit(
        kind="benchmarks",
        method=("simulation-based: scipy.optimize.least_squares (trf, bounds >= 0) on "
                "log(simulated / measured) of the fitted aggregates, every point re-simulated"),
        form=form, coefficients=coeffs_all, fixed=fixed, ci=_percentile_ci(sets, terms, level),
        bootstrap=sets,
        bootstrap_method=f"wild bootstrap (random signs) of the {n} log-ratio residuals "
                         f"(scaled by sqrt(n/(n-p))), {bootstrap} resamples, seed {seed}: {method}",
        level=level, residuals=rows,
        sources=_merge_sources(points), warnings=warnings, notes=notes, quality=quality,
        extra={"fit_load": fit_loads(points, obj.simulate(x_hat))},
    )


def _merge_sources(points: Sequence[BenchmarkPoint]) -> list[dict[str, Any]]:
    merged: dict[tuple, dict[str, Any]] = {}
    for pt in points:
        src = pt.source
        key = (src["file"], src.get("select"))
        entry = merged.setdefault(key, {**{k: v for k, v in src.items() if k != "row"}, "rows": [],
                                        "points": []})
        if src.get("row") is not None:
            entry["rows"].append(src["row"])
        entry["points"].append({"label": pt.label, "workload": pt.scenario["workload"],
                                "speculative": pt.scenario.get("speculative") is not None})
    return list(merged.values())


# --------------------------------------------------------------------------- roofline form
#
# The roofline form's free terms are its efficiencies (multipliers of physical terms, prior 1)
# and the seconds terms base, per_request and mixed_step. Efficiencies are fitted in log space
# with a Gaussian pull toward log(prior) (a log-normal prior): a term the data cannot pin stays
# near its prior instead of wandering along a near-null direction of the Jacobian.

ROOFLINE_TYPICAL = {"base": 0.01, "per_request": 1e-4, "mixed_step": 0.01}
# Default prior: efficiency 1 with a log-space sd of 0.7 (a factor 2 is one sd), against a data
# noise of 5% per fitted aggregate (one run per published figure). A term counts as pinned by
# the data when its posterior sd is under half its prior sd (the data hold >= 75% of the
# information about it).
PRIOR_SIGMA = 0.7
DATA_SIGMA = 0.05
PINNED_BELOW = 0.5


def _roofline_term(name: str) -> str:
    name = name.strip()
    if name in ROOFLINE_TERMS:
        name = f"efficiency.{name}"
    if name not in ROOFLINE_COEFFICIENTS:
        raise CalibrationError(
            f"form: unknown roofline term {name!r}; allowed: {', '.join(ROOFLINE_COEFFICIENTS)}"
        )
    return name


@dataclass(frozen=True)
class RooflineForm:
    """Free roofline terms (``efficiency.weights`` or ``weights``, ``base``, ...) and tied ones
    (``efficiency.experts=efficiency.weights``: one shared multiplier)."""

    free: tuple[str, ...]
    tied: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | Sequence[str]) -> "RooflineForm":
        items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
        free: list[str] = []
        tied: dict[str, str] = {}
        for item in (i for i in items if i):
            name, sep, other = item.partition("=")
            if sep:
                tied[_roofline_term(name)] = _roofline_term(other)
            elif _roofline_term(name) not in free:
                free.append(_roofline_term(name))
        for name, other in tied.items():
            if other not in free or name in free:
                raise CalibrationError(f"form: {name}={other} must tie a non-free term to a free one")
            if (name in ROOFLINE_SECONDS) != (other in ROOFLINE_SECONDS):
                raise CalibrationError(f"form: {name}={other} ties seconds to a multiplier")
        if not free:
            raise CalibrationError("form: no free term; name at least one of "
                                   + ", ".join(ROOFLINE_COEFFICIENTS))
        return cls(tuple(free), tied)

    def __str__(self) -> str:
        return ",".join([*self.free, *(f"{a}={b}" for a, b in self.tied.items())])

    def ties(self, fixed: dict[str, float] | None = None) -> dict[str, str]:
        return dict(self.tied)


def roofline_coefficients(step_time: dict[str, Any]) -> dict[str, float]:
    """The flat roofline coefficients (base, per_request, mixed_step, efficiency.<term>) of a
    step_time mapping; efficiencies absent are 1, seconds absent 0."""
    eff = step_time.get("efficiency") or {}
    out = {t: float(step_time.get(t) or 0.0) for t in ROOFLINE_SECONDS}
    for t in ROOFLINE_TERMS:
        out[f"efficiency.{t}"] = float(eff.get(t, 1.0))
    return out


def apply_coefficients(step_time: dict[str, Any], coeffs: dict[str, float]) -> dict[str, Any]:
    """``step_time`` (a mapping) with flat coefficients (``efficiency.kv_read`` style keys
    included) written in; used to re-run a scenario with a bootstrap coefficient set."""
    out = dict(step_time)
    eff = dict(out.get("efficiency") or {})
    for key, value in coeffs.items():
        if key.startswith("efficiency."):
            eff[key.split(".", 1)[1]] = value
        else:
            out[key] = value
    if eff:
        out["efficiency"] = eff
    return out


def _starts(x0, obj, form, priors, starts, seed, lower, upper):
    """The local fits' start points (variable units): ``x0``, then ``starts - 1`` draws
    around it (see :func:`fit_benchmarks_roofline`)."""
    yield x0
    rng = np.random.default_rng([seed, 7])
    for _ in range(starts - 1):
        x = x0.copy()
        for j, t in enumerate(form.free):
            if obj.is_log[j]:
                x[j] += (priors[t][1] if t in priors else PRIOR_SIGMA) * rng.standard_normal()
            else:
                x[j] *= rng.uniform(0.5, 2.0)
        yield np.clip(x, lower, np.where(np.isfinite(upper), upper, 1e9))


FD_STEP = 0.02  # the roofline fit's finite-difference step (:meth:`_RooflineObjective.jacobian`)


class _RooflineObjective(_Objective):
    """Data residuals as :class:`_Objective`, then one prior row per free multiplier:
    ``(DATA_SIGMA / prior_sigma) x log(e / prior)``, and per seconds term with a prior
    ``(DATA_SIGMA / sigma_s) x (value - prior)``. Variables: log(e) for multipliers,
    value / scale for seconds."""

    def __init__(self, points, form, step_time, metrics, smooth, priors, data_sigma):
        self.static = {k: v for k, v in step_time.items()
                       if k not in (*ROOFLINE_SECONDS, "efficiency", "host_overhead")}
        self.start = roofline_coefficients(step_time)
        self.host = float(step_time.get("host_overhead") or 0.0)
        self.priors, self.data_sigma = priors, data_sigma
        super().__init__(points, form, {}, metrics, smooth)
        self.scale = np.array([
            (self.start[t] or ROOFLINE_TYPICAL[t]) if t in ROOFLINE_SECONDS else 1.0
            for t in form.free])
        self.is_log = np.array([t not in ROOFLINE_SECONDS for t in form.free])

    def x0(self) -> np.ndarray:
        return np.array([math.log(max(self.start[t], 1e-6)) if log else 1.0
                         for t, log in zip(self.form.free, self.is_log)])

    def coefficients(self, x: np.ndarray) -> dict[str, float]:
        out = dict(self.start)
        vals = np.where(self.is_log, np.exp(np.clip(x, -8, 8)), np.maximum(x, 0.0) * self.scale)
        for t, v in zip(self.form.free, vals):
            out[t] = float(v)
        for a, b in self.form.tied.items():
            out[a] = out[b]
        return out

    def step_time(self, coeffs: dict[str, float]) -> StepTimeConfig:
        cfg = apply_coefficients({**self.static, "form": "roofline", "host_overhead": self.host},
                                 coeffs)
        try:
            return StepTimeConfig(**cfg)
        except (ValueError, ScenarioError) as exc:
            raise CalibrationError(f"step_time: {exc}") from None

    def prior_rows(self) -> list[tuple[int, float, float, bool]]:
        """(variable index, centre in variable units, weight, is_log) of each prior row."""
        rows = []
        for j, t in enumerate(self.form.free):
            prior = self.priors.get(t)
            if prior is None:
                continue
            centre, sigma = prior
            if self.is_log[j]:
                rows.append((j, math.log(centre), self.data_sigma / sigma, True))
            else:
                rows.append((j, centre / self.scale[j], self.data_sigma * self.scale[j] / sigma, False))
        return rows

    def residuals(self, x: np.ndarray) -> np.ndarray:
        data = super().residuals(x)
        prior = [w * (x[j] - c) for j, c, w, _ in self.prior_rows()]
        return np.concatenate([data, np.asarray(prior, dtype=float)])

    def jacobian(self, x: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Forward differences, each variable's step FD_STEP in log(e) (an efficiency moved by
        2%) or FD_STEP of a seconds term's value (at least of a tenth of its scale), backward
        where the step would pass ``upper``. A step relative to the variable, as
        ``least_squares``' own, vanishes at log(1) = 0: an efficiency started at the floor of 1
        would read as flat there and never leave it."""
        f0 = self.residuals(x)
        jac = np.empty((f0.size, x.size))
        for j in range(x.size):
            h = FD_STEP if self.is_log[j] else FD_STEP * max(abs(x[j]), 0.1)
            if x[j] + h > upper[j]:
                h = -h
            xj = x.copy()
            xj[j] += h
            jac[:, j] = (self.residuals(xj) - f0) / h
        return jac


def _roofline_priors(form: RooflineForm, prior: dict[str, Any] | None,
                     step_time: dict[str, Any] | None = None) -> tuple[dict, float]:
    """{free term: (centre, sigma)} and the data sigma from a recipe's ``prior`` section:
    ``{sigma: 0.7, data_sigma: 0.05, terms: {efficiency.draft: {value: 1, sigma: 1.0},
    mixed_step: {value: 0.0, sigma: 0.1}}, efficiency_floor: 1, kernel_class: NAME}`` (a
    multiplier's sigma is log-space; a seconds term has no prior unless given one; the floor is
    read by :func:`_floor_of`; a catalog kernel class centres the efficiencies it names on what
    its kernels achieved, with its sigma, where ``terms`` does not say otherwise, and must
    cover ``step_time``'s hardware and expert weight dtype)."""
    prior = dict(prior or {})
    unknown = sorted(set(prior) - {"sigma", "data_sigma", "terms", "efficiency_floor", "kernel_class"})
    if unknown:
        raise CalibrationError(f"prior: unknown key {unknown[0]!r}; allowed: sigma, data_sigma, "
                               "terms, efficiency_floor, kernel_class")
    sigma = float(prior.get("sigma", PRIOR_SIGMA))
    data_sigma = float(prior.get("data_sigma", DATA_SIGMA))
    own = {_roofline_term(k): v for k, v in (prior.get("terms") or {}).items()}
    if "kernel_class" in prior:
        for t, spec in _kernel_class_priors(prior["kernel_class"], step_time or {}).items():
            own.setdefault(t, spec)
    out = {}
    for t in form.free:
        spec = own.get(t)
        if spec is None:
            if t not in ROOFLINE_SECONDS and sigma > 0:
                out[t] = (1.0, sigma)
            continue
        if spec in (False, "none"):
            continue
        out[t] = (float(spec.get("value", 0.0 if t in ROOFLINE_SECONDS else 1.0)),
                  float(spec.get("sigma", sigma)))
        if out[t][1] <= 0 or (t not in ROOFLINE_SECONDS and out[t][0] <= 0):
            raise CalibrationError(f"prior.terms.{t}: value > 0 (multipliers) and sigma > 0 required")
    return out, data_sigma


def _kernel_class_priors(name: Any, step_time: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{efficiency.term: {value, sigma}}`` of a catalog kernel class, checked against the
    deployment it is to price."""
    from simcap.catalog import resolve_kernel_class

    try:
        kc = resolve_kernel_class(name, "prior.kernel_class")
    except ScenarioError as exc:
        raise CalibrationError(str(exc)) from None
    hw, dtype = step_time.get("hardware"), step_time.get("expert_weight_dtype")
    if not kc.covers(hw, dtype):
        raise CalibrationError(
            f"prior.kernel_class: {name} covers {', '.join(kc.hardware)}; step_time.hardware is {hw!r}"
            if hw not in kc.hardware else
            f"prior.kernel_class: {name} is for expert_weight_dtype {kc.expert_weight_dtype}; step_time has {dtype!r}")
    return {f"efficiency.{t}": {"value": v, "sigma": kc.sigma} for t, v in kc.efficiency.items()}


def _floor_of(prior: dict[str, Any] | None, hardware: Any) -> float:
    """The efficiencies' lower bound: a recipe ``prior`` section's ``efficiency_floor``, else
    the hardware's own (1 for datasheet peaks, none for measured rates)."""
    from simcap.calibrate.fit_roofline import check_floor

    try:
        return check_floor((prior or {}).get("efficiency_floor"), hardware)
    except CalibrationError as exc:
        raise CalibrationError(f"prior.{exc}") from None


def fit_benchmarks_roofline(
    points: Sequence[BenchmarkPoint],
    step_time: dict[str, Any],
    form: RooflineForm | str | Sequence[str],
    *,
    prior: dict[str, Any] | None = None,
    fit_metrics: Sequence[str] | None = None,
    weights: dict[str, float] | None = None,
    bootstrap: int = 40,
    iterations: int = 2,
    level: float = 0.9,
    seed: int = 0,
    warn_above: float = 0.1,
    smooth: float = 0.03,
    max_nfev: int | None = None,
    starts: int = 1,
) -> Fit:
    """Fit the roofline form's free multipliers and seconds terms by re-simulating every point.

    ``step_time``: the roofline section (form, hardware, model, dtypes, tp, ...), whose
    efficiencies and seconds are the start values of free terms and the values of the others.
    Objective: the data rows of :func:`fit_benchmarks` plus the prior rows of
    :class:`_RooflineObjective`. Intervals: the wild bootstrap of :func:`fit_benchmarks` on the
    data rows, with each prior's centre redrawn from the prior (so a term the data do not pin
    keeps an interval as wide as its prior). ``Fit.identification`` says per free term how
    much the data narrowed its prior (Laplace approximation at the fit) and whether it is pinned.

    ``starts`` > 1: the local fit runs from the given start values and from ``starts - 1``
    more, drawn (seeded) around them: a multiplier log-normally with its prior's sigma, a
    seconds term uniformly between half and twice its start; the fit of least cost is kept
    and the notes give every start's cost. (The objective re-simulates discrete steps, so a
    local fit can stop in a poor minimum that another start avoids.)
    """
    from scipy.optimize import least_squares, lsq_linear  # slow to import: only where a fit runs

    if not points:
        raise CalibrationError("calibrate: no benchmark points")
    if step_time.get("form") != "roofline":
        raise CalibrationError("step_time.form: the roofline fit needs form: roofline")
    form = form if isinstance(form, RooflineForm) else RooflineForm.parse(form)
    priors, data_sigma = _roofline_priors(form, prior, step_time)
    metrics = _fitted_metrics(points, fit_metrics, weights)
    n = sum(len(m) for m in metrics)
    p = len(form.free)
    obj = _RooflineObjective(points, form, step_time, metrics, smooth, priors, data_sigma)
    floor = _floor_of(prior, obj.step_time(obj.start).physics.hardware)
    for t, (centre, _) in priors.items():
        if t not in ROOFLINE_SECONDS and centre < floor:
            raise CalibrationError(f"prior.terms.{t}: value {centre:g} is below efficiency_floor {floor:g}")
    n_prior = len(obj.prior_rows())
    if n + n_prior < p:
        raise CalibrationError(
            f"calibrate: {n} fitted measurements and {n_prior} priors are too few for {p} free "
            f"terms ({', '.join(form.free)})" + _ignored_note(points))
    lower = np.where(obj.is_log, math.log(floor) if floor > math.exp(-8.0) else -8.0, 0.0)
    upper = np.where(obj.is_log, 8.0, np.inf)
    x0 = np.clip(obj.x0(), lower, np.where(np.isfinite(upper), upper, 1e9))
    # The optimizer sees log(e) + 1: its first trust region is as wide as the start vector, which
    # is 0 for efficiencies started at the floor of 1 (a one-term refit there would not move).
    shift = np.where(obj.is_log, 1.0, 0.0)
    fits = []
    for x_start in _starts(x0, obj, form, priors, starts, seed, lower, upper):
        res = least_squares(lambda z: obj.residuals(z - shift), x_start + shift,
                            jac=lambda z: obj.jacobian(z - shift, upper), bounds=(lower + shift, upper + shift),
                            method="trf", x_scale=1.0, xtol=1e-4, ftol=1e-5, max_nfev=max_nfev or 30 * p)
        res.x = res.x - shift
        fits.append(res)
        if res.status < 0 or not np.all(np.isfinite(res.x)):
            raise CalibrationError(f"calibrate: the fit failed: {res.message}")
    best = min(range(len(fits)), key=lambda i: (fits[i].status == 0, fits[i].cost))
    res = fits[best]
    if res.status == 0:
        files = ", ".join(sorted({pt.source["file"] for pt in points}))
        raise CalibrationError(
            f"{files}: the fit did not converge within {res.nfev} evaluations (free terms "
            f"{', '.join(form.free)}); fix a term or give better start values")
    warnings: list[str] = []
    notes = [f"least_squares: {res.nfev} evaluations ({obj.evaluations} distinct), {res.message}",
             _rows_note(points)]
    if len(fits) > 1:
        notes.append(f"{len(fits)} starts (the recipe's, then {len(fits) - 1} drawn around it; seed {seed}): "
                     f"costs {', '.join(f'{f.cost:.4g}' for f in fits)}; kept start {best + 1}")
    # Efficiencies the fit holds at the floor against the data (they want less time); trf
    # stays a hair inside its bounds, so those are set on it.
    at_floor = obj.is_log & (res.active_mask < 0)
    held = [t for t, h in zip(form.free, at_floor) if h]
    x_hat, J = np.where(at_floor, lower, res.x), res.jac
    coeffs = obj.coefficients(x_hat)
    # Identification (Laplace approximation): posterior covariance (J'J)^-1 in residual units,
    # against the prior's own variance (1 / w^2 in the same units).
    H = J.T @ J
    try:
        cov = np.linalg.inv(H + 1e-12 * np.eye(p))
    except np.linalg.LinAlgError:
        cov = np.linalg.pinv(H)
    post_sd = np.sqrt(np.maximum(np.diag(cov), 0.0))
    prior_w = {j: w for j, _, w, _ in obj.prior_rows()}
    identification: dict[str, dict[str, Any]] = {}
    # Wild bootstrap: data rows by random signs, prior centres redrawn from their priors.
    r_hat = obj.residuals(x_hat)
    dof = max(n + n_prior - p, 1)
    pool = r_hat[:n] * math.sqrt((n + n_prior) / dof) if n else r_hat[:n]
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(bootstrap):
        e = np.concatenate([pool * rng.choice([-1.0, 1.0], size=n),
                            data_sigma * rng.standard_normal(n_prior)])
        x = x_hat + lsq_linear(J, e, bounds=(lower - x_hat, upper - x_hat)).x
        best, best_cost = x, math.inf
        for _ in range(iterations):
            r_star = obj.residuals(x) - r_hat - e
            cost = float(r_star @ r_star)
            if cost < best_cost:
                best, best_cost = x, cost
            x = np.clip(x + lsq_linear(J, -r_star, bounds=(lower - x, upper - x)).x, lower, upper)
        sets.append(obj.coefficients(best if iterations else x))
    terms = [*form.free, *form.tied]
    sets = [{t: _fmt(s[t]) for t in terms} for s in sets]
    ci = _percentile_ci(sets, terms, level)
    if abs(level - 0.9) < 1e-9:
        z = 1.6449
    else:
        from scipy.stats import norm

        z = float(norm.ppf(0.5 + level / 2))
    for j, t in enumerate(form.free):
        entry: dict[str, Any] = {"value": _fmt(coeffs[t]), "ci": [_fmt(v) for v in ci.get(t, (0, 0))]}
        if j in prior_w:
            centre, sigma = priors[t]
            shrink = float(post_sd[j] * prior_w[j])  # posterior sd / prior sd
            entry.update({"prior": centre, "prior_sigma": sigma,
                          "prior_interval": ([_fmt(centre * math.exp(-z * sigma)),
                                              _fmt(centre * math.exp(z * sigma))]
                                             if t not in ROOFLINE_SECONDS else
                                             [_fmt(max(centre - z * sigma, 0.0)), _fmt(centre + z * sigma)]),
                          "posterior_sd_over_prior_sd": round(shrink, 3),
                          "data_share_of_information": round(max(0.0, 1.0 - shrink**2), 3),
                          "pinned": bool(shrink < PINNED_BELOW)})
        else:
            sd = data_sigma * post_sd[j] * (obj.scale[j] if not obj.is_log[j] else 1.0)
            entry.update({"prior": None, "posterior_sd": _fmt(sd),
                          "pinned": bool(sd < 0.5 * max(coeffs[t], 1e-12))})
        if t in held:
            entry["held_at_floor"] = True
        identification[t] = entry
    unpinned = [t for t, e in identification.items() if not e["pinned"]]
    if unpinned:
        notes.append("not pinned by the data (held by the prior, or poorly identified): "
                     + ", ".join(unpinned))
    from simcap.calibrate.fit_roofline import physics_floor_notes  # (scipy: a fit's, not start-up's)

    notes += physics_floor_notes({t: coeffs[t] for t in form.free}, held, floor)
    rows = _residual_rows(points, obj.simulate(x_hat), metrics)
    quality = _quality(rows, warn_above, warnings)
    quality["rms_log_error"] = round(float(np.sqrt(np.mean(r_hat[:n] ** 2))), 4) if n else None
    st_out = apply_coefficients({k: v for k, v in step_time.items() if k != "efficiency"},
                                {**roofline_coefficients(step_time), **coeffs})
    st_out["efficiency"] = {k: _fmt(v) for k, v in st_out["efficiency"].items()}
    for t in ROOFLINE_SECONDS:
        st_out[t] = _fmt(st_out[t])
    method = (f"refitted by up to {iterations} Gauss-Newton steps with the Jacobian frozen at the "
              "fit, each re-simulating every point" if iterations else "one linearised step")
    return Fit(
        kind="benchmarks",
        method=("simulation-based, roofline form: scipy.optimize.least_squares (trf) on "
                "log(simulated / measured) of the fitted aggregates, every point re-simulated, "
                f"plus a log-normal pull of each free efficiency toward its prior (data sigma "
                f"{data_sigma:g}); efficiencies fitted in log space, each at least {floor:g}"),
        form=form, coefficients={**coeffs, "host_overhead": obj.host}, fixed={},
        ci=ci, bootstrap=sets,
        bootstrap_method=(f"wild bootstrap (random signs) of the {n} log-ratio residuals (scaled "
                          f"by sqrt(n/(n-p))) with the {n_prior} prior centres redrawn from their "
                          f"priors, {bootstrap} resamples, seed {seed}: {method}"),
        level=level, residuals=rows, sources=_merge_sources(points), warnings=warnings,
        notes=notes, quality=quality, step_time=st_out, identification=identification,
        extra={"fit_load": fit_loads(points, obj.simulate(x_hat))},
    )


def _fitted_metrics(
    points: Sequence[BenchmarkPoint], fit_metrics: Sequence[str] | None, weights: dict[str, float] | None
) -> list[list[tuple[str, float]]]:
    """Per point, the (metric, weight) pairs the objective fits: ``fit_metrics`` (default every
    measured one but ``request_throughput`` where ``output_throughput`` is measured too),
    those of weight 0 left out."""
    weights = dict(weights or {})
    metrics = []
    for pt in points:
        names = [m for m in pt.measured if fit_metrics is None or m in fit_metrics]
        if fit_metrics is None and "output_throughput" in names and "request_throughput" in names:
            names.remove("request_throughput")
        metrics.append([(m, weights.get(m, 1.0)) for m in names if weights.get(m, 1.0) > 0])
    return metrics


RUNNING = "@requests_running"  # a simulation's own figure beside the measured ones (not fitted)


def fit_loads(points, sims) -> dict[str, float | None]:
    """The most requests running (:func:`~simcap.metrics.summary.requests_running`) any fitted
    row had at the fit, over all rows and over the rows with and without speculation: how far
    the profile's data reached, for the model-form interval of a prediction past it."""
    def most(sel: list[float | None]) -> float | None:
        known = [v for v in sel if v is not None]
        return round(max(known), 3) if known else None

    spec = [bool(pt.scenario.get("speculative")) for pt in points]
    loads = [sim.get(RUNNING) for sim in sims]
    return {"all": most(loads), "speculative": most([v for v, s in zip(loads, spec) if s]),
            "plain": most([v for v, s in zip(loads, spec) if not s])}


def _residual_rows(points, sims, metrics) -> list[dict[str, Any]]:
    """One row per published figure: measured, simulated at the fit, relative error."""
    rows = []
    for pt, sim, mets in zip(points, sims, metrics):
        fitted_names = {m for m, _ in mets}
        for m, meas in pt.measured.items():
            value = sim[m]
            rel = (value - meas) / meas if meas else None
            rows.append({
                "point": pt.label, "metric": m, "measured": _fmt(meas), "fitted": _fmt(value),
                "rel_error": None if rel is None else round(rel, 4),
                "fitted_in_objective": m in fitted_names,
            })
    return rows
