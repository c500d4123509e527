"""``simcap accuracy``: replay the accuracy corpus, print or write the table, check the ratchet."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from simcap.cli.common import JSON_OPTION, fail, user_errors
from simcap.metrics import report as text_report

DEFAULT_CORPUS = Path("calibration") / "corpus"


def accuracy(
    corpus: Path = typer.Argument(DEFAULT_CORPUS, help="The corpus folder (one case per sub-folder)."),
    case: Optional[List[str]] = typer.Option(None, "--case", help="Replay only this case (repeatable)."),
    form: Optional[List[str]] = typer.Option(None, "--form", help="Only this step-time form: linear or roofline (repeatable)."),
    write: bool = typer.Option(
        False, "--write", help="Rewrite accuracy.md and accuracy.json beside the corpus (the whole corpus only)."
    ),
    check: bool = typer.Option(
        False, "--check", help="Compare with the recorded accuracy.json: exit 1 naming every figure that got "
                               "worse (or better: the record must then be rewritten).",
    ),
    json_out: bool = JSON_OPTION,
) -> None:
    """Fit every corpus case on its fit part, predict its held-out part, and report the errors."""
    from simcap.accuracy import report
    from simcap.accuracy.corpus import FORMS, load_corpus
    from simcap.accuracy.replay import replay_corpus

    for f in form or []:
        if f not in FORMS:
            fail(f"--form: must be one of {', '.join(FORMS)} (got {f!r})")
    if write and (case or form):
        fail("--write: rewrites the whole record; drop --case and --form")
    with user_errors():
        cases = load_corpus(corpus, case or [])
        replays = replay_corpus(cases, form or None)
        problems = report.ratchet(replays, report.read_record(corpus.parent / "accuracy.json")) if check else []
        written = report.write(corpus.parent, cases, replays) if write else None
    rows = report.summary_rows(replays)
    form_error = report.form_error(cases, replays)
    if json_out:
        typer.echo(text_report.to_json({"cases": [r.to_dict() for r in replays], "summary": rows,
                                        "model_form": form_error,
                                        "ratchet": problems if check else None,
                                        "written": [str(p) for p in written] if written else None}))
    else:
        from rich.table import Table

        table = Table(title=f"prediction errors of held-out figures ({corpus})")
        for col in ("case", "form", "figures", "median |error|", "max |error|", "within spread", "fit + replay"):
            table.add_column(col, justify="left" if col in ("case", "form") else "right")
        for row, r in zip(rows, replays):
            hit, n = row["within_spread"]
            table.add_row(row["case"], row["form"], str(row["figures"]),
                          "-" if row["median_abs_error"] is None else f"{row['median_abs_error'] * 100:.1f}%",
                          "-" if row["max_abs_error"] is None else f"{row['max_abs_error'] * 100:.1f}%",
                          f"{hit} of {n}" if n else "-", f"{r.wall_s:.1f} s")
        text_report.wide_console(130).print(table)
        if form_error is not None:
            cov = form_error["coverage"]
            typer.echo(f"model-form {form_error['level']:.0%} intervals, each case left out of their fit: "
                       f"{cov['all']['inside']} of {cov['all']['figures']} held-out figures inside "
                       f"(median width {cov['all']['median_width']:.2f} of the prediction); beyond the fit part "
                       f"{cov['beyond_fit']['inside']} of {cov['beyond_fit']['figures']}")
        if written:
            typer.echo(f"written: {', '.join(str(p) for p in written)}")
        if check:
            typer.echo("ratchet: holds" if not problems else f"ratchet: {len(problems)} figure(s) departed from the record")
    for line in problems:
        typer.echo(line, err=True)
    if problems:
        raise typer.Exit(1)
