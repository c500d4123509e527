"""Builds the engine's hot modules as compiled extensions (Cython, from the same ``.py`` files).

Everything else about the package is in ``pyproject.toml``. The modules that
``simcap.compiled.MODULES`` lists are ordinary Python; Cython compiles each one, unchanged,
into an extension module beside it. A ``.pxd`` beside a few of them declares their hot classes
as extension types (every field still a Python object). ``simcap/_compiled.txt`` records which
modules were built and the SHA-256 of the source (and declarations) each was built from;
:mod:`simcap.compiled` loads an extension only while its files still have that hash, so an
edited module runs as the edited source until the next ``pip install``. A machine without a C
compiler (or a build that fails) gets the same package, interpreted: same results, slower.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Cython compiles Python semantics: same objects, same float operations in the same order.
# Annotations stay annotations (with annotation typing, ``x: float`` would turn an int argument
# into a C double and ``x: int`` refuse a numpy integer). The C compiler must not fuse a
# multiply and an add into one rounding (an FMA) either.
CFLAGS = ["-O2", "-ffp-contract=off"]
DIRECTIVES = {"binding": True, "annotation_typing": False, "emit_code_comments": False}


def compiled_modules() -> tuple[str, ...]:
    """``simcap.compiled.MODULES``, read from its file (the package is being built)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simcap", "compiled.py")
    spec = importlib.util.spec_from_file_location("_simcap_compiled", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODULES


def module_path(module: str, suffix: str) -> str:
    return os.path.join(*module.split(".")) + suffix


def source_sha256(module: str) -> str:
    """SHA-256 of the module's source and, where it has them, its declarations after it
    (as :func:`simcap.compiled.source_sha256` computes it)."""
    digest = hashlib.sha256()
    for path in (module_path(module, ".py"), module_path(module, ".pxd")):
        if os.path.exists(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


class OptionalBuildExt(build_ext):
    """Builds what it can; a module that fails stays interpreted, and the install goes on."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the package interpreted
            print(f"simcap: compiled engine modules not built ({exc}); running interpreted",
                  file=sys.stderr)
        built = {ext.name: source_sha256(ext.name) for ext in self.extensions
                 if os.path.exists(self.get_ext_fullpath(ext.name))}
        with open(self.manifest(), "w") as f:
            f.writelines(f"{name} {digest}\n" for name, digest in sorted(built.items()))

    def manifest(self) -> str:
        """``simcap/_compiled.txt`` where the extensions go (the tree itself when in place)."""
        package = os.path.dirname(self.get_ext_fullpath("simcap._compiled"))
        return os.path.join(package, "_compiled.txt")

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), self.manifest()]


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("simcap: Cython not available; running interpreted", file=sys.stderr)
        return []
    modules = [
        Extension(name, [module_path(name, ".py")], extra_compile_args=CFLAGS,
                  depends=[p for p in [module_path(name, ".pxd")] if os.path.exists(p)])
        for name in compiled_modules()
    ]
    try:
        return cythonize(modules, language_level=3, build_dir="build/cython", quiet=True,
                         compiler_directives=DIRECTIVES)
    except Exception as exc:  # noqa: BLE001 - a module Cython cannot translate stays interpreted
        print(f"simcap: Cython failed ({exc}); running interpreted", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
