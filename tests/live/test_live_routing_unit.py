"""The live router's bookkeeping, without a server: the simulated fleet's routers, fed with
the live run's own outstanding counts and the servers' scraped gauges."""

from __future__ import annotations

import pytest

from simcap.config.scenario import parse_scenario
from simcap.fleet.replicas import load_imbalance, replica_rows
from simcap.fleet.router import make_router
from simcap.live.prom import parse_metrics
from simcap.live.routing import LiveRouter, LiveRouterError, check_fleet_urls, gauges_of
from simcap.metrics.records import RequestRecord
from simcap.workloads.requests import Workload

BASE = {
    "engine": dict(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=256,
                   max_model_len=2048),
    "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 12,
                 "input_len": 64, "output_len": 8},
}


def gauges(running: int, waiting: int, usage: float) -> str:
    """The three gauges as vLLM's /metrics writes them."""
    out = []
    for name, value in (("num_requests_running", running), ("num_requests_waiting", waiting),
                        ("kv_cache_usage_perc", usage)):
        out += [f"# TYPE vllm:{name} gauge", f'vllm:{name}{{engine="0",model_name="tiny"}} {value}']
    return "\n".join(out) + "\n"


def scenario(**deployment):
    return parse_scenario({**BASE, **({"deployment": deployment} if deployment else {})})


def specs(sc, n=12):
    w = Workload(sc.workload, sc.seed)
    return [w.spec(i) for i in range(n)]


def test_roundrobin_alternates_whatever_the_load():
    sc = scenario(replicas=3, router="roundrobin")
    router = LiveRouter(sc, 3)
    picks = []
    for spec in specs(sc):
        picks.append(router.send(spec))
        router.outstanding[0] += 5  # load it would read if it read load: it must not
    assert picks == [i % 3 for i in range(12)]
    assert router.num_routed == [4, 4, 4]


def test_least_request_follows_its_own_outstanding_counts():
    sc = scenario(replicas=2, router="least_request")
    router = LiveRouter(sc, 2)
    a, b, c, d = specs(sc, 4)
    assert router.send(a) == 0 and router.send(b) == 1  # equal: in turn
    router.ended(1)  # server 1 answered: it has fewer outstanding
    assert router.send(c) == 1
    assert router.outstanding == [1, 1]
    router.ended(0)
    router.ended(1)
    assert router.outstanding == [0, 0]
    assert router.send(d) == 0  # ties go on from the last one picked


def test_kv_router_reads_the_scraped_gauges_and_keeps_the_last_on_a_failed_scrape():
    sc = scenario(replicas=2, router="kv_cache_utilization")
    router = LiveRouter(sc, 2)
    assert router.reads_gauges
    busy = parse_metrics(gauges(running=3, waiting=2, usage=0.75))
    idle = parse_metrics(gauges(running=0, waiting=0, usage=0.1))
    router.observe(0, busy)
    router.observe(1, idle)
    assert router.scraped == [(3, 2, 0.75), (0, 0, 0.1)]
    router.observe(0, None)  # a failed scrape keeps what was known
    assert router.scraped[0] == (3, 2, 0.75)
    assert [router.send(s) for s in specs(sc, 3)] == [1, 1, 1]


def test_gauges_of_reads_the_old_kv_gauge_name_and_none():
    assert gauges_of(None) == (0, 0, 0.0)
    old = '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0"} 0.5\n'
    assert gauges_of(parse_metrics(old)) == (0, 0, 0.5)


def test_live_router_decides_as_the_simulated_fleets_router_on_the_same_states():
    sc = scenario(replicas=2, router="prefix_cache")
    live = LiveRouter(sc, 2, capacities=[255, 255])
    assert live.router.needs_block_hashes
    same = make_router("prefix_cache", 2, capacities=[255, 255])
    from simcap.fleet.router import ReplicaState, route_request

    for spec in specs(sc):
        request = route_request(spec, None, 16, True)
        j = same.pick(request, [ReplicaState(), ReplicaState()])
        same.routed(request, j)
        assert live.send(spec) == j
        live.ended(j)


@pytest.mark.parametrize(
    "deployment, urls, needle",
    [
        ({}, 2, "no deployment"),
        ({"replicas": 3}, 2, "deployment.replicas is 3 but 2"),
        ({"replicas": 2}, 1, "deployment.replicas is 2 but 1"),
        ({"groups": [{"name": "a", "replicas": 2}]}, 2, "groups and disaggregated"),
    ],
)
def test_urls_must_be_the_deployments_replicas(deployment, urls, needle):
    with pytest.raises(LiveRouterError, match=needle):
        check_fleet_urls(scenario(**deployment), urls)


def test_no_deployment_and_one_url_is_a_lone_server():
    check_fleet_urls(scenario(), 1)
    check_fleet_urls(scenario(replicas=2), 2)


def test_replica_rows_and_imbalance_from_records():
    recs = []
    for i, (replica, prompt, out) in enumerate([(0, 10, 2), (1, 10, 2), (0, 30, 10), (1, 10, 2)]):
        r = RequestRecord(i, float(i), prompt, out, replica=replica)
        for k in range(out):
            r.add_chunk(i + 0.1 * (k + 1), 1)
        r.finish_time = r.chunk_times[-1]
        recs.append(r)
    rows = replica_rows(recs, 3)
    assert [(r["requests"], r["tokens"], r["completed"]) for r in rows] == [(2, 52, 2), (2, 24, 2), (0, 0, 0)]
    assert rows[0]["ttft_p50_s"] == pytest.approx(0.1)
    assert rows[2]["ttft_p50_s"] is None
    imb = load_imbalance(rows)
    assert imb["requests"] == pytest.approx(2 / (4 / 3))
    assert imb["tokens"] == pytest.approx(52 / (76 / 3))
