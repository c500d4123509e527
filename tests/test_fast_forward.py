"""The fast path (bulk pure-decode stretches) must equal the reference step-by-step path."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simcap.config.scenario import Scenario
from simcap.fleet.run import simulate
from simcap.metrics.report import to_json
from simcap.metrics.summary import summarize
from simcap.simulation.simulator import EngineWorld
from simcap.workloads.requests import RequestSpec
from tests.conftest import make_scenario


ROOFLINE_HW = {"memory_gb": 80, "memory_bandwidth_gbps": 100, "peak_tflops": {"bf16": 5},
               "interconnect": {"bandwidth_gbps": 50, "latency_us": 5}}
ROOFLINE_MODEL = {"num_layers": 4, "num_kv_heads": 2, "head_size": 32, "dtype_bytes": 2,
                  "hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 512,
                  "vocab_size": 32000}


def roofline_step_time(draw) -> dict:
    """A roofline step_time section: dense or MoE, sum or max, TP 1 or 2, skewed or not."""
    model = dict(ROOFLINE_MODEL)
    if draw(st.booleans()):
        model.update(num_experts=16, num_experts_per_tok=draw(st.sampled_from([1, 2, 16])),
                     moe_intermediate_size=512)
    return dict(
        form="roofline", hardware=ROOFLINE_HW, model=model,
        base=draw(st.sampled_from([0.0, 0.004])),
        per_request=draw(st.sampled_from([0.0, 2e-5])),
        mixed_step=draw(st.sampled_from([0.0, 1e-3])),
        host_overhead=draw(st.sampled_from([0.0, 0.0013])),
        combine=draw(st.sampled_from(["sum", "max"])),
        tensor_parallel_size=draw(st.sampled_from([1, 2])),
        routing_skew=draw(st.sampled_from([0.0, 0.6])),
        efficiency={"compute": draw(st.sampled_from([1.0, 3.0])),
                    "kv_read": draw(st.sampled_from([1.0, 50.0]))},
    )


@st.composite
def speculative_configs(draw) -> dict:
    """EAGLE3, EAGLE or ngram (drafting for all requests or some), 1-5 drafts, acceptance as a
    mean length or as per-position rates (down to none accepted or all)."""
    k = draw(st.integers(1, 5))
    method = draw(st.sampled_from(["eagle3", "eagle", "ngram"]))
    spec = {"method": method, "num_speculative_tokens": k}
    if draw(st.booleans()):
        spec["acceptance_length"] = draw(st.sampled_from([1.0, 1.0 + k / 2, 1.0 + k]))
    else:
        rates = sorted(draw(st.lists(st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0]),
                                     min_size=k, max_size=k)), reverse=True)
        spec["acceptance_rates"] = rates
    if method == "ngram":
        spec["proposal_rate"] = draw(st.sampled_from([1.0, 0.5]))
        if draw(st.booleans()):  # a match probability per request (Beta over requests)
            spec["proposal_concentration"] = draw(st.sampled_from([0.3, 4.0]))
        if draw(st.booleans()):  # no match before the output repeats
            spec["proposal_onset_tokens"] = draw(st.sampled_from([2, 5]))
    return spec


FRONTENDS = st.sampled_from([
    None, None,
    {"arrival_s": 0.003, "output_s": 0.002, "per_chunk_s": 5e-4},
    {"output_s": 0.001, "per_chunk_s": 0.02},  # a step's chunks later than its next step's end
])


@st.composite
def scenarios(draw, roofline=False, speculative=False, frontend=True):
    block_size = draw(st.sampled_from([4, 16, 32]))
    max_in = draw(st.integers(1, 400))
    max_out = draw(st.integers(1, 300))
    need = max_in + max_out
    arrival = draw(st.sampled_from([
        {"process": "poisson", "rate": draw(st.sampled_from([0.5, 5.0, 50.0]))},
        {"process": "gamma", "rate": 20.0, "burstiness": 0.3},
        {"process": "closed", "concurrency": draw(st.integers(1, 12))},
        {"process": "closed", "concurrency": 4, "think_time_s": 0.05},
    ]))
    workload = dict(
        arrival=arrival,
        num_requests=draw(st.integers(1, 40)),
        input_len={"dist": "uniform", "low": 1, "high": max_in},
        output_len={"dist": "uniform", "low": 1, "high": max_out},
    )
    if max_in > 40 and draw(st.booleans()):
        workload["prefix"] = {"shared_tokens": 20, "num_prefixes": 2}
        workload["input_len"] = {"dist": "uniform", "low": 21, "high": max_in}
    spec = None
    lookahead = 0
    if speculative and draw(st.booleans()):
        spec = draw(speculative_configs())
        lookahead = spec["num_speculative_tokens"] if spec["method"] != "ngram" else 0
    return make_scenario(
        engine=dict(
            vllm_version=draw(st.sampled_from(["0.11", "0.23", "0.32"])),
            block_size=block_size,
            max_model_len=need + draw(st.integers(0, 64)),
            num_gpu_blocks=-(-(need + lookahead) // block_size) + 1 + draw(st.integers(0, 60)),
            max_num_seqs=draw(st.integers(1, 16)),
            max_num_batched_tokens=draw(st.integers(4, 512)),
            enable_prefix_caching=draw(st.booleans()),
            # (vLLM refuses async scheduling with ngram drafts)
            async_scheduling=draw(st.sampled_from(
                [None, False] if spec and spec["method"] == "ngram" else [None, False, True]
            )),
        ),
        step_time=roofline_step_time(draw) if roofline else dict(
            base=0.004, per_prefill_token=1e-5, per_decode_token=draw(st.sampled_from([1e-4, 3e-3])),
            per_context_token=draw(st.sampled_from([0.0, 1e-7])),
            host_overhead=draw(st.sampled_from([0.0, 0.0013])),
            draft_per_pass=draw(st.sampled_from([0.0, 5e-4])),
            draft_per_request=draw(st.sampled_from([0.0, 1e-5])),
        ),
        speculative=spec,
        frontend=draw(FRONTENDS) if frontend else None,  # (the API server and client)
        workload=workload,
        seed=draw(st.integers(0, 2**16)),
    )


NOISES = st.sampled_from([
    {"decode": {"kind": "lognormal", "sigma": 0.4}},
    {"decode": {"kind": "empirical", "quantiles": [0.3, 0.8, 1.0, 1.1, 3.0]},
     "prefill": {"kind": "lognormal", "sigma": 0.2}},
    {"prefill": {"kind": "empirical", "quantiles": [0.5, 2.0]}},
    # steps far shorter than the noiseless period: pricing must go on past its first guess
    {"decode": {"kind": "empirical", "quantiles": [0.1, 0.15, 0.4]}},
])


@st.composite
def noisy_scenarios(draw, speculative=False, frontend=True):
    """Scenarios with step-time noise (either form): periods that shrink and grow along a
    stretch."""
    scenario = draw(scenarios(roofline=draw(st.booleans()), speculative=speculative, frontend=frontend))
    noise = draw(NOISES)
    if speculative and draw(st.booleans()):
        noise = {**noise, "spec": {"kind": "lognormal", "sigma": 0.3}}
    step_time = {**scenario.step_time.model_dump(exclude_none=True), "noise": noise}
    return scenario.model_copy(update={"step_time": type(scenario.step_time).model_validate(step_time)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_fast_path_equals_reference_path(scenario):
    check_fast_equals_reference(scenario)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(roofline=True, speculative=True))
def test_fast_path_equals_reference_path_roofline(scenario):
    """The roofline form (sum and max, dense and MoE, TP, skew), with and without
    speculation: the fast path's decode_periods equal step_period step by step."""
    check_fast_equals_reference(scenario)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(noisy_scenarios())
def test_fast_path_equals_reference_path_with_noise(scenario):
    check_fast_equals_reference(scenario)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(speculative=True))
def test_fast_path_equals_reference_path_with_speculation(scenario):
    """Verify stretches (EAGLE3, EAGLE, ngram; lengths and rates; async scheduling or not)
    draw acceptance and proposals from the same streams, in the same order, as stepping."""
    check_fast_equals_reference(scenario)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(noisy_scenarios(speculative=True))
def test_fast_path_equals_reference_path_with_speculation_and_noise(scenario):
    check_fast_equals_reference(scenario)


def test_front_end_gaps_are_taken_between_the_times_clients_see():
    """With a front end whose offset changes from step to step, a stretch's gaps, a step's,
    and the records' are all differences of the delivered times: the same floats, so the
    rounded ITL samples agree to the last digit (a case where they did not)."""
    scenario = Scenario.model_validate({
        "engine": {"vllm_version": "0.11", "max_num_seqs": 2, "max_num_batched_tokens": 6,
                   "block_size": 4, "num_gpu_blocks": 32, "max_model_len": 121,
                   "enable_prefix_caching": False, "long_prefill_token_threshold": 0,
                   "watermark": 0.0},
        "step_time": {
            "form": "roofline", "base": 0.0, "mixed_step": 0.0, "host_overhead": 0.0,
            "combine": "max", "routing_skew": 0.6,
            "hardware": {"memory_gb": 80, "memory_bandwidth_gbps": 100, "peak_tflops": {"bf16": 5},
                         "interconnect": {"bandwidth_gbps": 50, "latency_us": 5}},
            "model": {"num_layers": 4, "num_kv_heads": 2, "head_size": 32, "dtype_bytes": 2,
                      "hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 512,
                      "vocab_size": 32000, "num_experts": 16, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 512},
        },
        "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                        "acceptance_rates": [0.0, 0.0], "proposal_rate": 1.0},
        "frontend": {"output_s": 0.001, "per_chunk_s": 0.02},
        "workload": {"arrival": {"process": "gamma", "rate": 20.0, "burstiness": 0.3},
                     "num_requests": 2, "input_len": {"dist": "uniform", "low": 1, "high": 62},
                     "output_len": {"dist": "uniform", "low": 1, "high": 59}},
        "seed": 22,
    })
    reference = check_fast_equals_reference(scenario)
    assert reference.summary.preemptions > 0  # (stretches cut short, offsets that change)


def final_pool(scenario, fast, trace=None):
    """The KV pool a run leaves: the free queue's order (what later allocations take, and
    which cached blocks they evict) and the cached content of each block."""
    world = EngineWorld(scenario, fast)
    world.run(trace)
    kv = world.scheduler.kv
    return kv.free_block_ids(), kv.prefix_cache.block_hash


def check_fast_equals_reference(scenario, trace=None):
    reference = simulate(scenario, trace, fast=False, records=True, steps=True)
    fast = simulate(scenario, trace, fast=True, records=True, steps=True)
    assert final_pool(scenario, True, trace) == final_pool(scenario, False, trace)
    assert fast.records == reference.records
    assert fast.steps == reference.steps
    assert to_json(fast.to_dict()) == to_json(reference.to_dict())
    # Summarised as requests finish (no records kept), the run gives the same figures, and
    # they equal the summary of the full records: the streaming ITL path loses nothing.
    streaming = simulate(scenario, trace)
    assert to_json(streaming.to_dict()) == to_json(fast.to_dict())
    assert streaming.records is None and streaming.steps == fast.steps
    from_records = summarize(
        reference.records, slo=dict(scenario.slo) or None,
        kv_usage=reference.steps.kv_usage_summary(), spec_decode=reference.summary.spec_decode,
    )
    assert to_json(from_records.to_dict()) == to_json(fast.summary.to_dict())
    return reference


# ---------------------------------------------------------------- a prompt's last block


def prompt_end_case(spec, arrival):
    """Request 0's 64-token public prompt (block 16) is chunked at 63 tokens (the budget),
    so the step after computes its last token and fills its 4th block; request 1 opens with
    the same 64 tokens, has 32 more of its own, and arrives at ``arrival``: during the first
    chunk (admitted in that step) or after it (while request 0 decodes)."""
    scenario = make_scenario(
        engine=dict(max_num_seqs=8, max_num_batched_tokens=63, block_size=16, num_gpu_blocks=64,
                    max_model_len=256),
        step_time=dict(base=0.001, per_prefill_token=1e-5, per_decode_token=1e-4),
        speculative=spec,
        workload=dict(num_requests=2, input_len=64, output_len=20),
    )
    trace = [(0.0, RequestSpec(0, 64, 20, ((7, 64),))),
             (arrival, RequestSpec(1, 96, 20, ((7, 64), (-2, 32))))]
    return scenario, trace


@pytest.mark.parametrize("arrival", [0.001, 0.003, 0.01])
def test_prompt_last_block_is_cached_when_its_token_is_computed(arrival):
    """The step that computes a prompt's last token caches the block it fills at once, as
    allocate_slots does: request 1 then hits all 4 blocks of the shared prompt (its hit is
    capped at 95 tokens and at the 64 public ones: 4 full blocks), on both paths."""
    reference = check_fast_equals_reference(*prompt_end_case(None, arrival))
    assert [r.num_cached_tokens for r in reference.records] == [0, 64]


@st.composite
def shared_prompt_traces(draw, speculative=False):
    """A scenario and an open-loop trace of prompts that open with the same public content
    (whole blocks of it, some with more of their own after), under budgets that often stop a
    chunk one token short of a prompt's end: the step that computes that token fills the
    prompt's last block, which a later, longer prompt may hit. Arrivals come during steps,
    between them and at once; pools are tight enough to evict."""
    bs = draw(st.sampled_from([4, 16, 16]))
    num_requests = draw(st.integers(2, 6))
    blocks = draw(st.integers(1, 4))
    publics = []  # blocks of public content, per request: mostly growing
    for _ in range(num_requests):
        publics.append(blocks)
        blocks += draw(st.sampled_from([1, 1, 0, 2]))
    if not draw(st.integers(0, 3)):
        publics = draw(st.permutations(publics))
    trace = []
    t = 0.0
    for i, blocks in enumerate(publics):
        segments = ((draw(st.sampled_from([7, 7, 7, 8])), bs * blocks),)
        tail = draw(st.sampled_from([0, 0, 0, 1, bs])) if i else 0  # the first: all public
        if tail:
            segments += ((-1 - i, tail),)
        t += draw(st.sampled_from([0.0, 0.001, 0.003, 0.005, 0.008, 0.012, 0.05]))
        trace.append((t, RequestSpec(i, bs * blocks + tail, draw(st.integers(1, 40)), segments)))
    lengths = [spec.num_prompt_tokens for _, spec in trace]
    # Mostly a chunk that stops one token short of a prompt's end (the first prompt's: it
    # arrives alone), else budgets of a block and more.
    budget = draw(st.sampled_from([lengths[0] - 1] * 2 + [n - 1 for n in lengths[1:]]
                                  + [bs + 1, 2 * bs, 64]))
    budget = budget if budget > 0 else bs
    spec = draw(speculative_configs()) if speculative else None
    need = max(lengths) + 40 + 5  # + drafts' lookahead
    scenario = make_scenario(
        engine=dict(max_num_seqs=draw(st.integers(2, 8)), max_num_batched_tokens=budget,
                    block_size=bs, max_model_len=need,
                    num_gpu_blocks=-(-need // bs) + 1 + draw(st.sampled_from([0, 8, 40])),
                    vllm_version=draw(st.sampled_from(["0.11", "0.32"]))),
        step_time=dict(base=0.001, per_prefill_token=1e-5, per_decode_token=1e-4,
                       per_context_token=draw(st.sampled_from([0.0, 1e-7]))),
        speculative=spec,
        workload=dict(num_requests=num_requests, input_len=max(lengths), output_len=40),
        seed=draw(st.integers(0, 2**16)),
    )
    return scenario, trace


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prompt_traces())
def test_fast_path_equals_reference_path_on_shared_prompts(case):
    check_fast_equals_reference(*case)


@pytest.mark.parametrize("roofline", [False, True])
def test_fast_path_is_taken_on_long_decodes(roofline):
    step_time = dict(form="roofline", hardware=ROOFLINE_HW, model=ROOFLINE_MODEL) if roofline else {}
    scenario = make_scenario(
        step_time=step_time,
        workload={"arrival": {"process": "closed", "concurrency": 4}, "num_requests": 8,
                  "input_len": 100, "output_len": 500},
    )
    import simcap.simulation.simulator as sim

    calls = []
    original = sim.advance_decode_stretch

    def spy(world, now, horizon, first=None, span=False):
        before = len(world.steps)
        out = original(world, now, horizon, first, span)
        calls.append(len(world.steps) - before)
        return out

    sim.advance_decode_stretch = spy
    try:
        simulate(scenario)
    finally:
        sim.advance_decode_stretch = original
    assert sum(calls) > 0.9 * len(simulate(scenario, fast=False).steps)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_decode_shortcut_changes_nothing(scenario):
    """The scheduler skips allocate_slots for a decode token inside a held, not-yet-full block;
    calling it every time (the shortcut off) must give the same run."""
    from simcap.engine import scheduler as scheduler_module

    class NoShortcut(scheduler_module.KVCacheManager):  # (a compiled class cannot be patched)
        def num_blocks_held(self, request):
            return 0  # the shortcut never applies

    shortcut = simulate(scenario, fast=False, records=True, steps=True)
    original = scheduler_module.KVCacheManager
    scheduler_module.KVCacheManager = NoShortcut
    try:
        always = simulate(scenario, fast=False, records=True, steps=True)
    finally:
        scheduler_module.KVCacheManager = original
    assert shortcut.records == always.records and shortcut.steps == always.steps
    assert to_json(shortcut.to_dict()) == to_json(always.to_dict())


def test_fast_path_equals_reference_path_at_scale():
    """Hundreds of requests, with preemptions (a tight pool), shared prefixes and chunked
    prompts, through stretches, merged admission steps and reference steps."""
    preemptions = []
    for engine, workload in [
        (dict(num_gpu_blocks=120, block_size=16, max_num_seqs=24, max_num_batched_tokens=512),
         dict(arrival={"process": "poisson", "rate": 40.0}, num_requests=300,
              input_len={"dist": "uniform", "low": 40, "high": 600},
              output_len={"dist": "uniform", "low": 1, "high": 300},
              prefix={"shared_tokens": 32, "num_prefixes": 3})),
        (dict(num_gpu_blocks=4000, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
              vllm_version="0.11"),
         dict(arrival={"process": "gamma", "rate": 30.0, "burstiness": 0.5}, num_requests=400,
              input_len={"dist": "uniform", "low": 1, "high": 3000},
              output_len={"dist": "uniform", "low": 1, "high": 400})),
    ]:
        for noise in (None, {"decode": {"kind": "lognormal", "sigma": 0.3},
                             "prefill": {"kind": "empirical", "quantiles": [0.6, 1.0, 1.5]}}):
            scenario = make_scenario(
                engine={**engine, "max_model_len": 4096},
                step_time=dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4,
                               per_context_token=1e-8, noise=noise),
                workload=workload,
            )
            reference = simulate(scenario, fast=False, records=True, steps=True)
            fast = simulate(scenario, records=True, steps=True)
            assert fast.records == reference.records and fast.steps == reference.steps
            assert to_json(fast.to_dict()) == to_json(reference.to_dict())
            assert final_pool(scenario, True) == final_pool(scenario, False)
            assert reference.summary.completed == workload["num_requests"]
            preemptions.append(reference.summary.preemptions)
    assert min(preemptions) > 0  # every pool runs out: the fast path meets preemptions


def test_verify_stretches_equal_reference_path_at_scale():
    """Speculation on hundreds of requests: verify stretches of dozens of requests (bulk
    for EAGLE3, one step at a time for ngram with noise), a tight pool that preempts, shared
    prefixes, chunked prompts and a closed loop."""
    preemptions = []
    for spec, noise, arrival in [
        ({"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.4}, None,
         {"process": "poisson", "rate": 40.0}),
        ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 3.5,
          "proposal_onset_tokens": 5}, None, {"process": "poisson", "rate": 40.0}),
        ({"method": "eagle", "num_speculative_tokens": 4,
          "acceptance_rates": [0.9, 0.7, 0.5, 0.2]}, None,
         {"process": "closed", "concurrency": 20, "think_time_s": 0.02}),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_length": 2.0,
          "proposal_rate": 0.6}, {"decode": {"kind": "lognormal", "sigma": 0.3}},
         {"process": "poisson", "rate": 40.0}),
        ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 3.0,
          "proposal_rate": 0.4, "proposal_concentration": 0.5, "proposal_onset_tokens": 5}, None,
         {"process": "closed", "concurrency": 20}),
    ]:
        scenario = make_scenario(
            engine=dict(num_gpu_blocks=160, block_size=16, max_num_seqs=24,
                        max_num_batched_tokens=512, max_model_len=4096),
            step_time=dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4,
                           per_context_token=1e-8, draft_per_pass=5e-4, noise=noise),
            speculative=spec,
            workload=dict(arrival=arrival, num_requests=250,
                          input_len={"dist": "uniform", "low": 40, "high": 600},
                          output_len={"dist": "uniform", "low": 1, "high": 300},
                          prefix={"shared_tokens": 32, "num_prefixes": 3}),
        )
        reference = simulate(scenario, fast=False, records=True, steps=True)
        fast = simulate(scenario, records=True, steps=True)
        assert fast.records == reference.records and fast.steps == reference.steps
        assert to_json(fast.to_dict()) == to_json(reference.to_dict())
        assert final_pool(scenario, True) == final_pool(scenario, False)
        assert reference.summary.completed == 250
        preemptions.append(reference.summary.preemptions)
    assert min(preemptions) > 0  # every pool runs out: the fast path meets preemptions
