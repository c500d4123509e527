"""Reading the YAML files simcap takes (scenarios, profiles, recipes) with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from simcap.errors import ScenarioError


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
        data = yaml.safe_load(raw)
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
