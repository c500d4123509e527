"""Reading the YAML files simcap takes (scenarios, profiles, recipes) with one-line errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from simcap.errors import ScenarioError


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1), which also reads YAML 1.2's floats without a dot:
    ``1e9`` and ``2E-3`` are numbers, not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str | bytes) -> Any:
    """Parse YAML text as every simcap input is parsed (files, ``--set`` and ``--grid`` values)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml_mapping(path: str | Path, what: str, expected: str) -> tuple[dict[str, Any], bytes]:
    """The mapping a YAML file holds, and the file's bytes (for hashing).

    Every problem is a :class:`ScenarioError` naming the file: unreadable, malformed (with
    line and column), or not a mapping (``expected`` says of what, e.g. "sections").
    An empty file is an empty mapping.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read {what} file: {exc.strerror}") from None
    try:
        data = load_yaml(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ScenarioError(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: expected a mapping of {expected}")
    return data, raw
