"""The ``simcap`` command: parse, call the library, render. No logic of its own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from simcap import report
from simcap._version import __version__
from simcap.errors import SimcapError
from simcap.scenario import load_scenario
from simcap.simulator import SimulationError, simulate

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Discrete-event capacity simulator of the vLLM V1 serving engine.",
)


def _fail(message: str) -> None:
    """One line on stderr, exit code 2: the user's input was wrong."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command("simulate")
def simulate_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a scenario key: dotted.key=value (repeatable)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Simulate a scenario and print its latency, throughput and SLO summary."""
    try:
        result = simulate(load_scenario(scenario, set_ or []))
    except SimcapError as exc:
        _fail(str(exc))
    except SimulationError as exc:  # a state vLLM could not reach: report, don't hide
        typer.echo(f"simulation error: {exc}", err=True)
        raise typer.Exit(1)
    data = result.to_dict()
    if json_out:
        typer.echo(report.to_json(data))
    else:
        report.render_summary(data, Console(width=max(100, Console().width)))


@app.command("kv")
def kv_cmd(
    scenario: Path = typer.Argument(..., help="Scenario YAML file with an engine.memory section."),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a scenario key: dotted.key=value (repeatable)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Size the KV pool from card memory, model shape and flags, as vLLM does at start-up."""
    try:
        loaded = load_scenario(scenario, set_ or [], check=False)
    except SimcapError as exc:
        _fail(str(exc))
    plan = loaded.engine.kv_plan
    if plan is None:
        _fail("engine.memory: this scenario gives num_gpu_blocks, not a memory spec to plan from")
    if json_out:
        typer.echo(report.to_json(plan.to_dict()))
    else:
        report.render_kv_plan(plan.to_dict(), Console(width=max(100, Console().width)))


@app.command()
def version() -> None:
    """Print simcap's version and the vLLM version modelled by default."""
    from simcap.scenario import DEFAULT_VLLM_VERSION

    typer.echo(f"simcap {__version__} (models vLLM {DEFAULT_VLLM_VERSION} V1 by default)")


def main() -> None:  # pragma: no cover - entry point for python -m simcap
    app(prog_name="simcap")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
