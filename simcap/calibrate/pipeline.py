"""The entry point: :func:`calibrate` reads a recipe's datasets (or the given files), picks the
fit for their kind (step samples or benchmark results) and runs it."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Collection, Sequence

from simcap.calibrate.core import CalibrationError, Form, is_whole
from simcap.calibrate.fit_bench import fit_benchmarks, fit_benchmarks_roofline
from simcap.calibrate.fit_steps import fit_step_samples
from simcap.calibrate.metric_keys import metric_of_key
from simcap.calibrate.readers import (
    MAX_REQUESTS_PER_CLIENT, TableReading, _is_step_input, ignored_keys, read_benchmarks, read_step_samples,
    split_input,
)
from simcap.calibrate.recipe import Recipe
from simcap.calibrate.result import Fit
from simcap.config.scenario import MAX_INT64, MAX_TOKENS


MAX_BOOTSTRAP = 100_000  # resamples (each a refit)


# How a benchmark table is fitted in the roofline form (said wherever --form roofline meets one).
ROOFLINE_TABLES = (
    "--form roofline fits step samples (an iteration log, CSV or JSON step rows), not benchmark results; "
    "a table is fitted in the roofline form through --base: a profile or recipe whose step_time says "
    "form: roofline (with hardware and model), and --form naming its free terms, e.g. "
    "efficiency.weights,efficiency.experts,base"
)


def _finite(value: Any, *, positive: bool) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value > 0 if positive else value >= 0)


def check_options(
    *, bootstrap: int | None = None, host_overhead: float | None = None,
    warn_above: float | None = None, num_speculative_tokens: int = 0,
    workload: dict[str, Any] | None = None, seed: int = 0, recipe: Recipe | None = None,
) -> None:
    """Refuse, before any file is read, option values no fit can use: one line naming the
    option (``--bootstrap``), or with ``recipe`` the recipe's key (``FILE: bootstrap``)."""

    def name(key: str) -> str:
        return f"{recipe.path or recipe.name}: {key}" if recipe else f"--{key.replace('_', '-')}"

    if bootstrap is not None and not is_whole(bootstrap, 0, MAX_BOOTSTRAP):
        raise CalibrationError(f"{name('bootstrap')}: resamples, a whole number in "
                               f"[0, {MAX_BOOTSTRAP:,}] (got {bootstrap!r})")
    if host_overhead is not None and not _finite(host_overhead, positive=False):
        raise CalibrationError(
            f"{name('host_overhead')}: seconds per step, finite and >= 0 (got {host_overhead!r})"
        )
    if warn_above is not None and not _finite(warn_above, positive=True):
        raise CalibrationError(
            f"{name('warn_above')}: a relative error, finite and > 0 (got {warn_above!r})"
        )
    if not is_whole(num_speculative_tokens, 0, 16):  # as SpeculativeConfig allows
        raise CalibrationError(
            f"{name('num_speculative_tokens')}: must be in [0, 16] (got {num_speculative_tokens!r})"
        )
    if not is_whole(seed, 0, MAX_INT64):
        raise CalibrationError(f"{name('seed')}: a whole number in [0, 2^63) (got {seed!r})")
    for key, value in (workload or {}).items():
        if key == "requests_per_client":
            if not is_whole(value, 1, MAX_REQUESTS_PER_CLIENT):
                raise CalibrationError(f"{name(key)}: requests each client sent, a whole number in "
                                       f"[1, {MAX_REQUESTS_PER_CLIENT:,}] (got {value!r})")
            continue
        if not is_whole(value, 1, MAX_TOKENS):
            raise CalibrationError(
                f"{name(key)}: tokens, a whole number in [1, {MAX_TOKENS:,}] (got {value!r})"
            )


_METRIC = re.compile(r"(ttft|tpot|itl|e2e)_(mean|p50|p90|p95|p99)|(output|request|input|total)_throughput"
                     r"|per_user_output_tps|itl_frac_.+")


def check_fit_metrics(names: Sequence[str], option: str = "--fit-metrics") -> list[str]:
    """``--fit-metrics`` (or ``option``): each a simcap metric (``tpot_mean``,
    ``output_throughput``) or a measurement key that stands for one (``median_tpot_ms``);
    returns the simcap names."""
    out = []
    for name in names:
        hit = metric_of_key(name)
        metric = hit[0] if hit else name
        if not _METRIC.fullmatch(metric):
            raise CalibrationError(
                f"{option} {name!r}: not a metric; use ttft|tpot|itl|e2e_mean|p50|p90|p95|p99, "
                "output_throughput, request_throughput, total_throughput, per_user_output_tps, "
                "or a vllm bench key (median_tpot_ms, ...)"
            )
        out.append(metric)
    if not out:
        raise CalibrationError(f"{option}: name at least one metric")
    return out


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
    roofline: dict[str, Any] | None = None,
    rows: Collection[str] | None = None,
    table: TableReading | None = None,
    fit_metrics: Sequence[str] | None = None,
) -> Fit:
    """Read the inputs (or the recipe's datasets), pick the fit for their kind, and run it.

    ``rows``: fit only the benchmark rows with these labels (``BenchmarkPoint.label``, e.g.
    ``no-spec c=4``); an unknown label is refused, naming the labels there are. ``table``:
    what a table's columns are and which rows to read
    (:class:`~simcap.calibrate.readers.TableReading`). ``fit_metrics``: the measured figures
    the objective fits (default: the recipe's, else every one measured).

    ``form="roofline"``: fit the roofline form to step samples
    (:func:`simcap.calibrate.fit_roofline.fit_roofline_samples`); ``roofline`` holds its
    arguments: ``hardware``, ``model`` (required), ``combine``, ``routing_skew``, ``prior_sd``,
    ``records`` (client record files of the same run, for the attended context) and the rest of
    that function's keywords. The workload's ``input_len`` and ``output_len`` (means) stand in
    for records.

    A recipe whose ``step_time`` says ``form: roofline`` is fitted to benchmark results by
    simulation (:func:`simcap.calibrate.fit_bench.fit_benchmarks_roofline`); its ``form``
    names the free terms.
    """
    check_options(bootstrap=bootstrap, host_overhead=host_overhead, warn_above=warn_above,
                  num_speculative_tokens=num_speculative_tokens, workload=workload)
    check_options(bootstrap=recipe.bootstrap, warn_above=recipe.warn_above, seed=recipe.seed,
                  recipe=recipe)
    recipe_iterations = recipe.bootstrap_iterations
    if recipe_iterations is not None and not is_whole(recipe_iterations, 0, MAX_BOOTSTRAP):
        raise CalibrationError(f"{recipe.path or recipe.name}: bootstrap_iterations: a whole number "
                               f"in [0, {MAX_BOOTSTRAP:,}] (got {recipe_iterations!r})")
    if fit_metrics is not None:
        fit_metrics = check_fit_metrics(fit_metrics)
        recipe = dataclasses.replace(recipe, fit_metrics=list(fit_metrics))
    if form == "roofline":
        _no_table_options(rows, table, fit_metrics, ROOFLINE_TABLES)
        return _calibrate_roofline(inputs, recipe, roofline or {}, host_overhead=host_overhead,
                                   workload=workload, num_speculative_tokens=num_speculative_tokens,
                                   bootstrap=bootstrap, level=level, warn_above=warn_above, noise=noise)
    roofline_recipe = recipe.step_time.get("form") == "roofline"
    fixed = {k: v for k, v in recipe.step_time.items() if v is not None}
    fixed.update(fix or {})
    if host_overhead is not None:
        fixed["host_overhead"] = host_overhead
    if roofline_recipe:
        if fix:
            raise CalibrationError("--fix: the roofline form takes its fixed values from the "
                                   "recipe's step_time section")
        if not (form or recipe.form):
            raise CalibrationError("form: the roofline form needs its free terms named "
                                   "(e.g. efficiency.weights, efficiency.experts, base)")
    form_obj = (Form.parse(form or recipe.form) if (form or recipe.form) and not roofline_recipe
                else None)
    warn = warn_above if warn_above is not None else recipe.warn_above
    step_inputs, points = read_all(inputs, recipe, workload, num_speculative_tokens, table)
    if step_inputs:
        _no_table_options(rows, table, fit_metrics, "step samples have none")
    points = pick_rows(points, rows)
    if step_inputs and points:
        raise CalibrationError("calibrate: give step samples or benchmark results, not both")
    if fit_metrics is not None:
        measured = {m for p in points for m in p.measured}
        missing = [m for m in fit_metrics if m not in measured]
        if missing:
            raise CalibrationError(f"--fit-metrics: {', '.join(missing)} not measured in these rows "
                                   f"(measured: {', '.join(sorted(measured))})")
    if step_inputs and roofline_recipe:
        raise CalibrationError("calibrate: a roofline recipe is fitted to benchmark results; "
                               "fit step samples with --form roofline")
    if step_inputs:
        return fit_step_samples(step_inputs, form_obj, fixed=fixed,
                                host_overhead=fixed.get("host_overhead"),
                                bootstrap=200 if bootstrap is None else bootstrap, level=level,
                                seed=recipe.seed, warn_above=warn, noise=noise)
    ignored = ignored_keys(points)
    if roofline_recipe:
        fit = fit_benchmarks_roofline(
            points, fixed, form or recipe.form, prior=recipe.prior, fit_metrics=recipe.fit_metrics,
            weights=recipe.weights,
            bootstrap=(recipe.bootstrap or 40) if bootstrap is None else bootstrap,
            iterations=(recipe.bootstrap_iterations if recipe.bootstrap_iterations is not None
                        else 2) if iterations is None else iterations,
            level=level, seed=recipe.seed, warn_above=warn, starts=recipe.starts)
    else:
        fit = fit_benchmarks(points, form_obj, fixed=fixed, fit_metrics=recipe.fit_metrics,
                             weights=recipe.weights,
                             bootstrap=(recipe.bootstrap or 40) if bootstrap is None else bootstrap,
                             iterations=(recipe.bootstrap_iterations if recipe.bootstrap_iterations
                                         is not None else 2) if iterations is None else iterations,
                             level=level, seed=recipe.seed, warn_above=warn)
    if ignored:
        fit.notes.append(f"table keys read as no metric (left out of the fit): {', '.join(ignored)}")
    return fit


def _no_table_options(rows: Any, table: Any, fit_metrics: Any, why: str) -> None:
    """Refuse, in one line, the options that read benchmark tables where there is none."""
    for given, name in ((rows, "--rows"), (table, "--column/--where/--gpus"), (fit_metrics, "--fit-metrics")):
        if given is not None:
            raise CalibrationError(f"{name}: reads benchmark tables; {why}")


def pick_rows(points: list, rows: Collection[str] | None) -> list:
    """The points labelled as in ``rows`` (``--rows``; None: all); an unknown label is refused,
    naming the labels there are."""
    if rows is None:
        return points
    known = {p.label for p in points}
    unknown = sorted(set(rows) - known)
    if unknown:
        raise CalibrationError(f"--rows: no benchmark row labelled {', '.join(map(repr, unknown))} "
                               f"(rows: {', '.join(sorted(known))})")
    return [p for p in points if p.label in set(rows)]


def read_all(inputs: Sequence[str], recipe: Recipe, workload: dict[str, Any] | None,
             num_speculative_tokens: int, table: TableReading | None = None) -> tuple[list, list]:
    """The step samples and benchmark points of the command's inputs or the recipe's datasets
    (one or the other)."""
    base_dir = recipe.path.parent if recipe.path and recipe.datasets else Path(".")
    datasets = [dict(d) for d in recipe.datasets] or [{"input": i} for i in inputs]
    if recipe.datasets and inputs:
        raise CalibrationError("calibrate: give a recipe or measurement files, not both")
    if not datasets:
        raise CalibrationError("calibrate: no input files")
    return read_inputs(datasets, base_dir, recipe, workload, num_speculative_tokens, table)


TABLE_KEYS = ("columns", "where", "gpus")


def _table_of(dataset: dict[str, Any], path: Path) -> TableReading | None:
    """A recipe dataset's ``table`` section (``columns``, ``where``, ``gpus``: what ``--column``,
    ``--where`` and ``--gpus`` say on the command line), or None."""
    spec = dataset.get("table")
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - set(TABLE_KEYS):
        bad = sorted(set(spec) - set(TABLE_KEYS)) if isinstance(spec, dict) else None
        raise CalibrationError(f"{path}: dataset table: " + (f"unknown key {bad[0]!r}; " if bad else "a mapping; ")
                               + f"allowed: {', '.join(TABLE_KEYS)}")
    columns, where = spec.get("columns") or {}, spec.get("where") or []
    if not isinstance(columns, dict) or not isinstance(where, list):
        raise CalibrationError(f"{path}: dataset table: columns is a mapping NAME: KEY, where a list of "
                               "conditions NAME OP VALUE")
    try:
        return TableReading.parse([f"{k}={v}" for k, v in columns.items()], [str(w) for w in where],
                                  spec.get("gpus"))
    except CalibrationError as exc:  # the option's message, said of the recipe's section
        raise CalibrationError(f"{path}: dataset table: {exc}") from None


def read_inputs(datasets: Sequence[dict[str, Any]], base_dir: Path, recipe: Recipe,
                 workload: dict[str, Any] | None, num_speculative_tokens: int,
                 table: TableReading | None = None) -> tuple[list, list]:
    """The step samples and the benchmark points of a recipe's datasets (or input files)."""
    step_inputs: list = []
    points: list = []
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
        points += read_benchmarks(path, selector, engine=recipe.engine, speculative=spec, workload=wl,
                                  seed=recipe.seed, label=d.get("label"), table=table or _table_of(d, path))
    return step_inputs, points


def benchmark_points(recipe: Recipe) -> list:
    """Every benchmark row of a recipe's datasets, as :class:`~simcap.calibrate.readers.BenchmarkPoint`
    s (each with its label, scenario and measured figures): what :func:`calibrate` fits, and
    what a fit on some of them predicts for the rest."""
    base_dir = recipe.path.parent if recipe.path else Path(".")
    return read_inputs([dict(d) for d in recipe.datasets], base_dir, recipe, None, 0)[1]


def read_records(path: str | Path) -> list:
    """Client request records (``RequestRecord.to_dict()`` per line; JSONL, optionally gzipped,
    or a JSON list)."""
    import gzip
    import json

    from simcap.metrics.records import RequestRecord

    path = Path(path)
    try:
        raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.strip()
        rows = json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
        return [RequestRecord.from_dict(r) for r in rows]
    except (ValueError, TypeError, KeyError) as exc:
        raise CalibrationError(f"{path}: not client request records: {exc}") from None


def _calibrate_roofline(inputs, recipe, opts, *, host_overhead, workload, num_speculative_tokens,
                        bootstrap, level, warn_above, noise) -> Fit:
    from simcap.calibrate.fit_roofline import (
        ContextSource, decode_context_of_means, decode_context_of_records, fit_roofline_samples)

    opts = dict(opts)
    for key in ("hardware", "model"):
        if not opts.get(key):
            raise CalibrationError(f"--form roofline: give --{key} (a catalog name or a file)")
    if recipe.datasets:
        raise CalibrationError("--form roofline: give step-sample files, not a recipe")
    if not inputs:
        raise CalibrationError("calibrate: no input files")
    samples = []
    for i in inputs:
        file, selector = split_input(i)
        path = Path(file)
        if not path.exists():
            raise CalibrationError(f"{path}: cannot read: No such file or directory")
        if selector is not None or not _is_step_input(path):
            raise CalibrationError(
                f"{path}: {ROOFLINE_TABLES}")
        samples.append(read_step_samples(path, num_speculative_tokens))
    records = opts.pop("records", None) or []
    context = None
    wl = workload or {}
    if records:
        recs = [r for f in records for r in read_records(f)]
        context = ContextSource(decode_context_of_records(recs),
                                f"client records {', '.join(Path(f).name for f in records)}: mean over "
                                "decode request-steps of prompt + tokens generated so far")
    elif wl.get("input_len") and wl.get("output_len"):
        context = ContextSource(decode_context_of_means(wl["input_len"], wl["output_len"]),
                                f"workload means: input {wl['input_len']} + output {wl['output_len']} / 2")
    skew = opts.pop("routing_skew", 0.0)
    return fit_roofline_samples(
        samples, opts.pop("hardware"), opts.pop("model"), routing_skew=skew, context=context,
        host_overhead=host_overhead, bootstrap=200 if bootstrap is None else bootstrap, level=level,
        seed=recipe.seed, warn_above=warn_above if warn_above is not None else recipe.warn_above,
        noise=noise, **opts)
