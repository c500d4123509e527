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

# Run the CLI in-process with the given argv, then print the top-level packages loaded.
_RUN_CLI = """
import json, runpy, sys
sys.argv = ["simcap", *json.loads(sys.argv[1])]
try:
    runpy.run_module("simcap", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}), file=sys.stderr)
"""


def loaded_by(code: str, *args: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    code += "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def loaded_by_cli(*argv: str) -> set[str]:
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


def test_simulate_ci_loads_no_fits(tmp_path):
    profile = ROOT / "calibration" / "profiles" / "ascend910b4-minimax-m2.7.yaml"
    scenario = tmp_path / "ci.yaml"
    scenario.write_text(f"profile: {profile}\nworkload: {{arrival: {{process: closed, concurrency: 2}}, "
                        "num_requests: 4, input_len: 100, output_len: 8}\n")
    loaded = loaded_by_cli("simulate", str(scenario), "--ci", "--json")
    assert not loaded & set(HEAVY)  # the intervals, not the fits behind them


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
    # ``validate`` is both a function and a module of simcap.live: the package gives the function
    # when nothing imported the module first (it did before the exports were lazy, too).
    assert loaded_by("from simcap.live import validate\nassert callable(validate)") >= {"httpx"}
