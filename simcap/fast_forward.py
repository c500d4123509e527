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

With speculative decoding, :func:`advance_verify_stretch` does the same for verify steps:
each request verifies its drafts and emits ``accepted + 1`` tokens, with accepted counts
(and ngram proposals) read from the engine's buffered uniform streams in the order and
amount stepping reads them, so that the stretch ends where stepping's batch would change.

The result is the same, float for float, as stepping one by one: step times use the
step-time model's own operations in its order; start times are accumulated one step at a
time as SimPy's clock would; the KV manager hands out blocks in exactly the order in which
the reference path's ``allocate_slots`` calls take them. The tests hold this path to the
reference (``simulate(..., fast=False)``) on random scenarios.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from heapq import heappush
from itertools import accumulate
from operator import sub
from typing import NamedTuple

import numpy as np
import simpy
from simpy.core import NORMAL

from simcap.engine.request import Request
from simcap.engine.scheduler import SchedulerOutput

MIN_STRETCH = 2  # a lone step goes through the reference path
PRICE_STEPS = 32  # steps of a decode stretch priced before looking at the horizon


class Admission(NamedTuple):
    """A step that admits waiting requests into a batch of decoders (:func:`schedule_admission`),
    and what the decoders were found to have left, so that the stretch that runs it need not
    read them again."""

    out: SchedulerOutput  # the scheduled step
    lefts: list[int]  # per decoder (in batch order): tokens left, this step's included
    needs: list[int]  # per decoder: the step (0-based, this one 0) that first needs a new block
    num_context_tokens: int  # the decoders' computed tokens, this step's included


def schedule_admission(world) -> Admission | None:
    """The next step, when requests wait and every running request decodes: the
    :class:`SchedulerOutput` that ``Scheduler.schedule`` gives, scheduled without walking the
    decoders one by one, and what the stretch that runs it needs to know of them.

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
    max_model_len = scheduler.max_model_len
    context = 0
    touched = []  # decoders whose token needs a new block or fills one
    num_new = 0
    lefts = []
    needs = []
    for req in running:
        computed = req.num_computed_tokens
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        if computed != num_tokens - 1 or req.num_spec_tokens:
            return None
        context += computed
        num_held = len(held[req.request_id])
        if computed >= num_held * bs:
            touched.append(req)
            num_new += 1
            num_held += 1
        elif (computed + 1) % bs == 0:
            touched.append(req)
        left = req.max_tokens - req.num_output_tokens
        lefts.append(left if left < max_model_len - num_tokens else max_model_len - num_tokens)
        needs.append(num_held * bs - computed)  # its blocks after this step's allocation
    if num_new > kv.num_free_blocks:
        return None
    for req in touched:  # in batch order, as the reference path's allocate_slots calls
        kv.allocate_slots(req, 1)
    out = scheduler.schedule_decoders_and_admit(context)
    return Admission(out, lefts, needs, context + len(lefts))


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


def usages_by_step(
    events: list[int], num_reqs: int, num_steps: int, free: int, scale: int
) -> tuple[list[float], int]:
    """:func:`usage_runs_by_step`, one usage per step."""
    runs, counts, free = usage_runs_by_step(events, num_reqs, num_steps, free, scale)
    usages: list[float] = []
    for usage, count in zip(runs, counts):
        usages += [usage] * count
    return usages, free


def advance_decode_stretch(
    world, now: float, horizon: float, admitted: Admission | None = None
) -> tuple[float, list[Request]] | None:
    """Run the pure-decode steps that can run at once from ``now``; None if none can.

    The stretch runs until the first finish (included), the last step starting before
    ``horizon`` (the next arrival or client event) or the step before the KV pool runs out,
    whichever comes first. Returns the stretch's end time and the requests that finished in
    its last step (already released from the scheduler; the caller reports them at that
    time).

    ``admitted``: an already scheduled step (from :func:`schedule_admission`) to run as the
    stretch's first step, when after it every running request decodes and nothing waits;
    otherwise None is returned and the caller runs that step the reference way.

    Plain Python floats throughout: a stretch is typically tens of steps of a few requests,
    where numpy's per-call cost exceeds the arithmetic, and float operations are the
    step-time model's own, in its order, so every time equals the reference path's. The
    running batch is read once (what each request has left, and when it next needs a block)
    and written once (its tokens and stream chunks).
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
    for req in unread:
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        computed = req.num_computed_tokens
        if computed != num_tokens - ahead or req.num_spec_tokens:
            return None
        context += computed
        left = req.max_tokens - req.num_output_tokens
        lefts.append(left if left < max_model_len - num_tokens else max_model_len - num_tokens)
        # Request b needs a new block at step j when computed + j + 1 > held * bs.
        needs.append(len(held[req.request_id]) * bs - computed + 1 - ahead)
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
        # Up to PRICE_STEPS steps first (most stretches end sooner); if none of them reaches
        # the horizon, the rest. Periods never shrink along a stretch (the context grows), so
        # no more than (horizon - t) / the last period + 1 of the rest start before the
        # horizon: price only those (+1 for rounding), not every step up to a finish far
        # beyond it. Step j's context is context + num_reqs * j however the steps are split.
        priced = todo if todo < PRICE_STEPS else PRICE_STEPS
        if priced > 0:
            periods += model.decode_periods(num_reqs, context, priced)
        starts = list(accumulate(periods, initial=now))
        if priced < todo and starts[-1] < horizon:
            t = starts.pop()
            rest = todo - priced
            p = periods[-1]
            if p > 0 and model.decode_nondecreasing and horizon - t < p * rest:
                rest = int((horizon - t) / p) + 2
            more = model.decode_periods(num_reqs, context + num_reqs * priced, rest)
            periods += more
            starts += accumulate(more, initial=t)
    # Step j (0-based) runs only if it starts before the horizon; a scheduled first step runs.
    m = bisect_left(starts, horizon, 1 if first is not None else 0, len(periods))
    if m < len(periods):
        del starts[m + 1 :], periods[m:]
    else:
        m = len(periods)
    if first is None and m < MIN_STRETCH:
        return None

    # KV: request b needs a new block at step needs[b] and every bs steps after. Events are
    # encoded j * num_reqs + b, so that sorting them gives the (step, batch) order in which
    # stepping allocates.
    free = kv.num_free_blocks
    scale = kv.num_blocks - 1
    events: list[int] = []
    if min(needs) < m:
        stride = bs * num_reqs
        end = m * num_reqs
        for b, j in enumerate(needs):
            if j < m:
                events += range((j if j > 0 else 0) * num_reqs + b, end, stride)
    if events:
        events.sort()
        if len(events) > free:
            # The (free+1)-th new block fails: stop before the step that asks for it.
            m = events[free] // num_reqs
            if first is None and m < MIN_STRETCH:
                return None
            del events[free:], starts[m + 1 :], periods[m:]
        usages, counts, free = usage_runs_by_step(events, num_reqs, m, free, scale)
        # Blocks in (step, batch) order, as stepping pops them off the free queue. Blocks
        # that fill up are committed when the request releases them (KVCacheManager.free),
        # not as they fill: their content includes the request's own output tokens, which
        # no other prompt contains, so no allocation or prefix hit of another request can
        # depend on them.
        kv.append_blocks([running[e % num_reqs] for e in events])
    else:
        usages, counts = [1.0 - free / scale], [m]  # (as runs: counts[i] steps of usages[i])

    if world.noise is not None:
        world.noise.advance(len(periods))  # the draws of the steps that ran, and no more
    # Each request's tokens, and its token times (RequestStateStats): one token a step, the
    # first at starts[1], the last at the stretch's end.
    computed = m - 1 + ahead
    first_token = starts[1]
    last_token = starts[-1]
    gaps = []  # from each request's previous token to its first here
    for req in running:
        req.num_computed_tokens += computed
        req.num_output_tokens += m
        if req.first_token_ts is None:
            req.first_token_ts = first_token
        else:
            gaps.append(first_token - req.last_token_ts)
        req.last_token_ts = last_token
    # (m never exceeds the first finish's step: a stretch cut short has no finish)
    finishing = [req for req, left in zip(running, lefts) if left == m] if m == m_finish else []
    world.emit_stretch(running, starts, gaps)  # chunks at starts[1:]
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
        if m > 1:
            if counts[0] == 1:
                del usages[0], counts[0]
            else:
                counts[0] -= 1
            steps.extend_decode(starts[1:], periods[1:], usages, num_reqs, counts=counts)
    else:
        steps.extend_decode(starts, periods, usages, num_reqs, counts=counts)
    if finishing:
        scheduler.finish_requests(finishing)
    return end, finishing


def advance_verify_stretch(
    world, now: float, horizon: float, first: SchedulerOutput | None = None
) -> tuple[float, list[Request]] | None:
    """With speculative decoding: run the verify steps from ``now`` while the batch cannot
    change; None (nothing changed) if none can run.

    ``first``: the step the scheduler has just scheduled, run as the stretch's first step
    (it may admit requests); or None, when every running request decodes or verifies and
    the stretch schedules its first step itself. Either way nothing may wait (unless
    ``max_num_seqs`` requests run, so that scheduling never looks at the queue), nothing may
    be preempted, and every request samples in the first step.

    Then, until a request finishes (that step included), a step ends at or after
    ``horizon``, or the next step cannot be scheduled as 1 + drafts tokens per request (the
    token budget, ``long_prefill_token_threshold``, or a KV block the pool cannot give:
    stepping would preempt), each step is: every request verifies its drafts
    (``num_spec_tokens``, capped by ``max_model_len``), accepts a count drawn from the
    acceptance model's stream (one uniform per request, in batch order, in steps with
    drafts), emits ``accepted + 1`` tokens (capped by ``max_tokens`` and ``max_model_len``) and
    gets its next drafts from the proposer (ngram: one uniform per request from the
    proposer's stream, below the request's match probability). Steps in which every request verifies k drafts and none finishes
    (EAGLE, no noise) run in bulk, a request at a time; the rest one at a time.

    These are the reference path's operations on plain integers: step periods come from the
    step-time model (and noise) on each step's counts, start times are added one step at a
    time, blocks are handed out in (step, batch) order, and every stream is read in the
    order and amount stepping reads it. Returns the stretch's end time and the requests that
    finished in its last step (released; the caller reports them at that time).
    """
    scheduler = world.scheduler
    running: list[Request] = scheduler.running
    num_reqs = len(running)
    num_waiting = len(scheduler.waiting)
    if not num_reqs or (num_waiting and num_reqs < scheduler.max_num_seqs):
        return None
    acceptance = world.acceptance
    if not acceptance.non_increasing:
        return None
    max_model_len = scheduler.max_model_len
    # Each request's tokens before the first step's update; every one samples in it.
    nts = []
    if first is None:
        reqs = list(running)
        for req in reqs:
            nt = req.num_prompt_tokens + req.num_output_tokens
            if req.num_computed_tokens != nt - 1:
                return None
            nts.append(nt)
        proposed = [req.num_spec_tokens for req in reqs]  # drafts, before any cap
    else:
        reqs = first.reqs
        if first.preempted_reqs or first.spec_padded_reqs or len(reqs) != num_reqs:
            return None  # (padded drafts are never accepted: stepping's business)
        for req, spec in zip(reqs, first.num_scheduled_spec_tokens):
            nt = req.num_prompt_tokens + req.num_output_tokens
            if req.num_computed_tokens - spec != nt:
                return None  # a prompt chunk that does not complete: no token this step
            nts.append(nt)
        ds = first.num_scheduled_spec_tokens  # the step's drafts, per request
    outs = [req.num_output_tokens for req in reqs]
    maxes = [req.max_tokens for req in reqs]

    proposer = world.proposer
    k = proposer.k
    rate = proposer.proposal_rate
    drafts_all = rate >= 1.0  # EAGLE: every request that sampled drafts k
    # ngram with a match probability per request (drawn from its content, in any order).
    per_request = proposer.per_request
    matches = [proposer.match_probability(req) for req in reqs] if per_request else []
    uncapped = max_model_len - 1 - k  # up to this many tokens, k drafts fit max_model_len
    # Uniforms are read from the streams' buffers in order and used up at the end (or when
    # a buffer runs out): acceptance, one per request in steps with drafts; proposals
    # (ngram), one per request in every step.
    accept_stream = acceptance.uniforms
    ub, u0 = accept_stream.reserve(num_reqs)
    ui = u0
    propose_stream = proposer.uniforms
    if drafts_all:
        pb, p0 = [], 0
    else:
        pb, p0 = propose_stream.reserve(num_reqs)
    pi = p0
    ps: list[float] = []
    # accepted = #{i < d : u < r_i}; rates never rise, so that is min(d, rates above u).
    neg_rates = acceptance.neg_rates
    rates_ascending = acceptance.rates_ascending
    accepted_hist = [0] * (k + 1)  # verifying requests by accepted count
    num_drafts = num_draft_tokens = 0

    # Steps are scheduled as stepping would: 1 + drafts tokens per request within the
    # budget and the prefill threshold (both fixed while the batch is), and blocks for
    # tokens + drafts + lookahead slots (up to max_model_len).
    threshold = scheduler.prefill_threshold()
    budget = scheduler.max_num_batched_tokens
    lookahead = scheduler.num_lookahead_tokens
    kv = scheduler.kv
    bs = kv.block_size
    held_map = kv.req_to_blocks
    held = [len(held_map[req.request_id]) for req in reqs]
    limits = [h * bs - lookahead for h in held]  # a step needs a block past nt + d > limit
    free = kv.num_free_blocks
    scale = kv.num_blocks - 1
    allocs: list[Request] = []  # the blocks the stretch takes, by holder, in order taken

    model = world.step_model
    noise = world.noise
    verify_out = SchedulerOutput(reqs=reqs, num_decode_reqs=num_reqs, num_decode_tokens=num_reqs)
    starts = [now]
    periods: list[float] = []
    usages = [] if first is None else [kv.usage]
    news_all: list[int] = []  # tokens per request per step (step-major)
    t = now
    finished: dict[int, int] = {}  # batch index -> computed tokens after its last step
    last_accepted = [0] * num_reqs  # each request's accepted drafts in the last step
    # Plain steps (every request verifies k drafts, none finishes, no draft or block is
    # capped by max_model_len) run in bulk when no noise and no proposal draws are in play.
    onset = proposer.onset  # ngram: no drafts before this many output tokens
    bulk = drafts_all and not onset and noise is None
    full = num_reqs * k
    tail = min(uncapped, max_model_len - k - lookahead)  # a plain step follows up to here
    out = first
    while True:
        if out is None:
            # Schedule the next step: drafts capped by max_model_len, then the budget, the
            # threshold, and the blocks for 1 + drafts + lookahead slots.
            ds = []
            grow = []
            verify = 0
            for b in range(num_reqs):
                nt = nts[b]
                d = proposed[b]
                if d > max_model_len - nt - 1:
                    d = max_model_len - nt - 1
                ds.append(d)
                verify += d
                if nt + d > limits[b]:
                    grow.append(b)
            if num_reqs + verify > budget or (threshold and verify and max(ds) >= threshold):
                break
            if grow:
                need_blocks = 0
                step_allocs = []
                for b in grow:
                    need = nts[b] + ds[b] + lookahead
                    if need > max_model_len:
                        need = max_model_len
                    blocks = -(-need // bs) - held[b]
                    if blocks > 0:
                        need_blocks += blocks
                        step_allocs += [reqs[b]] * blocks
                if need_blocks > free:
                    break  # stepping would preempt: the reference path's business
                free -= need_blocks
                for b in grow:
                    need = nts[b] + ds[b] + lookahead
                    if need > max_model_len:
                        need = max_model_len
                    blocks = -(-need // bs)
                    if blocks > held[b]:
                        held[b] = blocks
                        limits[b] = blocks * bs - lookahead
                allocs += step_allocs
            usages.append(1.0 - free / scale)
            verify_out.num_scheduled_spec_tokens = ds
            verify_out.total_num_scheduled_tokens = num_reqs + verify
            verify_out.num_verify_tokens = verify
            verify_out.num_context_tokens = sum(nts) + verify
            out = verify_out

        if bulk and out.num_verify_tokens == full and not out.num_prefill_tokens:
            # Run the scheduled step and those after it in bulk. Request b's accepted
            # counts come from column b of the stream (one uniform per request per step);
            # its tokens after each step are their running sum. Each request finishes
            # within m steps: m = the fewest tokens any has left.
            m = min(min(map(sub, maxes, outs)), max_model_len - max(nts))
            # The first finish comes after about m / mean_tokens steps: draw for a margin over
            # that, not for m one-token steps (a bulk that ends at its m-th step is followed
            # by a step run one at a time, then by the next bulk).
            m = min(m, int(m / acceptance.mean_tokens * 1.15) + 3)
            context = out.num_context_tokens
            if model.decode_nondecreasing and horizon < math.inf:
                # Periods never shrink here: no more steps than this start before the horizon.
                p = model.verify_periods(num_reqs, full, (context,))[0]
                if p > 0 and horizon - t < p * m:
                    m = min(m, int((horizon - t) / p) + 2)
            if m >= 2:
                size = num_reqs * m
                accept_stream.advance(ui - u0)
                ub, u0 = accept_stream.reserve(size)
                ui = u0
                # Tokens per request per step (step-major): accepted + 1 (numpy's comparisons
                # of the same floats: the counts stepping takes, one uniform at a time).
                drawn = accept_stream.array[ui : ui + size]
                xs = rates_ascending.searchsorted(drawn, side="right")  # k - accepted
                news = (k + 1 - xs).tolist()
                fin = cap = m  # the first step in which one finishes; after which one caps
                cums = []
                for b in range(num_reqs):
                    cum = list(accumulate(news[b::num_reqs]))  # its tokens after each step
                    nt = nts[b]
                    room = maxes[b] - outs[b]
                    if room > max_model_len - nt:
                        room = max_model_len - nt
                    i = bisect_left(cum, room, 0, fin + 1 if fin < m else m)
                    if i < fin:
                        fin = i
                    i = bisect_right(cum, tail - nt, 0, cap)
                    if i < cap:
                        cap = i
                    cums.append(cum)
                # Blocks for the steps that plain steps schedule (request b's step after
                # step i needs its tokens + k + lookahead slots), in (step, batch) order.
                plain = fin if fin < cap else cap
                events = []
                for b in range(num_reqs):
                    cum = cums[b]
                    h = limits[b] - nts[b] - k
                    while True:
                        i = bisect_right(cum, h, 0, plain)
                        if i >= plain:
                            break
                        events.append(i * num_reqs + b)
                        h += bs
                events.sort()
                kv_stop = m
                if len(events) > free:
                    kv_stop = events[free] // num_reqs  # scheduling its successor would preempt
                stop = min(fin, cap, kv_stop)
                # Periods and start times up to the last step that may run.
                priced = stop + 1 if stop < m else m
                # Step i attends the context before it plus the tokens of steps 0..i-1.
                contexts = list(accumulate(
                    map(sum, zip(*[iter(news[: priced * num_reqs])] * num_reqs)), initial=context
                ))
                bulk_periods = model.verify_periods(num_reqs, full, contexts[:priced])
                bulk_starts = list(accumulate(bulk_periods, initial=t))
                late = bisect_left(bulk_starts, horizon, 1) - 1  # the first to end at/after it
                if late < priced and late < stop:
                    stop = late
                # What ends the bulk: a finish, the horizon or the pool (that step runs and
                # the stretch ends with it), a cap (that step runs one at a time), or m.
                ends = stop < m and (stop == fin or stop == late or stop == kv_stop)
                ran = stop + 1 if ends else stop  # steps run here
                scheduled = ran - 1 if ends else ran  # of them, those that schedule the next
                if ran:
                    size = num_reqs * ran
                    ui += size
                    num_drafts += size
                    num_draft_tokens += full * ran
                    if size < len(news):
                        del news[size:]
                    by_rejected = np.bincount(xs[:size], minlength=k + 1).tolist()
                    for a in range(1, k + 1):
                        accepted_hist[a] += by_rejected[k - a]
                    last_accepted = [n - 1 for n in news[size - num_reqs :]]
                    if ends and stop == fin:
                        before = fin - 1
                        for b in range(num_reqs):
                            cum = cums[b]
                            done = cum[before] if fin else 0
                            room = maxes[b] - outs[b]
                            if room > max_model_len - nts[b]:
                                room = max_model_len - nts[b]
                            if cum[fin] >= room:  # it finishes: tokens past the end are cut
                                i = fin * num_reqs + b
                                finished[b] = nts[b] + done + news[i] - 1
                                news[i] = room - done
                                cum[fin] = room
                    last = scheduled - 1  # the last step here that schedules the next
                    for b in range(num_reqs):
                        cum = cums[b]
                        nt = nts[b]
                        if scheduled:  # its blocks for the step after step `last` (its events)
                            blocks = -(-(nt + cum[last] + k + lookahead) // bs)
                            if blocks > held[b]:
                                held[b] = blocks
                                limits[b] = blocks * bs - lookahead
                        grown = cum[ran - 1]
                        nts[b] = nt + grown
                        outs[b] += grown
                    news_all += news
                    del events[bisect_left(events, scheduled * num_reqs) :]
                    bulk_usages, free = usages_by_step(events, num_reqs, scheduled, free, scale)
                    usages += bulk_usages
                    allocs += [reqs[e % num_reqs] for e in events]
                    periods += bulk_periods[:ran]
                    starts += bulk_starts[1 : ran + 1]
                    t = bulk_starts[ran]
                    if ends:
                        proposed = [k] * num_reqs
                        break
                    verify_out.num_scheduled_spec_tokens = ds = [k] * num_reqs
                    verify_out.total_num_scheduled_tokens = num_reqs + full
                    verify_out.num_verify_tokens = full
                    verify_out.num_context_tokens = contexts[ran]
                    out = verify_out

        # One step: price it, then its result (accepted drafts, tokens, finishes) and the
        # next drafts.
        p = model.step_period(out) if noise is None else noise.step_period(model, out)
        periods.append(p)
        t += p
        starts.append(t)
        verifying = out.num_verify_tokens
        if verifying:
            if ui + num_reqs > len(ub):
                accept_stream.advance(ui - u0)
                ub, u0 = accept_stream.reserve(num_reqs)
                ui = u0
            us = ub[ui : ui + num_reqs]
            ui += num_reqs
            num_drafts += num_reqs - ds.count(0)
            num_draft_tokens += verifying
        if drafts_all:
            proposed = [k] * num_reqs
        else:
            if pi + num_reqs > len(pb):
                propose_stream.advance(pi - p0)
                pb, p0 = propose_stream.reserve(num_reqs)
                pi = p0
            ps = pb[pi : pi + num_reqs]
            pi += num_reqs
            if per_request:
                proposed = [k if u < r else 0 for u, r in zip(ps, matches)]
            else:
                proposed = [k if u < rate else 0 for u in ps]
        for b in range(num_reqs):
            d = ds[b]
            if d:
                a = bisect_left(neg_rates, -us[b])
                if a > d:
                    a = d
                accepted_hist[a] += 1
            else:
                a = 0
            last_accepted[b] = a
            new = a + 1
            o = outs[b] + new
            nt = nts[b] + new
            if o >= maxes[b] or nt >= max_model_len:  # it finishes: tokens past the end are cut
                new = min(new, maxes[b] - outs[b], max_model_len - nts[b])
                finished[b] = nts[b] + a
                o = outs[b] + new
                nt = nts[b] + new
            outs[b] = o
            nts[b] = nt
            news_all.append(new)
        if onset:
            proposed = [d if o >= onset else 0 for d, o in zip(proposed, outs)]
        if finished or t >= horizon:
            break
        out = None
    if not periods:
        return None  # the first step could not be scheduled here: nothing changed
    accept_stream.advance(ui - u0)
    if not drafts_all:
        propose_stream.advance(pi - p0)

    # Apply: blocks, request state, counters, the step log, the stream chunks, finishes.
    if allocs:
        kv.append_blocks(allocs)
    for b, req in enumerate(reqs):
        req.num_output_tokens = outs[b]
        req.is_prefill_chunk = False
        # The last step's accepted drafts: their blocks are cached at the next allocation.
        req.num_accepted_uncommitted = last_accepted[b]
        if b in finished:
            req.num_computed_tokens = finished[b]
            req.num_spec_tokens = 0
        else:
            req.num_computed_tokens = nts[b] - 1
            req.num_spec_tokens = proposed[b]  # (a step scheduled later caps them)
    if num_drafts:
        counters = world.spec_counters
        counters.num_drafts += num_drafts
        counters.num_draft_tokens += num_draft_tokens
        # Position i (0-based) is accepted by every request that accepted more than i.
        accepted_past = list(accumulate(accepted_hist[:0:-1]))[::-1]
        while accepted_past and not accepted_past[-1]:
            accepted_past.pop()
        per_pos = counters.accepted_per_pos
        if len(per_pos) < len(accepted_past):
            per_pos += [0] * (len(accepted_past) - len(per_pos))
        for i, count in enumerate(accepted_past):
            per_pos[i] += count
        counters.num_accepted_tokens += sum(accepted_past)
    steps = world.steps
    if first is not None:
        for req in first.new_reqs:
            if req.scheduled_ts is None:
                req.scheduled_ts = now
        steps.append(
            now, periods[0], first.num_prefill_tokens, first.num_decode_tokens, num_reqs,
            num_reqs, num_waiting, usages[0], 0,
        )
        if len(periods) > 1:
            steps.extend_decode(starts[1:-1], periods[1:], usages[1:], num_reqs, num_waiting)
    else:
        steps.extend_decode(starts[:-1], periods, usages, num_reqs, num_waiting)
    world.emit_steps(reqs, starts, news_all)
    finishing = [reqs[b] for b in sorted(finished)]
    if finishing:
        scheduler.finish_requests(finishing)
    return starts[-1], finishing


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
