"""Fast path: advance a stretch of identical pure-decode steps at once, exactly.

When every running request is decoding, nothing waits, no drafts are in play and the token
budget covers the batch, each engine step computes one token per running request and the
batch cannot change until (a) a request finishes, (b) another SimPy event (an arrival, a
client's think time) happens, or (c) the KV pool runs out. Until then the steps differ only
in their attended context, so their durations, the requests' chunk times, the step log and
the KV pool's block allocations (every ``block_size`` tokens) can be computed in bulk.

The result is the same, float for float, as stepping one by one: step times use the
step-time model's own operation order elementwise; start times are accumulated
sequentially as SimPy's clock would; the KV manager is called at exactly the steps and in
the batch order at which the reference path's ``allocate_slots`` changes state. The tests
hold this path to the reference (``simulate(..., fast=False)``) on random scenarios.
"""

from __future__ import annotations

import math
from heapq import heappush

import numpy as np
import simpy
from simpy.core import NORMAL

from simcap.engine.request import Request

MIN_STRETCH = 4  # shorter stretches are not worth the set-up; step them one by one


def decode_stretch_length(world) -> int:
    """How many steps can be fast-forwarded now (0 when the fast path does not apply)."""
    scheduler = world.scheduler
    running: list[Request] = scheduler.running
    if world.proposer is not None or scheduler.waiting or not running:
        return 0
    num_reqs = len(running)
    if num_reqs > scheduler.max_num_batched_tokens:
        return 0
    max_model_len = scheduler.max_model_len
    remaining = math.inf
    for req in running:
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        if req.num_computed_tokens != num_tokens - 1 or req.num_spec_tokens:
            return 0
        left = min(req.max_tokens - req.num_output_tokens, max_model_len - num_tokens)
        if left < remaining:
            remaining = left
    # The step in which a request finishes goes through the reference path.
    m = int(remaining) - 1
    if m < MIN_STRETCH:
        return 0
    return m


def step_periods(world, num_reqs: int, context0: int, m: int) -> np.ndarray:
    """Durations of ``m`` pure-decode steps, computed as ``StepTimeModel.step_period`` does."""
    model = world.step_model
    t = np.full(m, model.base + model.per_prefill_token * 0)
    t = t + model.per_decode_token * num_reqs
    if model.per_context_token:
        context = context0 + num_reqs * np.arange(1, m + 1, dtype=np.int64)
        t = t + model.per_context_token * context.astype(np.float64)
    if model.async_scheduling:
        return np.maximum(t, model.host_overhead)
    return t + model.host_overhead


def plan_stretch(world, m: int, now: float, horizon: float):
    """Trim ``m`` to the steps that start before ``horizon`` and fit the KV pool.

    Returns (m, starts[0..m], periods[0..m-1], new-block events as sorted (step, batch
    index) pairs), where ``starts[j]`` is step j's start (``starts[m]`` the end).
    """
    scheduler = world.scheduler
    running = scheduler.running
    kv = scheduler.kv
    bs = kv.block_size
    num_reqs = len(running)
    context0 = sum(r.num_computed_tokens for r in running)
    periods = step_periods(world, num_reqs, context0, m)
    starts = np.add.accumulate(np.concatenate(([now], periods)))
    # Step j (0-based) is unaffected by an event at `horizon` only if it starts before it.
    fits = int(np.searchsorted(starts[:m], horizon, side="left"))
    m = min(m, fits)
    if m < MIN_STRETCH:
        return 0, None, None, None
    # KV: request b needs a new block at step j when computed + j + 1 > held * bs, i.e. at
    # j = held*bs - computed and every bs steps after. Few events: plain Python.
    new_events: list[tuple[int, int]] = []
    for b, req in enumerate(running):
        first = kv.num_blocks_held(req) * bs - req.num_computed_tokens
        new_events.extend((j, b) for j in range(first if first > 0 else 0, m, bs))
    new_events.sort()
    free = kv.num_free_blocks
    if len(new_events) > free:
        # The (free+1)-th new block fails: stop before the step that asks for it.
        m = min(m, new_events[free][0])
        if m < MIN_STRETCH:
            return 0, None, None, None
        new_events = [e for e in new_events if e[0] < m]
    return m, starts[: m + 1], periods[:m], new_events


def run_stretch(world, m: int, starts: np.ndarray, periods: np.ndarray, new_blocks) -> None:
    """Apply ``m`` pure-decode steps to the scheduler, KV pool, records and step log."""
    scheduler = world.scheduler
    running = list(scheduler.running)
    kv = scheduler.kv
    num_reqs = len(running)
    computed0 = [r.num_computed_tokens for r in running]
    outputs0 = [r.num_output_tokens for r in running]
    # New blocks in (step, batch) order, as stepping pops them off the free queue. Blocks
    # that fill up are committed at the end: their hashes include this request's own output
    # tokens, so no other request's allocation or hit in the stretch can depend on them.
    for _, b in new_blocks:
        kv.append_block(running[b])
    for b, req in enumerate(running):
        req.num_computed_tokens = computed0[b] + m
        req.num_output_tokens = outputs0[b] + m
        kv.commit_full_blocks(req)
    ends = starts[1:].tolist()
    ones = [1] * m
    records = world.records
    for req in running:
        rec = records[req.request_id]
        rec.chunk_times.extend(ends)
        rec.chunk_tokens.extend(ones)
    steps = world.steps
    steps.start.extend(starts[:-1].tolist())
    steps.duration.extend(periods.tolist())
    zeros = [0] * m
    steps.num_prefill_tokens.extend(zeros)
    steps.num_decode_tokens.extend([num_reqs] * m)
    steps.num_reqs.extend([num_reqs] * m)
    steps.num_running.extend([num_reqs] * m)
    steps.num_waiting.extend(zeros)
    steps.num_preempted.extend(zeros)
    # Usage after each step's allocations: the free count falls at every new-block event.
    free_end = kv.num_free_blocks
    allocated = np.bincount(
        np.fromiter((j for j, _ in new_blocks), np.int64, len(new_blocks)), minlength=m
    )[:m]
    free_after = free_end + int(allocated.sum()) - np.cumsum(allocated)
    steps.kv_cache_usage.extend((1.0 - free_after / (kv.num_blocks - 1)).tolist())


class Clock(simpy.Environment):
    """A SimPy environment that can also wake a process at an absolute time.

    ``env.timeout(end - now)`` lands on ``now + (end - now)``, which in floats is not always
    ``end``; a stretch must end exactly where stepping would have, so it is scheduled at its
    end time itself (the same heap entry ``Environment.schedule`` makes, minus the addition).
    """

    def timeout_at(self, at: float) -> simpy.Event:
        if at < self._now:
            raise ValueError(f"cannot schedule in the past ({at} < {self._now})")
        event = simpy.Event(self)
        event._ok = True
        event._value = None
        heappush(self._queue, (at, NORMAL, next(self._eid), event))
        return event
