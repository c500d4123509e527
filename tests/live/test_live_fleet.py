"""Two real vLLM CPU servers side by side, one thread each, behind the live router.

A skewed open-loop workload (about one answer in four 20 times longer) is routed over the two servers
by ``roundrobin`` and by ``least_request``, three runs each, and every run is replayed
through the simulated fleet with the same router (``simcap live validate`` with two
``--base-url``). What must hold whatever the noise: every record names its server, the
per-replica tables add up to the run, the servers' own counters agree with the client's,
and round robin alternates exactly, live and predicted. How close the predicted imbalance
comes to the measured one is printed, not asserted: on two shared cores it moves with the
host's noise from run to run.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from simcap.live.server import VllmServer

from .conftest import ENGINE, SERVER_ARGS, live_scenario

pytestmark = pytest.mark.live

# Step time of the tiny model on one core and one thread, read off these servers' own runs
# (decode step at small batches ~7.7 ms, TTFT of a 48-token prompt ~45-60 ms).
STEP_TIME_1T = dict(base=0.004, per_prefill_token=8e-4, per_decode_token=1.7e-3, host_overhead=0.002)
WORKLOAD = dict(
    arrival={"process": "poisson", "rate": 3.0}, num_requests=24, input_len=48,
    output_len={"dist": "empirical", "values": [8, 8, 8, 160]},
)
ROUTERS = ("roundrobin", "least_request")


@pytest.fixture(scope="module")
def two_servers():
    """Two servers, each bound to its own core (the first two this process may run on) with
    one OpenMP thread."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip(f"two servers on their own cores need two cores; this process may use {cores}")
    servers = [
        VllmServer(extra_args=SERVER_ARGS[:-1], eager=True, startup_timeout=420,
                   env={"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"})
        for core in cores
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        yield servers
    finally:
        for s in servers:
            s.stop()


def _scenario(router: str):
    return live_scenario(WORKLOAD, seed=11, step_time=STEP_TIME_1T,
                         deployment={"replicas": 2, "router": router, "scrape_interval_s": 0.5})


@pytest.mark.parametrize("router", ROUTERS)
def test_two_servers_routed_and_compared_with_the_simulated_fleet(two_servers, router):
    from simcap.live.validate import validate

    urls = [s.base_url for s in two_servers]
    pids = set().union(*(s.pids() for s in two_servers))
    result = validate(_scenario(router), urls, "tiny", repeats=int(os.environ.get("SIMCAP_FLEET_REPEATS", 3)),
                      server_pids=pids)
    data = result.to_dict()
    fleet = data["fleet"]
    print(f"\n{router}: load imbalance, live per run vs predicted per run")
    for key, m in fleet["load_imbalance"].items():
        print(f"  {key:8s} live {[round(v, 3) for v in m['live']]} predicted "
              f"{[round(v, 3) for v in m['predicted_per_repeat']]}  (live median {m['live_median']:.3f}, "
              f"predicted median {m['predicted']:.3f}, in range {m['in_range']})")
    for row in fleet["per_replica"]:
        print(f"  replica {row['replica']}: " + "; ".join(
            f"{k} live {row[k]['live_median']} pred {row[k]['predicted']}" for k in ("requests", "tokens")))
    print(f"  same replica as live: {fleet['same_replica_fraction']}")
    for key in ("ttft_p50", "tpot_p50", "e2e_p50"):
        m = data["metrics"][key]
        print(f"  fleet {key}: live {[round(v * 1e3, 1) for v in m['live']]} ms, predicted "
              f"{[round(v * 1e3, 1) for v in m['predicted_per_repeat']]} ms")
    if os.environ.get("SIMCAP_FLEET_JSON"):  # keep the whole comparison
        from simcap.metrics.report import to_json

        with open(f"{os.environ['SIMCAP_FLEET_JSON']}-{router}.json", "w") as fh:
            fh.write(to_json(data))
    for note in data["notes"]:
        print(f"  note: {note}")
    from rich.console import Console

    from simcap.live.validate import fleet_table

    Console(width=160).print(fleet_table(data))

    for rep in result.repeats:
        run = rep.live
        assert run.num_failed == 0, sorted({r.error for r in run.records if r.error})
        assert {r.replica for r in run.records} == {0, 1}
        live_fleet = run.fleet()
        rows = live_fleet["per_replica"]
        assert sum(r["requests"] for r in rows) == len(run.records) == WORKLOAD["num_requests"]
        for row in rows:  # each server counted what the client got from it
            check = row["cross_check"]
            assert check["generation_tokens_rel_diff"] == 0.0, check
            assert check["requests_rel_diff"] == 0.0, check
        assert {r.replica for r in rep.sim_records} == {0, 1}
        if router == "roundrobin":
            # sent in order: request i to server i mod 2, live and in the replay
            by_send = sorted(run.records, key=lambda r: (r.arrival_time, r.request_id))
            assert [r.replica for r in by_send] == [i % 2 for i in range(len(by_send))]
            assert rep.fleet["same_replica_fraction"] == 1.0
            assert rep.fleet["live"]["load_imbalance"] == rep.fleet["predicted"]["load_imbalance"]
    for key in ("requests", "tokens"):
        m = fleet["load_imbalance"][key]
        assert len(m["live"]) == len(result.repeats) and all(v >= 1.0 for v in m["live"])
        assert m["predicted"] is not None and m["predicted"] >= 1.0
