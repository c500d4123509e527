import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcap.metrics.summary import (
    _merge_neighbours,
    _merge_table,
    PERCENTILES,
    Distribution,
    MetricsAccumulator,
    _table_percentiles,
    binomial_cdf,
    early_stopping_min_queries,
    summarize,
)
from simcap.metrics.records import RequestRecord


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


@pytest.mark.parametrize("p", [0.001, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9])
def test_binomial_cdf_matches_scipy(p):
    from scipy.special import bdtr

    for n in (1, 2, 7, 64, 459, 2010, 100_000):
        for k in sorted({0, 1, 2, 10, n // 3, n - 1, n}):
            if k <= n:
                assert binomial_cdf(k, n, p) == pytest.approx(bdtr(k, n, p), rel=1e-9, abs=1e-300)


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


# ---------------------------------------------------------------- weighted samples, streaming


@st.composite
def tables(draw):
    """Small (value, count) tables: repeated values, one value, counts up to 50, many magnitudes."""
    # Full 52-bit mantissas too: simple floats interpolate exactly either way numpy's lerp goes.
    mantissa = st.builds(lambda m, e: (1 + m / 2**52) * 2.0**e, st.integers(0, 2**52 - 1), st.integers(-30, 20))
    magnitude = mantissa | st.floats(-1e6, 1e6, allow_nan=False) | st.floats(1e-9, 1e-3) | st.just(0.0)
    pool = draw(st.lists(magnitude, min_size=1, max_size=6))
    values = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=20))
    counts = draw(st.lists(st.integers(1, 50), min_size=len(values), max_size=len(values)))
    return np.array(values), np.array(counts)


@settings(max_examples=300, deadline=None)
@given(tables(), st.lists(st.floats(0, 100), min_size=1, max_size=6))
def test_weighted_percentiles_equal_numpy_bit_for_bit(table, qs):
    values, counts = table
    expanded = np.repeat(values, counts)
    d = Distribution.of_weighted(values, counts)
    expected = np.percentile(expanded, list(PERCENTILES.values()))
    assert [d.p50, d.p90, d.p95, d.p99] == expected.tolist()
    assert d.count == expanded.size and d.max == expanded.max()
    assert d == Distribution.of(expanded)
    order = np.argsort(values, kind="stable")
    v, c = values[order], counts[order]
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    got = _table_percentiles(v[starts], np.add.reduceat(c, starts), expanded.size, qs)
    assert got.tolist() == np.percentile(expanded, qs).tolist()


def test_weighted_percentiles_on_random_tables():
    rng = np.random.default_rng(0)
    lerp_sides_differ = 0
    for _ in range(500):
        size = int(rng.integers(1, 12))
        values = rng.choice(rng.uniform(0, 1, size) * 10.0 ** rng.integers(-6, 3, size), size)
        counts = rng.integers(1, 51, size)
        expanded = np.repeat(values, counts)
        d = Distribution.of_weighted(values, counts)
        assert [d.p50, d.p90, d.p95, d.p99] == np.percentile(expanded, [50, 90, 95, 99]).tolist()
        x = np.sort(expanded)
        for q in (50, 90, 95, 99):
            i, t = divmod((x.size - 1) * q / 100, 1)
            if i + 1 < x.size:
                a, b = x[int(i)], x[int(i) + 1]
                lerp_sides_differ += a + (b - a) * t != b - (b - a) * (1 - t)
    assert lerp_sides_differ  # the cases where numpy's choice of lerp formula matters are covered


def test_of_weighted_edge_cases():
    assert Distribution.of_weighted([], []) == Distribution(count=0)
    assert Distribution.of_weighted([0.5, 0.7], [0, 0]) == Distribution(count=0)
    d = Distribution.of_weighted([0.25, 0.75, 0.25], [2, 0, 1])  # unsorted, repeated, zero count
    assert d == Distribution.of(np.array([0.25, 0.25, 0.25]))
    assert d.mean == 0.25 and d.max == 0.25
    d = Distribution.of_weighted([0.1, 0.2], 64)  # one count for all values
    assert d.count == 128 and d.samples_adequate["p90"]
    with pytest.raises(ValueError):
        Distribution.of_weighted([0.1, 0.2], [1, -1])
    with pytest.raises(ValueError):
        Distribution.of_weighted([0.1, 0.2], [1, 2, 3])


def add_scalars(acc, r):
    """A record's per-request scalars, through add_request."""
    acc.add_request(
        r.request_id, r.arrival_time, first_token_time=r.first_token_time,
        finish_time=r.finish_time, scheduled_time=r.scheduled_time,
        num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
        num_preemptions=r.num_preemptions, num_cached_tokens=r.num_cached_tokens,
        succeeded=r.succeeded,
    )


def feed(acc, r):
    """What add_record does, through the two primitive calls (gaps one at a time)."""
    add_scalars(acc, r)
    if r.succeeded:
        for i in range(1, len(r.chunk_times)):
            acc.add_itl(r.chunk_times[i] - r.chunk_times[i - 1], tokens=r.chunk_tokens[i])


@st.composite
def mixed_records(draw):
    """Records with failures, unknown scheduled times, multi- and zero-token chunks, shared gaps."""
    gap = st.sampled_from([0.0, 0.01, 0.02, 0.125]) | st.floats(0, 1)
    out = []
    for i in range(draw(st.integers(0, 15))):
        arrival = draw(st.floats(0, 100))
        first = arrival + draw(st.floats(0, 10))
        gaps = draw(st.lists(gap, max_size=8))
        chunks = [float(t) for t in np.cumsum([first, *gaps])]
        tokens = [1] + draw(st.lists(st.integers(0, 4), min_size=len(gaps), max_size=len(gaps)))
        sched = draw(st.none() | st.just(arrival))
        r = rec(i, arrival, chunks, tokens=tokens, scheduled_time=sched,
                num_preemptions=draw(st.integers(0, 2)), num_cached_tokens=draw(st.integers(0, 64)))
        kind = draw(st.sampled_from(["ok", "ok", "ok", "error", "unfinished"]))
        if kind == "error":
            r.error = "boom"
        elif kind == "unfinished":
            r.finish_time = None
        out.append(r)
    return out


KW = dict(slo={"ttft_p95": 5.0, "tpot_mean": 0.1, "itl_p50": 0.05, "e2e_p99": 8.0}, kv_usage=([0, 1], [0.1, 0.3]))


@settings(max_examples=150, deadline=None)
@given(mixed_records(), st.randoms(use_true_random=False), st.integers(1, 7))
def test_summary_exactly_order_and_grouping_independent(rs, rnd, compact_at):
    expected = json.dumps(summarize(rs, **KW).to_dict())

    shuffled = list(rs)
    rnd.shuffle(shuffled)
    assert json.dumps(summarize(shuffled, **KW).to_dict()) == expected

    acc = MetricsAccumulator(compact_at=compact_at)  # merges the ITL tables many times
    for r in shuffled:
        acc.add_record(r)
    assert json.dumps(acc.summary(**KW).to_dict()) == expected

    # Requests one by one, their gaps separately, in another order, with equal gaps grouped.
    acc = MetricsAccumulator()
    rnd.shuffle(shuffled)
    for r in shuffled:
        add_scalars(acc, r)
    gaps = [
        (r.chunk_times[i] - r.chunk_times[i - 1], r.chunk_tokens[i])
        for r in rs if r.succeeded for i in range(1, len(r.chunk_times))
    ]
    groups: dict[tuple[float, int], int] = {}
    for g in gaps:
        groups[g] = groups.get(g, 0) + 1
    items = list(groups.items())
    rnd.shuffle(items)
    for (g, k), w in items:
        acc.add_itl(np.array([g]), weight=w, tokens=k)
    assert json.dumps(acc.summary(**KW).to_dict()) == expected


def test_split_weights_and_batches_give_the_same_summary():
    gaps = np.array([0.011, 0.013, 0.011, 0.2, 0.0123456789])
    tokens = np.array([1, 2, 0, 3, 1])

    def summary(feed_itl):
        acc = MetricsAccumulator()
        acc.add_request(0, 0.0, first_token_time=0.1, finish_time=1.0, scheduled_time=0.0,
                        num_prompt_tokens=10, num_output_tokens=20)
        feed_itl(acc)
        return json.dumps(acc.summary().to_dict())

    one = summary(lambda a: a.add_itl(gaps, weight=3, tokens=tokens))
    assert one == summary(lambda a: [a.add_itl(gaps, 1, tokens) for _ in range(3)])
    assert one == summary(lambda a: a.add_itl(np.repeat(gaps, 3), 1, np.repeat(tokens, 3)))
    assert one == summary(lambda a: [a.add_itl(g, 3, int(k)) for g, k in zip(gaps[::-1], tokens[::-1])])
    assert one == summary(lambda a: (a.add_itl(gaps, 2, tokens), a.add_itl(gaps[:2], 1, tokens[:2]),
                                     a.add_itl(gaps[2:], 1, tokens[2:])))


def test_add_itl_weights_and_tokens():
    acc = MetricsAccumulator()
    acc.add_request(0, 0.0, first_token_time=0.1, finish_time=1.0, scheduled_time=None,
                    num_prompt_tokens=10, num_output_tokens=20)
    acc.add_itl(0.3, weight=2, tokens=3)  # 2 chunks, 6 tokens of 0.1
    acc.add_itl([0.5, 0.7], weight=4, tokens=[0, 1])  # the zero-token chunk has no per-token ITL
    s = acc.summary()
    assert s.itl_s.count == 10 and s.itl_s.max == 0.7
    assert s.itl_per_token_s.count == 10
    assert s.itl_per_token_s.p50 == round(0.3 / 3, 9) and s.itl_per_token_s.max == 0.7
    values, counts = acc.itl_table()
    assert values.tolist() == [0.3, 0.5, 0.7] and counts.tolist() == [2, 4, 4]
    assert counts.dtype == np.int64
    for bad in (dict(weight=0), dict(tokens=-1), dict(tokens=[1, -1]), dict(tokens=[1, 2, 3])):
        with pytest.raises(ValueError):
            acc.add_itl([0.1, 0.2], **bad)
    with pytest.raises(TypeError):
        acc.add_itl([0.1], weight=1.5)
    assert acc.summary().to_dict() == s.to_dict()  # rejected calls added nothing
    acc.add_itl([], weight=2, tokens=[])
    acc.add_itl([0.4], weight=2, tokens=0)
    assert acc.summary().itl_s.count == 12 and acc.summary().itl_per_token_s.count == 10


@pytest.mark.parametrize("seed", range(4))
def test_add_shared_itl_is_add_itl_of_the_repeated_gaps(seed):
    """Gaps each seen by several requests, each with its own tokens (0 included), give the
    tables of the gaps repeated request by request."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 400))
    gaps = np.repeat(rng.choice([0.0125, 0.0131, 0.02, 0.0133333333333], m), rng.integers(1, 9, m))[:m]
    gaps = gaps + rng.random(m) * 1e-12  # equal to the nanosecond, not in their last bits
    sizes = rng.integers(1, 6, m)
    tokens = rng.integers(0 if seed % 2 else 1, 5, sizes.sum())
    shared, plain = MetricsAccumulator(compact_at=64), MetricsAccumulator()
    shared.add_shared_itl(gaps[: m // 2], sizes[: m // 2], tokens[: sizes[: m // 2].sum()])
    shared.add_shared_itl(gaps[m // 2:], sizes[m // 2:], tokens[sizes[: m // 2].sum():])
    plain.add_itl(np.repeat(gaps, sizes), 1, tokens)
    assert tables(shared) == tables(plain)
    assert shared.summary().to_dict() == plain.summary().to_dict()
    assert shared.summary().itl_s.count == sizes.sum()


def tables(acc):
    return [[x.tolist() for x in samples.table()] for samples in (acc._itl, acc._itl_token)]


@pytest.mark.parametrize("max_tokens", [4, 2000])  # counted per (gap, tokens) pair, or one by one
@pytest.mark.parametrize("weighted", [False, True])
def test_add_itl_with_tokens_per_gap_is_gap_by_gap(max_tokens, weighted):
    rng = np.random.default_rng(max_tokens)
    n = 300
    gaps = rng.choice([0.01, 0.0125, 0.02, 0.0], n) if max_tokens < 10 else rng.random(n) * 0.05
    gaps[:2] = -0.0, 0.0
    tokens = rng.integers(0, max_tokens + 1, n)
    weight = rng.integers(1, 5, n) if weighted else 2
    acc, one = MetricsAccumulator(), MetricsAccumulator()
    acc.add_itl(gaps, weight, tokens)
    for j in range(n):
        one.add_itl(gaps[j], int(weight[j]) if weighted else weight, int(tokens[j]))
    assert tables(acc) == tables(one)
    assert acc.summary().itl_per_token_s.count == (tokens * weight).sum()


def test_add_shared_itl_checks_its_input():
    acc = MetricsAccumulator()
    for bad in (
        ([0.1, 0.2], [1], [1]),  # one size per gap
        ([0.1, 0.2], [1, 0], [1]),  # every gap seen by at least one request
        ([0.1, 0.2], [1, 2], [1, 1]),  # one token count per request and gap
        ([0.1, 0.2], [1, 1], [1, -1]),
    ):
        with pytest.raises(ValueError):
            acc.add_shared_itl(*(np.array(x) for x in bad))
    acc.add_shared_itl(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert acc.summary().itl_s.count == 0


@pytest.mark.parametrize("counts", [1, 3, "array"])
def test_merge_neighbours_sums_each_run_of_equal_neighbours(counts):
    rng = np.random.default_rng(3)
    values = np.repeat(rng.choice([0.5, 0.25, 0.125], 200), rng.integers(1, 6, 200))
    c = rng.integers(1, 9, values.size) if counts == "array" else counts
    got_values, got_counts = _merge_neighbours(values, c)
    assert (got_values[1:] != got_values[:-1]).all()  # no two neighbours left equal
    assert got_counts.dtype == np.int64
    expanded = np.repeat(values, c if counts == "array" else np.full(values.size, c))
    assert np.repeat(got_values, got_counts).tolist() == expanded.tolist()
    # Nothing to merge, or too little to halve them: as they are.
    for few in (values[:0], values[:1], np.array([0.5, 0.25, 0.5]), np.array([0.5, 0.5, 0.25, 0.5])):
        v, n = _merge_neighbours(few, 2)
        assert v.tolist() == few.tolist() and n.tolist() == [2] * few.size


def test_add_itl_copies_its_input():
    acc = MetricsAccumulator()
    buf = np.array([0.1, 0.2])
    acc.add_itl(buf, 5)
    buf[:] = 9.0
    assert acc.itl_table()[0].tolist() == [0.1, 0.2]


def test_failed_record_adds_no_itl_but_counts_preemptions():
    acc = MetricsAccumulator()
    acc.add_record(rec(0, 0.0, [0.1, 0.2, 0.4], error="boom", num_preemptions=2, num_cached_tokens=8))
    s = acc.summary()
    assert s.completed == 0 and s.failed == 1
    assert s.itl_s.count == 0 and s.itl_per_token_s.count == 0 and s.ttft_s.count == 0
    assert s.preemptions == 2 and s.prefix_cache_hit_tokens == 8
    with pytest.raises(ValueError):
        acc.add_request(1, 0.0, first_token_time=None, finish_time=1.0, scheduled_time=None,
                        num_prompt_tokens=1, num_output_tokens=1)


def test_per_request_read_access_in_request_id_order():
    acc = MetricsAccumulator()
    acc.add_record(rec(2, 0.2, [0.5, 0.6]))
    acc.add_record(RequestRecord(request_id=0, arrival_time=0.0, num_prompt_tokens=5, max_tokens=5))
    acc.add_record(rec(1, 0.1, [0.3]))
    assert len(acc) == 3
    assert acc.request_ids.tolist() == [0, 1, 2]
    assert acc.arrival_times.tolist() == [0.0, 0.1, 0.2]
    assert acc.finish_times.tolist() == [np.inf, 0.3, 0.6]
    assert acc.itl_table()[0].tolist() == [round(0.6 - 0.5, 9)]


def test_summary_can_be_taken_while_streaming():
    rs = [rec(i, 0.01 * i, [0.1 + 0.01 * i, 0.2 + 0.02 * i, 0.25 + 0.03 * i], tokens=[1, 2, 1]) for i in range(30)]
    acc = MetricsAccumulator(compact_at=4)
    for r in rs[:10]:
        acc.add_record(r)
    assert acc.summary().to_dict() == summarize(rs[:10]).to_dict()
    for r in rs[10:]:
        acc.add_record(r)
    assert acc.summary(**KW).to_dict() == summarize(rs, **KW).to_dict()


def test_itl_samples_kept_to_the_nanosecond():
    """Gaps of a run of equal steps differ only by float rounding: they are one value."""
    times = np.cumsum(np.full(1000, 0.0043)) + 17.0
    gaps = np.diff(times)
    assert np.unique(gaps).size > 1  # float rounding makes them differ in the last bits
    acc = MetricsAccumulator()
    acc.add_itl(gaps, weight=7)
    values, counts = acc.itl_table()
    assert values.tolist() == [0.0043] and counts.tolist() == [999 * 7]
    acc.add_itl([0.00430000049, 0.0043000005001])
    assert acc.itl_table()[0].tolist() == [0.0043, 0.004300001]


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("decimals", [5, 3])
def test_merge_table_of_weighted_values_mostly_ascending_or_shuffled(shuffled, decimals):
    """Weighted values that mostly ascend (a stretch's gaps: stable sort) or come shuffled
    (numpy's default sort), with few or many runs of equal neighbours, give the table of the
    expanded samples."""
    rng = np.random.default_rng(7)
    runs = [np.sort(np.round(rng.random(rng.integers(1, 400)) * 0.05, decimals)) for _ in range(300)]
    values = np.concatenate(runs)
    if shuffled:
        values = rng.permutation(values)
    values[:3] = [-0.0, 0.0, -0.0]  # merge as one
    counts = rng.integers(0, 50, values.size)
    got_values, got_counts = _merge_table(values, counts)
    want_values, want_counts = np.unique(np.repeat(values + 0.0, counts), return_counts=True)
    assert got_values.tolist() == want_values.tolist()
    assert got_counts.tolist() == want_counts.tolist()


def test_simulator_token_counts_any_size():
    """The simulator's buffered token counts reach the metrics as int64, whatever their size."""
    from simcap.simulation.simulator import _token_counts

    for counts in ([], [0], [1, 4, 255], [1, 256, 3], [70000, 2]):
        got = _token_counts(counts)
        assert got.dtype == np.int64 and got.tolist() == counts


def test_simulator_stretch_gaps_hand_case():
    """Buffered decode stretches: ``add`` says how many times the buffer holds (what the
    flush threshold reads); ``take`` gives the gaps between chunks within each stretch (not
    start -> first chunk, nor across stretches) and the batch size of each, then empties."""
    from simcap.simulation.simulator import _StretchGaps

    buffer = _StretchGaps()
    assert buffer.add([0.0, 1.0, 3.0], 2) == 3  # start 0.0, chunks at 1.0 and 3.0
    assert buffer.add([5.0, 6.0, 8.0, 9.5], 1) == 7
    gaps, sizes = buffer.take()
    assert gaps.tolist() == [2.0, 2.0, 1.5]
    assert sizes.tolist() == [2, 1, 1]
    assert buffer.add([10.0, 10.25, 11.0], 4) == 3  # emptied by take
    gaps, sizes = buffer.take()
    assert gaps.tolist() == [0.75] and sizes.tolist() == [4]
