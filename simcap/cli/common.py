"""What every ``simcap`` command shares: loading its scenario, and bad input as one line with
exit code 2 (an engine-model error: exit code 1)."""

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer

from simcap.errors import SimcapError, SimulationError
from simcap.runtime import startup


# Options shared by the commands that take a scenario.
SET_OPTION = typer.Option(None, "--set", help="Override a scenario key: dotted.key=value (repeatable).")
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object instead of tables.")
MODEL_FORM_OPTION = typer.Option(
    None, "--model-form", metavar="FILE",
    help="Add the model-form interval (a record simcap accuracy --write makes, e.g. calibration/model_form.json): "
         "how wrong such predictions have been, at this one's distance past the load the profile was fitted at.",
)


# Options of the commands that read benchmark tables (calibrate, score).
COLUMN_OPTION = typer.Option(
    None, "--column", metavar="NAME=KEY",
    help="What a table column is (repeatable): a vllm bench key (mean_ttft_ms, median_tpot_ms, p99_itl_ms, "
         "output_throughput, total_token_throughput, ...; add _per_gpu for per-GPU throughput) or "
         "concurrency, request_rate, input_len, output_len, num_prompts. E.g. 'TPOT (ms)=median_tpot_ms'.",
)
WHERE_OPTION = typer.Option(
    None, "--where", metavar="COND",
    help="Read only the table rows meeting NAME OP VALUE (repeatable, all must hold), e.g. 'concurrency<=16'.",
)
GPUS_OPTION = typer.Option(
    None, "--gpus", help="GPUs of the deployment: a per-GPU throughput column is multiplied by this "
                         "(default: engine.memory.tensor_parallel_size)."
)


INPUT_LEN_OPTION = typer.Option(None, "--input-len", help="Prompt tokens, where the table lacks them.")
OUTPUT_LEN_OPTION = typer.Option(None, "--output-len", help="Output tokens, where the table lacks them.")
REQUESTS_PER_CLIENT_OPTION = typer.Option(
    None, "--requests-per-client",
    help="Requests each client of a closed-loop row sent (a benchmark's --num-prompts / concurrency), where "
         "the table lacks the count: the rows run that many, first wave and drain included (default: whole "
         "rounds of 20-120 requests, throughput read in the steady state).",
)


def table_workload(input_len: Optional[int], output_len: Optional[int],
                   requests_per_client: Optional[int]) -> dict[str, int]:
    """What a table's rows lack, from the options that give it (``workload`` of a dataset)."""
    return {k: v for k, v in (("input_len", input_len), ("output_len", output_len),
                              ("requests_per_client", requests_per_client)) if v is not None}


def table_reading(columns: Optional[List[str]], where: Optional[List[str]], gpus: Optional[int]) -> Any:
    """The :class:`~simcap.calibrate.readers.TableReading` of those options; None when none is given."""
    if not columns and not where and gpus is None:
        return None
    from simcap.calibrate.readers import TableReading

    return TableReading.parse(columns or [], where or [], gpus)


def with_replicas(scenario: Any, replicas: Optional[int], router: Optional[str]) -> Any:
    """``--replicas N [--router R]``: the scenario as a fleet of N replicas (its own when neither
    is given); ``--router`` alone is refused."""
    if router is not None and replicas is None:
        fail("--router: give --replicas N with it (or a deployment in the scenario)")
    if replicas is None:
        return scenario
    from simcap.studies.fleet_sizing import parse_routers, with_fleet

    return with_fleet(scenario, replicas, parse_routers(router, scenario)[0] if router else None)


def fail(message: str) -> None:
    """One line on stderr, exit code 2: the user's input was wrong."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@contextmanager
def _without_pydantic_plugins() -> Iterator[None]:
    """pydantic looks for plugins the first time it builds a validator: it reads the entry
    points of every installed distribution (``importlib.metadata``), 5-15 ms of a command's
    start. The command builds simcap's scenario models without plugins, as typer builds its
    parameters': ``PYDANTIC_DISABLE_PLUGINS`` is set while a scenario loads and then restored,
    so the library, and every process a command starts, keep the user's setting."""
    previous = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PYDANTIC_DISABLE_PLUGINS"]
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = previous


def load_command_scenario(path: Path, overrides: Optional[List[str]], *, collect: bool = True,
                          simulated: bool = True, **kwargs: Any) -> Any:
    """:func:`simcap.config.scenario.load_scenario` with the scenario models built without
    pydantic plugins (:func:`_without_pydantic_plugins`): how every command, ``simcap live
    ...`` included, loads its scenario. Then the command's start-up is over and the garbage
    collector resumes (:func:`simcap.runtime.startup.end`); ``collect=False``: the caller
    resumes it, when what it imports next is imported.

    ``simulated``: the command simulates the scenario, so a scenario whose step time nobody
    chose (no ``step_time``, no profile) gets a warning: one line on stderr once the command
    has printed its numbers (:func:`warn_when_done`; a command that fails says only why)."""
    try:
        with _without_pydantic_plugins():  # the import too: it builds the models' default instances
            from simcap.config.scenario import load_scenario

            scenario = load_scenario(path, overrides or [], **kwargs)
    finally:
        if collect:
            startup.end()
    if simulated and not scenario.step_time_given:
        _WARNINGS.append(f"warning: {path}: {STEP_TIME_WARNING}")
    return scenario


_WARNINGS: list[str] = []  # said once the command has done its work


@contextmanager
def warn_when_done() -> Iterator[None]:
    """The command's warnings on stderr after it finished (returned, or exited with code 0:
    its numbers are out); none after an error, which is said alone."""
    _WARNINGS.clear()
    try:
        yield
    except typer.Exit as exc:
        if exc.exit_code == 0:
            _say_warnings()
        raise
    else:
        _say_warnings()


def _say_warnings() -> None:
    for line in dict.fromkeys(_WARNINGS):  # (a scenario loaded twice: said once)
        typer.echo(line, err=True)
    _WARNINGS.clear()


STEP_TIME_WARNING = (
    "step_time: not given (no step_time section, no profile): this command's numbers come from "
    "illustrative default coefficients that no measurement backs; give a step_time section or "
    "a profile (simcap calibrate fits one)"
)


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input becomes one line and exit code 2; an engine-model error, exit code 1."""
    try:
        yield
    except SimcapError as exc:
        fail(str(exc))
    except SimulationError as exc:  # a state vLLM could not reach: report, don't hide
        typer.echo(f"simulation error: {exc}", err=True)
        raise typer.Exit(1)
