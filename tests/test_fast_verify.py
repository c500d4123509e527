"""The speculative fast path's parts, each held to what stepping does: the admission step
against ``Scheduler.schedule``, the acceptance token table against ``AcceptanceModel.sample``.
(The whole path against the reference path: tests/test_fast_forward.py.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import simcap.simulation.fast_verify as fv
import simcap.simulation.simulator as sim
from simcap.engine.speculative import AcceptanceModel
from tests.conftest import make_scenario, run_interpreted
from tests.test_fast_forward import (
    ROOFLINE_HW, ROOFLINE_MODEL, check_fast_equals_reference, prompt_end_case, scenarios,
    shared_prompt_traces,
)


def scheduled(out, scheduler):
    """What a step schedules and the engine state it leaves (by request id): every
    SchedulerOutput field, the requests' counters, the queues, the blocks each holds and the
    free queue's order. (Not the prefix cache's commits of output blocks: the fast path
    makes a running request's at its next allocation or release. A prompt's last block is
    committed in the step: admitted requests' num_cached_tokens show it.)"""
    ids = lambda reqs: [r.request_id for r in reqs]  # noqa: E731
    kv = scheduler.kv
    reqs = list(scheduler.running) + list(scheduler.waiting)
    return (
        ids(out.reqs), out.num_scheduled_tokens, out.num_scheduled_spec_tokens,
        out.total_num_scheduled_tokens, out.num_prefill_reqs, out.num_prefill_tokens,
        out.num_decode_reqs, out.num_decode_tokens, out.num_verify_tokens,
        out.num_context_tokens, out.num_prefill_pairs, ids(out.new_reqs),
        ids(out.preempted_reqs), ids(out.spec_padded_reqs),
        ids(scheduler.running), ids(scheduler.waiting),
        [(r.num_computed_tokens, r.num_spec_tokens, int(r.status), r.is_prefill_chunk,
          r.num_cached_tokens) for r in reqs],
        {rid: list(blocks) for rid, blocks in kv.req_to_blocks.items() if blocks},
        kv.free_block_ids(), kv.prefix_cache_queries, kv.prefix_cache_hits,
    )


def check_admissions(scenario, trace=None) -> tuple[int, int]:
    """Run ``scenario`` (on ``trace``, if given), holding each admission step the shortcut
    schedules to Scheduler.schedule on a copy of the engine. Returns the shortcut's steps,
    and the drafts it capped at max_model_len."""
    original = sim.schedule_verify_admission
    taken = capped = 0

    def checked(world):
        nonlocal taken, capped
        reference = copy.deepcopy(world.scheduler)
        drafts = [r.num_spec_tokens for r in world.scheduler.running]
        out = original(world)
        if out is not None:
            assert scheduled(out, world.scheduler) == scheduled(reference.schedule(), reference)
            taken += 1
            capped += sum(d > s for d, s in zip(drafts, out.num_scheduled_spec_tokens))
        return out

    sim.schedule_verify_admission = checked
    try:
        sim.simulate_engine(scenario, trace)
    finally:
        sim.schedule_verify_admission = original
    return taken, capped


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios(speculative=True))
def test_verify_admission_equals_scheduler(scenario):
    """Each admission step the shortcut schedules equals Scheduler.schedule on a copy of
    the engine (EAGLE, EAGLE3, ngram; budgets, thresholds, tight pools, prefixes)."""
    assume(scenario.speculative is not None)
    check_admissions(scenario)


@pytest.mark.parametrize("asynchronous, least", [(False, 300), (True, 200)])
def test_verify_admission_caps_drafts_at_max_model_len(asynchronous, least):
    """Requests that end at max_model_len: admissions while one of them is within k tokens
    of it, its drafts cut as the scheduler cuts them (async: also by the drafts the last
    step rejected; the step after a finish, which admits most, is the scheduler's)."""
    scenario = make_scenario(
        engine=dict(max_num_seqs=16, max_num_batched_tokens=512, num_gpu_blocks=400,
                    max_model_len=256, async_scheduling=asynchronous),
        speculative={"method": "eagle3", "num_speculative_tokens": 4, "acceptance_length": 3.0},
        workload={"arrival": {"process": "poisson", "rate": 30.0}, "num_requests": 300,
                  "input_len": {"dist": "uniform", "low": 20, "high": 120}, "output_len": 136},
    )
    taken, capped = check_admissions(scenario)
    assert taken > least and capped > 0


def test_verify_admission_is_taken():
    """On an EAGLE3 workload the admission steps take the shortcut."""
    scenario = make_scenario(
        engine=dict(max_num_seqs=64, max_num_batched_tokens=2048, num_gpu_blocks=4000),
        speculative={"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.4},
        workload={"arrival": {"process": "poisson", "rate": 20.0}, "num_requests": 200,
                  "input_len": 300, "output_len": 100},
    )
    original = sim.schedule_verify_admission
    results = []

    def spy(world):
        out = original(world)
        if world.scheduler.waiting or out is not None:
            results.append(out is not None)
        return out

    sim.schedule_verify_admission = spy
    try:
        sim.simulate_engine(scenario)
    finally:
        sim.schedule_verify_admission = original
    # Steps that admit (some admit several arrivals at once), nearly all of them shortcut.
    assert len(results) > 150 and sum(results) > 0.9 * len(results)


EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 2, "acceptance_length": 2.0}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "acceptance_length": 2.0}


@pytest.mark.parametrize("arrival", [0.001, 0.003, 0.01])
@pytest.mark.parametrize("spec, hit", [(EAGLE3, 48), (NGRAM, 64)])
def test_prompt_last_block_is_cached_when_its_token_is_computed(spec, arrival, hit):
    """The step that computes a prompt's last token caches the block it fills at once, as
    allocate_slots does, whether it admits request 1 (arrival 0.001: the admission
    shortcut) or runs in a verify stretch before request 1 arrives: request 1's hit is all 4
    blocks of the shared prompt (capped at 95 tokens and at the 64 public ones), less the
    last hit block that EAGLE drops (48), on both paths."""
    scenario, trace = prompt_end_case(spec, arrival)
    reference = check_fast_equals_reference(scenario, trace)
    assert [r.num_cached_tokens for r in reference.records] == [0, hit]
    check_admissions(scenario, trace)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prompt_traces(speculative=True))
def test_verify_paths_equal_reference_path_on_shared_prompts(case):
    """Prompts chunked one token short of their end, whose last block later, longer prompts
    share: verify stretches and admission steps cache it when stepping does."""
    check_fast_equals_reference(*case)
    check_admissions(*case)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.7, 0.95, 1.0]), min_size=1, max_size=6),
    st.integers(0, 2**16), st.lists(st.integers(1, 5000), min_size=1, max_size=8),
)
def test_token_table_equals_sampled_counts(rates, seed, takes):
    """reserve_tokens reads each uniform as sample() counts it, for every draft count, across
    buffer refills (blocks of 4096 uniforms)."""
    rates = sorted(rates, reverse=True)
    k = len(rates)
    tabled = AcceptanceModel(rates, np.random.default_rng(seed))
    sampled = AcceptanceModel(rates, np.random.default_rng(seed))
    for i, n in enumerate(takes):
        d = i % (k + 1)
        tokens, start = tabled.reserve_tokens(n)
        tabled.uniforms.advance(n)
        accepted = [min(t - 1, d) for t in tokens[start : start + n]]
        assert accepted == sampled.sample([d] * n)


def capped_scenario(roofline: bool):
    """Requests that end at max_model_len, with periods that depend on the context."""
    step_time = (dict(form="roofline", hardware=ROOFLINE_HW, model=ROOFLINE_MODEL) if roofline
                 else dict(base=0.004, per_decode_token=1e-4, per_context_token=1e-8,
                           draft_per_pass=5e-4))
    scenario = make_scenario(
        engine=dict(num_gpu_blocks=4000, max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=400),
        step_time=step_time,
        speculative={"method": "eagle3", "num_speculative_tokens": 4,
                     "acceptance_rates": [0.9, 0.6, 0.5, 0.2]},
        workload=dict(arrival={"process": "poisson", "rate": 5.0}, num_requests=100,
                      input_len={"dist": "uniform", "low": 140, "high": 150}, output_len=250),
    )
    return scenario


def bulks_followed_by_a_step(roofline: bool) -> int:
    """How many bulks of the capped scenario stop short and are followed by a step run one at
    a time (a spy on ``VerifyStretch.run_bulk``: the interpreted class, whose methods can be
    replaced; a compiled one's cannot)."""
    original = fv.VerifyStretch.run_bulk
    followed = []

    def spy(stretch, horizon):
        ran = len(stretch.periods)
        ends = original(stretch, horizon)
        followed.append(not ends and len(stretch.periods) > ran)
        return ends

    fv.VerifyStretch.run_bulk = spy
    try:
        sim.simulate_engine(capped_scenario(roofline))
    finally:
        fv.VerifyStretch.run_bulk = original
    return sum(followed)


@pytest.mark.parametrize("roofline", [False, True])
def test_bulk_followed_by_a_capped_step_equals_reference_path(roofline):
    """Requests that end at max_model_len: bulks that stop before a step whose drafts it
    caps, that step run one at a time, then the next bulk; periods that depend on the
    context (a context term, the roofline's KV read). The case is counted on the interpreted
    engine (in its own process), and checked on the engine this process runs."""
    check_fast_equals_reference(capped_scenario(roofline))
    assert run_interpreted(f"print(bulks_followed_by_a_step({roofline}))",
                           "from tests.test_fast_verify import bulks_followed_by_a_step") > 20
