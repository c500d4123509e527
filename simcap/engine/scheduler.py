"""The vLLM V1 scheduler as a pure, time-free state machine.

Models ``vllm/v1/core/sched/scheduler.py`` of vLLM 0.32 by default; the behaviours that differ
in the field's older releases are switches in :class:`SchedulerFeatures`, chosen by
``engine.vllm_version`` (and overridable one by one).

One rule, not phases: every step gives each request tokens so that ``num_computed_tokens``
catches up with ``num_tokens_with_spec``. A request still reading its prompt simply gets a
large ``n``; a decoding one gets ``1 + num_spec_tokens``. Within one step:

1. RUNNING requests, in admission order, while the token budget lasts. When the KV pool
   cannot hold a request's new tokens, the last admitted running request is preempted
   (its blocks freed, ``num_computed_tokens = 0``, back to the head of the queue), until the
   allocation fits or the request preempted itself.
2. WAITING requests, in queue order, only if nothing was preempted in (1), while the budget
   lasts and fewer than ``max_num_seqs`` run. The head of the queue blocks the rest when it
   does not fit (no skipping).

``schedule()`` returns a :class:`SchedulerOutput` and advances ``num_computed_tokens`` at once;
``update_from_output()`` then appends the sampled tokens, rolls back rejected drafts and
finishes requests. Nothing here knows about time: the caller prices a step with the step-time
model and moves a clock.

**Async scheduling** (``async_scheduling=True``, vLLM's ``AsyncScheduler``): step n+1 is
scheduled before step n's output is applied. The sampled tokens are placeholders then, which
gives every request the same tokens as the synchronous order; what differs is that a request
that finished in step n is still RUNNING when step n+1 is scheduled: vLLM skips it (it has
reached ``max_tokens``) but it keeps its running slot and its KV blocks until step n's output
is applied, after that schedule. So here ``update_from_output`` marks it finished and leaves it
in RUNNING (``finished_pending``), the next schedule skips it, and releases it at its end
(:meth:`apply_pending`): admissions that its slot or blocks held back come a step later. Likewise
the tokens a step sampled are not yet known to vLLM when the next step allocates, so that
allocation caches no block they fill (``Request.num_unapplied_tokens``). A finishing request
that must give up its blocks as a preemption victim is reported preempted (no admission that
step), as vLLM does. With drafts, vLLM cannot know at the next schedule that the drafts
finished a request (all might have been rejected): unless the bonus token alone ends it, it
gets one more decode step with placeholder drafts, wasted; and that schedule's allocations
still count the last step's rejected drafts (``Request.num_rejected_pending``). The simulator
runs this order too (its fast paths stop at each finish; the step after it is the
scheduler's: :meth:`schedule`, or for decoders :meth:`schedule_decoders_and_admit`), and
prices async timing in the step-time model. Whether an engine runs async is vLLM's choice
(:func:`resolve_async_scheduling`).

**Prefill cadence** (``prefill_schedule_interval`` N > 1, vLLM 0.32 with data parallelism):
see :meth:`Scheduler.defers_prefills`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

from simcap.engine.kv_cache import KVCacheManager
from simcap.engine.request import Request, RequestStatus


class SchedulerSettings(Protocol):
    """The engine flags the scheduler reads, under vLLM's names (its ``SchedulerConfig`` and
    ``CacheConfig``); a scenario's ``engine`` section (:class:`simcap.config.scenario.EngineConfig`)
    is one."""

    vllm_version: str
    scheduler_reserve_full_isl: bool | None
    async_scheduling: bool | None
    prefill_schedule_interval: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int
    block_size: int
    num_blocks: int
    watermark: float
    enable_prefix_caching: bool

# (module constants: an enum member read through its class costs more than the rest of a
# status change)
_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_FINISHED_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED


@dataclass(frozen=True)
class SchedulerFeatures:
    """Scheduler behaviours that changed between vLLM releases (read from each release's source)."""

    # Admission from WAITING needs KV blocks for the whole prompt, not just its first chunk
    # (``scheduler_reserve_full_isl``, 0.19+).
    reserve_full_isl: bool
    # An admission watermark exists (0.24+; default 0.0).
    has_watermark: bool
    # long_prefill_token_threshold is ignored when running + waiting <= 1 (0.31+).
    threshold_exempts_single_request: bool
    # Freed blocks without a cached hash go to the HEAD of the free queue (0.24+); before,
    # every freed block went to the tail.
    free_unhashed_first: bool
    # Prefix-cache queries/hits are counted once per admission (0.27+), not per lookup.
    prefix_stats_at_admission: bool
    # Async scheduling is on by default on GPUs (0.14+); the CPU platform forces it off.
    async_scheduling_default: bool
    # Under speculation, a request admitted with one token left is padded to 1 + k tokens
    # (placeholder drafts) when no running request prefills (between 0.23 and 0.26).
    pad_waiting_spec_decode: bool

    @classmethod
    def for_engine(cls, engine: SchedulerSettings) -> "SchedulerFeatures":
        defaults = VERSION_FEATURES[engine.vllm_version]
        reserve = engine.scheduler_reserve_full_isl
        if reserve is None:
            return defaults
        return replace(defaults, reserve_full_isl=reserve)


VERSION_FEATURES: dict[str, SchedulerFeatures] = {
    "0.11": SchedulerFeatures(False, False, False, False, False, False, False),
    "0.23": SchedulerFeatures(True, False, False, False, False, True, False),
    "0.26": SchedulerFeatures(True, True, False, True, False, True, True),
    "0.32": SchedulerFeatures(True, True, True, True, True, True, True),
}


def resolve_async_scheduling(engine: SchedulerSettings, speculative_method: str | None = None) -> bool:
    """Whether the engine schedules asynchronously, as vLLM decides (``VllmConfig``, 0.32):
    ``async_scheduling`` as given; unset, on where the release turns it on by default
    (0.14+, :class:`SchedulerFeatures`) unless the drafts are ngram's, whose proposer runs on
    the CPU between steps (vLLM turns async off for it and refuses it when asked). The CPU
    platform always runs without it; its scenarios say ``async_scheduling: false``."""
    given = engine.async_scheduling
    if given is not None:
        return given
    if speculative_method == "ngram":
        return False
    return VERSION_FEATURES[engine.vllm_version].async_scheduling_default


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes; the step-time model prices it from the summary counts."""

    # Scheduled requests in batch order, with the tokens each computes this step.
    reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Of those tokens, how many are drafts to verify (0 without speculation).
    num_scheduled_spec_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Requests computing prompt (or recomputing after preemption) tokens, and those tokens.
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0
    # Requests computing only their last sampled token (+ drafts); one token each.
    num_decode_reqs: int = 0
    num_decode_tokens: int = 0
    # Draft tokens verified in this forward pass (counted apart from decode tokens).
    num_verify_tokens: int = 0
    # KV tokens the batch attends to: sum over requests of context length after the step.
    num_context_tokens: int = 0
    # Causal (query, key) pairs of the prefill chunks: a chunk of n tokens after s computed
    # ones attends n*s + n*(n+1)/2 pairs (the roofline form's prefill attention FLOPs).
    num_prefill_pairs: int = 0
    # Requests admitted from WAITING this step (first scheduling or resumption).
    new_reqs: list[Request] = field(default_factory=list)
    # Requests preempted this step.
    preempted_reqs: list[Request] = field(default_factory=list)
    # Requests admitted from WAITING whose drafts are padding (vLLM's -1 placeholders,
    # never accepted): see ``Scheduler._schedule_waiting``.
    spec_padded_reqs: list[Request] = field(default_factory=list)

    def reject_padding(self, accepted: list[int]) -> list[int]:
        """``accepted`` (per request of the batch) with 0 for the padded requests' drafts."""
        if self.spec_padded_reqs:
            padded = set(map(id, self.spec_padded_reqs))
            for i, req in enumerate(self.reqs):
                if id(req) in padded:
                    accepted[i] = 0
        return accepted


@dataclass(slots=True)
class EngineOutput:
    """Tokens produced by one step: per request the count (a stream chunk), and who finished."""

    reqs: list[Request]
    num_new_tokens: list[int]
    finished: list[Request]


class Scheduler:
    """vLLM V1's FCFS scheduler over a :class:`KVCacheManager` (pure, no clock)."""

    def __init__(
        self, engine: SchedulerSettings, num_lookahead_tokens: int = 0, num_speculative_tokens: int = 0,
        async_scheduling: bool = False,
    ) -> None:
        self.config = engine
        self.async_scheduling = async_scheduling
        # Async scheduling: requests finished by the last update, still RUNNING with their blocks
        # until the next schedule has run, and the requests whose sampled tokens vLLM has not
        # applied yet then (see the module doc).
        self.finished_pending: list[Request] = []
        self.unapplied: list[Request] = []
        self.features = SchedulerFeatures.for_engine(engine)
        # Prefill cadence (``prefill_schedule_interval``, vLLM 0.32's data-parallel engine
        # core): the engine's steps since it was last idle, and whether the last step that
        # could admit left requests waiting (then no step defers).
        self.prefill_schedule_interval = engine.prefill_schedule_interval
        self.step_counter = 0
        self.prefill_capacity_bound = False
        self._defer_prefills = False
        self.max_num_seqs = engine.max_num_seqs
        self.max_num_batched_tokens = engine.max_num_batched_tokens
        self.max_model_len = engine.max_model_len
        self.long_prefill_token_threshold = engine.long_prefill_token_threshold
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_spec_tokens = num_speculative_tokens
        self.block_size = engine.block_size
        self.watermark_blocks = int(engine.watermark * engine.num_blocks)
        self.kv = KVCacheManager(
            engine.num_blocks,
            engine.block_size,
            engine.max_model_len,
            engine.enable_prefix_caching,
            free_unhashed_first=self.features.free_unhashed_first,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Fixed for the run, read at every admission: when the prefix-cache counters count
        # (at admission, 0.27+, or at every lookup), and whether admitted drafts may be padded.
        caching = self.kv.enable_caching
        self._stats_at_lookup = caching and not self.features.prefix_stats_at_admission
        self._stats_at_admission = caching and self.features.prefix_stats_at_admission
        self._may_pad = bool(num_speculative_tokens) and self.features.pad_waiting_spec_decode

    # ------------------------------------------------------------------ queue

    def add_request(self, request: Request) -> None:
        if not self.running and not self.waiting:
            self.step_counter = 0  # (an idle engine starts a new wave: its cadence restarts)
        request.status = _WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return len(self.running) > len(self.finished_pending) or bool(self.waiting)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        threshold = self.prefill_threshold()
        if self.prefill_schedule_interval > 1:
            self._defer_prefills = self.defers_prefills()
            self.step_counter += 1
        budget = self._schedule_running(out, self.max_num_batched_tokens, threshold)
        if not out.preempted_reqs:
            self._schedule_waiting(out, budget, threshold)
            if self.prefill_schedule_interval > 1 and not self._defer_prefills:
                self.prefill_capacity_bound = bool(self.waiting)
        self._advance(out)
        if self.unapplied or self.finished_pending:
            self.apply_pending()
        return out

    def schedule_decoders_and_admit(
        self, num_context_tokens: int, decoders: list[Request] | None = None
    ) -> SchedulerOutput:
        """:meth:`schedule` for a batch in which every running request decodes one token and
        the budget covers them all, with their allocations already made by the caller
        (``num_context_tokens``: the sum of their computed tokens). Admits from WAITING.
        ``decoders``: the running requests but those the last step finished (async), if any."""
        running = self.running if decoders is None else decoders
        n = len(running)
        out = SchedulerOutput(  # (positional, in field order: this runs at every admission)
            list(running), [1] * n, [0] * n, n, 0, 0, n, n, 0, num_context_tokens + n, 0, [], [], [],
        )
        self._schedule_waiting(out, self.max_num_batched_tokens - n, self.prefill_threshold())
        self._advance(out)
        if self.unapplied or self.finished_pending:
            self.apply_pending()
        return out

    def admit_after_running(self, out: SchedulerOutput) -> SchedulerOutput:
        """The rest of :meth:`schedule` when ``out`` holds the running requests as
        :meth:`_schedule_running` would have scheduled them (none preempted), their blocks
        allocated by the caller: admit from WAITING within the budget left, then advance."""
        self._schedule_waiting(
            out, self.max_num_batched_tokens - out.total_num_scheduled_tokens, self.prefill_threshold()
        )
        self._advance(out)
        if self.unapplied or self.finished_pending:
            self.apply_pending()
        return out

    def defers_prefills(self) -> bool:
        """vLLM 0.32's prefill cadence (``prefill_schedule_interval`` N > 1, the data-parallel
        engine core's ``_should_throttle_prefills`` and the scheduler's ``defer_prefills``):
        a step whose count since the engine was last idle is not a multiple of N computes no
        prefill (running prompt chunks wait, no waiting request is admitted that has a prompt
        to compute) while some running request decodes, unless the last step that admitted
        left requests waiting (capacity-bound: then every step admits)."""
        if self.step_counter % self.prefill_schedule_interval == 0 or self.prefill_capacity_bound:
            return False
        for req in self.running:
            if not req.is_prefill_chunk:
                return True
        return False

    def prefill_threshold(self) -> int:
        """``long_prefill_token_threshold`` as it applies to this step (0: no cap)."""
        threshold = self.long_prefill_token_threshold
        if threshold and self.features.threshold_exempts_single_request:
            if len(self.running) + len(self.waiting) <= 1:
                return 0
        return threshold

    def _advance(self, out: SchedulerOutput) -> None:
        # num_computed_tokens advances as soon as the step is scheduled (vLLM does the same).
        for req, n in zip(out.reqs, out.num_scheduled_tokens):
            req.num_computed_tokens += n
        if self.num_spec_tokens or self.prefill_schedule_interval > 1:
            for req in out.reqs:
                req.is_prefill_chunk = req.num_computed_tokens < req.num_prompt_tokens + req.num_output_tokens

    def _add(self, out: SchedulerOutput, req: Request, n: int, num_spec: int) -> None:
        out.reqs.append(req)
        out.num_scheduled_tokens.append(n)
        out.num_scheduled_spec_tokens.append(num_spec)
        out.total_num_scheduled_tokens += n
        computed = req.num_computed_tokens
        out.num_context_tokens += computed + n
        # (>=: async, a finished request's wasted step, whose last output was capped below
        # its accepted drafts, is a decode too)
        if n - num_spec == 1 and computed + 1 >= req.num_prompt_tokens + req.num_output_tokens:
            out.num_decode_reqs += 1
            out.num_decode_tokens += 1
            out.num_verify_tokens += num_spec
        else:
            out.num_prefill_reqs += 1
            out.num_prefill_tokens += n
            out.num_prefill_pairs += n * computed + n * (n + 1) // 2

    def _schedule_running(self, out: SchedulerOutput, budget: int, threshold: int) -> int:
        running = self.running
        kv = self.kv
        lookahead = self.num_lookahead_tokens
        bs = self.block_size
        max_len_minus_1 = self.max_model_len - 1
        i = 0
        k = self.num_spec_tokens
        defer = self._defer_prefills
        while i < len(running) and budget > 0:
            req = running[i]
            if defer and req.is_prefill_chunk:
                i += 1  # (prefill cadence) its next chunk waits for a step that admits
                continue
            computed = req.num_computed_tokens
            # (async, drafts: vLLM still counts the last step's rejected drafts as computed)
            rejected = req.num_rejected_pending
            num_tokens = req.num_prompt_tokens + req.num_output_tokens
            wasted = req.status == _FINISHED_LENGTH_CAPPED
            if wasted:
                # Async: finished in the last step, its output not yet applied. vLLM skips it
                # when it is sure: even with every draft of that step rejected it would end.
                # Else it schedules one more decode with placeholder drafts, wasted.
                if not k or req.num_output_tokens - req.num_unapplied_tokens + 1 >= req.max_tokens:
                    i += 1
                    continue
                n = 1 + k
            else:
                n = num_tokens + req.num_spec_tokens - computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > max_len_minus_1 - computed - rejected:
                n = max_len_minus_1 - computed - rejected
            if n <= 0:
                i += 1
                continue
            if n == 1 and not lookahead and (computed + 1) % bs and computed < kv.num_blocks_held(req) * bs:
                pass  # a token inside a held block that does not fill it: the pool is unchanged
            else:
                while not kv.allocate_slots(req, n + rejected, num_lookahead_tokens=lookahead):
                    victim = running.pop()
                    if victim.status == _FINISHED_LENGTH_CAPPED:
                        # (async) vLLM preempts a request whose finishing output it has not
                        # applied yet: its blocks go now, it counts as preempted (no admission
                        # this step), and the output then finishes it from the waiting queue.
                        self.kv.free(victim)
                        self.finished_pending.remove(victim)
                        self.num_preemptions += 1
                        out.preempted_reqs.append(victim)
                        if victim is req:
                            return budget
                        continue
                    self._preempt(victim, out)
                    if victim is req:
                        return budget
            # Drafts that did not fit in the budget are dropped, not delayed.
            num_spec = n - 1 if wasted else computed + n - num_tokens
            if num_spec < 0:
                num_spec = 0
            if num_spec < req.num_spec_tokens:
                req.num_spec_tokens = num_spec
            self._add(out, req, n, num_spec)
            budget -= n
            i += 1
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_rejected_pending = 0
        req.num_spec_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_reqs.append(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, threshold: int) -> None:
        waiting = self.waiting
        running = self.running
        kv = self.kv
        bs = self.block_size
        k = self.num_spec_tokens
        # Draft padding (0.26+): an admitted request with a single token left (its prompt hit
        # but for the last token, or a resumption) is padded to 1 + k tokens, placeholder
        # drafts that no verification accepts, so that the step stays a uniform decode batch.
        # Only when no running request is prefilling in this step and either a running
        # request was scheduled or the admitted one hit the cache.
        pad = self._may_pad
        if pad:  # (loops, not generator expressions: a cpdef method holds no closure, .pxd)
            for req in out.reqs:
                if req.is_prefill_chunk:
                    pad = False
                    break
        num_running_scheduled = len(out.reqs)
        reserve_full_isl = self.features.reserve_full_isl
        stats_at_lookup = self._stats_at_lookup
        stats_at_admission = self._stats_at_admission
        lookahead = self.num_lookahead_tokens
        max_num_seqs = self.max_num_seqs
        max_model_len = self.max_model_len
        while waiting and budget > 0:
            if len(running) >= max_num_seqs:
                break
            req = waiting[0]
            hit_blocks: list[int] = []
            num_hit = 0
            num_tokens = req.num_prompt_tokens + req.num_output_tokens
            if req.num_computed_tokens == 0:
                hit_blocks, num_hit = kv.get_computed_blocks(req, lookahead > 0)  # (drop_last_block)
                if stats_at_lookup:
                    kv.record_prefix_cache_stats(num_tokens, num_hit)
            external = 0
            if req.num_external_tokens and req.num_computed_tokens == 0 and not req.num_preemptions:
                # KV received from a prefill engine (vLLM's connector: WAITING_FOR_REMOTE_KVS,
                # then scheduled with those tokens computed; the last prompt token is recomputed).
                external = min(req.num_external_tokens, num_tokens - 1) - num_hit
                if external < 0:
                    external = 0
            if self._defer_prefills and num_hit + external < num_tokens - 1:
                break  # (prefill cadence) its prompt waits for a step that admits
            n = num_tokens - num_hit - external
            padded = False
            if (pad and n == 1 and (num_running_scheduled or num_hit)
                    and num_hit + 2 + k <= max_model_len):
                if 1 + k > budget:
                    break  # vLLM prefers not to schedule it over scheduling it unpadded
                n = 1 + k
                padded = True
            elif 0 < threshold < n:
                n = threshold  # (vLLM 0.32 asserts if the threshold cuts a padded request)
            if n > budget:
                n = budget
            if n <= 0:
                break
            headroom = self.watermark_blocks if running else 0
            # Blocks an admission takes (vLLM's get_num_blocks_to_allocate): those its tokens
            # need past its hits, plus its hits on free cached blocks (taken off the queue).
            held = 0
            if hit_blocks:
                ref_cnt = kv.ref_cnt
                held = len(hit_blocks) - [ref_cnt[b] for b in hit_blocks].count(0)
            if reserve_full_isl:
                # The whole prompt (+ outputs, if resumed) must fit, hits counted as held.
                full = num_tokens if num_tokens < max_model_len else max_model_len
                if -(-full // bs) - held + headroom > kv.free_queue.num_free:
                    break
            if headroom:
                # And this step's slots (lookahead included), with the watermark's headroom.
                slots = num_hit + external + n + lookahead
                if slots > max_model_len:
                    slots = max_model_len
                if -(-slots // bs) - held + headroom > kv.free_queue.num_free:
                    break
            if not kv.allocate_slots(req, external + n, num_hit, hit_blocks, lookahead):
                break
            if stats_at_admission:
                kv.record_prefix_cache_stats(num_tokens, num_hit)
            waiting.popleft()
            running.append(req)
            req.status = _RUNNING
            req.num_computed_tokens = num_hit + external
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            out.new_reqs.append(req)
            if padded:
                out.spec_padded_reqs.append(req)
                self._add(out, req, n, k)
            else:
                self._add(out, req, n, 0)
            budget -= n

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, out: SchedulerOutput, num_accepted: Sequence[int] | None = None
    ) -> EngineOutput:
        """Apply a finished step: sample tokens, roll back rejected drafts, finish requests.

        ``num_accepted[i]`` is how many of ``out.reqs[i]``'s scheduled drafts were accepted.
        A request samples only when its computed tokens reach ``num_tokens`` (a non-final
        prefill chunk produces nothing). Each verify step emits ``accepted + 1`` tokens.
        """
        reqs_out: list[Request] = []
        counts: list[int] = []
        finished: list[Request] = []
        max_model_len = self.max_model_len
        asynchronous = self.async_scheduling
        for idx, req in enumerate(out.reqs):
            # (vLLM skips a request preempted later in the same step: under FCFS the one
            # preempted is always the last running request, never one already scheduled.)
            if req.status == _FINISHED_LENGTH_CAPPED:
                continue  # (async) a step scheduled for a request already finished: wasted
            num_spec = out.num_scheduled_spec_tokens[idx]
            if num_spec:
                accepted = num_accepted[idx] if num_accepted is not None else 0
                req.num_computed_tokens -= num_spec - accepted
                req.num_spec_tokens = 0
                req.num_accepted_uncommitted = accepted
                if asynchronous:
                    req.num_rejected_pending = num_spec - accepted
            else:
                accepted = 0
                if req.num_accepted_uncommitted:
                    req.num_accepted_uncommitted = 0
            num_tokens = req.num_prompt_tokens + req.num_output_tokens
            if req.num_computed_tokens < num_tokens:
                continue  # non-final prefill chunk
            new = accepted + 1
            room = req.max_tokens - req.num_output_tokens
            if new > room:
                new = room
            room = max_model_len - num_tokens
            if new > room:
                new = room
            req.num_output_tokens += new
            if self.async_scheduling:
                req.num_unapplied_tokens = new
                self.unapplied.append(req)
            reqs_out.append(req)
            counts.append(new)
            if req.num_output_tokens >= req.max_tokens or num_tokens + new >= max_model_len:
                finished.append(req)
        if finished:
            self.finish_requests(finished)
        return EngineOutput(reqs_out, counts, finished)

    def finish_requests(self, finished: list[Request]) -> None:
        """Release finished requests' blocks (in batch order) and drop them from RUNNING;
        under async scheduling, after the next schedule (:meth:`apply_pending`)."""
        for req in finished:
            req.status = _FINISHED_LENGTH_CAPPED
        if self.async_scheduling:
            self.finished_pending += finished
        else:
            self._release(finished)

    def abort_requests(self, requests: list[Request]) -> None:
        """vLLM's ``finish_requests(ids, FINISHED_ABORTED)``, between steps: each request not
        finished yet leaves RUNNING (or WAITING, a preempted one too) and frees its blocks, as
        a finished one does."""
        for req in requests:
            if req.status >= _FINISHED_LENGTH_CAPPED:
                continue
            if req.status == _RUNNING:
                self.running.remove(req)  # (by identity)
            else:
                self.waiting.remove(req)
            req.status = _FINISHED_ABORTED
            self.kv.free(req)

    def apply_pending(self) -> None:
        """Async scheduling: what applying the previous step's output does once the next step
        is scheduled: its sampled tokens become cacheable, and the requests it finished free
        their blocks (in the order they finished) and leave RUNNING."""
        self.apply_tokens()
        # vLLM caches a finishing request's blocks as it applies that output: every token but
        # the last, whose KV was never computed (accepted drafts included; a wasted step after
        # it adds nothing). Its computed count says so when its blocks are freed.
        for req in self.finished_pending:
            req.num_computed_tokens = req.num_prompt_tokens + req.num_output_tokens - 1
            req.num_accepted_uncommitted = 0
        self._release(self.finished_pending)
        self.finished_pending = []

    def apply_tokens(self) -> None:
        """Async scheduling: the previous step's sampled tokens (and rejected drafts) applied,
        as :meth:`apply_pending` does. A fast path calls it when its first step has been
        scheduled with them pending."""
        for req in self.unapplied:
            req.num_unapplied_tokens = 0
            req.num_rejected_pending = 0
        self.unapplied = []

    def hold_tokens(self, reqs: list[Request], tokens: list[int], rejected: list[int] | None = None) -> None:
        """Async scheduling: the tokens ``reqs`` sampled in a fast path's last step (and the
        drafts it rejected), pending until the next schedule, as :meth:`update_from_output`
        leaves them."""
        for i, req in enumerate(reqs):
            req.num_unapplied_tokens = tokens[i]
            if rejected is not None:
                req.num_rejected_pending = rejected[i]
        self.unapplied = list(reqs)

    def _release(self, finished: list[Request]) -> None:
        """Free finished requests' blocks, in order, and drop them from RUNNING."""
        running = self.running
        free = self.kv.free
        for req in finished:
            free(req)
            running.remove(req)  # (by identity: Request defines no equality)
