"""``simcap live``: run a scenario's workload against a real vLLM server, validate against it,
calibrate a profile from it, or measure its capacity.

Thin: parse, call :mod:`simcap.live.client` / :mod:`simcap.live.validate` /
:mod:`simcap.live.calibration` / :mod:`simcap.live.rate_search`, render. Mounted by ``simcap.cli`` as
``app.add_typer(live_app, name="live")``. An API key comes from ``--api-key``, else the
variable ``--api-key-env`` names, else ``$SIMCAP_API_KEY``; it is sent as a Bearer header
and never printed or written (a profile's ``fitted_with`` masks it).
"""

from pathlib import Path
from typing import List, Optional

import typer

from simcap.cli.common import JSON_OPTION, SET_OPTION, fail, load_command_scenario
from simcap.errors import SimcapError, SimulationError
from simcap.metrics import report
from simcap.runtime import startup

live_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Drive a real vLLM server with a scenario's workload; compare it with the simulation; calibrate from it; measure its capacity.",
)

_KEY_HELP = "API key (sent as a Bearer header; visible in the process list: prefer --api-key-env)."
_KEY_ENV_HELP = "Read the API key from this environment variable (default: SIMCAP_API_KEY when set)."
_URLS_HELP = (
    "vLLM server, e.g. http://127.0.0.1:8000; repeat it once per deployment replica to route "
    "over several servers with the scenario's deployment.router."
)
_TIMEOUT_HELP = "Seconds a request may take (send to done) before it is cut and recorded as failed."


def _api_key(api_key: Optional[str], api_key_env: Optional[str]) -> Optional[str]:
    """The key from --api-key, else the variable --api-key-env names, else $SIMCAP_API_KEY."""
    import os

    from simcap.live.client import API_KEY_ENV

    if api_key:
        return api_key
    if api_key_env:
        value = os.environ.get(api_key_env)
        if not value:
            fail(f"--api-key-env: environment variable {api_key_env} is not set")
        return value
    return os.environ.get(API_KEY_ENV) or None


def _urls(base_urls: List[str]):
    """One --base-url as itself, several as the list a fleet run takes."""
    return base_urls[0] if len(base_urls) == 1 else list(base_urls)



def _command_line(ctx: typer.Context, prefix: str, secret: frozenset[str] = frozenset()) -> str:
    """The running command as given (options that differ from their defaults; secrets masked)."""
    import shlex

    parts = [prefix]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value == param.default or getattr(param, "param_type_name", "") != "option":
            continue
        flag = param.opts[0]
        if getattr(param, "is_flag", False):
            parts.append(flag if value else (param.secondary_opts or [flag])[0])
            continue
        parts += [flag, "***" if param.name in secret else shlex.quote(str(value))]
    return " ".join(parts)


@live_app.command("run")
def run_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file (its workload is sent)."),
    base_url: List[str] = typer.Option(..., "--base-url", metavar="URL", help=_URLS_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the server's first)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions (exact token prompts) or chat."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSONL file: one record per request, written as each completes."),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_KEY_HELP),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help=_KEY_ENV_HELP),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help=_TIMEOUT_HELP),
) -> None:
    """Send the scenario's workload to a live server and summarise what it measured."""
    from simcap.live.client import ENDPOINTS, run_live

    if endpoint not in ENDPOINTS:
        fail(f"--endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
    key = _api_key(api_key, api_key_env)
    try:
        sc = load_command_scenario(scenario, set_, simulated=False)
        run = run_live(sc, _urls(base_url), model, endpoint=endpoint, out_path=out, progress=progress and not json_out,
                       api_key=key, request_timeout_s=request_timeout)  # type: ignore[arg-type]
    except SimcapError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{getattr(exc, 'filename', None) or out}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        where = f"; finished requests are in {out}" if out else ""
        typer.echo(f"interrupted{where}", err=True)
        raise typer.Exit(130)
    data = run.to_dict(slo=dict(sc.slo) or None)
    if json_out:
        typer.echo(report.to_json(data))
        return
    console = report.wide_console()
    report.render_summary(data, console)
    live, check = data["live"], data["cross_check"]
    unit = live["rate_unit"]
    if live["requested_rate"] is not None:
        lag = live["max_send_lag_s"]
        console.print(
            f"arrival rate: requested {live['requested_rate']:.3f} {unit} (this draw "
            f"{live['scheduled_rate'] or 0:.3f}), achieved {live['achieved_rate'] or 0:.3f} {unit}; "
            f"worst send lag {(lag or 0) * 1e3:.1f} ms"
        )
    elif live["achieved_rate"] is not None:
        console.print(f"closed loop: achieved arrival rate {live['achieved_rate']:.3f} {unit}")
    if live["sessions"] is not None:
        sess, server = live["sessions"], data["server"]
        rate = server.get("prefix_cache_hit_rate")
        console.print(
            f"sessions: {sess['sessions']:,} started, {sess['ended_by_error']:,} ended at an errored turn; "
            f"server prefix-cache hit rate {'n/a' if rate is None else f'{rate * 100:.1f}%'}"
        )
    if "fleet" in data:
        report.render_live_fleet(data["fleet"], console)
    else:
        console.print(_cross_check_line(check))
    spec = _spec_line(data["server"])
    if spec:
        console.print(spec)
    for note in live["notes"]:
        console.print(f"note: {note}", style="dim")
    for err in live["errors"]:
        console.print(f"error seen: {err}", style="red")
    if out:
        console.print(f"records: {out}", style="dim")


def _cross_check_line(check: dict) -> str:
    def rel(key: str) -> str:
        v = check.get(key)
        return "n/a" if v is None else f"{v * 100:+.2f}%"

    return (
        f"client vs server counters: prompt tokens {check['client_prompt_tokens']:,} vs "
        f"{_num(check['server_prompt_tokens'])} ({rel('prompt_tokens_rel_diff')}), generation tokens "
        f"{check['client_generation_tokens']:,} vs {_num(check['server_generation_tokens'])} "
        f"({rel('generation_tokens_rel_diff')}), requests {check['client_requests_succeeded']} vs "
        f"{_num(check['server_request_success'])} ({rel('requests_rel_diff')})"
    )


def _spec_line(server: dict) -> str | None:
    """Speculative decoding as the server counted it, or None when it drafted nothing."""
    drafts = server.get("spec_decode_num_drafts")
    if not drafts:
        return None
    acc = server.get("spec_decode_mean_acceptance_length")
    rates = server.get("spec_decode_acceptance_rates") or []
    per_pos = ", ".join(f"{r:.2f}" for r in rates)
    return (
        f"speculative decoding (server counters): mean acceptance length {acc:.3f} over {int(drafts):,} "
        f"drafts, {int(server.get('spec_decode_num_draft_tokens') or 0):,} draft tokens, "
        f"{int(server.get('spec_decode_num_accepted_tokens') or 0):,} accepted"
        + (f"; per-position acceptance {per_pos}" if per_pos else "")
    )


def _num(v) -> str:
    return "n/a" if v is None else f"{int(v):,}"


@live_app.command("validate")
def validate_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file (workload, engine and step-time model)."),
    base_url: Optional[List[str]] = typer.Option(
        None, "--base-url", metavar="URL", help=_URLS_HELP + " Or --launch instead, for one server."
    ),
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the server's first)."),
    repeats: int = typer.Option(
        3, "--repeats", min=1, help="Live runs (each simulated on its own trace); per server instance with --launch."
    ),
    launch: Optional[Path] = typer.Option(
        None, "--launch", help="Start the server from this launch config (SERVER.yaml) instead of --base-url."
    ),
    restarts: int = typer.Option(
        0, "--restarts", help="With --launch: restart the server this many times, --repeats runs on each "
                              "instance, so the band holds instance-to-instance variance.",
    ),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions or chat."),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
    out_prefix: Optional[str] = typer.Option(None, "--out-prefix", help="Write live run i's records to PREFIXi.jsonl."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Send a few unmeasured requests first."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Write ECDFs of live vs simulated TTFT and ITL (PNG/SVG/PDF)."
    ),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_KEY_HELP),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help=_KEY_ENV_HELP),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help=_TIMEOUT_HELP),
    replay: Optional[str] = typer.Option(
        None, "--replay",
        help="How each live run is simulated: closed (a closed-loop workload: its clients, each "
             "request sent the measured gap after the client's previous response; the default "
             "there), times (each request at its live send time; the default for open loop) or "
             "sessions (a session workload, the default there: its sessions, each turn sent the "
             "measured gap after the previous answer).",
    ),
    record: Optional[Path] = typer.Option(
        None, "--record", metavar="DIR",
        help="Keep every run in an accuracy-corpus case folder (calibration/corpus/NAME): a new case first "
             "runs the calibration workload on the first server instance (its fit part); each run is a "
             "held-out run of --point. A later command adds instances or points to the same case.",
    ),
    point: Optional[str] = typer.Option(None, "--point", help="--record: the held-out point's name (default: the scenario file's stem)."),
    log: Optional[List[Path]] = typer.Option(
        None, "--log", help="--record with --base-url: each server's log file (it runs with "
                            "--enable-logging-iteration-details), one per --base-url.",
    ),
    calibrate_up_to: Optional[int] = typer.Option(
        None, "--calibrate-up-to", min=1, help="--record, new case: the calibration workload's most clients."
    ),
    roofline_hardware: Optional[str] = typer.Option(
        None, "--roofline-hardware", help="--record: the case's roofline form runs on this hardware (a catalog "
                                          "name, or a YAML file holding one hardware entry).",
    ),
    roofline_model: Optional[str] = typer.Option(None, "--roofline-model", help="--record: the roofline form's model shape (catalog name)."),
    description: Optional[str] = typer.Option(None, "--description", help="--record, new case: what the case holds."),
    mechanism: Optional[List[str]] = typer.Option(None, "--mechanism", help="--record, new case: a mechanism the case exercises (repeatable)."),
    prompt_period: Optional[int] = typer.Option(
        None, "--prompt-period", min=1, help="Prompts repeat every this many tokens (ngram drafts find matches)."
    ),
    rate_of_saturation: Optional[float] = typer.Option(
        None, "--rate-of-saturation", metavar="F",
        help="An open-loop workload runs at F x the saturation rate measured on each server instance "
             "after its warm-up (a closed loop of 2 x max_num_seqs clients on the same request mix), "
             "replacing workload.arrival.rate: a point near saturation stays near it when the server's "
             "speed moves.",
    ),
) -> None:
    """Run the workload live REPEATS times and compare each run with the simulation of its trace."""
    from simcap.live.client import ENDPOINTS
    from simcap.live.plot import plot_validation_ecdfs
    from simcap.live.validate import (
        REPLAYS, fleet_table, ks_line, replay_line, sessions_table, speed_line, spread_line, validate,
        validation_table,
    )
    from simcap.studies.plots import check_figure_path

    if endpoint not in ENDPOINTS:
        fail(f"--endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
    if replay is not None and replay not in REPLAYS:
        fail(f"--replay: must be one of {', '.join(REPLAYS)} (got {replay!r})")
    if plot is not None:
        try:
            check_figure_path(plot, "--plot")
        except SimcapError as exc:
            fail(str(exc))
    if launch is not None and base_url and len(base_url) > 1:
        fail(f"--launch: starts one server; a fleet's {len(base_url)} servers are given by --base-url alone")
    if (not base_url) == (launch is None):
        fail("--base-url: give either --base-url (a running server) or --launch SERVER.yaml, one of them")
    if restarts < 0:
        fail(f"--restarts: must be >= 0 (got {restarts})")
    if restarts and launch is None:
        fail("--restarts: restarting the server between repeats needs --launch (a server simcap starts)")
    from simcap.live.launch import launch_server, load_server_config, startup_failure_line
    from simcap.live.server import VllmServerError

    if (roofline_hardware is None) != (roofline_model is None):
        fail("--roofline-hardware and --roofline-model: give both (or neither)")
    if record is None:
        for name, value in (("--point", point), ("--log", log), ("--calibrate-up-to", calibrate_up_to),
                            ("--roofline-hardware", roofline_hardware), ("--description", description),
                            ("--mechanism", mechanism)):
            if value:
                fail(f"{name}: goes with --record DIR")
    key = _api_key(api_key, api_key_env)
    try:
        sc = load_command_scenario(scenario, set_)
        starter = config = None
        if launch is not None:
            config, base_dir = load_server_config(launch)
            from simcap.live.launch import engine_mismatches

            differ = engine_mismatches(config, sc)
            if differ:
                fail(f"--launch {launch}: launch config contradicts the scenario: " + "; ".join(differ))
            model = model or config.served_model_name
            starter = lambda: launch_server(config, base_dir, speculative=sc.speculative is not None)  # noqa: E731
        recorder = None
        if record is not None:
            recorder = _recorder(record, sc, point or scenario.stem, replay, model, config, description,
                                 mechanism or [], roofline_hardware, roofline_model, calibrate_up_to, key,
                                 prompt_period, rate_of_saturation, fleet=len(base_url or []) > 1)
        result = validate(
            sc, _urls(base_url or []), model, repeats, endpoint=endpoint, progress=not json_out,
            warmup=warmup, out_prefix=out_prefix, api_key=key, request_timeout_s=request_timeout,
            replay=replay, launch=starter, restarts=restarts, logs=log or [],
            on_instance=recorder and recorder.on_instance, on_run=recorder and recorder.on_run,
            prompt_period=prompt_period, rate_of_saturation=rate_of_saturation,
        )  # fmt: skip
        if plot is not None:
            plot_validation_ecdfs(result, plot)
    except VllmServerError as exc:
        fail(f"--launch {launch}: {startup_failure_line(exc)}")
    except SimcapError as exc:
        fail(str(exc))
    except SimulationError as exc:
        typer.echo(f"simulation error: {exc}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130)
    data = result.to_dict()
    if plot is not None:
        data["plot"] = str(plot)
    if json_out:
        typer.echo(report.to_json(data))
        return
    console = report.wide_console(150)
    console.print(replay_line(data))
    console.print(spread_line(data))
    console.print(validation_table(data))
    line = speed_line(data)
    if line is not None:
        console.print(line)
    table = sessions_table(data)
    if table is not None:
        console.print(table)
    console.print(ks_line(data))
    table = fleet_table(data)
    if table is not None:
        console.print(table)
    for note in data["notes"]:
        console.print(f"note: {note}", style="dim")
    if plot is not None:
        console.print(f"figure: {plot}")
    if record is not None:
        console.print(f"recorded: {len(result.repeats)} run(s) of point {point or scenario.stem} in {record}; "
                      f"replay: simcap accuracy {record.parent} --case {record.name}")


def _recorder(folder: Path, sc, point: str, replay: Optional[str], model: Optional[str], launch,
              description: Optional[str], mechanisms: List[str], hardware: Optional[str], shape: Optional[str],
              calibrate_up_to: Optional[int], api_key: Optional[str], prompt_period: Optional[int],
              rate_of_saturation: Optional[float], fleet: bool):
    """The case recorder of ``--record`` (see :class:`simcap.accuracy.corpus.CaseRecorder`)."""
    from simcap.accuracy.corpus import CaseRecorder, roofline_ref
    from simcap.live.validate import default_replay

    return CaseRecorder(folder, sc, point, replay or default_replay(sc, fleet), model=model,
                        description=description, mechanisms=mechanisms,
                        server={} if launch is None else {"launch": launch.model_dump(mode="json")},
                        roofline=None if hardware is None else roofline_ref(hardware, shape),
                        calibrate_up_to=calibrate_up_to, api_key=api_key, prompt_period=prompt_period,
                        rate_of_saturation=rate_of_saturation)


# The roofline form's options, shared by live calibrate and live crossover.
_ROOFLINE_MODEL_OPTION = typer.Option(
    None, "--roofline-model", help="--form roofline: catalog model name or config.json of the served model."
)
_COMBINE_OPTION = typer.Option("sum", "--combine", help="--form roofline: sum or max of compute and memory.")


def _roofline_form(form: str, hardware: Optional[str], model: Optional[str], combine: str,
                   routing_skew: str = "0", prior_sd: float = 1.0) -> Optional[dict]:
    """``--form``: None for linear, the roofline options for roofline; one-line errors."""
    if form == "linear":
        return None
    from simcap.live.client import LiveError

    if form != "roofline":
        raise LiveError(f"--form: linear or roofline (got {form!r})")
    if not hardware or not model:
        raise LiveError("--form roofline: give --hardware and --roofline-model (catalog names or files)")
    from simcap.calibrate.fit_roofline import roofline_options

    return roofline_options(hardware, model, combine=combine, routing_skew=routing_skew, prior_sd=prior_sd)


@live_app.command("calibrate")
def calibrate_cmd(
    ctx: typer.Context,
    base_url: str = typer.Option(..., "--base-url", help="vLLM server, e.g. http://127.0.0.1:8000"),
    out: Path = typer.Option(..., "--out", help="Profile YAML to write (its data file is written beside it)."),
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the server's first)."),
    log: Optional[Path] = typer.Option(
        None, "--log",
        help="The server's log file (run with --enable-logging-iteration-details): fit its per-step "
             "lines. Without it: black-box probes, which overstate prefill cost.",
    ),
    max_num_seqs: int = typer.Option(..., "--max-num-seqs", min=1, help="The server's --max-num-seqs."),
    max_num_batched_tokens: int = typer.Option(
        ..., "--max-num-batched-tokens", min=1, help="The server's --max-num-batched-tokens."
    ),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", min=2, help="The server's --max-model-len (default: from /v1/models)."
    ),
    requests: int = typer.Option(
        40, "--requests", min=8,
        help="Requests in the calibration mix's closed loops of 1 to max_num_seqs clients (log source); "
             "its cached- and long-context phases add a tenth and a twentieth more.",
    ),
    speculative_method: Optional[str] = typer.Option(
        None, "--speculative-method", help="ngram, eagle or eagle3, when the server drafts and does not say."
    ),
    name: Optional[str] = typer.Option(None, "--name", help="Profile name (default: --out's stem)."),
    hardware: Optional[str] = typer.Option(
        None, "--hardware",
        help="Hardware description for the profile; with --form roofline a catalog hardware name "
             "(or a YAML file of one entry).",
    ),
    form: str = typer.Option(
        "linear", "--form",
        help="Step-time form fitted from the log: linear (two-stage fit) or roofline (efficiencies "
             "on --hardware and --roofline-model).",
    ),
    roofline_model: Optional[str] = _ROOFLINE_MODEL_OPTION,
    combine: str = _COMBINE_OPTION,
    routing_skew: str = typer.Option("0", "--routing-skew", help="--form roofline, MoE: skew in [0, 1) or 'fit'."),
    prior_sd: float = typer.Option(1.0, "--prior-sd", help="--form roofline: prior sd of each efficiency around 1."),
    seed: int = typer.Option(0, "--seed", help="Seed of the calibration prompts and the bootstrap."),
    bootstrap: int = typer.Option(200, "--bootstrap", min=0, help="Bootstrap resamples for the intervals."),
    json_out: bool = JSON_OPTION,
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_KEY_HELP),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help=_KEY_ENV_HELP),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help=_TIMEOUT_HELP),
    noise: str = typer.Option(
        "empirical", "--noise",
        help="Log source: fit step_time.noise from the logged steps' residual ratios (empirical "
             "quantiles, or lognormal), or none (not written).",
    ),
    record: Optional[Path] = typer.Option(
        None, "--record", metavar="DIR",
        help="Log source: keep each phase's run with its log lines in DIR (phase<i>.run.json.gz), so "
             "the fit can be replayed (simcap.live.recording.load_run).",
    ),
) -> None:
    """Drive a calibration workload against a live server and fit a profile from it."""
    from simcap.calibrate import noise_family, render_fit
    from simcap.live.calibration import calibrate_live
    from simcap.metrics.report import describe_line

    key = _api_key(api_key, api_key_env)
    command = _command_line(ctx, "simcap live calibrate", secret=frozenset({"api_key"}))
    say = None if json_out else (lambda msg: typer.echo(f"calibrate: {msg}", err=True))
    try:
        roofline = _roofline_form(form, hardware, roofline_model, combine, routing_skew, prior_sd)
        startup.end()  # the run and the fit: collections as usual
        result = calibrate_live(
            base_url, model, out, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, log_path=log, num_requests=requests,
            speculative_method=speculative_method, api_key=key, request_timeout_s=request_timeout,
            name=name, hardware=hardware, seed=seed, bootstrap=bootstrap, command=command, progress=say,
            noise=noise_family(noise), roofline=roofline, record=record,
        )  # fmt: skip
    except SimcapError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        typer.echo("interrupted; no profile written", err=True)
        raise typer.Exit(130)
    data = result.to_dict()
    if json_out:
        typer.echo(report.to_json(data))
    else:
        console = report.wide_console(110)
        console.print(f"fitted from: {result.source} ({result.data_path}); {result.wall_s:.0f} s")
        render_fit(result.fit, console)
        host = result.host_overhead
        if host and host.get("step_period_s") is not None:
            console.print(
                f"host overhead {host['host_overhead_s'] * 1e3:.2f} ms/step: client decode step period "
                f"{host['step_period_s'] * 1e3:.2f} ms (mean ITL {host['client_mean_itl_s'] * 1e3:.2f} ms) "
                f"- logged forward {host['logged_elapsed_s'] * 1e3:.2f} ms"
            )
        console.print(describe_line(result.profile.get("frontend")))
        eng = result.engine
        console.print("engine: " + ", ".join(f"{k}={v}" for k, v in eng.items()))
        if result.speculative:
            console.print("speculative: " + ", ".join(f"{k}={v}" for k, v in result.speculative.items()))
        for note in result.notes:
            console.print(f"note: {note}", style="dim")
        console.print(f"profile: {out}")
    for line in result.fit.warnings:
        typer.echo(line, err=True)


@live_app.command("capacity")
def capacity_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file (its workload, at each rate)."),
    base_url: str = typer.Option(..., "--base-url", help="vLLM server, e.g. http://127.0.0.1:8000"),
    slo: Optional[List[str]] = typer.Option(
        None, "--slo", help="SLO target METRIC_STAT=SECONDS, e.g. ttft_p95=2.0 (repeatable; default the scenario's slo)."
    ),
    rates: Optional[str] = typer.Option(None, "--rates", help="Requested arrival rates in req/s: R1,R2,... or START:STOP:N."),
    auto: bool = typer.Option(False, "--auto", help="Bracket and bisect the safe rate (default without --rates)."),
    duration: float = typer.Option(60.0, "--duration", help="Seconds of arrivals per run."),
    replicates: int = typer.Option(2, "--replicates", help="Runs per rate; replicate r uses seed + r."),
    start_rate: Optional[float] = typer.Option(None, "--start-rate", help="--auto: first rate (default the predicted safe rate)."),
    rel_tol: float = typer.Option(0.1, "--rel-tol", help="--auto: stop when the bracket is this narrow (relative)."),
    max_points: int = typer.Option(8, "--max-points", help="--auto: at most this many rates."),
    max_probes: int = typer.Option(
        2, "--max-probes", help="Rates above the highest tried, one run each, while none saturated (0: none)."
    ),
    predict: Optional[Path] = typer.Option(
        None, "--predict", help="Profile YAML whose step-time model predicts (default the scenario's)."
    ),
    adopt_server_config: bool = typer.Option(
        False, "--adopt-server-config",
        help="Where the server's engine flags differ from the scenario's, predict with the server's instead of stopping.",
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Directory for every run's records and the finished runs (default SCENARIO_STEM.live-capacity)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue the search in --out: keep its finished runs."),
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the server's first)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions or chat."),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write the measured SLO-vs-rate figure to FILE (PNG)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_KEY_HELP),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help=_KEY_ENV_HELP),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help=_TIMEOUT_HELP),
) -> None:
    """Measure the safe rate and saturation rate on a live server, with simcap's prediction beside them."""
    from simcap.live.client import ENDPOINTS
    from simcap.live.rate_search import live_capacity, render_live_capacity
    from simcap.studies.capacity import parse_rates, parse_slo

    if endpoint not in ENDPOINTS:
        fail(f"--endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
    if auto and rates is not None:
        fail("--auto and --rates: give one (--rates tests those rates, --auto searches)")
    key = _api_key(api_key, api_key_env)
    out_dir = out or Path(f"{scenario.stem}.live-capacity")
    say = None if json_out else (lambda msg: typer.echo(f"live capacity: {msg}", err=True))
    try:
        if plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(plot, "--plot")
        sc = load_command_scenario(scenario, set_, simulated=predict is None)
        predicted = load_command_scenario(scenario, set_, profile=predict) if predict is not None else None
        result = live_capacity(
            sc, base_url, out_dir, slo=parse_slo(slo) if slo else None,
            rates=parse_rates(rates) if rates is not None else None, duration_s=duration,
            replicates=replicates, start_rate=start_rate, rel_tol=rel_tol, max_points=max_points,
            max_probes=max_probes, predict_scenario=predicted, model=model, endpoint=endpoint,
            api_key=key, request_timeout_s=request_timeout, adopt_server_config=adopt_server_config,
            resume=resume, say=say,
        )  # fmt: skip
        if plot is not None:
            from simcap.studies.plots import plot_capacity

            plot_capacity(result.measured, plot, title=f"{sc.name}: measured on {result.server['model']}")
    except SimcapError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{getattr(exc, 'filename', None) or out_dir}: {exc.strerror or exc}")
    except SimulationError as exc:
        typer.echo(f"simulation error: {exc}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; every finished run is in {out_dir} (--resume to continue)", err=True)
        raise typer.Exit(130)
    data = result.to_dict()
    if plot is not None:
        data["plot"] = str(plot)
    if json_out:
        typer.echo(report.to_json(data))
        return
    render_live_capacity(result, report.wide_console(130))
    if plot is not None:
        typer.echo(f"figure: {plot}")


@live_app.command("crossover")
def crossover_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file with a speculative section."),
    concurrency: str = typer.Option(..., "--concurrency", help="Closed-loop clients, comma-separated, e.g. 1,4,8."),
    launch: Path = typer.Option(
        ..., "--launch", help="Launch config SERVER.yaml (model, engine flags, speculative config): "
                              "each arm's server is started from it and stopped after.",
    ),
    calibrate_up_to: Optional[int] = typer.Option(
        None, "--calibrate-up-to",
        help="The profile behind the prediction is calibrated with at most this many clients "
             "(default: the lowest concurrency; 2 when that is 1 and 2 is below the highest).",
    ),
    calibration_requests: int = typer.Option(
        24, "--calibration-requests", min=8,
        help="Requests in the calibration mix's closed loops (its cached- and long-context phases add "
             "a tenth and a twentieth more)."
    ),
    requests_per_client: int = typer.Option(
        8, "--requests-per-client", min=1, help="Each point runs max(num_requests, this x clients) requests."
    ),
    prompt_period: int = typer.Option(
        16, "--prompt-period", min=0,
        help="Prompts repeat every this many tokens, so ngram's prompt lookup finds matches (0: random prompts).",
    ),
    out_dir: Optional[Path] = typer.Option(
        None, "--out-dir", help="Keep the profiles, the calibration runs, the servers' logs and every run's records here."
    ),
    form: str = typer.Option(
        "linear", "--form",
        help="Step-time form of both arms' profiles: linear (two-stage fit) or roofline (efficiencies on "
             "--hardware and --roofline-model).",
    ),
    hardware: Optional[str] = typer.Option(
        None, "--hardware", help="--form roofline: catalog hardware name (or a YAML file of one entry)."
    ),
    roofline_model: Optional[str] = _ROOFLINE_MODEL_OPTION,
    combine: str = _COMBINE_OPTION,
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
    request_timeout: float = typer.Option(600.0, "--request-timeout", help=_TIMEOUT_HELP),
) -> None:
    """Measure speculation on vs off at each concurrency on servers started from --launch, beside
    the crossover predicted from each arm's profile calibrated at the lowest concurrencies."""
    from simcap.live.crossover_arms import comparison_lines, live_crossover
    from simcap.live.launch import load_server_config, startup_failure_line
    from simcap.live.server import VllmServerError
    from simcap.studies.crossover import parse_load_list, render_crossover

    say = None if json_out else (lambda msg: typer.echo(f"live crossover: {msg}", err=True))
    try:
        loads = parse_load_list(concurrency, "--concurrency", integer=True)
        roofline = _roofline_form(form, hardware, roofline_model, combine)
        config, base_dir = load_server_config(launch)
        sc = load_command_scenario(scenario, set_)
        result = live_crossover(
            sc, config, loads, base_dir=base_dir, calibrate_up_to=calibrate_up_to,
            calibration_requests=calibration_requests, requests_per_client=requests_per_client,
            prompt_period=prompt_period or None, out_dir=out_dir, progress=say,
            request_timeout_s=request_timeout, roofline=roofline,
        )  # fmt: skip
    except VllmServerError as exc:
        fail(f"--launch {launch}: {startup_failure_line(exc)}")
    except SimcapError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        where = f"; finished runs' records are in {out_dir}" if out_dir else ""
        typer.echo(f"interrupted{where}", err=True)
        raise typer.Exit(130)
    data = result.to_dict()
    if json_out:
        typer.echo(report.to_json(data))
        return
    console = report.wide_console(130)
    console.print("measured (live servers from the launch config)", style="bold")
    render_crossover(result.measured, console)
    console.print("predicted (each arm's profile calibrated on its own server at the lowest concurrencies)", style="bold")
    render_crossover(result.predicted, console)
    for line in comparison_lines(data):
        console.print(line)
    for note in data["notes"]:
        console.print(f"note: {note}", style="dim")
    console.print(f"live crossover took {data['wall_s']:.0f} s", style="dim")
