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
from dataclasses import dataclass
from heapq import heappush

import numpy as np
import simpy
from simpy.core import NORMAL

from simcap.engine.request import Request

MIN_STRETCH = 2  # shorter stretches are not worth the set-up; step them one by one


@dataclass(slots=True)
class Stretch:
    """``m`` pure-decode steps to apply at once (see :func:`plan_stretch`)."""

    m: int
    starts: np.ndarray  # starts[j] = step j's start; starts[m] = the stretch's end
    periods: np.ndarray  # the m step periods
    new_blocks: list[tuple[int, int]]  # (step, batch index) of each new KV block, sorted
    finishing: list[Request]  # requests whose last token comes in the last step


def plan_stretch(world, now: float, horizon: float) -> Stretch | None:
    """The pure-decode steps that can run at once from ``now``, or None.

    The stretch runs until the first finish (included), the last step starting before
    ``horizon`` (the next SimPy event) or the step before the KV pool runs out, whichever
    comes first.
    """
    scheduler = world.scheduler
    running: list[Request] = scheduler.running
    if world.proposer is not None or scheduler.waiting or not running:
        return None
    num_reqs = len(running)
    if num_reqs > scheduler.max_num_batched_tokens:
        return None
    max_model_len = scheduler.max_model_len
    lefts = []
    for req in running:
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        if req.num_computed_tokens != num_tokens - 1 or req.num_spec_tokens:
            return None
        left = req.max_tokens - req.num_output_tokens
        lefts.append(left if left < max_model_len - num_tokens else max_model_len - num_tokens)
    m_finish = m = min(lefts)  # the first finish is in step m (1-based)
    if m < MIN_STRETCH:
        return None
    periods = step_periods(world, num_reqs, m)
    starts = np.empty(m + 1)
    starts[0] = now
    starts[1:] = periods
    np.add.accumulate(starts, out=starts)
    # Step j (0-based) is unaffected by an event at `horizon` only if it starts before it.
    if starts[m - 1] >= horizon:
        m = int(np.searchsorted(starts[:m], horizon, side="left"))
        if m < MIN_STRETCH:
            return None
    # KV: request b needs a new block at step j when computed + j + 1 > held * bs, i.e. at
    # j = held*bs - computed and every bs steps after.
    kv = scheduler.kv
    bs = kv.block_size
    new_blocks: list[tuple[int, int]] = []
    for b, req in enumerate(running):
        first = kv.num_blocks_held(req) * bs - req.num_computed_tokens
        if first < m:
            new_blocks.extend((j, b) for j in range(first if first > 0 else 0, m, bs))
    if len(new_blocks) > 1:
        new_blocks.sort()
    free = kv.num_free_blocks
    if len(new_blocks) > free:
        # The (free+1)-th new block fails: stop before the step that asks for it.
        m = new_blocks[free][0]
        if m < MIN_STRETCH:
            return None
        new_blocks = [e for e in new_blocks if e[0] < m]
    finishing = []
    if m == m_finish:
        finishing = [req for req, left in zip(running, lefts) if left == m]
    return Stretch(m, starts[: m + 1], periods[:m], new_blocks, finishing)


def step_periods(world, num_reqs: int, m: int) -> np.ndarray:
    """Durations of the next ``m`` pure-decode steps of ``num_reqs`` requests, computed as
    ``StepTimeModel.step_period`` computes each (same operations, same order)."""
    model = world.step_model
    t = model.base + model.per_prefill_token * 0
    t += model.per_decode_token * num_reqs
    if model.per_context_token:
        context0 = sum(r.num_computed_tokens for r in world.scheduler.running)
        context = context0 + num_reqs * np.arange(1, m + 1, dtype=np.int64)
        t = t + model.per_context_token * context.astype(np.float64)
        if model.async_scheduling:
            return np.maximum(t, model.host_overhead)
        return t + model.host_overhead
    if model.async_scheduling:
        t = t if t > model.host_overhead else model.host_overhead
    else:
        t += model.host_overhead
    return np.full(m, t)


def run_stretch(world, stretch: Stretch) -> None:
    """Apply the stretch's steps to the scheduler, KV pool, requests and step log.

    Requests that finish in the last step are released as ``update_from_output`` would;
    the caller reports them once the clock has reached the stretch's end.
    """
    m, starts, periods, new_blocks = stretch.m, stretch.starts, stretch.periods, stretch.new_blocks
    scheduler = world.scheduler
    running = list(scheduler.running)
    kv = scheduler.kv
    num_reqs = len(running)
    # New blocks in (step, batch) order, as stepping pops them off the free queue. Blocks
    # that fill up are committed at the end: their hashes include this request's own output
    # tokens, so no other request's allocation or hit in the stretch can depend on them.
    for _, b in new_blocks:
        kv.append_block(running[b])
    for req in running:
        req.num_computed_tokens += m
        req.num_output_tokens += m
        kv.commit_full_blocks(req)
    world.emit_stretch(running, starts[1:])
    # Usage after each step's allocations: the free count falls at every new-block event.
    free_end = kv.num_free_blocks
    if new_blocks:
        event_steps = np.array([j for j, _ in new_blocks])
        allocated = np.searchsorted(event_steps, np.arange(m), side="right")
        usage = 1.0 - (free_end + len(new_blocks) - allocated) / (kv.num_blocks - 1)
    else:
        usage = np.full(m, 1.0 - free_end / (kv.num_blocks - 1))
    world.steps.extend(
        starts[:-1], periods, usage,
        num_decode_tokens=num_reqs, num_reqs=num_reqs, num_running=num_reqs,
    )
    if stretch.finishing:
        scheduler.finish_requests(stretch.finishing)


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
