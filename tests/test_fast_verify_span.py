"""Verify spans: with open-loop or replayed arrivals, a fast-path verify stretch (speculative
decoding) goes on past finishes that end before the next arrival. Each finish inside a span
must leave the run as stepping leaves it: the finished requests' blocks freed between the
allocations before and after it, their summaries recorded at that time, the smaller batch
scheduled and priced from there, its acceptance and proposal draws read from the same
streams in the same order."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simcap.fleet.run import simulate
from simcap.metrics.report import to_json
from tests.conftest import make_scenario
from tests.test_fast_forward import check_fast_equals_reference
from tests.test_fast_forward_span import (
    SpanSpy, burst_cases, check_a_stop_rule_sees_spans_as_stretches, many_finishes_trace,
    poisson_cases,
)

EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 2.4,
         "proposal_rate": 0.5, "proposal_concentration": 4.0}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(burst_cases(speculative=True))
def test_verify_spans_equal_reference_path_on_bursts(case):
    check_fast_equals_reference(*case)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(burst_cases(noise=True, speculative=True))
def test_verify_spans_equal_reference_path_with_noise(case):
    check_fast_equals_reference(*case)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(poisson_cases(speculative=True))
def test_verify_spans_equal_reference_path_on_slow_arrivals(case):
    check_fast_equals_reference(*case)


@pytest.mark.parametrize("spec", [EAGLE3, NGRAM], ids=["eagle3", "ngram"])
@pytest.mark.parametrize("blocks, expect_preemptions", [(400, False), (30, True)])
def test_verify_spans_go_on_past_many_finishes_and_equal_the_reference_path(
    spec, blocks, expect_preemptions
):
    """Fixed cases that must run spans through many finishes: a burst of 12 with outputs
    1..120 in plenty of blocks, and in a pool that runs out mid-span (preemptions), each with
    shared prompts whose freed blocks later prompts hit."""
    trace = many_finishes_trace()
    scenario = make_scenario(
        engine=dict(block_size=16, max_model_len=256, num_gpu_blocks=blocks, max_num_seqs=16,
                    max_num_batched_tokens=512, async_scheduling=False),  # (spans: sync order)
        step_time=dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4,
                       per_context_token=1e-7, draft_per_pass=5e-4),
        speculative=spec,
        workload=dict(num_requests=24, input_len=48, output_len=120),
    )
    with SpanSpy(verify=True) as spy:
        reference = check_fast_equals_reference(scenario, trace)
    assert spy.most_finishes >= 3 and spy.finishes_inside >= 10
    assert (reference.summary.preemptions > 0) == expect_preemptions
    assert sum(r.num_cached_tokens for r in reference.records) > 0
    assert reference.summary.spec_decode is not None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(burst_cases(speculative=True), st.sampled_from([0.01, 0.05, 0.3]),
       st.sampled_from([0.0, 0.02]))
def test_a_stop_rule_sees_verify_spans_as_stretches(case, period, not_before):
    check_a_stop_rule_sees_spans_as_stretches(case, period, not_before, verify=True)


@pytest.mark.parametrize("spec", [EAGLE3, NGRAM], ids=["eagle3", "ngram"])
@pytest.mark.parametrize("rate", [0.5, 3.0])
def test_verify_spans_replace_stretches_one_for_one_at_each_finish(spec, rate):
    """Each finish reported inside a span is a stretch the engine no longer runs: fewer
    calls, the same run as with spans off."""
    scenario = make_scenario(
        engine=dict(max_num_seqs=32, num_gpu_blocks=4000, async_scheduling=False),  # (spans: sync order)
        step_time=dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4,
                       draft_per_pass=5e-4),
        speculative=spec,
        workload=dict(arrival={"process": "poisson", "rate": rate}, num_requests=60,
                      input_len={"dist": "uniform", "low": 10, "high": 300},
                      output_len={"dist": "uniform", "low": 50, "high": 500}),
    )
    with SpanSpy(verify=True) as spy:
        with_spans = simulate(scenario, steps=True, records=True)
    with SpanSpy(span=False, verify=True) as spanless_spy:
        without = simulate(scenario, steps=True, records=True)
    assert spanless_spy.finishes_inside == 0
    assert spy.finishes_inside > 10
    assert spanless_spy.calls - spy.calls >= spy.finish_steps_inside > 0
    assert with_spans.steps == without.steps and with_spans.records == without.records
    assert to_json(with_spans.to_dict()) == to_json(without.to_dict())
