"""Routers: which replica of a fleet gets a request, from what a real router can see.

Each router is a pure piece: given the request (its id, its affinity key, its prompt's block
hashes) and one :class:`ReplicaState` per replica, ``pick`` names a replica; ``routed`` tells
it where the request went (its own bookkeeping). A router sees only

- its own count of outstanding requests per replica (up when it sends a request, down when
  the response ends), exact at every decision;
- the replicas' metrics as last scraped (every ``deployment.scrape_interval_s``): running
  and waiting requests and KV-cache usage, the gauges vLLM publishes with each step
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``);
- for ``prefix_cache``: the prompts it has itself sent to each replica (below), not the
  replicas' KV events.

Ties go to the first replica at or after a rotating pointer (the replica after the last one
picked), so that equal replicas share requests in turn; every router is deterministic.

=====================  =========================================================================
``roundrobin``         replica ``i mod N`` for the i-th request (vLLM production-stack's
                       ``roundrobin`` routing logic)
``least_request``      fewest outstanding requests (Envoy's ``LEAST_REQUEST``; the router's own
                       counts)
``kv_cache_utilization`` lowest scraped KV-cache usage, then fewest outstanding (llm-d's
                       ``kv-cache-utilization-scorer`` alone)
``session``            a request with an affinity key goes where the key hashes to (production-
                       stack's ``session`` routing logic, a hash of the session id over the
                       replicas); one without a key, as ``least_request``
``prefix_cache``       highest weighted score ``w_prefix * prefix + w_queue * queue + w_kv * kv``
                       (llm-d's scorers and weights): ``prefix`` the fraction of the prompt's
                       full blocks, from its first, found in the router's index of the
                       replica; ``queue`` llm-d's queue scorer ``(max - q) / (max - min)`` of
                       the scraped waiting counts (1 when all equal); ``kv`` ``1 - usage``
=====================  =========================================================================

The prefix index is llm-d's estimated (approximate) prefix-cache scorer: per replica an LRU
of the block hashes of the prompts the router sent there, as many as the replica's KV pool
has blocks. It knows nothing the replica evicted sooner, nor anything cached by requests it
did not route; a KV-event-fed index (Dynamo's KV router, llm-d's precise scorer) would.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from simcap.config.scenario import PREFIX_CACHE_WEIGHTS, ROUTERS
from simcap.errors import ScenarioError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica when it decides."""

    outstanding: int = 0  # the router's own count: sent, response not yet ended
    num_running: int = 0  # scraped
    num_waiting: int = 0  # scraped
    kv_cache_usage: float = 0.0  # scraped, 0..1


@dataclass(frozen=True)
class RouteRequest:
    request_id: int
    affinity_key: int | None = None
    block_hashes: Sequence[int] = field(default=())


def affinity_key(spec: Any, client_id: int | None) -> int | None:
    """The key that keeps a request on its replica under ``session``: its conversation's
    ``session_id`` when it is a session's turn, else the sending closed-loop client's id
    (None for an open-loop request)."""
    session_id = getattr(spec, "session_id", None)
    return session_id if session_id is not None else client_id


def route_request(spec: Any, client_id: int | None, block_size: int, hashes: bool,
                  now: float = 0.0) -> RouteRequest:
    """What a router is told of ``spec``: its id, affinity key and, when the router reads
    them (``hashes``), its prompt's full-block hashes at ``block_size``."""
    block_hashes: Sequence[int] = ()
    if hashes:
        from simcap.engine.request import Request

        block_hashes = Request(
            spec.request_id, now, spec.num_prompt_tokens, spec.max_tokens, spec.segments
        ).hash_full_blocks(block_size)
    return RouteRequest(spec.request_id, affinity_key(spec, client_id), block_hashes)


def session_hash(key: int) -> int:
    """A well-mixed 64-bit hash of an affinity key (splitmix64's finaliser): the same in
    every run, unlike Python's salted string hashes."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Router:
    """Base: the rotating tie-break pointer and the no-op bookkeeping."""

    name = ""
    needs_block_hashes = False
    # What the decision reads besides the router's own history: the outstanding counts, the
    # scraped gauges. A router that reads neither decides every request ahead of time.
    reads_outstanding = True
    reads_gauges = False

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._after = -1  # the last replica picked

    def _best(self, keys: Sequence) -> int:
        """The replica with the smallest key; ties to the first at or after the pointer."""
        n = self.num_replicas
        start = (self._after + 1) % n
        best = start
        for j in range(1, n):
            i = (start + j) % n
            if keys[i] < keys[best]:
                best = i
        return best

    def pick(self, request: RouteRequest, states: Sequence[ReplicaState]) -> int:
        raise NotImplementedError

    def routed(self, request: RouteRequest, replica: int) -> None:
        self._after = replica


class RoundRobin(Router):
    name = "roundrobin"
    reads_outstanding = False

    def pick(self, request: RouteRequest, states: Sequence[ReplicaState]) -> int:
        return (self._after + 1) % self.num_replicas


class LeastRequest(Router):
    name = "least_request"

    def pick(self, request: RouteRequest, states: Sequence[ReplicaState]) -> int:
        return self._best([s.outstanding for s in states])


class KvCacheUtilization(Router):
    name = "kv_cache_utilization"
    reads_gauges = True

    def pick(self, request: RouteRequest, states: Sequence[ReplicaState]) -> int:
        return self._best([(s.kv_cache_usage, s.outstanding) for s in states])


class Session(Router):
    name = "session"

    def pick(self, request: RouteRequest, states: Sequence[ReplicaState]) -> int:
        if request.affinity_key is None:
            return self._best([s.outstanding for s in states])
        return session_hash(request.affinity_key) % self.num_replicas


class PrefixIndex:
    """Block hashes the router sent to one replica, least recently sent first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the index holds."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class PrefixCache(Router):
    name = "prefix_cache"
    needs_block_hashes = True

    def __init__(
        self, num_replicas: int, capacities: Sequence[int], weights: Mapping[str, float] | None = None
    ) -> None:
        super().__init__(num_replicas)
        self.weights = {**PREFIX_CACHE_WEIGHTS, **(weights or {})}
        self.indexes = [PrefixIndex(c) for c in capacities]
        self.reads_outstanding = False
        self.reads_gauges = bool(self.weights["queue"] or self.weights["kv_cache_utilization"])

    def scores(self, request: RouteRequest, states: Sequence[ReplicaState]) -> list[float]:
        """Each replica's weighted score (higher is better)."""
        w = self.weights
        hashes = request.block_hashes
        waiting = [s.num_waiting for s in states]
        lo, hi = min(waiting), max(waiting)
        out = []
        for index, state in zip(self.indexes, states):
            prefix = index.match(hashes) / len(hashes) if hashes else 0.0
            queue = 1.0 if hi == lo else (hi - state.num_waiting) / (hi - lo)
            kv = 1.0 - state.kv_cache_usage
            out.append(
                w["prefix_cache"] * prefix + w["queue"] * queue + w["kv_cache_utilization"] * kv
            )
        return out

    def pick(self, request: RouteRequest, states: Sequence[ReplicaState]) -> int:
        return self._best([-s for s in self.scores(request, states)])

    def routed(self, request: RouteRequest, replica: int) -> None:
        super().routed(request, replica)
        self.indexes[replica].add(request.block_hashes)


def make_router(
    name: str, num_replicas: int, *, capacities: Sequence[int] | None = None,
    weights: Mapping[str, float] | None = None,
) -> Router:
    """The router called ``name`` over ``num_replicas`` replicas; ``capacities``: each
    replica's KV blocks (the prefix index's size), ``weights``: the prefix_cache scorers'."""
    if name == "roundrobin":
        return RoundRobin(num_replicas)
    if name == "least_request":
        return LeastRequest(num_replicas)
    if name == "kv_cache_utilization":
        return KvCacheUtilization(num_replicas)
    if name == "session":
        return Session(num_replicas)
    if name == "prefix_cache":
        return PrefixCache(num_replicas, capacities or [1 << 20] * num_replicas, weights)
    raise ScenarioError(f"deployment.router: unknown router {name!r}; known: {', '.join(ROUTERS)}")
