"""The ``simcap`` command: parse, call the library, render. No logic of its own."""

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import typer
from typer.core import TyperGroup

from simcap._version import __version__
from simcap.cli.common import (
    COLUMN_OPTION, GPUS_OPTION, JSON_OPTION, MODEL_FORM_OPTION, REQUESTS_PER_CLIENT_OPTION, SET_OPTION, WHERE_OPTION,
    fail, load_command_scenario, table_reading, table_workload,
    user_errors, warn_when_done, with_replicas)
from simcap.errors import SimcapError
from simcap.metrics import report
from simcap.runtime import startup


class _OneLineUsageErrors(TyperGroup):
    """A malformed command line (unknown option, a value of the wrong type or out of range,
    a missing argument), in any sub-command, is one line and exit code 2, as every other bad
    input is; a bare group still prints its help."""

    def main(self, *args, **kwargs):
        with startup.command():  # few collections while it starts, none at exit (simcap.runtime.startup)
            return super().main(*args, **kwargs)

    def make_context(self, *args, **kwargs):
        with _usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _usage_errors(), warn_when_done():
            return super().invoke(ctx)


# Click's usage errors, from the click typer runs on (some typer releases carry their own).
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_NoArgsIsHelp = getattr(sys.modules[_UsageError.__module__], "NoArgsIsHelpError", ())


@contextmanager
def _usage_errors() -> Iterator[None]:
    try:
        yield
    except _NoArgsIsHelp:  # a bare command group: its help, as before
        raise
    except _UsageError as exc:
        fail(exc.format_message())


app = typer.Typer(
    cls=_OneLineUsageErrors,
    add_completion=False,
    no_args_is_help=True,
    help="Discrete-event capacity simulator of the vLLM V1 serving engine.",
)


def _show(result: Any, render: Callable[[Any, Any], None], json_out: bool, plot: Optional[Path],
          plotter: str, extra: dict[str, Any] | None = None) -> None:
    """A study's result: its figure (``simcap.studies.plots.<plotter>``) when asked, then JSON or
    tables (``extra``: more keys for the JSON; ``extra["lines"]``: lines after the tables)."""
    extra = dict(extra or {})
    lines = extra.pop("lines", [])
    if plot is not None:
        from simcap.studies import plots

        with user_errors():
            getattr(plots, plotter)(result, plot)
    if json_out:
        typer.echo(report.to_json({**result.to_dict(), **extra}))
    else:
        render(result, report.wide_console(120))
        for line in lines:
            typer.echo(line)
    if plot is not None:
        typer.echo(f"figure: {plot}", err=json_out)


@app.command("simulate")
def simulate_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Write teaching figures (step timeline, ITL histogram, KV and queue) as PNGs into DIR."
    ),
    ci: bool = typer.Option(
        False, "--ci", help="Re-run with the profile's bootstrap coefficient sets; print 90% intervals."
    ),
    compare_router: Optional[str] = typer.Option(
        None, "--compare-router",
        help="A fleet with --plot: also run it under these routers (comma-separated), side by side.",
    ),
    speedup: Optional[float] = typer.Option(
        None, "--speedup", help="Trace replay: divide the trace's gaps by this (workload.trace.speedup)."
    ),
    trace_start: Optional[float] = typer.Option(
        None, "--trace-start", help="Trace replay: window start, s after its first row (workload.trace.start_s)."
    ),
    trace_duration: Optional[float] = typer.Option(
        None, "--trace-duration", help="Trace replay: window length in s of trace time (workload.trace.duration_s)."
    ),
    trace_requests: Optional[int] = typer.Option(
        None, "--trace-requests", help="Trace replay: send only the first N requests (workload.trace.num_requests)."
    ),
    model_form: Optional[Path] = MODEL_FORM_OPTION,
) -> None:
    """Simulate a scenario and print its latency, throughput and SLO summary."""
    from simcap.config.traces import trace_overrides

    set_ = [*(set_ or []), *trace_overrides(speedup, trace_start, trace_duration, trace_requests)]
    intervals = None
    keep = plot is not None  # the figures need every chunk and every step
    compare = []
    with user_errors():
        if plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(plot, "--plot", directory=True)
        loaded = load_command_scenario(scenario, set_, collect=False)
        if model_form is not None:  # read first: a bad record or profile fails before the run
            from simcap.accuracy import model_form as mf

            if loaded.deployment is not None:
                fail("--model-form: not with a deployment (a profile's fitted load is one replica's)")
            form_error, fit_load = mf.for_scenario(model_form, loaded)
        from simcap.fleet.run import simulate  # after the scenario's models (load_command_scenario)

        startup.end()

        if compare_router is not None:
            from simcap.studies.fleet_sizing import parse_routers, with_fleet

            if plot is None or loaded.deployment is None:
                fail("--compare-router: only with --plot and a scenario with a deployment")
            compare = [
                simulate(with_fleet(loaded, loaded.deployment.num_replicas, name), records=True, steps=True)
                for name in parse_routers(compare_router, loaded)
            ]
        if ci:
            from simcap.calibrate import simulate_with_ci

            result, intervals = simulate_with_ci(loaded, records=keep, steps=keep)
        else:
            result = simulate(loaded, records=keep, steps=keep)
    data = result.to_dict()
    if intervals is not None:
        data["ci"] = {"level": 0.9, **{k: list(v) for k, v in intervals.items()}}
    if model_form is not None:
        data["model_form"] = mf.summary_intervals(form_error, result.summary, fit_load)
    if json_out:
        typer.echo(report.to_json(data))
    else:
        report.render_summary(data, report.wide_console(100))
        if intervals is not None:
            from simcap.calibrate import render_intervals

            render_intervals(data, intervals, report.wide_console(100))
        if model_form is not None:
            typer.echo(report.model_form_summary_line(data["model_form"]))
    if plot is not None:
        from simcap.studies.plots import write_simulation_plots

        with user_errors():
            paths = write_simulation_plots(result, plot, compare)
        for path in paths:
            typer.echo(f"figure: {path}", err=json_out)  # stdout stays pure JSON with --json


@app.command("kv")
def kv_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file with an engine.memory section."),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Size the KV pool from card memory, model shape and flags, as vLLM does at start-up."""
    try:
        loaded = load_command_scenario(scenario, set_, check=False, simulated=False)
    except SimcapError as exc:
        fail(str(exc))
    plan = loaded.engine.kv_plan
    if plan is None:
        fail("engine.memory: this scenario gives num_gpu_blocks, not a memory spec to plan from")
    if json_out:
        typer.echo(report.to_json(plan.to_dict()))
    else:
        report.render_kv_plan(plan.to_dict(), report.wide_console(100))


@app.command("crossover")
def crossover_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file with a speculative section."),
    concurrency: Optional[str] = typer.Option(
        None, "--concurrency", help="Closed-loop clients, comma-separated (default 1,2,4,...,128)."
    ),
    rate: Optional[str] = typer.Option(
        None, "--rate", help="Open-loop arrival rates in req/s, comma-separated (instead of --concurrency)."
    ),
    per_stream_tps: Optional[float] = typer.Option(
        None, "--per-stream-tps", help="Per-stream target, output tok/s per request: highest load keeping it."
    ),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a throughput/latency figure (PNG, SVG, PDF)."),
    workers: int = typer.Option(1, "--workers", help="Worker processes (the arms run in parallel)."),
    baseline_profile: Optional[Path] = typer.Option(
        None, "--baseline-profile",
        help="Price the baseline arm with this profile (step time, KV pool), e.g. one calibrated on the "
             "server without speculation; default: the scenario's own, speculation removed.",
    ),
    model_form: Optional[Path] = MODEL_FORM_OPTION,
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Run a scenario with and without speculative decoding across load; find the crossover."""
    from simcap.studies import crossover as xo

    with user_errors():
        if concurrency is not None and rate is not None:
            fail("--rate: give either --concurrency (closed loop) or --rate (open loop), not both")
        if plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(plot, "--plot")
        loaded = load_command_scenario(scenario, set_)
        baseline = None if baseline_profile is None else load_command_scenario(
            scenario, set_, profile=baseline_profile)
        if model_form is not None:  # read first: a bad record or profile fails before the runs
            from simcap.accuracy import model_form as mf

            form_error = mf.FormError.read(model_form)
            fit_loads = (mf.profile_fit_load(loaded.profile_file, "speculative"),
                         mf.profile_fit_load((baseline or loaded).profile_file, "plain"))
        result = xo.find_crossover(
            loaded,
            concurrencies=None if concurrency is None else xo.parse_load_list(concurrency, "--concurrency", integer=True),
            rates=None if rate is None else xo.parse_load_list(rate, "--rate", integer=False),
            per_stream_tps=per_stream_tps,
            workers=workers,
            baseline=baseline,
        )
        band = None if model_form is None else mf.crossover_band(form_error, result, *fit_loads)
    if plot is not None:
        with user_errors():
            xo.plot_crossover(result, plot)
    if json_out:
        typer.echo(report.to_json({**result.to_dict(), **({"model_form": band} if band else {})}))
    else:
        xo.render_crossover(result, report.wide_console(130))
        if band:
            typer.echo(report.model_form_band_line(band))
        if plot is not None:
            typer.echo(f"figure: {plot}")


@app.command("capacity")
def capacity_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    slo: Optional[List[str]] = typer.Option(
        None, "--slo", help="SLO target METRIC_STAT=SECONDS, e.g. ttft_p95=2.0 (repeatable; default the scenario's slo)."
    ),
    rates: Optional[str] = typer.Option(
        None, "--rates", help="Requested arrival rates in req/s: R1,R2,... or START:STOP:N."
    ),
    auto: bool = typer.Option(False, "--auto", help="Bracket and bisect the safe rate (default without --rates)."),
    duration: float = typer.Option(300.0, "--duration", help="Seconds of arrivals per run."),
    replicates: int = typer.Option(2, "--replicates", help="Runs per rate; replicate r uses seed + r."),
    workers: int = typer.Option(1, "--workers", help="Worker processes."),
    interval_sets: int = typer.Option(
        8, "--interval-sets", help="Profile bootstrap sets to rerun for safe_rate_interval (0: none)."
    ),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write the SLO-vs-rate figure to FILE (PNG)."),
    early_stop: bool = typer.Option(
        True, "--early-stop/--no-early-stop",
        help="Stop a run once its TTFT/E2E target is certain to fail (its SLO values are then not known).",
    ),
    replicas: Optional[int] = typer.Option(
        None, "--replicas", help="The safe rate of a fleet of N replicas behind the scenario's router (or --router)."
    ),
    router: Optional[str] = typer.Option(None, "--router", help="With --replicas: the fleet's router."),
    model_form: Optional[Path] = MODEL_FORM_OPTION,
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Highest arrival rate that keeps the SLO (safe rate) and where the queue diverges."""
    from simcap.studies import capacity as cap

    if model_form is not None and replicas:
        fail("--model-form: not with --replicas (a profile's fitted load is one replica's)")
    with user_errors():
        if plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(plot, "--plot")
        loaded = with_replicas(load_command_scenario(scenario, set_), replicas, router)
        if model_form is not None:  # read first: a bad record or profile fails before the runs
            from simcap.accuracy import model_form as mf

            form_error, fit_load = mf.for_scenario(model_form, loaded)
        result = cap.find_capacity(
            loaded,
            cap.parse_slo(slo) if slo else None,
            rates=cap.parse_rates(rates) if rates is not None else None,
            auto=auto,
            duration_s=duration,
            replicates=replicates,
            workers=workers,
            interval=interval_sets != 0,
            interval_max_sets=interval_sets,
            early_stop=early_stop,
        )
        extra = None
        if model_form is not None:
            band = mf.capacity_interval(form_error, loaded, result, fit_load, duration_s=duration,
                                        replicates=replicates, workers=workers)
            extra = {"model_form": band, "lines": [report.model_form_capacity_line(band)]}
    _show(result, cap.render_capacity, json_out, plot, "plot_capacity", extra)


@app.command("fleet")
def fleet_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    target_rate: float = typer.Option(..., "--target-rate", help="Arrival rate the fleet must take, req/s."),
    slo: Optional[List[str]] = typer.Option(
        None, "--slo", help="SLO target METRIC_STAT=SECONDS (repeatable; default the scenario's slo)."
    ),
    router: Optional[str] = typer.Option(
        None, "--router", help="Routers to size for, comma-separated (default: the scenario's, or roundrobin)."
    ),
    price: Optional[float] = typer.Option(
        None, "--price-per-replica-hour", help="Price of one replica for an hour: cost of each answer."
    ),
    max_replicas: int = typer.Option(64, "--max-replicas", help="Largest fleet tried."),
    duration: float = typer.Option(120.0, "--duration", help="Seconds of arrivals per run."),
    replicates: int = typer.Option(2, "--replicates", help="Runs per replica count; replicate r uses seed + r."),
    workers: int = typer.Option(1, "--workers", help="Worker processes (local backend)."),
    backend: str = typer.Option("local", "--backend", help="local (processes) or ray (needs Ray installed)."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Also find the safe rate at 1, 2, 4, ... replicas per router; plot it (PNG, SVG, PDF)."
    ),
    disaggregated: bool = typer.Option(
        False, "--disaggregated",
        help="Size the scenario's prefill and decode pools: the best prefill:decode split of the fewest replicas.",
    ),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """The fewest replicas meeting the SLO at a target rate, for each router, and their cost."""
    from simcap.studies import fleet_sizing as fs

    if disaggregated:
        for given, name in ((router, "--router"), (plot, "--plot"), (price, "--price-per-replica-hour")):
            if given is not None:
                fail(f"{name}: not with --disaggregated (the scenario's router serves both pools)")
        with user_errors():
            pools = fs.size_pools(
                load_command_scenario(scenario, set_), target_rate, fs.parse_slo(slo) if slo else None,
                duration_s=duration, replicates=replicates, max_replicas=max_replicas,
                workers=workers, backend=backend,
            )
        if json_out:
            typer.echo(report.to_json(pools.to_dict()))
        else:
            fs.render_pool_sizing(pools, report.wide_console(100))
        return
    with user_errors():
        if plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(plot, "--plot")
        loaded = load_command_scenario(scenario, set_)
        routers = fs.parse_routers(router, loaded)
        result = fs.size_fleet(
            loaded, target_rate, fs.parse_slo(slo) if slo else None, routers,
            duration_s=duration, replicates=replicates, max_replicas=max_replicas,
            price_per_replica_hour=price, workers=workers, backend=backend,
        )
        if plot is not None:
            fs.add_safe_rate_curve(result, loaded, fs.curve_counts_for(result), workers=workers)
    _show(result, fs.render_sizing, json_out, plot, "plot_fleet_sizing")


@app.command("sweep")
def sweep_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    grid: List[str] = typer.Option(
        ..., "--grid", help="dotted.key=V1,V2,... (repeatable): the cartesian product is simulated."
    ),
    metric: Optional[List[str]] = typer.Option(
        None, "--metric", help="Result field to report, a dotted path into simulate --json, e.g. ttft_s.p95 (repeatable)."
    ),
    workers: Optional[int] = typer.Option(None, "--workers", help="Worker processes (default: CPU count)."),
    backend: str = typer.Option("local", "--backend", help="local (processes) or ray (needs simcap[ray])."),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a scenario key for every point: dotted.key=value (repeatable)."
    ),
    json_out: bool = JSON_OPTION,
    csv_out: bool = typer.Option(False, "--csv", help="Print CSV instead of a table."),
) -> None:
    """Simulate every combination of the --grid overrides; one row per point, in grid order."""
    from rich.console import Console
    from rich.progress import Progress

    from simcap.studies import sweep as sw

    if json_out and csv_out:
        fail("--csv: give either --json or --csv, not both")
    bar = Progress(console=Console(stderr=True), transient=True)
    task = None

    def progress(done: int, total: int) -> None:  # first called once every point validated
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task("simulating", total=total)
        bar.update(task, completed=done, total=total)

    startup.end()  # (the points are loaded and validated as the sweep starts)
    with user_errors():
        try:
            result = sw.run_sweep(
                sw.ScenarioSource.from_file(scenario),
                sw.parse_grid(grid),
                metric or None,
                overrides=set_ or [],
                workers=workers,
                backend=backend,
                progress=progress,
            )
        finally:  # the bar must be gone before any message is printed
            if task is not None:
                bar.stop()
    if json_out:
        typer.echo(result.to_json())
    elif csv_out:
        typer.echo(result.to_csv(), nl=False)
    else:
        sw.render_sweep(result, report.wide_console(120))


@app.command("calibrate")
def calibrate_cmd(
    inputs: List[str] = typer.Argument(
        ..., help="Measurement files (FILE or FILE#key.path), or one recipe YAML with datasets."
    ),
    out: Path = typer.Option(..., "--out", help="Profile YAML to write."),
    base: Optional[Path] = typer.Option(
        None, "--base", help="Profile, recipe or scenario giving the deployment (engine, speculative) and start values."
    ),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Change the --base profile or scenario first: dotted.key=value (repeatable), e.g. "
                            "step_time.hardware=mi300x to refit some terms of a profile on other hardware.",
    ),
    name: Optional[str] = typer.Option(None, "--name", help="Profile name (default: the base's, or --out's stem)."),
    form: Optional[str] = typer.Option(
        None, "--form",
        help="Free terms, comma-separated; a=b ties a to free term b (default: by data). 'roofline': "
             "fit the roofline form's efficiencies (needs --hardware and --model).",
    ),
    hardware: Optional[str] = typer.Option(
        None, "--hardware", help="--form roofline: catalog hardware name, or a YAML file of one entry."
    ),
    model: Optional[str] = typer.Option(
        None, "--model", help="--form roofline: catalog model name, or a config.json file."
    ),
    combine: str = typer.Option("sum", "--combine", help="--form roofline: sum or max of compute and memory."),
    routing_skew: str = typer.Option(
        "0", "--routing-skew", help="--form roofline, MoE: routing skew in [0, 1), or 'fit' (grid)."
    ),
    prior_sd: float = typer.Option(
        1.0, "--prior-sd", help="--form roofline: prior sd of each efficiency around 1."
    ),
    efficiency_floor: Optional[float] = typer.Option(
        None, "--efficiency-floor",
        help="--form roofline: lower bound of each efficiency (default: 1 on datasheet hardware, "
             "none on measured rates; 0: the unbounded fit).",
    ),
    records: Optional[List[Path]] = typer.Option(
        None, "--records",
        help="--form roofline: client request records of the logged run (JSONL, .gz ok; repeatable): "
             "the attended context of the steps. Else --input-len/--output-len (means).",
    ),
    fix: Optional[List[str]] = typer.Option(None, "--fix", help="Fixed term value TERM=SECONDS (repeatable)."),
    host_overhead: Optional[float] = typer.Option(
        None, "--host-overhead", help="Host seconds per step between forwards (not in iteration logs)."
    ),
    input_len: Optional[int] = typer.Option(None, "--input-len", help="Prompt tokens, where the data lacks them."),
    output_len: Optional[int] = typer.Option(None, "--output-len", help="Output tokens, where the data lacks them."),
    requests_per_client: Optional[int] = REQUESTS_PER_CLIENT_OPTION,
    num_speculative_tokens: int = typer.Option(
        0, "--num-speculative-tokens", help="k of the logged run (iteration logs: generation tokens include drafts)."
    ),
    bootstrap: Optional[int] = typer.Option(None, "--bootstrap", help="Bootstrap resamples (0: no intervals)."),
    warn_above: Optional[float] = typer.Option(
        None, "--warn-above", help="Warn where |relative error| exceeds this fraction (default 0.1)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the fit report as one JSON object."),
    residual_plot: Optional[Path] = typer.Option(None, "--residual-plot", help="Write fitted vs measured (PNG/SVG/PDF)."),
    noise: str = typer.Option(
        "empirical", "--noise",
        help="Step samples: fit step_time.noise from the residual ratios (empirical quantiles, or "
             "lognormal), or none (not written).",
    ),
    rows: Optional[List[str]] = typer.Option(
        None, "--rows", metavar="LABEL",
        help="Benchmark results: fit only the row with this label (repeatable), e.g. 'no-spec c=4'; "
             "the others are left out (held out, to score the fit on).",
    ),
    leave_one_out: bool = typer.Option(
        False, "--leave-one-out",
        help="Benchmark results: also predict each row from the same fit on all the other rows, "
             "and name the rows the others cannot predict.",
    ),
    column: Optional[List[str]] = COLUMN_OPTION,
    where: Optional[List[str]] = WHERE_OPTION,
    gpus: Optional[int] = GPUS_OPTION,
    fit_metrics: Optional[str] = typer.Option(
        None, "--fit-metrics",
        help="Benchmark results: the figures to fit, comma-separated (e.g. output_throughput,tpot_mean; "
             "default: every one measured).",
    ),
) -> None:
    """Fit a profile (step-time coefficients) to step samples or benchmark results."""
    import shlex

    from simcap import calibrate as cal

    try:
        if residual_plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(residual_plot, "--residual-plot")
        fixed = cal.parse_fix(fix or [])
        recipe, inputs = cal.recipe_for(inputs, base, name=name, default_name=out.stem, overrides=set_ or ())
        workload = table_workload(input_len, output_len, requests_per_client)
        family = cal.noise_family(noise)
        roofline = None
        if form == "roofline":
            from simcap.calibrate.fit_roofline import roofline_options

            roofline = roofline_options(hardware, model, combine=combine, routing_skew=routing_skew,
                                        prior_sd=prior_sd, efficiency_floor=efficiency_floor,
                                        records=records)
        elif hardware or model or records:
            raise cal.CalibrationError("--hardware, --model, --records: only with --form roofline")
        elif combine != "sum" or routing_skew != "0" or prior_sd != 1.0 or efficiency_floor is not None:
            # (a roofline recipe carries its own combine, routing skew, prior and floor)
            raise cal.CalibrationError("--combine, --routing-skew, --prior-sd, --efficiency-floor: only "
                                       "with --form roofline (a roofline recipe sets them in its "
                                       "step_time and prior)")
        startup.end()  # what follows reads the measurements and fits them
        options = dict(form=form, fix=fixed, host_overhead=host_overhead, workload=workload,
                       num_speculative_tokens=num_speculative_tokens, warn_above=warn_above,
                       noise=family, roofline=roofline, table=table_reading(column, where, gpus),
                       fit_metrics=fit_metrics.split(",") if fit_metrics is not None else None)
        fit = cal.calibrate(inputs, recipe, bootstrap=bootstrap, rows=rows, **options)
        loo = None
        if leave_one_out:
            from simcap.calibrate.leave_one_out import of_calibration

            loo = of_calibration(inputs, recipe, rows=rows, **options)
        command = "simcap calibrate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        cal.write_profile(cal.profile_dict(fit, recipe, command=command), out)
        if residual_plot is not None:
            cal.residual_plot(fit, residual_plot)
    except SimcapError as exc:
        fail(str(exc))
    above = warn_above if warn_above is not None else recipe.warn_above
    if json_out:
        typer.echo(report.to_json({**fit.to_dict(), "profile": str(out),
                                   **({"leave_one_out": loo} if loo is not None else {})}))
    else:
        cal.render_fit(fit, report.wide_console(110))
        if loo is not None:
            report.wide_console(110).print(report.leave_one_out_table(loo))
        typer.echo(f"profile: {out}")
        if residual_plot is not None:
            typer.echo(f"figure: {residual_plot}")
    for line in fit.warnings:
        typer.echo(line, err=True)
    if loo is not None:
        from simcap.calibrate.leave_one_out import disagreeing

        for label, why in dict.fromkeys((r["point"], r["unfitted"]) for r in loo if r.get("unfitted")):
            typer.echo(f"note: {label}: not predicted: the other rows cannot be fitted alone ({why})", err=True)
        for label in disagreeing(loo, above):
            typer.echo(f"WARNING: {label}: the fit on the other rows misses it by more than "
                       f"{above:.0%}; it disagrees with them (a one-run outlier, or a load the form "
                       "cannot reach from the rest)", err=True)


from simcap.cli.accuracy import accuracy  # noqa: E402
from simcap.cli.live import live_app  # noqa: E402  (the `simcap live` sub-commands)
from simcap.cli.measure_next import measure_next  # noqa: E402
from simcap.cli.score import score  # noqa: E402
from simcap.cli.serve import serve  # noqa: E402
from simcap.cli.transfer import transfer  # noqa: E402

app.command("accuracy")(accuracy)
app.command("measure-next")(measure_next)
app.command("score")(score)
app.command("serve")(serve)
app.command("transfer")(transfer)
app.add_typer(live_app, name="live")


def _print_version() -> None:
    from simcap.config.scenario import DEFAULT_VLLM_VERSION
    from simcap.runtime import compiled

    typer.echo(f"simcap {__version__} (models vLLM {DEFAULT_VLLM_VERSION} V1 by default)")
    typer.echo(compiled.summary())


@app.command()
def version() -> None:
    """Print simcap's version, the vLLM version modelled by default, and whether the engine's
    modules run compiled (same results either way)."""
    _print_version()


def _version_option(value: bool) -> None:
    if value:
        _print_version()
        raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_version_option,
                                      help="Print the version and how the engine runs, and exit."),
) -> None:
    pass


def main() -> None:  # pragma: no cover - entry point for python -m simcap
    app(prog_name="simcap")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
