"""The ``simcap`` command's start-up: hardly any garbage collection while it starts.

Importing typer, pydantic, numpy and rich, and building the scenario's models, makes tens of
thousands of objects that live until exit and little garbage; the cyclic collector would
go over them some 30 times (15-25 ms of a ``simcap simulate``). While a command starts
(:func:`begin`: ``python -m simcap`` before it imports the command, the command itself as
it is called) the collector runs once per :data:`COLLECT_EVERY` new objects instead of
every 700: rarely, yet a command that never says its start-up is over still collects.
When its work begins (:func:`end`: once the scenario is loaded) what start-up loaded moves
to the permanent generation (``gc.freeze``) and collections resume as usual, over what the
work makes. When the command ends (:func:`command`) the collector is as it was, and at exit
everything is frozen (:func:`freeze_at_exit`), so that the interpreter's shutdown runs no
full collection.
"""

from __future__ import annotations

import atexit
import gc
from contextlib import contextmanager
from typing import Iterator, Optional

COLLECT_EVERY = 1 << 17

_thresholds: Optional[tuple[int, int, int]] = None  # the collector's, from before start-up
_starting = False
_froze = False  # whether start-up's objects were frozen (and are unfrozen at the end)


def begin() -> None:
    """Start-up begins: collections become rare (once per :data:`COLLECT_EVERY` objects)."""
    global _thresholds, _starting
    if _thresholds is None:
        _thresholds = gc.get_threshold()
    if not _starting:
        _starting = True
        gc.set_threshold(max(COLLECT_EVERY, _thresholds[0]), *_thresholds[1:])


def end() -> None:
    """Start-up is over: what it loaded is frozen (unless the process froze objects of its
    own already) and collections resume as usual."""
    global _starting, _froze
    if _starting:
        _starting = False
        if not gc.get_freeze_count():
            gc.freeze()
            _froze = True
        assert _thresholds is not None
        gc.set_threshold(*_thresholds)


def freeze_at_exit() -> None:
    """At exit, move every object to the collector's permanent generation (``gc.freeze``):
    the interpreter's shutdown then frees them by reference count alone instead of running
    full collections over everything numpy, pydantic, typer and rich loaded (some 60 ms of a
    ``simcap simulate``; ``benchmarks/bench_startup.py``). Registered before the command runs,
    so it runs after the exit handlers the command registers; only cyclic garbage still
    there at exit goes unfreed, which the interpreter does not promise to finalize either."""
    atexit.unregister(gc.freeze)  # once, however often a command runs in one process
    atexit.register(gc.freeze)


@contextmanager
def command() -> Iterator[None]:
    """A command's run: start-up (:func:`begin`, if not begun yet) until :func:`end`; after
    it, the collector's thresholds as before start-up, and nothing left frozen by it; at
    exit, everything frozen (:func:`freeze_at_exit`)."""
    global _thresholds, _starting, _froze
    freeze_at_exit()
    begin()
    try:
        yield
    finally:
        if _thresholds is not None:
            gc.set_threshold(*_thresholds)
        if _froze:
            gc.unfreeze()
        _thresholds, _starting, _froze = None, False, False
