"""The engine's compiled modules: which the import hook loads (hand cases on a made-up package
tree), and that a compiled engine computes exactly what its source computes (whole commands,
byte for byte, compiled against ``SIMCAP_INTERPRETED=1``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader, SourceFileLoader
from pathlib import Path

import pytest

from simcap.runtime import compiled
from simcap.runtime.compiled import MANIFEST, NOT_BUILT, CompiledFinder, cimported

ROOT = Path(__file__).resolve().parents[1]


def make_tree(tmp_path: Path, recorded: str | None = None, extension: bool = True) -> Path:
    """simcap/engine/kv.py with (optionally) an extension beside it, listed in the manifest
    with the source's hash, or ``recorded`` in its place."""
    package = tmp_path / "simcap"
    (package / "engine").mkdir(parents=True)
    source = package / "engine" / "kv.py"
    source.write_text("X = 1\n")
    if extension:
        (package / "engine" / f"kv{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    digest = recorded or hashlib.sha256(source.read_bytes()).hexdigest()
    (package / MANIFEST).write_text(f"simcap.engine.kv {digest}\n")
    return package


def test_a_module_whose_source_is_unchanged_loads_compiled(tmp_path, monkeypatch):
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    finder = CompiledFinder(make_tree(tmp_path))
    spec = finder.find_spec("simcap.engine.kv")
    assert isinstance(spec.loader, ExtensionFileLoader)
    assert spec.origin.endswith(EXTENSION_SUFFIXES[0])
    assert finder.loaded == {"simcap.engine.kv": "compiled"}


def test_an_edited_source_runs_as_source(tmp_path, monkeypatch):
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    finder = CompiledFinder(make_tree(tmp_path, recorded="0" * 64))
    spec = finder.find_spec("simcap.engine.kv")
    assert isinstance(spec.loader, SourceFileLoader)
    assert spec.origin.endswith("kv.py")
    assert finder.loaded == {"simcap.engine.kv": "interpreted (source changed since it was compiled)"}


def test_edited_declarations_run_the_source_too(tmp_path, monkeypatch):
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    package = make_tree(tmp_path)
    (package / "engine" / "kv.pxd").write_text("cdef class KV:\n    cdef public object x\n")
    finder = CompiledFinder(package)
    assert isinstance(finder.find_spec("simcap.engine.kv").loader, SourceFileLoader)

    source = package / "engine" / "kv.py"
    digest = hashlib.sha256(source.read_bytes() + (package / "engine" / "kv.pxd").read_bytes())
    (package / MANIFEST).write_text(f"simcap.engine.kv {digest.hexdigest()}\n")
    assert isinstance(CompiledFinder(package).find_spec("simcap.engine.kv").loader,
                      ExtensionFileLoader)


def test_a_missing_extension_or_the_variable_runs_the_source(tmp_path, monkeypatch):
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    finder = CompiledFinder(make_tree(tmp_path, extension=False))
    assert isinstance(finder.find_spec("simcap.engine.kv").loader, SourceFileLoader)
    assert finder.loaded["simcap.engine.kv"] == "interpreted (no extension module)"

    monkeypatch.setenv("SIMCAP_INTERPRETED", "1")
    finder = CompiledFinder(make_tree(tmp_path / "b"))
    assert isinstance(finder.find_spec("simcap.engine.kv").loader, SourceFileLoader)
    assert finder.loaded["simcap.engine.kv"] == "interpreted (SIMCAP_INTERPRETED is set)"


def test_modules_not_in_the_manifest_are_left_to_the_usual_finders(tmp_path):
    finder = CompiledFinder(make_tree(tmp_path))
    assert finder.find_spec("simcap.engine.scheduler") is None
    assert finder.find_spec("numpy") is None
    assert finder.find_spec("simcapx.engine.kv") is None
    assert CompiledFinder(tmp_path / "nowhere").find_spec("simcap.engine.kv") is None


def test_an_extension_the_manifest_does_not_list_is_never_loaded(tmp_path, monkeypatch):
    """(An earlier build's, or one cut from the manifest: Python alone would load it.)"""
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    package = make_tree(tmp_path)
    (package / "simulation").mkdir()
    (package / "simulation" / "steplog.py").write_text("Y = 2\n")
    (package / "simulation" / f"steplog{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    finder = CompiledFinder(package)
    spec = finder.find_spec("simcap.simulation.steplog")
    assert isinstance(spec.loader, SourceFileLoader) and spec.origin.endswith("steplog.py")
    assert finder.loaded["simcap.simulation.steplog"] == "interpreted (extension not from this install)"
    assert "simcap.simulation.steplog" not in compiled_states(finder)  # (not one the install tried)


def test_a_module_the_install_could_not_compile_runs_its_source(tmp_path, monkeypatch):
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    package = make_tree(tmp_path, recorded=NOT_BUILT)  # (a stale extension beside it)
    finder = CompiledFinder(package)
    assert finder.built() == {} and finder.listed() == {"simcap.engine.kv": NOT_BUILT}
    assert isinstance(finder.find_spec("simcap.engine.kv").loader, SourceFileLoader)
    assert finder.loaded["simcap.engine.kv"] == "interpreted (not compiled at install)"


def test_a_module_cimporting_one_that_runs_its_source_runs_its_source_too(tmp_path, monkeypatch):
    """Its extension expects the other's extension types: loaded beside that module's source,
    its import would fail."""
    monkeypatch.delenv("SIMCAP_INTERPRETED", raising=False)
    package = make_tree(tmp_path)
    engine = package / "engine"
    (engine / "sched.py").write_text("Z = 3\n")
    (engine / "sched.pxd").write_text("# declarations\nfrom simcap.engine.kv cimport KV  # the pool\n")
    (engine / f"sched{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    digests = {name: compiled.source_sha256(engine / f"{name}.py") for name in ("kv", "sched")}

    def finder_with(kv_digest: str) -> CompiledFinder:
        (package / MANIFEST).write_text(f"simcap.engine.kv {kv_digest}\n"
                                        f"simcap.engine.sched {digests['sched']}\n")
        return CompiledFinder(package)

    finder = finder_with(digests["kv"])
    assert compiled_states(finder) == {"simcap.engine.kv": "compiled", "simcap.engine.sched": "compiled"}
    for kv in ("0" * 64, NOT_BUILT):
        finder = finder_with(kv)
        assert isinstance(finder.find_spec("simcap.engine.sched").loader, SourceFileLoader)
        assert finder.loaded["simcap.engine.sched"] == \
            "interpreted (cimports simcap.engine.kv, which runs interpreted)"


def compiled_states(finder: CompiledFinder) -> dict[str, str]:
    return {name: "compiled" if finder.decide(name)[1] is None else "interpreted"
            for name in finder.listed()}


def test_cimported_reads_both_forms_and_ignores_comments(tmp_path):
    pxd = tmp_path / "m.pxd"
    pxd.write_text("# from simcap.x cimport Nothing\nfrom simcap.engine.request cimport Request\n"
                   "cimport simcap.engine.kv_cache as kv\ncdef class A:\n    cdef public object b\n")
    assert cimported(str(pxd)) == ["simcap.engine.request", "simcap.engine.kv_cache"]
    assert cimported(str(tmp_path / "none.pxd")) == []
    assert cimported(str(ROOT / "simcap" / "simulation" / "fast_forward.pxd")) == [
        "simcap.engine.kv_cache", "simcap.engine.request", "simcap.engine.scheduler"]


def test_the_finder_comes_first_once():
    import simcap  # noqa: F401  (installs it)

    compiled.install()
    finders = [f for f in sys.meta_path if isinstance(f, CompiledFinder)]
    assert len(finders) == 1 and sys.meta_path[0] is finders[0]


def built() -> dict[str, str]:
    return CompiledFinder().built()


def listed_modules() -> list[dict]:
    """``ext-modules`` of pyproject.toml: the modules the install compiles."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]


def test_ci_builds_the_compiled_engine():
    """The project's own install (``pip install -e .``) compiles every listed module, and in
    this process each runs compiled. Off CI, a machine without a C compiler may run the source."""
    if not built() and not os.environ.get("CI"):
        pytest.skip("no compiled engine modules were built at install on this machine")
    import simcap.simulation.simulator  # noqa: F401

    listed = listed_modules()
    assert set(built()) == {ext["name"] for ext in listed}
    states = compiled.status()
    if os.environ.get("SIMCAP_INTERPRETED"):
        pytest.skip("SIMCAP_INTERPRETED is set")
    assert all(state == "compiled" for name, state in states.items()
               if name in sys.modules), states
    from simcap.engine.request import Request

    assert not Request.__flags__ & (1 << 9), "Request is not an extension type"  # HEAPTYPE


def run(args: list[str], interpreted: bool) -> bytes:
    env = {k: v for k, v in os.environ.items() if k != "SIMCAP_INTERPRETED"}
    if interpreted:
        env["SIMCAP_INTERPRETED"] = "1"
    done = subprocess.run([sys.executable, "-m", "simcap", *args], cwd=ROOT, env=env,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout


SPEC = ["--set", "speculative={method: eagle3, num_speculative_tokens: 3, acceptance_length: 2.4}",
        "--set", "step_time.draft_per_pass=0.0005"]


@pytest.mark.parametrize("args", [
    ["simulate", "examples/chat.yaml", "--json"],
    ["simulate", "examples/shared-prefix.yaml", "--json", "--set", "engine.num_gpu_blocks=400"],
    ["simulate", "examples/closed-loop.yaml", "--json"],
    ["simulate", "examples/chat-sessions.yaml", "--json"],
    ["simulate", "examples/fleet.yaml", "--json"],
    ["simulate", "examples/chat.yaml", "--json", *SPEC, "--set", "step_time.noise={decode: {kind: lognormal, sigma: 0.2}, spec: {kind: lognormal, sigma: 0.3}}"],
    ["simulate", "examples/chat.yaml", "--json", "--set", "workload.num_requests=300", *SPEC,
     "--set", "workload.arrival.rate=8", "--set", "engine.num_gpu_blocks=150"],
], ids=["chat", "prefix-preempting", "closed-loop", "sessions", "fleet", "eagle3-noise",
        "eagle3-preempting"])
def test_compiled_and_interpreted_engines_print_the_same_bytes(args):
    """(The two preempting cases preempt: 55 and 114 times.)"""
    if not built():
        pytest.skip("no compiled engine modules were built at install on this machine")
    compiled_out = run(args, interpreted=False)
    assert compiled_out == run(args, interpreted=True)
    assert b'"completed"' in compiled_out
    if "engine.num_gpu_blocks" in " ".join(args):
        assert json.loads(compiled_out)["preemptions"] > 0


def test_version_says_how_the_engine_runs():
    out = run(["version"], interpreted=True).decode()
    assert "engine modules interpreted" in out
    if built():
        assert "engine modules compiled:" in run(["version"], interpreted=False).decode()


def declared_fields(pxd: Path) -> dict[str, set[str]]:
    """``cdef class NAME:`` -> the ``cdef public object`` fields under it, and whether it keeps
    a ``__dict__`` (the pseudo-field ``__dict__``)."""
    classes: dict[str, set[str]] = {}
    current = None
    for line in pxd.read_text().splitlines():
        words = line.split()
        if line.startswith("cdef class "):
            current = classes.setdefault(words[2].rstrip(":"), set())
        elif current is not None and words[:3] == ["cdef", "public", "object"]:
            current.add(words[3])
        elif current is not None and words[:3] == ["cdef", "dict", "__dict__"]:
            current.add("__dict__")
    return classes


def attributes_set(source: Path, name: str) -> set[str]:
    """The class's ``__slots__``, or else every ``self.X`` its methods assign, plus
    ``__dict__``."""
    import ast

    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    for statement in cls.body:
        if isinstance(statement, ast.Assign) and any(
                getattr(t, "id", None) == "__slots__" for t in statement.targets):
            return {e.value for e in statement.value.elts}
    names = {"__dict__"}
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for t in getattr(target, "elts", [target]):
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                    names.add(t.attr)
    return names


DECLARATIONS = sorted((ROOT / "simcap").rglob("*.pxd"))


def test_there_are_declarations_and_each_module_is_compiled():
    listed = listed_modules()
    modules = {ext["name"] for ext in listed}
    assert all(ext["sources"] == [f"{ext['name'].replace('.', '/')}.py"] for ext in listed)
    assert DECLARATIONS
    for pxd in DECLARATIONS:
        module = ".".join(pxd.relative_to(ROOT).with_suffix("").parts)
        assert module in modules, f"{pxd} declares a module pyproject.toml does not compile"


@pytest.mark.parametrize("pxd", DECLARATIONS, ids=lambda p: p.name)
def test_declared_fields_are_the_attributes_the_class_sets(pxd):
    """A field the class sets but its declaration lacks fails on a compiled engine (a slotted
    class) or is looked up by name (one with ``__dict__``); one declared but never set reads
    as None there, where the source would raise AttributeError."""
    for name, fields in declared_fields(pxd).items():
        assert fields == attributes_set(pxd.with_suffix(".py"), name), name
