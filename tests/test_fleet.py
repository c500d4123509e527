"""Fleets: replicas behind a router on one clock (simcap.fleet.replicas) and the routers themselves."""

from __future__ import annotations

import dataclasses

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simcap.metrics.report import to_json
from simcap.fleet.router import (
    PrefixCache, PrefixIndex, ReplicaState, RouteRequest, affinity_key, make_router, session_hash,
)
from simcap.config.scenario import ROUTERS, parse_scenario
from simcap.fleet.run import simulate
from simcap.workloads.requests import RequestSpec
from tests.conftest import make_scenario
from tests.test_fast_forward import noisy_scenarios, scenarios


def with_deployment(scenario, **deployment):
    data = scenario.model_dump(mode="json")
    data["deployment"] = deployment
    return parse_scenario(data)


def without_fleet(result) -> str:
    """A fleet run's JSON less its fleet section and the scenario hash (its scenario has a
    deployment key): what a lone engine's run prints."""
    data = json.loads(to_json(result.to_dict()))
    data.pop("fleet")
    data["provenance"].pop("scenario_sha256")
    return to_json(data)


def single(result) -> str:
    data = json.loads(to_json(result.to_dict()))
    data["provenance"].pop("scenario_sha256")
    return to_json(data)


# --------------------------------------------------------------------------- fleet of one


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(speculative=True, frontend=False), st.sampled_from(ROUTERS), st.sampled_from([0.05, 1.0]))
def test_fleet_of_one_is_the_single_engine_byte_for_byte(scenario, router, interval):
    alone = simulate(scenario, records=True)
    fleet = simulate(
        with_deployment(scenario, replicas=1, router=router, scrape_interval_s=interval),
        records=True,
    )
    assert without_fleet(fleet) == single(alone)
    assert {r.replica for r in fleet.records} <= {0}
    assert [dataclasses.replace(r, replica=None) for r in fleet.records] == alone.records
    assert fleet.fleet_info["per_replica"][0]["requests"] == alone.summary.completed


def test_no_deployment_key_leaves_scenario_and_output_as_before():
    scenario = make_scenario()
    assert "deployment" not in scenario.model_dump(mode="json")
    assert "fleet" not in simulate(scenario).to_dict()


# --------------------------------------------------------------------------- fast == reference


def check_fleet_fast_equals_reference(scenario):
    reference = simulate(scenario, fast=False, records=True, steps=True)
    fast = simulate(scenario, fast=True, records=True, steps=True)
    assert fast.records == reference.records
    assert list(fast.replica_of) == list(reference.replica_of)
    for a, b in zip(fast.replica_steps, reference.replica_steps):
        assert a == b
    assert to_json(fast.to_dict()) == to_json(reference.to_dict())


@st.composite
def fleet_scenarios(draw, noisy=False):
    # (a fleet's router stands in front of its replicas: no front end)
    base = draw(noisy_scenarios(frontend=False) if noisy else scenarios(speculative=True, frontend=False))
    return with_deployment(
        base, replicas=draw(st.integers(2, 4)), router=draw(st.sampled_from(ROUTERS)),
        scrape_interval_s=draw(st.sampled_from([0.01, 0.1, 1.0])),
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet_scenarios())
def test_fleet_fast_path_equals_reference_path(scenario):
    """Bulk stretches end at arrivals and scrapes: every routing decision, scrape and float is
    the reference path's."""
    check_fleet_fast_equals_reference(scenario)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet_scenarios(noisy=True))
def test_fleet_fast_path_equals_reference_path_with_noise(scenario):
    check_fleet_fast_equals_reference(scenario)


def test_fleet_is_deterministic():
    scenario = make_scenario(
        workload=dict(arrival={"process": "poisson", "rate": 30.0}, num_requests=200,
                      input_len={"dist": "uniform", "low": 50, "high": 300}, output_len=40,
                      prefix={"shared_tokens": 32, "num_prefixes": 3}),
        step_time=dict(base=0.01, per_prefill_token=1e-5, per_decode_token=1e-4),
        engine=dict(enable_prefix_caching=True),
        deployment=dict(replicas=3, router="prefix_cache", scrape_interval_s=0.5),
    )
    assert to_json(simulate(scenario).to_dict()) == to_json(simulate(scenario).to_dict())


# --------------------------------------------------------------------------- by hand


@pytest.mark.parametrize("n", [2, 3, 5])
def test_round_robin_gives_each_replica_every_nth_request(n):
    """A deterministic workload (fixed lengths, one request every 0.1 s, each done within
    one arrival gap) over n identical replicas: request i goes to replica i mod n, and every
    replica serves the same requests the same way."""
    trace = [(0.1 * i, RequestSpec(i, 20, 3, ((-2 * i - 1, 20),))) for i in range(6 * n)]
    scenario = make_scenario(
        step_time=dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 10.0}, num_requests=6 * n,
                      input_len=20, output_len=3),
        deployment=dict(replicas=n, router="roundrobin"),
    )
    result = simulate(scenario, trace, records=True)
    assert list(result.replica_of) == [i % n for i in range(6 * n)]
    rows = result.fleet_info["per_replica"]
    assert [row["requests"] for row in rows] == [6] * n
    assert result.fleet_info["load_imbalance"] == {"requests": 1.0, "tokens": 1.0}
    # Each request alone on its replica: 3 steps of 0.01 s (prefill + first token, 2 decodes).
    for rec in result.records:
        assert rec.first_token_time - rec.arrival_time == pytest.approx(0.01)
        assert rec.finish_time - rec.arrival_time == pytest.approx(0.03)


def test_least_request_sees_its_own_outstanding_counts():
    """Two replicas, requests every 0.1 s that each take 0.25 s: least_request alternates
    while both are busy; the counts fall as responses end."""
    trace = [(0.1 * i, RequestSpec(i, 16, 25, ((-2 * i - 1, 16),))) for i in range(4)]
    scenario = make_scenario(
        step_time=dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 10.0}, num_requests=4,
                      input_len=16, output_len=25),
        deployment=dict(replicas=2, router="least_request"),
    )
    result = simulate(scenario, trace)
    # t=0: both idle -> 0; t=0.1: 1 vs 0 -> 1; t=0.2: 1, 1 -> tie, after 1 -> 0;
    # t=0.3: request 0 ended at 0.25 -> replica 0 has 1 (request 2), replica 1 has 1 -> tie,
    # after 0 -> 1.
    assert list(result.replica_of) == [0, 1, 0, 1]


def test_session_router_keeps_each_client_on_one_replica():
    scenario = make_scenario(
        workload=dict(arrival={"process": "closed", "concurrency": 6}, num_requests=60,
                      input_len=20, output_len=5),
        deployment=dict(replicas=3, router="session"),
    )
    result = simulate(scenario, records=True)
    for rec in result.records:
        assert result.replica_of[rec.request_id] == session_hash(rec.client_id) % 3


def test_prefix_cache_router_keeps_a_prefix_group_together():
    """Two system prompts, prefix weight only: after a group's first request, the group
    stays where its prefix is, and the prefix-cache hits follow."""
    scenario = make_scenario(
        engine=dict(enable_prefix_caching=True),
        workload=dict(arrival={"process": "poisson", "rate": 5.0}, num_requests=60,
                      input_len=200, output_len=5,
                      prefix={"shared_tokens": 160, "num_prefixes": 2}),
        deployment=dict(replicas=4, router="prefix_cache",
                        weights={"prefix_cache": 1.0, "queue": 0.0}),
    )
    result = simulate(scenario)
    from simcap.workloads.requests import Workload

    wl = Workload(scenario.workload, scenario.seed)
    by_group: dict[int, set[int]] = {}
    for i in range(60):
        by_group.setdefault(wl.spec(i).segments[0][0], set()).add(int(result.replica_of[i]))
    assert all(len(replicas) == 1 for replicas in by_group.values())
    rows = result.fleet_info["per_replica"]
    busy = [row for row in rows if row["requests"]]
    assert all(row["prefix_cache_hit_rate"] > 0.5 for row in busy)
    # Round robin spreads each group over every replica: fewer hits in all.
    rr = simulate(with_deployment(scenario, replicas=4, router="roundrobin"))
    assert rr.summary.prefix_cache_hit_tokens < result.summary.prefix_cache_hit_tokens


def test_replica_groups_have_their_own_engines():
    scenario = make_scenario(
        step_time=dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 20.0}, num_requests=40,
                      input_len=20, output_len=10),
        deployment=dict(router="roundrobin", groups=[
            {"name": "slow", "replicas": 1, "step_time": {"base": 0.04}},
            {"name": "fast", "replicas": 1},
        ]),
    )
    result = simulate(scenario)
    slow, fast = result.fleet_info["per_replica"]
    assert (slow["group"], fast["group"]) == ("slow", "fast")
    assert slow["requests"] == fast["requests"] == 20
    assert slow["ttft_p50_s"] > 3 * fast["ttft_p50_s"]


# --------------------------------------------------------------------------- routers alone


def states(*outstanding, usage=None, waiting=None):
    n = len(outstanding)
    usage = usage or [0.0] * n
    waiting = waiting or [0] * n
    return [ReplicaState(o, 0, w, u) for o, w, u in zip(outstanding, waiting, usage)]


def pick_and_route(router, request, st_):
    r = router.pick(request, st_)
    router.routed(request, r)
    return r


def test_round_robin_by_hand():
    router = make_router("roundrobin", 3)
    picks = [pick_and_route(router, RouteRequest(i), states(9, 0, 0)) for i in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]  # load plays no part


def test_least_request_by_hand():
    router = make_router("least_request", 3)
    assert pick_and_route(router, RouteRequest(0), states(2, 1, 3)) == 1
    # tie between 0 and 2 (1 was last picked): the first at or after replica 2 wins
    assert pick_and_route(router, RouteRequest(1), states(1, 2, 1)) == 2
    assert pick_and_route(router, RouteRequest(2), states(1, 2, 1)) == 0


def test_kv_cache_utilization_by_hand():
    router = make_router("kv_cache_utilization", 3)
    assert router.pick(RouteRequest(0), states(5, 0, 0, usage=[0.1, 0.5, 0.3])) == 0
    # equal usage: fewer outstanding wins
    assert router.pick(RouteRequest(0), states(5, 2, 3, usage=[0.2, 0.2, 0.2])) == 1


def test_session_by_hand():
    router = make_router("session", 4)
    for key in (0, 1, 7, 12345):
        assert router.pick(RouteRequest(0, key), states(0, 0, 0, 0)) == session_hash(key) % 4
    assert session_hash(7) != session_hash(8)
    # no key: least outstanding
    assert router.pick(RouteRequest(0, None), states(3, 1, 2, 5)) == 1
    spec = RequestSpec(0, 10, 2, ((-1, 10),))
    assert affinity_key(spec, 5) == 5 and affinity_key(spec, None) is None
    assert affinity_key(spec._replace(session_id=9, turn=1), 5) == 9


def test_prefix_index_lru_by_hand():
    index = PrefixIndex(capacity=4)
    index.add([1, 2, 3])
    assert index.match([1, 2, 9]) == 2 and index.match([9, 1]) == 0
    index.add([1, 5])  # 1 refreshed; 4 blocks held
    index.add([6])  # evicts the least recently sent: 2
    assert index.match([1, 2, 3]) == 1 and len(index) == 4


def test_prefix_cache_scores_by_hand():
    """score = 3 * prefix + 2 * queue + 0 * kv (defaults)."""
    router = PrefixCache(2, [100, 100])
    router.routed(RouteRequest(0, None, [10, 11, 12, 13]), 1)
    req = RouteRequest(1, None, [10, 11, 20, 21])
    # prefix: 0 and 2/4; queue: waiting 0 vs 4 -> 1 and 0
    assert router.scores(req, states(0, 0, waiting=[0, 4])) == [2.0, 1.5]
    assert router.pick(req, states(0, 0, waiting=[0, 4])) == 0
    # equal queues: the prefix decides
    assert router.scores(req, states(0, 0, waiting=[2, 2])) == [2.0, 3.5]
    assert router.pick(req, states(0, 0, waiting=[2, 2])) == 1
    weighted = PrefixCache(2, [100, 100], {"prefix_cache": 1.0, "queue": 0.0,
                                          "kv_cache_utilization": 1.0})
    assert weighted.scores(RouteRequest(2), states(0, 0, usage=[0.25, 0.5])) == [0.75, 0.5]


# --------------------------------------------------------------------------- sizing


def sizing_scenario():
    return make_scenario(
        step_time=dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=1,
                      input_len=16, output_len=20),
        slo={"ttft_p95": 0.5},
    )


def test_fleet_sizing_finds_the_fewest_passing_replicas():
    """One replica serves 8 requests at a time, each in 20 steps of 10 ms: about 40 req/s.
    At 100 req/s, 2 replicas fall behind and 3 keep up; the search must say 3 and have
    tested 2 (fail) and 3 (pass)."""
    from simcap.studies.fleet_sizing import size_fleet

    result = size_fleet(sizing_scenario(), 100.0, routers=["roundrobin", "least_request"],
                        duration_s=20.0, replicates=1, max_replicas=8,
                        price_per_replica_hour=3.0)
    for sizing in result.routers:
        assert sizing.replicas == 3, sizing.tested
        assert sizing.tested[2] is False and sizing.tested[3] is True
        assert sizing.cost_per_hour == 9.0
        assert sizing.cost_per_million_requests == pytest.approx(9.0 / (100 * 3600) * 1e6)
    data = result.to_dict()
    assert [r["replicas"] for r in data["routers"]] == [3, 3]


def test_fleet_sizing_says_when_no_count_is_enough():
    from simcap.studies.fleet_sizing import size_fleet

    result = size_fleet(sizing_scenario(), 100.0, duration_s=10.0, replicates=1, max_replicas=2)
    assert result.routers[0].replicas is None
    assert set(result.routers[0].tested) == {1, 2}


def test_routing_stops_mattering_by_hand():
    from simcap.studies.fleet_sizing import routing_stops_mattering

    curve = {"a": {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, "b": {1: 1.0, 2: 1.5, 4: 3.9, 8: 7.9}}
    assert routing_stops_mattering(curve) == 4  # 1 agrees, 2 does not, 4 and 8 do
    assert routing_stops_mattering({"a": {1: 1.0}}) is None
    assert routing_stops_mattering({"a": {1: 1.0, 2: 2.0}, "b": {1: 1.0, 2: 1.0}}) is None


def test_capacity_of_a_fleet_grows_with_replicas():
    from simcap.studies.capacity import find_capacity
    from simcap.studies.fleet_sizing import with_fleet

    scenario = sizing_scenario()
    one = find_capacity(scenario, duration_s=20.0, replicates=1, interval=False)
    three = find_capacity(with_fleet(scenario, 3), duration_s=20.0, replicates=1, interval=False)
    assert one.safe_rate is not None and three.safe_rate is not None
    assert 2.5 * one.safe_rate < three.safe_rate < 3.5 * one.safe_rate


def test_fleet_command_and_capacity_replicas(tmp_path):
    from typer.testing import CliRunner

    from simcap.cli import app
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sizing_scenario().model_dump(mode="json")))
    res = CliRunner().invoke(app, ["fleet", str(path), "--target-rate", "100", "--duration", "20",
                                   "--replicates", "1", "--max-replicas", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["routers"][0]["replicas"] == 3
    res = CliRunner().invoke(app, ["capacity", str(path), "--replicas", "2", "--router",
                                   "least_request", "--rates", "50", "--duration", "10",
                                   "--replicates", "1", "--interval-sets", "0", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["safe_rate"] is not None


def test_teaching_picture_is_written(tmp_path):
    from simcap.studies.fleet_sizing import with_fleet
    from simcap.studies.plots import write_simulation_plots

    scenario = with_fleet(sizing_scenario().model_copy(update={}), 2, "least_request")
    a = simulate(scenario, records=True, steps=True)
    b = simulate(with_fleet(scenario, 2, "roundrobin"), records=True, steps=True)
    paths = write_simulation_plots(a, tmp_path / "figs", [b])
    assert [p.name for p in paths] == ["fleet_routers.png"] and paths[0].stat().st_size > 10_000


def test_fleet_sizing_on_ray_matches_local():
    """The sweep's Ray backend runs a fleet-sizing search's runs; same answer, same runs."""
    import ray  # in the test extra

    from simcap.studies.fleet_sizing import size_fleet

    kwargs = dict(routers=["roundrobin"], duration_s=10.0, replicates=1, max_replicas=4)
    local = size_fleet(sizing_scenario(), 100.0, **kwargs)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        remote = size_fleet(sizing_scenario(), 100.0, backend="ray", **kwargs)
    finally:
        ray.shutdown()
    a, b = local.to_dict(), remote.to_dict()
    assert b["provenance"].pop("backend") == "ray" and a["provenance"].pop("backend") == "local"
    assert to_json(a) == to_json(b)


def test_sweep_over_fleets_reports_fleet_fields(tmp_path):
    import yaml

    from simcap.studies.sweep import run_sweep

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sizing_scenario().model_dump(mode="json")))
    result = run_sweep(path, ["deployment.replicas=1,3", "deployment.router=roundrobin"],
                       ["completed", "fleet.load_imbalance.requests", "fleet.replicas"],
                       overrides=["workload.num_requests=9"])
    assert [(r["fleet.replicas"], r["fleet.load_imbalance.requests"]) for r in result.rows] == [
        (1, 1.0), (3, 1.0)]


@pytest.mark.parametrize("router,expected", [
    ("kv_cache_utilization", [0, 1, 0, 0, 0]),
    ("least_request", [0, 1, 0, 1, 0]),
])
def test_router_sees_scraped_gauges_not_the_present(router, expected):
    """Request 1 (1000-token prompt) is on replica 1 at the scrape at t = 1 s and gone by
    1.25 s. Until the next scrape, kv_cache_utilization still sees replica 1 as the fuller
    one and sends everything to replica 0, also request 3 at 1.5 s while request 2 runs
    there; least_request counts its own outstanding requests and alternates."""
    def spec(i, prompt, out):
        return RequestSpec(i, prompt, out, ((-2 * i - 1, prompt),))

    trace = [(0.0, spec(0, 16, 3)), (0.95, spec(1, 1000, 20)), (1.3, spec(2, 16, 30)),
             (1.5, spec(3, 16, 30)), (1.7, spec(4, 16, 30))]
    scenario = make_scenario(
        step_time=dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=5,
                      input_len=16, output_len=3),
        deployment=dict(replicas=2, router=router, scrape_interval_s=1.0),
    )
    result = simulate(scenario, trace, records=True)
    assert list(result.replica_of) == expected
    request_1 = result.records[1]
    assert request_1.arrival_time < 1.0 < request_1.finish_time < 1.3  # gone before request 2


@pytest.mark.parametrize("router", ["roundrobin", "least_request", "kv_cache_utilization"])
def test_early_stop_of_a_fleet_is_conservative(router):
    """An overloaded fleet is stopped once its TTFT target must fail, and the full run does
    fail it; a fleet that keeps up is never stopped, and its result is the full run's."""
    from simcap.simulation.early_stop import SloStop
    from simcap.studies.capacity import at_rate
    from simcap.studies.fleet_sizing import with_fleet

    base = with_fleet(sizing_scenario(), 2, router)
    for rate, overloaded in ((150.0, True), (40.0, False)):
        s = at_rate(base, rate, duration_s=10.0, seed=0, slo={"ttft_p95": 0.5})
        full = simulate(s)
        stopped = simulate(s, stop=SloStop(s.slo, not_before=10.0))
        assert full.summary.slo_pass is (not overloaded)
        if overloaded:
            assert stopped.stopped is not None and stopped.stopped.at_s >= 10.0
            assert stopped.summary.slo_pass is False
            assert stopped.summary.completed < full.summary.completed
        else:
            assert stopped.stopped is None
            assert to_json(stopped.to_dict()) == to_json(full.to_dict())


# --------------------------------------------------------------------------- disaggregated


def pd_deployment(prefill=1, decode=1, router="roundrobin", bandwidth=1.0, latency=0.002,
                  bytes_per_token=100_000):
    return {"router": router, "disaggregated": {
        "prefill": {"replicas": prefill}, "decode": {"replicas": decode},
        "kv_transfer": {"bandwidth_gbps": bandwidth, "latency_s": latency,
                        "kv_bytes_per_token": bytes_per_token}}}


@pytest.mark.parametrize("fast", [True, False])
def test_disaggregated_ttft_is_prefill_plus_transfer_plus_first_decode_step(fast):
    """100 prompt tokens, 10 output tokens, steps of 10 ms: the prefill replica's one step
    ends at 0.010 s; 100 x 100 kB over 1 GB/s is 0.010 s, + 2 ms latency; the decode replica
    recomputes the last prompt token and samples the first output token in one step: TTFT
    0.032 s; 9 more decode steps: E2E 0.122 s."""
    scenario = make_scenario(
        step_time=dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=2,
                      input_len=100, output_len=10),
        deployment=pd_deployment(),
    )
    trace = [(0.0, RequestSpec(0, 100, 10, ((-1, 100),))),
             (5.0, RequestSpec(1, 100, 10, ((-3, 100),)))]
    result = simulate(scenario, trace, records=True, steps=True, fast=fast)
    for rec in result.records:
        assert rec.first_token_time - rec.arrival_time == pytest.approx(0.032)
        assert rec.finish_time - rec.arrival_time == pytest.approx(0.122)
        assert rec.num_output_tokens == 10
    prefill_steps, decode_steps = (s.as_arrays() for s in result.replica_steps)
    assert list(prefill_steps["num_prefill_tokens"]) == [100, 100]  # one step per prompt
    # the decode replica computes 10 tokens a request: the last prompt token, 9 outputs
    assert len(decode_steps["start"]) == 20
    assert (decode_steps["num_prefill_tokens"] + decode_steps["num_decode_tokens"]).sum() == 20
    info = result.fleet_info["disaggregated"]
    assert info["kv_transfer_mean_s"] == pytest.approx(0.012)
    rows = result.fleet_info["per_replica"]
    assert [row["group"] for row in rows] == ["prefill", "decode"]
    assert result.summary.completed == 2  # the clients' requests, not the prefills


@st.composite
def pd_scenarios(draw):
    base = draw(scenarios(speculative=True, frontend=False))
    return with_deployment(base, **pd_deployment(
        prefill=draw(st.integers(1, 3)), decode=draw(st.integers(1, 3)),
        router=draw(st.sampled_from(ROUTERS)),
        bandwidth=draw(st.sampled_from([0.01, 1.0, 100.0])),
        latency=draw(st.sampled_from([0.0, 0.005])), bytes_per_token=4096,
    ))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pd_scenarios())
def test_disaggregated_fast_path_equals_reference_path(scenario):
    check_fleet_fast_equals_reference(scenario)
    result = simulate(scenario)
    n = scenario.workload.num_requests
    assert result.summary.completed == n
    assert sum(row["completed"] for row in result.fleet_info["per_replica"]
               if row["group"] == "prefill") == n


def test_disaggregated_kv_bytes_come_from_the_memory_plan():
    from simcap.config.scenario import kv_transfer_bytes_per_token, load_scenario

    base = load_scenario("examples/ascend910b4-kv.yaml")
    data = base.model_dump(mode="json")
    data["deployment"] = pd_deployment(bytes_per_token=None)
    data["deployment"]["disaggregated"]["kv_transfer"].pop("kv_bytes_per_token")
    scenario = parse_scenario(data)
    assert kv_transfer_bytes_per_token(scenario) == \
        base.engine.memory.model.kv_bytes_per_token_total()


def test_pool_sizing_finds_the_best_split_of_the_fewest_replicas():
    """Prompts of 2000 tokens at 1 ms a token make prefill the bottleneck (2 s a prompt on
    one replica) while decoding 5 tokens is cheap: at 0.6 req/s one prefill replica falls
    behind and two keep up, so the answer is 2 prefill + 1 decode, after every split of 2
    replicas failed and 1:2 failed at 3."""
    from simcap.studies.fleet_sizing import size_pools

    scenario = make_scenario(
        engine=dict(max_num_batched_tokens=4096),
        step_time=dict(base=0.01, per_prefill_token=0.001, per_decode_token=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=1,
                      input_len=2000, output_len=5),
        slo={"ttft_p95": 6.0},
        deployment=pd_deployment(bandwidth=100.0, latency=0.0, bytes_per_token=1000),
    )
    result = size_pools(scenario, 0.6, duration_s=60.0, replicates=1, max_replicas=4)
    assert result.best == (2, 1)
    assert result.tested[(1, 1)] is False and result.tested[(1, 2)] is False
    assert result.to_dict()["best"] == {"prefill": 2, "decode": 1, "replicas": 3}
