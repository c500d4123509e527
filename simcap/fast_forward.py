"""Fast path: advance a stretch of pure-decode steps at once, exactly.

When every running request is decoding, nothing waits, no drafts are in play and the token
budget covers the batch, each engine step computes one token per running request and the
batch cannot change until (a) a request finishes, (b) the horizon: the next arrival, or a
closed-loop client's next event (its think time over), or (c) the KV pool runs out. Until
then the steps differ only in their attended context, so their durations, the requests'
chunk times, the step log and the KV pool's block allocations (every ``block_size``
tokens) can be computed in bulk (:func:`advance_decode_stretch`). A step that admits waiting
requests into such a batch is scheduled without walking the decoders one by one
(:func:`schedule_admission`) and, when every admitted prompt completes in it, runs as the
first step of the following stretch.

The result is the same, float for float, as stepping one by one: step times use the
step-time model's own operations in its order; start times are accumulated one step at a
time as SimPy's clock would; the KV manager hands out blocks in exactly the order in which
the reference path's ``allocate_slots`` calls take them. The tests hold this path to the
reference (``simulate(..., fast=False)``) on random scenarios.
"""

from __future__ import annotations

from bisect import bisect_left
from heapq import heappush
from itertools import accumulate

import simpy
from simpy.core import NORMAL

from simcap.engine.request import Request
from simcap.engine.scheduler import SchedulerOutput

MIN_STRETCH = 2  # a lone step goes through the reference path


def schedule_admission(world) -> SchedulerOutput | None:
    """The next step's :class:`SchedulerOutput` when requests wait and every running request
    decodes: what ``Scheduler.schedule`` gives, without walking the decoders one by one.

    None (nothing changed) when the batch is not like that, or a decoder would need a block
    the pool does not have (a preemption: the reference path's business).
    """
    scheduler = world.scheduler
    if world.proposer is not None or not scheduler.waiting:
        return None
    running = scheduler.running
    if len(running) >= scheduler.max_num_batched_tokens:
        return None
    kv = scheduler.kv
    bs = kv.block_size
    held = kv.req_to_blocks
    context = 0
    touched = []  # decoders whose token needs a new block or fills one
    num_new = 0
    for req in running:
        computed = req.num_computed_tokens
        if computed != req.num_prompt_tokens + req.num_output_tokens - 1 or req.num_spec_tokens:
            return None
        context += computed
        if computed >= len(held.get(req.request_id, ())) * bs:
            touched.append(req)
            num_new += 1
        elif (computed + 1) % bs == 0:
            touched.append(req)
    if num_new > kv.num_free_blocks:
        return None
    for req in touched:  # in batch order, as the reference path's allocate_slots calls
        kv.allocate_slots(req, 1)
    return scheduler.schedule_decoders_and_admit(context)


def advance_decode_stretch(
    world, now: float, horizon: float, first: SchedulerOutput | None = None
) -> tuple[float, list[Request]] | None:
    """Run the pure-decode steps that can run at once from ``now``; None if none can.

    The stretch runs until the first finish (included), the last step starting before
    ``horizon`` (the next arrival or client event) or the step before the KV pool runs out,
    whichever comes first. Returns the stretch's end time and the requests that finished in
    its last step (already released from the scheduler; the caller reports them at that
    time).

    ``first``: an already scheduled step (from :func:`schedule_admission`) to run as the
    stretch's first step, when after it every running request decodes and nothing waits;
    otherwise None is returned and the caller runs that step the reference way.

    Plain Python floats throughout: a stretch is typically tens of steps, where numpy's
    per-call cost exceeds the arithmetic, and float operations are the step-time model's own,
    in its order, so every time equals the reference path's.
    """
    scheduler = world.scheduler
    running: list[Request] = scheduler.running
    if world.proposer is not None or scheduler.waiting or not running:
        return None
    num_reqs = len(running)
    if num_reqs > scheduler.max_num_batched_tokens:
        return None
    # Before a step, a decoding request has computed all but its last token; a scheduled
    # first step has already counted its tokens as computed.
    ahead = 1 if first is None else 0
    max_model_len = scheduler.max_model_len
    lefts = []
    context = 0
    for req in running:
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        computed = req.num_computed_tokens
        if computed != num_tokens - ahead or req.num_spec_tokens:
            return None
        context += computed
        left = req.max_tokens - req.num_output_tokens
        lefts.append(left if left < max_model_len - num_tokens else max_model_len - num_tokens)
    m_finish = min(lefts)  # the first finish is in step m_finish (1-based)
    if first is None and (m_finish < MIN_STRETCH or now >= horizon):
        return None

    # Step periods (the step-time model's decode_periods: step_period's float operations on
    # integers) and start times, up to the first finish; then cut after the last step that
    # starts before the horizon. Times are accumulated one step at a time
    # (itertools.accumulate: the same additions, in C).
    model = world.step_model
    if world.noise is not None:  # per-step factors on the forward time: simcap.engine.noise
        periods, starts = world.noise.price_stretch(
            model, first, running, context, now, horizon, m_finish
        )
    else:
        periods = []
        todo = m_finish
        if first is not None:
            periods.append(model.step_period(first))
            todo -= 1
        # Periods never shrink along a stretch (the context grows), so no more than
        # (horizon - now) / first period + 1 steps start before the horizon: price only those
        # (+1 for rounding), not every step up to a finish far beyond it.
        if todo > 0:
            p1 = model.decode_periods(num_reqs, context, 1)[0]
            if p1 > 0 and model.decode_nondecreasing and horizon - now < p1 * todo:
                todo = int((horizon - now) / p1) + 2
            periods += model.decode_periods(num_reqs, context, todo)
        starts = list(accumulate(periods, initial=now))
    # Step j (0-based) runs only if it starts before the horizon; a scheduled first step runs.
    m = bisect_left(starts, horizon, 1 if first is not None else 0, len(periods))
    if m < len(periods):
        del starts[m + 1 :], periods[m:]
    m = len(periods)
    if first is None and m < MIN_STRETCH:
        return None

    # KV: request b needs a new block at step j when computed + j + 1 > held * bs, i.e. at
    # j = held*bs - computed and every bs steps after. Events are encoded j * num_reqs + b,
    # so that sorting them gives the (step, batch) order in which stepping allocates.
    kv = scheduler.kv
    bs = kv.block_size
    held = kv.req_to_blocks
    stride = bs * num_reqs
    events: list[int] = []
    for b, req in enumerate(running):
        j = len(held.get(req.request_id, ())) * bs - req.num_computed_tokens + 1 - ahead
        if j < m:
            events += range((j if j > 0 else 0) * num_reqs + b, m * num_reqs, stride)
    free = kv.num_free_blocks
    if events:
        events.sort()
        if len(events) > free:
            # The (free+1)-th new block fails: stop before the step that asks for it.
            m = events[free] // num_reqs
            if first is None and m < MIN_STRETCH:
                return None
            del events[free:], starts[m + 1 :], periods[m:]

    # Usage after each step's allocations: the free count falls at every new block.
    scale = kv.num_blocks - 1
    usages: list[float] = []
    j = 0
    for e in events:
        step = e // num_reqs
        if step > j:
            usages += [1.0 - free / scale] * (step - j)
            j = step
        free -= 1
    usages += [1.0 - free / scale] * (m - j)

    # Apply: blocks in (step, batch) order, as stepping pops them off the free queue. Blocks
    # that fill up are committed when the request releases them (KVCacheManager.free), not
    # as they fill: their content includes the request's own output tokens, which no other
    # prompt contains, so no allocation or prefix hit of another request can depend on them.
    if events:
        kv.append_blocks([running[e % num_reqs] for e in events])
    finishing = []
    for req, left in zip(running, lefts):
        req.num_computed_tokens += m - 1 + ahead
        req.num_output_tokens += m
        if left == m:
            finishing.append(req)
    if world.noise is not None:
        world.noise.advance(len(periods))  # the draws of the steps that ran, and no more
    world.emit_stretch(running, starts)  # chunks at starts[1:]
    end = starts.pop()  # starts now holds the m steps' start times
    steps = world.steps
    if first is not None:
        for req in first.new_reqs:
            if req.scheduled_ts is None:
                req.scheduled_ts = now
        steps.append(
            now, periods[0], first.num_prefill_tokens, first.num_decode_tokens, len(first.reqs),
            num_reqs, 0, usages[0], 0,
        )
        del starts[0], periods[0], usages[0]
    if starts:
        steps.extend_decode(starts, periods, usages, num_reqs)
    if finishing:
        scheduler.finish_requests(finishing)
    return end, finishing


def advance_verify_stretch(
    world, now: float, horizon: float, first: SchedulerOutput
) -> tuple[float, list[Request]] | None:
    """With speculative decoding: run the already scheduled step ``first`` and the verify
    steps that follow it while the batch cannot change; None (nothing run) if ``first``
    is not such a step.

    ``first`` qualifies when nothing was preempted, nothing waits (or ``max_num_seqs``
    requests run, so that nothing waiting can be admitted), every running request is in it
    and every one of them samples in it (decodes or verifies, or completes its prompt).
    Then, until a request finishes (that step included), the next step would start at or
    after ``horizon``, or the next step could not be scheduled as one of 1 + drafts tokens
    per request (the token budget, ``long_prefill_token_threshold``, or a KV block the pool
    cannot give), every step is: each request verifies its drafts (``num_spec_tokens``,
    capped by ``max_model_len``), accepts a count drawn from the acceptance model's stream
    (one uniform per scheduled request, in batch order, in steps with drafts), emits
    ``accepted + 1`` tokens (capped by ``max_tokens`` and ``max_model_len``) and gets its next
    drafts from the proposer (ngram: one uniform per request from the proposer's stream).

    These are the reference path's operations on plain integers: step periods come from the
    step-time model (and noise) on each step's counts, start times are added one step at a
    time, blocks are handed out in (step, batch) order, and every stream is read in the
    order and amount stepping reads it. Returns the stretch's end time and the requests that
    finished in its last step (released; the caller reports them at that time).
    """
    scheduler = world.scheduler
    running: list[Request] = scheduler.running
    reqs = first.reqs
    num_reqs = len(running)
    if first.preempted_reqs or not num_reqs or len(reqs) != num_reqs:
        return None
    # Requests may wait only if no more can run: then scheduling never looks at them.
    num_waiting = len(scheduler.waiting)
    if num_waiting and num_reqs < scheduler.max_num_seqs:
        return None
    acceptance = world.acceptance
    if not acceptance.non_increasing:
        return None
    max_model_len = scheduler.max_model_len
    # Before the first step's update: each request's tokens and drafts; every one samples.
    nts = []
    outs = []
    for req, spec in zip(reqs, first.num_scheduled_spec_tokens):
        nt = req.num_prompt_tokens + req.num_output_tokens
        if req.num_computed_tokens - spec != nt:
            return None  # a prompt chunk that does not complete: no token this step
        nts.append(nt)
        outs.append(req.num_output_tokens)
    maxes = [req.max_tokens for req in reqs]
    ds = list(first.num_scheduled_spec_tokens)

    proposer = world.proposer
    k = proposer.k
    rate = proposer.proposal_rate
    drafts_all = rate >= 1.0
    take_proposals = proposer.uniforms.take
    take_uniforms = acceptance.uniforms.take
    # accepted = #{i < d : u < r_i} = min(d, rates above u): a bisection on -r.
    neg_rates = [-r for r in acceptance.rates.tolist()]
    counters = world.spec_counters
    accepted_hist = [0] * (k + 1)  # requests (with drafts) by accepted count
    num_drafts = num_draft_tokens = 0

    # The next steps are scheduled as stepping would: 1 + drafts tokens each, within the
    # budget and the prefill threshold (nothing waits, the batch is fixed, so both are fixed).
    threshold = scheduler.prefill_threshold()
    budget = scheduler.max_num_batched_tokens
    lookahead = scheduler.num_lookahead_tokens
    kv = scheduler.kv
    bs = kv.block_size
    held_map = kv.req_to_blocks
    held = [len(held_map[req.request_id]) for req in reqs]
    free = kv.num_free_blocks
    scale = kv.num_blocks - 1
    allocs: list[Request] = []  # the blocks the stretch takes, by holder, in order taken

    model = world.step_model
    noise = world.noise
    out = first
    # Steps after the first: pure verify (or decode) steps of the same requests.
    verify_out = SchedulerOutput(reqs=reqs, num_decode_reqs=num_reqs, num_decode_tokens=num_reqs)
    starts = [now]
    periods: list[float] = []
    usages = [kv.usage]
    news_by_step: list[list[int]] = []
    t = now
    finishing: list[Request] = []
    while True:
        p = model.step_period(out) if noise is None else noise.step_period(model, out)
        periods.append(p)
        t += p
        starts.append(t)
        # The step's result: accepted drafts, tokens, finishes, next drafts.
        news = []
        prev_nts = nts
        nts = []
        accs = [0] * num_reqs
        if out.num_verify_tokens:
            uniforms, u0 = take_uniforms(num_reqs)
            for b in range(num_reqs):
                d = ds[b]
                if d:
                    a = bisect_left(neg_rates, -uniforms[u0 + b])
                    if a > d:
                        a = d
                    accs[b] = a
                    accepted_hist[a] += 1
                    num_drafts += 1
                    num_draft_tokens += d
        done = False
        for b in range(num_reqs):
            nt = prev_nts[b]
            new = accs[b] + 1
            o = outs[b]
            room = maxes[b] - o
            if new > room:
                new = room
            room = max_model_len - nt
            if new > room:
                new = room
            o += new
            nt += new
            outs[b] = o
            nts.append(nt)
            news.append(new)
            if o >= maxes[b] or nt >= max_model_len:
                done = True
        news_by_step.append(news)
        if drafts_all:
            proposed = [k] * num_reqs
        else:
            draws, v0 = take_proposals(num_reqs)
            proposed = [k if u < rate else 0 for u in draws[v0 : v0 + num_reqs]]
        if done:
            finishing = [req for req, o, nt, m in zip(reqs, outs, nts, maxes)
                         if o >= m or nt >= max_model_len]
            break
        if t >= horizon:
            break
        # Schedule the next step: drafts capped by max_model_len, then the budget, the
        # threshold, and the blocks for 1 + drafts + lookahead slots.
        total = num_reqs
        context = 0
        verify = 0
        need_blocks = 0
        new_held = held[:]
        step_allocs = []
        ds = []
        for b in range(num_reqs):
            nt = nts[b]
            d = proposed[b]
            if d > max_model_len - nt - 1:
                d = max_model_len - nt - 1
            ds.append(d)
            verify += d
            context += nt + d
            need = nt + d + lookahead
            if need > max_model_len:
                need = max_model_len
            blocks = -(-need // bs)
            if blocks > held[b]:
                need_blocks += blocks - held[b]
                new_held[b] = blocks
                step_allocs += [reqs[b]] * (blocks - held[b])
        total += verify
        if total > budget or (threshold and verify and 1 + max(ds) > threshold):
            break
        if need_blocks > free:
            break  # stepping would preempt: the reference path's business
        free -= need_blocks
        held = new_held
        allocs += step_allocs
        usages.append(1.0 - free / scale)
        verify_out.num_scheduled_spec_tokens = ds
        verify_out.total_num_scheduled_tokens = total
        verify_out.num_verify_tokens = verify
        verify_out.num_context_tokens = context
        out = verify_out

    # Apply: blocks, request state, counters, the step log, the stream chunks, finishes.
    if allocs:
        kv.append_blocks(allocs)
    for req, prev, a, o, d in zip(reqs, prev_nts, accs, outs, proposed):
        req.num_output_tokens = o
        req.num_computed_tokens = prev + a
        req.num_spec_tokens = d
    if num_drafts:
        counters.num_drafts += num_drafts
        counters.num_draft_tokens += num_draft_tokens
        per_pos = counters.accepted_per_pos
        for a in range(1, k + 1):
            count = accepted_hist[a]
            if count:
                while len(per_pos) < a:
                    per_pos.append(0)
                for i in range(a):
                    per_pos[i] += count
                counters.num_accepted_tokens += a * count
    steps = world.steps
    for req in first.new_reqs:
        if req.scheduled_ts is None:
            req.scheduled_ts = now
    steps.append(
        now, periods[0], first.num_prefill_tokens, first.num_decode_tokens, num_reqs,
        num_reqs, num_waiting, usages[0], 0,
    )
    if len(periods) > 1:
        steps.extend_decode(starts[1:-1], periods[1:], usages[1:], num_reqs, num_waiting)
    world.emit_steps(reqs, starts, news_by_step)
    end = starts[-1]
    if finishing:
        for req in finishing:
            req.num_spec_tokens = 0
        scheduler.finish_requests(finishing)
    return end, finishing


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
