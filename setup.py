"""Builds the engine's hot modules as compiled extensions (Cython, from the same ``.py`` files).

Everything else about the package is in ``pyproject.toml``. The modules listed below are
ordinary Python; Cython compiles each one, unchanged, into an extension module beside it, and
``simcap/_compiled.txt`` records which were built and the SHA-256 of the source each was built
from. :mod:`simcap.compiled` loads an extension only while its source still has that hash, so
an edited module runs as the edited source until the next ``pip install``. A machine without a
C compiler (or a build that fails) gets the same package, interpreted: same results, slower.
``SIMCAP_INTERPRETED=1`` runs the source even where extensions exist.
"""

from __future__ import annotations

import hashlib
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules of the engine loop: where a simulation spends its time.
COMPILED = (
    "simcap.engine.kv_cache",
    "simcap.engine.request",
    "simcap.engine.scheduler",
    "simcap.engine.speculative",
    "simcap.engine.step_time",
    "simcap.fast_forward",
    "simcap.fast_verify",
    "simcap.metrics",
    "simcap.simulator",
    "simcap.steplog",
    "simcap.workload",
)

# Cython compiles Python semantics: same objects, same float operations in the same order.
# Annotations stay annotations (with annotation typing, ``x: float`` would turn an int argument
# into a C double and ``x: int`` refuse a numpy integer). The C compiler must not fuse a
# multiply and an add into one rounding (an FMA) either.
CFLAGS = ["-O2", "-ffp-contract=off"]


def source_path(module: str) -> str:
    return os.path.join(*module.split(".")) + ".py"


def source_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class OptionalBuildExt(build_ext):
    """Builds what it can; a failed module stays interpreted, and the install goes on."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        built: dict[str, str] = {}
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the package interpreted
            print(f"simcap: compiled engine modules not built ({exc}); running interpreted",
                  file=sys.stderr)
        for ext in self.extensions:
            if os.path.exists(self.get_ext_fullpath(ext.name)):
                built[ext.name] = source_sha256(source_path(ext.name))
        with open(self.manifest(), "w") as f:
            f.writelines(f"{name} {digest}\n" for name, digest in sorted(built.items()))

    def manifest(self) -> str:
        """``simcap/_compiled.txt`` where the extensions go (the tree itself when in place)."""
        return os.path.join(os.path.dirname(self.get_ext_fullpath("simcap._compiled")),
                            "_compiled.txt")

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), self.manifest()]


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("simcap: Cython not available; running interpreted", file=sys.stderr)
        return []
    modules = [Extension(name, [source_path(name)], extra_compile_args=CFLAGS) for name in COMPILED]
    try:
        return cythonize(modules, language_level=3, build_dir="build/cython", quiet=True,
                         compiler_directives={"binding": True, "annotation_typing": False,
                                              "emit_code_comments": False})
    except Exception as exc:  # noqa: BLE001 - a module Cython cannot translate stays interpreted
        print(f"simcap: Cython failed ({exc}); running interpreted", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
