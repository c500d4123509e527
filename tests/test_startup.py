"""Start-up: ``import simcap``, ``simcap --help`` and ``simcap simulate`` load only what they use.

Each case runs in a fresh interpreter (the test process has imported everything already) and
reads ``sys.modules`` at its end. Times are measured by ``benchmarks/bench_startup.py``, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Packages no start-up path may load unless its command needs them.
HEAVY = ("scipy", "matplotlib", "httpx", "prometheus_client")

# Run the CLI in-process with the given argv, then print its exit code and every module loaded.
_RUN_CLI = """
import json, runpy, sys
sys.argv = ["simcap", *json.loads(sys.argv[1])]
try:
    runpy.run_module("simcap", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def packages(modules: set[str]) -> set[str]:
    """The top-level packages of ``modules``."""
    return {m.split(".")[0] for m in modules}


def loaded_by(code: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    code += "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def loaded_by_cli(*argv: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after ``simcap ARGV`` (exit 0) in a fresh interpreter."""
    return packages(modules_of_cli(*argv))


def modules_of_cli(*argv: str) -> set[str]:
    """Every module in ``sys.modules`` after ``simcap ARGV`` (exit 0) in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _RUN_CLI, json.dumps(argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    last = json.loads(done.stderr.strip().splitlines()[-1])
    assert last["code"] in (0, None), done.stderr
    return set(last["modules"])


def test_import_simcap_loads_no_third_party_package():
    loaded = loaded_by("import simcap")
    assert not loaded & {*HEAVY, "numpy", "pydantic", "simpy", "yaml", "rich", "typer"}


def test_import_scenario_loads_no_numpy():
    """A trace's reader imports numpy when it reads one; ``simcap kv`` never needs it."""
    loaded = loaded_by("import simcap.config.scenario")
    assert not loaded & {*HEAVY, "numpy", "simpy", "rich", "typer"}
    assert not loaded_by_cli("kv", "examples/ascend910b4-kv.yaml") & {*HEAVY, "numpy", "simpy"}


def test_import_cli_loads_only_typer():
    loaded = loaded_by("import simcap.cli")
    assert "typer" in loaded
    assert not loaded & {*HEAVY, "numpy", "pydantic", "simpy", "yaml", "rich"}


def test_help_loads_no_model_or_live_stack():
    loaded = loaded_by_cli("--help")
    assert not loaded & {*HEAVY, "numpy", "simpy", "yaml"}
    assert not loaded & {*HEAVY, "numpy"}, loaded_by_cli("live", "--help")


def test_simulate_command_loads_no_scipy_plots_or_live_stack():
    loaded = loaded_by_cli("simulate", "examples/chat.yaml", "--set", "workload.num_requests=20")
    assert {"numpy", "simpy", "pydantic", "rich"} <= loaded  # it did simulate and render
    assert not loaded & set(HEAVY)
    assert "rich" not in loaded_by_cli("simulate", "examples/chat.yaml", "--json",
                                       "--set", "workload.num_requests=20")


def test_tables_print_emoji_codes_as_written():
    """A scenario name with an emoji code prints as given, and rich's emoji table stays
    unloaded."""
    done = subprocess.run([sys.executable, "-c", _RUN_CLI, json.dumps(
        ["simulate", "examples/chat.yaml", "--set", "workload.num_requests=20", "--set", "name=a:fire:b"])],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = json.loads(done.stderr.strip().splitlines()[-1])
    assert last["code"] in (0, None), done.stderr
    assert "scenario a:fire:b sha256" in " ".join(done.stdout.split())
    assert "rich._emoji_codes" not in last["modules"]


def profiled_scenario(tmp_path: Path, arrival: str) -> str:
    """A small scenario on a shipped profile with bootstrap coefficient sets."""
    profile = ROOT / "calibration" / "profiles" / "ascend910b4-minimax-m2.7.yaml"
    scenario = tmp_path / "profiled.yaml"
    scenario.write_text(f"profile: {profile}\nworkload: {{arrival: {arrival}, num_requests: 4, "
                        "input_len: 100, output_len: 8}\nslo: {ttft_p95: 2.0}\n")
    return str(scenario)


def test_intervals_load_no_fits(tmp_path):
    """``simulate --ci`` and the capacity interval rerun bootstrap sets; they fit nothing."""
    closed = profiled_scenario(tmp_path, "{process: closed, concurrency: 2}")
    assert not loaded_by_cli("simulate", closed, "--ci", "--json") & set(HEAVY)
    poisson = profiled_scenario(tmp_path, "{process: poisson, rate: 1}")
    modules = modules_of_cli("capacity", poisson, "--rates", "0.5,1", "--duration", "5",
                             "--replicates", "1", "--interval-sets", "2", "--json")
    assert "simcap.calibrate.fit_bench" in modules  # the interval ran, with the fit's helpers
    assert not packages(modules) & set(HEAVY)


def test_library_simulate_loads_no_scipy_plots_or_live_stack():
    loaded = loaded_by(
        "import simcap\n"
        "r = simcap.simulate(simcap.load_scenario('examples/chat.yaml', ['workload.num_requests=20']))\n"
        "assert r.summary.completed == 20"
    )
    assert not loaded & {*HEAVY, "rich", "typer"}


def test_lazy_exports_resolve_and_list():
    import simcap
    import simcap.calibrate
    import simcap.live

    for package in (simcap, simcap.calibrate, simcap.live):
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            assert getattr(package, name) is not None
        with pytest.raises(AttributeError):
            package.no_such_name  # noqa: B018
    assert simcap.simulate.__module__ == "simcap.fleet.run"
    # ``simcap.live.validate`` is the module, whatever was imported before; the function is
    # ``simcap.live.validate.validate``.
    assert loaded_by(
        "from simcap.live import validate\nassert callable(validate.validate)"
    ) >= {"httpx"}


def probe_plugin(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A pydantic plugin installed as a distribution (an entry point in the ``pydantic``
    group) that writes the name of every model or adapter it is asked to validate to a log;
    the environment that puts it on the path, and the log."""
    site = tmp_path / "site"
    info = site / "simcap_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: simcap-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pydantic]\nprobe = simcap_probe_plugin:plugin\n")
    (site / "simcap_probe_plugin.py").write_text(
        "import os\n"
        "class Probe:\n"
        "    def new_schema_validator(self, schema, schema_type, path, kind, config, settings):\n"
        "        with open(os.environ['SIMCAP_PROBE_LOG'], 'a') as log:\n"
        "            log.write(path.name + '\\n')\n"
        "        return None, None, None\n"
        "plugin = Probe()\n"
    )
    log = tmp_path / "validated.txt"
    log.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), SIMCAP_PROBE_LOG=str(log))
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)
    return env, log


def test_command_builds_scenario_models_without_pydantic_plugins(tmp_path):
    """The command loads a scenario with pydantic's plugins off (no scan of every installed
    distribution) and then restores the environment; the library keeps the user's plugins."""
    env, log = probe_plugin(tmp_path)
    library = "import simcap\nsimcap.load_scenario('examples/chat.yaml')\n"
    subprocess.run([sys.executable, "-c", library], cwd=ROOT, env=env, check=True, timeout=300)
    assert "Scenario" in log.read_text().split()  # the plugin is installed and sees the library

    log.write_text("")
    command = ("import os, sys\nfrom simcap.cli import app\n"
               "try:\n    app(['simulate', 'examples/chat.yaml', '--set', 'workload.num_requests=20'])\n"
               "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
               "print('PYDANTIC_DISABLE_PLUGINS' in os.environ, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    assert "completed 20 requests" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "False"  # restored once the scenario loaded
    assert log.read_text() == ""


# Run the command in-process, noting the garbage collector's state while the scenario loads
# and while the simulation runs, and after the command.
_GC_PROBE = """
import gc, json, sys
import simcap.config.scenario, simcap.simulation.simulator
seen = {}
def noting(stage, function):
    def noted(*args, **kwargs):
        seen[stage] = {"threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}
        return function(*args, **kwargs)
    return noted
import simcap.calibrate, simcap.studies.sweep
simcap.config.scenario.load_scenario = noting("load", simcap.config.scenario.load_scenario)
simcap.simulation.simulator.EngineWorld.run = noting("run", simcap.simulation.simulator.EngineWorld.run)
simcap.studies.sweep.run_sweep = noting("sweep", simcap.studies.sweep.run_sweep)
simcap.calibrate.calibrate = noting("calibrate", simcap.calibrate.calibrate)
before = gc.get_threshold()
from simcap.cli import app
for argv in json.loads(sys.argv[1]):
    try:
        app(argv)
    except SystemExit as exc:
        seen.setdefault("codes", []).append(exc.code)
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen_after": gc.get_freeze_count(),
                  **seen}), file=sys.stderr)
"""


def test_command_collects_rarely_while_starting_then_as_usual():
    """Start-up (imports, the scenario's models) runs with rare collections; the simulation
    with the collector's own thresholds, what start-up loaded frozen; after the command, good
    or bad input, the collector is as it was."""
    from simcap.runtime.startup import COLLECT_EVERY

    argvs = [["simulate", "examples/chat.yaml", "--set", "workload.num_requests=20", "--json"],
             ["simulate", "examples/chat.yaml", "--set", "workload.num_requests=-1"]]
    done = subprocess.run([sys.executable, "-c", _GC_PROBE, json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    assert seen["codes"] == [0, 2]
    assert seen["load"]["threshold"] >= COLLECT_EVERY
    assert seen["run"]["threshold"] == seen["before"][0] < COLLECT_EVERY
    assert seen["run"]["frozen"] > 10_000  # typer, pydantic, numpy, the scenario's models
    assert seen["after"] == seen["before"] and seen["frozen_after"] == 0


def test_sweep_and_calibrate_end_their_start_up_before_their_work(tmp_path):
    """Their work (the sweep's points, the fit) runs with the collector's own thresholds."""
    lines = ["num_decode_tokens,step_time_s"] + [f"{d},{0.005 + 1e-4 * d}" for d in range(1, 40)]
    (tmp_path / "s.csv").write_text("\n".join(lines) + "\n")
    argvs = [["sweep", "examples/chat.yaml", "--grid", "workload.num_requests=10,20", "--workers", "1",
              "--json"],
             ["calibrate", str(tmp_path / "s.csv"), "--out", str(tmp_path / "p.yaml"), "--json"]]
    done = subprocess.run([sys.executable, "-c", _GC_PROBE, json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    assert seen["codes"] == [0, 0], done.stderr[-2000:]
    assert seen["sweep"]["threshold"] == seen["calibrate"]["threshold"] == seen["before"][0]
    assert seen["after"] == seen["before"] and seen["frozen_after"] == 0
