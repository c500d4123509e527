"""``simcap live``: run a scenario's workload against a real vLLM server, or validate against it.

Thin: parse, call :mod:`simcap.live.client` / :mod:`simcap.live.validate`, render. Mounted by
``simcap.cli`` as ``app.add_typer(live_app, name="live")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from simcap import report
from simcap.errors import SimcapError
from simcap.scenario import load_scenario
from simcap.simulator import SimulationError

live_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Drive a real vLLM server with a scenario's workload; compare it with the simulation.",
)

_SET_HELP = "Override a scenario key: dotted.key=value (repeatable)."


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _console(width: int = 100) -> Console:
    return Console(width=max(width, Console().width))


@live_app.command("run")
def run_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file (its workload is sent)."),
    base_url: str = typer.Option(..., "--base-url", help="vLLM server, e.g. http://127.0.0.1:8000"),
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the server's first)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions (exact token prompts) or chat."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSONL file: one record per request, written as each completes."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help=_SET_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
) -> None:
    """Send the scenario's workload to a live server and summarise what it measured."""
    from simcap.live.client import ENDPOINTS, run_live

    if endpoint not in ENDPOINTS:
        _fail(f"--endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
    try:
        sc = load_scenario(scenario, set_ or [])
        run = run_live(sc, base_url, model, endpoint=endpoint, out_path=out, progress=progress and not json_out)  # type: ignore[arg-type]
    except SimcapError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{getattr(exc, 'filename', None) or out}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        where = f"; finished requests are in {out}" if out else ""
        typer.echo(f"interrupted{where}", err=True)
        raise typer.Exit(130)
    data = run.to_dict(slo=dict(sc.slo) or None)
    if json_out:
        typer.echo(report.to_json(data))
        return
    console = _console()
    report.render_summary(data, console)
    live, check = data["live"], data["cross_check"]
    if live["requested_rate"] is not None:
        lag = live["max_send_lag_s"]
        console.print(
            f"arrival rate: requested {live['requested_rate']:.3f} req/s (this draw "
            f"{live['scheduled_rate'] or 0:.3f}), achieved {live['achieved_rate'] or 0:.3f} req/s; "
            f"worst send lag {(lag or 0) * 1e3:.1f} ms"
        )
    elif live["achieved_rate"] is not None:
        console.print(f"closed loop: achieved arrival rate {live['achieved_rate']:.3f} req/s")
    console.print(_cross_check_line(check))
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


def _num(v) -> str:
    return "n/a" if v is None else f"{int(v):,}"


@live_app.command("validate")
def validate_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file (workload, engine and step-time model)."),
    base_url: str = typer.Option(..., "--base-url", help="vLLM server, e.g. http://127.0.0.1:8000"),
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the server's first)."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Live runs (each simulated on its own trace)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions or chat."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help=_SET_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    out_prefix: Optional[str] = typer.Option(None, "--out-prefix", help="Write live run i's records to PREFIXi.jsonl."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Send a few unmeasured requests first."),
) -> None:
    """Run the workload live REPEATS times and compare each run with the simulation of its trace."""
    from simcap.live.client import ENDPOINTS
    from simcap.live.validate import ks_line, validate, validation_table

    if endpoint not in ENDPOINTS:
        _fail(f"--endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
    try:
        sc = load_scenario(scenario, set_ or [])
        result = validate(
            sc, base_url, model, repeats, endpoint=endpoint, progress=not json_out,
            warmup=warmup, out_prefix=out_prefix,
        )  # fmt: skip
    except SimcapError as exc:
        _fail(str(exc))
    except SimulationError as exc:
        typer.echo(f"simulation error: {exc}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130)
    data = result.to_dict()
    if json_out:
        typer.echo(report.to_json(data))
        return
    console = _console(150)
    console.print(validation_table(data))
    console.print(ks_line(data))
    for note in data["notes"]:
        console.print(f"note: {note}", style="dim")
