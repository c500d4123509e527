"""The scenario's engine (or fleet) on the wall clock, taking requests as they come.

The engine model is the one ``simcap simulate`` runs, stepped one step at a time
(``EngineWorld(fast=False)``: a bulk stretch could not know of a request that has not been sent
yet), on a simulated clock that runs ``speed`` times as fast as the wall clock from the moment
the server starts: simulated time ``t`` is wall time ``start + t / speed``. A request enters
the engine when it arrives (the simulation is first brought up to that instant), and each
stream chunk is handed to its client when the simulation reaches the end of the step that
made it. The loop sleeps until the next simulated event is due, or a request arrives.

What each request asks for becomes a :class:`~simcap.workloads.requests.RequestSpec`: its
prompt's tokens as content blocks (:mod:`simcap.serve.prompts`), and its output length. With
``ignore_eos`` it is ``max_tokens`` (finish reason ``length``); without, the model's own answer
length is the scenario's: the i-th request served gets the i-th output length of the
scenario's workload (``workload.output_len``, or its trace's), raised to ``min_tokens`` and cut
at ``max_tokens`` (finish reason ``stop`` where it ended before ``max_tokens``); a scenario
without output lengths (sessions) answers ``max_tokens``.

Lag: a chunk is late by how long after its step's end (in wall time) its client's stream
writes it; :class:`ClockLag` keeps every such lag (a fixed-size sample once there are many).
Files: ``records`` gets one JSON line per finished request (the shared
:class:`~simcap.metrics.records.RequestRecord`, times on the simulated clock), ``trace`` one
Mooncake-format line per arrival (``timestamp`` in ms on the simulated clock, ``input_length``,
``output_length``, ``hash_ids`` of the prompt's blocks at the engine's block size), so that
``simcap simulate`` replays the workload served (:func:`replay_overrides`). Each line is
flushed as it is written.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from array import array
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

from simcap.config.scenario import Scenario
from simcap.errors import ScenarioError, SimulationError
from simcap.metrics.records import RequestRecord
from simcap.serve.prompts import Prompt
from simcap.simulation.simulator import EngineWorld, provenance
from simcap.workloads.requests import RequestSpec, Workload

_LAG_SAMPLE = 1 << 17  # lags kept exactly; a uniform sample of this many beyond


class ClockLag:
    """How late chunks were written: count, max, and percentiles of the lags kept."""

    def __init__(self) -> None:
        self.count = 0
        self.max = 0.0
        self.values = array("d")
        self._rng = random.Random(0)

    def add(self, lag: float) -> None:
        self.count += 1
        if lag > self.max:
            self.max = lag
        if len(self.values) < _LAG_SAMPLE:
            self.values.append(lag)
        else:  # reservoir sampling: every lag so far kept with the same probability
            j = self._rng.randrange(self.count)
            if j < _LAG_SAMPLE:
                self.values[j] = lag

    def to_dict(self) -> dict[str, Any]:
        values = sorted(self.values)

        def pct(p: float) -> float | None:
            return values[min(len(values) - 1, int(p * len(values)))] if values else None

        return {"chunks": self.count, "p50_s": pct(0.5), "p99_s": pct(0.99), "max_s": self.max if self.count else None}


class Chunk(NamedTuple):
    """Tokens for choice ``index``, made by a step that ended at simulated ``time``."""

    index: int
    time: float
    num_tokens: int


class Done(NamedTuple):
    """Choice ``index`` has finished (its last chunk came before)."""

    index: int


class Failed(NamedTuple):
    """The engine model stopped before choice ``index`` finished."""

    index: int
    message: str


@dataclass
class Stream:
    """One engine request's output as its client reads it: a :class:`Chunk` per stream chunk
    on ``queue``, then :class:`Done` (or :class:`Failed`). The choices of one HTTP request
    (``n``, a batch of prompts) share a queue, each with its own ``index``."""

    request_id: int
    index: int
    max_tokens: int  # what the client asked for (the engine runs ``num_output_tokens``)
    num_output_tokens: int
    finish_reason: str
    queue: asyncio.Queue
    delivered: int = 0


class ServedEngine:
    """``scenario``'s engine (a fleet when it has a ``deployment``) on the wall clock."""

    def __init__(
        self, scenario: Scenario, *, speed: float = 1.0, observer: Any = None,
        records: IO[str] | None = None, trace: IO[str] | None = None,
    ) -> None:
        if not speed > 0 or math.isinf(speed):
            raise ScenarioError(f"--speed: a positive number (simulated seconds per wall second), got {speed}")
        if scenario.frontend is not None:
            # This server is a real front end: its clients pay its own delays, not a model's.
            scenario = scenario.model_copy(update={"frontend": None})
        self.scenario = scenario
        self.speed = speed
        # Told of each chunk handed on (engine index, record, chunk index) and each finished
        # request (engine index, record, max_tokens asked): ``chunk`` and ``finished``.
        self.observer = observer
        self.records_file = records
        self.trace_file = trace
        if scenario.deployment is not None:
            from simcap.fleet.replicas import Fleet

            world = Fleet(scenario, fast=False, records=True)
            world.open()
            self.replicas = world.replicas
            self._send = world.send
            self._replica_of = world.replica_of
        else:
            world = EngineWorld(scenario, fast=False, records=True)
            world.env.process(world.engine())
            self.replicas = [world]
            self._send = world.submit
            self._replica_of = None
        for replica in self.replicas:  # vLLM's start-up check: one request of max_model_len fits
            kv = replica.scheduler.kv
            if -(-kv.max_model_len // kv.block_size) > kv.num_blocks - 1:
                raise ScenarioError(
                    f"engine.max_model_len: {kv.max_model_len} tokens do not fit the KV pool of "
                    f"{(kv.num_blocks - 1) * kv.block_size} tokens; vLLM refuses to start so "
                    "(lower max_model_len or give the pool more blocks)"
                )
        self.env = world.env
        self.records: dict[int, RequestRecord] = world.records
        self.block_size = scenario.engine.block_size
        self.max_model_len = scenario.engine.max_model_len
        config = scenario.workload
        self._answers = (
            Workload(config, scenario.seed)
            if config.trace_requests is not None or config.output_len is not None else None
        )
        self._streams: dict[int, Stream] = {}
        self._next_id = 0
        self.lag = ClockLag()
        self.num_finished = 0
        self.failure: str | None = None  # the engine model's error, once it has stopped
        self._start: float | None = None
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ the clock

    def wall(self, t: float) -> float:
        """The monotonic clock's time (``time.monotonic()``) at which simulated time ``t`` is due."""
        return self._start + t / self.speed

    def now(self) -> float:
        """Simulated time now."""
        return (time.monotonic() - self._start) * self.speed

    def advance(self) -> None:
        """Bring the simulation up to now, and hand every chunk it made to its stream."""
        if self.failure is not None:
            return
        target = self.now()
        if target > self.env.now:
            try:
                self.env.run(until=target)
            except SimulationError as exc:
                self._fail(f"the engine model stopped: {exc}")
                return
        self._deliver()

    async def run(self) -> None:
        """Step the simulation as the wall clock reaches each of its events, until cancelled."""
        self._start = time.monotonic()
        while self.failure is None:
            due = self.env.peek()
            wait = None if due == math.inf else self.wall(due) - time.monotonic()
            if wait is None or wait > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # behind: let the server read and write between events
            self.advance()

    # ------------------------------------------------------------------ requests

    def submit(
        self, prompt: Prompt, max_tokens: int, *, min_tokens: int = 0, ignore_eos: bool = False,
        queue: asyncio.Queue | None = None, index: int = 0,
    ) -> Stream:
        """A request arriving now: it enters the engine; its chunks come on ``queue`` (a new
        one by default) as choice ``index``."""
        if self.failure is not None:
            raise SimulationError(self.failure)
        self.advance()
        now = self.env.now
        rid = self._next_id
        self._next_id += 1
        n = max_tokens
        reason = "length"
        natural = self._natural_length(rid)
        if not ignore_eos and natural is not None and natural < max_tokens:
            n = max(natural, min_tokens, 1)
            reason = "stop" if n < max_tokens else "length"
        stream = Stream(rid, index, max_tokens, n, reason, asyncio.Queue() if queue is None else queue)
        self._streams[rid] = stream
        self._send(RequestSpec(rid, prompt.num_tokens, n, prompt.segments(self.block_size)), now)
        if self.trace_file is not None:
            self.trace_file.write(json.dumps({
                "timestamp": now * 1000.0, "input_length": prompt.num_tokens, "output_length": n,
                "hash_ids": list(prompt.block_keys(self.block_size)),
            }) + "\n")
            self.trace_file.flush()
        self._wake.set()
        return stream

    def abort(self, streams: list[Stream]) -> None:
        """The client of these streams went away: each request not finished yet leaves its
        engine before the next step (vLLM aborts it; its record ends with reason ``abort``)."""
        for stream in streams:
            rid = stream.request_id
            if rid in self._streams:
                self.replicas[self._engine_of(rid)].abort(rid)
        self._wake.set()

    def _natural_length(self, i: int) -> int | None:
        answers = self._answers
        if answers is None:
            return None
        total = answers.num_requests
        return answers.spec(i % total if total else i).max_tokens

    def _deliver(self) -> None:
        records = self.records
        observer = self.observer
        finished = []
        for rid, stream in self._streams.items():
            rec = records.get(rid)  # (disaggregated: none until the decode replica has it)
            if rec is None:
                continue
            times = rec.chunk_times
            if len(times) == stream.delivered and rec.finish_time is None:
                continue
            queue = stream.queue
            index = stream.index
            engine = self._engine_of(rid)
            for j in range(stream.delivered, len(times)):
                queue.put_nowait(Chunk(index, times[j], rec.chunk_tokens[j]))
                if observer is not None:
                    observer.chunk(engine, rec, j)
            stream.delivered = len(times)
            if rec.finish_time is not None:
                queue.put_nowait(Done(index))
                finished.append((rid, stream, rec, engine))
        for rid, stream, rec, engine in finished:
            del self._streams[rid]
            del records[rid]
            if rec.finish_reason != "abort":
                rec.finish_reason = stream.finish_reason
            if self._replica_of is not None:
                rec.replica = engine
            self.num_finished += 1
            if observer is not None:
                observer.finished(engine, rec, stream.max_tokens)
            if self.records_file is not None:
                self.records_file.write(json.dumps(rec.to_dict()) + "\n")
                self.records_file.flush()

    def _engine_of(self, rid: int) -> int:
        """The replica serving request ``rid`` (0 for a lone engine)."""
        return 0 if self._replica_of is None else int(self._replica_of[rid])

    def _fail(self, message: str) -> None:
        self.failure = message
        for stream in self._streams.values():
            stream.queue.put_nowait(Failed(stream.index, message))
        self._streams.clear()

    # ------------------------------------------------------------------ state

    def gauges(self, i: int) -> tuple[int, int, float]:
        """Engine i's (running, waiting, KV usage) as a scrape now reads them."""
        return self.replicas[i].gauges(self.env.now)

    def prefix_cache(self, i: int) -> tuple[int, int]:
        kv = self.replicas[i].scheduler.kv
        return kv.prefix_cache_queries, kv.prefix_cache_hits

    def reset_prefix_cache(self) -> bool:
        """Every engine's prefix cache emptied (``POST /reset_prefix_cache``); False, as
        vLLM answers, where an engine still holds blocks (that one keeps its cache)."""
        self.advance()
        return all([replica.scheduler.kv.reset_prefix_cache() for replica in self.replicas])

    def status(self) -> dict[str, Any]:
        """What ``GET /simcap`` answers: where the numbers come from, the clock and the load."""
        return {
            "provenance": provenance(self.scenario),
            # simulated time t is monotonic clock time (time.monotonic()) start + t / speed
            "clock": {"speed": self.speed, "start_monotonic_s": self._start, "simulated_time_s": self.env.now},
            "requests": {"arrived": self._next_id, "finished": self.num_finished,
                         "in_flight": len(self._streams)},
            "clock_lag": self.lag.to_dict(),
            "failure": self.failure,
        }


def replay_overrides(trace_path: str, block_size: int) -> list[str]:
    """``--set`` overrides under which ``simcap simulate`` replays a served workload from the
    trace ``simcap serve --trace`` wrote."""
    return [
        "workload.trace.format=mooncake", f"workload.trace.path={trace_path}",
        f"workload.trace.block_size={block_size}",
        # (the trace's rows are the requests, sent at its times)
        "workload.input_len=null", "workload.output_len=null", "workload.num_requests=null",
        "workload.duration_s=null", "workload.arrival=null", "workload.prefix=null",
    ]
