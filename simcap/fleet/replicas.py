"""A fleet: replicas of the engine behind a router, all on one SimPy clock.

``deployment: {replicas: N, router: POLICY, scrape_interval_s: S}`` in a scenario (or
``groups:`` of replicas, each with its own engine, step-time or speculative sections or
profile) runs N engine models (:class:`simcap.simulation.simulator.EngineWorld`, each its own scheduler, KV
pool, step-time model and random streams; replica 0's streams are a lone engine's) on one
clock. Requests come from the scenario's one workload: open-loop arrivals (or a replayed
trace of send times) are routed as they arrive, closed-loop clients are routed as they
send. The router (:mod:`simcap.fleet.router`) sees its own outstanding counts, exact, and each
replica's gauges as scraped every ``scrape_interval_s`` (the first scrape at S; zeros
before).

Order at one instant: every engine step ending at a time ends first; then the router sends
the requests arriving then (an engine whose next step would start then waits for it, so a
request that arrives as a step ends is seen by the next step, as with one engine); scrapes
at that time read the replicas after their steps ended. A scrape reads, per replica, the
running and waiting counts and KV usage of the step in flight as it was scheduled, or the
engine's own between steps.

The fast path holds: an engine's bulk stretch ends at the next arrival or the next scrape
(open loop), or at the next event of any kind (closed loop, where one replica's finish lets
a client send to another), so the router decides on the same state as stepping one by one,
and results are the same float for float. Scrapes happen only for routers that read them.
A router that reads neither its outstanding counts nor the scrapes (``roundrobin``,
``prefix_cache`` weighing only the prefix) decides every open-loop request up front; each
replica then takes its own arrivals as a lone engine does, and its stretches end only at
its own arrivals (a 64-replica fleet costs about what its requests cost on one engine).
With a load-reading router every replica's stretch ends at every fleet arrival, so many
replicas at a high fleet rate run mostly one step at a time (benchmarks/bench_fleet.py).

``deployment.disaggregated`` makes two pools instead: each request is sent first to a
prefill replica as a one-token request (vLLM's P/D proxy does the same), its prompt's KV then
crosses the link (prompt tokens x KV bytes per token / bandwidth + latency) and the decode
pool's router sends it to a decode replica, which admits it with the prompt's KV computed
but for the last token (``Request.num_external_tokens``, as vLLM's KV connector) and streams
its output; the client's TTFT counts from its send. Prefill replicas yield at every finish
(their ends send requests on), and every replica's stretches end at the next event of any
kind, as in a closed loop.

Results: the fleet-wide summary (every request of every replica, as one engine's summary is
computed), and per replica: requests routed, latency percentiles, throughput, preemptions,
prefix-cache hit rate, KV usage, steps. Load imbalance is max / mean over the replicas of
the requests routed (``requests``) and of the tokens served, prompt + output
(``tokens``): 1.0 is even, N is everything on one replica. Each record names its
``replica``; :func:`replica_rows` and :func:`load_imbalance` give the per-replica table and
the imbalance from records alone, so a live run over several servers
(:mod:`simcap.live.routing`) and its simulated replay are tabled by the one function.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simcap.engine.speculative import SpecDecodeCounters
from simcap.errors import SimulationError
from simcap.fleet.router import ReplicaState, make_router, route_request
from simcap.metrics.records import RequestRecord
from simcap.metrics.summary import Distribution, MetricsAccumulator
from simcap.simulation.early_stop import SloStop
from simcap.simulation.fast_forward import LATE, Clock
from simcap.config.scenario import (
    ClosedArrival, Scenario, kv_transfer_bytes_per_token, replica_scenarios,
)
from simcap.simulation.simulator import Result, EngineWorld, closed_loop_clients, provenance
from simcap.simulation.steplog import StepLog
from simcap.workloads.requests import ClosedLoopTrace, RequestSpec, Workload

ROUTER_KNOWS = (
    "own outstanding counts; scraped running/waiting/KV usage; prefix_cache: its own index of "
    "the prompt blocks it sent to each replica (no KV events)"
)


def _ratio_max_mean(values: list[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


@dataclass
class FleetResult(Result):
    """A fleet's run: the fleet-wide summary (``summary``, ``metrics``), and per replica its
    step log, its summary and its group; ``replica_of[i]``: where request i went. ``steps``
    is empty: each replica's steps are in ``replica_steps``."""

    replica_steps: list[StepLog] = field(default_factory=list)
    replica_summaries: list[dict[str, Any]] = field(default_factory=list)
    groups: list[str | None] = field(default_factory=list)
    replica_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fleet_info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["num_steps"] = sum(len(steps) for steps in self.replica_steps)
        out["fleet"] = self.fleet_info
        return out


class Fleet:
    """The replicas, the router, its scrapes and the requests' sources, on one clock."""

    def __init__(
        self, scenario: Scenario, fast: bool = True, records: bool = False, steps: bool = False,
        stop: SloStop | None = None,
    ) -> None:
        dep = scenario.deployment
        assert dep is not None
        self.scenario = scenario
        self.stop = stop
        self.num_arrivals = 0  # open loop: every request the run will have
        self.env = Clock()
        self.records: dict[int, RequestRecord] | None = {} if records else None
        self.configs = configs = replica_scenarios(scenario)
        self.groups = [name for name, _ in configs]
        # Disaggregated: prefill replicas take each request first (as a one-token request, as
        # vLLM's P/D proxy sends it); no client sees their output, so they keep no records.
        self.disaggregated = dep.disaggregated is not None
        self.replicas = [
            EngineWorld(s, fast, records and name != "prefill", steps, fleet=self, index=i)
            for i, (name, s) in enumerate(configs)
        ]
        n = len(self.replicas)
        if self.disaggregated:
            self.pools = [[i for i, name in enumerate(self.groups) if name == role]
                          for role in ("prefill", "decode")]
            self.kv_bytes_per_token = kv_transfer_bytes_per_token(scenario)
            self.link = dep.disaggregated.kv_transfer
        else:
            self.pools = [list(range(n))]
        self.routers = [
            make_router(
                dep.router, len(pool),
                capacities=[self.replicas[i].scheduler.kv.num_blocks - 1 for i in pool],
                weights=dep.scorer_weights if dep.router == "prefix_cache" else None,
            )
            for pool in self.pools
        ]
        self.router = self.routers[0]
        self.block_size = self.replicas[0].scheduler.kv.block_size
        self.client_done: dict[int, Any] = {}  # disaggregated closed loop: until the decode
        self.transfer_s = 0.0  # disaggregated: KV transfer seconds, summed over requests
        self.interval = dep.scrape_interval_s
        self.workload = Workload(scenario.workload, scenario.seed)
        self.outstanding = [0] * n
        self.scraped = [(0, 0, 0.0)] * n
        self.replica_of = array("q")
        self.num_routed = [0] * n
        self.tokens_routed = [0] * n
        self._clients: dict[int, tuple] = {}  # disaggregated: requests in prefill or transfer
        self.next_arrival = math.inf  # the next open-loop arrival not yet routed
        self.next_scrape = math.inf
        self.next_stop_check = math.inf  # (open loop with a stop rule: checked on the clock)
        self.closed = False  # closed loop: engines' horizon is the next event of any kind
        self.sources_done = False  # no request will be sent any more

    # ------------------------------------------------------------------ router side

    def horizon(self) -> float:
        """Where a replica's bulk stretch must end: what may send it a request next."""
        if self.closed:
            return self.env.peek()
        return min(self.next_arrival, self.next_scrape, self.next_stop_check)

    def route(self, spec: RequestSpec, now: float, client_id: int | None = None, pool: int = 0):
        """The replica the router of ``pool`` picks for ``spec`` (arriving at ``now``),
        counted as sent there; the caller submits it."""
        router = self.routers[pool]
        members = self.pools[pool]
        request = route_request(spec, client_id, self.block_size, router.needs_block_hashes, now)
        states = [ReplicaState(self.outstanding[i], *self.scraped[i]) for i in members]
        j = router.pick(request, states)
        router.routed(request, j)
        r = members[j]
        self.outstanding[r] += 1
        self.num_routed[r] += 1
        self.tokens_routed[r] += spec.num_prompt_tokens + spec.max_tokens
        ids = self.replica_of
        while len(ids) <= spec.request_id:
            ids.append(-1)
        ids[spec.request_id] = r
        replica = self.replicas[r]
        replica.num_arrivals += 1
        return replica

    def send(self, spec: RequestSpec, now: float, client_id: int | None = None, done=None) -> None:
        """A client's request: to the replica the router picks (a prefill replica first,
        when disaggregated). ``done``: called when its response ends."""
        replica = self.route(spec, now, client_id)
        if not self.disaggregated:
            if done is not None:
                replica._on_finish[spec.request_id] = done
            replica.submit(spec, now, client_id)
            return
        if done is not None:
            self.client_done[spec.request_id] = done
        self._clients[spec.request_id] = (spec, now, client_id)
        replica._on_finish[spec.request_id] = _nothing  # (so that its engine wakes the clock)
        replica.submit(spec._replace(max_tokens=1), now)

    def responses_ended(self, replica: int, reqs: list, now: float) -> None:
        self.outstanding[replica] -= len(reqs)
        if self.disaggregated and self.groups[replica] == "prefill":
            for req in reqs:  # the KV moves to a decode replica
                spec, sent, client_id = self._clients.pop(req.request_id)
                seconds = (spec.num_prompt_tokens * self.kv_bytes_per_token
                           / (self.link.bandwidth_gbps * 1e9) + self.link.latency_s)
                self.transfer_s += seconds
                event = self.env.timeout_at(now + seconds, LATE)
                event.callbacks.append(
                    lambda _, spec=spec, sent=sent, client_id=client_id:
                        self.handoff(spec, sent, client_id)
                )

    def handoff(self, spec: RequestSpec, sent: float, client_id: int | None) -> None:
        """A prefill's KV has arrived: the decode pool's router picks a replica for it."""
        now = self.env.now
        replica = self.route(spec, now, client_id, pool=1)
        done = self.client_done.pop(spec.request_id, None)
        if done is not None:
            replica._on_finish[spec.request_id] = done
        replica.submit(spec, now, client_id, sent=sent, external=spec.num_prompt_tokens)

    # ------------------------------------------------------------------ processes

    def arrivals(self, times, specs):
        """Open loop (or replayed send times): route each request as it arrives."""
        env = self.env
        for i in range(len(times)):
            t = times[i]
            self.next_arrival = t
            if t > env.now:
                yield env.timeout_at(t, LATE)
            self.send(specs(i), t)
        self.next_arrival = math.inf
        self.sources_done = True

    def closed_loop(self, arrival: ClosedArrival):
        """Closed-loop clients, each routed as it sends (as one engine's clients)."""
        clients = closed_loop_clients(self.env, self.workload, arrival, self.send)

        def watch():
            yield self.env.all_of(clients)
            self.sources_done = True

        self.env.process(watch())

    def scrapes(self):
        """Every ``scrape_interval_s``: each replica's gauges, until nothing more is sent."""
        env = self.env
        k = 1
        while not self.sources_done:
            t = k * self.interval
            self.next_scrape = t
            yield env.timeout_at(t, LATE)
            self.scraped = [r.gauges(t) for r in self.replicas]
            k += 1
        self.next_scrape = math.inf

    def stop_checks(self):
        """The early-stop rule over the whole fleet, at its check times (open loop only; every
    replica's stretches end there, and routing ahead is off).

        Replicas may be ahead of the clock on the fast path: a request they have finished
        counts with its own latency, an unfinished one with the bound ``now - arrival``
        (its first or last token comes at the end of a later step), so the rule stays
        conservative."""
        env = self.env
        stop = self.stop
        assert stop is not None
        while True:
            self.next_stop_check = max(stop.next_check, env.now)
            if stop.next_check > env.now:
                yield env.timeout_at(stop.next_check, LATE)
            if self.sources_done and not any(
                r.scheduler.has_unfinished_requests() for r in self.replicas
            ):
                break
            if stop(self, env.now):
                self.stopped = True
                break
        self.next_stop_check = math.inf

    @property
    def scheduler(self):
        """Every replica's waiting and running requests, as the stop rule reads one engine's."""
        return _Pending(
            [r for rep in self.replicas for r in rep.scheduler.waiting],
            [r for rep in self.replicas for r in rep.scheduler.running],
        )

    @property
    def metrics(self) -> MetricsAccumulator:
        """The clients' requests: every replica's (the decode pool's, when disaggregated)."""
        return MetricsAccumulator.merged(
            [r.metrics for r, name in zip(self.replicas, self.groups) if name != "prefill"]
        )

    def open(self) -> None:
        """Take requests sent from outside, as they come (``simcap serve``): every replica's
        engine runs and waits for :meth:`send`; a load-reading router's scrapes go on; a
        step ends wherever anything may happen next, as in a closed loop."""
        for replica in self.replicas:
            self.env.process(replica.engine())
        self.closed = True
        if any(router.reads_gauges for router in self.routers):
            self.env.process(self.scrapes())

    # ------------------------------------------------------------------ run

    def route_ahead(self, times, specs) -> None:
        """A router that reads no load decides every open-loop request up front: each
        replica then takes its own arrivals itself, as a lone engine does (and its bulk
        stretches end only at its own arrivals)."""
        mine: list[list[int]] = [[] for _ in self.replicas]
        for i in range(len(times)):
            mine[self.route(specs(i), times[i]).index].append(i)
        self.sources_done = True
        for replica, ids in zip(self.replicas, mine):
            own = array("d", (times[i] for i in ids))
            self.env.process(replica.engine(own, lambda j, ids=ids: specs(ids[j])))

    def run(self, trace: list[tuple[float, RequestSpec]] | None = None) -> FleetResult:
        env = self.env
        arrival = self.scenario.workload.arrival
        if isinstance(trace, ClosedLoopTrace):
            raise ValueError("a fleet replays traces of send times, not closed-loop traces")
        if trace is not None:
            times = list(itertools.accumulate((t for t, _ in trace), max))
            specs = lambda i: trace[i][1]  # noqa: E731
        elif isinstance(arrival, ClosedArrival):
            times = specs = None
        else:
            times = array("d", self.workload.arrival_times().tobytes())
            specs = self.workload.spec
        if times is not None:
            self.num_arrivals = len(times)
            if self.stop is not None:
                self.next_stop_check = self.stop.next_check
                env.process(self.stop_checks())
        elif self.stop is not None:
            raise ValueError("a stop rule needs open-loop or replayed arrivals")
        ahead = not (self.router.reads_outstanding or self.router.reads_gauges)
        if self.disaggregated:
            self.closed = True  # a prefill's end sends a request on: any event is a horizon
        if times is not None and ahead and self.stop is None and not self.disaggregated:
            self.route_ahead(times, specs)
        else:
            for replica in self.replicas:
                env.process(replica.engine())
            if times is None:
                self.closed = True
                self.closed_loop(arrival)
            else:
                self.next_arrival = times[0] if len(times) else math.inf
                env.process(self.arrivals(times, specs))
            if any(router.reads_gauges for router in self.routers):
                env.process(self.scrapes())
        self.stopped = False
        if self.stop is None:
            env.run()
        else:
            while not self.stopped and env.peek() < math.inf:
                env.step()
        if not self.stopped and any(r.scheduler.has_unfinished_requests() for r in self.replicas):
            raise SimulationError("simulation ended with unfinished requests")
        return self.result()

    def result(self) -> FleetResult:
        scenario = self.scenario
        slo = dict(scenario.slo) or None
        per_replica = []
        spec_counters = None
        usage_means, usage_maxes = [], []
        for i, replica in enumerate(self.replicas):
            replica._flush_gaps()
            kv = replica.steps.kv_usage_summary()
            summary = replica.metrics.summary(slo=slo, kv_usage=kv)
            per_replica.append(self._replica_row(i, summary, kv))
            if kv["mean"] is not None:
                usage_means.append(kv["mean"])
                usage_maxes.append(kv["max"])
            if replica.spec_counters is not None:
                spec_counters = _add_counters(spec_counters, replica.spec_counters)
        metrics = self.metrics
        kv_usage = (
            {"mean": sum(usage_means) / len(usage_means), "max": max(usage_maxes)}
            if usage_means else {"mean": None, "max": None}
        )
        summary = metrics.summary(
            slo=slo, kv_usage=kv_usage,
            spec_decode=spec_counters.to_dict() if spec_counters else None,
        )
        dep = scenario.deployment
        assert dep is not None
        info: dict[str, Any] = {
            "replicas": len(self.replicas),
            "router": dep.router,
            "scrape_interval_s": dep.scrape_interval_s,
            "router_knows": ROUTER_KNOWS,
        }
        if dep.router == "prefix_cache":
            info["weights"] = dep.scorer_weights
        last = self.pools[-1]  # the replicas that answer the clients
        info["load_imbalance"] = {
            "requests": _ratio_max_mean([float(self.num_routed[i]) for i in last]),
            "tokens": _ratio_max_mean([float(self.tokens_routed[i]) for i in last]),
        }
        if self.disaggregated:
            first = self.pools[0]
            done = max(summary.completed, 1)
            info["disaggregated"] = {
                "prefill_replicas": len(first),
                "decode_replicas": len(last),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_transfer_mean_s": self.transfer_s / done if summary.completed else None,
                "prefill_load_imbalance": _ratio_max_mean([float(self.num_routed[i]) for i in first]),
            }
        info["per_replica"] = per_replica
        stopped = self.stop.record if self.stop is not None and self.stopped else None
        if stopped is not None:
            for key in stopped.failed:
                if summary.slo and key in summary.slo:
                    summary.slo[key]["pass"] = False
            summary = dataclasses.replace(summary, slo_pass=False)
        records = None if self.records is None else [self.records[i] for i in sorted(self.records)]
        if records is not None:
            for record in records:
                record.replica = int(self.replica_of[record.request_id])
        return FleetResult(
            scenario, summary, metrics, StepLog(keep=False), records, provenance(scenario), stopped,
            replica_steps=[r.steps for r in self.replicas],
            replica_summaries=per_replica,
            groups=list(self.groups),
            replica_of=np.frombuffer(self.replica_of, dtype=np.int64).copy(),
            fleet_info=info,
        )

    def _replica_row(self, i: int, summary, kv: dict[str, Any]) -> dict[str, Any]:
        stat = Distribution.stat
        hits = summary.prefix_cache_hit_tokens
        return {
            "replica": i,
            "group": self.groups[i],  # (disaggregated: "prefill" or "decode")
            "requests": self.num_routed[i],
            "completed": summary.completed,
            "ttft_p50_s": stat(summary.ttft_s, "p50"),
            "ttft_p95_s": stat(summary.ttft_s, "p95"),
            "tpot_p95_s": stat(summary.tpot_s, "p95"),
            "e2e_p95_s": stat(summary.e2e_s, "p95"),
            "output_tokens_per_s": summary.throughput["output_tokens_per_s"],
            "preemptions": summary.preemptions,
            "prefix_cache_hit_tokens": hits,
            "prefix_cache_hit_rate": hits / summary.input_tokens if summary.input_tokens else None,
            "kv_cache_usage_mean": kv["mean"],
            "kv_cache_usage_max": kv["max"],
            "num_steps": len(self.replicas[i].steps),
        }


@dataclass
class _Pending:
    waiting: list
    running: list


def _nothing(*_: Any) -> None:
    pass


def _add_counters(total: SpecDecodeCounters | None, part: SpecDecodeCounters) -> SpecDecodeCounters:
    if total is None:
        total = SpecDecodeCounters()
    total.num_drafts += part.num_drafts
    total.num_draft_tokens += part.num_draft_tokens
    total.num_accepted_tokens += part.num_accepted_tokens
    per_pos = total.accepted_per_pos
    for j, count in enumerate(part.accepted_per_pos):
        if j < len(per_pos):
            per_pos[j] += count
        else:
            per_pos.append(count)
    return total


def replica_rows(
    records: list[RequestRecord], num_replicas: int, slo: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Per replica, from the records alone (each names its ``replica``): requests routed,
    completed, tokens routed (prompt + max_tokens), latency percentiles and throughput."""
    from simcap.metrics.summary import summarize

    stat = Distribution.stat
    rows = []
    for i in range(num_replicas):
        mine = [r for r in records if r.replica == i]
        row: dict[str, Any] = {
            "replica": i,
            "requests": len(mine),
            "tokens": sum(r.num_prompt_tokens + r.max_tokens for r in mine),
        }
        if any(r.succeeded for r in mine):
            summary = summarize(mine, slo=slo)
            row.update(
                completed=summary.completed,
                ttft_p50_s=stat(summary.ttft_s, "p50"),
                ttft_p95_s=stat(summary.ttft_s, "p95"),
                tpot_p95_s=stat(summary.tpot_s, "p95"),
                e2e_p95_s=stat(summary.e2e_s, "p95"),
                output_tokens_per_s=summary.throughput["output_tokens_per_s"],
            )
        else:
            row.update(completed=0, ttft_p50_s=None, ttft_p95_s=None, tpot_p95_s=None,
                       e2e_p95_s=None, output_tokens_per_s=None)
        rows.append(row)
    return rows


def load_imbalance(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Max / mean over the replicas of :func:`replica_rows`' requests and tokens routed."""
    return {
        "requests": _ratio_max_mean([float(r["requests"]) for r in rows]),
        "tokens": _ratio_max_mean([float(r["tokens"]) for r in rows]),
    }


def simulate_fleet(
    scenario: Scenario,
    trace: list[tuple[float, RequestSpec]] | None = None,
    *,
    fast: bool = True,
    records: bool = False,
    steps: bool = False,
    stop: SloStop | None = None,
) -> FleetResult:
    """Run a scenario with a ``deployment`` (replicas behind a router) to completion, or
    until ``stop`` (:class:`simcap.simulation.early_stop.SloStop`, open loop) says its SLO must fail."""
    return Fleet(scenario, fast, records, steps, stop).run(trace)
