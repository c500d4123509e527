"""The SimPy world: one engine process, and closed-loop clients when the workload has them.

The engine loops ``take arrivals -> schedule -> timeout(step period) -> update``: on the
reference path one SimPy event per engine step, never one per token; on the fast path whole
stretches of steps at once, with an event only where a client is due. Open-loop and replayed
arrivals are known in advance, so the engine takes them itself: before each step, every
request that has arrived by then. Tokens a step produces reach the client at the end of the
step, as one stream chunk per request. Clients (closed loop) are SimPy processes that wait on
their request's completion; a replayed closed-loop run (:class:`simcap.workloads.requests.ClosedLoopTrace`)
has one such client per recorded client, sending that client's requests after its gaps; a
session workload (:mod:`simcap.workloads.sessions`) has one process per live session, sending each turn
when the previous turn's answer has streamed back plus the think time, its prompt the whole
conversation so far.
Finished requests go straight into the run's metrics; full records and step-log rows are kept
only when asked for.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import simpy

from simcap._version import __version__
from simcap.config.scenario import ClosedArrival, Scenario, check_limits
from simcap.engine.noise import StepNoise
from simcap.engine.request import Request
from simcap.engine.scheduler import Scheduler, resolve_async_scheduling
from simcap.engine.speculative import AcceptanceModel, Proposer, SpecDecodeCounters
from simcap.engine.step_time import make_step_model
from simcap.errors import ScenarioError, SimulationError
from simcap.metrics.records import RequestRecord
from simcap.metrics.summary import MetricsAccumulator, Summary
from simcap.simulation.early_stop import SloStop, StopRecord
from simcap.simulation.fast_forward import LATE, Clock, advance_decode_stretch, schedule_admission
from simcap.simulation.fast_verify import advance_verify_stretch, first_chunks, schedule_verify_admission
from simcap.simulation.frontend import FrontEnd
from simcap.simulation.frontend import describe as describe_frontend
from simcap.simulation.steplog import StepLog
from simcap.workloads.requests import ClosedLoopTrace, RequestSpec, Workload
from simcap.workloads.sessions import Conversation, SessionWorkload


@dataclass
class Result:
    """A finished simulation: its inputs, summary, metrics and (when asked) records and steps.

    ``metrics`` holds every request's scalars and the ITL table the summary came from;
    ``records`` (one :class:`RequestRecord` per request, with every stream chunk) is None
    unless ``simulate(..., records=True)``; ``steps`` keeps its rows only with ``steps=True``.
    ``stopped``: where and why a run given a stop rule ended early (None when it ran to the
    end); the summary then covers the requests completed by then, and fails the SLO.
    """

    scenario: Scenario
    summary: Summary
    metrics: MetricsAccumulator
    steps: StepLog
    records: list[RequestRecord] | None
    provenance: dict[str, Any]
    stopped: StopRecord | None = None
    # The engine's prefix-cache counters in tokens, as vllm:prefix_cache_queries / _hits.
    prefix_cache: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Summary fields at the top level, plus where the numbers came from."""
        return {
            **self.summary.to_dict(),
            "num_steps": len(self.steps),
            **({"stopped_early": self.stopped.to_dict()} if self.stopped else {}),
            "provenance": self.provenance,
        }


ILLUSTRATIVE_STEP_TIME = "illustrative defaults (no step_time section, no profile): not a measurement"


def provenance(scenario: Scenario) -> dict[str, Any]:
    """What a printed number can be traced to: simcap, the modelled vLLM, scenario, seed."""
    return {
        "simcap_version": __version__,
        "vllm_version_modelled": scenario.engine.vllm_version,
        "scenario_name": scenario.name,
        "scenario_sha256": scenario.digest(),
        "seed": scenario.seed,
        "profile": scenario.profile.model_dump() if scenario.profile else None,
        "step_time_source": (
            f"profile {scenario.profile.name} (scenario keys override it){_overrides(scenario.profile)}"
            if scenario.profile
            else "scenario" if scenario.step_time_given else ILLUSTRATIVE_STEP_TIME
        ),
        "kv_pool_blocks": scenario.engine.num_blocks,
        "kv_pool_source": (
            "engine.num_gpu_blocks"
            if scenario.engine.kv_plan is None
            else f"engine.memory ({scenario.engine.kv_plan.source})"
        ),
        **({"trace": scenario.workload.trace.requests.summary} if scenario.workload.trace else {}),
        **({"frontend": describe_frontend(scenario.frontend)} if scenario.frontend is not None else {}),
    }


def _overrides(ref: Any) -> str:
    """``; not as fitted: step_time.hardware a800-80gb -> h100-sxm; inherited as fitted:
    engine.vllm_version 0.26`` (empty when the scenario runs the fitted deployment)."""
    if not ref.overridden:
        return ""
    changed = ", ".join(f"{k} {v['profile']} -> {v['scenario']}" for k, v in ref.overridden.items())
    kept = ", ".join(f"{k} {v}" for k, v in (ref.inherited_as_fitted or {}).items())
    return f"; not as fitted: {changed}" + (f"; inherited as fitted: {kept}" if kept else "")


GAP_BUFFER = 1 << 16  # per-chunk ITL samples collected before one bulk add to the metrics


def _floats(values: list[float]) -> np.ndarray:
    return np.fromiter(values, np.float64, len(values))


def _ints(values: list[int]) -> np.ndarray:
    return np.fromiter(values, np.int64, len(values))


def _token_counts(values: list[int]) -> np.ndarray:
    """Tokens per chunk as int64: through ``bytes`` (twice as fast as ``np.fromiter``) while
    each is below 256, as they are but for very long drafts."""
    try:
        return np.frombuffer(bytes(values), np.uint8).astype(np.int64)
    except ValueError:
        return _ints(values)


class _StretchGaps:
    """Buffered stretches of steps in which each of a stretch's requests gets a chunk at every
    step: each stretch's start then its chunk times, and how many requests it had. The times
    join a float array as each stretch comes (a stretch's own float array, copied as a block;
    any sequence of floats will do)."""

    __slots__ = ("times", "lens", "sizes")

    def __init__(self) -> None:
        self.times = array("d")
        self.lens: list[int] = []
        self.sizes: list[int] = []

    def add(self, times: array, num_reqs: int) -> int:
        """Buffer a stretch; returns how many times the buffer now holds."""
        buffered = self.times
        buffered.extend(times)
        self.lens.append(len(times))
        self.sizes.append(num_reqs)
        return len(buffered)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The gaps between the chunks of the buffered stretches (start -> first chunk is not
        one), and how many requests saw each; the buffer is emptied."""
        times = np.frombuffer(self.times, dtype=np.float64)
        lens = _ints(self.lens)
        starts = np.cumsum(lens) - lens
        keep = np.ones(len(times) - 1, dtype=bool)
        keep[starts] = False  # start -> first chunk
        keep[starts[1:] - 1] = False  # last chunk -> next stretch's start
        gaps, sizes = (times[1:] - times[:-1])[keep], np.repeat(_ints(self.sizes), lens - 2)
        self.times = array("d")  # (a new one: ``times`` still views the old)
        self.lens.clear()
        self.sizes.clear()
        return gaps, sizes


def closed_loop_clients(
    env: simpy.Environment, workload: Workload, arrival: ClosedArrival,
    send: Callable[[RequestSpec, float, int, Callable[[int], object]], None],
) -> list[simpy.Process]:
    """``arrival.concurrency`` closed-loop clients (SimPy processes, returned), each sending
    the workload's next request (``send(spec, now, client_id, done)``, ``done`` to be called
    when its response ends), waiting for the response and the think time, until
    ``num_requests`` are sent or ``duration_s`` has passed."""
    limit = workload.num_requests
    duration = workload.duration_s
    counter = iter(range(limit) if limit is not None else itertools.count())

    def client(c: int):
        for i in counter:
            if duration is not None and env.now >= duration:
                return
            done = env.event()
            send(workload.spec(i), env.now, c, done.succeed)
            yield done
            if arrival.think_time_s:
                yield env.timeout(arrival.think_time_s)

    return [env.process(client(c)) for c in range(arrival.concurrency)]


class EngineWorld:
    """One engine's SimPy world: the scheduler, the step-time model, the KV pool and the
    clock, its clients (closed loop) or arrivals (open loop, replay), and the metrics of the
    requests it finishes. :meth:`run` runs it to the end; :func:`simulate_engine` is the way
    to call it. A fleet (:mod:`simcap.fleet.replicas`) builds one per replica with
    ``fleet=`` itself and ``index=`` the replica's place: the replica then takes the fleet's
    clock (``fleet.env``) and records, is sent its requests by the fleet's router
    (``fleet.next_arrival``, ``fleet.horizon()``) and reports its finished requests
    (``fleet.responses_ended``)."""

    def __init__(
        self, scenario: Scenario, fast: bool = True, records: bool = False, steps: bool = False,
        stop: SloStop | None = None, *, fleet: Any = None, index: int = 0,
    ) -> None:
        self.scenario = scenario
        # (a prefill cadence, engine.prefill_schedule_interval > 1, runs one step at a time:
        # the fast paths schedule admissions without it)
        self.fast = fast and scenario.engine.prefill_schedule_interval == 1
        self.stop = stop  # checked between steps: ends the run when it returns True
        self.num_arrivals = 0  # open loop and replay: every request the run will have
        # A replica of a fleet (simcap.fleet.replicas) shares the fleet's clock and records, and is
        # sent its requests by the fleet's router; ``index`` is its place in the fleet.
        self.fleet = fleet
        self.index = index
        self.env = Clock() if fleet is None else fleet.env
        self.busy_until = -math.inf  # the end of the step (or stretch) in flight
        spec = scenario.speculative
        async_scheduling = resolve_async_scheduling(scenario.engine, spec.method if spec else None)
        self.scheduler = Scheduler(
            scenario.engine, num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            async_scheduling=async_scheduling,
        )
        self.step_model = make_step_model(
            scenario.step_time, async_scheduling=async_scheduling,
            speculative_method=spec.method if spec else None,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        )
        # Engine randomness (acceptance, ngram matches) has its own streams, apart from the
        # workload's, so turning speculation on leaves the requests unchanged.
        # Replica r > 0 of a fleet has streams of its own (replica 0's are a lone engine's).
        accept_ss, propose_ss = np.random.SeedSequence(
            [scenario.seed, 1] + ([index] if index else [])
        ).spawn(2)
        self.acceptance = (
            AcceptanceModel.from_config(spec, np.random.default_rng(accept_ss)) if spec else None
        )
        # ngram match probabilities belong to the requests' content: the scenario's seed, the
        # same on every replica.
        self.proposer = (
            Proposer(spec, np.random.default_rng(propose_ss), content_seed=scenario.seed) if spec else None
        )
        self.spec_counters = SpecDecodeCounters() if spec else None
        # Step-time noise (None when off): its own stream, SeedSequence([seed, 2]).
        self.noise = StepNoise.from_config(scenario.step_time.noise, scenario.seed, index)
        self.workload = Workload(scenario.workload, scenario.seed)
        # A fleet's replicas buffer less each (the figures do not depend on the buffering).
        share = 1 if fleet is None else max(len(fleet.configs), 1)
        self.metrics = MetricsAccumulator(compact_at=max((1 << 20) // share, 1 << 12))
        self._gap_buffer = max(GAP_BUFFER // share, 1 << 10)
        # Records by request id (a replayed closed loop may send them out of id order).
        self.records: dict[int, RequestRecord] | None = (
            (fleet.records if fleet is not None else {}) if records else None
        )
        self.steps = StepLog(keep=steps)
        # The front end (API server, client loop) between the engine and its clients: None
        # when the scenario has none, and then every time is the engine's.
        self.frontend = FrontEnd.from_config(scenario.frontend)
        # ITL samples not yet in the metrics: single gaps (with the tokens of the later
        # chunk; one token, in _single_gaps), stretch gaps that every request of a decode
        # stretch saw (with that count), and the gaps of verify stretches (every request sees
        # each gap, with its own tokens).
        self._gaps: list[float] = []
        self._gap_tokens: list[int] = []
        self._single_gaps: list[float] = []
        self._decode_stretches = _StretchGaps()
        self._verify_stretches = _StretchGaps()
        self._verify_tokens: list[int] = []  # per gap, per request: the later chunk's tokens
        self._wakeup: simpy.Event | None = None
        self._aborts: list[int] = []  # request ids whose clients went away (simcap serve)
        # Clients waiting on a request, called with its output tokens when it finishes.
        self._on_finish: dict[int, Callable[[int], object]] = {}
        self._session_of: dict[int, tuple[int, int]] = {}  # request id -> (session, turn)
        self._next_request_id = 0  # sessions: ids in send order
        # Sessions: turns sent truncated, turns dropped from contexts, sessions ended early.
        self.session_overflow = {"truncated_turns": 0, "dropped_turns": 0, "ended_sessions": 0}

    # ------------------------------------------------------------------ actors

    def submit(
        self, spec: RequestSpec, now: float, client_id: int | None = None, *,
        sent: float | None = None, external: int = 0,
    ) -> None:
        """``spec`` arrives at ``now`` (sent by closed-loop client ``client_id``). A fleet's
        decode replica gets a request its client ``sent`` earlier, with ``external`` prompt
        tokens' KV computed by a prefill replica."""
        sent = now if sent is None else sent
        request_id, num_prompt_tokens, max_tokens, segments, output_key, session_id, turn = spec
        if self.records is not None:
            self.records[request_id] = RequestRecord(
                request_id, sent, num_prompt_tokens, max_tokens, client_id=client_id,
                session_id=session_id, turn=turn,
            )
        if session_id is not None:
            self._session_of[request_id] = (session_id, turn)
        request = Request(request_id, sent, num_prompt_tokens, max_tokens, segments, output_key)
        if external:
            request.num_external_tokens = external
        self.scheduler.add_request(request)
        if self._wakeup is not None:
            self._wakeup.succeed()
            self._wakeup = None

    def send(self, spec: RequestSpec, now: float, client_id: int | None, done: Callable[[int], object]) -> None:
        """A client's request: submitted now (with a front end, it reaches the engine its
        ``arrival_s`` later), ``done`` called with its output tokens when its last chunk
        reaches the client."""
        self._on_finish[spec.request_id] = done
        fe = self.frontend
        if fe is None or not fe.arrival_s:
            self.submit(spec, now, client_id)
            return
        self.env.timeout(fe.arrival_s).callbacks.append(
            lambda _event: self.submit(spec, self.env.now, client_id, sent=now)
        )

    def abort(self, request_id: int) -> None:
        """``request_id``'s client went away: the request leaves the engine before the next
        step is scheduled, as vLLM's engine core takes aborts between steps (its record ends
        with finish reason ``abort``). Stepping one step at a time only (``fast=False``)."""
        if self.fast:
            raise SimulationError("aborts need the reference path (fast=False)")
        self._aborts.append(request_id)

    def _apply_aborts(self, now: float) -> None:
        ids = set(self._aborts)
        self._aborts.clear()
        scheduler = self.scheduler
        reqs = [r for r in scheduler.running if r.request_id in ids]
        reqs += [r for r in scheduler.waiting if r.request_id in ids]
        if not reqs:
            return
        scheduler.abort_requests(reqs)
        if self.records is not None:
            for req in reqs:
                rec = self.records[req.request_id]
                rec.finish_time = now
                rec.finish_reason = "abort"
                rec.scheduled_time = req.scheduled_ts
                rec.num_preemptions = req.num_preemptions
        if self.fleet is not None:
            self.fleet.responses_ended(self.index, reqs, now)

    def replay_clients(self, trace: ClosedLoopTrace) -> None:
        """One client per ``trace.clients[c]``: wait the gap, send, wait for the response."""
        env = self.env

        def client(c: int, requests):
            for gap, spec in requests:
                if gap > 0:
                    yield env.timeout(gap)
                done = env.event()
                self.send(spec, env.now, c, done.succeed)
                yield done

        for c, requests in enumerate(trace.clients):
            env.process(client(c, requests))

    def session_clients(self) -> None:
        """One process per live session: send a turn, wait for its answer, think, send the
        next (its prompt the conversation so far). Sessions start open loop at their start
        times, or closed loop: ``concurrency`` clients, each running one session after another
        (with the arrival's think time between sessions) until ``num_sessions`` have started
        or ``duration_s`` has passed."""
        env = self.env
        workload = SessionWorkload(self.scenario.workload, self.scenario.seed)
        max_model_len = self.scenario.engine.max_model_len
        on_overflow = workload.sessions.on_overflow
        overflow = self.session_overflow

        def session(i: int, client_id: int | None):
            conv = Conversation(workload.plan(i), max_model_len, on_overflow)
            while True:
                rid = self._next_request_id
                spec = conv.request(rid)
                if spec is None:
                    break
                self._next_request_id = rid + 1
                done = env.event()
                self.send(spec, env.now, client_id, done.succeed)
                num_output_tokens = yield done
                think = conv.answered(num_output_tokens)
                if conv.done:
                    break
                if think > 0:
                    yield env.timeout(think)
            overflow["truncated_turns"] += conv.truncated_turns
            overflow["dropped_turns"] += conv.dropped_turns
            overflow["ended_sessions"] += conv.ended

        arrival = self.scenario.workload.arrival
        if isinstance(arrival, ClosedArrival):
            limit, duration = workload.num_sessions, workload.duration_s
            counter = iter(range(limit) if limit is not None else itertools.count())

            def client(c: int):
                for i in counter:
                    if duration is not None and env.now >= duration:
                        return
                    yield from session(i, c)
                    if arrival.think_time_s:
                        yield env.timeout(arrival.think_time_s)

            for c in range(arrival.concurrency):
                env.process(client(c))
            return
        starts = workload.start_times().tolist()

        def starter():
            for i, t in enumerate(starts):
                if t > env.now:
                    yield env.timeout_at(t)
                env.process(session(i, None))

        env.process(starter())

    # ------------------------------------------------------------------ client view

    def emit(self, req: Request, now: float, num_tokens: int) -> None:
        """The step ending at ``now`` gives ``req`` a stream chunk of ``num_tokens`` tokens: it
        reaches the client then (with a front end, the step's offset later)."""
        fe = self.frontend
        off = 0.0
        if fe is not None:
            off, prev = fe.chunk(req.request_id)
        if req.first_token_ts is None:
            req.first_token_ts = now
        else:
            self._gaps.append(now - req.last_token_ts if fe is None else now + off - (req.last_token_ts + prev))
            self._gap_tokens.append(num_tokens)
            if len(self._gaps) >= self._gap_buffer:
                self._flush_gaps()
        req.last_token_ts = now
        if self.records is not None:
            self.records[req.request_id].add_chunk(now + off, num_tokens)

    def emit_stretch(self, reqs: list[Request], times: array, lasts: list[float]) -> None:
        """One token per request at each of ``times[1:]`` (a float array: a stretch of decode
        steps; ``times[0]`` is its start); ``lasts``: the previous token's time of each
        request that had one, in batch order.

        With a front end every gap is taken between the times the client sees (each the
        engine's time plus its offset), as a step at a time takes it and as the records hold
        them: the summaries of both, and of the records, agree byte for byte."""
        fe = self.frontend
        if fe is None:
            ends = times
            first = ends[1]
            gaps = [first - last for last in lasts]
        else:
            off, prevs = fe.batch([req.request_id for req in reqs])
            ends = array("d", [t + off for t in times])
            first = ends[1]
            it = iter(lasts)
            gaps = [first - (next(it) + prev) for prev in prevs if prev is not None]
        single = self._single_gaps
        single += gaps
        m = len(times) - 1
        if m > 1:
            # Every request in the stretch sees the same gaps between its chunks.
            if self._decode_stretches.add(ends, len(reqs)) >= self._gap_buffer:
                self._flush_gaps()  # (empties ``single`` too)
        if len(single) >= self._gap_buffer:
            self._flush_gaps()
        if self.records is not None:
            ends = ends[1:]
            ones = [1] * m
            for req in reqs:
                rec = self.records[req.request_id]
                rec.chunk_times.extend(ends)
                rec.chunk_tokens.extend(ones)

    def emit_steps(self, reqs: list[Request], times: array, news: list[int]) -> None:
        """The chunks of a stretch of steps in which every one of ``reqs`` samples: at
        ``times[j + 1]`` (a float array; ``times[0]`` is its start), ``news[j * len(reqs) +
        b]`` tokens reach ``reqs[b]``."""
        num_reqs = len(reqs)
        gaps = self._gaps
        fe = self.frontend
        ends = times
        if fe is not None:
            off, prevs = fe.batch([req.request_id for req in reqs])
            lasts = [req.last_token_ts for req in reqs]
            g = len(gaps)
        first_chunks(reqs, news, times[1], times[-1], gaps, self._gap_tokens)
        if fe is not None:  # the gaps between the times the client sees, as emit_stretch
            ends = array("d", [t + off for t in times])
            first = ends[1]
            for prev, last in zip(prevs, lasts):
                if prev is not None:
                    gaps[g] = first - (last + prev)
                    g += 1
        if len(times) > 2:  # every request's gap at each later step
            self._verify_stretches.add(ends, num_reqs)
            self._verify_tokens += news[num_reqs:]
            if len(self._verify_tokens) >= self._gap_buffer:
                self._flush_gaps()
        if len(gaps) >= self._gap_buffer:
            self._flush_gaps()
        if self.records is not None:
            ends = ends[1:]
            for b, req in enumerate(reqs):
                rec = self.records[req.request_id]
                rec.chunk_times.extend(ends)
                rec.chunk_tokens.extend(news[b::num_reqs])

    def _flush_gaps(self) -> None:
        """The buffered ITL samples into the metrics; the buffers are emptied."""
        if self._single_gaps:
            self.metrics.add_itl(_floats(self._single_gaps))
            self._single_gaps.clear()
        if self._gaps:
            self.metrics.add_itl(_floats(self._gaps), tokens=_token_counts(self._gap_tokens))
            self._gaps.clear()
            self._gap_tokens.clear()
        if self._decode_stretches.times:
            gaps, sizes = self._decode_stretches.take()
            self.metrics.add_itl(gaps, weight=sizes)
        if self._verify_stretches.times:
            # Gap j of a verify stretch, once for each of its requests (in batch order), with
            # that request's tokens at the later step.
            gaps, sizes = self._verify_stretches.take()
            self.metrics.add_shared_itl(gaps, sizes, _token_counts(self._verify_tokens))
            self._verify_tokens.clear()

    def finish(self, reqs: list[Request], now: float) -> None:
        """Requests that got their last token at ``now``: summarise them, wake their clients."""
        add_request = self.metrics.add_request
        sessions = self._session_of
        waiters = self._on_finish
        fe = self.frontend
        end = now
        for req in reqs:
            cached = req.num_cached_tokens
            if cached < 0:
                cached = 0
            where = sessions.pop(req.request_id, None) if sessions else None
            first = req.first_token_ts
            if fe is not None:  # as its client saw them
                first_off, last_off = fe.done(req.request_id)
                first += first_off
                end = now + last_off
            add_request(
                req.request_id, req.arrival_time, first_token_time=first,
                finish_time=end, scheduled_time=req.scheduled_ts,
                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                num_preemptions=req.num_preemptions, num_cached_tokens=cached,
                session_id=None if where is None else where[0], turn=None if where is None else where[1],
            )
            if self.records is not None:
                rec = self.records[req.request_id]
                rec.finish_time = end
                rec.finish_reason = "length"
                rec.scheduled_time = req.scheduled_ts
                rec.num_preemptions = req.num_preemptions
                rec.num_cached_tokens = cached
            if waiters:
                notify = waiters.pop(req.request_id, None)
                if notify is not None:
                    if end > now:  # its last chunk reaches the client later
                        self.env.timeout_at(end).callbacks.append(
                            lambda _event, notify=notify, n=req.num_output_tokens: notify(n)
                        )
                    else:
                        notify(req.num_output_tokens)
        if self.fleet is not None:
            self.fleet.responses_ended(self.index, reqs, now)

    def gauges(self, now: float) -> tuple[int, int, float]:
        """(running, waiting, KV usage) as a scrape at ``now`` reads them: those of the step in
        flight (as it was scheduled), or the engine's own between steps."""
        if self.busy_until > now:
            return self.steps.last
        scheduler = self.scheduler
        return len(scheduler.running), len(scheduler.waiting), scheduler.kv.usage

    def engine(
        self, times: Sequence[float] | None = None, specs: Callable[[int], RequestSpec] | None = None
    ):
        """Step the engine; in fast mode, without a SimPy event for steps nobody waits on.

        Open-loop and replayed arrivals (``times``, ``specs(i)`` the i-th request) are the
        engine's to take: before each step it takes every request that has arrived by then,
        and an idle engine moves on to the next arrival. Closed-loop clients are SimPy
        processes that submit requests and wait on their completion.

        The reference path yields one timeout per step. The fast path keeps its own clock and
        yields only when a client is due by the step's end (its think time over) or waits on
        a request finishing in it: between such events the order of things, and every float,
        is the same.
        """
        env = self.env
        scheduler = self.scheduler
        step_model = self.step_model
        noise = self.noise
        steps = self.steps
        kv = scheduler.kv
        fast = self.fast
        speculative = self.proposer is not None
        waiters = self._on_finish
        stop = self.stop
        clients = times is None  # closed loop: other SimPy processes share the clock
        fleet = self.fleet  # a fleet's router sends this replica its requests
        num_arrivals = len(times) if times is not None else 0
        # With a front end a request reaches the engine its arrival_s after it was sent.
        delay = self.frontend.arrival_s if self.frontend is not None else 0.0
        k = 0  # the next arrival
        next_arrival = times[0] + delay if num_arrivals else math.inf
        now = env.now
        while True:
            while next_arrival <= now:
                self.submit(specs(k), next_arrival, sent=times[k])
                k += 1
                next_arrival = times[k] + delay if k < num_arrivals else math.inf
            if fleet is not None and fleet.next_arrival <= now:
                # A request arrives as this step would start: the router sends it first.
                yield env.timeout_at(now, LATE)
                continue
            if stop is not None and now >= stop.next_check and stop(self, now):
                return
            if self._aborts:
                self._apply_aborts(now)
            if not (scheduler.running or scheduler.waiting):  # (has_unfinished_requests)
                if not clients:
                    if next_arrival == math.inf:
                        return
                    if not fast:
                        yield env.timeout_at(next_arrival)
                    now = next_arrival
                    continue
                self._wakeup = env.event()
                yield self._wakeup
                now = env.now
                continue
            if not clients:
                horizon = next_arrival
            else:  # a fleet's replica: the next arrival or scrape (open loop), or any event
                horizon = env.peek() if fleet is None else fleet.horizon()
            # (async) requests finished by the last step hold their slots and blocks through
            # this schedule: the fast paths schedule that step as an admission (on the verify
            # path with their wasted verifies), and a stretch runs it.
            pending = bool(scheduler.finished_pending)
            unapplied = pending or bool(scheduler.unapplied)
            out = stretch = None
            if fast:
                if speculative:  # scheduled here, or by the scheduler, then run in bulk
                    out = schedule_verify_admission(self)
                    if out is None:
                        if not pending:
                            stretch = advance_verify_stretch(self, now, horizon, None, not clients)
                        if stretch is None:
                            out = scheduler.schedule()
                    if stretch is None:
                        stretch = advance_verify_stretch(self, now, horizon, out, not clients)
                else:
                    admitted = schedule_admission(self)
                    stretch = advance_decode_stretch(self, now, horizon, admitted, not clients)
                    if admitted is not None:
                        out = admitted.out
            if stretch is not None:
                now, finishing = stretch
                self.busy_until = now
                if clients and (now >= horizon or (finishing and waiters)):
                    yield env.timeout_at(now)
                if finishing:
                    self.finish(finishing, now)
                continue
            if out is None:
                out = scheduler.schedule()
            if out.total_num_scheduled_tokens == 0 and not out.preempted_reqs:
                if unapplied:
                    # (async) nothing to run before the last step's output is applied (its
                    # finished requests released, its rejected drafts no longer counted):
                    # not a step, as vLLM's engine core runs none.
                    continue
                raise SimulationError(
                    f"engine stalled at t={now:.6f}s: {len(scheduler.waiting)} waiting, "
                    f"{len(scheduler.running)} running, nothing schedulable"
                )
            for req in out.new_reqs:
                if req.scheduled_ts is None:
                    req.scheduled_ts = now
            dt = step_model.step_period(out) if noise is None else noise.step_period(step_model, out)
            self.busy_until = now + dt
            steps.append(
                now, dt, out.num_prefill_tokens, out.num_decode_tokens, len(out.reqs),
                len(scheduler.running), len(scheduler.waiting), kv.usage, len(out.preempted_reqs),
            )
            if not fast:
                yield env.timeout(dt)
                now = env.now
            else:
                now += dt
                if clients and (now >= horizon or waiters):
                    yield env.timeout_at(now)
            accepted = None
            if out.num_verify_tokens:
                drafts = out.num_scheduled_spec_tokens
                accepted = out.reject_padding(self.acceptance.sample(drafts))
                if pending:  # (async) a finished request's wasted drafts: vLLM counts none
                    drafts = [0 if r.is_finished else d for r, d in zip(out.reqs, drafts)]
                self.spec_counters.record(drafts, accepted)
            result = scheduler.update_from_output(out, accepted)
            if self.proposer is not None:
                self.proposer.propose(result.reqs)
            if self.frontend is not None:
                self.frontend.new_step(len(result.reqs))
            for req, n in zip(result.reqs, result.num_new_tokens):
                self.emit(req, now, n)
            if result.finished:
                self.finish(result.finished, now)

    # ------------------------------------------------------------------ run

    def run(self, trace: list[tuple[float, RequestSpec]] | ClosedLoopTrace | None = None) -> Result:
        arrival = self.scenario.workload.arrival
        if isinstance(trace, ClosedLoopTrace):
            if self.stop is not None:
                raise ValueError("a stop rule needs open-loop arrivals or a trace of send times")
            self.num_arrivals = trace.num_requests
            self.replay_clients(trace)
            self.env.process(self.engine())
        elif trace is not None:
            times = list(itertools.accumulate((t for t, _ in trace), max))  # (in send order)
            self.num_arrivals = len(times)
            self.env.process(self.engine(times, lambda i: trace[i][1]))
        elif self.scenario.workload.sessions is not None:
            if self.stop is not None:
                raise ValueError("a stop rule needs open-loop or replayed arrivals, not sessions")
            self.session_clients()
            self.env.process(self.engine())
        elif isinstance(arrival, ClosedArrival):
            if self.stop is not None:
                raise ValueError("a stop rule needs open-loop or replayed arrivals")
            closed_loop_clients(self.env, self.workload, arrival, self.send)
            self.env.process(self.engine())
        else:
            times = array("d", self.workload.arrival_times().tobytes())  # (compact)
            self.num_arrivals = len(times)
            self.env.process(self.engine(times, self.workload.spec))
        self.env.run()
        stopped = self.stop.record if self.stop is not None else None
        if stopped is None and self.scheduler.has_unfinished_requests():
            raise SimulationError("simulation ended with unfinished requests")
        self._flush_gaps()
        summary = self.metrics.summary(
            slo=dict(self.scenario.slo) or None,
            kv_usage=self.steps.kv_usage_summary(),
            spec_decode=self.spec_counters.to_dict() if self.spec_counters else None,
            session_overflow=self.session_overflow if self.scenario.workload.sessions else None,
        )
        if stopped is not None:
            for key in stopped.failed:
                if summary.slo and key in summary.slo:
                    summary.slo[key]["pass"] = False
            summary = dataclasses.replace(summary, slo_pass=False)
        records = None if self.records is None else [self.records[i] for i in sorted(self.records)]
        return Result(
            self.scenario, summary, self.metrics, self.steps, records,
            provenance(self.scenario), stopped,
            {"queries": self.scheduler.kv.prefix_cache_queries, "hits": self.scheduler.kv.prefix_cache_hits},
        )


def simulate_engine(
    scenario: Scenario,
    trace: list[tuple[float, RequestSpec]] | ClosedLoopTrace | None = None,
    *,
    fast: bool = True,
    records: bool = False,
    steps: bool = False,
    stop: SloStop | None = None,
) -> Result:
    """Run one engine's scenario to completion (every request finishes) and summarise it.

    ``trace``: replay these (send time, request) pairs instead of the scenario's workload,
    e.g. the arrivals and lengths a live run actually produced. Request ids must be
    0..N-1 in send order. A :class:`~simcap.workloads.requests.ClosedLoopTrace` replays a closed-loop
    run as one: its clients, each sending its own requests in order, each after the previous
    response ended and that request's gap (the scenario's arrival process is not used).

    Requests are summarised as they finish, so memory does not grow with every token of
    every request; ``records=True`` also keeps each request's full record (every stream
    chunk, as the live client records it), ``steps=True`` every row of the step log.

    ``fast=False`` steps the engine one step at a time: the reference path that the fast
    path (:mod:`simcap.simulation.fast_forward`, :mod:`simcap.simulation.fast_verify`; identical results) is tested
    against.

    ``stop``: a :class:`simcap.simulation.early_stop.SloStop` for ``scenario.slo`` (open-loop or
    replayed arrivals only): the run ends once the SLO is certain to fail, and
    ``Result.stopped`` says when and why.

    A scenario with a ``deployment`` is a fleet's: :func:`simcap.fleet.run.simulate` runs
    either kind (it is ``simcap.simulate``).

    A scenario larger than one simulation holds (:func:`simcap.config.scenario.check_limits`) is a
    ScenarioError before anything is allocated.
    """
    if scenario.deployment is not None:
        raise ScenarioError("deployment: a fleet's scenario; simcap.simulate (simcap.fleet.run.simulate) runs it")
    check_limits(scenario, records=records or steps)
    return EngineWorld(scenario, fast, records, steps, stop).run(trace)
