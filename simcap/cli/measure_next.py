"""``simcap measure-next``: which load point to measure to narrow a prediction most."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from simcap.cli.common import JSON_OPTION, MODEL_FORM_OPTION, user_errors
from simcap.metrics import report


def measure_next(
    recipe: Path = typer.Argument(..., help="A roofline recipe with datasets (what simcap calibrate fits)."),
    target: List[str] = typer.Option(
        ..., "--target", metavar="LABEL",
        help="A prediction: a row label, ARM c=N (N clients, run as that arm's rows are) or ARM rate=R "
             "(an open-loop row at R requests/s); repeatable.",
    ),
    candidate: List[str] = typer.Option(
        ..., "--candidate", metavar="LABEL", help="A point you could measure, as --target (repeatable).",
    ),
    metrics: str = typer.Option(
        "output_throughput,e2e_mean", "--metrics",
        help="Comma-separated: the targets' figure is the first; a candidate run measures them all.",
    ),
    model_form: Optional[Path] = MODEL_FORM_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Fit the recipe, give each target its 90% interval (the prior's spread over terms the data
    leave free included), and say which candidate, measured, would narrow them most."""
    from simcap.calibrate.measure_next import measure_next_recipe

    with user_errors():
        form_error = None
        if model_form is not None:  # read first: a bad record fails before the fit
            from simcap.accuracy.model_form import FormError

            form_error = FormError.read(model_form)
        result = measure_next_recipe(recipe, target, candidate,
                                     [m.strip() for m in metrics.split(",") if m.strip()], form_error=form_error)
    if json_out:
        typer.echo(report.to_json(result))
        return
    console = report.wide_console(110)
    from rich.table import Table

    table = Table(title="targets (90% interval, Laplace at the fit)", title_justify="left")
    form = form_error is not None
    for col in ("target", "figure", "predicted", "interval", *(["model-form interval"] if form else [])):
        table.add_column(col, justify="left" if col in ("target", "figure") else "right")
    for t in result["targets"]:
        table.add_row(t["point"], t["metric"], f"{t['value']:.4g}",
                      f"{t['interval'][0]:.4g} - {t['interval'][1]:.4g}",
                      *([f"{t['model_form_interval'][0]:.4g} - {t['model_form_interval'][1]:.4g}"] if form else []))
    console.print(table)
    table = Table(title="candidates: each target's interval width if measured (x current)",
                  title_justify="left")
    table.add_column("measure")
    for t in result["targets"]:
        table.add_column(t["point"], justify="right")
    table.add_column("summed variance", justify="right")
    for c in result["candidates"]:
        table.add_row(c["point"], *(f"{v:.2f}" + (f" ({c['model_form_shrink'][k]:.2f})" if form else "")
                                    for k, v in c["shrink"].items()),
                      f"{c['summed_variance_ratio']:.2f}")
    console.print(table)
    a = result["advice"]
    typer.echo(f"measure next: {a['measure']} ({', '.join(a['metrics'])}); the widest interval "
               f"({a['widest_target']}) shrinks to {a['its_interval_shrinks_to']:.2f} of its width")
    if form:
        typer.echo(f"model form: measuring {a['model_form']['measure']} narrows the targets' model-form "
                   f"intervals most (in brackets above: each one's width x, once that load is among the "
                   f"fitted rows)")
    for note in result["fit"]["notes"]:
        typer.echo(f"note: {note}")
