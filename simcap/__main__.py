"""``python -m simcap`` runs the CLI."""

from simcap.runtime import startup

startup.begin()  # few garbage collections while the command's modules import (simcap.runtime.startup)

from simcap.cli import app  # noqa: E402

app(prog_name="simcap")
