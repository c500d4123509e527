"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package lists the names it re-exports and the module each comes from; the module is imported
the first time one of its names is looked up. ``import simcap`` and ``simcap --help`` so stay
free of numpy, pydantic, SimPy and the live stack until a command needs them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, resolving each name of ``exports``
    (name -> module) on first use and caching it in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
