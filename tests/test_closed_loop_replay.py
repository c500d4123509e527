"""Replaying a closed-loop run as a closed loop (:class:`simcap.workloads.requests.ClosedLoopTrace`)."""

from __future__ import annotations

import pytest

from simcap.fleet.run import simulate
from simcap.metrics.records import RequestRecord
from simcap.metrics.report import to_json
from simcap.workloads.requests import ClientRequest, ClosedLoopTrace, RequestSpec, Workload
from tests.conftest import make_scenario

STEP = 0.01  # every step costs 10 ms, whatever it holds


def _spec(i: int, prompt: int, out: int) -> RequestSpec:
    return RequestSpec(i, prompt, out, ((-2 * i - 1, prompt),))


def _closed(concurrency: int = 4, think: float = 0.0, step_scale: float = 1.0, **workload):
    wl = dict(arrival={"process": "closed", "concurrency": concurrency, "think_time_s": think},
              num_requests=60, input_len={"dist": "uniform", "low": 30, "high": 300},
              output_len={"dist": "uniform", "low": 5, "high": 40})
    wl.update(workload)
    return make_scenario(
        engine=dict(max_num_seqs=concurrency, max_num_batched_tokens=512),
        step_time=dict(base=0.004 * step_scale, per_prefill_token=2e-5 * step_scale,
                       per_decode_token=5e-4 * step_scale),
        workload=wl, seed=11,
    )


def test_two_clients_with_known_gaps_send_when_hand_computed():
    # Client 0: A (3 tokens) at 0, then B (2 tokens) 0.5 s after A ends. Client 1: C (2 tokens)
    # at 5 ms, then D (1 token) 0.1 s after C ends. Steps cost 10 ms: A prefills in [0, 10 ms]
    # (first token), C joins the next step; A's third and C's second token come at 30 ms, both
    # done. D is sent at 130 ms and done at 140 ms; B is sent at 530 ms and done at 550 ms.
    a, c, d, b = _spec(0, 20, 3), _spec(1, 20, 2), _spec(2, 20, 1), _spec(3, 20, 2)
    trace = ClosedLoopTrace((
        (ClientRequest(0.0, a), ClientRequest(0.5, b)),
        (ClientRequest(0.005, c), ClientRequest(0.1, d)),
    ))
    sc = make_scenario(step_time=dict(base=STEP, per_prefill_token=0.0, per_decode_token=0.0),
                       engine=dict(async_scheduling=False))
    recs = simulate(sc, trace=trace, records=True).records
    assert [r.request_id for r in recs] == [0, 1, 2, 3]
    assert [r.client_id for r in recs] == [0, 1, 1, 0]
    assert [r.arrival_time for r in recs] == pytest.approx([0.0, 0.005, 0.13, 0.53])
    assert recs[0].chunk_times == pytest.approx([0.01, 0.02, 0.03])
    assert recs[1].chunk_times == pytest.approx([0.02, 0.03])
    assert recs[2].chunk_times == pytest.approx([0.14])
    assert recs[3].chunk_times == pytest.approx([0.54, 0.55])
    assert [r.finish_time for r in recs] == pytest.approx([0.03, 0.03, 0.14, 0.55])


def test_a_slower_step_delays_the_next_send_instead_of_queueing_it():
    # The same two clients with steps twice as dear: every send moves with the responses.
    trace = ClosedLoopTrace(((ClientRequest(0.0, _spec(0, 20, 3)), ClientRequest(0.5, _spec(2, 20, 2))),
                             (ClientRequest(0.0, _spec(1, 20, 1)),)))
    sc = make_scenario(step_time=dict(base=2 * STEP, per_prefill_token=0.0, per_decode_token=0.0),
                       engine=dict(async_scheduling=False))
    recs = simulate(sc, trace=trace, records=True).records
    assert recs[2].arrival_time == pytest.approx(0.06 + 0.5)  # A ends after 3 steps of 20 ms
    assert recs[2].finish_time == pytest.approx(0.56 + 0.04)


@pytest.mark.parametrize("think", [0.0, 0.05])
@pytest.mark.parametrize("prefix", [None, {"num_prefixes": 3, "shared_tokens": 24}])
def test_replaying_a_simulated_closed_loop_run_reproduces_it_exactly(think, prefix):
    sc = _closed(think=think, **({"prefix": prefix} if prefix else {}))
    run = simulate(sc, records=True)
    assert sorted({r.client_id for r in run.records}) == [0, 1, 2, 3]
    wl = Workload(sc.workload, sc.seed)
    trace = ClosedLoopTrace.from_records(run.records, lambda rec, j: wl.spec(rec.request_id)._replace(request_id=j))
    assert [len(c) for c in trace.clients] == [sum(r.client_id == c for r in run.records) for c in range(4)]
    again = simulate(sc, trace=trace, records=True)
    assert again.records == run.records
    assert to_json(again.summary.to_dict()) == to_json(run.summary.to_dict())
    # Same inputs, same output; the reference path (one event per step) agrees.
    assert simulate(sc, trace=trace, records=True).records == again.records
    assert simulate(sc, trace=trace, records=True, fast=False).records == again.records


def test_fixed_send_times_inflate_ttft_where_the_closed_loop_replay_does_not():
    # At concurrency = max_num_seqs, a step model 5 % slower than the run it replays: at fixed
    # send times each request arrives before its client's previous response would have ended,
    # and queues behind a full engine; replayed as a closed loop it waits for nothing.
    sc = _closed(concurrency=8, num_requests=200)
    run = simulate(sc, records=True)
    wl = Workload(sc.workload, sc.seed)
    spec_of = lambda rec, j: wl.spec(rec.request_id)._replace(request_id=j)  # noqa: E731
    order = sorted(run.records, key=lambda r: (r.arrival_time, r.request_id))
    times = [(r.arrival_time, spec_of(r, j)) for j, r in enumerate(order)]
    closed = ClosedLoopTrace.from_records(run.records, spec_of)
    slow = _closed(concurrency=8, num_requests=200, step_scale=1.05)
    base = run.summary.ttft_s.p50
    at_times = simulate(slow, trace=times).summary.ttft_s.p50
    as_loop = simulate(slow, trace=closed).summary.ttft_s.p50
    assert at_times > 3 * base
    assert base <= as_loop < 1.15 * base


def test_records_without_client_ids_are_refused():
    sc = make_scenario(workload=dict(num_requests=3))
    run = simulate(sc, records=True)
    assert all(r.client_id is None for r in run.records)
    with pytest.raises(ValueError, match="client_id"):
        ClosedLoopTrace.from_records(run.records, lambda rec, j: _spec(j, 100, 10))


def test_gaps_are_measured_from_each_clients_previous_response():
    recs = [RequestRecord(0, 0.0, 10, 2, chunk_times=[0.1, 0.2], chunk_tokens=[1, 1], finish_time=0.2, client_id=0),
            RequestRecord(1, 0.01, 10, 1, chunk_times=[0.15], chunk_tokens=[1], finish_time=0.15, client_id=1),
            RequestRecord(2, 0.25, 10, 1, chunk_times=[0.3], chunk_tokens=[1], finish_time=0.3, client_id=0),
            RequestRecord(3, 0.2, 10, 1, error="boom", client_id=1),  # failed: left out
            RequestRecord(4, 0.4, 10, 1, chunk_times=[0.5], chunk_tokens=[1], finish_time=0.5, client_id=1)]
    trace = ClosedLoopTrace.from_records(recs, lambda rec, j: _spec(j, 10, rec.max_tokens))
    gaps = [[(round(g, 9), s.request_id) for g, s in c] for c in trace.clients]
    assert gaps == [[(0.0, 0), (0.05, 2)], [(0.01, 1), (0.25, 3)]]
    assert trace.num_requests == 4


def test_a_trace_names_each_request_once_with_finite_gaps():
    with pytest.raises(ValueError, match="0..N-1"):
        ClosedLoopTrace(((ClientRequest(0.0, _spec(0, 10, 1)),), (ClientRequest(0.0, _spec(2, 10, 1)),)))
    with pytest.raises(ValueError, match="gaps"):
        ClosedLoopTrace(((ClientRequest(-1.0, _spec(0, 10, 1)),),))
