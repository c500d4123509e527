"""Fast path: advance a stretch of pure-decode steps at once, exactly.

When every running request is decoding, nothing waits, no drafts are in play and the token
budget covers the batch, each engine step computes one token per running request and the
batch cannot change until (a) a request finishes, (b) the horizon: the next arrival, or a
closed-loop client's next event (its think time over), or (c) the KV pool runs out. Until
then the steps differ only in their attended context, so their durations, the requests'
chunk times, the step log and the KV pool's block allocations (every ``block_size``
tokens) can be computed in bulk (:func:`advance_decode_stretch`). With open-loop or
replayed arrivals nothing but the engine acts before the next arrival, so a stretch goes on
past (a) as a span of such segments: at each finish the finished requests leave the batch
as stepping releases them, and the smaller batch runs on. A step that admits waiting
requests into such a batch is scheduled without walking the decoders one by one
(:func:`schedule_admission`) and, when every admitted prompt completes in it, runs as the
first step of the following stretch.

With speculative decoding, :func:`simcap.simulation.fast_verify.advance_verify_stretch` does the same
for verify steps.

The result is the same, float for float, as stepping one by one: step times use the
step-time model's own operations in its order; start times are accumulated one step at a
time as SimPy's clock would; the KV manager hands out blocks in exactly the order in which
the reference path's ``allocate_slots`` calls take them. The tests hold this path to the
reference (``simulate(..., fast=False)``) on random scenarios.
"""

from __future__ import annotations

from array import array
from heapq import heappush
from typing import NamedTuple

import simpy
from simpy.core import NORMAL

from simcap.engine.request import Request, RequestStatus
from simcap.engine.scheduler import SchedulerOutput

MIN_STRETCH = 2  # a lone step goes through the reference path
_FINISHED_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
PRICE_STEPS = 32  # steps of a decode stretch priced before looking at the horizon
_ZERO = array("d", [0.0])


class Admission(NamedTuple):
    """A step that admits waiting requests into a batch of decoders (:func:`schedule_admission`),
    and what the decoders were found to have left, so that the stretch that runs it need not
    read them again."""

    out: SchedulerOutput  # the scheduled step
    lefts: list[int]  # per decoder (in batch order): tokens left, this step's included
    needs: list[int]  # per decoder: the step (0-based, this one 0) that first needs a new block
    num_context_tokens: int  # the decoders' computed tokens, this step's included


def schedule_admission(world) -> Admission | None:
    """The next step, when requests wait (or, under async scheduling, the last step finished
    some) and every running request decodes: the :class:`SchedulerOutput` that
    ``Scheduler.schedule`` gives, scheduled without walking the decoders one by one, and what
    the stretch that runs it needs to know of them. (Async: the finished requests are not in
    the batch, but hold their slots and blocks through the admission, then leave.)

    None (nothing changed) when the batch is not like that, or a decoder would need a block
    the pool does not have (a preemption: the reference path's business).
    """
    scheduler = world.scheduler
    finished = scheduler.finished_pending
    if world.proposer is not None or not (scheduler.waiting or finished):
        return None
    running = scheduler.running
    if finished:
        running = [req for req in running if req.status != _FINISHED_LENGTH_CAPPED]
    if len(running) >= scheduler.max_num_batched_tokens:
        return None
    kv = scheduler.kv
    bs = kv.block_size
    held = kv.req_to_blocks
    max_model_len = scheduler.max_model_len
    context = 0
    touched = []  # decoders whose token needs a new block or fills one
    num_new = 0
    lefts = []
    needs = []
    for req in running:  # (no drafts: without a proposer num_spec_tokens stays 0)
        computed = req.num_computed_tokens
        num_output = req.num_output_tokens
        num_tokens = req.num_prompt_tokens + num_output
        if computed + 1 != num_tokens:
            return None
        context += computed
        room = len(held[req.request_id]) * bs - computed  # slots left in its blocks
        if room <= 0:  # its token needs a new block
            touched.append(req)
            num_new += 1
            room += bs
        elif num_tokens % bs == 0:  # its token (the last of num_tokens) fills its last block
            touched.append(req)
        left = req.max_tokens - num_output
        cap = max_model_len - num_tokens
        lefts.append(left if left < cap else cap)
        needs.append(room)  # its blocks after this step's allocation
    if num_new > kv.free_queue.num_free:
        return None
    for req in touched:  # in batch order, as the reference path's allocate_slots calls
        kv.allocate_slots(req, 1)
    out = scheduler.schedule_decoders_and_admit(context, running)
    return Admission(out, lefts, needs, context + len(lefts))


def decode_starts(periods: list[float], t: float, horizon: float, lo: int) -> array:
    """Start times of steps of ``periods`` run back to back from ``t``, cut before the first
    step (from index ``lo`` on) that would start at or after ``horizon``: an array of the
    ``m`` steps' starts and the last one's end (``m`` is ``len(result) - 1``; ``m ==
    len(periods)`` when none is cut). Each start is the previous one plus its step's period,
    one float addition at a time, as SimPy's clock adds step after step (and as
    ``itertools.accumulate`` would); computed into a float array (C doubles when compiled),
    which the step log and the stream gaps take as it is."""
    n = len(periods)
    out = _ZERO * (n + 1)
    v = out  # (a typed memoryview when compiled)
    s = t
    j = 0
    while j < n:
        if j >= lo and s >= horizon:
            break
        v[j] = s
        p = periods[j]
        s = s + p
        j += 1
    v[j] = s
    v = None  # (the array cannot be resized while viewed)
    if j < n:
        del out[j + 1 :]
    return out


def usage_runs_by_step(
    events: list[int], num_reqs: int, num_steps: int, free: int, scale: int
) -> tuple[list[float], list[int], int]:
    """KV usage after each of ``num_steps`` steps whose new blocks are ``events`` (``step *
    num_reqs + b``, ascending, every step below ``num_steps``), with ``free`` blocks before
    the first and ``scale`` usable in all: the free count falls at every new block. Returns
    the usages as runs (``counts[i]`` steps of ``usages[i]`` in turn, each count >= 1) and
    the free count left."""
    usages: list[float] = []
    counts: list[int] = []
    done = 0
    for e in events:
        step = e // num_reqs
        if step > done:
            usages.append(1.0 - free / scale)
            counts.append(step - done)
            done = step
        free -= 1
    if num_steps > done:
        usages.append(1.0 - free / scale)
        counts.append(num_steps - done)
    return usages, counts, free


def take_decode_blocks(
    running: list[Request], needs: list[int], m: int, bs: int, free: int, scale: int
) -> tuple[int, list[float], list[int], list[Request]]:
    """The new KV blocks of ``m`` pure-decode steps of the batch ``running``, as stepping
    takes them: request ``b`` needs one at step ``needs[b]`` (0-based; at once when below
    0) and every ``bs`` steps after, and the requests of a step take theirs in batch order,
    off ``free`` free blocks (``scale`` usable in all). When the pool runs short, the step
    that asks for the missing block does not run (its requests before the one refused have
    theirs, as the scheduler would have given them before preempting).

    Returns the steps that run (``m``, or fewer), the KV usage after each of them as runs
    (``counts[i]`` steps of ``usages[i]`` in turn, each count >= 1) and the requests in the
    order they take a block (for :meth:`KVCacheManager.append_blocks`). The blocks come in
    cycles of ``bs`` steps, in each cycle in the same order: by the step of a request's
    first block modulo ``bs``, then batch order. So they are taken cycle by cycle in that
    order, without sorting them all.
    """
    num_reqs = len(running)
    keys = []  # (first % bs) * num_reqs + b, of the requests with a block within m steps
    for b in range(num_reqs):
        j = needs[b]
        if j < m:
            if j < 0:
                j = 0
            keys.append((j % bs) * num_reqs + b)
    keys.sort()
    n = len(keys)
    usages: list[float] = []
    counts: list[int] = []
    takers: list[Request] = []
    done = 0  # steps whose usage is written
    base = 0  # the cycle's first step
    while n and (keys[0] // num_reqs) + base < m:
        for i in range(n):
            key = keys[i]
            q = key // num_reqs
            step = base + q
            if step >= m:
                break
            b = key - q * num_reqs
            if step < needs[b]:  # (its first block comes in a later cycle)
                continue
            if not free:  # this block is missing: its step does not run
                m = step
                n = 0
                break
            if step > done:
                usages.append(1.0 - free / scale)
                counts.append(step - done)
                done = step
            free -= 1
            takers.append(running[b])
        base += bs
    if m > done:
        usages.append(1.0 - free / scale)
        counts.append(m - done)
    return m, usages, counts, takers


def log_stretch(
    steps, first: SchedulerOutput | None, starts: array, periods: list[float],
    usages: list[float], counts: list[int], num_reqs: int, num_waiting: int = 0,
) -> None:
    """Write a stretch's steps into the step log ``steps``: step j started at ``starts[j]``
    (a float array; it may run on past the last step) and took ``periods[j]``; KV usage as runs,
    ``counts[i]`` steps of ``usages[i]`` in turn (both lists are consumed). The first step is
    ``first`` when given, a step already scheduled (its new requests are scheduled at its
    start); the others are pure-decode steps of ``num_reqs`` requests, ``num_waiting``
    waiting."""
    n = len(periods)
    if first is None:
        steps.extend_decode(
            starts if len(starts) == n else starts[:n], periods, usages, num_reqs, num_waiting,
            counts=counts,
        )
        return
    now = starts[0]
    for req in first.new_reqs:
        if req.scheduled_ts is None:
            req.scheduled_ts = now
    steps.append(
        now, periods[0], first.num_prefill_tokens, first.num_decode_tokens, len(first.reqs),
        num_reqs, num_waiting, usages[0], 0,
    )
    if n > 1:
        if counts[0] == 1:
            del usages[0], counts[0]
        else:
            counts[0] -= 1
        steps.extend_decode(starts[1:n], periods[1:], usages, num_reqs, num_waiting, counts=counts)


def advance_decode_stretch(
    world, now: float, horizon: float, admitted: Admission | None = None, span: bool = False
) -> tuple[float, list[Request]] | None:
    """Run the pure-decode steps that can run at once from ``now``; None if none can.
    (One long function on purpose: it is the fast path's inner loop, where a call per step
    costs more than the step's own arithmetic.)

    The stretch runs until the first finish (included), the last step starting before
    ``horizon`` (the next arrival or client event) or the step before the KV pool runs out,
    whichever comes first. Returns the stretch's end time and the requests that finished in
    its last step (already released from the scheduler; the caller reports them at that
    time).

    ``span``: nothing but the engine itself acts before the horizon (open-loop or replayed
    arrivals, no closed-loop client, no fleet), so the stretch goes on past finishes that
    end before the horizon, as a span of segments, each up to the next finish: the
    finished requests leave the batch (``Scheduler.finish_requests``, which frees their
    blocks after the segment's allocations and before the next one's) and are reported
    (``world.finish``) at their finish, and the next segment runs the smaller batch. A span
    stops at a finish when a stop rule is due to be checked then (``world.stop``), so that
    it sees the engine as stepping would, and under async scheduling (the step after a
    finish is the scheduler's: see :mod:`simcap.engine.scheduler`).

    ``admitted``: an already scheduled step (from :func:`schedule_admission`) to run as the
    stretch's first step, when after it every running request decodes and nothing waits;
    otherwise None is returned and the caller runs that step the reference way.

    No numpy: a stretch is typically tens of steps of a few requests, where numpy's per-call
    cost exceeds the arithmetic. Float operations are the step-time model's own, in its
    order, so every time equals the reference path's; the start times are a float array
    (:func:`decode_starts`), which the step log and the stream gaps copy as a block. The
    running batch is read once per span (what each request has left, and when it next
    needs a block, carried from segment to segment) and written once (its tokens; a
    finished request's at its finish).
    """
    scheduler = world.scheduler
    running: list[Request] = scheduler.running
    if world.proposer is not None or scheduler.waiting or not running or scheduler.finished_pending:
        return None
    num_reqs = len(running)
    if num_reqs > scheduler.max_num_batched_tokens:
        return None
    # Before a step, a decoding request has computed all but its last token; a scheduled
    # first step has already counted its tokens as computed.
    max_model_len = scheduler.max_model_len
    kv = scheduler.kv
    bs = kv.block_size
    held = kv.req_to_blocks
    if admitted is None:
        first = None
        ahead = 1
        lefts = []  # tokens each request has left: it finishes in that step (1-based)
        needs = []  # the step (0-based) in which each first needs a new block
        context = 0
        unread = running
    else:  # the decoders are read; the admitted requests follow them in the batch
        first, lefts, needs, context = admitted
        ahead = 0
        unread = first.new_reqs
    prompt_ends = []  # requests whose first step computes their prompt's last token
    for req in unread:
        out = req.num_output_tokens
        num_tokens = req.num_prompt_tokens + out
        computed = req.num_computed_tokens
        if computed != num_tokens - ahead or req.num_spec_tokens:
            return None
        if not out and ahead:
            prompt_ends.append(req)
        context += computed
        left = req.max_tokens - out
        lefts.append(left if left < max_model_len - num_tokens else max_model_len - num_tokens)
        # Request b needs a new block at step j when computed + j + 1 > held * bs.
        needs.append(len(held[req.request_id]) * bs - computed + 1 - ahead)
    m_finish = min(lefts)  # the first finish is in step m_finish (1-based)
    if first is None and (m_finish < MIN_STRETCH or now >= horizon):
        return None

    model = world.step_model
    noise = world.noise
    stop = world.stop
    steps = world.steps
    scale = kv.num_blocks - 1
    # Async scheduling: the stretch ends at its first finish (the finished requests hold
    # their slots and blocks through the next schedule, the scheduler's step), and the
    # tokens of its last step stay pending, as the scheduler leaves them.
    asynchronous = scheduler.async_scheduling
    free_queue = kv.free_queue
    t = now  # the segment's start
    done = 0  # steps of the span before the segment
    first_token = 0.0  # the span's first step's end
    finishing: list[Request] = []  # those of the span's last segment
    while True:
        # Step periods (the step-time model's decode_periods: step_period's float operations
        # on integers) up to the segment's first finish, and the start times of those that
        # run: step j (0-based) runs only if it starts before the horizon; a scheduled first
        # step runs. (A later segment starts before the horizon: its first step runs.)
        lo = 1 if first is not None else 0
        if noise is not None:  # per-step factors on the forward time: simcap.engine.noise
            periods = noise.price_stretch(model, first, running, context, t, horizon, m_finish)
            starts = decode_starts(periods, t, horizon, lo)
        else:
            periods = []
            todo = m_finish
            if first is not None:
                periods.append(model.step_period(first))
                todo -= 1
            # Up to PRICE_STEPS steps first (most segments end sooner); if none of them
            # reaches the horizon, the rest. Periods never shrink along a segment (the
            # context grows), so no more than (horizon - t) / the last period + 1 of the rest
            # start before the horizon: price only those (+1 for rounding), not every step up
            # to a finish far beyond it. Step j's context is context + num_reqs * j however
            # the steps are split.
            priced = todo if todo < PRICE_STEPS else PRICE_STEPS
            if priced > 0:
                periods += model.decode_periods(num_reqs, context, priced)
            starts = decode_starts(periods, t, horizon, lo)
            if priced < todo and starts[-1] < horizon:  # (none cut: its last is their end)
                s = starts.pop()
                rest = todo - priced
                p = periods[-1]
                if p > 0 and model.decode_nondecreasing and horizon - s < p * rest:
                    rest = int((horizon - s) / p) + 2
                more = model.decode_periods(num_reqs, context + num_reqs * priced, rest)
                periods += more
                starts += decode_starts(more, s, horizon, 0)
        m = len(starts) - 1  # the steps that run
        if m < len(periods):
            del periods[m:]
        if not done and first is None and m < MIN_STRETCH:
            return None

        # KV: the new blocks of the m steps, in the order stepping takes them; fewer steps
        # when the pool runs short.
        runs, usages, counts, takers = take_decode_blocks(
            running, needs, m, bs, free_queue.num_free, scale
        )
        if runs < m:
            m = runs
            if not done and first is None and m < MIN_STRETCH:
                return None
            if not m:  # (a later segment: the span ends at the previous finish)
                break
            del starts[m + 1 :], periods[m:]
        if takers:
            # Blocks that fill up after the prompt's last one are committed when the request
            # next allocates or releases them (KVCacheManager.free), not as they fill: their
            # content includes the request's own output tokens, which no other prompt holds
            # while it runs, so no allocation or prefix hit of another request can depend on
            # them.
            kv.append_blocks(takers)
        if not done:
            first_token = starts[1]
            for req in prompt_ends:
                # Its first step fills its prompt's last block (when the prompt ends on a
                # block boundary): committed at once, as that step's allocate_slots does, for
                # a request that arrives after it may hit it. (A scheduled first step made
                # that call already.)
                kv.cache_blocks(req, req.num_prompt_tokens)
            # Chunks at starts[1:], after each request's previous token. (The requests' token
            # times are written when they finish or the span ends.)
            world.emit_stretch(running, starts, [
                req.last_token_ts for req in running if req.first_token_ts is not None
            ])
        else:  # every request's previous token came at the segment's start
            world.emit_stretch(running, starts, [t] * num_reqs)
        if noise is not None:
            noise.advance(len(periods))  # the draws of the steps that ran, and no more
        t = starts.pop()  # starts now holds the m steps' start times
        log_stretch(steps, first, starts, periods, usages, counts, num_reqs)
        done += m
        if m < m_finish:  # cut short (the horizon, or the KV pool): no finish
            break
        # The requests that finish in the segment's last step, with their tokens and token
        # times (RequestStateStats): one token a step, the first at the span's first step's
        # end, the last now.
        kept_lefts = []
        kept_needs = []
        for req, left, j in zip(running, lefts, needs):
            if left == m:
                req.num_computed_tokens += done - 1 + ahead
                req.num_output_tokens += done
                if req.first_token_ts is None:
                    req.first_token_ts = first_token
                req.last_token_ts = t
                context -= req.num_computed_tokens
                finishing.append(req)
            else:
                kept_lefts.append(left - m)
                kept_needs.append(j - m if j >= m else (j - m) % bs)
        scheduler.finish_requests(finishing)
        if (not span or asynchronous or t >= horizon or len(finishing) == num_reqs
                or (stop is not None and t >= stop.next_check)):
            break  # the caller reports them: the engine's loop goes on from t
        world.finish(finishing, t)
        # The next segment: the survivors (still in batch order in ``running``), from t.
        context += num_reqs * (m - 1 if first is not None else m)
        num_reqs -= len(finishing)
        lefts = kept_lefts
        needs = kept_needs
        m_finish = min(lefts)
        first = None
        finishing = []
    # The span ends: the tokens and token times of the requests still running.
    computed = done - 1 + ahead
    for req in running:
        if asynchronous and req.status == _FINISHED_LENGTH_CAPPED:
            continue  # (async: it holds its place in RUNNING until the next schedule)
        req.num_computed_tokens += computed
        req.num_output_tokens += done
        if req.first_token_ts is None:
            req.first_token_ts = first_token
        req.last_token_ts = t
    if asynchronous:
        # What the stretch's first step applied, and what its last step leaves pending
        # (one token each, finished requests included) until the next schedule.
        scheduler.apply_tokens()
        scheduler.hold_tokens(running, [1] * len(running))
    return t, finishing


class Clock(simpy.Environment):
    """A SimPy environment that can also wake a process at an absolute time.

    ``env.timeout(end - now)`` lands on ``now + (end - now)``, which in floats is not always
    ``end``; a stretch must end exactly where stepping would have, so it is scheduled at its
    end time itself (the same heap entry ``Environment.schedule`` makes, minus the addition).
    No public SimPy call can do that: for some pairs no delay at all lands on ``end``
    (now = 2**-52, end = 2 + 2**-51), and waking at an intermediate time first would change
    the order of simultaneous events. So this uses SimPy's internals (``_now``, ``_queue``,
    ``_eid``, ``Event._ok``, ``_value``), and pyproject.toml pins SimPy to the minor release
    they were read from; tests/test_clock.py fails with the pin's name when they change.
    """

    def timeout_at(self, at: float, priority: int = NORMAL) -> simpy.Event:
        """An event at ``at``; ``priority=LATE``: after every ordinary event at that time."""
        if at < self._now:
            raise ValueError(f"cannot schedule in the past ({at} < {self._now})")
        event = simpy.Event(self)
        event._ok = True
        event._value = None
        heappush(self._queue, (at, priority, next(self._eid), event))
        return event


# Events that must see every ordinary event at their time first (a fleet's router and its
# metrics scrapes: an engine step that ends at that time has ended).
LATE = NORMAL + 1
