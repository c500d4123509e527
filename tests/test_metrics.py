import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcap.metrics import Distribution, early_stopping_min_queries, summarize
from simcap.records import RequestRecord


def rec(rid, arrival, chunks, tokens=None, finish=None, prompt=10, **kw):
    r = RequestRecord(request_id=rid, arrival_time=arrival, num_prompt_tokens=prompt, max_tokens=100, **kw)
    for t, k in zip(chunks, tokens or [1] * len(chunks)):
        r.add_chunk(t, k)
    r.finish_time = chunks[-1] if finish is None and chunks else finish
    return r


def test_single_record_hand_case():
    s = summarize([rec(0, 0.0, [0.04, 0.05, 0.06], finish=0.06)])
    assert s.completed == 1 and s.failed == 0
    assert s.ttft_s.mean == pytest.approx(0.04)
    assert s.tpot_s.mean == pytest.approx(0.01)
    assert s.e2e_s.mean == pytest.approx(0.06)
    assert s.itl_s.count == 2
    assert s.itl_s.p50 == pytest.approx(0.01) and s.itl_s.max == pytest.approx(0.01)
    assert s.duration_s == pytest.approx(0.06)
    assert s.output_tokens == 3 and s.input_tokens == 10
    assert s.queue_s.count == 0 and s.queue_s.mean is None


def test_multi_token_chunk_itl():
    s = summarize([rec(0, 0.0, [0.1, 0.13], tokens=[1, 3])])
    assert s.itl_s.count == 1 and s.itl_s.mean == pytest.approx(0.03)
    assert s.itl_per_token_s.count == 3
    assert s.itl_per_token_s.mean == pytest.approx(0.01)
    assert s.itl_per_token_s.max == pytest.approx(0.01)
    assert s.tpot_s.mean == pytest.approx(0.01)


def test_itl_does_not_cross_records():
    s = summarize([rec(0, 0.0, [0.1, 0.2]), rec(1, 0.0, [5.0, 5.5])])
    assert s.itl_s.count == 2
    assert s.itl_s.mean == pytest.approx(0.3) and s.itl_s.max == pytest.approx(0.5)


def test_queue_and_percentiles():
    rs = [rec(i, 0.0, [1.0 + i], scheduled_time=0.1 * i) for i in range(5)]
    s = summarize(rs)
    assert s.queue_s.count == 5 and s.queue_s.mean == pytest.approx(0.2)
    assert s.ttft_s.p90 == pytest.approx(np.percentile([1, 2, 3, 4, 5], 90))
    assert s.tpot_s.count == 0 and s.tpot_s.p99 is None


def test_throughput_with_given_duration():
    rs = [rec(i, 0.0, [0.5, 1.0], tokens=[2, 3], prompt=100) for i in range(4)]
    s = summarize(rs, duration_s=2.0)
    assert s.duration_s == 2.0
    assert s.throughput == pytest.approx(
        {"requests_per_s": 2.0, "output_tokens_per_s": 10.0, "input_tokens_per_s": 200.0, "total_tokens_per_s": 210.0}
    )


def test_zero_records():
    s = summarize([])
    assert s.completed == 0 and s.duration_s == 0.0
    assert all(v == 0.0 for v in s.throughput.values())
    assert s.ttft_s == Distribution(count=0)
    json.dumps(s.to_dict())


def test_failed_records_not_counted():
    ok = rec(0, 0.0, [0.1, 0.2], num_preemptions=1, num_cached_tokens=16)
    err = rec(1, 0.0, [0.3], error="boom", num_preemptions=2, num_cached_tokens=32)
    unfinished = RequestRecord(request_id=2, arrival_time=0.0, num_prompt_tokens=5, max_tokens=5)
    s = summarize([ok, err, unfinished])
    assert s.completed == 1 and s.failed == 2
    assert s.ttft_s.count == 1 and s.ttft_s.mean == pytest.approx(0.1)
    assert s.output_tokens == 2 and s.input_tokens == 10
    assert s.preemptions == 3 and s.prefix_cache_hit_tokens == 48


def test_goodput_and_slo():
    rs = [rec(0, 0.0, [0.5, 0.6]), rec(1, 0.0, [3.0, 3.1])]
    s = summarize(rs, slo={"ttft_p50": 2.0, "tpot_mean": 0.2}, duration_s=4.0)
    assert s.goodput == {"requests_per_s": 0.25, "fraction": 0.5}
    assert s.slo["ttft_p50"]["value"] == pytest.approx(1.75)
    assert s.slo["ttft_p50"]["pass"] is True and s.slo["tpot_mean"]["pass"] is True
    assert s.slo["ttft_p50"]["samples_adequate"] is True
    assert s.slo_pass is True
    s2 = summarize(rs, slo={"ttft_p99": 2.0, "itl_p95": 1.0})
    assert s2.slo["ttft_p99"]["pass"] is False and s2.slo["itl_p95"]["pass"] is True
    assert s2.slo["ttft_p99"]["samples_adequate"] is False
    assert s2.slo_pass is False
    assert s2.goodput["fraction"] == 0.5


def test_goodput_single_token_passes_tpot_and_itl_ignored():
    rs = [rec(0, 0.0, [0.1]), rec(1, 0.0, [0.1, 5.0])]
    s = summarize(rs, slo={"tpot_p99": 0.5, "itl_p50": 0.0})
    assert s.goodput["fraction"] == 0.5
    assert s.slo["itl_p50"]["pass"] is False


def test_no_slo_and_bad_key():
    s = summarize([rec(0, 0.0, [0.1])])
    assert s.slo is None and s.slo_pass is None and s.goodput is None
    with pytest.raises(ValueError):
        summarize([rec(0, 0.0, [0.1])], slo={"ttft_p42": 1.0})


def test_empty_distribution_slo_fails():
    s = summarize([rec(0, 0.0, [0.1])], slo={"tpot_p50": 1.0})
    assert s.slo["tpot_p50"] == {"target": 1.0, "value": None, "pass": False, "samples_adequate": False}


TABLE = {0.90: (44, 64, 81, 197), 0.95: (90, 130, 165, 398), 0.99: (459, 662, 838, 2010)}


@pytest.mark.parametrize(
    "p,t,n", [(p, t, n) for p, ns in TABLE.items() for t, n in zip((0, 1, 2, 10), ns)]
)
def test_early_stopping_table(p, t, n):
    assert early_stopping_min_queries(p, t) == n


def test_adequacy_switches_at_64_for_p90():
    below = Distribution.of(np.linspace(0, 1, 63))
    at = Distribution.of(np.linspace(0, 1, 64))
    assert below.samples_adequate == {"p90": False, "p95": False, "p99": False}
    assert at.samples_adequate == {"p90": True, "p95": False, "p99": False}
    s = summarize([rec(i, 0.0, [0.1]) for i in range(64)])
    assert s.ttft_s.samples_adequate["p90"] is True
    s = summarize([rec(i, 0.0, [0.1]) for i in range(63)])
    assert s.ttft_s.samples_adequate["p90"] is False


def test_kv_usage_time_weighting():
    s = summarize([], kv_usage=([0, 1, 3], [0.5, 1.0, 0.2]))
    assert s.kv_cache_usage["mean"] == pytest.approx((0.5 * 1 + 1.0 * 2) / 3)
    assert s.kv_cache_usage["max"] == 1.0
    assert summarize([], kv_usage=(np.array([2.0]), np.array([0.3]))).kv_cache_usage == {"mean": 0.3, "max": 0.3}
    assert summarize([]).kv_cache_usage is None


def test_to_dict_layout_and_determinism():
    rs = [rec(i, 0.01 * i, [0.1 + 0.01 * i, 0.2 + 0.02 * i, 0.25 + 0.03 * i], tokens=[1, 2, 1], scheduled_time=0.02 * i) for i in range(50)]
    kw = dict(slo={"ttft_p95": 0.5, "e2e_mean": 2.0}, kv_usage=([0.0, 1.0], [0.1, 0.2]))
    d1 = summarize(rs, **kw).to_dict()
    d2 = summarize(list(rs), **kw).to_dict()
    assert json.dumps(d1) == json.dumps(d2)
    assert list(d1) == [
        "completed", "failed", "duration_s", "ttft_s", "tpot_s", "itl_s", "itl_per_token_s", "e2e_s",
        "queue_s", "throughput", "preemptions", "prefix_cache_hit_tokens", "goodput", "slo", "slo_pass",
        "kv_cache_usage", "output_tokens", "input_tokens", "spec_decode",
    ]
    assert list(d1["ttft_s"]) == ["count", "mean", "p50", "p90", "p95", "p99", "max", "samples_adequate"]

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        return x is None or type(x) in (int, float, bool, str)

    assert plain(d1)


@st.composite
def records(draw):
    out = []
    for i in range(draw(st.integers(1, 20))):
        arrival = draw(st.floats(0, 100))
        first = arrival + draw(st.floats(0, 10))
        gaps = draw(st.lists(st.floats(0, 1), max_size=8))
        chunks = list(np.cumsum([first, *gaps]))
        tokens = draw(st.lists(st.integers(1, 4), min_size=len(chunks), max_size=len(chunks)))
        out.append(rec(i, arrival, chunks, tokens=tokens))
    return out


@settings(max_examples=100, deadline=None)
@given(records())
def test_percentiles_ordered(rs):
    s = summarize(rs)
    for d in (s.ttft_s, s.tpot_s, s.itl_s, s.itl_per_token_s, s.e2e_s):
        if d.count:
            assert d.p50 <= d.p90 <= d.p95 <= d.p99 <= d.max
    assert all(summarize([r]).ttft_s.mean >= 0 for r in rs)


def test_zero_token_chunk_keeps_chunk_itl():
    s = summarize([rec(0, 0.0, [0.1, 0.2, 0.4], tokens=[1, 0, 2])])
    assert s.itl_s.count == 2
    assert s.itl_per_token_s.count == 2 and s.itl_per_token_s.mean == pytest.approx(0.1)
