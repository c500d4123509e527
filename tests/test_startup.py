"""Start-up: ``import simcap``, ``simcap --help`` and ``simcap simulate`` load only what they use.

Each case runs in a fresh interpreter (the test process has imported everything already) and
reads ``sys.modules`` at its end. Times are measured by ``benchmarks/bench_startup.py``, not here.
"""

from __future__ import annotations

import json
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
    assert simcap.simulate.__module__ == "simcap.simulator"
    # ``simcap.live.validate`` is the module, whatever was imported before; the function is
    # ``simcap.live.validate.validate``.
    assert loaded_by(
        "from simcap.live import validate\nassert callable(validate.validate)"
    ) >= {"httpx"}
