"""Which engine modules run compiled, and the import hook that decides it.

``pip install`` compiles the engine loop's modules (``ext-modules`` in ``pyproject.toml``)
with Cython from their unchanged ``.py`` source (:mod:`simcap.runtime.build`; a ``.pxd`` beside a few
of them declares their hot classes as extension types) and writes ``simcap/_compiled.txt``:
one line per listed module, its name and the SHA-256 of the files it was built from
(:func:`source_sha256`). A compiled module computes what its source computes, float operation
for float operation, so results are byte-identical either way (``tests/test_compiled.py``
holds them to that); only the time differs.

A module the install could not compile (no Cython, no C compiler, a compile error) is listed
with ``-`` in place of the hash, and runs its source.

Python would import an extension module in preference to the ``.py`` beside it, even after
the source was edited. The finder installed here (first on ``sys.meta_path``) loads a listed
module's extension only while its files still have the recorded hash, and the source
otherwise; an extension beside any other module of the package (left by an earlier build,
or missing from the manifest) is never loaded either. ``SIMCAP_INTERPRETED=1`` always loads
the source. :func:`status` and :func:`summary` say what ran.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

# (os.path, not pathlib, and importlib.util only when a listed module is found: ``import
# simcap`` loads this module, and pathlib with importlib.util cost it some 10 ms.)
MANIFEST = "_compiled.txt"
NOT_BUILT = "-"  # the manifest's hash of a listed module the install did not compile
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # simcap/


def interpreted_by_request() -> bool:
    return os.environ.get("SIMCAP_INTERPRETED", "") not in ("", "0")


class CompiledFinder:
    """A meta-path finder for the package's modules that have an extension module beside
    their source, or a line in the manifest (see the module docstring)."""

    def __init__(self, package_dir: str | os.PathLike = _PACKAGE_DIR) -> None:
        self.package_dir = os.fspath(package_dir)
        self._listed: dict[str, str] | None = None
        self._extensions: dict[str, dict[str, str]] = {}  # directory -> module -> extension file
        self._decided: dict[str, tuple[str, str | None]] = {}
        self.loaded: dict[str, str] = {}  # module -> "compiled" | "interpreted (why)"

    def listed(self) -> dict[str, str]:
        """Every module the install tried to compile -> the SHA-256 of the source it was
        compiled from, or ``NOT_BUILT`` (empty: no manifest, nothing tried)."""
        if self._listed is None:
            try:
                with open(os.path.join(self.package_dir, MANIFEST)) as f:
                    text = f.read()
            except OSError:
                text = ""
            pairs = (line.split() for line in text.splitlines())
            self._listed = {p[0]: p[1] for p in pairs if len(p) == 2}  # (a torn line: not built)
        return self._listed

    def built(self) -> dict[str, str]:
        """Module name -> SHA-256 of the source it was compiled from (empty: none built)."""
        return {name: digest for name, digest in self.listed().items() if digest != NOT_BUILT}

    def where(self, fullname: str) -> tuple[str, str | None]:
        """A module's source path and its extension module file, if there is one (each
        directory listed once)."""
        *package, leaf = fullname.split(".")[1:]
        directory = os.path.join(self.package_dir, *package)
        extensions = self._extensions.get(directory)
        if extensions is None:
            try:
                files = sorted(os.listdir(directory))
            except OSError:
                files = []
            extensions = {}
            for suffix in reversed(EXTENSION_SUFFIXES):  # (the most specific suffix wins)
                extensions.update({f[: -len(suffix)]: os.path.join(directory, f)
                                   for f in files if f.endswith(suffix)})
            self._extensions[directory] = extensions
        return os.path.join(directory, f"{leaf}.py"), extensions.get(leaf)

    def decide(self, fullname: str) -> tuple[str, str | None]:
        """For a module the manifest names or that has an extension: the file to load and,
        when that is the source in place of the extension, why (:class:`str`; None: the
        extension). A compiled module whose declarations ``cimport`` another module's types
        runs compiled only while that module does too (else its import fails)."""
        decided = self._decided.get(fullname)
        if decided is None:
            self._decided[fullname] = decided = self._decide(fullname)
        return decided

    def _decide(self, fullname: str) -> tuple[str, str | None]:
        source, extension = self.where(fullname)
        recorded = self.listed().get(fullname)
        if interpreted_by_request():
            return source, "SIMCAP_INTERPRETED is set"
        if recorded == NOT_BUILT:
            return source, "not compiled at install"
        if extension is None:
            return source, "no extension module"
        if recorded is None:
            return source, "extension not from this install"
        if os.path.exists(source) and source_sha256(source) != recorded:
            return source, "source changed since it was compiled"  # (or its declarations)
        self._decided[fullname] = (source, "cimports itself")  # (a cycle: never compiled)
        for dependency in cimported(source[: -len(".py")] + ".pxd"):
            if self.decide(dependency)[1] is not None:
                return source, f"cimports {dependency}, which runs interpreted"
        return extension, None

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith("simcap."):
            return None
        if fullname not in self.listed():
            source, extension = self.where(fullname)
            if extension is None or not os.path.exists(source):
                return None  # (a plain module or a package: the usual finders)
        from importlib.util import spec_from_file_location

        location, why = self.decide(fullname)
        self.loaded[fullname] = _state(why)
        return spec_from_file_location(fullname, location)


def cimported(pxd: str) -> list[str]:
    """The modules whose declarations a ``.pxd`` cimports (none where there is no ``.pxd``)."""
    try:
        with open(pxd) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for words in (line.split("#")[0].replace(",", " ").split() for line in lines):
        if len(words) >= 3 and words[0] == "from" and words[2] == "cimport":
            out.append(words[1])
        elif words[:1] == ["cimport"]:
            out += [w for w in words[1:] if w != "as"][:1]
    return out


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
    ``interpreted (why)``): as it was loaded, or as it would be. Empty where the install tried
    none."""
    return {name: _FINDER.loaded.get(name) or _state(_FINDER.decide(name)[1])
            for name in sorted(_FINDER.listed())}


def _state(why: str | None) -> str:
    return "compiled" if why is None else f"interpreted ({why})"


def summary() -> str:
    """One line: how the engine's modules run in this process, naming any that run their
    source in spite of an extension (and why)."""
    listed, built = _FINDER.listed(), _FINDER.built()
    if not built:
        return "engine modules interpreted (none compiled at install)"
    if interpreted_by_request():
        return (f"engine modules interpreted (SIMCAP_INTERPRETED set; {len(built)} of {len(listed)} "
                "compiled at install)")
    states = status()
    compiled = sum(1 for state in states.values() if state == "compiled")
    others = "; ".join(f"{name} {state}" for name, state in states.items() if state != "compiled")
    return f"engine modules compiled: {compiled} of {len(listed)}" + (f"; {others}" if others else "")
