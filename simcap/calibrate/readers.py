"""Reading measurements: step samples (CSV, JSON, vLLM iteration logs) and benchmark results
(``vllm bench serve`` JSON, GuideLLM reports, tables in JSON or CSV), with the file errors they
raise."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from simcap.calibrate.core import TERMS, CalibrationError, is_whole
from simcap.calibrate.metric_keys import metric_of_key


_COLUMNS = {
    "num_prefill_tokens": ("num_prefill_tokens", "prefill_tokens"),
    "num_decode_tokens": ("num_decode_tokens", "decode_tokens"),
    "num_verify_tokens": ("num_verify_tokens", "verify_tokens"),
    "num_context_tokens": ("num_context_tokens", "attended_tokens"),
    "num_prefill_pairs": ("num_prefill_pairs", "prefill_pairs"),
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
    # Per-step counts by column name (num_reqs, num_prefill_reqs, num_decode_reqs, ...; the
    # columns the data has, and num_reqs, num_decode_reqs, mixed derived): the roofline fit's
    # inputs (simcap.calibrate.fit_roofline).
    counts: dict[str, np.ndarray] | None = None

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
    counts = {**cols, "num_prefill_tokens": prefill, "num_decode_tokens": decode,
              "num_verify_tokens": cols.get("num_verify_tokens", zero),
              "num_decode_reqs": decode_reqs, "num_reqs": reqs, "mixed": mixed}
    return StepSamples(X, y, available, {**source, "rows": n}, cols.get("start_s"), counts)


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
    return log_step_samples(text.splitlines(), num_speculative_tokens, str(path), source)


def log_step_samples(lines: Iterable[str], num_speculative_tokens: int = 0, where: str = "iteration log",
                     source: dict[str, Any] | None = None) -> StepSamples:
    """Step samples of vLLM's per-step log lines (:func:`parse_iteration_log`); ``where``
    names them in errors, ``source`` describes them (default: ``where`` and the lines' SHA-256)."""
    lines = list(lines)
    if source is None:
        source = {"file": where, "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}
    rows = parse_iteration_log(lines, num_speculative_tokens)
    if not rows:
        raise CalibrationError(
            f"{where}: no 'Iteration(i): a context requests, b context tokens, ...' lines "
            "(vLLM --enable-logging-iteration-details)"
        )
    return _rows_to_samples(rows, where, {**source, "format": "vllm iteration log"})


def _read_text(path: Path) -> str:
    """The file's text; a leading byte-order mark (spreadsheet CSVs often have one) dropped."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not a text file") from None


def _parse_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: malformed JSON at line {exc.lineno}: {exc.msg}") from None


# The most requests per client a closed-loop row may declare (``workload.requests_per_client``).
MAX_REQUESTS_PER_CLIENT = 1_000


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


# The row keys of a closed-loop table that describe the run rather than measure it.
TABLE_SHAPE_KEYS = frozenset({"concurrency", "request_rate", "input_len", "actual_prompt_len", "output_len",
                              "num_prompts", "failures", "scenario"})


def ignored_keys(points: Iterable["BenchmarkPoint"]) -> list[str]:
    """The table keys :func:`read_benchmarks` read as no metric, over ``points``, sorted."""
    return sorted({k for p in points for k in p.source.get("ignored_keys", ())})


# What a table column may be declared as (``--column NAME=KEY``), beside every metric key
# :func:`metric_of_key` knows: the row's shape, and per-GPU throughputs.
SHAPE_KEYS = ("concurrency", "request_rate", "input_len", "output_len", "num_prompts")
_SHAPE_ALIASES = {"isl": "input_len", "osl": "output_len", "rate": "request_rate", "qps_offered": "request_rate",
                  "max_concurrency": "concurrency"}
_WHERE = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(<=|>=|==|!=|<|>)\s*(.+?)\s*$")
_OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


@dataclass(frozen=True)
class TableReading:
    """How to read a table's columns (``--column``, ``--where``, ``--gpus``).

    ``columns``: table column -> what it is: a metric key (``median_tpot_ms``,
    ``output_throughput``, ...; a throughput key ending ``_per_gpu`` is per GPU) or a shape key
    (``concurrency``, ``request_rate``, ``input_len``, ``output_len``, ``num_prompts``).
    Columns named so in the file need no declaration; a column neither declared nor known is
    read as nothing and named. ``where``: conditions ``NAME OP VALUE`` (``<=``, ``>=``, ``==``,
    ``!=``, ``<``, ``>``; names as declared), all of which a row must meet to be read.
    ``gpus``: what a per-GPU throughput is multiplied by (default: the deployment's
    ``engine.memory.tensor_parallel_size``; a per-GPU column without either is refused).
    """

    columns: tuple[tuple[str, str], ...] = ()
    where: tuple[str, ...] = ()
    gpus: int | None = None

    @classmethod
    def parse(cls, columns: Sequence[str] = (), where: Sequence[str] = (), gpus: int | None = None) -> "TableReading":
        pairs = []
        for item in columns:
            name, sep, key = (t.strip() for t in item.rpartition("="))
            if not sep or not name or not key:
                raise CalibrationError(f"--column {item!r}: expected NAME=KEY (a table column and what it is)")
            if not (_table_key(key) or key in SHAPE_KEYS or key in _SHAPE_ALIASES):
                raise CalibrationError(
                    f"--column {item!r}: {key!r} is no metric or shape key; use a vllm bench key "
                    "(mean_ttft_ms, median_tpot_ms, p99_itl_ms, output_throughput, request_throughput, "
                    "total_token_throughput, ...; a throughput with _per_gpu is per GPU) or one of "
                    f"{', '.join(SHAPE_KEYS)}"
                )
            pairs.append((name, _SHAPE_ALIASES.get(key, key)))
        for cond in where:
            if not _WHERE.fullmatch(cond):
                raise CalibrationError(f"--where {cond!r}: expected NAME OP VALUE with OP one of <= >= == != < >")
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
            raise CalibrationError(f"--gpus: a whole number >= 1 (got {gpus!r})")
        return cls(tuple(pairs), tuple(where), gpus)

    def keeps(self, row: dict[str, Any], where: str) -> bool:
        """Whether ``row`` meets every ``where`` condition."""
        for cond in self.where:
            name, op, text = _WHERE.fullmatch(cond).groups()
            if name not in row:
                raise CalibrationError(f"--where {cond!r}: {where} has no column {name!r} "
                                       f"(columns: {', '.join(sorted(row))})")
            value = row[name]
            try:
                wanted: Any = float(text)
                value = float(value)
            except (TypeError, ValueError):
                wanted, value = text.strip("'\""), str(value)
            if not _OPS[op](value, wanted):
                return False
        return True


# A GuideLLM report's per-request distributions, as table keys: TTFT; its inter-token latency
# (per request, (last token - first token) / (tokens - 1): vLLM's TPOT, weighted by each
# request's tokens after the first); request latency (seconds) as E2E.
_GUIDELLM_LATENCIES = {"time_to_first_token_ms": ("ttft", 1.0), "inter_token_latency_ms": ("tpot", 1.0),
                       "request_latency": ("e2el", 1e3)}
_GUIDELLM_STATS = ("mean", "median", "p90", "p95", "p99")


def _is_guidellm_report(d: Any) -> bool:
    runs = d.get("benchmarks") if isinstance(d, dict) else None
    return bool(runs) and isinstance(runs, list) and all(isinstance(b, dict) and "metrics" in b for b in runs)


def _guidellm_rows(report: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A GuideLLM report (``guidellm run --output kind=json`` of 0.8, ``guidellm benchmark run
    --output-path`` of 0.3): one table row per benchmark, its load from the strategy (under
    ``config``, 0.8, or ``args``, 0.3; ``concurrent``: its streams; ``synchronous``: 1;
    ``constant``/``poisson``: its rate) and its figures from the successful requests."""
    rows = []
    for i, bench in enumerate(report["benchmarks"]):
        config = bench.get("config") or bench.get("args") or {}
        strategy = config.get("strategy") or {}
        kind = strategy.get("type_")
        row: dict[str, Any] = {}
        if kind == "concurrent":
            row["concurrency"] = int(strategy["streams"])
        elif kind == "synchronous":
            row["concurrency"] = 1
        elif kind in ("constant", "poisson") and strategy.get("rate"):
            row["request_rate"] = float(strategy["rate"])
        else:
            raise CalibrationError(f"{where} benchmark {i}: a GuideLLM {kind!r} run is not modelled "
                                   "(concurrent, synchronous, constant and poisson runs are)")
        metrics = bench["metrics"]

        def successful(name: str) -> dict[str, Any]:
            return (metrics.get(name) or {}).get("successful") or {}

        for name, (what, scale) in _GUIDELLM_LATENCIES.items():
            dist = successful(name)
            for stat in _GUIDELLM_STATS:
                value = dist.get(stat, (dist.get("percentiles") or {}).get(stat))
                if isinstance(value, (int, float)) and dist.get("count"):
                    row[f"{stat}_{what}_ms"] = value * scale
        for name, key in (("output_tokens_per_second", "output_throughput"),
                          ("requests_per_second", "request_throughput")):
            value = successful(name).get("mean")
            if isinstance(value, (int, float)):
                row[key] = value
        for name, key in (("prompt_token_count", "input_len"), ("output_token_count", "output_len")):
            value = successful(name).get("mean")
            if isinstance(value, (int, float)) and value > 0:
                row[key] = max(1, int(round(value)))
        count = (metrics.get("request_totals") or bench.get("request_totals") or {}).get("successful")
        if isinstance(count, int) and count > 0:
            row["num_prompts"] = count
        rows.append(row)
    return rows


def _table_key(key: str) -> tuple[str, float] | None:
    """A metric key, or a per-GPU throughput key (``output_throughput_per_gpu``)."""
    return metric_of_key(key[: -len("_per_gpu")] if key.endswith("_per_gpu") else key)


def _number(text: str) -> Any:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text or None


def _csv_table(path: Path, text: str) -> list[dict[str, Any]]:
    """A CSV table with a header: one dict per row, numbers as numbers, empty cells left out."""
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames:
        raise CalibrationError(f"{path}: an empty CSV (a table needs a header row)")
    rows = [{k.strip(): _number(v) for k, v in row.items() if k and v is not None and v.strip()} for row in reader]
    if not rows:
        raise CalibrationError(f"{path}: a CSV header without rows")
    return rows


def read_benchmarks(
    path: str | Path,
    selector: str | None = None,
    *,
    engine: dict[str, Any],
    speculative: dict[str, Any] | None,
    workload: dict[str, Any] | None = None,
    seed: int = 0,
    label: str | None = None,
    table: TableReading | None = None,
) -> list[BenchmarkPoint]:
    """Benchmark points from a ``vllm bench serve`` result JSON or a closed-loop table.

    A table is a list of rows (or one row) with ``concurrency`` (a closed loop) or
    ``request_rate`` (Poisson arrivals) and measured aggregates (:func:`metric_of_key`), in JSON
    or in a CSV file with a header, or a GuideLLM report (:func:`_guidellm_rows`); ``selector`` picks it inside a larger JSON
    (``a800_minimax_m3.runs.no_spec``); ``table`` says what its columns are and which rows to
    read (:class:`TableReading`). Other keys (neither a metric nor :data:`TABLE_SHAPE_KEYS`) are read as nothing
    and named in each point's source (``ignored_keys``) and in the fit's notes. Prompt/output
    lengths and request counts come from the row (``input_len``, ``actual_prompt_len``,
    ``output_len``, ``num_prompts``), the enclosing ``load`` section
    (``max_tokens``, ``hold_seconds``: requests = hold x measured QPS) or ``workload``
    (which overrides both; e.g. an assumed ``input_len``; ``requests_per_client: R``: a closed
    loop of C clients sent R x C requests). A closed-loop row whose request count none of these
    gives runs whole rounds of 20-120 requests and reads its throughput in the steady state.
    """
    path = Path(path)
    text = _read_text(path)
    where = f"{path}#{selector}" if selector else str(path)
    table = table or TableReading()
    if path.suffix.lower() == ".csv":
        if selector:
            raise CalibrationError(f"{where}: a CSV file is one table (no #key.path)")
        data: Any = _csv_table(path, text)
    else:
        data = _parse_json(path, text)
    node, parents = _select(data, selector or "", where)
    guidellm = _is_guidellm_report(node)
    if guidellm:
        node = _guidellm_rows(node, where)
    workload = dict(workload or {})
    per_client = workload.get("requests_per_client")
    if per_client is not None and not is_whole(per_client, 1, MAX_REQUESTS_PER_CLIENT):
        raise CalibrationError(f"{where}: requests_per_client: requests each client sent, a whole number in "
                               f"[1, {MAX_REQUESTS_PER_CLIENT:,}] (got {per_client!r})")
    source = {"file": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(),
              "select": selector, **({"format": "guidellm"} if guidellm else {})}
    base = {"engine": engine, "speculative": speculative, "seed": seed}
    if _is_bench_result(node) and not table.columns:
        return [_bench_point(node, where, base, workload, source, label or path.stem)]
    rows = node if isinstance(node, list) else [node]
    rows = [_declared(r, table, engine, f"{where} row {i}") if isinstance(r, dict) else r
            for i, r in enumerate(rows)]
    if not rows or not all(isinstance(r, dict) and ("concurrency" in r or "request_rate" in r) for r in rows):
        raise CalibrationError(
            f"{where}: not a recognised benchmark (a vllm bench result JSON, or rows with "
            "'concurrency' or 'request_rate': declare a column with --column NAME=concurrency); "
            "pick a table inside a larger file with FILE#key.path"
        )
    kept = [i for i, r in enumerate(rows) if table.keeps(r, f"{where} row {i}")]
    if not kept:
        raise CalibrationError(f"{where}: no row meets {' and '.join(table.where)}")
    if table.where:
        source = {**source, "where": list(table.where)}
    load: dict[str, Any] = {}
    for p in parents:
        if isinstance(p, dict) and isinstance(p.get("load"), dict):
            load = p["load"]
    # Keys that are neither a metric nor the row's shape: kept, but named (a misspelt metric
    # would otherwise vanish without a word).
    ignored = sorted({k for r in rows for k in r} - TABLE_SHAPE_KEYS - {k for r in rows for k in r if metric_of_key(k)})
    if ignored:
        source = {**source, "ignored_keys": ignored}
    points = []
    for i in kept:
        row = rows[i]
        rw = f"{where} row {i}"
        measured = {}
        for key, value in row.items():
            hit = metric_of_key(key)
            if hit and isinstance(value, (int, float)) and not isinstance(value, bool):
                measured[hit[0]] = float(value) * hit[1]
        if not measured:
            raise CalibrationError(f"{rw}: no measured aggregate (throughput, latency_*, *_ms, ...)")
        c = row.get("concurrency")
        rate = row.get("request_rate") if c is None else None
        if c is not None and (not isinstance(c, int) or c <= 0):
            raise CalibrationError(f"{rw}: concurrency must be a positive integer (got {c!r})")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
            raise CalibrationError(f"{rw}: request_rate must be a positive number of requests/s (got {rate!r})")
        in_len = workload.get("input_len", row.get("actual_prompt_len", row.get("input_len")))
        out_len = workload.get("output_len", row.get("output_len", load.get("max_tokens")))
        if in_len is None:
            raise CalibrationError(
                f"{rw}: the prompt length is not in the data; give --input-len (an assumption)"
            )
        if out_len is None:
            raise CalibrationError(f"{rw}: the output length is not in the data; give --output-len")
        n = workload.get("num_requests", row.get("num_prompts"))
        if n is None and per_client is not None and c is not None:
            n = c * per_client  # the benchmark's count: each client sends this many (10 x C in InferenceMAX)
        counted = n is not None  # the run's request count is the benchmark's, not a guess
        if n is None and rate is not None:
            n = int(min(max(round(60 * rate), 40), 400))  # a minute of arrivals, 40 to 400 requests
        elif n is None:
            hold = load.get("hold_seconds", workload.get("hold_s"))
            hold = float(np.mean(hold)) if isinstance(hold, list) else hold
            qps = measured.get("request_throughput")
            n = round(hold * qps) if hold and qps else 60
            n = int(min(max(n, 4 * c, 20), 120))
            n = c * math.ceil(n / c)  # whole rounds of the closed loop
        arrival = ({"process": "closed", "concurrency": c} if rate is None
                   else {"process": "poisson", "rate": float(rate)})
        scen = {**base, "workload": {
            "arrival": arrival, "num_requests": int(n),
            "input_len": in_len, "output_len": out_len,
            **{k: v for k, v in workload.items() if k in ("prefix",)},
        }}
        if row.get("failures"):
            measured_note = f" ({row['failures']} failures measured)"
        else:
            measured_note = ""
        name = row.get("scenario") or (f"c={c}" if rate is None else f"rate={rate:g}")
        name = (label or name) if len(rows) == 1 else f"{label + ' ' if label else ''}{name}"
        steady = rate is None and not counted
        points.append(BenchmarkPoint(
            f"{name}{measured_note}", scen, measured,
            {**source, "row": i}, steady_state=steady,
        ))
    return points


def _declared(row: dict[str, Any], table: TableReading, engine: dict[str, Any], where: str) -> dict[str, Any]:
    """``row`` under its declared names (``--column``), each per-GPU throughput made the
    deployment's (x ``--gpus``, or x its ``engine.memory.tensor_parallel_size``). Where two
    columns would be read as the same key, a declared column beats an undeclared one, and a
    known alias beats the bare key (``max_concurrency``, the load a benchmark client sets, over
    the ``concurrency`` SGLang's ``bench_serving`` measures); the other is not read (named among
    the ignored keys). Two of the same standing: a one-line error."""
    names = dict(table.columns)
    out: dict[str, Any] = {}
    rank: dict[str, tuple[int, str]] = {}
    for column, value in row.items():
        key = names.get(column, _SHAPE_ALIASES.get(column, column))
        standing = 2 if column in names else 1 if column in _SHAPE_ALIASES else 0
        if key.endswith("_per_gpu") and _table_key(key):
            gpus = table.gpus or (engine.get("memory") or {}).get("tensor_parallel_size")
            if not gpus:
                raise CalibrationError(f"{where}: {key}: a per-GPU figure needs the GPUs of the deployment: "
                                       "give --gpus N (or engine.memory.tensor_parallel_size)")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = value * gpus
            key = key[: -len("_per_gpu")]
        if key in out:
            other_standing, other = rank[key]
            if other_standing == standing:
                raise CalibrationError(f"{where}: two columns read as {key!r} ({other!r} and {column!r}); "
                                       f"declare the one to read with --column NAME={key}")
            if other_standing > standing:
                out[f"{column} (not read: {other!r} is {key})"] = value
                continue
            out[f"{other} (not read: {column!r} is {key})"] = out[key]
        out[key] = value
        rank[key] = (standing, column)
    return out


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


def split_input(text: str) -> tuple[str, str | None]:
    """``FILE#key.path`` -> (FILE, key.path)."""
    file, sep, selector = text.partition("#")
    return file, (selector or None) if sep else None


def _is_step_input(path: Path) -> bool:
    if path.suffix.lower() == ".csv":  # step samples have a step-time or step-content column; a table neither
        header = {name.strip() for name in next(csv.reader(io.StringIO(_read_text(path))), [])}
        step_columns = set(_TARGETS).union(*_COLUMNS.values())
        return bool(header & step_columns)
    if path.suffix.lower() != ".json":
        return True  # a log
    data = _parse_json(path, _read_text(path))
    if isinstance(data, dict):
        return "samples" in data or "steps" in data
    return bool(data) and isinstance(data[0], dict) and any(t in data[0] for t in _TARGETS)
