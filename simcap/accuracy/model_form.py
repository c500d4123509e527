"""The model-form error of simcap's predictions, learned from the accuracy corpus's held-out
figures, and the intervals it gives a prediction.

A bootstrap over the rows a profile was fitted on says how much the fit moves with its data; it
cannot say how wrong the step-time form is where no row reached. That error is measured here,
from every held-out figure of the corpus (each a prediction from a fit on other data):

- its log error ``e = log(predicted / measured)``;
- its metric's family (:func:`family`): TTFT, per-token latency (TPOT, ITL), end-to-end
  latency, throughput; medians and means apart from tails (p90 and above);
- its distance past the fit part, ``d = max(0, log2(load / fit_load))`` in requests running
  (:mod:`simcap.accuracy.replay`): 0 inside the fitted range, 1 at twice its load.

Per family, ``e`` is taken as ``N(0, s0^2 + (a d)^2)``: ``s0`` the error at the fitted load
(noise of the measurement, host effects, what the form misses everywhere), ``a`` its growth per
doubling of load past it. ``s0`` and ``a`` are fitted by maximum likelihood; the interval's
half-width in log space is ``q sigma(d)``, with ``q`` the split-conformal quantile of the
training figures' ``|e| / sigma(d)`` (the ``ceil((n + 1) level)``-th smallest of n), not a
normal quantile: the errors have heavier tails than a normal. A family with fewer than
:data:`MIN_FIGURES` figures takes the pooled fit of all families.

:func:`coverage` checks the intervals the honest way: each case's figures get intervals from a
fit on the other cases only (leave one case out), and the share of figures inside them is
reported, with the intervals' median width.

What uses them: :func:`summary_intervals` (``simcap simulate --model-form``),
:func:`crossover_band` (``simcap crossover --model-form``: the throughput gain's interval at
each load), :func:`capacity_interval` (``simcap capacity --model-form``: the safe rate under
the SLO read at each end of its interval, the saturation rate's), each at the distance past the
profile's ``provenance.fit_load`` (:func:`profile_fit_load`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from simcap.errors import SimcapError


class ModelFormError(SimcapError):
    """A model-form record or a profile's fitted load that cannot be used (one line)."""


LEVEL = 0.9
MIN_FIGURES = 8
FORMAT = "simcap model-form error 1"
POOLED = "all"


def family(metric: str) -> str | None:
    """The metric's family (None: not a latency or throughput figure, e.g. a hit rate)."""
    m = metric.lower()
    if "throughput" in m or m.endswith("_tps"):
        return "throughput"
    tail = any(m.endswith(s) for s in ("_p90", "_p95", "_p99", "_max"))
    for key, name in (("ttft", "ttft"), ("tpot", "token"), ("itl", "token"), ("e2e", "e2e")):
        if key in m:
            return f"{name} tail" if tail else name
    return None


def distance(load: float | None, fit_load: float | None) -> float:
    """Doublings of load past the fit part (0 inside it, or where a load is unknown)."""
    if not load or not fit_load or load <= fit_load:
        return 0.0
    return math.log2(load / fit_load)


@dataclass(frozen=True)
class Sample:
    """One held-out figure as the model-form fit sees it."""

    case: str
    family: str
    error: float  # log(predicted / measured)
    distance: float
    kind: str = ""  # the case's kind of data ("live", "table"), for reports

    def to_row(self) -> list[Any]:
        """As a record stores it: [case, kind, family, error, distance]."""
        return [self.case, self.kind, self.family, round(self.error, 5), round(self.distance, 4)]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> "Sample":
        case, kind, fam, error, dist = row
        return cls(str(case), str(fam), float(error), float(dist), str(kind))

    @classmethod
    def of(cls, figure: Mapping[str, Any], kind: str = "") -> "Sample | None":
        fam = family(str(figure["metric"]))
        err = figure.get("error")
        if fam is None or err is None or err <= -1.0:
            return None
        return cls(str(figure["case"]), fam, math.log1p(err),
                   distance(figure.get("load"), figure.get("fit_load")), kind)


def samples(figures: Iterable[Mapping[str, Any]], kinds: Mapping[str, str] | None = None) -> list[Sample]:
    """The figures that have a family and an error, as samples (``kinds``: case -> kind)."""
    out = []
    for f in figures:
        s = Sample.of(f, (kinds or {}).get(str(f["case"]), ""))
        if s is not None:
            out.append(s)
    return out


@dataclass(frozen=True)
class Term:
    """One family's fit: ``sigma(d) = sqrt(s0^2 + (a d)^2)``, interval half-width ``q sigma``."""

    s0: float
    a: float
    q: float
    figures: int

    def sigma(self, d: float) -> float:
        return math.sqrt(self.s0**2 + (self.a * d) ** 2)

    def half_width(self, d: float) -> float:
        """The interval's half-width in log space at distance ``d``."""
        return self.q * self.sigma(d)


@dataclass
class FormError:
    """The fitted model-form error: a :class:`Term` per family (and the pooled one)."""

    terms: dict[str, Term]
    level: float = LEVEL
    cases: list[str] = field(default_factory=list)

    def term(self, fam: str) -> Term:
        return self.terms.get(fam) or self.terms[POOLED]

    def half_width(self, metric: str, load: float | None = None, fit_load: float | None = None) -> float:
        """The log half-width of ``metric``'s interval at ``load`` past ``fit_load``."""
        fam = family(metric)
        if fam is None:
            raise ValueError(f"{metric}: no model-form family (latency or throughput figures only)")
        return self.term(fam).half_width(distance(load, fit_load))

    def interval(self, predicted: float, metric: str, load: float | None = None,
                 fit_load: float | None = None) -> tuple[float, float] | None:
        """Where the measurement of a prediction should fall, at this object's level (None:
        the metric has no family)."""
        if family(metric) is None:
            return None
        h = self.half_width(metric, load, fit_load)
        return predicted * math.exp(-h), predicted * math.exp(h)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "level": self.level, "cases": list(self.cases),
                "terms": {k: {"s0": round(t.s0, 5), "a": round(t.a, 5), "q": round(t.q, 4), "figures": t.figures}
                          for k, t in sorted(self.terms.items())}}

    @classmethod
    def read(cls, path: str | Path, leave_out: Iterable[str] = ()) -> "FormError":
        """A record ``simcap accuracy --write`` wrote (``calibration/model_form.json``);
        ``leave_out``: refit it on its samples without these cases (predictions of data those
        cases hold then get intervals learned elsewhere)."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a model-form error record (format {FORMAT!r})")
        except OSError as exc:
            raise ModelFormError(f"--model-form {path}: cannot read: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ModelFormError(f"--model-form {path}: {exc}") from None
        gone = set(leave_out)
        if not gone:
            return cls.from_dict(data)
        return fit([s for s in map(Sample.from_row, data.get("samples", [])) if s.case not in gone],
                   float(data.get("level", LEVEL)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FormError":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a model-form error record (format {FORMAT!r})")
        terms = {k: Term(float(v["s0"]), float(v["a"]), float(v["q"]), int(v["figures"]))
                 for k, v in data["terms"].items()}
        return cls(terms, float(data["level"]), list(data.get("cases", [])))


def _fit_term(errors: np.ndarray, dists: np.ndarray, level: float) -> Term:
    """Maximum likelihood of ``e ~ N(0, s0^2 + (a d)^2)``, then the conformal quantile."""
    from scipy.optimize import minimize

    e2 = errors**2
    d2 = dists**2

    def nll(theta: np.ndarray) -> float:
        var = math.exp(2 * theta[0]) + math.exp(2 * theta[1]) * d2
        return float(np.sum(np.log(var) + e2 / var))

    rms = math.sqrt(float(np.mean(e2))) or 1e-6
    starts = [np.array([math.log(rms), math.log(rms)]), np.array([math.log(rms), math.log(1e-4)])]
    best = min((minimize(nll, x0, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 4000})
                for x0 in starts), key=lambda r: r.fun)
    s0, a = (math.exp(v) for v in best.x)
    a = a if d2.any() else 0.0  # no distance in the data: no growth to speak of
    scores = np.sort(np.abs(errors) / np.sqrt(s0**2 + a**2 * d2))
    n = len(scores)
    k = min(n, math.ceil((n + 1) * level))
    return Term(s0, a, float(scores[k - 1]), n)


def fit(data: Sequence[Sample], level: float = LEVEL) -> FormError:
    """The model-form error of ``data`` (at least :data:`MIN_FIGURES` samples)."""
    if len(data) < MIN_FIGURES:
        raise ValueError(f"a model-form fit needs at least {MIN_FIGURES} figures (got {len(data)})")
    errors = np.array([s.error for s in data])
    dists = np.array([s.distance for s in data])
    terms = {POOLED: _fit_term(errors, dists, level)}
    for fam in sorted({s.family for s in data}):
        mask = np.array([s.family == fam for s in data])
        if mask.sum() >= MIN_FIGURES:
            terms[fam] = _fit_term(errors[mask], dists[mask], level)
    return FormError(terms, level, sorted({s.case for s in data}))


def coverage(data: Sequence[Sample], level: float = LEVEL) -> dict[str, Any]:
    """Leave one case out: every case's samples against intervals fitted on the other cases.

    Returns the share inside (overall, per kind of data, per family, per case), the median
    interval width (``exp(h) - exp(-h)``, relative to the prediction) and each sample's
    result (case, family, distance, error, half-width, inside)."""
    rows = []
    for case in sorted({s.case for s in data}):
        train = [s for s in data if s.case != case]
        model = fit(train, level)
        for s in data:
            if s.case == case:
                h = model.term(s.family).half_width(s.distance)
                rows.append({"case": s.case, "kind": s.kind, "family": s.family, "distance": s.distance,
                             "error": s.error, "half_width": h, "inside": abs(s.error) <= h})

    def share(sel: list[dict[str, Any]]) -> dict[str, Any]:
        widths = [math.exp(r["half_width"]) - math.exp(-r["half_width"]) for r in sel]
        return {"inside": sum(r["inside"] for r in sel), "figures": len(sel),
                "share": sum(r["inside"] for r in sel) / len(sel) if sel else None,
                # (6 decimals: the last digits of a leave-one-out fit are the machine's, not the data's)
                "median_width": round(float(np.median(widths)), 6) if widths else None}

    def by(key: str) -> dict[str, Any]:
        return {v: share([r for r in rows if r[key] == v]) for v in sorted({r[key] for r in rows})}

    return {"level": level, "all": share(rows), "kind": by("kind"), "family": by("family"),
            "case": by("case"), "beyond_fit": share([r for r in rows if r["distance"] > 0]),
            "rows": rows}


def crossover_band(model: FormError, result: Any, fit_load_spec: float | None,
                   fit_load_baseline: float | None) -> dict[str, Any]:
    """The model-form interval of a crossover study's throughput gain at each load, and the
    crossovers of its two ends (:class:`simcap.studies.crossover.CrossoverResult`).

    Each arm's throughput is off by its own model-form error, at its own distance past the
    rows its terms were fitted on (``fit_load_spec``, ``fit_load_baseline``: requests in
    flight); the two errors are taken as independent, so the gain's log half-width is
    ``sqrt(h_spec^2 + h_baseline^2)``. ``crossover_low`` is where the pessimistic end of the
    gain turns negative (speculation may stop paying from there), ``crossover_high`` where the
    optimistic end does; ``undecided`` lists the loads whose interval holds zero."""
    from simcap.studies.crossover import locate_crossover

    rows = []
    for p in result.points:
        s, b = p.spec, p.baseline
        hs = model.half_width("output_throughput", s.requests_per_s * (s.latency_mean_s or 0.0), fit_load_spec)
        hb = model.half_width("output_throughput", b.requests_per_s * (b.latency_mean_s or 0.0), fit_load_baseline)
        h = math.hypot(hs, hb)
        r = s.output_tokens_per_s / b.output_tokens_per_s
        rows.append({"load": p.load, "gain_pct": (r - 1) * 100, "low_pct": (r * math.exp(-h) - 1) * 100,
                     "high_pct": (r * math.exp(h) - 1) * 100, "half_width": h})
    loads = [r["load"] for r in rows]
    axis = result.axis
    return {"level": model.level, "points": rows,
            "crossover_low": locate_crossover(loads, [r["low_pct"] for r in rows], axis=axis),
            "crossover_high": locate_crossover(loads, [r["high_pct"] for r in rows], axis=axis),
            "undecided": [r["load"] for r in rows if r["low_pct"] <= 0 < r["high_pct"]]}


def capacity_slos(model: FormError, slo: Mapping[str, float], load: float | None,
                  fit_load: float | None) -> tuple[dict[str, float], dict[str, float]]:
    """The SLOs whose safe rates bound a capacity search's safe rate by the model-form error:
    a latency the model predicts as x is measured between ``x exp(-h)`` and ``x exp(h)``, so
    it holds an SLO limit L for sure only if ``x <= L exp(-h)`` and may hold it up to
    ``x <= L exp(h)``. Returns (strict, loose), each limit moved by its metric's half-width at
    ``load`` (requests running at the safe rate) past ``fit_load``."""
    strict, loose = {}, {}
    for metric, limit in slo.items():
        h = model.half_width(metric, load, fit_load)
        strict[metric], loose[metric] = limit * math.exp(-h), limit * math.exp(h)
    return strict, loose


def arm(scenario: Any) -> str:
    """Which of a profile's fitted loads a scenario's prediction is measured from: the rows
    with speculation when it speculates, else those without."""
    return "speculative" if scenario.speculative is not None else "plain"


def profile_fit_load(path: str | Path | None, which: str = "all") -> float:
    """The requests running at the rows a profile was fitted on (its ``provenance.fit_load``,
    written by ``simcap calibrate`` on benchmark rows): ``which`` is ``all``, ``speculative``
    or ``plain`` (rows without speculation), falling back to ``all``."""
    from simcap.config.profiles import load_profile

    if path is None:
        raise ModelFormError("--model-form: the scenario names no profile, so no fitted load to measure "
                             "the distance from")
    loads = load_profile(path)[0].provenance.get("fit_load") or {}
    value = loads.get(which) or loads.get("all")
    if not value:
        raise ModelFormError(f"--model-form: profile {path} records no fitted load (provenance.fit_load); "
                             "refit it with simcap calibrate on benchmark rows")
    return float(value)


def for_scenario(record: str | Path, scenario: Any) -> tuple[FormError, float]:
    """The model-form record at ``record`` and the fitted load a prediction of ``scenario`` is
    measured from (its profile's rows of the scenario's arm): what ``simcap simulate`` and
    ``simcap capacity --model-form`` read before they run."""
    return FormError.read(record), profile_fit_load(scenario.profile_file, arm(scenario))


def capacity_interval(model: FormError, scenario: Any, result: Any, fit_load: float,
                      **search: Any) -> dict[str, Any] | None:
    """The model-form interval of a capacity search's safe and saturation rates
    (:func:`simcap.studies.capacity.find_capacity`'s result on ``scenario``): the safe rate
    searched again under the strict and the loose SLO limits of :func:`capacity_slos`, at the
    requests running at the safe rate (one simulation there); the saturation rate times the
    throughput family's interval at the same distance. ``search``: ``find_capacity``'s options
    (duration, replicates, workers). None when the search found no safe or saturation rate."""
    from simcap.fleet.run import simulate
    from simcap.metrics.summary import requests_running
    from simcap.studies.capacity import at_rate, find_capacity

    if result.safe_rate is None or result.saturation_rate is None:
        return None
    duration = search.get("duration_s", result.duration_s)
    load = requests_running(simulate(at_rate(scenario, result.safe_rate, duration_s=duration,
                                             seed=scenario.seed)).summary)
    strict, loose = capacity_slos(model, result.slo, load, fit_load)
    ends = [find_capacity(scenario, limits, auto=True, probe_saturation=False, interval=False, **search).safe_rate
            for limits in (strict, loose)]
    h = model.half_width("output_throughput", load, fit_load)
    mu = result.saturation_rate
    return {"level": model.level, "fit_load": fit_load, "load_at_safe_rate": load, "slo_strict": strict,
            "slo_loose": loose, "safe_rate_interval": ends,
            "saturation_rate_interval": [mu * math.exp(-h), mu * math.exp(h)]}


SUMMARY_METRICS = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "itl_p50", "e2e_p50", "e2e_p95",
                   "output_throughput")


def summary_intervals(model: FormError, summary: Any, fit_load: float) -> dict[str, Any]:
    """A simulation's headline figures with their model-form interval, at the run's requests
    running past ``fit_load``: per metric of :data:`SUMMARY_METRICS` the prediction and its
    ends (None where the run has no such figure)."""
    from simcap.live.validate import metric_value
    from simcap.metrics.summary import requests_running

    load = requests_running(summary)
    out: dict[str, Any] = {"level": model.level, "fit_load": fit_load, "load": load,
                           "distance": distance(load, fit_load), "metrics": {}}
    for metric in SUMMARY_METRICS:
        value = metric_value(summary, metric)
        if value is not None:
            lo, hi = model.interval(value, metric, load, fit_load)  # type: ignore[misc]
            out["metrics"][metric] = {"predicted": value, "low": lo, "high": hi}
    return out
