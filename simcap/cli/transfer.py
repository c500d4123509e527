"""``simcap transfer``: a roofline profile moved to other hardware, refitting what does not carry."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from simcap.cli.common import (
    COLUMN_OPTION, GPUS_OPTION, INPUT_LEN_OPTION, JSON_OPTION, OUTPUT_LEN_OPTION, REQUESTS_PER_CLIENT_OPTION, SET_OPTION,
    WHERE_OPTION, table_reading, table_workload, user_errors,
)
from simcap.metrics import report


def transfer(
    profile: Path = typer.Argument(..., help="The roofline profile to move (fitted on its own hardware)."),
    tables: Optional[List[str]] = typer.Argument(
        None, help="Benchmark results measured on the target (FILE or FILE#key.path); none: move by the "
                   "catalog alone."
    ),
    hardware: str = typer.Option(..., "--hardware", help="Target: a catalog hardware name, or a YAML file of one entry."),
    tensor_parallel_size: Optional[int] = typer.Option(
        None, "--tensor-parallel-size", help="Ranks on the target (default: the profile's)."
    ),
    out: Path = typer.Option(..., "--out", help="Profile YAML to write."),
    refit: Optional[str] = typer.Option(
        None, "--refit",
        help="Terms refitted on the target's rows, comma-separated (default: by the rows given: one row, "
             "the dominant byte term's efficiency; two or more, that and base).",
    ),
    column: Optional[List[str]] = COLUMN_OPTION,
    where: Optional[List[str]] = WHERE_OPTION,
    gpus: Optional[int] = GPUS_OPTION,
    rows: Optional[List[str]] = typer.Option(None, "--rows", metavar="LABEL", help="Fit only this row (repeatable)."),
    fit_metrics: Optional[str] = typer.Option(
        None, "--fit-metrics", help="The figures to fit, comma-separated (default: every one measured)."
    ),
    input_len: Optional[int] = INPUT_LEN_OPTION,
    output_len: Optional[int] = OUTPUT_LEN_OPTION,
    requests_per_client: Optional[int] = REQUESTS_PER_CLIENT_OPTION,
    kernel_class: str = typer.Option(
        "auto", "--kernel-class",
        help="Catalog kernel class whose efficiencies replace the carried ones: auto (the one covering the "
             "target, if any), a name, or none.",
    ),
    set_: Optional[List[str]] = SET_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Move a roofline profile to other hardware: bytes and FLOPs re-priced from the catalog,
    fitted terms carried, and the terms that do not carry refitted on the target's rows."""
    from simcap.calibrate.pipeline import check_options
    from simcap.calibrate.profile_io import write_profile
    from simcap.calibrate.transfer import term_value, transfer as move

    with user_errors():
        workload = table_workload(input_len, output_len, requests_per_client)
        check_options(workload=workload)
        result = move(
            profile, hardware=hardware, tensor_parallel_size=tensor_parallel_size, overrides=set_ or (),
            inputs=tables or (), table=table_reading(column, where, gpus), rows=rows,
            refit=refit.split(",") if refit is not None else None,
            fit_metrics=fit_metrics.split(",") if fit_metrics is not None else None,
            workload=workload or None, kernel_class=kernel_class,
            command="simcap transfer " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        )
        write_profile(result.profile, out)
    if json_out:
        typer.echo(report.to_json({**result.to_dict(), "profile": str(out)}))
        return
    moved = result.record
    typer.echo(f"moved {moved['from']['hardware']} (tp {moved['from']['tensor_parallel_size']}) -> "
               f"{moved['to']['hardware']} (tp {moved['to']['tensor_parallel_size']})")
    typer.echo("refitted: " + (", ".join(
        f"{t} = {term_value(result.profile['step_time'], t):.4g}" for t in result.refitted)
        or "none (the catalog alone)"))
    if moved["kernel_class"]:
        typer.echo(f"from the kernel class {moved['kernel_class']['name']}: "
                   + ", ".join(moved["kernel_class"]["terms"]))
    typer.echo(f"carried: {', '.join(moved['carried'])}")
    for r in result.fitted_rows:
        typer.echo(f"  {r['point']} {r['metric']}: measured {r['measured']:.4g}, fitted "
                   f"{r['fitted']:.4g} ({r['rel_error']:+.1%})")
    typer.echo(f"profile: {out}")
    advice = result.advice()
    if advice:
        typer.echo(f"note: {advice}", err=True)
