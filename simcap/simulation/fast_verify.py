"""Fast path with speculative decoding: advance a stretch of verify steps at once, exactly.

While the batch cannot change (nothing waits, or ``max_num_seqs`` requests run; nothing is
preempted) every step of a speculative engine is a verify step: each request verifies its
drafts, accepts a count drawn from the acceptance model's stream and emits ``accepted + 1``
tokens, then gets its next drafts from the proposer. :func:`advance_verify_stretch` runs
such steps until the batch would change; :class:`VerifyStretch` holds a stretch's state
while it runs, in three parts:

- :meth:`VerifyStretch.schedule`: the next step as the scheduler would schedule it (drafts
  capped by ``max_model_len``, the token budget, the prefill threshold, KV blocks);
- :meth:`VerifyStretch.run_bulk`: steps in which every request verifies k drafts and none
  finishes or is capped (EAGLE, no noise), all at once: a request's tokens after each step
  are the running sum of its column of the acceptance stream;
- :meth:`VerifyStretch.run_step`: one step at a time (ngram proposals, noise, a step that
  admits, one that is capped), as stepping runs it;

then :meth:`VerifyStretch.apply` hands out the blocks and writes the requests' state, the
counters, the step log and the stream chunks. With open-loop or replayed arrivals a stretch
goes on past finishes before the next arrival while nothing waits, as a span of segments
(:meth:`VerifyStretch.go_on`): at each finish the segment is written, the finished requests
are released and reported, and the smaller batch runs on.

The result is the same, float for float, as stepping one by one (``simulate(...,
fast=False)``; the tests hold the two to each other on random scenarios): step periods come
from the step-time model (and noise) on each step's counts, start times are added one step
at a time, blocks are handed out in (step, batch) order, and every stream is read in the
order and amount stepping reads it.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from itertools import accumulate

from simcap.engine.request import Request, RequestStatus
from simcap.engine.scheduler import SchedulerOutput
from simcap.simulation.fast_forward import decode_starts, log_stretch, usage_runs_by_step

_NO_COUNTS = array("q", [0])
_FINISHED_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def advance_verify_stretch(
    world, now: float, horizon: float, first: SchedulerOutput | None = None, span: bool = False
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
    proposer's stream, below the request's match probability). Steps in which every request
    verifies k drafts and none finishes (EAGLE, no noise) run in bulk, a request at a time;
    the rest one at a time.

    Returns the stretch's end time and the requests that finished in its last step
    (released; the caller reports them at that time).

    ``span``: nothing but the engine itself acts before the horizon (open-loop or replayed
    arrivals, no closed-loop client, no fleet), so the stretch goes on past finishes that
    end before the horizon while nothing waits, as a span of segments, each up to the next
    finish (:meth:`VerifyStretch.go_on`): the finished requests leave the batch
    (``Scheduler.finish_requests``, which frees their blocks after the segment's
    allocations and before the next one's) and are reported (``world.finish``) at their
    finish, and the next segment runs the smaller batch, its draws taken from the same
    streams in the same order. A span stops at a finish when a stop rule is due to be
    checked then (``world.stop``), so that it sees the engine as stepping would.
    """
    stretch = VerifyStretch.begin(world, now, first)
    if stretch is None:
        return None
    pending = first is not None  # a step is scheduled and not yet run
    while True:
        if not pending and not stretch.schedule():
            break  # the next step does not fit as a verify step: stepping's business
        pending = False
        if (stretch.bulk and stretch.verify == stretch.full and not stretch.prefill
                and stretch.positions is None):
            if stretch.run_bulk(horizon):
                if span and stretch.go_on(horizon):
                    continue
                break
        if stretch.run_step(horizon):
            if span and stretch.go_on(horizon):
                continue
            break
    return stretch.apply()


def schedule_verify_admission(world) -> SchedulerOutput | None:
    """The next step's :class:`SchedulerOutput` when requests wait and every running request
    verifies its drafts (or decodes): what ``Scheduler.schedule`` gives, with the running
    requests' drafts and blocks worked out on plain integers, then admission from the queue.

    None (nothing changed) when the batch is not like that (a prompt under way), or when its
    tokens do not fit as stepping schedules them in full (the budget, the prefill threshold,
    or a block the pool cannot give: a preemption), the reference path's business. The
    running requests' newly full blocks are committed when they next allocate or are
    released, as along a stretch (:meth:`VerifyStretch.apply`): no other request can hit them,
    their content being the requests' own output. The exception, a prompt's last block that
    this step fills (its chunk stopped one token short), is committed here, before admission,
    as ``allocate_slots`` would: an admitted request sharing the prompt hits it.

    Async scheduling: also the step after a finish, when nothing waits. A request the last
    step finished is skipped when its bonus token alone ended it, and otherwise scheduled for
    one more, wasted, verify of k placeholder drafts (the scheduler's rule); its slot and
    blocks go once the step is scheduled (``apply_pending``).
    """
    scheduler = world.scheduler
    if not (scheduler.waiting or scheduler.finished_pending):
        return None
    running = scheduler.running
    k = scheduler.num_spec_tokens
    kv = scheduler.kv
    bs = kv.block_size
    held_map = kv.req_to_blocks
    lookahead = scheduler.num_lookahead_tokens
    max_model_len = scheduler.max_model_len
    threshold = scheduler.prefill_threshold()
    ds = []  # drafts to verify, per request (capped by max_model_len)
    allocs: list[Request] = []  # new blocks, by holder, in batch order
    prompt_ends = []  # requests that compute their prompt's last token in this step
    total = context = 0
    batch = []  # the running requests scheduled (async: all but those sure to have ended)
    for req in running:
        computed = req.num_computed_tokens
        out = req.num_output_tokens
        nt = req.num_prompt_tokens + out
        # (async: the last step's rejected drafts still count as computed when allocating)
        rejected = req.num_rejected_pending
        if req.status == _FINISHED_LENGTH_CAPPED:  # (async) finished by the last step
            if out - req.num_unapplied_tokens + 1 >= req.max_tokens:
                continue  # sure to have ended: not scheduled
            d = k  # a wasted verify of placeholder drafts
            if 1 + d > max_model_len - 1 - computed - rejected:
                return None  # cut: stepping's business
        else:
            if computed != nt - 1:
                return None
            if not out:
                prompt_ends.append(req)
            d = req.num_spec_tokens
            if d > max_model_len - nt - 1 - rejected:
                d = max_model_len - nt - 1 - rejected
                if d < 0:
                    return None  # not scheduled at all this step: stepping's business
        n = 1 + d
        if 0 < threshold < n:
            return None
        total += n
        context += computed + n
        need = computed + n + rejected + lookahead
        if need > max_model_len:
            need = max_model_len
        blocks = -(-need // bs) - len(held_map.get(req.request_id, ()))
        if blocks > 0:
            allocs += [req] * blocks
        ds.append(d)
        batch.append(req)
    if total > scheduler.max_num_batched_tokens or len(allocs) > kv.num_free_blocks:
        return None
    if allocs:
        kv.append_blocks(allocs)
    for req in prompt_ends:  # its prompt's last block, full: an admitted request may hit it
        kv.cache_blocks(req, req.num_prompt_tokens)
    if scheduler.async_scheduling:
        # Each allocation commits the full blocks of the tokens applied by then, which a
        # release with tokens pending may not reach later: committed here, as allocate_slots
        # does (synchronous, a release commits at least as far).
        for req in batch:
            kv.cache_blocks(req, req.num_prompt_tokens + req.num_output_tokens - req.num_unapplied_tokens)
    for req, d in zip(batch, ds):
        if d < req.num_spec_tokens:
            req.num_spec_tokens = d  # drafts past max_model_len are dropped
    n = len(batch)
    return scheduler.admit_after_running(SchedulerOutput(
        reqs=batch, num_scheduled_tokens=[1 + d for d in ds], num_scheduled_spec_tokens=ds,
        total_num_scheduled_tokens=total, num_decode_reqs=n, num_decode_tokens=n,
        num_verify_tokens=total - n, num_context_tokens=context,
    ))


def first_chunks(
    reqs: list[Request], news: list[int], first: float, last: float, gaps: list[float],
    gap_tokens: list[int],
) -> None:
    """Each request's first chunk of a stretch at ``first`` (``news[b]`` tokens to
    ``reqs[b]``) and its last at ``last``: the gap from a request's previous token to the
    first, with that chunk's tokens, joins ``gaps`` and ``gap_tokens``; the requests' token
    times are written."""
    for b in range(len(reqs)):
        req = reqs[b]
        if req.first_token_ts is None:
            req.first_token_ts = first
        else:
            gaps.append(first - req.last_token_ts)
            gap_tokens.append(news[b])
        req.last_token_ts = last


def count_accepted(accepted_hist: list[int], news: list[int]) -> None:
    """Add steps' tokens per request (``news``: accepted drafts + 1 each) to the histogram
    of accepted drafts: ``accepted_hist[a]`` counts those that accepted ``a >= 1``. One
    pass over them (C integers when compiled)."""
    counts = _NO_COUNTS * (len(accepted_hist) + 1)
    c = counts  # (a typed memoryview when compiled)
    for x in news:
        c[x] += 1
    for a in range(1, len(accepted_hist)):
        accepted_hist[a] += c[a + 1]


class VerifyStretch:
    """A stretch of verify steps while it runs: per request (in batch order) its tokens,
    output tokens, blocks and drafts, as plain integers; the steps run so far (periods,
    start times, KV usages as runs, tokens emitted); the blocks taken and the streams' read
    positions. The scheduled step not yet run is ``ds`` (drafts per request), ``verify``
    (their sum), ``context`` (attended tokens) and ``prefill`` (prompt tokens), and ``out``
    its :class:`SchedulerOutput` (the caller's first step, or made when a step runs one at a
    time)."""

    __slots__ = (
        "world", "reqs", "num_reqs", "num_waiting", "nts", "outs", "maxes", "proposed",
        "matches", "max_model_len", "k", "rate", "drafts_all", "per_request", "onset", "tail",
        "acceptance", "accept_stream", "tb", "u0", "ui", "propose_stream", "pb", "p0", "pi",
        "neg_rates", "accepted_hist", "num_drafts", "num_draft_tokens", "threshold", "budget",
        "lookahead", "bs", "held", "limits", "free", "scale", "allocs", "model", "noise",
        "starts", "periods", "usages", "counts", "news_all", "t", "finished", "last_tokens",
        "bulk", "full", "ds", "verify", "context", "prefill", "out", "verify_out", "prompt_ends",
        "first", "flushed", "asynchronous", "rejected", "unapplied", "positions",
    )

    @classmethod
    def begin(cls, world, now: float, first: SchedulerOutput | None) -> "VerifyStretch | None":
        """The stretch from ``now`` (see :func:`advance_verify_stretch`), or None when the
        engine is not in a state it covers."""
        scheduler = world.scheduler
        running: list[Request] = scheduler.running
        num_reqs = len(running)
        num_waiting = len(scheduler.waiting)
        if not num_reqs or (num_waiting and num_reqs < scheduler.max_num_seqs):
            return None
        acceptance = world.acceptance
        if not acceptance.non_increasing:
            return None
        # Each request's tokens before the first step's update; every one samples in it.
        nts = []
        if first is None:
            reqs = list(running)
            for req in reqs:
                nt = req.num_prompt_tokens + req.num_output_tokens
                if req.num_computed_tokens != nt - 1:
                    return None
                nts.append(nt)
        else:
            reqs = first.reqs
            specs = first.num_scheduled_spec_tokens
            if first.preempted_reqs or first.spec_padded_reqs:
                return None  # (padded drafts are never accepted: stepping's business)
            positions = None
            if len(reqs) != num_reqs:
                # (async) the step after a finish: the requests it finished have a wasted
                # verify in it and have left RUNNING since; the others must be all of it.
                if not scheduler.async_scheduling:
                    return None
                positions = [i for i, req in enumerate(reqs) if not req.is_finished]
                if len(positions) != num_reqs:
                    return None
                reqs = [reqs[i] for i in positions]
                specs = [specs[i] for i in positions]
            for req, spec in zip(reqs, specs):
                nt = req.num_prompt_tokens + req.num_output_tokens
                if req.num_computed_tokens - spec != nt:
                    return None  # a prompt chunk that does not complete: no token this step
                nts.append(nt)
        self = cls()
        self._start(world, now, first, reqs, nts, num_waiting)
        if first is not None and positions is not None:
            self.positions = positions
            self.ds = specs
        return self

    def _start(self, world, now: float, first: SchedulerOutput | None, reqs: list[Request],
               nts: list[int], num_waiting: int) -> None:
        """Set up the stretch that :meth:`begin` found covered: ``reqs`` (in batch order) with
        ``nts`` tokens each, ``num_waiting`` waiting."""
        scheduler = world.scheduler
        num_reqs = len(reqs)
        acceptance = world.acceptance
        self.world = world
        self.reqs = reqs
        self.num_reqs = num_reqs
        self.num_waiting = num_waiting
        self.nts = nts
        outs = self.outs = [req.num_output_tokens for req in reqs]
        # Whether a request's first step here computes its prompt's last token (see apply).
        self.prompt_ends = first is None and 0 in outs
        self.maxes = [req.max_tokens for req in reqs]
        max_model_len = self.max_model_len = scheduler.max_model_len

        proposer = world.proposer
        k = self.k = proposer.k
        rate = self.rate = proposer.proposal_rate
        drafts_all = self.drafts_all = rate >= 1.0  # EAGLE: every request that sampled drafts k
        # ngram with a match probability per request (drawn from its content, in any order).
        per_request = self.per_request = proposer.per_request
        self.matches = [proposer.match_probability(req) for req in reqs] if per_request else []
        self.onset = onset = proposer.onset  # ngram: no drafts before this many output tokens
        # Uniforms are read from the streams' buffers in order (reserved when first needed)
        # and used up at the end (or when a buffer runs out): acceptance, one per request in
        # steps with drafts, read as the tokens each emits (AcceptanceModel.reserve_tokens);
        # proposals (ngram), one per request in every step.
        self.acceptance = acceptance
        stream = self.accept_stream = acceptance.uniforms
        if acceptance.tokens_of is stream.array:  # the table of the stream's buffer, as is
            self.tb = acceptance.tokens
            self.u0 = self.ui = stream.next
        else:
            self.tb = []
            self.u0 = self.ui = 0
        self.propose_stream = proposer.uniforms
        self.pb = []
        self.p0 = self.pi = 0
        # accepted = #{i < d : u < r_i}; rates never rise, so that is min(d, rates above u).
        self.neg_rates = acceptance.neg_rates
        self.accepted_hist = [0] * (k + 1)  # verifying requests by accepted count
        self.num_drafts = self.num_draft_tokens = 0

        # Steps are scheduled as stepping would: 1 + drafts tokens per request within the
        # budget and the prefill threshold (both fixed while the batch is), and blocks for
        # tokens + drafts + lookahead slots (up to max_model_len).
        self.threshold = scheduler.prefill_threshold()
        self.budget = scheduler.max_num_batched_tokens
        lookahead = self.lookahead = scheduler.num_lookahead_tokens
        kv = scheduler.kv
        bs = self.bs = kv.block_size
        held_map = kv.req_to_blocks
        held = self.held = [len(held_map[req.request_id]) for req in reqs]
        # A step needs a block when its tokens + drafts pass a request's limit.
        self.limits = [h * bs - lookahead for h in held]
        self.free = kv.num_free_blocks
        self.scale = kv.num_blocks - 1
        self.allocs = []  # the blocks the stretch takes, by holder, in order taken

        self.model = world.step_model
        noise = self.noise = world.noise
        self.starts = array("d", [now])  # (taken as a block by the log and the gaps)
        self.periods = []
        # KV usage after each step's scheduling, as runs: counts[i] steps of usages[i] in turn.
        self.usages = [] if first is None else [kv.usage]
        self.counts = [] if first is None else [1]
        self.news_all = []  # tokens per request per step (step-major)
        self.t = now
        self.finished = {}  # batch index -> computed tokens after its last step
        self.last_tokens = [1] * num_reqs  # each request's accepted drafts + 1 in the last step
        # Plain steps (every request verifies k drafts, none finishes, no draft or block is
        # capped by max_model_len) run in bulk when no noise and no proposal draws are in
        # play; a plain step follows up to `tail` tokens.
        self.bulk = drafts_all and not onset and noise is None
        self.full = num_reqs * k
        self.tail = min(max_model_len - 1 - k, max_model_len - k - self.lookahead)
        self.verify_out = None
        self.out = self.first = first
        self.flushed = False  # a span's segment has been written (see go_on)
        # (async) the first step's batch position of each request when that step also holds
        # wasted verifies (see begin): they draw acceptance, nothing else
        self.positions = None
        # Async scheduling: a step's allocations still count the drafts the step before
        # rejected (each request's, below), so a plain step follows up to k tokens fewer;
        # the stretch ends at its first finish (see flush).
        asynchronous = self.asynchronous = scheduler.async_scheduling
        self.rejected = [
            req.num_rejected_pending if asynchronous and first is None else 0 for req in reqs
        ]
        # (async) the tokens the step before the stretch sampled, not yet applied when the
        # stretch's first step allocates (None: the scheduler scheduled that step)
        self.unapplied = [req.num_unapplied_tokens for req in reqs] if asynchronous and first is None else None
        if asynchronous:
            self.tail -= k
        if first is None:
            self.proposed = [req.num_spec_tokens for req in reqs]  # drafts, before any cap
        else:
            self.ds = first.num_scheduled_spec_tokens  # the step's drafts, per request
            self.verify = first.num_verify_tokens
            self.context = first.num_context_tokens
            self.prefill = first.num_prefill_tokens

    def schedule(self) -> bool:
        """Schedule the next step: drafts capped by max_model_len, then the budget, the
        threshold, and the blocks for 1 + drafts + lookahead slots. False (nothing changed)
        when it does not fit: stepping would schedule it otherwise, or preempt."""
        nts = self.nts
        proposed = self.proposed
        limits = self.limits
        rejected = self.rejected
        num_reqs = self.num_reqs
        max_model_len = self.max_model_len
        ds = []
        grow = []
        verify = 0
        for b in range(num_reqs):
            nt = nts[b]
            r = rejected[b]
            d = proposed[b]
            if d > max_model_len - nt - 1 - r:
                d = max_model_len - nt - 1 - r
                if d < 0:
                    return False  # not scheduled at all this step: stepping's business
            ds.append(d)
            verify += d
            if nt + d + r > limits[b]:
                grow.append(b)
        threshold = self.threshold
        if num_reqs + verify > self.budget or (threshold and verify and max(ds) >= threshold):
            return False
        if grow:
            held = self.held
            bs = self.bs
            lookahead = self.lookahead
            reqs = self.reqs
            need_blocks = 0
            step_allocs = []
            for b in grow:
                need = nts[b] + ds[b] + rejected[b] + lookahead
                if need > max_model_len:
                    need = max_model_len
                blocks = -(-need // bs) - held[b]
                if blocks > 0:
                    need_blocks += blocks
                    step_allocs += [reqs[b]] * blocks
            if need_blocks > self.free:
                return False  # stepping would preempt: the reference path's business
            self.free -= need_blocks
            for b in grow:
                need = nts[b] + ds[b] + rejected[b] + lookahead
                if need > max_model_len:
                    need = max_model_len
                blocks = -(-need // bs)
                if blocks > held[b]:
                    held[b] = blocks
                    limits[b] = blocks * bs - lookahead
            self.allocs += step_allocs
        usage = 1.0 - self.free / self.scale
        usages = self.usages
        if usages and usages[-1] == usage:
            self.counts[-1] += 1
        else:
            usages.append(usage)
            self.counts.append(1)
        self.ds = ds
        self.verify = verify
        self.context = sum(nts) + verify
        self.prefill = 0
        self.out = None
        return True

    def run_bulk(self, horizon: float) -> bool:
        """Run the scheduled step (every request verifies k drafts) and those after it in
        bulk, while they are plain. Request b's accepted counts come from column b of the
        acceptance stream (one uniform per request per step); its tokens after each step
        are their running sum. True when the stretch ends with the last step run here (a
        finish, the horizon, the pool); otherwise the next step is scheduled (a capped one,
        or the first past the drawn margin) for :meth:`run_step`. (One long method on
        purpose: the verify stretch's inner loop, where a call per step costs more than the
        step's own arithmetic.)"""
        nts = self.nts
        outs = self.outs
        maxes = self.maxes
        num_reqs = self.num_reqs
        max_model_len = self.max_model_len
        k = self.k
        full = self.full
        model = self.model
        t = self.t
        acceptance = self.acceptance
        # Each request finishes within m steps: m = the fewest tokens any has left.
        m = max_model_len
        for b in range(num_reqs):
            room = maxes[b] - outs[b]
            if room > max_model_len - nts[b]:
                room = max_model_len - nts[b]
            if room < m:
                m = room
        # The first finish comes after about m / mean_tokens steps: draw for a margin over
        # that, not for m one-token steps (a bulk that ends at its m-th step is followed by a
        # step run one at a time, then by the next bulk).
        m = min(m, int(m / acceptance.mean_tokens * 1.15) + 3)
        context = self.context
        # Without a context term every step of the bulk has the same period.
        by_context = model.periods_depend_on_context
        p = None
        if model.decode_nondecreasing and horizon < math.inf:
            # Periods never shrink here: no more steps than this start before the horizon.
            p = model.verify_periods(num_reqs, full, (context,))[0]
            if p > 0 and horizon - t < p * m:
                m = min(m, int((horizon - t) / p) + 2)
        if m < 2:
            return False
        size = num_reqs * m
        tb = self.tb
        ui = self.ui
        if ui + size > len(tb):  # (else the stream's buffer holds them from ui on)
            self.accept_stream.advance(ui - self.u0)
            tb, ui = acceptance.reserve_tokens(size)
            self.tb = tb
            self.u0 = self.ui = ui
        # Tokens per request per step (step-major): accepted + 1.
        news = tb[ui : ui + size]
        fin = cap = m  # the first step in which one finishes; after which one caps
        tail = self.tail
        # Request b's tokens after step i, at cums[b * m + i] (C integers when compiled).
        cums = _NO_COUNTS * size
        cv = cums  # (a typed memoryview when compiled)
        for b in range(num_reqs):
            row = b * m
            grown = 0
            for i in range(m):
                grown += news[i * num_reqs + b]
                cv[row + i] = grown
            nt = nts[b]
            room = maxes[b] - outs[b]
            if room > max_model_len - nt:
                room = max_model_len - nt
            hi = fin + 1 if fin < m else m
            i = 0
            while i < hi and cv[row + i] < room:  # the first step that reaches room
                i += 1
            if i < fin:
                fin = i
            over = tail - nt
            i = 0
            while i < cap and cv[row + i] <= over:  # the first step that takes it past tail
                i += 1
            if i < cap:
                cap = i
        # Blocks for the steps that plain steps schedule (request b's step after step i
        # needs its tokens + k + lookahead slots), in (step, batch) order. Async: + the k -
        # accepted drafts step i rejected, so tokens before step i + 2k + 1 (+ lookahead).
        plain = fin if fin < cap else cap
        limits = self.limits
        bs = self.bs
        asynchronous = self.asynchronous
        events = []
        if plain:
            last = plain - 1
            for b in range(num_reqs):
                row = b * m
                i = 0
                if not asynchronous:
                    top = cv[row + last]  # its tokens after the last plain step
                    h = limits[b] - nts[b] - k
                    while h < top:  # the step after the first that takes it past h needs a block
                        while cv[row + i] <= h:
                            i += 1
                        events.append(i * num_reqs + b)
                        h += bs
                    continue
                # (the step after step i needs a block per bs that its tokens before step i
                # pass: 0 before step 0, then cv[row + i - 1])
                top = cv[row + last - 1] if last else 0
                h = limits[b] - nts[b] - 2 * k - 1
                while h < top or h < 0:
                    while i and cv[row + i - 1] <= h or not i and h >= 0:
                        i += 1
                    events.append(i * num_reqs + b)
                    h += bs
        events.sort()
        kv_stop = m
        free = self.free
        if len(events) > free:
            kv_stop = events[free] // num_reqs  # scheduling its successor would preempt
        stop = min(fin, cap, kv_stop)
        # Periods and start times up to the last step that may run; step i attends the
        # context before it plus the tokens of steps 0..i-1.
        priced = stop + 1 if stop < m else m
        if by_context:
            contexts = list(accumulate(
                map(sum, zip(*[iter(news[: priced * num_reqs])] * num_reqs)), initial=context
            ))
            bulk_periods = model.verify_periods(num_reqs, full, contexts[:priced])
        else:
            if p is None:
                p = model.verify_periods(num_reqs, full, (context,))[0]
            bulk_periods = [p] * priced
        # The first step to end at or after the horizon (priced when none does): the bulk's
        # starts are cut after it.
        bulk_starts = decode_starts(bulk_periods, t, horizon, 1)
        late = (len(bulk_starts) - 2 if len(bulk_starts) <= priced or bulk_starts[-1] >= horizon
                else priced)
        if late < priced and late < stop:
            stop = late
        # What ends the bulk: a finish, the horizon or the pool (that step runs and the
        # stretch ends with it), a cap (that step runs one at a time), or m.
        ends = stop < m and (stop == fin or stop == late or stop == kv_stop)
        ran = stop + 1 if ends else stop  # steps run here
        if not ran:
            return False
        scheduled = ran - 1 if ends else ran  # of them, those that schedule the next
        size = num_reqs * ran
        self.ui = ui + size
        self.num_drafts += size
        self.num_draft_tokens += full * ran
        if size < len(news):
            del news[size:]
        count_accepted(self.accepted_hist, news)
        self.last_tokens = news[size - num_reqs : size]  # (before a finish cuts them)
        if asynchronous:  # the drafts the last step rejected
            self.rejected = [k + 1 - x for x in self.last_tokens]
        if ends and stop == fin:
            finished = self.finished
            before = fin - 1
            for b in range(num_reqs):
                row = b * m
                done = cv[row + before] if fin else 0
                room = maxes[b] - outs[b]
                if room > max_model_len - nts[b]:
                    room = max_model_len - nts[b]
                if cv[row + fin] >= room:  # it finishes: tokens past the end are cut
                    i = fin * num_reqs + b
                    finished[b] = nts[b] + done + news[i] - 1
                    news[i] = room - done
                    cv[row + fin] = room
        grown_all = 0
        if ends:  # (the blocks held matter only to steps scheduled after these)
            for b in range(num_reqs):
                grown = cv[b * m + ran - 1]
                nts[b] += grown
                outs[b] += grown
        else:
            held = self.held
            lookahead = self.lookahead
            last = scheduled - 1  # the last step here that schedules the next
            for b in range(num_reqs):
                row = b * m
                nt = nts[b]
                if scheduled:  # its blocks for the step after step `last` (its events)
                    if asynchronous:
                        blocks = -(-(nt + (cv[row + last - 1] if last else 0) + 2 * k + 1 + lookahead) // bs)
                    else:
                        blocks = -(-(nt + cv[row + last] + k + lookahead) // bs)
                    if blocks > held[b]:
                        held[b] = blocks
                        limits[b] = blocks * bs - lookahead
                grown = cv[row + ran - 1]
                grown_all += grown
                nts[b] = nt + grown
                outs[b] += grown
        self.news_all += news
        del events[bisect_left(events, scheduled * num_reqs) :]
        usages = self.usages
        counts = self.counts
        if events:
            runs, runs_counts, self.free = usage_runs_by_step(
                events, num_reqs, scheduled, free, self.scale
            )
            if usages and usages[-1] == runs[0]:  # the run before goes on
                counts[-1] += runs_counts[0]
                del runs[0], runs_counts[0]
            usages += runs
            counts += runs_counts
            reqs = self.reqs
            allocs = self.allocs
            for e in events:
                allocs.append(reqs[e % num_reqs])
        elif scheduled:
            usage = 1.0 - free / self.scale
            if usages and usages[-1] == usage:
                counts[-1] += scheduled
            else:
                usages.append(usage)
                counts.append(scheduled)
        self.periods += bulk_periods[:ran]
        self.starts += bulk_starts[1 : ran + 1]
        self.t = bulk_starts[ran]
        if ends:
            self.proposed = [k] * num_reqs
            return True
        self.ds = [k] * num_reqs
        self.verify = full
        self.context = context + grown_all
        self.prefill = 0
        self.out = None
        return False

    def run_step(self, horizon: float) -> bool:
        """Run the scheduled step: price it, then its result (accepted drafts, tokens,
        finishes) and the next drafts. True when the stretch ends with it (a finish, or it
        ends at or after ``horizon``)."""
        out = self.out
        num_reqs = self.num_reqs
        ds = self.ds
        if out is None:
            out = self.verify_out
            if out is None:
                out = self.verify_out = SchedulerOutput(
                    reqs=self.reqs, num_decode_reqs=num_reqs, num_decode_tokens=num_reqs
                )
            out.num_scheduled_spec_tokens = ds
            out.total_num_scheduled_tokens = num_reqs + self.verify
            out.num_verify_tokens = self.verify
            out.num_context_tokens = self.context
        model = self.model
        noise = self.noise
        p = model.step_period(out) if noise is None else noise.step_period(model, out)
        self.periods.append(p)
        t = self.t = self.t + p
        self.starts.append(t)
        verifying = out.num_verify_tokens
        tb = self.tb
        base = 0
        positions = self.positions
        if verifying:
            # One uniform per request of the batch (the wasted verifies of a step after a
            # finish too: positions), in batch order, as stepping draws them.
            drawn = num_reqs if positions is None else len(out.reqs)
            ui = self.ui
            if ui + drawn > len(tb):
                self.accept_stream.advance(ui - self.u0)
                tb, ui = self.acceptance.reserve_tokens(drawn)
                self.tb = tb
                self.u0 = ui
            base = ui
            self.ui = ui + drawn
            self.num_drafts += num_reqs - ds.count(0)
            self.num_draft_tokens += verifying if positions is None else sum(ds)
        k = self.k
        if self.drafts_all:
            proposed = [k] * num_reqs
        else:
            pb = self.pb
            pi = self.pi
            if pi + num_reqs > len(pb):
                self.propose_stream.advance(pi - self.p0)
                pb, pi = self.propose_stream.reserve(num_reqs)
                self.pb = pb
                self.p0 = pi
            ps = pb[pi : pi + num_reqs]
            self.pi = pi + num_reqs
            if self.per_request:
                proposed = [k if u < r else 0 for u, r in zip(ps, self.matches)]
            else:
                rate = self.rate
                proposed = [k if u < rate else 0 for u in ps]
        accepted_hist = self.accepted_hist
        last_tokens = self.last_tokens
        outs = self.outs
        nts = self.nts
        maxes = self.maxes
        max_model_len = self.max_model_len
        finished = self.finished
        news_all = self.news_all
        rejected = self.rejected if self.asynchronous else None
        for b in range(num_reqs):
            d = ds[b]
            if d:
                a = tb[base + (b if positions is None else positions[b])] - 1
                if a > d:
                    a = d
                accepted_hist[a] += 1
            else:
                a = 0
            if rejected is not None:
                rejected[b] = d - a
            new = a + 1
            last_tokens[b] = new
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
        onset = self.onset
        if onset:
            proposed = [d if o >= onset else 0 for d, o in zip(proposed, outs)]
        self.proposed = proposed
        self.positions = None
        return bool(finished) or t >= horizon

    def go_on(self, horizon: float) -> bool:
        """In a span (see :func:`advance_verify_stretch`), after a step in which requests
        finished: when the engine would go on stepping the batch without them (the step
        ends before ``horizon``, nothing waits, some request still runs, no stop rule is due
        to be checked), write the segment (:meth:`flush`), report the finished requests at
        its end and carry the survivors on as the next segment's batch; True then. False
        (nothing changed) otherwise: the stretch ends with this step."""
        finished = self.finished
        t = self.t
        if (not finished or t >= horizon or self.num_waiting or len(finished) == self.num_reqs
                or self.asynchronous):
            return False
        world = self.world
        stop = world.stop
        if stop is not None and t >= stop.next_check:
            return False
        finishing = self.flush()
        self.flushed = True
        world.finish(finishing, t)
        # The survivors, in batch order (as Scheduler.running holds them now).
        gone = sorted(finished, reverse=True)
        self.reqs = [req for b, req in enumerate(self.reqs) if b not in finished]
        lists = [self.nts, self.outs, self.maxes, self.last_tokens, self.proposed]
        if self.per_request:
            lists.append(self.matches)
        for values in lists:
            for b in gone:
                del values[b]
        num_reqs = self.num_reqs = len(self.reqs)
        self.full = num_reqs * self.k
        self.finished = {}
        self.verify_out = None
        scheduler = world.scheduler
        kv = scheduler.kv
        # The blocks each holds, now handed out (a bulk that ends at a finish leaves them).
        held_map = kv.req_to_blocks
        held = self.held = [len(held_map[req.request_id]) for req in self.reqs]
        bs = self.bs
        lookahead = self.lookahead
        self.limits = [h * bs - lookahead for h in held]
        self.free = kv.num_free_blocks  # (theirs are back)
        self.threshold = scheduler.prefill_threshold()  # (a lone request may be exempt)
        return True

    def flush(self) -> list[Request]:
        """Hand out the blocks taken so far; write the steps run since the last flush into
        the step log and the stream chunks, and the requests that finished in the last of
        them; release those (``Scheduler.finish_requests``) and return them, in batch order.
        The steps' lists are emptied for a next segment from the last step's end."""
        world = self.world
        scheduler = world.scheduler
        reqs = self.reqs
        num_reqs = self.num_reqs
        asynchronous = self.asynchronous
        if asynchronous:
            news_all = self.news_all
            last_news = news_all[-num_reqs:]  # each request's tokens in the last step
            # and in the step before it: not yet applied when the last step allocated
            before_news = (news_all[-2 * num_reqs : -num_reqs] if len(news_all) >= 2 * num_reqs
                           else self.unapplied)
        self.hand_out()
        if self.periods:
            starts = self.starts
            log_stretch(
                world.steps, self.first, starts, self.periods, self.usages, self.counts,
                self.num_reqs, self.num_waiting,
            )
            self.first = None
            world.emit_steps(reqs, starts, self.news_all)
            self.starts = array("d", [self.t])
            self.periods = []
            self.usages = []
            self.counts = []
            self.news_all = []
        finishing = []
        finished = self.finished
        if finished:
            outs = self.outs
            last_tokens = self.last_tokens
            for b in sorted(finished):
                req = reqs[b]
                req.num_output_tokens = outs[b]
                req.is_prefill_chunk = False
                # The last step's accepted drafts: their blocks are cached at the next allocation.
                req.num_accepted_uncommitted = last_tokens[b] - 1
                req.num_computed_tokens = finished[b]
                req.num_spec_tokens = 0
                finishing.append(req)
        if asynchronous:
            # What the stretch's first step applied, and what its last step leaves pending
            # until the next schedule: each request's tokens and rejected drafts (a stretch
            # under async scheduling is flushed once, at its end; every request sampled).
            scheduler.apply_tokens()
            scheduler.hold_tokens(reqs, last_news, self.rejected)
            if before_news is not None:
                # The last step's allocation committed each request's full blocks of the
                # tokens applied by then (allocate_slots), which a release with tokens
                # pending may not reach later: committed here, as it did.
                kv = scheduler.kv
                nts = self.nts
                for b in range(num_reqs):
                    kv.cache_blocks(reqs[b], nts[b] - last_news[b] - before_news[b])
        if finishing:
            scheduler.finish_requests(finishing)
        return finishing

    def hand_out(self) -> None:
        """Hand out the blocks the stretch has taken so far, in the order taken. (Before the
        requests' state is written.)"""
        kv = self.world.scheduler.kv
        if self.allocs:
            kv.append_blocks(self.allocs)
            self.allocs = []
        if self.prompt_ends:
            # A request whose first step computed its prompt's last token: that step's
            # allocate_slots commits the prompt's last block if it filled (a scheduled first
            # step made that call already). Blocks filled later hold its own output tokens:
            # committed when it next allocates or is released, as no other request can hit
            # them while it runs.
            for req in self.reqs:
                if not req.num_output_tokens:
                    kv.cache_blocks(req, req.num_prompt_tokens)
            self.prompt_ends = False

    def apply(self) -> tuple[float, list[Request]] | None:
        """Hand out the blocks, write the requests' state, the counters, the step log, the
        stream chunks and the finishes; the stretch's end time and the requests that
        finished in its last step. None (nothing changed) when no step ran."""
        if not self.periods and not self.flushed:
            return None  # the first step could not be scheduled here: nothing changed
        self.accept_stream.advance(self.ui - self.u0)
        if not self.drafts_all:
            self.propose_stream.advance(self.pi - self.p0)
        self.hand_out()
        world = self.world
        outs = self.outs
        nts = self.nts
        last_tokens = self.last_tokens
        finished = self.finished
        proposed = self.proposed
        for b, req in enumerate(self.reqs):
            if b in finished:  # (written by flush)
                continue
            req.num_output_tokens = outs[b]
            req.is_prefill_chunk = False
            # The last step's accepted drafts: their blocks are cached at the next allocation.
            req.num_accepted_uncommitted = last_tokens[b] - 1
            req.num_computed_tokens = nts[b] - 1
            req.num_spec_tokens = proposed[b]  # (a step scheduled later caps them)
        if self.num_drafts:
            counters = world.spec_counters
            counters.num_drafts += self.num_drafts
            counters.num_draft_tokens += self.num_draft_tokens
            # Position i (0-based) is accepted by every request that accepted more than i.
            accepted_past = list(accumulate(self.accepted_hist[:0:-1]))[::-1]
            while accepted_past and not accepted_past[-1]:
                accepted_past.pop()
            per_pos = counters.accepted_per_pos
            if len(per_pos) < len(accepted_past):
                per_pos += [0] * (len(accepted_past) - len(per_pos))
            for i, count in enumerate(accepted_past):
                per_pos[i] += count
            counters.num_accepted_tokens += sum(accepted_past)
        return self.t, self.flush()
