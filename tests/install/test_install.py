"""The README's set-up on machines that cannot compile the engine: no C compiler, no Cython,
a compiler that fails on one module. Each installs the package from a copy of this checkout
into a fresh virtual environment (it sees this environment's packages, so only simcap itself
is built), checks that the install succeeds and says what it compiled, and that ``simcap
simulate`` prints the same bytes as this environment's compiled build. Also: an extension
module that no longer matches its source, or that the manifest does not list, is never
imported in place of the source.

Slow (minutes: each case runs Cython, one compiles ten modules), so it is marked ``build``
and runs as its own step of ``.ci/run``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from simcap.runtime import compiled

pytestmark = pytest.mark.build

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "chat.yaml"
SIMULATE = ["simulate", str(EXAMPLE), "--json", "--set", "workload.num_requests=300"]
NO_COMPILER = {"CC": "/bin/false"}


def copy_checkout(dst: Path) -> Path:
    """The checkout's tracked files (what a fresh clone has), without build outputs."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


def clean_env(extra: dict | None = None) -> dict:
    """This process's environment without what would change which engine runs or which
    compiler builds it, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SIMCAP_INTERPRETED", "CC", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **(extra or {})}


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = path / "bin" / "python"
        self.simcap = path / "bin" / "simcap"

    def run(self, args: list, cwd: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=cwd, env=clean_env(env), capture_output=True,
                              text=True, timeout=timeout)

    def pip_install(self, tree: Path, *args: str, env: dict | None = None) -> str:
        """``pip install ARGS`` in ``tree``: must succeed; returns the build's ``simcap:`` line."""
        done = self.run([self.python, "-m", "pip", "install", "-v", "--disable-pip-version-check",
                         "--force-reinstall", "--no-deps", *args], cwd=tree, env=env)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("simcap: ")]
        assert len(lines) == 1, lines
        return lines[0]

    def simcap_out(self, *args: str, cwd: Path) -> str:
        done = self.run([self.simcap, *args], cwd=cwd)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    def python_out(self, code: str, cwd: Path) -> str:
        done = self.run([self.python, "-c", code], cwd=cwd)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True)
    env = Venv(path)
    # A build without isolation uses the environment's setuptools: one new enough for
    # pyproject's ext-modules (the isolated builds fetch their own, as a new user's would).
    done = env.run([env.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "setuptools>=74.1"], cwd=path)
    assert done.returncode == 0, done.stderr[-2000:]
    return env


@pytest.fixture(scope="module")
def compiled_output() -> str:
    """``simcap simulate`` of the example by this environment's own (compiled) install."""
    if not compiled.CompiledFinder().built():
        if os.environ.get("CI"):
            pytest.fail("CI's own install compiled no engine module (it has a C compiler)")
        pytest.skip("this environment's install compiled nothing to compare with")
    done = subprocess.run([sys.executable, "-m", "simcap", *SIMULATE], cwd=ROOT, capture_output=True,
                          text=True, env=clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def imported_from(venv: Venv, module: str, cwd: Path) -> str:
    return venv.python_out(f"import {module} as m; print(m.__file__)", cwd)


def test_editable_install_without_a_c_compiler(venv, tmp_path, compiled_output):
    tree = copy_checkout(tmp_path / "checkout")
    said = venv.pip_install(tree, "-e", ".[test]", env=NO_COMPILER)  # (the README command, plus -v)
    assert said.startswith("simcap: no engine module compiled (simcap.engine.kv_cache: CompileError: "
                           "command '/bin/false' returned non-zero exit status 1"), said
    assert said.endswith("they run interpreted, with the same results"), said
    assert imported_from(venv, "simcap", tmp_path).startswith(str(tree))
    version = venv.simcap_out("--version", cwd=tmp_path)
    assert version.splitlines()[1] == "engine modules interpreted (none compiled at install)"
    assert not list((tree / "simcap").rglob("*.so"))
    simulator = tree / "simcap" / "simulation" / "simulator.py"
    assert imported_from(venv, "simcap.simulation.simulator", tmp_path) == str(simulator)
    assert venv.simcap_out(*SIMULATE, cwd=tmp_path) == compiled_output


def test_wheel_without_a_c_compiler_is_pure_python(venv, tmp_path, compiled_output):
    tree = copy_checkout(tmp_path / "checkout")
    done = venv.run([venv.python, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                     "-w", tmp_path / "dist", "."], cwd=tree, env=NO_COMPILER)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        manifest = z.read("simcap/_compiled.txt").decode()
        wheel_meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/WHEEL"))
    assert not [n for n in names if n.endswith(".so")]
    assert "Root-Is-Purelib: true" in wheel_meta
    assert len(manifest.splitlines()) == 11 and all(ln.endswith(" -") for ln in manifest.splitlines())

    done = venv.run([venv.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                     "--force-reinstall", "--no-deps", wheel], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert imported_from(venv, "simcap", tmp_path).startswith(str(venv.path))
    assert venv.simcap_out("--version", cwd=tmp_path).splitlines()[1] == \
        "engine modules interpreted (none compiled at install)"
    assert venv.simcap_out(*SIMULATE, cwd=tmp_path) == compiled_output


def test_install_without_cython(venv, tmp_path, compiled_output):
    if venv.run([venv.python, "-c", "import Cython"], cwd=tmp_path).returncode == 0:
        pytest.skip("Cython is importable in this environment")
    tree = copy_checkout(tmp_path / "checkout")
    said = venv.pip_install(tree, "--no-build-isolation", "-e", ".")
    assert said.startswith("simcap: no engine module compiled (simcap.engine.kv_cache: not translated "
                           "(ModuleNotFoundError: No module named 'Cython'))"), said
    assert venv.simcap_out("version", cwd=tmp_path).splitlines()[1] == \
        "engine modules interpreted (none compiled at install)"
    assert venv.simcap_out(*SIMULATE, cwd=tmp_path) == compiled_output


def test_one_module_that_fails_to_compile_and_stale_extensions(venv, tmp_path, compiled_output):
    """The compiler refuses scheduler.c only: the other ten are compiled and run compiled.
    Then three stale extensions, none of which may be imported: the refused module given
    another module's extension file, an edited source, and a module cut from the manifest."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine")
    tree = copy_checkout(tmp_path / "checkout")
    cc = tmp_path / "cc-refusing-scheduler"
    cc.write_text('#!/bin/sh\ncase "$*" in *scheduler.c*) echo "refused: $*" >&2; exit 1;; esac\n'
                  'exec cc "$@"\n')
    cc.chmod(0o755)
    said = venv.pip_install(tree, "-e", ".", env={"CC": str(cc)})
    # fast_forward and fast_verify cimport the scheduler's declarations: built against its
    # extension type, they cannot run beside its source, so they count as not compiled.
    assert said.startswith("simcap: engine modules compiled: 8 of 11; not compiled: "
                           "simcap.engine.scheduler, simcap.simulation.fast_forward, simcap.simulation.fast_verify "
                           "(simcap.engine.scheduler: CompileError: command "), said
    version = venv.simcap_out("--version", cwd=tmp_path).splitlines()[1]
    assert version == ("engine modules compiled: 8 of 11; "
                       "simcap.engine.scheduler interpreted (not compiled at install); "
                       "simcap.simulation.fast_forward interpreted (not compiled at install); "
                       "simcap.simulation.fast_verify interpreted (not compiled at install)"), version
    assert imported_from(venv, "simcap.simulation.simulator", tmp_path).endswith(".so")
    assert imported_from(venv, "simcap.engine.scheduler", tmp_path).endswith("scheduler.py")
    assert venv.simcap_out(*SIMULATE, cwd=tmp_path) == compiled_output

    # Stale extensions: never imported in place of their source. The refused module gets
    # another module's extension file; an edited source takes the module that cimports it
    # along; a module is cut from the manifest.
    package = tree / "simcap"
    (request_so,) = (package / "engine").glob("request.*.so")
    shutil.copy(request_so, package / "engine" / request_so.name.replace("request", "scheduler"))
    with open(package / "engine" / "request.py", "a") as f:
        f.write("\n# edited after the install\n")
    manifest = package / "_compiled.txt"
    manifest.write_text("".join(ln for ln in manifest.read_text().splitlines(keepends=True)
                                if not ln.startswith("simcap.simulation.steplog ")))
    for module in ("simcap.engine.scheduler", "simcap.engine.request", "simcap.engine.kv_cache",
                   "simcap.simulation.steplog"):
        origin = imported_from(venv, module, tmp_path)
        assert origin.endswith(".py"), (module, origin)
    version = venv.simcap_out("version", cwd=tmp_path).splitlines()[1]
    assert version == ("engine modules compiled: 5 of 10; "
                       "simcap.engine.kv_cache interpreted (cimports simcap.engine.request, which "
                       "runs interpreted); simcap.engine.request interpreted (source changed since "
                       "it was compiled); simcap.engine.scheduler interpreted (not compiled at "
                       "install); simcap.simulation.fast_forward interpreted (not compiled at install); "
                       "simcap.simulation.fast_verify interpreted (not compiled at install)"), version
    status = venv.python_out("import simcap.simulation.steplog; from simcap.runtime import compiled; "
                             "print(compiled._FINDER.loaded['simcap.simulation.steplog'])", tmp_path)
    assert status == "interpreted (extension not from this install)"
    assert venv.simcap_out(*SIMULATE, cwd=tmp_path) == compiled_output
