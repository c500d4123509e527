"""Capacity search: a scenario whose safe and saturation rates are known by construction.

The construction: one request at a time (max_num_seqs 1), one output token (the prefill step
finishes the request), a constant step of D = 10 ms, and near-deterministic arrivals (gamma
with a huge shape). That is a D/D/1 queue with service rate mu = 1/D = 100 req/s: below mu
every request finds the engine idle and TTFT = D exactly; above mu the queue grows linearly
and TTFT p95 runs to tens of milliseconds within seconds. So with SLO TTFT p95 <= 1.5 D the
safe rate is just below 100 req/s, and a saturated run completes exactly 100 req/s.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from simcap.cli import app
from simcap.studies.capacity import (
    CapacityPoint,
    at_rate,
    find_capacity,
    parse_rates,
    parse_slo,
    safe_rate_of,
)
from simcap.config.scenario import parse_scenario
from simcap.errors import ScenarioError
from simcap.workloads.requests import Workload

ROOT = Path(__file__).resolve().parents[1]
D = 0.01  # seconds per step
MU = 1.0 / D
SLO = {"ttft_p95": 1.5 * D}


def dd1_data(**workload) -> dict:
    return {
        "name": "dd1",
        "engine": dict(max_num_seqs=1, max_num_batched_tokens=64, block_size=16,
                       num_gpu_blocks=64, max_model_len=256, enable_prefix_caching=False),
        "step_time": dict(base=D, per_prefill_token=0.0, per_decode_token=0.0),
        "workload": {"arrival": {"process": "gamma", "rate": 10.0, "burstiness": 1.0e6},
                     "duration_s": 10.0, "input_len": 16, "output_len": 1, **workload},
        "seed": 0,
    }


@pytest.fixture(scope="module")
def dd1():
    return parse_scenario(dd1_data())


@pytest.fixture(scope="module")
def grid_result(dd1):
    return find_capacity(dd1, SLO, rates=[50, 90, 99, 101, 110, 150], duration_s=10.0,
                         replicates=2, probe_saturation=False)


def test_grid_safe_rate_is_the_queueing_bound(grid_result):
    r = grid_result
    assert r.safe_offered_rate == 99
    assert r.safe_rate == pytest.approx(99, rel=0.01)  # measured: arrivals / duration
    passed = {p.rate: p.passed for p in r.points}
    assert [passed[x] for x in (50, 90, 99, 101, 110, 150)] == [True] * 3 + [False] * 3
    for p in r.points:
        if p.rate < MU:
            assert p.values["ttft_p95"] == pytest.approx(D)
        assert p.seed == p.replicate  # replicate r uses seed + r


def test_saturation_rate_is_the_service_rate(grid_result):
    r = grid_result
    assert r.saturation_rate == pytest.approx(MU, rel=0.01)
    sat = {p.rate: p.saturated for p in r.points}
    # 1% over mu loses only 1% of the window's arrivals: below the 5% criterion.
    assert not any(sat[x] for x in (50, 90, 99, 101)) and sat[110] and sat[150]


def test_pass_fail_is_monotone_in_rate(grid_result):
    by_rate: dict[float, bool] = {}
    for p in grid_result.points:
        by_rate[p.rate] = by_rate.get(p.rate, True) and p.passed
    verdicts = [by_rate[r] for r in sorted(by_rate)]
    assert verdicts == sorted(verdicts, reverse=True)  # passes, then only failures


def test_auto_search_brackets_and_bisects_within_bounds(dd1):
    r = find_capacity(dd1, SLO, auto=True, duration_s=10.0, replicates=1, rel_tol=0.02,
                      max_points=12)
    searched = sorted({p.rate for p in r.points if p.role == "search"})
    assert len(searched) <= 12
    lo = r.safe_offered_rate
    hi = min(p.rate for p in r.points if not p.passed)
    assert lo < MU * 1.005 and hi > MU * 0.995  # the bracket holds the true boundary
    assert hi - lo <= 0.02 * hi
    assert r.saturation_rate == pytest.approx(MU, rel=0.01)
    assert r.mode == "auto"


def test_prefix_rule_ignores_a_pass_above_a_failure():
    def pt(rate, rep, ok):
        return CapacityPoint(rate=rate, replicate=rep, seed=rep, measured_rate=rate * 0.98,
                             values={"ttft_p95": 1.0}, slo_pass={"ttft_p95": ok},
                             samples_adequate={"ttft_p95": True}, passed=ok, completed=1,
                             arrived_in_window=1, completed_in_window=1, completion_rate=rate,
                             saturated=False)

    points = [pt(1, 0, True), pt(1, 1, True), pt(2, 0, True), pt(2, 1, False),
              pt(3, 0, True), pt(3, 1, True)]
    assert safe_rate_of(points) == (1, pytest.approx(0.98))
    assert safe_rate_of(points[:2] + points[4:]) == (3, pytest.approx(2.94))
    assert safe_rate_of([pt(1, 0, False)] + points[2:3]) == (None, None)


def test_samples_adequate_flags_follow_the_sample_count(dd1):
    r = find_capacity(dd1, SLO, rates=[5, 50], duration_s=10.0, replicates=1,
                      probe_saturation=False)
    flags = {p.rate: p.samples_adequate["ttft_p95"] for p in r.points}
    assert flags == {5: False, 50: True}  # 51 vs 501 requests; p95 needs 130 (MLPerf)
    assert any("too few samples" in n for n in r.notes)
    assert r.to_dict()["points"][0]["samples_adequate"] == {"ttft_p95": False, "tpot_p95": False}


def test_bootstrap_sets_give_a_safe_rate_interval(tmp_path):
    profile = {
        "name": "p", "step_time": {"base": D, "per_prefill_token": 0.0, "per_decode_token": 0.0},
        "bootstrap": [{"base": 0.008}, {"base": 0.01}, {"base": 0.0125}],  # mu 125, 100, 80
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(profile))
    data = dd1_data()
    del data["step_time"]
    data["profile"] = "p.yaml"
    scenario = parse_scenario(data, base_dir=tmp_path)
    r = find_capacity(scenario, SLO, rates=[50, 90, 99, 101, 110], duration_s=10.0,
                      replicates=1, probe_saturation=False)
    lo, hi = r.safe_rate_interval
    info = r.interval_info
    assert info["num_sets"] == 3 and len(info["safe_rates"]) == 3
    assert 70 < lo < 82 and 112 < hi <= 126
    assert lo <= r.safe_rate <= hi


def test_closed_loop_scenario_is_run_open_loop(tmp_path):
    data = dd1_data(arrival={"process": "closed", "concurrency": 2})
    r = find_capacity(parse_scenario(data), SLO, rates=[50], duration_s=5.0, replicates=1,
                      probe_saturation=False)
    assert r.points[0].measured_rate == pytest.approx(50, rel=0.3)
    assert r.provenance["arrival_process"] == "poisson"


@pytest.mark.parametrize(
    "items, field",
    [(["ttft_p95"], "--slo"), (["ttft_p97=2"], "slo.ttft_p97"), (["ttft_p95=abc"], "slo.ttft_p95"),
     (["ttft_p95=-1"], "slo.ttft_p95"), (["=2"], "--slo")],
)
def test_bad_slo_names_the_field(items, field):
    with pytest.raises(ScenarioError, match=f"^{field}"):
        parse_slo(items)


def test_slo_units_and_rates():
    assert parse_slo(["ttft_p95=2", "tpot_p95=50ms"]) == {"ttft_p95": 2.0, "tpot_p95": 0.05}
    assert parse_rates("3,1,2") == [1.0, 2.0, 3.0]
    assert parse_rates("1:3:3") == [1.0, 2.0, 3.0]
    for bad in ("a,b", "0,1", "1:2", "3:1:2"):
        with pytest.raises(ScenarioError, match="^--rates"):
            parse_rates(bad)


def test_no_slo_is_an_error(dd1):
    with pytest.raises(ScenarioError, match="^slo"):
        find_capacity(dd1, None, rates=[10], duration_s=1.0)


def _cli(*args):
    """The command in-process (a subprocess per case costs seconds of imports)."""
    return CliRunner().invoke(app, list(args))


def test_cli_json_shape(tmp_path):
    path = tmp_path / "dd1.yaml"
    path.write_text(yaml.safe_dump(dd1_data()))
    proc = _cli("capacity", str(path), "--slo", "ttft_p95=0.015", "--rates", "50,110",
                "--duration", "5", "--replicates", "2", "--json", "--plot", str(tmp_path / "c.png"))
    assert proc.exit_code == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {"safe_rate", "saturation_rate", "points", "safe_rate_interval", "provenance"} <= set(data)
    assert data["safe_rate"] == pytest.approx(50, rel=0.05)
    assert data["saturation_rate"] == pytest.approx(MU, rel=0.02)
    assert len(data["points"]) == 4
    for p in data["points"]:
        assert {"rate", "measured_rate", "replicate", "ttft_p95", "tpot_p95", "pass",
                "samples_adequate"} <= set(p)
    assert data["provenance"]["seeds"] == [0, 1]
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "figure:" in proc.stderr  # stdout stays pure JSON


@pytest.mark.parametrize(
    "args, field",
    [(["--slo", "ttft_p95"], "--slo"), (["--slo", "latency_p95=1"], "slo.latency_p95"),
     (["--slo", "ttft_p95=1", "--rates", "x"], "--rates"),
     (["--slo", "ttft_p95=1", "--set", "engine.max_num_seqs=0", "--rates", "1"], "engine.max_num_seqs")],
)
def test_cli_bad_input_is_one_line_exit_2(args, field):
    proc = _cli("capacity", str(ROOT / "examples/chat.yaml"), *args)
    assert proc.exit_code == 2
    assert proc.stderr.startswith(f"error: {field}") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("arrival", [
    {"process": "poisson", "rate": 1.0},
    {"process": "gamma", "rate": 1.0, "burstiness": 0.4},
])
def test_rates_share_common_random_numbers(arrival):
    """Replicate r's runs at two rates have the same requests (lengths, prefix groups) and
    arrival times in the ratio of the rates: the unit-rate gaps are drawn once per seed."""
    scenario = parse_scenario(dd1_data(
        arrival=arrival, input_len={"dist": "uniform", "low": 40, "high": 200},
        output_len={"dist": "uniform", "low": 1, "high": 50},
        prefix={"shared_tokens": 20, "num_prefixes": 3},
    ))
    runs = {}
    for rate in (3.0, 7.5):
        s = at_rate(scenario, rate, duration_s=200.0, seed=scenario.seed + 1, slo=SLO)
        w = Workload(s.workload, s.seed)
        runs[rate] = (w.arrival_times(), [w.spec(i) for i in range(2000)])
    (slow, slow_specs), (fast, fast_specs) = runs[3.0], runs[7.5]
    assert slow_specs == fast_specs
    n = len(slow)
    assert 400 < n < len(fast)
    np.testing.assert_allclose(fast[:n] * 7.5, slow * 3.0, rtol=1e-12, atol=1e-12)
    other = Workload(at_rate(scenario, 3.0, duration_s=200.0, seed=scenario.seed).workload, 0)
    assert not np.array_equal(other.arrival_times()[:n], slow[:n])  # replicates differ
