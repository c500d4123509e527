"""Routing a live run over several servers: the fleet's routers (:mod:`simcap.fleet.router`) fed
with what a real router in front of real servers sees.

A scenario with ``deployment: {replicas: N, router: POLICY}`` run live over N base URLs
sends each request to the server the router picks. :class:`LiveRouter` is the bookkeeping:
its own count of outstanding requests per server (up when a request is sent, down when its
response ends, failed or not), and each server's gauges (running and waiting requests, KV
usage) from ``/metrics`` as last scraped; the run scrapes every
``deployment.scrape_interval_s`` when the router reads them. ``prefix_cache``'s index holds
as many blocks as each server reports in its pool (``vllm:cache_config_info``), hashed at
the server's block size. Groups of replicas and disaggregated pools are simulated only; a
session workload runs on one server, since a scenario refuses sessions with a deployment
(:func:`simcap.config.scenario.replica_scenarios`).
"""

from __future__ import annotations

from typing import Sequence

from simcap.config.scenario import Scenario
from simcap.errors import SimcapError
from simcap.fleet.router import ReplicaState, make_router, route_request
from simcap.live.prom import ServerMetrics
from simcap.workloads.requests import RequestSpec

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
OLD_KV_GAUGE = "vllm:gpu_cache_usage_perc"  # vLLM before the rename


class LiveRouterError(SimcapError):
    """The scenario and the servers given do not make a fleet that can be run live."""


def check_fleet_urls(scenario: Scenario, num_urls: int) -> None:
    """The servers given must be the scenario's replicas: one URL and no deployment, or
    exactly ``deployment.replicas`` URLs; else a one-line :class:`LiveRouterError`."""
    dep = scenario.deployment
    if dep is None:
        if num_urls > 1:
            raise LiveRouterError(
                f"--base-url: {num_urls} servers given but the scenario has no deployment; add "
                f"deployment: {{replicas: {num_urls}, router: ...}} to route over them"
            )
        return
    if dep.groups is not None or dep.disaggregated is not None:
        raise LiveRouterError(
            "deployment: live runs route over identical replicas (replicas and router); "
            "groups and disaggregated pools are simulated only"
        )
    if dep.num_replicas != num_urls:
        raise LiveRouterError(
            f"--base-url: deployment.replicas is {dep.num_replicas} but {num_urls} server(s) "
            f"given; give one --base-url per replica"
        )


def gauges_of(metrics: ServerMetrics | None) -> tuple[int, int, float]:
    """(running, waiting, KV usage 0..1) of one scrape; zeros when it failed."""
    if metrics is None:
        return (0, 0, 0.0)
    g = metrics.gauges
    usage = g.get(GAUGES[2], g.get(OLD_KV_GAUGE, 0.0))
    return (int(g.get(GAUGES[0], 0.0)), int(g.get(GAUGES[1], 0.0)), float(usage))


class LiveRouter:
    """The router of ``scenario.deployment`` over ``num_servers`` servers, and what it knows."""

    def __init__(
        self, scenario: Scenario, num_servers: int, *, block_size: int | None = None,
        capacities: Sequence[int | None] | None = None,
    ) -> None:
        dep = scenario.deployment
        assert dep is not None
        check_fleet_urls(scenario, num_servers)
        self.block_size = block_size or scenario.engine.block_size
        default = max(scenario.engine.num_gpu_blocks - 1, 1)
        caps = [c if c else default for c in (capacities or [None] * num_servers)]
        self.router = make_router(
            dep.router, num_servers, capacities=caps,
            weights=dep.scorer_weights if dep.router == "prefix_cache" else None,
        )
        self.scrape_interval_s = dep.scrape_interval_s
        self.outstanding = [0] * num_servers
        self.scraped = [(0, 0, 0.0)] * num_servers
        self.num_routed = [0] * num_servers

    @property
    def reads_gauges(self) -> bool:
        return self.router.reads_gauges

    def send(self, spec: RequestSpec, client_id: int | None = None) -> int:
        """The server ``spec`` goes to, counted as outstanding there."""
        request = route_request(spec, client_id, self.block_size, self.router.needs_block_hashes)
        states = [ReplicaState(o, *g) for o, g in zip(self.outstanding, self.scraped)]
        replica = self.router.pick(request, states)
        self.router.routed(request, replica)
        self.outstanding[replica] += 1
        self.num_routed[replica] += 1
        return replica

    def ended(self, replica: int) -> None:
        """A response from ``replica`` ended (finished, failed or cut)."""
        self.outstanding[replica] -= 1

    def observe(self, replica: int, metrics: ServerMetrics | None) -> None:
        """A scrape of ``replica``'s ``/metrics`` (None: it failed; the last one is kept)."""
        if metrics is not None:
            self.scraped[replica] = gauges_of(metrics)
