"""Sweeps: grid order, determinism, parallel == serial, CSV/JSON shape, bad input."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simcap.cli import app
from simcap.errors import ScenarioError
from simcap.studies.sweep import DEFAULT_METRICS, grid_points, parse_grid, run_sweep

ROOT = Path(__file__).resolve().parents[1]

SCENARIO = {
    "name": "tiny",
    "engine": dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=16,
                   num_gpu_blocks=400, max_model_len=1024),
    "step_time": dict(base=0.004, per_prefill_token=1.0e-5, per_decode_token=5.0e-5),
    "workload": {"arrival": {"process": "poisson", "rate": 20.0}, "num_requests": 60,
                 "input_len": {"dist": "uniform", "low": 64, "high": 256}, "output_len": 24},
    "slo": {"ttft_p95": 0.5},
    "seed": 3,
}
GRID = {"engine.max_num_batched_tokens": [128, 512], "engine.max_num_seqs": [2, 4, 8]}


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "tiny.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    return path


@pytest.fixture(scope="module")
def serial(scenario_file):
    return run_sweep(scenario_file, GRID, workers=1)


def test_rows_follow_grid_order_first_key_slowest(serial):
    got = [(r["engine.max_num_batched_tokens"], r["engine.max_num_seqs"]) for r in serial.rows]
    assert got == [(128, 2), (128, 4), (128, 8), (512, 2), (512, 4), (512, 8)]
    assert serial.metrics == list(DEFAULT_METRICS)
    assert all(isinstance(r["ttft_s.p95"], float) for r in serial.rows)
    # the knob matters: more seqs, less queueing
    assert serial.rows[0]["ttft_s.p95"] > serial.rows[2]["ttft_s.p95"]


def test_parallel_equals_serial_and_is_deterministic(scenario_file, serial):
    seen = []
    parallel = run_sweep(scenario_file, GRID, workers=2, progress=lambda d, n: seen.append((d, n)))
    assert parallel.rows == serial.rows
    assert parallel.to_json() == serial.to_json()
    assert seen[0] == (0, 6) and seen[-1] == (6, 6) and len(seen) == 7


def test_csv_and_json_shape(serial):
    rows = list(csv.reader(io.StringIO(serial.to_csv())))
    assert rows[0] == list(GRID) + list(DEFAULT_METRICS)
    assert len(rows) == 7 and all(len(r) == len(rows[0]) for r in rows)
    assert float(rows[1][rows[0].index("ttft_s.p95")]) == serial.rows[0]["ttft_s.p95"]
    data = json.loads(serial.to_json())
    assert data["grid"] == list(GRID) and len(data["rows"]) == 6
    assert data["provenance"]["seed"] == 3


def test_chosen_metrics_and_base_overrides(scenario_file):
    r = run_sweep(scenario_file, ["engine.max_num_seqs=2,8"], ["ttft_s.p95", "num_steps"],
                  overrides=["workload.num_requests=20"])
    assert list(r.rows[0]) == ["engine.max_num_seqs", "ttft_s.p95", "num_steps"]
    assert r.provenance["overrides"] == ["workload.num_requests=20"]


def test_parse_grid_values():
    grid = parse_grid(["engine.max_num_seqs=16, 32", "engine.enable_prefix_caching=true,false",
                       "x.y=[1,2],3"])
    assert grid == {"engine.max_num_seqs": [16, 32], "engine.enable_prefix_caching": [True, False],
                    "x.y": [[1, 2], 3]}
    assert grid_points({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]


@pytest.mark.parametrize(
    "grid, metrics, field",
    [(["engine.max_num_seqs"], None, "--grid"),
     (["engine.max_num_seqs=4,"], None, "engine.max_num_seqs"),
     (["engine.max_num_sqs=4,8"], None, "engine.max_num_sqs: unknown key"),
     (["engine.max_num_seqs=4,abc"], None, "engine.max_num_seqs"),
     (["engine.max_num_seqs=0,4"], None, "engine.max_num_seqs"),
     (["engine.max_num_seqs=4"], ["ttft_s.p97"], "--metric ttft_s.p97"),
     (["engine.max_num_seqs=4"], ["ttft_s"], "--metric ttft_s")],
)
def test_bad_input_names_the_field(scenario_file, grid, metrics, field):
    with pytest.raises(ScenarioError, match=f"^{field}"):
        run_sweep(scenario_file, grid, metrics)


def _cli(*args):
    """The command in-process (a subprocess per case costs seconds of imports)."""
    return CliRunner().invoke(app, list(args))


def test_cli_csv(scenario_file):
    proc = _cli("sweep", str(scenario_file), "--grid", "engine.max_num_seqs=2,8", "--csv",
                "--metric", "ttft_s.p95", "--metric", "slo_pass", "--workers", "1")
    assert proc.exit_code == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "engine.max_num_seqs,ttft_s.p95,slo_pass" and len(lines) == 3
    assert lines[1].startswith("2,") and lines[2].startswith("8,")


@pytest.mark.parametrize(
    "args, field",
    [(["--grid", "engine.nope=1,2"], "engine.nope"),
     (["--grid", "engine.max_num_seqs=x"], "engine.max_num_seqs"),
     (["--grid", "engine.max_num_seqs=1", "--backend", "dask"], "--backend")],
)
def test_cli_bad_grid_is_one_line_exit_2(scenario_file, args, field):
    proc = _cli("sweep", str(scenario_file), *args)
    assert proc.exit_code == 2
    assert proc.stderr.startswith(f"error: {field}") and proc.stderr.count("\n") == 1


def test_ray_missing_is_a_one_line_error(scenario_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(Exception, match="Ray is not installed"):
        run_sweep(scenario_file, ["engine.max_num_seqs=2"], backend="ray")


def test_ray_backend_matches_local(scenario_file, serial):
    import ray  # in the test extra: the Ray backend runs in every default test run

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        result = run_sweep(scenario_file, GRID, backend="ray")
    finally:
        ray.shutdown()
    assert result.rows == serial.rows
    assert result.provenance["backend"] == "ray"
