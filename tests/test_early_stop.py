"""Early stop: a run ends only when its SLO is certain to fail, and it saves work.

Three levels: the percentile/mean rule itself against every completion of a random set of
lower bounds; whole simulations stopped early against the same simulations run to the end
(random open-loop scenarios and SLO targets around the run's own values); and a capacity grid
with and without the stop, which must reach the same safe and saturation rates.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from simcap.cli import app
from simcap.config.scenario import parse_scenario
from simcap.errors import ScenarioError
from simcap.fleet.run import simulate
from simcap.metrics.summary import Distribution
from simcap.simulation.early_stop import SloStop, certain_failure, stoppable_keys
from simcap.studies.capacity import find_capacity
from tests.conftest import make_scenario
from tests.test_capacity import MU, SLO, dd1_data

STATS = ["p50", "p90", "p95", "p99", "mean"]


# --------------------------------------------------------------------------- the rule


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 120),
    stat=st.sampled_from(STATS),
    data=st.data(),
)
def test_rule_never_fails_a_percentile_that_some_future_passes(n, stat, data):
    """Whenever the rule says "fails", every completion of the bounds fails: the arrived
    requests' values are their bounds plus anything >= 0, the rest anything at all."""
    arrived = data.draw(st.integers(0, n))
    values = st.floats(0.0, 10.0, allow_nan=False)
    bounds = np.array(data.draw(st.lists(values, min_size=arrived, max_size=arrived)))
    target = data.draw(st.sampled_from([0.5, 1.0, 2.0, 5.0]))
    why = certain_failure(f"ttft_{stat}", target, n, bounds)
    if why is None:
        return
    assert str(n) in why
    # the completion most favourable to passing: arrived ones at their bounds, the rest at 0
    for rest in (np.zeros(n - arrived), np.array(data.draw(
            st.lists(values, min_size=n - arrived, max_size=n - arrived)))):
        extra = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=arrived,
                                            max_size=arrived)))
        for final in (np.concatenate([bounds, rest]),
                      np.concatenate([bounds + extra, rest])):
            value = Distribution.of(final).stat(stat)
            assert value > target, (stat, n, arrived, value, target)


def test_rule_threshold_is_the_count_above_the_interpolation_floor():
    """p95 over 100 requests: h = 99 x 0.95 = 94.05, so 100 - 94 = 6 values over the target
    settle it (x[94] is then over), and 5 do not (x[94] may still be under)."""
    five = np.array([3.0] * 5)
    six = np.array([3.0] * 6)
    assert certain_failure("ttft_p95", 2.0, 100, five) is None
    assert certain_failure("ttft_p95", 2.0, 100, six) is not None
    # and that is tight: five over with the rest at zero passes, six fail
    assert Distribution.of(np.concatenate([five, np.zeros(95)])).p95 <= 2.0
    assert Distribution.of(np.concatenate([six, np.zeros(94)])).p95 > 2.0


def test_only_ttft_and_e2e_targets_can_stop_a_run():
    assert stoppable_keys({"ttft_p95": 1, "tpot_p95": 1, "itl_p99": 1, "e2e_mean": 1}) == [
        "ttft_p95", "e2e_mean"]
    assert SloStop({"tpot_p95": 0.05}).next_check == float("inf")  # never checks


# --------------------------------------------------------------------------- whole runs


@st.composite
def open_loop_runs(draw):
    max_in = draw(st.integers(1, 300))
    max_out = draw(st.integers(1, 200))
    block_size = draw(st.sampled_from([4, 16]))
    need = max_in + max_out
    arrival = draw(st.sampled_from([
        {"process": "poisson", "rate": draw(st.sampled_from([2.0, 20.0, 80.0]))},
        {"process": "gamma", "rate": draw(st.sampled_from([10.0, 60.0])), "burstiness": 0.3},
    ]))
    stop_by = draw(st.sampled_from(["num_requests", "duration_s"]))
    workload = dict(
        arrival=arrival,
        input_len={"dist": "uniform", "low": 1, "high": max_in},
        output_len={"dist": "uniform", "low": 1, "high": max_out},
        **({"num_requests": draw(st.integers(1, 80))} if stop_by == "num_requests"
           else {"num_requests": None, "duration_s": draw(st.sampled_from([0.5, 2.0, 4.0]))}),
    )
    spec = None
    if draw(st.booleans()):
        spec = {"method": "eagle3", "num_speculative_tokens": 2, "acceptance_length": 2.0}
    return make_scenario(
        engine=dict(
            block_size=block_size, max_model_len=need + 8,
            num_gpu_blocks=-(-(need + 2) // block_size) + 1 + draw(st.integers(0, 80)),
            max_num_seqs=draw(st.integers(1, 16)),
            max_num_batched_tokens=draw(st.integers(16, 512)),
        ),
        step_time=dict(base=0.004, per_prefill_token=1e-5,
                       per_decode_token=draw(st.sampled_from([1e-4, 3e-3]))),
        speculative=spec,
        workload=workload,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(open_loop_runs(), st.sampled_from(["ttft", "e2e"]), st.sampled_from(STATS),
       st.sampled_from([0.3, 0.7, 0.95, 1.0, 1.05, 1.5]), st.sampled_from([0.0, 0.5]),
       st.sampled_from([0.01, 0.2]), st.booleans())
def test_a_stopped_run_would_have_failed_and_an_unstopped_one_is_unchanged(
    scenario, metric, stat, factor, not_before, period, fast
):
    """Targets around the full run's own value (so both verdicts come up): a run the rule
    stops fails in full; a run it does not stop is the full run, byte for byte."""
    full = simulate(scenario, fast=fast)
    key = f"{metric}_{stat}"
    value = getattr(full.summary, f"{metric}_s").stat(stat)
    if value is None:
        return
    target = max(value * factor, 1e-6)
    with_slo = scenario.model_copy(update={"slo": {key: target}})
    full = simulate(with_slo, fast=fast)
    stop = SloStop(with_slo.slo, not_before=not_before, period=period)
    run = simulate(with_slo, fast=fast, stop=stop)
    event("stopped" if run.stopped is not None else
          "ran to the end, " + ("passed" if full.summary.slo_pass else "failed"))
    if run.stopped is not None:
        assert full.summary.slo_pass is False, (key, target, run.stopped.reason)
        assert run.summary.slo_pass is False
        assert run.stopped.at_s >= not_before
        assert run.summary.completed < full.summary.completed or run.stopped.unfinished_arrivals.size == 0
        assert len(run.steps) <= len(full.steps)
    else:
        assert json.dumps(run.to_dict(), sort_keys=True) == json.dumps(full.to_dict(), sort_keys=True)


def overloaded(rate: float = 2 * MU):
    arrival = {"process": "gamma", "rate": rate, "burstiness": 1.0e6}
    return parse_scenario({**dd1_data(arrival=arrival), "slo": SLO})


def test_an_overloaded_run_stops_and_saves_steps():
    """At twice the service rate the run holds 10 s of arrivals (2,000 requests at 100 per
    second, so 10 s more to drain them). With the check held until the window closes it
    stops at 10 s: half the engine steps. Without the hold it stops within the first
    second (TTFT p95 fails once 101 requests wait longer than 15 ms)."""
    scenario = overloaded()
    full = simulate(scenario)
    assert full.summary.slo_pass is False
    held = simulate(scenario, stop=SloStop(scenario.slo, not_before=10.0))
    early = simulate(scenario, stop=SloStop(scenario.slo))
    assert held.stopped is not None and early.stopped is not None
    assert 10.0 <= held.stopped.at_s < 11.0
    assert early.stopped.at_s < 1.5
    assert len(held.steps) < 0.55 * len(full.steps)
    assert len(early.steps) < 0.1 * len(full.steps)
    assert held.stopped.key == "ttft_p95" and "ttft_p95 cannot hold" in held.stopped.reason
    assert held.to_dict()["stopped_early"]["unfinished"] == held.stopped.unfinished_arrivals.size


def test_a_closed_loop_run_cannot_take_a_stop_rule():
    scenario = make_scenario(workload={"arrival": {"process": "closed", "concurrency": 2}})
    with pytest.raises(ValueError, match="open-loop"):
        simulate(scenario, stop=SloStop({"ttft_p95": 1.0}))


# --------------------------------------------------------------------------- capacity


@pytest.fixture(scope="module")
def both_grids():
    scenario = parse_scenario(dd1_data())
    kw = dict(rates=[50, 99, 101, 150, 200], duration_s=10.0, replicates=2,
              probe_saturation=False)
    return (find_capacity(scenario, SLO, early_stop=True, **kw),
            find_capacity(scenario, SLO, early_stop=False, **kw))


def test_capacity_with_early_stop_reaches_the_same_answers(both_grids):
    stopped, full = both_grids
    assert stopped.safe_rate == full.safe_rate
    assert stopped.safe_offered_rate == full.safe_offered_rate
    assert stopped.saturation_rate == full.saturation_rate
    assert stopped.safe_rate_by_slo == full.safe_rate_by_slo
    for a, b in zip(stopped.points, full.points):
        assert (a.rate, a.replicate, a.passed, a.saturated) == (b.rate, b.replicate, b.passed, b.saturated)
        assert a.samples_adequate == b.samples_adequate
        assert (a.measured_rate, a.completion_rate, a.arrived_in_window, a.completed_in_window) == (
            b.measured_rate, b.completion_rate, b.arrived_in_window, b.completed_in_window)
        if a.stopped:
            assert not b.passed and a.values["ttft_p95"] is None
            assert a.stopped["at_s"] >= 10.0 and a.slo_pass == {"ttft_p95": False}
        else:
            assert a.values == b.values
    assert {p.rate for p in stopped.points if p.stopped} >= {150, 200}
    assert not any(p.stopped for p in full.points)
    assert any("stopped early" in n for n in stopped.notes)
    assert "early_stop" in stopped.to_dict()["rules"]
    assert "early_stop" not in full.to_dict()["rules"]


def test_a_key_the_stop_leaves_unknown_makes_its_safe_rate_a_lower_bound():
    """TTFT stops the overloaded runs; TPOT (1 output token: none) is unknown there, so the
    TPOT-alone safe rate ends below them and says it is a lower bound."""
    scenario = parse_scenario(dd1_data(output_len=2))
    slo = {"ttft_p95": 2.5 * 0.01, "tpot_p95": 1.0}
    res = find_capacity(scenario, slo, rates=[50, 150], duration_s=10.0, replicates=1,
                        probe_saturation=False)
    top = [p for p in res.points if p.rate == 150][0]
    assert top.stopped and top.slo_pass == {"ttft_p95": False, "tpot_p95": None}
    assert res.safe_rate_by_slo["tpot_p95"] is not None
    assert res.lower_bounds() == {"ttft_p95": False, "tpot_p95": True}


def test_cli_early_stop_switch(tmp_path):
    path = tmp_path / "dd1.yaml"
    path.write_text(yaml.safe_dump(dd1_data()))
    args = ["capacity", str(path), "--slo", "ttft_p95=0.015", "--rates", "50,200",
            "--duration", "5", "--replicates", "1", "--json"]
    on = json.loads(CliRunner().invoke(app, args).stdout)
    off = json.loads(CliRunner().invoke(app, args + ["--no-early-stop"]).stdout)
    assert [p.get("stopped_early") is not None for p in on["points"]] == [False, True]
    assert not any("stopped_early" in p for p in off["points"])
    assert on["safe_rate"] == off["safe_rate"] and on["saturation_rate"] == off["saturation_rate"]
    assert off["points"][1]["ttft_p95"] > 0.015 and on["points"][1]["ttft_p95"] is None


def test_interval_only_early_stop_spares_the_reported_runs():
    """``early_stop="interval"`` stops only the bootstrap interval's runs (role bootstrap),
    whose values nobody reports; a search run at the same overloaded rate goes to the end."""
    from simcap.studies.capacity import Runner

    scenario = parse_scenario(dd1_data())
    with Runner(1, early_stop="interval") as runner:
        search, boot = runner.map([(scenario, 200.0, 0, 10.0, SLO, None, role)
                                   for role in ("search", "bootstrap")])
    assert search.stopped is None and search.values["ttft_p95"] > SLO["ttft_p95"]
    assert boot.stopped is not None and boot.values["ttft_p95"] is None
    assert (search.passed, search.saturated, search.completion_rate) == (
        boot.passed, boot.saturated, boot.completion_rate)
    with pytest.raises(ScenarioError, match="early_stop"):
        find_capacity(scenario, SLO, rates=[50], duration_s=1.0, early_stop="sometimes")
