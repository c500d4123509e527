"""Workload: which requests arrive when, with what prompt and output lengths.

Deterministic in the scenario's seed: independent random streams (spawned from one
``numpy.random.SeedSequence``) drive arrivals, input lengths, output lengths and prefix
groups, so that changing the arrival rate leaves the i-th request's lengths unchanged.
The same object feeds the simulator and the live client.

:class:`ClosedLoopTrace` is a closed-loop run to replay as one: its clients, each with its own
sequence of requests and the gap between each response's end and that client's next send.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

import numpy as np

from simcap.metrics.records import RequestRecord
from simcap.config.scenario import (
    ClosedArrival,
    EmpiricalLength,
    FixedLength,
    GammaArrival,
    PoissonArrival,
    UniformLength,
    WorkloadConfig,
)

_CHUNK = 1024  # lengths are drawn in fixed-size chunks so request i is the same in any run


class RequestSpec(NamedTuple):
    """What the i-th request asks for: its prompt (as content segments) and output length."""

    request_id: int
    num_prompt_tokens: int
    max_tokens: int
    # (content key, tokens): prompts sharing a key share those tokens (prefix caching); a
    # key below zero is the request's own (see simcap.engine.request).
    segments: tuple[tuple[int, int], ...]
    # Key of the answer's tokens: >= 0 when a later prompt quotes them (a session's next
    # turn); None: the request's own (private) key.
    output_key: int | None = None
    session_id: int | None = None  # a session's turn: which session, and which turn (0-based)
    turn: int | None = None


class ClientRequest(NamedTuple):
    """One request of a replayed client: how long the client waits before sending it, and what.

    ``gap_s``: for the client's first request, its send time on the run's clock; for each
    later one, the time from the end of the client's previous response to this send.
    """

    gap_s: float
    spec: RequestSpec


@dataclass(frozen=True)
class ClosedLoopTrace:
    """A closed-loop run, client by client: ``clients[c]`` is client c's requests in its order.

    Replayed (``simulate(scenario, trace=...)``), each client sends its first request at its
    first gap, waits for the response to end, waits the next gap, sends its next request, and
    so on: a step priced slower delays the client's next send instead of queueing it. Request
    ids are 0..N-1 (in the recorded run's send order).
    """

    clients: tuple[tuple[ClientRequest, ...], ...]

    def __post_init__(self) -> None:
        ids = sorted(r.spec.request_id for c in self.clients for r in c)
        if ids != list(range(len(ids))):
            raise ValueError("trace: request ids must be 0..N-1, each once")
        if any(r.gap_s < 0 or not math.isfinite(r.gap_s) for c in self.clients for r in c):
            raise ValueError("trace: gaps must be finite and >= 0")

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.clients)

    @classmethod
    def from_records(
        cls, records: Iterable[RequestRecord], spec_of: Callable[[RequestRecord, int], RequestSpec],
        by: str = "client_id",
    ) -> "ClosedLoopTrace":
        """The trace of a closed-loop run's completed records (each with its ``client_id``).

        ``spec_of(record, j)``: the request to replay for ``record``, with id ``j`` (0..N-1 in
        send order). A failed request is left out; its time folds into the gap before its
        client's next send. ``by``: the record field that names the client, ``client_id``, or
        ``session_id`` (an open-loop session run: each session is one client, its first turn
        at its send time).
        """
        done = sorted((r for r in records if r.succeeded), key=lambda r: (r.arrival_time, r.request_id))
        if any(getattr(r, by) is None for r in done):
            raise ValueError(
                f"records: a closed-loop replay needs each record's {by} (an open-loop run has no client_id)"
            )
        per_client: dict[int, list[ClientRequest]] = {}
        last_end: dict[int, float] = {}
        for j, rec in enumerate(done):
            c = getattr(rec, by)
            assert c is not None and rec.finish_time is not None
            gap = rec.arrival_time - last_end[c] if c in last_end else rec.arrival_time
            per_client.setdefault(c, []).append(ClientRequest(max(gap, 0.0), spec_of(rec, j)))
            last_end[c] = rec.finish_time
        return cls(tuple(tuple(per_client[c]) for c in sorted(per_client)))


def draw_lengths(
    spec: FixedLength | UniformLength | EmpiricalLength, rng: np.random.Generator, size: int
) -> np.ndarray:
    """``size`` lengths (int64) drawn from ``spec`` with ``rng``."""
    if isinstance(spec, FixedLength):
        return np.full(size, spec.value, dtype=np.int64)
    if isinstance(spec, UniformLength):
        return rng.integers(spec.low, spec.high + 1, size=size, dtype=np.int64)
    return rng.choice(np.asarray(spec.values, dtype=np.int64), size=size)


def arrival_times(
    arrival: PoissonArrival | GammaArrival, rng: np.random.Generator,
    count: int | None, duration_s: float | None,
) -> np.ndarray:
    """Open-loop send times in seconds, the first at 0 (as a benchmark client starts): the
    first ``count`` of them, or all before ``duration_s``."""
    if isinstance(arrival, PoissonArrival):
        shape, scale = 1.0, 1.0 / arrival.rate
    else:
        assert isinstance(arrival, GammaArrival)
        shape, scale = arrival.burstiness, 1.0 / (arrival.rate * arrival.burstiness)
    if count is not None:
        gaps = rng.gamma(shape, scale, size=count - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])
    assert duration_s is not None
    parts = [np.zeros(1)]
    last = 0.0
    while last <= duration_s:
        times = last + np.cumsum(rng.gamma(shape, scale, size=_CHUNK))
        parts.append(times)
        last = float(times[-1])
    times = np.concatenate(parts)
    return times[times < duration_s]


class _LengthSampler:
    def __init__(self, spec: FixedLength | UniformLength | EmpiricalLength, rng: np.random.Generator):
        self.spec = spec
        self.rng = rng
        self.drawn = array("q")  # (8 bytes a request; indexing gives a Python int)

    def _draw(self) -> np.ndarray:
        return draw_lengths(self.spec, self.rng, _CHUNK)

    def __getitem__(self, i: int) -> int:
        while i >= len(self.drawn):
            self.drawn.frombytes(self._draw().astype(np.int64).tobytes())
        return self.drawn[i]


class Workload:
    """Request specs and (open loop) arrival times for one scenario and seed.

    With ``workload.trace`` the requests are the trace's (:mod:`simcap.config.traces`), in its order,
    sent at its times, or by ``workload.arrival`` when one is given.
    """

    def __init__(self, config: WorkloadConfig, seed: int) -> None:
        self.config = config
        self._trace = config.trace_requests
        arrival_ss, input_ss, output_ss, prefix_ss = np.random.SeedSequence(seed).spawn(4)
        self._arrival_rng = np.random.default_rng(arrival_ss)
        if self._trace is None:
            assert config.input_len is not None and config.output_len is not None
            self._input = _LengthSampler(config.input_len, np.random.default_rng(input_ss))
            self._output = _LengthSampler(config.output_len, np.random.default_rng(output_ss))
        self._prefix_rng = np.random.default_rng(prefix_ss)
        self._prefix_groups = np.empty(0, dtype=np.int64)

    @property
    def is_closed_loop(self) -> bool:
        return isinstance(self.config.arrival, ClosedArrival)

    @property
    def num_requests(self) -> int | None:
        if self._trace is not None:
            return len(self._trace)
        return self.config.num_requests

    @property
    def duration_s(self) -> float | None:
        return self.config.duration_s

    def spec(self, i: int) -> RequestSpec:
        """The i-th request (0-based); the same for every run of this workload and seed."""
        unique_key = -2 * i - 1
        trace = self._trace
        if trace is not None:
            num_prompt = int(trace.input_lens[i])
            return RequestSpec(i, num_prompt, int(trace.output_lens[i]), trace.segments(i, unique_key))
        try:  # (the lengths drawn so far, read in place: this runs for every request)
            num_prompt = self._input.drawn[i]
            max_tokens = self._output.drawn[i]
        except IndexError:
            num_prompt = self._input[i]
            max_tokens = self._output[i]
        prefix = self.config.prefix
        if prefix is None:
            return RequestSpec(i, num_prompt, max_tokens, ((unique_key, num_prompt),))
        while i >= len(self._prefix_groups):
            draw = self._prefix_rng.integers(0, prefix.num_prefixes, size=_CHUNK)
            self._prefix_groups = np.concatenate([self._prefix_groups, draw])
        group = int(self._prefix_groups[i])
        segments = ((group, prefix.shared_tokens), (unique_key, num_prompt - prefix.shared_tokens))
        return RequestSpec(i, num_prompt, max_tokens, segments)

    def arrival_times(self) -> np.ndarray:
        """Open-loop send times in seconds, the first at 0 (as a benchmark client starts)."""
        arrival = self.config.arrival
        if isinstance(arrival, ClosedArrival):
            raise ValueError("a closed-loop workload has no arrival times; clients pace it")
        if arrival is None:  # a trace at its own times
            assert self._trace is not None and self._trace.times is not None
            return self._trace.times.copy()
        return arrival_times(arrival, self._arrival_rng, self.num_requests, self.duration_s)
