"""Property tests: the scheduler's invariants over random engines and workloads.

Checked after every step by ``check_step_invariants`` (conftest): budget never exceeded,
running <= max_num_seqs, free + referenced blocks == pool, computed tokens have KV slots.
Checked at the end: every request finishes with exactly its output length (token
conservation), first admissions follow arrival order (FCFS), and a run is deterministic.
"""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simcap.config.scenario import SpeculativeConfig
from simcap.engine.request import Request
from simcap.engine.scheduler import Scheduler
from simcap.engine.speculative import AcceptanceModel, Proposer
from simcap.fleet.run import simulate
from simcap.metrics.report import to_json
from tests.conftest import make_engine, make_scenario, run_to_completion

VERSIONS = st.sampled_from(["0.11", "0.23", "0.26", "0.32"])


@st.composite
def engine_and_requests(draw):
    block_size = draw(st.sampled_from([4, 8, 16]))
    max_model_len = draw(st.integers(32, 256))
    n = draw(st.integers(1, 12))
    prompts = draw(st.lists(st.integers(1, max_model_len - 1), min_size=n, max_size=n))
    outputs = [draw(st.integers(1, max_model_len - p)) for p in prompts]
    need = max(p + o for p, o in zip(prompts, outputs))
    min_blocks = -(-need // block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + 40))
    engine = make_engine(
        vllm_version=draw(VERSIONS),
        block_size=block_size,
        max_model_len=max_model_len,
        num_gpu_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 128)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5, 17])),
        enable_prefix_caching=draw(st.booleans()),
    )
    shared = draw(st.sampled_from([0, 0, block_size, 2 * block_size + 1]))
    requests = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        if shared and p > shared:
            segments = ((3, shared), (-2 * i - 1, p - shared))
        else:
            segments = None
        requests.append(Request(i, 0.0, p, o, segments))
    arrivals = sorted(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    spec = draw(st.sampled_from([None, None, "eagle3", "ngram"]))
    if spec is not None:
        k = draw(st.integers(1, 4))
        spec = SpeculativeConfig(method=spec, num_speculative_tokens=k,
                                 acceptance_length=draw(st.floats(1.0, k + 1.0)),
                                 proposal_rate=1.0 if spec == "eagle3" else 0.6)
    # Async scheduling (vLLM's takes EAGLE drafts, not ngram ones).
    asynchronous = (spec is None or spec.method == "eagle3") and draw(st.booleans())
    return engine, requests, arrivals, spec, asynchronous


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine_and_requests())
def test_scheduler_invariants_conservation_and_fcfs(case):
    engine, requests, arrivals, spec, asynchronous = case
    acceptance = proposer = None
    lookahead = 0
    if spec is not None:
        acceptance = AcceptanceModel.from_config(spec, np.random.default_rng(0))
        proposer = Proposer(spec, np.random.default_rng(1))
        lookahead = spec.num_lookahead_tokens
        if engine.kv_capacity_tokens < max(r.num_prompt_tokens + r.max_tokens for r in requests) + lookahead:
            return  # the pool must also hold the lookahead slots of one request
    scheduler = Scheduler(engine, num_lookahead_tokens=lookahead, async_scheduling=asynchronous)
    emitted, first_scheduled, _ = run_to_completion(
        scheduler, requests, arrivals, acceptance=acceptance, proposer=proposer
    )
    for req in requests:
        assert req.is_finished
        assert sum(emitted[req.request_id]) == req.max_tokens == req.num_output_tokens
        assert all(n >= 1 for n in emitted[req.request_id])
    assert first_scheduled == sorted(first_scheduled), "admission out of FCFS order"
    assert scheduler.kv.num_free_blocks == engine.num_gpu_blocks - 1
    assert not scheduler.kv.req_to_blocks


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    max_in = draw(st.integers(1, 300))
    max_out = draw(st.integers(1, 60))
    need = max_in + max_out
    arrival = draw(
        st.sampled_from(
            [
                {"process": "poisson", "rate": 20.0},
                {"process": "gamma", "rate": 50.0, "burstiness": 0.5},
                {"process": "closed", "concurrency": 3},
            ]
        )
    )
    return make_scenario(
        engine=dict(
            vllm_version=draw(VERSIONS),
            block_size=block_size,
            max_model_len=need + draw(st.integers(0, 64)),
            num_gpu_blocks=-(-need // block_size) + 1 + draw(st.integers(0, 30)),
            max_num_seqs=draw(st.integers(1, 8)),
            max_num_batched_tokens=draw(st.integers(8, 256)),
        ),
        step_time=dict(base=0.002, per_prefill_token=1e-5, per_decode_token=1e-4,
                       host_overhead=draw(st.sampled_from([0.0, 0.001]))),
        workload=dict(
            arrival=arrival,
            num_requests=draw(st.integers(1, 25)),
            input_len={"dist": "uniform", "low": 1, "high": max_in},
            output_len={"dist": "uniform", "low": 1, "high": max_out},
        ),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_simulated_records_are_causal_complete_and_deterministic(scenario):
    result = simulate(scenario, records=True)
    assert result.summary.completed == scenario.workload.num_requests
    for rec in result.records:
        assert rec.arrival_time <= rec.scheduled_time <= rec.first_token_time <= rec.finish_time
        assert rec.chunk_times == sorted(rec.chunk_times)
        assert rec.num_output_tokens == rec.max_tokens
    again = simulate(scenario)
    assert to_json(again.to_dict()) == to_json(result.to_dict())
    json.loads(to_json(result.to_dict()))
