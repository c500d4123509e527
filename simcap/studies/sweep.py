"""Sweeps: one simulation per point of a cartesian grid of scenario overrides.

``run_sweep(source, {"engine.max_num_batched_tokens": [2048, 8192], "engine.max_num_seqs":
[16, 32]})`` runs the four scenarios, in worker processes (``workers``) or on a Ray cluster
(``backend="ray"``, an optional extra imported only then), and returns one row per point in
grid order -- the first key varies slowest -- whatever order the runs finish in. A row holds
the point's overrides and the chosen metrics, dotted paths into ``simcap simulate --json``
(e.g. ``ttft_s.p95``, ``throughput.requests_per_s``).

Every point is loaded and validated before any runs, so a bad key or value fails at once with
the field's name.
"""

from __future__ import annotations

import copy
import csv
import io
import itertools
import json
import math
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from simcap._version import __version__
from simcap.config.scenario import Scenario, apply_overrides, parse_scenario
from simcap.config.yaml_files import load_yaml, read_yaml_mapping
from simcap.errors import ScenarioError, SimcapError
from simcap.fleet.run import simulate
from simcap.metrics.summary import summarize
from simcap.studies.capacity import check_workers

DEFAULT_METRICS = (
    "ttft_s.p50",
    "ttft_s.p95",
    "tpot_s.p95",
    "itl_s.p50",
    "itl_s.p95",
    "e2e_s.p95",
    "throughput.requests_per_s",
    "throughput.output_tokens_per_s",
    "kv_cache_usage.max",
    "preemptions",
    "slo_pass",
)

Progress = Callable[[int, int], None]  # (points done, points in all)


# --------------------------------------------------------------------------- input


@dataclass(frozen=True)
class ScenarioSource:
    """A scenario's raw data (before overrides) and the folder its relative paths start from."""

    data: dict[str, Any]
    base_dir: str
    name: str = "scenario"

    @classmethod
    def from_file(cls, path: str | Path) -> "ScenarioSource":
        path = Path(path)
        data, _ = read_yaml_mapping(path, "scenario", "sections (engine, workload, ...)")
        return cls(data, str(path.parent.resolve()), str(path))

    def load(self, overrides: Sequence[str] = ()) -> Scenario:
        data = apply_overrides(copy.deepcopy(self.data), list(overrides))
        return parse_scenario(data, base_dir=Path(self.base_dir))


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets/braces/quotes: ``1,[2,3],x`` -> ``1``, ``[2,3]``, ``x``."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return [v.strip() for v in out]


def parse_grid(items: Sequence[str] | Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """``["engine.max_num_seqs=16,32"]`` (or a mapping) -> ``{"engine.max_num_seqs": [16, 32]}``.

    Values are parsed as YAML scalars. Only the form is checked here; whether a key exists
    and a value is valid is checked when the points are loaded (:func:`grid_points`).
    """
    if isinstance(items, Mapping):
        grid = {str(k): list(v) for k, v in items.items()}
    else:
        grid = {}
        for item in items:
            key, sep, raw = str(item).partition("=")
            key = key.strip()
            if not sep or not key or any(not part for part in key.split(".")):
                raise ScenarioError(f"--grid {item!r}: expected dotted.key=VALUE1,VALUE2,...")
            values = _split_values(raw)
            if any(v == "" for v in values):
                raise ScenarioError(f"{key}: empty value in --grid {item!r}")
            parsed = []
            for v in values:
                try:
                    parsed.append(load_yaml(v))
                except yaml.YAMLError:
                    parsed.append(v)
            if key in grid:
                raise ScenarioError(f"{key}: given twice in --grid; give all its values once")
            grid[key] = parsed
    for key, values in grid.items():
        if not values:
            raise ScenarioError(f"{key}: --grid needs at least one value")
    return grid


def _override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}" if not isinstance(value, str) else f"{key}={value}"


MAX_GRID_POINTS = 100_000  # each a whole simulation


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The cartesian product in order: the first key varies slowest."""
    keys = list(grid)
    size = math.prod(len(grid[k]) for k in keys)
    if size > MAX_GRID_POINTS:
        raise ScenarioError(f"--grid: {size:,} points; a sweep runs at most {MAX_GRID_POINTS:,}")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _metric_template() -> dict[str, Any]:
    summary = summarize([], slo={"ttft_p95": 1.0}, kv_usage=([], [])).to_dict()
    summary["num_steps"] = 0
    return summary


def check_metrics(metrics: Sequence[str]) -> list[str]:
    """Reject metric paths that name nothing in a result (``spec_decode.*``, ``slo.*``,
    ``provenance.*``, e.g. ``provenance.kv_pool_blocks``, and a fleet's ``fleet.*``, e.g.
    ``fleet.load_imbalance.requests``, are free-form)."""
    template = _metric_template()
    for metric in metrics:
        node: Any = template
        parts = metric.split(".")
        if parts[0] in ("spec_decode", "slo", "provenance", "fleet"):
            continue
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                top = ", ".join(k for k in template if k not in ("slo", "spec_decode"))
                raise ScenarioError(
                    f"--metric {metric}: no such result field; use a dotted path into "
                    f"`simcap simulate --json`, e.g. ttft_s.p95 (top-level fields: {top})"
                )
            node = node[part]
        if isinstance(node, dict):
            raise ScenarioError(
                f"--metric {metric}: is a section; name one of {', '.join(node)}"
            )
    return list(metrics)


def _lookup(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# --------------------------------------------------------------------------- run


def run_point(source: ScenarioSource, overrides: list[str], metrics: list[str]) -> dict[str, Any]:
    """Load one point's scenario, simulate it, pick the metrics (runs in a worker)."""
    result = simulate(source.load(overrides)).to_dict()
    return {m: _lookup(result, m) for m in metrics}


def _run_task(task: tuple) -> tuple[int, dict[str, Any]]:
    index, source, overrides, metrics = task
    return index, run_point(source, overrides, metrics)


@dataclass
class SweepResult:
    keys: list[str]
    metrics: list[str]
    rows: list[dict[str, Any]]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "grid": self.keys,
            "metrics": self.metrics,
            "rows": self.rows,
            "provenance": self.provenance,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        columns = self.keys + self.metrics
        writer.writerow(columns)
        for row in self.rows:
            writer.writerow(["" if row[c] is None else _csv_cell(row[c]) for c in columns])
        return buf.getvalue()


def _csv_cell(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def run_sweep(
    source: ScenarioSource | str | Path,
    grid: Mapping[str, Sequence[Any]] | Sequence[str],
    metrics: Sequence[str] | None = None,
    *,
    overrides: Sequence[str] = (),
    workers: int | None = 1,
    backend: str = "local",
    progress: Progress | None = None,
) -> SweepResult:
    """Simulate every grid point; rows in grid order (see the module doc).

    ``overrides``: ``--set`` style overrides applied to every point before the grid's own.
    ``workers``: processes for the local backend (None: the CPU count); 1 runs in-process.
    """
    if not isinstance(source, ScenarioSource):
        source = ScenarioSource.from_file(source)
    grid = parse_grid(grid)
    metrics = check_metrics(list(metrics) if metrics else list(DEFAULT_METRICS))
    if backend not in ("local", "ray"):
        raise ScenarioError(f"--backend {backend}: unknown backend; allowed: local, ray")
    if workers is not None:
        check_workers(workers)
    points = grid_points(grid)
    tasks = []
    for i, point in enumerate(points):
        point_overrides = list(overrides) + [_override(k, v) for k, v in point.items()]
        try:
            source.load(point_overrides)  # validate every point before running any
        except ScenarioError as exc:
            shown = ", ".join(f"{k}={v}" for k, v in point.items())
            raise ScenarioError(f"{exc} [grid point {shown}]") from None
        tasks.append((i, source, point_overrides, list(metrics)))
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(tasks))

    if progress is not None:
        progress(0, len(tasks))
    if backend == "ray":
        for index, row in run_ray(tasks):
            results[index] = row
            tick()
    else:
        n = (os.cpu_count() or 1) if workers is None else workers
        if n == 1 or len(tasks) <= 1:
            for task in tasks:
                index, row = _run_task(task)
                results[index] = row
                tick()
        else:
            with ProcessPoolExecutor(min(n, len(tasks))) as pool:
                futures = [pool.submit(_run_task, t) for t in tasks]
                for fut in as_completed(futures):
                    index, row = fut.result()
                    results[index] = row
                    tick()
    rows = [{**point, **row} for point, row in zip(points, results)]  # type: ignore[arg-type]
    base = source.load(list(overrides))
    prov = {
        "simcap_version": __version__,
        "scenario": source.name,
        "base_scenario_sha256": base.digest(),
        "vllm_version_modelled": base.engine.vllm_version,
        "seed": base.seed,
        "overrides": list(overrides),
        "backend": backend,
    }
    return SweepResult(list(grid), list(metrics), rows, prov)


def run_ray(tasks: list[tuple], fn: Callable[[tuple], Any] | None = None):
    """Yield ``fn(task)`` (default: a sweep point's (index, row)) as Ray tasks finish, in any
    order: each result must say where it belongs (as (index, value) does)."""
    try:
        import ray
    except ImportError:
        raise SimcapError(
            "--backend ray: Ray is not installed; install it with pip install 'simcap[ray]' "
            "(or pip install 'ray>=2')"
        ) from None
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(fn if fn is not None else _run_task)
    pending = [remote.remote(t) for t in tasks]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            yield ray.get(ref)


def render_sweep(result: SweepResult, console: Any) -> None:
    """A table, one row per grid point, in grid order."""
    from rich.table import Table

    table = Table(title="sweep", title_justify="left")
    for col in result.keys + result.metrics:
        table.add_column(col, justify="right")
    for row in result.rows:
        cells = []
        for col in result.keys + result.metrics:
            value = row[col]
            if value is None:
                cells.append("-")
            elif isinstance(value, bool):
                cells.append("yes" if value else "NO")
            elif isinstance(value, float):
                cells.append(f"{value:.4g}")
            else:
                cells.append(str(value))
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"simcap {result.provenance.get('simcap_version')}; scenario {result.provenance.get('scenario')} "
        f"sha256 {str(result.provenance.get('base_scenario_sha256'))[:12]}, seed "
        f"{result.provenance.get('seed')}; times in seconds", style="dim",
    )
