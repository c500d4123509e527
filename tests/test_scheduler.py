"""Hand-computed cases of the vLLM V1 scheduler model (pure, no clock)."""

from __future__ import annotations

import pytest

from simcap.engine.request import RequestStatus
from simcap.fleet.run import simulate
from simcap.workloads.requests import RequestSpec
from tests.conftest import (
    check_step_invariants,
    make_request,
    make_scenario,
    make_scheduler,
    run_to_completion,
)


def test_prompt_chunks_under_budget_and_first_token_at_final_chunk():
    # 1000-token prompt, budget 256: chunks 256, 256, 256, 232; the 4th step samples.
    sched = make_scheduler(max_num_batched_tokens=256)
    req = make_request(0, 1000, 128)
    sched.add_request(req)
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        check_step_invariants(sched, out)
        chunks.append(out.num_scheduled_tokens[0])
        result = sched.update_from_output(out)
        assert (req.num_output_tokens == 1) == (len(chunks) == 4)
        assert len(result.reqs) == (1 if len(chunks) == 4 else 0)
    assert chunks == [256, 256, 256, 232]
    out = sched.schedule()
    assert out.num_scheduled_tokens == [1] and out.num_decode_reqs == 1 and out.num_prefill_reqs == 0


def test_hand_computed_ttft_and_e2e_with_constant_step_time():
    # Constant 10 ms steps: 4 prompt steps -> TTFT 0.040 s; 127 more tokens -> E2E 1.310 s.
    scenario = make_scenario(
        engine={"max_num_batched_tokens": 256},
        workload={"input_len": 1000, "output_len": 128, "num_requests": 1},
    )
    result = simulate(scenario, records=True, steps=True)
    rec = result.records[0]
    assert rec.first_token_time - rec.arrival_time == pytest.approx(0.040)
    assert rec.finish_time - rec.arrival_time == pytest.approx(1.310)
    assert rec.num_output_tokens == 128 and len(rec.chunk_times) == 128
    assert len(result.steps) == 131
    assert result.summary.tpot_s.mean == pytest.approx(0.010)


def test_two_requests_share_the_budget():
    # Budget 256, prompts of 300, 4 output tokens, both queued at t=0, 10 ms steps.
    # step1: A 256 | step2: A 44 (first token), B 212 | step3: A decode, B 88 (first token)
    # A's tokens at steps 2,3,4,5; B's at 3,4,5,6.
    scenario = make_scenario(
        engine={"max_num_batched_tokens": 256},
        workload={"arrival": {"process": "closed", "concurrency": 2}, "num_requests": 2,
                  "input_len": 300, "output_len": 4},
    )
    result = simulate(scenario, records=True, steps=True)
    a, b = result.records
    assert a.chunk_times == pytest.approx([0.02, 0.03, 0.04, 0.05])
    assert b.chunk_times == pytest.approx([0.03, 0.04, 0.05, 0.06])
    assert a.scheduled_time == 0.0 and b.scheduled_time == pytest.approx(0.01)
    assert [len(result.steps)] == [6]
    st = result.steps.as_arrays()
    assert st["num_prefill_tokens"][:3].tolist() == [256, 44 + 212, 88]
    assert st["num_decode_tokens"][:3].tolist() == [0, 0, 1]


def test_small_pool_forces_preemption_and_everyone_still_finishes_exactly():
    # 10 usable blocks of 16 = 160 tokens; two requests of 64 + 64 tokens each need 8 blocks.
    sched = make_scheduler(num_gpu_blocks=11, block_size=16, max_num_batched_tokens=256)
    reqs = [make_request(i, 64, 64) for i in range(2)]
    emitted, order, _ = run_to_completion(sched, reqs)
    assert sched.num_preemptions > 0
    assert reqs[1].num_preemptions > 0 and reqs[0].num_preemptions == 0  # last admitted is victim
    for req in reqs:
        assert sum(emitted[req.request_id]) == 64 == req.num_output_tokens
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert order == [0, 1]
    assert sched.kv.num_free_blocks == 10


def test_preempted_request_goes_to_head_of_waiting_and_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_gpu_blocks=11, block_size=16, enable_prefix_caching=False)
    a, b, c = (make_request(i, 64, 64) for i in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    # 0.32 admits only whole prompts: a and b fit (4 blocks each), c (4 more) does not.
    out = sched.schedule()
    assert [r.request_id for r in out.reqs] == [0, 1]
    sched.update_from_output(out)
    while not out.preempted_reqs:
        out = sched.schedule()
        check_step_invariants(sched, out)
        sched.update_from_output(out)
    assert out.preempted_reqs == [b]
    assert list(sched.waiting)[:2] == [b, c]
    assert b.num_computed_tokens == 0 and b.num_output_tokens > 0
    # When b is admitted again it recomputes prompt + outputs (no prefix cache here).
    while b.status != RequestStatus.RUNNING:
        out = sched.schedule()
        sched.update_from_output(out)
    assert b.num_computed_tokens >= min(b.num_tokens, sched.max_num_batched_tokens) - 1


def test_aborted_requests_leave_running_or_waiting_and_free_their_blocks():
    """vLLM's finish_requests(..., FINISHED_ABORTED) between steps: a running request frees its
    blocks and its slot, a waiting one leaves the queue, a finished one is left alone; the next
    schedule admits the request the aborted one was holding back."""
    sched = make_scheduler(max_num_seqs=1, num_gpu_blocks=64, block_size=16)
    a, b = make_request(0, 40, 50), make_request(1, 40, 50)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule())
    assert sched.running == [a] and list(sched.waiting) == [b]
    held = sched.kv.num_free_blocks
    sched.abort_requests([a])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.is_finished
    assert sched.running == [] and sched.kv.num_free_blocks == held + 3  # 40 prompt + 1 token: 3 blocks
    out = sched.schedule()
    assert [r.request_id for r in out.reqs] == [1]
    c = make_request(2, 8, 4)
    sched.add_request(c)
    sched.abort_requests([c, a])  # (a: finished already, nothing happens)
    assert list(sched.waiting) == [] and c.status == RequestStatus.FINISHED_ABORTED
    sched.kv.check_invariants()


def test_max_num_seqs_caps_running_and_blocks_the_queue():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4096)
    reqs = [make_request(i, 32, 3) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [r.request_id for r in out.reqs] == [0, 1]
    assert len(sched.waiting) == 2


def test_head_of_line_blocking_no_skipping():
    # Pool of 8 blocks x 16: a 100-token prompt (7 blocks) runs; the next one (100 tokens)
    # cannot be admitted, and a short third request behind it is not admitted either.
    sched = make_scheduler(num_gpu_blocks=9, block_size=16, max_num_batched_tokens=4096,
                           max_model_len=128)
    big1, big2, small = make_request(0, 100, 20), make_request(1, 100, 20), make_request(2, 8, 2)
    for r in (big1, big2, small):
        sched.add_request(r)
    out = sched.schedule()
    assert out.reqs == [big1]
    assert list(sched.waiting) == [big2, small]


@pytest.mark.parametrize("version,expected", [("0.32", [1000]), ("0.26", [100]), ("0.11", [100])])
def test_long_prefill_threshold_and_its_single_request_exemption(version, expected):
    sched = make_scheduler(max_num_batched_tokens=2048, long_prefill_token_threshold=100,
                           vllm_version=version)
    sched.add_request(make_request(0, 1000, 4))
    assert sched.schedule().num_scheduled_tokens == expected


def test_long_prefill_threshold_caps_chunks_when_requests_compete():
    sched = make_scheduler(max_num_batched_tokens=2048, long_prefill_token_threshold=100)
    sched.add_request(make_request(0, 1000, 4))
    sched.add_request(make_request(1, 1000, 4))
    assert sched.schedule().num_scheduled_tokens == [100, 100]


def test_full_prompt_admission_is_a_version_switch():
    # 20 usable blocks of 16 = 320 tokens; budget 64. A 400-token prompt cannot be admitted
    # whole (0.19 and later), but 0.11 admits its first chunk.
    for version, admitted in (("0.32", False), ("0.23", False), ("0.11", True)):
        sched = make_scheduler(num_gpu_blocks=21, block_size=16, max_num_batched_tokens=64,
                               max_model_len=1024, vllm_version=version)
        sched.add_request(make_request(0, 64, 2))
        sched.add_request(make_request(1, 300, 2))
        out = sched.schedule()
        assert (len(out.reqs) == 1) and out.reqs[0].request_id == 0
        sched.update_from_output(out)
        # Now request 0 holds 5 blocks (64 + lookahead for its next token); 15 free < 19.
        out = sched.schedule()
        assert (1 in [r.request_id for r in out.reqs]) == admitted, version


def test_prefix_cache_hit_skips_shared_full_blocks():
    sched = make_scheduler(block_size=16, max_num_batched_tokens=4096)
    shared = (7, 64)  # a 64-token system prompt (4 full blocks)
    a = make_request(0, 100, 2, segments=(shared, (-1, 36)))
    b = make_request(1, 100, 2, segments=(shared, (-3, 36)))
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 64
    assert out.num_scheduled_tokens == [1, 36]
    assert sched.kv.prefix_cache_hits == 64


def test_prefix_hit_is_capped_below_the_whole_prompt():
    sched = make_scheduler(block_size=16, max_num_batched_tokens=4096)
    seg = ((5, 64),)
    a, b = make_request(0, 64, 2, seg), make_request(1, 64, 2, seg)
    sched.add_request(a)
    sched.update_from_output(sched.schedule())
    sched.add_request(b)
    out = sched.schedule()
    # 64 tokens = 4 full blocks, but the last token must be recomputed: hit 3 blocks.
    assert b.num_cached_tokens == 48 and out.num_scheduled_tokens[-1] == 16


@pytest.mark.parametrize("fast", [True, False])
def test_a_request_arriving_as_a_step_ends_is_in_the_next_step(fast):
    # 0.25 s steps (exact in binary): step 1 at 0 (A's prompt), step 2 at 0.25 (A decodes);
    # B arrives at 0.5, exactly when step 2 ends, and step 3 at 0.5 takes its prompt.
    scenario = make_scenario(step_time={"base": 0.25}, workload={"num_requests": 2})
    trace = [(0.0, RequestSpec(0, 16, 10, ((-1, 16),))), (0.5, RequestSpec(1, 16, 10, ((-3, 16),)))]
    result = simulate(scenario, trace, fast=fast, records=True, steps=True)
    b = result.records[1]
    assert b.arrival_time == 0.5 and b.scheduled_time == 0.5
    steps = result.steps.as_arrays()
    assert steps["start"][:3].tolist() == [0.0, 0.25, 0.5]
    assert steps["num_prefill_tokens"][:3].tolist() == [16, 0, 16]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_async_scheduling_holds_a_finished_requests_slot_through_one_more_schedule(asynchronous):
    # One slot (max_num_seqs 1): A (4-token prompt, 2 outputs) runs, B waits. Synchronous: A
    # prefills (step 1), decodes its last token (step 2) and leaves; B is admitted at step 3.
    # Async: step 3 is scheduled before step 2's output is applied, so A still holds the slot
    # and its blocks; that schedule runs nothing and releases A; B is admitted at step 4.
    from simcap.engine.scheduler import Scheduler
    from tests.conftest import make_engine

    sched = Scheduler(make_engine(max_num_seqs=1), async_scheduling=asynchronous)
    a, b = make_request(0, 4, 2), make_request(1, 4, 2)
    sched.add_request(a)
    sched.add_request(b)
    free_at_start = sched.kv.num_free_blocks
    batches = []
    for _ in range(5):
        out = sched.schedule()
        batches.append([(r.request_id, n) for r, n in zip(out.reqs, out.num_scheduled_tokens)])
        sched.update_from_output(out)
        if len(batches) == 2:
            held = free_at_start - sched.kv.num_free_blocks  # A finished: its blocks, before step 3
    if asynchronous:
        assert batches == [[(0, 4)], [(0, 1)], [], [(1, 4)], [(1, 1)]]
    else:
        assert batches == [[(0, 4)], [(0, 1)], [(1, 4)], [(1, 1)], []]
    assert (held >= 1) == asynchronous  # async: A's blocks free only once step 3 is scheduled
    if asynchronous:  # B's last output waits for a next schedule, or for the engine to idle
        assert sched.finished_pending == [b] and not sched.has_unfinished_requests()
        sched.apply_pending()
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == free_at_start
    assert a.is_finished and b.is_finished and sched.running == [] and sched.finished_pending == []


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_prefill_cadence_admits_a_prompt_only_at_multiples_of_the_interval(interval):
    # A (1-token prompt: it decodes from step 1) runs from step 0; B arrives before step 1.
    # Without a cadence B is admitted at step 1. With N, a step k (counted from the idle
    # engine's first, 0) admits a prompt only when k % N == 0 while A decodes: B waits for
    # step N, and A decodes at every step meanwhile.
    from simcap.engine.scheduler import Scheduler
    from tests.conftest import make_engine

    sched = Scheduler(make_engine(prefill_schedule_interval=interval))
    a, b = make_request(0, 1, 8), make_request(1, 4, 2)
    sched.add_request(a)
    steps = []
    for k in range(6):
        if k == 1:
            sched.add_request(b)
        out = sched.schedule()
        steps.append([(r.request_id, n) for r, n in zip(out.reqs, out.num_scheduled_tokens)])
        sched.update_from_output(out)
    first_b = next(k for k, batch in enumerate(steps) if any(rid == 1 for rid, _ in batch))
    assert first_b == (1 if interval == 1 else interval)
    assert all(batch[0] == (0, 1) for batch in steps[1:])


@pytest.mark.parametrize("capacity_bound_rule", [True, False])
def test_prefill_cadence_stops_deferring_once_an_admitting_step_left_requests_waiting(capacity_bound_rule):
    # max_num_seqs 2, N = 2: A decodes; B (one output) and C arrive before step 1. Step 1
    # defers; step 2 admits B, and C still waits (no slot): capacity-bound. B finishes in
    # step 2, so step 3 (odd) has a slot: it admits C, as vLLM does, instead of deferring it
    # to step 4. (Without the rule, the plant below, C would wait for step 4.)
    from simcap.engine.scheduler import Scheduler
    from tests.conftest import make_engine

    class WithoutTheRule(Scheduler):
        def defers_prefills(self) -> bool:
            self.prefill_capacity_bound = False
            return super().defers_prefills()

    cls = Scheduler if capacity_bound_rule else WithoutTheRule
    sched = cls(make_engine(max_num_seqs=2, prefill_schedule_interval=2))
    a, b, c = make_request(0, 1, 20), make_request(1, 4, 1), make_request(2, 4, 2)
    sched.add_request(a)
    admitted = {}
    for k in range(6):
        if k == 1:
            sched.add_request(b)
            sched.add_request(c)
        out = sched.schedule()
        for r in out.new_reqs:
            admitted[r.request_id] = k
        sched.update_from_output(out)
    assert admitted[1] == 2
    assert admitted[2] == (3 if capacity_bound_rule else 4)


def test_vllm_decides_async_scheduling_as_vllm_does():
    from simcap.engine.scheduler import resolve_async_scheduling
    from tests.conftest import make_engine

    assert resolve_async_scheduling(make_engine(vllm_version="0.11")) is False
    assert resolve_async_scheduling(make_engine(vllm_version="0.32")) is True
    assert resolve_async_scheduling(make_engine(vllm_version="0.32"), "eagle3") is True
    assert resolve_async_scheduling(make_engine(vllm_version="0.32"), "ngram") is False
    assert resolve_async_scheduling(make_engine(vllm_version="0.32", async_scheduling=False)) is False
    assert resolve_async_scheduling(make_engine(vllm_version="0.11", async_scheduling=True)) is True
