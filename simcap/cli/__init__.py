"""The ``simcap`` command: thin commands over the library (:mod:`simcap.cli.main`), with
``simcap live`` (:mod:`simcap.cli.live`) mounted under it."""

from simcap.cli.main import app, main

__all__ = ["app", "main"]
