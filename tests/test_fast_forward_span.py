"""Decode spans: with open-loop or replayed arrivals, a fast-path decode stretch goes on past
finishes that end before the next arrival. Each finish inside a span must leave the run as
stepping leaves it: the finished requests' blocks freed between the allocations before and
after it, their summaries recorded at that time, the smaller batch priced from there."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simcap.simulation.simulator as sim
from simcap.fleet.run import simulate
from simcap.metrics.report import to_json
from simcap.simulation.early_stop import SloStop
from simcap.workloads.requests import RequestSpec
from tests.conftest import make_scenario
from tests.test_fast_forward import NOISES, check_fast_equals_reference, speculative_configs


class SpanSpy:
    """Counts, while installed, the stretch calls, the finishes reported inside spans (from a
    segment that the span went on after) and the spans that had them; ``span=False`` runs
    every stretch as one segment (a span stops at its first finish). ``verify=True``: the
    verify stretches of speculative decoding (``advance_verify_stretch``), else the plain
    decode ones."""

    def __init__(self, span: bool = True, verify: bool = False) -> None:
        self.span = span
        self.name = "advance_verify_stretch" if verify else "advance_decode_stretch"
        self.calls = 0  # stretches (spans) asked for
        self.finishes_inside = 0  # requests reported inside spans
        self.finish_steps_inside = 0  # the steps with finishes a span went on after
        self.spans_with_finishes = 0
        self.most_finishes = 0  # the most finishes (steps with some) one span went on past

    def __enter__(self) -> SpanSpy:
        self.original_stretch = getattr(sim, self.name)
        self.original_finish = sim.EngineWorld.finish
        inside = []

        def finish(world, reqs, now):
            if inside:
                inside[-1] += 1
                self.finishes_inside += len(reqs)
            return self.original_finish(world, reqs, now)

        def stretch(world, now, horizon, first=None, span=False):
            self.calls += 1
            inside.append(0)
            try:
                return self.original_stretch(world, now, horizon, first, span and self.span)
            finally:
                n = inside.pop()
                self.finish_steps_inside += n
                self.spans_with_finishes += n > 0
                self.most_finishes = max(self.most_finishes, n)

        setattr(sim, self.name, stretch)
        sim.EngineWorld.finish = finish
        return self

    def __exit__(self, *exc) -> None:
        setattr(sim, self.name, self.original_stretch)
        sim.EngineWorld.finish = self.original_finish


def burst_trace(draw, bs: int, shared: bool) -> tuple[list, int, int]:
    """Bursts of requests arriving at once (or nearly), far apart or close: while a burst
    decodes, its requests finish one after another with no arrival between them. Prompts
    may open with whole blocks of public content (prefix caching hits what a finished
    request left in the free queue)."""
    trace = []
    t = 0.0
    i = 0
    for _ in range(draw(st.integers(1, 4))):
        t += draw(st.sampled_from([0.0, 0.05, 0.5, 3.0]))
        for _ in range(draw(st.integers(1, 8))):
            t += draw(st.sampled_from([0.0, 0.0, 0.001, 0.02]))
            public = bs * draw(st.integers(0, 3)) if shared else 0
            own = draw(st.integers(0 if public else 1, 60))
            segments = (((draw(st.sampled_from([7, 8])), public),) if public else ()) + (
                ((-1 - i, own),) if own else ())
            trace.append((t, RequestSpec(i, public + own, draw(st.integers(1, 120)), segments)))
            i += 1
    return trace, max(s.num_prompt_tokens for _, s in trace), i


@st.composite
def burst_cases(draw, noise: bool = False, speculative: bool = False):
    """A replayed trace of bursts under pools from one request's worth of blocks (decoders
    run out mid-span and are preempted) to plenty, with prefix caching on or off.
    ``speculative``: with a drafting method (EAGLE, EAGLE3, ngram), draft costs and a
    prefill threshold that a lone request may be exempt from."""
    bs = draw(st.sampled_from([4, 16]))
    shared = draw(st.booleans())
    trace, longest, num_requests = burst_trace(draw, bs, shared)
    spec = draw(speculative_configs()) if speculative else None
    need = longest + 120 + (draw(st.sampled_from([0, 8])) if spec else 0)
    step_time = dict(
        base=0.004, per_prefill_token=1e-5, per_decode_token=draw(st.sampled_from([1e-4, 3e-3])),
        per_context_token=draw(st.sampled_from([0.0, 1e-7])),
        host_overhead=draw(st.sampled_from([0.0, 0.0013])),
    )
    if spec:
        step_time["draft_per_pass"] = draw(st.sampled_from([0.0, 5e-4]))
        step_time["draft_per_request"] = draw(st.sampled_from([0.0, 1e-5]))
    if noise:
        step_time["noise"] = draw(NOISES)
    slots = need + (lookahead(spec) if spec else 0)
    engine = dict(
        vllm_version=draw(st.sampled_from(["0.11", "0.32"])),
        block_size=bs, max_model_len=need,
        num_gpu_blocks=-(-slots // bs) + 1 + draw(st.sampled_from([0, 3, 12, 200])),
        max_num_seqs=draw(st.integers(2, 16)),
        max_num_batched_tokens=draw(st.sampled_from([64, 512])),
    )
    if spec:
        engine["long_prefill_token_threshold"] = draw(st.sampled_from([0, 0, 3]))
    engine["enable_prefix_caching"] = shared or draw(st.booleans())
    # (vLLM refuses async scheduling with ngram drafts)
    ngram = spec is not None and spec["method"] == "ngram"
    engine["async_scheduling"] = draw(st.sampled_from([None, False] if ngram else [None, False, True]))
    scenario = make_scenario(
        engine=engine,
        step_time=step_time,
        workload=dict(num_requests=num_requests, input_len=longest, output_len=120),
        seed=draw(st.integers(0, 2**16)),
        **({"speculative": spec} if spec else {}),
    )
    return scenario, trace


def lookahead(spec: dict) -> int:
    """Slots a speculative method reserves past a request's tokens."""
    return spec["num_speculative_tokens"] if spec["method"] != "ngram" else 0


@st.composite
def poisson_cases(draw, speculative: bool = False):
    """The scenario's own open-loop arrivals, slow against long and varied outputs: several
    requests finish between two arrivals. ``speculative``: with a drafting method (EAGLE,
    EAGLE3, ngram)."""
    max_out = draw(st.integers(20, 400))
    bs = draw(st.sampled_from([4, 16]))
    spec = draw(speculative_configs()) if speculative else None
    need = 300 + max_out
    slots = need + (lookahead(spec) if spec else 0)
    step_time = dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4,
                     per_context_token=draw(st.sampled_from([0.0, 1e-7])))
    if spec:
        step_time["draft_per_pass"] = 5e-4
    scenario = make_scenario(
        engine=dict(block_size=bs, max_model_len=need,
                    num_gpu_blocks=-(-slots // bs) + 1 + draw(st.sampled_from([0, 20, 2000])),
                    max_num_seqs=16, max_num_batched_tokens=256,
                    enable_prefix_caching=draw(st.booleans()),
                    # (spans run in the synchronous order; async stops at each finish)
                    async_scheduling=draw(st.booleans()) if not spec or spec["method"] != "ngram" else False),
        step_time=step_time,
        workload=dict(
            arrival=draw(st.sampled_from([{"process": "poisson", "rate": 2.0},
                                          {"process": "gamma", "rate": 5.0, "burstiness": 0.2}])),
            num_requests=draw(st.integers(2, 30)),
            input_len={"dist": "uniform", "low": 40, "high": 300},
            output_len={"dist": "uniform", "low": 1, "high": max_out},
            prefix={"shared_tokens": 32, "num_prefixes": 2},
        ),
        seed=draw(st.integers(0, 2**16)),
        **({"speculative": spec} if spec else {}),
    )
    return scenario, None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(burst_cases())
def test_spans_equal_reference_path_on_bursts(case):
    check_fast_equals_reference(*case)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(burst_cases(noise=True))
def test_spans_equal_reference_path_with_noise(case):
    check_fast_equals_reference(*case)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(poisson_cases())
def test_spans_equal_reference_path_on_slow_arrivals(case):
    check_fast_equals_reference(*case)


def many_finishes_trace() -> list:
    """A burst of 12 requests with outputs 1..120 and, 2 s later, 12 more, each prompt
    opening with the same 32 public tokens."""
    trace = []
    for i in range(24):
        t = 0.0 if i < 12 else 2.0 + 0.001 * i
        trace.append((t, RequestSpec(i, 48, 1 + (i * 37) % 120, ((7, 32), (-1 - i, 16)))))
    return trace


def test_spans_go_on_past_many_finishes_and_equal_the_reference_path():
    """Fixed cases that must run spans through many finishes: a burst of 12 with outputs
    1..120 in plenty of blocks, and in a pool that runs out mid-span (preemptions), each with
    shared prompts whose freed blocks later prompts hit."""
    for blocks, expect_preemptions in [(400, False), (30, True)]:
        trace = many_finishes_trace()
        scenario = make_scenario(
            engine=dict(block_size=16, max_model_len=256, num_gpu_blocks=blocks, max_num_seqs=16,
                        max_num_batched_tokens=512, async_scheduling=False),  # (spans: sync order)
            step_time=dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4,
                           per_context_token=1e-7),
            workload=dict(num_requests=24, input_len=48, output_len=120),
        )
        with SpanSpy() as spy:
            reference = check_fast_equals_reference(scenario, trace)
        assert spy.most_finishes >= 3 and spy.finishes_inside >= 10
        assert (reference.summary.preemptions > 0) == expect_preemptions
        assert sum(r.num_cached_tokens for r in reference.records) > 0


def spanless(scenario, trace=None, *, verify: bool = False, **kwargs):
    with SpanSpy(span=False, verify=verify) as spy:
        result = simulate(scenario, trace, **kwargs)
    assert spy.finishes_inside == 0
    return result


def check_a_stop_rule_sees_spans_as_stretches(case, period, not_before, verify=False):
    """A stop rule is checked where the engine's loop comes between stretches; a span stops
    at a finish when a check is due then, so a run with spans stops where one without them
    does, with the same figures."""
    scenario, trace = case
    scenario = scenario.model_copy(update={"slo": {"ttft_p90": 0.05, "e2e_p50": 0.3}})

    def run(span):
        stop = SloStop(scenario.slo, not_before=not_before, period=period)
        if span:
            return simulate(scenario, trace, records=True, steps=True, stop=stop)
        return spanless(scenario, trace, verify=verify, records=True, steps=True, stop=stop)

    with_spans, without = run(True), run(False)
    assert with_spans.records == without.records and with_spans.steps == without.steps
    assert to_json(with_spans.to_dict()) == to_json(without.to_dict())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(burst_cases(), st.sampled_from([0.01, 0.05, 0.3]), st.sampled_from([0.0, 0.02]))
def test_a_stop_rule_sees_spans_as_stretches(case, period, not_before):
    check_a_stop_rule_sees_spans_as_stretches(case, period, not_before)


@pytest.mark.parametrize("rate", [0.5, 3.0])
def test_spans_replace_stretches_one_for_one_at_each_finish(rate):
    """Each finish reported inside a span is a stretch the engine no longer runs: fewer
    calls, the same run as with spans off."""
    scenario = make_scenario(
        engine=dict(max_num_seqs=32, num_gpu_blocks=4000, async_scheduling=False),  # (spans: sync order)
        step_time=dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4),
        workload=dict(arrival={"process": "poisson", "rate": rate}, num_requests=60,
                      input_len={"dist": "uniform", "low": 10, "high": 300},
                      output_len={"dist": "uniform", "low": 50, "high": 500}),
    )
    with SpanSpy() as spy:
        with_spans = simulate(scenario, steps=True)
    with SpanSpy(span=False) as spanless_spy:
        without = simulate(scenario, steps=True)
    assert spanless_spy.finishes_inside == 0
    n_spans, n_stretches = spy.calls, spanless_spy.calls
    assert spy.finishes_inside > 10
    assert n_stretches - n_spans >= spy.finish_steps_inside > 0
    assert with_spans.steps == without.steps
    assert to_json(with_spans.to_dict()) == to_json(without.to_dict())
