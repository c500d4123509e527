"""``simcap serve``: a scenario's simulated deployment behind vLLM's HTTP API."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from simcap.cli.common import SET_OPTION, load_command_scenario, user_errors, with_replicas


def serve(
    scenario: Path = typer.Argument(..., help="Scenario YAML file: the engine (or deployment) to serve."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on."),
    replicas: Optional[int] = typer.Option(
        None, "--replicas", min=1, help="Serve a fleet of N replicas behind the scenario's router (or --router)."
    ),
    router: Optional[str] = typer.Option(None, "--router", help="With --replicas: the fleet's router."),
    speed: float = typer.Option(
        1.0, "--speed", help="Simulated seconds per wall-clock second (2: the engine runs twice as fast as real)."
    ),
    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer",
        help="The served model's folder (or tokenizer.json): prompts counted by its tokenizer and chat template "
             "(default: 1 token per 4 UTF-8 bytes).",
    ),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name", help="The model name clients send (default: the scenario's name)."
    ),
    records: Optional[Path] = typer.Option(
        None, "--records", help="Write one JSON line per finished request (simulated clock) to FILE."
    ),
    trace: Optional[Path] = typer.Option(
        None, "--trace",
        help="Write the arrivals as a Mooncake trace to FILE, for `simcap simulate` to replay "
             "(the overrides: simcap/serve/README.md, or simcap.serve.engine.replay_overrides).",
    ),
    set_: Optional[List[str]] = SET_OPTION,
) -> None:
    """Serve the scenario's simulated engine with vLLM's OpenAI-compatible API, /metrics included,
    in real time (or --speed times as fast), until interrupted."""
    from simcap.serve.run import lag_line, serve as run_serve

    with user_errors():
        loaded = with_replicas(load_command_scenario(scenario, set_), replicas, router)
        status = run_serve(
            loaded, host=host, port=port, speed=speed, tokenizer=tokenizer,
            served_model_name=served_model_name, records=records, trace=trace,
            say=lambda line: typer.echo(line, err=True),
        )
    typer.echo(lag_line(status), err=True)
    if status["failure"]:
        typer.echo(f"simulation error: {status['failure']}", err=True)
        raise typer.Exit(1)
