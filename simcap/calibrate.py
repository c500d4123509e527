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
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import yaml
from scipy.optimize import least_squares, lsq_linear, nnls

from simcap._version import __version__
from simcap.engine.step_time import FEATURES
from simcap.errors import ScenarioError, SimcapError
from simcap.profile import load_profile
from simcap.scenario import Scenario, StepTimeConfig, parse_scenario
from simcap.simulator import Result, SimulationError, simulate

TERMS = FEATURES
# Typical magnitudes (s per unit), used to scale the optimiser's variables and as start values.
TYPICAL = {
    "base": 0.01,
    "per_prefill_token": 5e-5,
    "per_decode_token": 5e-4,
    "per_verify_token": 5e-4,
    "per_context_token": 1e-8,
    "mixed_step": 0.01,
    "draft_per_pass": 1e-3,
    "draft_per_request": 1e-4,
}


class CalibrationError(SimcapError):
    """Measurements that cannot be read or fitted; the message names the file and the problem."""


def _fmt(x: float) -> float:
    """A coefficient rounded to 6 significant digits (below 1e-12 s: 0), for readable YAML."""
    return 0.0 if abs(x) < 1e-12 else float(f"{x:.6g}")


# --------------------------------------------------------------------------- form


@dataclass(frozen=True)
class Form:
    """Which step-time terms a fit may move: ``free`` ones, and ``tied`` ones (term -> free term)."""

    free: tuple[str, ...]
    tied: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | Sequence[str]) -> "Form":
        """``"base,per_decode_token,per_verify_token=per_decode_token"`` -> Form."""
        items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
        items = [t for t in items if t]
        free: list[str] = []
        tied: dict[str, str] = {}
        for item in items:
            name, sep, other = (s.strip() for s in item.partition("="))
            for term in (name, other) if sep else (name,):
                if term not in TERMS:
                    raise CalibrationError(
                        f"--form: unknown term {term!r}; allowed: {', '.join(TERMS)}"
                    )
            if sep:
                tied[name] = other
            elif name not in free:
                free.append(name)
        for name, other in tied.items():
            if other not in free:
                raise CalibrationError(f"--form: {name}={other} ties to a term that is not free")
            if name in free:
                raise CalibrationError(f"--form: {name} is both free and tied")
        if not free:
            raise CalibrationError("--form: no free term; name at least one of " + ", ".join(TERMS))
        return cls(tuple(free), tied)

    def __str__(self) -> str:
        return ",".join([*self.free, *(f"{a}={b}" for a, b in self.tied.items())])

    def ties(self, fixed: dict[str, float]) -> dict[str, str]:
        """Tied terms, with StepTimeConfig's rule: no verify cost of its own is the decode one's."""
        if (fixed.get("per_verify_token") is None and "per_verify_token" not in self.free
                and "per_verify_token" not in self.tied):
            return {"per_verify_token": "per_decode_token", **self.tied}
        return dict(self.tied)

    def coefficients(self, x: Sequence[float], fixed: dict[str, float]) -> dict[str, float]:
        """Full coefficient dict: free values from ``x``, tied copies, the rest from ``fixed``."""
        out = {t: float(fixed.get(t) or 0.0) for t in TERMS}
        for name, value in zip(self.free, x):
            out[name] = float(value)
        for name, other in self.ties(fixed).items():
            out[name] = out[other]
        return out


# --------------------------------------------------------------------------- metrics

_STATS = ("mean", "p50", "p90", "p95", "p99")
_DISTS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
_THROUGHPUTS = {
    "output_throughput": "output_tokens_per_s",
    "request_throughput": "requests_per_s",
    "input_throughput": "input_tokens_per_s",
    "total_throughput": "total_tokens_per_s",
}
_ALIASES = {
    "throughput": "output_throughput",
    "output_throughput": "output_throughput",
    "qps": "request_throughput",
    "request_throughput": "request_throughput",
    "input_throughput": "input_throughput",
    "total_token_throughput": "total_throughput",
    "per_user_output_tps": "per_user_output_tps",
}


def metric_of_key(key: str) -> tuple[str, float] | None:
    """The simcap metric a measurement key stands for, and the factor to seconds; else None.

    Knows ``vllm bench`` keys (``mean_ttft_ms``, ``median_itl_ms``, ``p99_e2el_ms``,
    ``output_throughput``), table keys (``throughput``, ``qps``, ``latency_p95`` = E2E,
    ``itl_median_ms``) and ITL fractions (``itl_fraction_over_1500ms``,
    ``itl_fraction_100_to_1500ms``).
    """
    if key in _ALIASES:
        return _ALIASES[key], 1.0

    def stat(s: str) -> str | None:
        s = "p50" if s == "median" else s
        return s if s in _STATS else None

    m = re.fullmatch(r"latency_(mean|median|p\d+)", key)
    if m and stat(m[1]):
        return f"e2e_{stat(m[1])}", 1.0
    m = re.fullmatch(r"(mean|median|p\d+)_(ttft|tpot|itl|e2el)_ms", key) or re.fullmatch(
        r"(ttft|tpot|itl|e2el)_(mean|median|p\d+)_ms", key
    )
    if m:
        s, what = (m[1], m[2]) if m[2] in ("ttft", "tpot", "itl", "e2el") else (m[2], m[1])
        if stat(s):
            return f"{what.replace('e2el', 'e2e')}_{stat(s)}", 1e-3
    m = re.fullmatch(r"itl_fraction_over_(\d+)ms", key)
    if m:
        return f"itl_frac_gt_{int(m[1]) / 1000:g}", 1.0
    m = re.fullmatch(r"itl_fraction_(\d+)_to_(\d+)ms", key)
    if m:
        return f"itl_frac_{int(m[1]) / 1000:g}_{int(m[2]) / 1000:g}", 1.0
    return None


def _itl_samples(result: Result) -> np.ndarray:
    gaps = [np.diff(r.chunk_times) for r in result.records if r.succeeded and len(r.chunk_times) > 1]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def metric_value(
    name: str, result: Result, *, smooth: float = 0.0, steady_state: bool = False,
    _itl: list | None = None,
) -> float:
    """A named metric of a simulated run (seconds, tokens/s or a fraction).

    ``smooth > 0`` replaces the hard edges of ITL fractions by logistic ones of that width in
    log seconds, so the objective of a fit is continuous in the coefficients. ``steady_state``
    (a closed loop): throughputs are concurrency x tokens per request / mean E2E latency.
    """
    s = result.summary
    if name in _THROUGHPUTS:
        arrival = result.scenario.workload.arrival
        if steady_state and getattr(arrival, "concurrency", None) and s.completed and s.e2e_s.mean:
            per_req = {"output_throughput": s.output_tokens, "request_throughput": s.completed,
                       "input_throughput": s.input_tokens,
                       "total_throughput": s.output_tokens + s.input_tokens}[name] / s.completed
            return float(arrival.concurrency * per_req / s.e2e_s.mean)
        return float(s.throughput[_THROUGHPUTS[name]])
    if name == "per_user_output_tps":
        return 1.0 / s.tpot_s.mean if s.tpot_s.mean else 0.0
    m = re.fullmatch(r"itl_frac_(gt_)?([\d.]+)(?:_([\d.]+))?", name)
    if m:
        if _itl is not None and _itl:
            itl = _itl[0]
        else:
            itl = _itl_samples(result)
            if _itl is not None:
                _itl.append(itl)
        if itl.size == 0:
            return 0.0
        lo, hi = float(m[2]), (float(m[3]) if m[3] else math.inf)
        if smooth > 0:
            z = np.log(np.maximum(itl, 1e-9))
            above = _sigmoid((z - math.log(lo)) / smooth)
            below = _sigmoid((z - math.log(hi)) / smooth) if hi < math.inf else 0.0
            return float(np.mean(above - below))
        return float(np.mean((itl > lo) & (itl <= hi)))
    metric, _, stat = name.partition("_")
    if metric in _DISTS and stat in _STATS:
        value = getattr(getattr(s, _DISTS[metric]), stat)
        return float(value) if value is not None else math.nan
    raise CalibrationError(f"metric {name!r}: unknown")


def _is_fraction(metric: str) -> bool:
    return metric.startswith("itl_frac_")


# --------------------------------------------------------------------------- step samples

_COLUMNS = {
    "num_prefill_tokens": ("num_prefill_tokens", "prefill_tokens"),
    "num_decode_tokens": ("num_decode_tokens", "decode_tokens"),
    "num_verify_tokens": ("num_verify_tokens", "verify_tokens"),
    "num_context_tokens": ("num_context_tokens", "attended_tokens"),
    "num_prefill_reqs": ("num_prefill_reqs", "prefill_reqs"),
    "num_decode_reqs": ("num_decode_reqs", "decode_reqs"),
    "num_reqs": ("num_reqs", "reqs"),
    "mixed": ("mixed", "mixed_step"),
    "num_speculative_tokens": ("num_speculative_tokens", "k"),
    "start_s": ("start_s",),
}
_TARGETS = {"step_time_s": 1.0, "elapsed_s": 1.0, "forward_s": 1.0,
            "step_time_ms": 1e-3, "elapsed_ms": 1e-3, "forward_ms": 1e-3}
# Columns each term needs (any one of each tuple).
_NEEDS = {
    "base": (),
    "per_prefill_token": (("num_prefill_tokens",),),
    "per_decode_token": (("num_decode_tokens", "num_decode_reqs"),),
    "per_verify_token": (("num_verify_tokens",),),
    "per_context_token": (("num_context_tokens",),),
    "mixed_step": (("mixed", "num_prefill_tokens"), ("mixed", "num_decode_reqs", "num_decode_tokens")),
    "draft_per_pass": (("num_speculative_tokens",),),
    "draft_per_request": (("num_speculative_tokens",), ("num_reqs", "num_prefill_reqs")),
}

ITERATION_RE = re.compile(
    r"Iteration\((\d+)\):\s*(\d+) context requests,\s*(\d+) context tokens,\s*(\d+) generation "
    r"requests,\s*(\d+) generation tokens,\s*iteration elapsed time:\s*([0-9.]+)\s*ms"
)


def parse_iteration_log(lines: Iterable[str], num_speculative_tokens: int = 0) -> list[dict[str, float]]:
    """Step samples from vLLM's ``--enable-logging-iteration-details`` lines; other lines skipped.

    ``a context requests, b context tokens`` are prefill (vLLM calls prompt tokens "context");
    ``c generation requests, d generation tokens`` decode. With ``k`` drafts per request the
    generation tokens include the drafts: decode tokens ``c``, verified drafts ``d - c``.
    """
    rows = []
    for line in lines:
        m = ITERATION_RE.search(line)
        if not m:
            continue
        _, a, b, c, d, ms = m.groups()
        a, b, c, d = int(a), int(b), int(c), int(d)
        k = num_speculative_tokens
        rows.append({
            "num_prefill_reqs": a, "num_prefill_tokens": b, "num_decode_reqs": c,
            "num_decode_tokens": c if k else d, "num_verify_tokens": d - c if k else 0,
            "num_reqs": a + c, "num_speculative_tokens": k, "step_time_s": float(ms) * 1e-3,
        })
    return rows


@dataclass
class StepSamples:
    """Step rows as a feature matrix (columns in ``FEATURES`` order) and measured seconds."""

    X: np.ndarray
    y: np.ndarray
    available: set[str]
    source: dict[str, Any]
    start_s: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.y)


def _rows_to_samples(rows: list[dict[str, Any]], where: str, source: dict[str, Any]) -> StepSamples:
    if not rows:
        raise CalibrationError(f"{where}: no step samples")
    keys = set(rows[0])
    target = next((t for t in _TARGETS if t in keys), None)
    if target is None:
        raise CalibrationError(
            f"{where}: missing column step_time_s (or step_time_ms, elapsed_s, elapsed_ms) with "
            "the measured seconds of each step"
        )
    present = {canon: next(a for a in aliases if a in keys)
               for canon, aliases in _COLUMNS.items() if any(a in keys for a in aliases)}
    cols: dict[str, np.ndarray] = {}
    try:
        for canon, key in [*present.items(), ("_y", target)]:
            cols[canon] = np.array([float(r[key]) for r in rows], dtype=float)
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(
            f"{where}: column {key!r} has an empty or non-numeric value"
        ) from None
    for name, values in cols.items():
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise CalibrationError(f"{where}: column {name if name != '_y' else target!r} "
                                   "has a negative or non-finite value")
    n = len(rows)
    zero = np.zeros(n)
    y = cols.pop("_y") * _TARGETS[target]
    prefill = cols.get("num_prefill_tokens", zero)
    decode = cols.get("num_decode_tokens", cols.get("num_decode_reqs", zero))
    decode_reqs = cols.get("num_decode_reqs", decode)
    mixed = cols.get("mixed", ((prefill > 0) & (decode_reqs > 0)).astype(float))
    k = cols.get("num_speculative_tokens", zero)
    reqs = cols.get("num_reqs", cols.get("num_prefill_reqs", zero) + decode_reqs)
    feats = {
        "base": np.ones(n), "per_prefill_token": prefill, "per_decode_token": decode,
        "per_verify_token": cols.get("num_verify_tokens", zero),
        "per_context_token": cols.get("num_context_tokens", zero), "mixed_step": mixed,
        "draft_per_pass": k, "draft_per_request": k * reqs,
    }
    available = {t for t, needs in _NEEDS.items() if all(any(c in cols for c in alt) for alt in needs)}
    X = np.column_stack([feats[t] for t in TERMS])
    return StepSamples(X, y, available, {**source, "rows": n}, cols.get("start_s"))


def read_step_samples(path: str | Path, num_speculative_tokens: int = 0) -> StepSamples:
    """Read step samples from CSV, JSON (a list of rows, or ``{"samples": [...]}``) or a log."""
    path = Path(path)
    text = _read_text(path)
    source = {"file": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        rows = [{k.strip(): v for k, v in row.items() if k} for row in reader]
        return _rows_to_samples(rows, str(path), {**source, "format": "csv"})
    if path.suffix.lower() == ".json":
        data = _parse_json(path, text)
        rows = data.get("samples", data.get("steps")) if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise CalibrationError(f"{path}: expected a list of step rows or {{\"samples\": [...]}}")
        return _rows_to_samples(rows, str(path), {**source, "format": "json"})
    rows = parse_iteration_log(text.splitlines(), num_speculative_tokens)
    if not rows:
        raise CalibrationError(
            f"{path}: no 'Iteration(i): a context requests, b context tokens, ...' lines "
            "(vLLM --enable-logging-iteration-details)"
        )
    return _rows_to_samples(rows, str(path), {**source, "format": "vllm iteration log"})


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not a text file") from None


def _parse_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: malformed JSON at line {exc.lineno}: {exc.msg}") from None


# --------------------------------------------------------------------------- benchmarks


@dataclass
class BenchmarkPoint:
    """One measured benchmark run: the scenario that reproduces it and what was measured."""

    label: str
    scenario: dict[str, Any]  # engine, speculative, workload, seed (step_time filled by the fit)
    measured: dict[str, float]  # metric -> value (seconds, tokens/s, fractions)
    source: dict[str, Any]
    # A closed loop held at its concurrency (a hold time, not a request count): throughputs are
    # the steady state's, concurrency / mean latency (Little's law), free of ramp-up and drain.
    steady_state: bool = False


def _select(data: Any, selector: str, where: str) -> tuple[Any, list[Any]]:
    """Walk a dotted path (``a.runs.0``); returns the node and its ancestors (outermost first)."""
    node, parents = data, []
    for part in [p for p in selector.split(".") if p]:
        parents.append(node)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise CalibrationError(f"{where}: no key {part!r} at {selector!r}")
    return node, parents


def _is_bench_result(d: Any) -> bool:
    return isinstance(d, dict) and ("max_concurrency" in d or "request_rate" in d) and (
        "output_throughput" in d or "completed" in d
    )


def _length(values: Any, mean: float | None, what: str, where: str) -> Any:
    if isinstance(values, list) and values and all(isinstance(v, (int, float)) and v > 0 for v in values):
        return {"dist": "empirical", "values": [int(v) for v in values]}
    if mean is None or not mean > 0:
        raise CalibrationError(f"{where}: no {what} length")
    return max(1, int(round(mean)))


def read_benchmarks(
    path: str | Path,
    selector: str | None = None,
    *,
    engine: dict[str, Any],
    speculative: dict[str, Any] | None,
    workload: dict[str, Any] | None = None,
    seed: int = 0,
    label: str | None = None,
) -> list[BenchmarkPoint]:
    """Benchmark points from a ``vllm bench serve`` result JSON or a closed-loop table.

    A table is a list of rows (or one row) with ``concurrency`` and measured aggregates
    (:func:`metric_of_key`); ``selector`` picks it inside a larger JSON (``a800_minimax_m3.runs.
    no_spec``). Prompt/output lengths and request counts come from the row (``input_len``,
    ``actual_prompt_len``, ``output_len``, ``num_prompts``), the enclosing ``load`` section
    (``max_tokens``, ``hold_seconds``: requests = hold x measured QPS) or ``workload``
    (which overrides both; e.g. an assumed ``input_len``).
    """
    path = Path(path)
    text = _read_text(path)
    where = f"{path}#{selector}" if selector else str(path)
    data = _parse_json(path, text)
    node, parents = _select(data, selector or "", where)
    workload = dict(workload or {})
    source = {"file": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(),
              "select": selector}
    base = {"engine": engine, "speculative": speculative, "seed": seed}
    if _is_bench_result(node):
        return [_bench_point(node, where, base, workload, source, label or path.stem)]
    rows = node if isinstance(node, list) else [node]
    if not rows or not all(isinstance(r, dict) and "concurrency" in r for r in rows):
        raise CalibrationError(
            f"{where}: not a recognised benchmark (a vllm bench result JSON, or rows with "
            "'concurrency'); pick a table inside a larger file with FILE#key.path"
        )
    load: dict[str, Any] = {}
    for p in parents:
        if isinstance(p, dict) and isinstance(p.get("load"), dict):
            load = p["load"]
    points = []
    for i, row in enumerate(rows):
        rw = f"{where} row {i}"
        measured = {}
        for key, value in row.items():
            hit = metric_of_key(key)
            if hit and isinstance(value, (int, float)) and not isinstance(value, bool):
                measured[hit[0]] = float(value) * hit[1]
        if not measured:
            raise CalibrationError(f"{rw}: no measured aggregate (throughput, latency_*, *_ms, ...)")
        c = row["concurrency"]
        if not isinstance(c, int) or c <= 0:
            raise CalibrationError(f"{rw}: concurrency must be a positive integer (got {c!r})")
        in_len = workload.get("input_len", row.get("actual_prompt_len", row.get("input_len")))
        out_len = workload.get("output_len", row.get("output_len", load.get("max_tokens")))
        if in_len is None:
            raise CalibrationError(
                f"{rw}: the prompt length is not in the data; give --input-len (an assumption)"
            )
        if out_len is None:
            raise CalibrationError(f"{rw}: the output length is not in the data; give --output-len")
        n = workload.get("num_requests", row.get("num_prompts"))
        if n is None:
            hold = load.get("hold_seconds", workload.get("hold_s"))
            hold = float(np.mean(hold)) if isinstance(hold, list) else hold
            qps = measured.get("request_throughput")
            n = round(hold * qps) if hold and qps else 60
            n = int(min(max(n, 4 * c, 20), 120))
            n = c * math.ceil(n / c)  # whole rounds of the closed loop
        scen = {**base, "workload": {
            "arrival": {"process": "closed", "concurrency": c}, "num_requests": int(n),
            "input_len": in_len, "output_len": out_len,
            **{k: v for k, v in workload.items() if k in ("prefix",)},
        }}
        if row.get("failures"):
            measured_note = f" ({row['failures']} failures measured)"
        else:
            measured_note = ""
        name = row.get("scenario") or f"c={c}"
        name = (label or name) if len(rows) == 1 else f"{label + ' ' if label else ''}{name}"
        steady = workload.get("num_requests", row.get("num_prompts")) is None
        points.append(BenchmarkPoint(
            f"{name}{measured_note}", scen, measured,
            {**source, "row": i}, steady_state=steady,
        ))
    return points


def _bench_point(d, where, base, workload, source, label) -> BenchmarkPoint:
    completed = d.get("completed") or d.get("num_prompts")
    if not completed:
        raise CalibrationError(f"{where}: vllm bench result without 'completed' requests")
    rate = d.get("request_rate", "inf")
    rate = math.inf if rate in ("inf", None) else float(rate)
    conc = d.get("max_concurrency")
    if rate < math.inf and conc:
        raise CalibrationError(
            f"{where}: a finite request_rate with max_concurrency is not modelled; "
            "use a run with one of the two"
        )
    if rate < math.inf:
        arrival = {"process": "gamma", "rate": rate, "burstiness": float(d.get("burstiness") or 1.0)}
    else:
        arrival = {"process": "closed", "concurrency": int(conc or completed)}
    in_len = workload.get("input_len") or _length(
        d.get("input_lens"), (d.get("total_input_tokens") or 0) / completed, "input", where)
    out_len = workload.get("output_len") or _length(
        d.get("output_lens"), (d.get("total_output_tokens") or 0) / completed, "output", where)
    measured = {}
    for key, value in d.items():
        hit = metric_of_key(key)
        if hit and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            measured[hit[0]] = float(value) * hit[1]
    scen = {**base, "workload": {"arrival": arrival, "num_requests": int(completed),
                                 "input_len": in_len, "output_len": out_len}}
    name = f"c={conc}" if conc else (f"rate={rate:g}" if rate < math.inf else "all at once")
    return BenchmarkPoint(f"{label} {name}", scen, measured, {**source, "row": None})


# --------------------------------------------------------------------------- fit result


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

    def fitted_terms(self) -> list[str]:
        return [*self.form.free, *(t for t in self.form.tied if t not in self.form.free)]

    def to_dict(self) -> dict[str, Any]:
        return {
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
        }


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


# --------------------------------------------------------------------------- direct fit


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
) -> Fit:
    """Non-negative least squares of the free terms on measured step seconds.

    Terms that are not free contribute ``fixed`` values (default 0) and are subtracted first.
    ``host_overhead`` (s per step, not in an iteration log's elapsed time) is written to the
    profile as given; without it, when samples carry ``start_s``, it is the median gap between
    one step's end and the next's start. Intervals: pairs bootstrap over rows.
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
    if host_overhead is None:
        host = 0.0
        starts = [s for s in samples if s.start_s is not None]
        if starts:
            gaps = np.concatenate([np.diff(s.start_s) - s.y[:-1] for s in starts])
            host = float(max(np.median(gaps), 0.0))
            notes.append(f"host_overhead {host:.4g} s: median gap between a step's end and the next "
                         "step's start (start_s column)")
        else:
            notes.append("host_overhead 0: the samples time the forward pass only and no "
                         "--host-overhead was given; the engine's real step period is longer")
    else:
        host = float(host_overhead)
        notes.append(f"host_overhead {host:.4g} s per step: given (--host-overhead), not fitted")
    coeffs_all = {**coeffs, "host_overhead": host}
    rel = (fitted - y) / np.where(y > 0, y, np.nan)
    residuals = [
        {"point": f"row {i}", "metric": "step_time_s", "measured": _fmt(y[i]), "fitted": _fmt(fitted[i]),
         "rel_error": None if math.isnan(rel[i]) else round(float(rel[i]), 4), "fitted_in_objective": True}
        for i in range(len(y))
    ]
    warnings: list[str] = []
    # Single steps are noisy: judge the fit by the spread of errors, warn on the worst rows.
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
    if ok.any() and quality["p95_abs_rel_error"] > warn_above:
        worst = int(np.nanargmax(np.abs(rel)))
        warnings.append(
            f"WARNING: max relative error {abs(rel[worst]):.0%} at row {worst} of {where} (fitted "
            f"{fitted[worst]:.4g} s vs measured {y[worst]:.4g} s); 5% of the step samples are off "
            f"by more than {quality['p95_abs_rel_error']:.0%}: the form may be missing a term"
        )
    return Fit(
        kind="step_samples",
        method="nnls (scipy.optimize.nnls) on measured step seconds",
        form=form, coefficients=coeffs_all, fixed=fixed,
        ci=_percentile_ci(sets, terms, level), bootstrap=sets,
        bootstrap_method=f"pairs bootstrap over step rows ({bootstrap} resamples, seed {seed})",
        level=level, residuals=residuals, sources=[s.source for s in samples],
        warnings=warnings, notes=notes, quality=quality,
    )


# --------------------------------------------------------------------------- simulation-based fit


class _Objective:
    """Simulates every point at given coefficients (cached) and forms log-ratio residuals."""

    def __init__(self, points, form, fixed, metrics, smooth):
        self.points, self.form, self.fixed = points, form, fixed
        self.metrics = metrics  # per point: list of (metric, weight)
        self.smooth = smooth
        self.scale = np.array([fixed.get(t) or TYPICAL[t] for t in form.free], dtype=float)
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

    def simulate(self, x: np.ndarray) -> list[dict[str, float]]:
        key = tuple(np.round(x, 12))
        if key in self.cache:
            return self.cache[key]
        coeffs = self.coefficients(x)
        step_time = StepTimeConfig(**coeffs, host_overhead=self.fixed.get("host_overhead") or 0.0)
        out = []
        for pt, sc, mets in zip(self.points, self.scenarios, self.metrics):
            try:
                res = simulate(sc.model_copy(update={"step_time": step_time}))
            except SimulationError as exc:
                raise CalibrationError(f"{pt.label}: simulation failed at {coeffs}: {exc}") from None
            itl: list = []
            values = {}
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
    if not points:
        raise CalibrationError("calibrate: no benchmark points")
    fixed = dict(fixed or {})
    form = form or default_benchmark_form(points)
    weights = dict(weights or {})
    metrics = []
    for pt in points:
        names = [m for m in pt.measured if fit_metrics is None or m in fit_metrics]
        if fit_metrics is None and "output_throughput" in names and "request_throughput" in names:
            names.remove("request_throughput")
        metrics.append([(m, weights.get(m, 1.0)) for m in names if weights.get(m, 1.0) > 0])
    n = sum(len(m) for m in metrics)
    p = len(form.free)
    if n < p:
        raise CalibrationError(
            f"calibrate: {n} fitted measurements are too few for {p} free terms ({', '.join(form.free)})"
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
    notes = [f"least_squares: {res.nfev} evaluations ({obj.evaluations} distinct), {res.message}"]
    x_hat = res.x
    J = res.jac
    coeffs = obj.coefficients(x_hat)
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
    sims = obj.simulate(x_hat)
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


# --------------------------------------------------------------------------- recipes and profiles


@dataclass
class Recipe:
    """What to fit and how: deployment sections, form, assumptions and datasets (YAML)."""

    name: str
    path: Path | None = None
    hardware: str | None = None
    model: str | None = None
    description: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    speculative: dict[str, Any] | None = None
    step_time: dict[str, Any] = field(default_factory=dict)
    form: str | None = None
    fit_metrics: list[str] | None = None
    weights: dict[str, float] = field(default_factory=dict)
    bootstrap: int | None = None
    bootstrap_iterations: int | None = None
    seed: int = 0
    warn_above: float = 0.1
    assumptions: list[str] = field(default_factory=list)
    datasets: list[dict[str, Any]] = field(default_factory=list)

    KEYS = ("name", "hardware", "model", "description", "engine", "speculative", "step_time", "form",
            "fit_metrics", "weights", "bootstrap", "bootstrap_iterations", "seed", "warn_above",
            "assumptions", "datasets")

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        path = Path(path)
        try:
            data = yaml.safe_load(_read_text(path))
        except yaml.YAMLError as exc:
            raise CalibrationError(f"{path}: malformed YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict) or "name" not in data:
            raise CalibrationError(f"{path}: a recipe is a mapping with name, engine, datasets, ...")
        extra = set(data) - set(cls.KEYS)
        if extra:
            raise CalibrationError(
                f"{path}: unknown key {sorted(extra)[0]!r}; allowed: {', '.join(cls.KEYS)}"
            )
        if isinstance(data.get("form"), list):
            data["form"] = ",".join(data["form"])
        return cls(path=path, **data)


def base_from_profile(path: str | Path) -> Recipe:
    """A recipe without datasets from a profile file (``--base``): deployment and start values."""
    profile, _ = load_profile(path)
    return Recipe(name=profile.name, path=Path(path), hardware=profile.hardware, model=profile.model,
                  description=profile.description, engine=dict(profile.engine),
                  speculative=dict(profile.speculative) if profile.speculative else None,
                  step_time=dict(profile.step_time))


def profile_dict(fit: Fit, recipe: Recipe, *, command: str | None = None) -> dict[str, Any]:
    """The profile (YAML-ready dict) of a fit: deployment, coefficients, CI, bootstrap, provenance."""
    step_time = {}
    for key in StepTimeConfig.model_fields:
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
    out["step_time"] = step_time
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
                 "fixed": {t: _fmt(fit.coefficients[t]) for t in TERMS
                           if t not in fit.fitted_terms() and fit.coefficients.get(t) is not None}},
        "ci": {"level": fit.level, "method": fit.bootstrap_method},
        "assumptions": list(recipe.assumptions),
        "notes": fit.notes,
        "warnings": fit.warnings,
        "fit_quality": fit.quality,
        "residuals": fit.residuals if len(fit.residuals) <= 500 else fit.residuals[:500],
    }
    return out


def write_profile(data: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    text = yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=False, width=100, allow_unicode=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot write profile: {exc.strerror}") from None


def parse_fix(items: Sequence[str]) -> dict[str, float]:
    """``["mixed_step=0.03", ...]`` (``--fix``) -> {term: seconds}."""
    fixed = {}
    for item in items:
        term, sep, value = (t.strip() for t in item.partition("="))
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or term not in TERMS or not number >= 0:
            raise CalibrationError(
                f"--fix {item!r}: expected TERM=SECONDS (>= 0) with TERM in {', '.join(TERMS)}"
            )
        fixed[term] = number
    return fixed


def recipe_for(
    inputs: Sequence[str], base: str | Path | None = None, *, name: str | None = None,
    default_name: str = "profile",
) -> tuple[Recipe, list[str]]:
    """The recipe of a ``simcap calibrate`` call and the measurement files left to read.

    One ``.yaml`` input is a recipe (its datasets are the data); ``base`` is a profile or a
    recipe whose deployment and start values are used for the given files.
    """
    inputs = list(inputs)
    recipe = None
    if len(inputs) == 1 and split_input(inputs[0])[0].endswith((".yaml", ".yml")):
        recipe, inputs = Recipe.load(inputs[0]), []
    if base is not None:
        if recipe is not None:
            raise CalibrationError("--base: the recipe already names its deployment")
        try:
            data = yaml.safe_load(_read_text(Path(base)))
        except yaml.YAMLError as exc:
            raise CalibrationError(f"{base}: malformed YAML: {str(exc).splitlines()[0]}") from None
        is_recipe = isinstance(data, dict) and "datasets" in data
        recipe = Recipe.load(base) if is_recipe else base_from_profile(base)
        recipe.datasets = []
    recipe = recipe or Recipe(name=default_name)
    if name:
        recipe.name = name
    return recipe, inputs


def split_input(text: str) -> tuple[str, str | None]:
    """``FILE#key.path`` -> (FILE, key.path)."""
    file, sep, selector = text.partition("#")
    return file, (selector or None) if sep else None


def _is_step_input(path: Path) -> bool:
    if path.suffix.lower() == ".csv":
        return True
    if path.suffix.lower() != ".json":
        return True  # a log
    data = _parse_json(path, _read_text(path))
    if isinstance(data, dict):
        return "samples" in data or "steps" in data
    return bool(data) and isinstance(data[0], dict) and any(t in data[0] for t in _TARGETS)


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
) -> Fit:
    """Read the inputs (or the recipe's datasets), pick the fit for their kind, and run it."""
    fixed = {k: v for k, v in recipe.step_time.items() if v is not None}
    fixed.update(fix or {})
    if host_overhead is not None:
        fixed["host_overhead"] = host_overhead
    form_obj = Form.parse(form or recipe.form) if (form or recipe.form) else None
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
                                seed=recipe.seed, warn_above=warn)
    return fit_benchmarks(points, form_obj, fixed=fixed, fit_metrics=recipe.fit_metrics,
                          weights=recipe.weights,
                          bootstrap=(recipe.bootstrap or 40) if bootstrap is None else bootstrap,
                          iterations=(recipe.bootstrap_iterations if recipe.bootstrap_iterations
                                      is not None else 2) if iterations is None else iterations,
                          level=level, seed=recipe.seed, warn_above=warn)


# --------------------------------------------------------------------------- report


def render_fit(fit: Fit, console: Any) -> None:
    """Rich tables: coefficients with intervals, then fitted vs measured, then warnings."""
    from rich.table import Table

    pct = f"{fit.level:.0%}"
    table = Table(title=f"step-time coefficients ({fit.kind}; {pct} intervals)", title_justify="left")
    for col, justify in (("term", "left"), ("value", "right"), (f"{pct} low", "right"),
                         (f"{pct} high", "right"), ("", "left")):
        table.add_column(col, justify=justify)
    ties = fit.form.ties(fit.fixed)
    for key, value in fit.coefficients.items():
        if value is None:
            continue
        lo, hi = fit.ci.get(key, (None, None))
        status = ("free" if key in fit.form.free else f"= {ties[key]}" if key in ties
                  else "given" if key == "host_overhead" else "fixed")
        cells = [f"{value:.4g}", "-" if lo is None else f"{lo:.4g}", "-" if hi is None else f"{hi:.4g}"]
        table.add_row(key, *cells, status)
    console.print(table)
    rows = fit.residuals
    if fit.kind == "step_samples" and len(rows) > 30:
        q = fit.quality
        console.print(f"{q['n']} step samples: RMSE {q['rmse_s']:.4g} s, R^2 {q['r2']}, median |error| "
                      f"{q['median_abs_rel_error']:.1%}, p95 |error| {q['p95_abs_rel_error']:.1%}")
    else:
        res = Table(title="fitted vs measured", title_justify="left")
        for col, justify in (("point", "left"), ("metric", "left"), ("measured", "right"),
                             ("fitted", "right"), ("error", "right"), ("", "left")):
            res.add_column(col, justify=justify)
        for r in rows:
            err = "-" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
            bad = r["rel_error"] is not None and abs(r["rel_error"]) > fit.quality.get("warn_above", 0.1)
            res.add_row(r["point"], r["metric"], f"{r['measured']:.4g}", f"{r['fitted']:.4g}",
                        f"[bold red]{err}[/]" if bad else err,
                        "" if r["fitted_in_objective"] else "reported only")
        console.print(res)
    for note in fit.notes:
        console.print(f"note: {note}", highlight=False)


def render_intervals(data: dict[str, Any], intervals: dict[str, tuple[float, float]], console: Any) -> None:
    """One table: each metric's central value and its interval over the bootstrap re-runs."""
    from rich.table import Table

    table = Table(title="90% intervals (profile bootstrap sets)", title_justify="left")
    for col, justify in (("metric", "left"), ("value", "right"), ("low", "right"), ("high", "right")):
        table.add_column(col, justify=justify)
    for name, (lo, hi) in intervals.items():
        metric, _, stat = name.partition("_")
        if name in _THROUGHPUTS:
            value, unit = data["throughput"][_THROUGHPUTS[name]], ""
        else:
            value, unit = (data.get(_DISTS[metric]) or {}).get(stat), "ms"
        scale = 1e3 if unit else 1.0
        cells = ["-" if v is None else f"{v * scale:,.1f}" for v in (value, lo, hi)]
        table.add_row(f"{name}{' (ms)' if unit else ''}", *cells)
    console.print(table)


def residual_plot(fit: Fit, path: str | Path) -> None:
    """Fitted vs measured (log-log, with the identity line) and relative errors, as a PNG/SVG/PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in fit.residuals if r["rel_error"] is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    if fit.kind == "step_samples":
        meas = np.array([r["measured"] for r in rows])
        fitted = np.array([r["fitted"] for r in rows])
        ax1.scatter(meas, fitted, s=6, alpha=0.5)
        lo, hi = max(min(meas.min(), fitted.min()), 1e-6), max(meas.max(), fitted.max())
        ax1.plot([lo, hi], [lo, hi], "k--", lw=1)
        ax1.set(xlabel="measured step time (s)", ylabel="fitted step time (s)", xscale="log", yscale="log")
        ax2.scatter(meas, 100 * np.array([r["rel_error"] for r in rows]), s=6, alpha=0.5)
        ax2.set(xlabel="measured step time (s)", ylabel="relative error (%)", xscale="log")
    else:
        metrics = sorted({r["metric"] for r in rows})
        for m in metrics:
            sub = [r for r in rows if r["metric"] == m]
            ax1.scatter([r["measured"] for r in sub], [r["fitted"] for r in sub], label=m,
                        marker="o" if sub[0]["fitted_in_objective"] else "x")
        allv = [v for r in rows for v in (r["measured"], r["fitted"]) if v > 0]
        if allv:
            ax1.plot([min(allv), max(allv)], [min(allv), max(allv)], "k--", lw=1)
        ax1.set(xlabel="measured", ylabel="simulated with fitted coefficients", xscale="log", yscale="log")
        ax1.legend(fontsize=7)
        labels = [f"{r['point']} {r['metric']}" for r in rows]
        errs = [100 * r["rel_error"] for r in rows]
        limit = 100 * fit.quality.get("warn_above", 0.1)
        colors = ["tab:red" if abs(e) > limit else "tab:blue" for e in errs]
        ax2.barh(range(len(rows)), errs, color=colors)
        ax2.set_yticks(range(len(rows)), labels, fontsize=6)
        ax2.axvline(0, color="k", lw=0.8)
        ax2.set(xlabel="relative error (%)")
        ax2.invert_yaxis()
    ax1.set_title("fitted vs measured")
    ax2.set_title(f"max |error| {fit.quality.get('max_rel_error', 0):.1%}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: cannot write the residual plot: {exc}") from None
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- uncertainty

CI_METRICS = (
    "output_throughput", "request_throughput",
    *(f"{m}_{s}" for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p95", "p99")),
)


def simulate_with_ci(
    scenario: Scenario,
    profile_path: str | Path | None = None,
    level: float = 0.9,
    max_sets: int | None = None,
) -> tuple[Result, dict[str, tuple[float, float]]]:
    """Simulate ``scenario``, then again with each bootstrap coefficient set of its profile.

    Returns the central result and ``{metric: (low, high)}``: percentile intervals at ``level``
    over the re-runs, for the metrics of :data:`CI_METRICS`. A coefficient the scenario sets
    itself (differs from the profile's) is not varied. The re-runs keep the scenario's seed, so
    the intervals show the coefficients' uncertainty only, not the workload's sampling noise.
    """
    path = profile_path or scenario.profile_file
    if path is None:
        raise ScenarioError("profile: intervals need a profile with bootstrap coefficient sets; "
                            "the scenario names none (profile: PATH)")
    profile, _ = load_profile(path)
    if not profile.bootstrap:
        raise ScenarioError(f"profile: {path} has no bootstrap coefficient sets; refit it with "
                            "simcap calibrate")
    result = simulate(scenario)
    own = scenario.step_time.model_dump()
    sets = profile.bootstrap[:max_sets] if max_sets else profile.bootstrap
    values: dict[str, list[float]] = {m: [] for m in CI_METRICS}
    for coeffs in sets:
        st = dict(own)
        for key, value in coeffs.items():
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
