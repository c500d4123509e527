"""``simcap live validate --record DIR`` against the real vLLM: a case recorded in one command,
extended by a second, and replayed by ``simcap accuracy`` the same way twice."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from simcap.accuracy.corpus import load_case
from simcap.cli.main import app
from simcap.live.recording import load_run

from .conftest import ENGINE

pytestmark = pytest.mark.live


def test_a_live_run_becomes_a_corpus_case(vllm_server, base_url, live_cli, write_yaml, tmp_path):
    scenario = write_yaml(tmp_path / "c2.yaml", {
        "name": "record-c2", "engine": {**ENGINE, "async_scheduling": False}, "seed": 5,
        "workload": {"arrival": {"process": "closed", "concurrency": 2}, "num_requests": 8,
                     "input_len": {"dist": "uniform", "low": 64, "high": 160}, "output_len": 16},
    })
    case_dir = tmp_path / "corpus" / "mini"
    args = ["validate", str(scenario), "--base-url", base_url, "--log", str(vllm_server.log_path),
            "--record", str(case_dir), "--point", "c2"]
    code, out, err = live_cli(*args, "--repeats", "2", "--calibrate-up-to", "2", "--mechanism", "closed loop")
    assert code == 0, err
    assert "recorded: 2 run(s) of point c2" in out
    case = load_case(case_dir)
    assert case.kind == "live" and case.mechanisms == ["closed loop"]
    assert case.fit.runs and case.fit.engine["num_gpu_blocks"] == ENGINE["num_gpu_blocks"]
    assert [r.instance for r in case.points[0].runs] == [0, 0]
    fit = load_run(case_dir / case.fit.runs[0])
    assert fit.iteration_lines and fit.run.metrics_before.text  # the log window and /metrics, kept
    first = load_run(case_dir / case.points[0].runs[0].file)
    assert len(first.run.records) == 8 and all(r.client_id is not None for r in first.run.records)
    assert any("Iteration(" in line for line in first.iteration_lines)

    # The same command again is another server instance of the same point; no new calibration.
    code, out, err = live_cli(*args, "--repeats", "1")
    assert code == 0, err
    case = load_case(case_dir)
    assert [r.instance for r in case.points[0].runs] == [0, 0, 1]
    assert len(case.fit.runs) == len(load_case(case_dir).fit.runs)

    runner = CliRunner()
    replays = [runner.invoke(app, ["accuracy", str(case_dir.parent), "--json"]) for _ in range(2)]
    assert all(r.exit_code == 0 for r in replays), replays[0].output
    data = [json.loads(r.stdout)["cases"] for r in replays]
    assert data[0] == [{**c, "wall_s": d["wall_s"]} for c, d in zip(data[1], data[0])]  # same figures
    figures = data[0][0]["figures"]
    assert {f["metric"] for f in figures} >= {"ttft_p50", "tpot_p50", "e2e_p95", "output_throughput"}
    assert all(f["runs"] == 3 and f["spread"] is not None for f in figures)
    for f in figures:
        print(f"  {f['metric']:18s} measured {f['measured']:.4g} predicted {f['predicted']:.4g} "
              f"({f['error'] * 100:+.1f}%, instance spread {f['spread'] * 100:.1f}%)")
