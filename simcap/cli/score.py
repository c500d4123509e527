"""``simcap score``: a fixed profile against benchmark tables, row by row."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from simcap.cli.common import (
    COLUMN_OPTION, GPUS_OPTION, INPUT_LEN_OPTION, JSON_OPTION, OUTPUT_LEN_OPTION, REQUESTS_PER_CLIENT_OPTION, SET_OPTION,
    WHERE_OPTION, table_reading, table_workload, user_errors,
)
from simcap.metrics import report


def score(
    profile: Path = typer.Argument(..., help="The profile to score (simcap calibrate wrote it, or any profile)."),
    tables: List[str] = typer.Argument(
        ..., help="Benchmark results: vllm bench serve JSON, JSON or CSV tables (FILE or FILE#key.path)."
    ),
    column: Optional[List[str]] = COLUMN_OPTION,
    where: Optional[List[str]] = WHERE_OPTION,
    gpus: Optional[int] = GPUS_OPTION,
    rows: Optional[List[str]] = typer.Option(None, "--rows", metavar="LABEL", help="Only this row (repeatable)."),
    metrics: Optional[str] = typer.Option(
        None, "--metrics", help="Only these figures, comma-separated (e.g. output_throughput,tpot_mean)."
    ),
    speculative: Optional[bool] = typer.Option(
        None, "--speculative/--no-speculative",
        help="Whether the rows ran with the profile's speculative decoding (default: a fitted row as the fit "
             "ran it, the others with it).",
    ),
    input_len: Optional[int] = INPUT_LEN_OPTION,
    output_len: Optional[int] = OUTPUT_LEN_OPTION,
    requests_per_client: Optional[int] = REQUESTS_PER_CLIENT_OPTION,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write predicted vs measured to FILE (PNG/SVG/PDF)."),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Predicted vs measured for every row of the tables, with the error; which rows the profile
    was fitted on and which are held out."""
    from simcap.calibrate.pipeline import check_options
    from simcap.calibrate.score import render_score, score_plot, score_profile

    with user_errors():
        if plot is not None:
            from simcap.studies.plots import check_figure_path

            check_figure_path(plot, "--plot")
        workload = table_workload(input_len, output_len, requests_per_client)
        check_options(workload=workload)
        result = score_profile(
            profile, tables, table=table_reading(column, where, gpus), workload=workload or None, rows=rows,
            metrics=metrics.split(",") if metrics is not None else None, speculative=speculative,
            overrides=set_ or (),
        )
        if plot is not None:
            score_plot(result, plot)
    if json_out:
        typer.echo(report.to_json(result.to_dict()))
    else:
        render_score(result, report.wide_console(110))
    if plot is not None:
        typer.echo(f"figure: {plot}", err=json_out)
