"""Errors simcap reports to its user as one line, never as a traceback."""

from __future__ import annotations


class SimcapError(Exception):
    """Base class of every error that is the user's input, not simcap's bug."""


class ScenarioError(SimcapError, ValueError):
    """A scenario (or an override of one) is malformed, out of range or infeasible.

    The message starts with the dotted path of the offending field, e.g.
    ``workload.arrival.rate: must be > 0 (got -1)``.
    """


class SimulationError(RuntimeError):
    """The engine model reached a state vLLM could not (a bug, or an unservable request)."""
