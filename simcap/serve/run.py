""":func:`serve`: a scenario's simulated deployment behind vLLM's HTTP API, until interrupted."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from simcap.config.scenario import Scenario
from simcap.errors import ScenarioError
from simcap.serve.app import ServeApp
from simcap.serve.engine import ServedEngine
from simcap.serve.prompts import PromptReader
from simcap.simulation.simulator import provenance


def serve(
    scenario: Scenario, *, host: str = "127.0.0.1", port: int = 8000, speed: float = 1.0,
    tokenizer: str | Path | None = None, served_model_name: str | None = None,
    records: str | Path | None = None, trace: str | Path | None = None,
    say: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Serve ``scenario`` on ``host:port`` until the process is interrupted; returns the
    engine's final status (:meth:`ServedEngine.status`: requests, clock lag, provenance).

    ``speed``: simulated seconds per wall-clock second. ``tokenizer``: the served model's
    folder (or its ``tokenizer.json``); without one, prompts are counted by the documented rule
    (:mod:`simcap.serve.prompts`). ``records`` / ``trace``: files that get one line per
    finished request / per arrival (:mod:`simcap.serve.engine`). ``say``: where the start-up
    lines go."""
    import uvicorn

    reader = PromptReader(tokenizer)
    name = served_model_name or scenario.name or "simcap"
    engine = ServedEngine(scenario, speed=speed)
    _check_free(host, port)
    with contextlib.ExitStack() as files:
        if records is not None:
            engine.records_file = files.enter_context(open(records, "w"))
        if trace is not None:
            engine.trace_file = files.enter_context(open(trace, "w"))
        app = ServeApp(engine, reader, name)
        facts = provenance(scenario)
        say(f"simcap serve: model {name!r} on http://{host}:{port} (speed {speed:g}x; prompts: {reader.source})")
        say(f"  scenario {facts['scenario_name']} sha256 {facts['scenario_sha256'][:12]}; "
            f"step time: {facts['step_time_source']}; vLLM {facts['vllm_version_modelled']} modelled; "
            f"simcap {facts['simcap_version']}")
        server = uvicorn.Server(uvicorn.Config(app.app, host=host, port=port, log_level="warning", lifespan="on"))
        with _stop_signals_end_the_run():
            server.run()
    return engine.status()


def _check_free(host: str, port: int) -> None:
    """The address can be listened on (else one line, before anything starts)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ScenarioError(f"--host/--port: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


@contextlib.contextmanager
def _stop_signals_end_the_run() -> Iterator[None]:
    """SIGINT and SIGTERM stop the server and then return here: uvicorn shuts down on them
    and raises them again once done, which would end the process before the records are
    closed and the lag is said; handlers of ours take them there instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def lag_line(status: dict[str, Any]) -> str:
    """The clock lag of a finished serve, in one line."""
    lag = status["clock_lag"]
    served = status["requests"]["finished"]
    if not lag["chunks"]:
        return f"served {served} requests; no chunk streamed"
    return (f"served {served} requests; clock lag over {lag['chunks']} chunks: "
            f"p50 {lag['p50_s'] * 1e3:.2f} ms, p99 {lag['p99_s'] * 1e3:.2f} ms, max {lag['max_s'] * 1e3:.2f} ms")
