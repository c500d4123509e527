"""Builds the engine's hot modules as compiled extensions at install (Cython, from the same
``.py`` files); ``pyproject.toml`` lists them (``ext-modules``) and names these commands.

Each module is ordinary Python: Cython compiles it, unchanged, into an extension module
beside it. A ``.pxd`` beside a few of them declares their hot classes as extension types
(every field still a Python object). ``simcap/_compiled.txt`` records every listed module:
the SHA-256 of the files it was built from, or ``-`` where it was not built
(:mod:`simcap.runtime.compiled` loads an extension only while its files still have the recorded
hash, so an edited module runs as the edited source until the next ``pip install``).

The set-up never depends on the build machine: without Cython, without a working C compiler
or Python's headers, or where one module fails to compile, the install goes on and the
modules not built run interpreted (same results, slower). The install says so in one line
(``pip install -v`` shows it), and so does ``simcap --version``. A wheel with nothing
compiled in it is tagged ``py3-none-any``. Used only while installing.

It is also the package's build backend (``pyproject.toml``): setuptools' own, re-exported, so
that the project's root is on the build's path and these commands can be imported by name.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks)
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

from simcap.runtime.compiled import MANIFEST, NOT_BUILT, cimported, source_sha256

# Cython compiles Python semantics: same objects, same float operations in the same order.
# Annotations stay annotations (with annotation typing, ``x: float`` would turn an int argument
# into a C double and ``x: int`` refuse a numpy integer). The C compiler must not fuse a
# multiply and an add into one rounding (an FMA) either.
CFLAGS = ["-O2", "-ffp-contract=off"]
DIRECTIVES = {"binding": True, "annotation_typing": False, "emit_code_comments": False}


def _say(text: str) -> None:
    print(f"simcap: {text}", file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    """The error in one short line (a failed compiler command named by its program only)."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"Command '\[('[^']*')[^]]*\]'", r"command \1", lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"[:160]


class CompiledEngine(build_ext):
    """``build_ext`` that cythonizes the listed ``.py`` modules, builds each one it can (a
    module that fails stays interpreted, and the install goes on) and writes the manifest."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.engine_modules: list[str] = []  # every listed module, built or not
        self.built: set[str] = set()
        self.not_built: dict[str, str] = {}  # module -> why (one line)

    def finalize_options(self) -> None:
        # (May run more than once: the distribution keeps the listed .py extensions, and this
        # command finalizes its own cythonized copies, each with the flags once.)
        listed = list(self.distribution.ext_modules or [])
        self.engine_modules = [ext.name for ext in listed]
        self.distribution.ext_modules = self.cythonized(listed)
        try:
            super().finalize_options()
        finally:
            self.distribution.ext_modules = listed
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def cythonized(self, listed: list) -> list:
        """The listed modules as C extensions (none where Cython is missing or fails)."""
        try:
            from Cython.Build import cythonize

            for ext in listed:
                ext.depends = sorted({*ext.depends, *(str(p) for p in declarations(ext.sources[0]))})
            extensions = cythonize(listed, language_level=3, quiet=True, build_dir="build/cython",
                                   compiler_directives=DIRECTIVES)
        except Exception as exc:  # noqa: BLE001 - no Cython, or a module it cannot translate
            self.not_built = dict.fromkeys(self.engine_modules, f"not translated ({_first_line(exc)})")
            return []
        for ext in extensions:
            ext.extra_compile_args = [*ext.extra_compile_args, *CFLAGS]
            ext.optional = True  # (an in-place build copies only what was built)
        return extensions

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers, a compile error
            self.not_built[ext.name] = _first_line(exc)
            stale = self.get_ext_fullpath(ext.name)  # (an earlier build's, never shipped)
            if os.path.exists(stale):
                os.remove(stale)
        else:
            self.built.add(ext.name)

    def run(self) -> None:
        inplace = self.inplace
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - e.g. no compiler for this platform at all
            self.built.clear()
            self.not_built.update(dict.fromkeys(self.engine_modules, _first_line(exc)))
        finally:
            self.inplace = inplace  # (setuptools clears it while it builds)
        self.drop_dependents()
        self.write_manifest()
        _say(self.outcome())

    def drop_dependents(self) -> None:
        """A built module whose declarations cimport a module that was not built cannot be
        imported (it expects that module's extension types): it counts as not built."""
        changed = True
        while changed:
            changed = False
            for name in sorted(self.built):
                missing = [dep for dep in cimported(str(module_source(name).with_suffix(".pxd")))
                           if dep not in self.built]
                if missing:
                    self.built.discard(name)
                    self.not_built[name] = f"cimports {missing[0]}, which was not compiled"
                    changed = True

    def write_manifest(self) -> None:
        path = self.manifest()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lines = (f"{name} {source_sha256(module_source(name)) if name in self.built else NOT_BUILT}\n"
                 for name in sorted(self.engine_modules))
        with open(path, "w") as f:
            f.writelines(lines)

    def outcome(self) -> str:
        """One line: how many engine modules were compiled, and why the others were not (the
        first one's reason)."""
        total = len(self.engine_modules)
        missing = [name for name in self.engine_modules if name not in self.built]
        if not missing:
            return f"engine modules compiled: {total} of {total}"
        head = ("no engine module compiled" if not self.built else
                f"engine modules compiled: {len(self.built)} of {total}; not compiled: {', '.join(missing)}")
        why = self.not_built.get(missing[0], "not built")
        return f"{head} ({missing[0]}: {why}); they run interpreted, with the same results"

    def manifest(self) -> str:
        """``simcap/_compiled.txt`` where the extensions go (the tree itself when in place)."""
        return os.path.join(os.path.dirname(self.get_ext_fullpath("simcap._compiled")), MANIFEST)

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), self.manifest()]


class EngineWheel(bdist_wheel):
    """``bdist_wheel`` whose tag says what the build produced: a wheel with no compiled module
    in it is pure Python (``py3-none-any``), however many modules were listed."""

    def run_command(self, command: str) -> None:
        super().run_command(command)
        if command == "build" and not self.get_finalized_command("build_ext").built:
            self.distribution.ext_modules = []  # (installed as pure Python, at the wheel's root)
            self.root_is_pure = True


def module_source(name: str) -> Path:
    return Path(*name.split(".")).with_suffix(".py")


def declarations(source: str) -> list[Path]:
    """The ``.pxd`` beside a module's source, if it has one."""
    pxd = Path(source).with_suffix(".pxd")
    return [pxd] if pxd.exists() else []
