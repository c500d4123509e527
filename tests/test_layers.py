"""The package's layers hold: each folder imports only the folders below it (the contract in
``pyproject.toml``, ``[tool.importlinter]``), and the check fails on an import that climbs.

The contract is checked on the tree as it is, and on a copy with one upward import planted
(at module level, and inside a function, where an import is easiest to slip in unseen).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys\nfrom importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def lint(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``simcap`` package under ``tree`` with ``tree``'s pyproject."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", LINT], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_layers_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize("module, planted, names", [
    # The engine's pure pieces read plain values, never the YAML models.
    ("engine/request.py", "from simcap.config.scenario import EngineConfig  # planted\n",
     ("simcap.engine.request", "simcap.config.scenario")),
    # The per-request record, shared by simulated and live runs, knows nothing of either.
    ("metrics/records.py", "\n\ndef _planted():\n    from simcap.simulation import simulator\n\n    return simulator\n",
     ("simcap.metrics.records", "simcap.simulation.simulator")),
])
def test_an_upward_import_breaks_the_contract(tmp_path, module, planted, names):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "simcap", tmp_path / "simcap",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.c", "*.html"))
    target = tmp_path / "simcap" / module
    text = target.read_text()
    target.write_text(text + planted if planted.startswith("\n") else _after_imports(text, planted))
    done = lint(tmp_path)
    assert done.returncode != 0, done.stdout
    assert "0 kept, 1 broken" in done.stdout and all(n in done.stdout for n in names), done.stdout


def _after_imports(text: str, line: str) -> str:
    """``text`` with ``line`` after its ``from __future__`` import (or first)."""
    marker = "from __future__ import annotations\n"
    return text.replace(marker, marker + line, 1) if marker in text else line + text
