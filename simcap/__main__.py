"""``python -m simcap`` runs the CLI."""

from simcap.cli import app

app(prog_name="simcap")
