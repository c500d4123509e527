"""Which engine modules run compiled, and the import hook that decides it.

``pip install`` compiles the engine loop's modules (``ext-modules`` in ``pyproject.toml``)
with Cython from their unchanged ``.py`` source (:mod:`simcap._build`; a ``.pxd`` beside a few
of them declares their hot classes as extension types) and writes ``simcap/_compiled.txt``:
one line per module built, its name and the SHA-256 of the files it was built from
(:func:`source_sha256`). A compiled module computes what its source computes, float operation
for float operation, so results are byte-identical either way (``tests/test_compiled.py``
holds them to that); only the time differs.

Python would import an extension module in preference to the ``.py`` beside it, even after
the source was edited. The finder installed here (first on ``sys.meta_path``, for listed
modules only) loads the extension only while those files still have the recorded hash, and
the source otherwise; ``SIMCAP_INTERPRETED=1`` always loads the source. :func:`status` and
:func:`summary` say what ran.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

# (os.path, not pathlib, and importlib.util only when a listed module is found: ``import
# simcap`` loads this module, and pathlib with importlib.util cost it some 10 ms.)
MANIFEST = "_compiled.txt"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def interpreted_by_request() -> bool:
    return os.environ.get("SIMCAP_INTERPRETED", "") not in ("", "0")


class CompiledFinder:
    """A meta-path finder for the modules named in the manifest (see the module docstring)."""

    def __init__(self, package_dir: str | os.PathLike = _PACKAGE_DIR) -> None:
        self.package_dir = os.fspath(package_dir)
        self._built: dict[str, str] | None = None
        self.loaded: dict[str, str] = {}  # module -> "compiled" | "interpreted (why)"

    def built(self) -> dict[str, str]:
        """Module name -> SHA-256 of the source it was compiled from (empty: none built)."""
        if self._built is None:
            try:
                with open(os.path.join(self.package_dir, MANIFEST)) as f:
                    text = f.read()
            except OSError:
                text = ""
            pairs = (line.split() for line in text.splitlines())
            self._built = {p[0]: p[1] for p in pairs if len(p) == 2}  # (a torn line: not built)
        return self._built

    def decide(self, fullname: str) -> tuple[str, str | None]:
        """For a module the manifest names: the file to load and, when that is the source in
        place of the extension, why (:class:`str`; None: the extension)."""
        *package, leaf = fullname.split(".")[1:]
        directory = os.path.join(self.package_dir, *package)
        source = os.path.join(directory, f"{leaf}.py")
        extension = next((path for suffix in EXTENSION_SUFFIXES
                          if os.path.exists(path := os.path.join(directory, leaf + suffix))), None)
        if interpreted_by_request():
            return source, "SIMCAP_INTERPRETED is set"
        if extension is None:
            return source, "no extension module"
        if os.path.exists(source) and source_sha256(source) != self.built()[fullname]:
            return source, "source changed since it was compiled"  # (or its declarations)
        return extension, None

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith("simcap.") or fullname not in self.built():
            return None
        from importlib.util import spec_from_file_location

        location, why = self.decide(fullname)
        self.loaded[fullname] = _state(why)
        return spec_from_file_location(fullname, location)


def source_sha256(source: str | os.PathLike) -> str:
    """What a compiled module was built from: its source, then its declarations (``.pxd``)
    if it has them (the build records this; the finder compares it)."""
    import hashlib

    source = os.fspath(source)
    digest = hashlib.sha256()
    for path in (source, source[: -len(".py")] + ".pxd"):
        if path == source or os.path.exists(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


_FINDER = CompiledFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, CompiledFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def status() -> dict[str, str]:
    """Each compiled-capable module -> how it runs in this process (``compiled`` or
    ``interpreted (why)``): as it was loaded, or as it would be. Empty where nothing was built."""
    return {name: _FINDER.loaded.get(name) or _state(_FINDER.decide(name)[1])
            for name in sorted(_FINDER.built())}


def _state(why: str | None) -> str:
    return "compiled" if why is None else f"interpreted ({why})"


def summary() -> str:
    """One line: how the engine's modules run in this process, naming any that run their
    source in spite of an extension (and why)."""
    built = _FINDER.built()
    if not built:
        return "engine modules interpreted (none compiled at install)"
    if interpreted_by_request():
        return f"engine modules interpreted (SIMCAP_INTERPRETED set; {len(built)} compiled at install)"
    states = status()
    compiled = sum(1 for state in states.values() if state == "compiled")
    others = "; ".join(f"{name} {state}" for name, state in states.items() if state != "compiled")
    return f"engine modules compiled: {compiled} of {len(built)}" + (f"; {others}" if others else "")
