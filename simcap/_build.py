"""Builds the engine's hot modules as compiled extensions at install (Cython, from the same
``.py`` files); ``pyproject.toml`` lists them (``ext-modules``) and names this command.

Each module is ordinary Python: Cython compiles it, unchanged, into an extension module
beside it. A ``.pxd`` beside a few of them declares their hot classes as extension types
(every field still a Python object). ``simcap/_compiled.txt`` records which modules were
built and the SHA-256 of the files each was built from; :mod:`simcap.compiled` loads an
extension only while its files still have that hash, so an edited module runs as the edited
source until the next ``pip install``. A machine without a C compiler (or a build that fails)
gets the same package, interpreted: same results, slower. Used only while installing.

It is also the package's build backend (``pyproject.toml``): setuptools' own, re-exported, so
that the project's root is on the build's path and ``simcap._build.CompiledEngine`` can be
imported by name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks)
from setuptools.command.build_ext import build_ext

from simcap.compiled import MANIFEST, source_sha256

# Cython compiles Python semantics: same objects, same float operations in the same order.
# Annotations stay annotations (with annotation typing, ``x: float`` would turn an int argument
# into a C double and ``x: int`` refuse a numpy integer). The C compiler must not fuse a
# multiply and an add into one rounding (an FMA) either.
CFLAGS = ["-O2", "-ffp-contract=off"]
DIRECTIVES = {"binding": True, "annotation_typing": False, "emit_code_comments": False}


class CompiledEngine(build_ext):
    """``build_ext`` that cythonizes the listed ``.py`` modules first, builds what it can (a
    module that fails stays interpreted, and the install goes on) and writes the manifest."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        for ext in self.extensions:
            ext.extra_compile_args = [*ext.extra_compile_args, *CFLAGS]
            ext.depends = [*ext.depends, *(str(p) for p in declarations(ext.sources[0]))]
        try:
            from Cython.Build import cythonize

            self.extensions[:] = cythonize(self.extensions, language_level=3, quiet=True,
                                           build_dir="build/cython", compiler_directives=DIRECTIVES)
        except Exception as exc:  # noqa: BLE001 - no Cython, or a module it cannot translate
            print(f"simcap: engine modules not compiled ({exc}); they run interpreted",
                  file=sys.stderr)
            self.extensions[:] = []

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - a compiler error leaves the source to run
            print(f"simcap: engine modules not compiled ({exc}); they run interpreted",
                  file=sys.stderr)
        built = {ext.name: source_sha256(Path(*ext.name.split(".")).with_suffix(".py"))
                 for ext in self.extensions if os.path.exists(self.get_ext_fullpath(ext.name))}
        with open(self.manifest(), "w") as f:
            f.writelines(f"{name} {digest}\n" for name, digest in sorted(built.items()))

    def manifest(self) -> str:
        """``simcap/_compiled.txt`` where the extensions go (the tree itself when in place)."""
        return os.path.join(os.path.dirname(self.get_ext_fullpath("simcap._compiled")), MANIFEST)

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), self.manifest()]


def declarations(source: str) -> list[Path]:
    """The ``.pxd`` beside a module's source, if it has one."""
    pxd = Path(source).with_suffix(".pxd")
    return [pxd] if pxd.exists() else []
