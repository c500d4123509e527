"""``simcap live capacity`` bookkeeping that needs no server: a live run's point, brackets,
the comparison, the engine-flag check, the search directory and resume, and bad input.

The reference for a live point is the simulator's own: the records of a simulated run, taken
as if a client had measured them, must give the point ``simcap capacity`` gives that run.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from simcap.studies.capacity import (
    CapacityPoint, at_rate, capacity_result, point_from_result, safe_rate_bracket, saturation_bracket,
)
from simcap.errors import ScenarioError
from simcap.live.rate_search import (
    CapacityStore, compare_capacity, engine_differences, live_point,
)
from simcap.cli.live import live_app
from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate
from simcap.live.prom import ServerMetrics
from simcap.metrics.records import RequestRecord

D = 0.01  # one 10 ms step a request: a D/D/1 queue, mu = 100 req/s (tests/test_capacity.py)
SLO = {"ttft_p95": 1.5 * D}
DURATION = 4.0


@pytest.fixture(scope="module")
def dd1():
    return parse_scenario({
        "name": "dd1",
        "engine": dict(max_num_seqs=1, max_num_batched_tokens=64, block_size=16, num_gpu_blocks=64,
                       max_model_len=256, enable_prefix_caching=False),
        "step_time": dict(base=D, per_prefill_token=0.0, per_decode_token=0.0),
        "workload": {"arrival": {"process": "gamma", "rate": 10.0, "burstiness": 1.0e6}, "duration_s": 10.0,
                     "input_len": 16, "output_len": 1},
        "seed": 3,
    })  # fmt: skip


def _simulated(dd1, rate, replicate=0):
    """(point simcap capacity gives the run, the run's records)."""
    sc = at_rate(dd1, rate, duration_s=DURATION, seed=dd1.seed + replicate, slo=SLO)
    result = simulate(sc, records=True)
    return point_from_result(result, rate, replicate, DURATION), list(result.records)


def _copy(recs):
    return [RequestRecord.from_dict(r.to_dict()) for r in recs]


@pytest.mark.parametrize("rate", [40.0, 80.0, 130.0])  # passes; passes; fails and saturates
def test_a_live_run_measures_as_the_simulated_run_does(dd1, rate):
    sim, recs = _simulated(dd1, rate)
    live = live_point(recs, dd1, rate=rate, replicate=0, duration_s=DURATION, slo=SLO)
    core = {f.name for f in dataclasses.fields(CapacityPoint)} - {"live"}
    assert {k: getattr(live, k) for k in core} == {k: getattr(sim, k) for k in core}
    assert live.live["rate_reached"] and live.live["failed"] == 0
    assert live.live["requests"] == len(recs)
    assert live.live["max_send_lag_s"] == pytest.approx(0.0, abs=1e-9)  # sent on schedule
    assert live.passed == (rate < 100) and live.saturated == (rate > 100)


def test_a_generator_that_fell_behind_is_marked_with_its_achieved_rate(dd1):
    _, recs = _simulated(dd1, 40.0)
    late = _copy(recs)
    n = len(late)
    # Every send slips so that the last one leaves at 1.5 x the arrival window.
    last = max(r.arrival_time for r in late)
    stretch = 1.5 * DURATION / last
    for r in late:
        shift = r.arrival_time * (stretch - 1)
        r.arrival_time += shift
        r.chunk_times = [t + shift for t in r.chunk_times]
        r.finish_time += shift
    p = live_point(late, dd1, rate=40.0, replicate=0, duration_s=DURATION, slo=SLO)
    assert p.measured_rate == pytest.approx(n / (1.5 * DURATION))
    assert p.live["achieved_rate"] == p.measured_rate and p.live["scheduled_rate"] == n / DURATION
    assert p.live["rate_reached"] is False
    assert p.live["max_send_lag_s"] == pytest.approx(1.5 * DURATION - last)  # the last send slipped most


def test_a_failed_request_fails_the_run_and_never_finishes(dd1):
    sim, recs = _simulated(dd1, 40.0)
    broken = _copy(recs)
    victim = next(r for r in broken if DURATION / 2 <= r.arrival_time < DURATION)
    victim.error, victim.finish_time, victim.chunk_times, victim.chunk_tokens = "HTTP 500", None, [], []
    p = live_point(broken, dd1, rate=40.0, replicate=0, duration_s=DURATION, slo=SLO)
    assert sim.passed and not p.passed and p.slo_pass == {"ttft_p95": True}
    assert p.live["failed"] == 1 and p.completed == sim.completed - 1
    assert p.completed_in_window == sim.completed_in_window - 1
    assert p.measured_rate == sim.measured_rate  # it was sent


def _pt(rate, rep, ok, measured, saturated=False, role="search"):
    return CapacityPoint(rate=rate, replicate=rep, seed=rep, measured_rate=measured, values={"ttft_p95": 1.0},
                         slo_pass={"ttft_p95": ok}, samples_adequate={"ttft_p95": True}, passed=ok,
                         completed=1, arrived_in_window=1, completed_in_window=1,
                         completion_rate=9.5 if saturated else measured, saturated=saturated, role=role)


def test_brackets_and_the_comparison():
    points = [_pt(1, 0, True, 0.97), _pt(1, 1, True, 1.04), _pt(2, 0, True, 2.1), _pt(2, 1, False, 1.9),
              _pt(4, 0, False, 4.2, True), _pt(4, 1, False, 3.8, True), _pt(6, 0, False, 6.1, True, "probe")]
    assert safe_rate_bracket(points) == (0.97, 1.9)  # the failing replicate's rate, not 2.1
    assert saturation_bracket(points) == (2.1, 3.8)  # below the first saturating rate, 4
    noisy = [_pt(1, 0, True, 1.0), _pt(2, 0, True, 2.2, True), _pt(3, 0, True, 3.1), _pt(4, 0, False, 3.9, True)]
    assert saturation_bracket(noisy) == (1.0, 2.2)  # the run that kept up at 3 is above it: not trusted
    assert safe_rate_bracket(points[:2]) == (0.97, None)  # nothing failed: open above
    assert safe_rate_bracket(points[3:4]) == (None, 1.9)  # nothing passed: open below
    measured = capacity_result(points, {"ttft_p95": 1.0}, duration_s=5, replicates=2, mode="auto")
    inside = capacity_result([_pt(1, 0, True, 1.5), _pt(2, 0, False, 3.0, True)], {"ttft_p95": 1.0},
                             duration_s=5, replicates=1, mode="auto")
    c = compare_capacity(measured, inside)
    assert c["safe_rate"] == {"measured": 0.97, "bracket": [0.97, 1.9], "predicted": 1.5,
                              "rel_error": pytest.approx(1.5 / 0.97 - 1), "in_bracket": True}
    assert c["saturation_rate"]["measured"] == 9.5 and c["saturation_rate"]["bracket"] == [2.1, 3.8]
    assert c["saturation_rate"]["predicted"] == 9.5 and c["saturation_rate"]["in_bracket"] is False
    assert compare_capacity(measured, None)["safe_rate"]["in_bracket"] is None


def test_engine_differences_name_each_flag(dd1):
    snap = ServerMetrics(time=0.0, cache_config={"block_size": "32", "num_gpu_blocks": "64",
                                                 "enable_prefix_caching": "True"})
    diff = engine_differences(dd1, snap, 2048)
    assert diff == {"block_size": (32, 16), "enable_prefix_caching": (True, False), "max_model_len": (2048, 256)}
    same = ServerMetrics(time=0.0, cache_config={"block_size": "16", "num_gpu_blocks": "64",
                                                 "enable_prefix_caching": "False"})
    assert engine_differences(dd1, same, 256) == {} and engine_differences(dd1, None, None) == {}


def test_the_store_keeps_finished_runs_and_reruns_a_half_done_one(dd1, tmp_path):
    settings = {"scenario_sha256": dd1.digest(), "duration_s": DURATION, "replicates": 2}
    store = CapacityStore(tmp_path / "search", settings, resume=False)
    kept = {}
    for rate in (40.0, 80.0):
        _, recs = _simulated(dd1, rate)
        path = store.records_path(rate, 0)
        path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in recs))
        p = live_point(recs, dd1, rate=rate, replicate=0, duration_s=DURATION, slo=SLO, facts={"wall_s": 4.2})
        store.finish(p, {"wall_s": 4.2})
        kept[rate] = p
    # A third run killed half-way: records on disk, no line in points.jsonl.
    _, recs = _simulated(dd1, 130.0)
    store.records_path(130.0, 0).write_text(json.dumps(recs[0].to_dict()) + "\n")

    with pytest.raises(ScenarioError, match="already holds a capacity search; --resume"):
        CapacityStore(tmp_path / "search", settings, resume=False)
    with pytest.raises(ScenarioError, match=r"--resume: duration_s differs .*there 4.0, now 5.0"):
        CapacityStore(tmp_path / "search", {**settings, "duration_s": 5.0}, resume=True)
    with pytest.raises(ScenarioError, match="no capacity search in"):
        CapacityStore(tmp_path / "elsewhere", settings, resume=True)

    again = CapacityStore(tmp_path / "search", settings, resume=True)
    for rate, p in kept.items():
        recs, facts = again.load(rate, 0)
        assert facts == {"wall_s": 4.2}
        redone = live_point(recs, dd1, rate=rate, replicate=0, duration_s=DURATION, slo=SLO, facts=facts)
        assert redone == p  # the same point, recomputed from its records
    assert again.load(130.0, 0) is None  # half-done: rerun
    assert again.load(40.0, 1) is None  # never run
    # A records file cut short after its line was written is rerun too.
    path = again.records_path(80.0, 0)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    assert again.load(80.0, 0) is None


def _cli(*args):
    result = CliRunner().invoke(live_app, ["capacity", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stderr


@pytest.mark.parametrize("extra, field", [
    ((), "cannot reach vLLM server at http://127.0.0.1:9"),
    (("--auto", "--rates", "1,2"), "--auto and --rates"),
    (("--slo", "ttft_p77=1"), "slo.ttft_p77"),
    (("--rates", "0,1"), "--rates"),
    (("--duration", "0"), "--duration"),
    (("--replicates", "0"), "--replicates"),
    (("--plot", "out.txt"), "--plot"),
    (("--request-timeout", "0"), "--request-timeout"),
    (("--predict", "missing-profile.yaml"), "missing-profile.yaml"),
])  # fmt: skip
def test_bad_input_is_one_line_exit_2(tmp_path, extra, field):
    import yaml

    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "s", "engine": dict(max_num_seqs=1, max_num_batched_tokens=64, num_gpu_blocks=64, max_model_len=256),
        "step_time": dict(base=D), "slo": {"ttft_p95": 0.1},
        "workload": {"arrival": {"process": "poisson", "rate": 1.0}, "duration_s": 10.0, "input_len": 16, "output_len": 1},
    }))  # fmt: skip
    code, err = _cli(scenario, "--base-url", "http://127.0.0.1:9", "--out", tmp_path / "o", *extra)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], err
    assert "Traceback" not in err


def test_a_short_window_needs_a_shortfall_beyond_a_stable_queues_noise():
    """Ten arrivals in [T/2, T), each served in 1.2 s: the two sent in the last 1.2 s are still
    running at T. That is 20 % of the window, but a stable queue's in-flight count (2.4 on
    average here) moves by that much; a backlog that grows by 60 % is saturation."""
    from simcap.metrics.summary import summarize
    from simcap.studies.capacity import point_from_measurements

    def point(arrival, finish):
        recs = []
        for i, (a, f) in enumerate(zip(arrival, finish)):
            r = RequestRecord(i, a, 16, 1)
            r.add_chunk(f, 1)
            r.finish_time = f
            recs.append(r)
        return point_from_measurements(summarize(recs, slo=SLO), arrival, finish, rate=2.0, replicate=0,
                                       seed=0, duration_s=10.0)

    arrival = [5.0 + 0.5 * i for i in range(10)]  # 5.0 ... 9.5
    stable = point(arrival, [a + 1.2 for a in arrival])  # 9.0 and 9.5 finish after T = 10
    assert (stable.arrived_in_window, stable.completed_in_window) == (10, 8) and not stable.saturated
    arrival = [5.0 + 0.1 * i for i in range(50)]
    growing = point(arrival, [5.2 + 0.25 * i for i in range(50)])  # served at 4/s, sent at 10/s
    assert growing.completed_in_window == 20 and growing.saturated


def test_a_saturation_rate_outside_its_bracket_is_noted():
    """Kept up (by the rule) at 16.6 req/s, yet the saturated run completed only 10 req/s: the
    runs were too short to tell, and the result says so."""
    short = [_pt(9, 0, True, 9.6), _pt(18, 0, False, 16.6), _pt(36, 0, False, 30.3, True)]
    short[2] = dataclasses.replace(short[2], completion_rate=10.0)
    result = capacity_result(short, {"ttft_p95": 1.0}, duration_s=5, replicates=1, mode="auto")
    assert result.saturation_rate == 10.0 and saturation_bracket(short) == (16.6, 30.3)
    assert any("lies outside the arrival rates that bracket the divergence (16.6-30.3)" in n for n in result.notes)
    # Within the rule's own 5 % slack (a run keeps up at up to mu / 0.95), nothing is noted.
    close = short[:2] + [dataclasses.replace(short[2], completion_rate=16.0)]
    assert not any("lies outside" in n for n in capacity_result(close, {"ttft_p95": 1.0}, duration_s=5,
                                                                replicates=1, mode="auto").notes)
