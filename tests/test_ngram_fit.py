"""The ngram proposal fit: match-probability spread over requests from per-step drafting counts."""

from __future__ import annotations

import numpy as np
import pytest

from simcap.calibrate.ngram import fit_proposal_concentration


def step_rows(probabilities, steps_per_batch, rng, k=3, batches=40):
    """Batches of requests with their own match probabilities, each batch decoding for a
    while (the log's rows: one prefill step joining the batch, then pure-decode steps whose
    verified tokens are k per request that drafted after the step before)."""
    rows = []
    n = 8
    for _ in range(batches):
        p = rng.choice(probabilities, size=n)
        rows.append({"num_prefill_reqs": n, "num_decode_reqs": 0, "num_verify_tokens": 0})
        for _ in range(steps_per_batch):
            drafted = int((rng.random(n) < p).sum())
            rows.append({"num_prefill_reqs": 0, "num_decode_reqs": n, "num_verify_tokens": k * drafted})
    return rows


def test_a_spread_of_requests_gives_its_concentration_back():
    # Nothing accepted (a = 0): steps weigh every request alike, so the step variance is the
    # Beta's, rate (1 - rate) / (c + 1).
    rng = np.random.default_rng(0)
    c, rate = 0.5, 0.4
    probabilities = rng.beta(rate * c, (1 - rate) * c, size=5000)
    rows = step_rows(probabilities, 60, rng, batches=400)  # 3200 requests: the spread's noise
    fit = fit_proposal_concentration(rows, float(probabilities.mean()), 3.0, 0.0)
    assert fit["pairs"] == 400 * 59
    assert fit["step_variance"] == pytest.approx(rate * (1 - rate) / (c + 1), rel=0.15)
    assert fit["concentration"] == pytest.approx(c, rel=0.35)


def test_requests_alike_give_no_concentration():
    rng = np.random.default_rng(1)
    rows = step_rows(np.array([0.4]), 60, rng)
    fit = fit_proposal_concentration(rows, 0.4, 3.0, 2.0)
    # Every request at the rate: the covariance is noise around 0, so either no spread
    # or a concentration so large that the Beta is a point.
    assert fit["concentration"] is None or fit["concentration"] > 20


def test_too_few_pure_decode_pairs_give_none():
    rows = [{"num_prefill_reqs": 1, "num_decode_reqs": 2, "num_verify_tokens": 3}] * 100
    fit = fit_proposal_concentration(rows, 0.5, 3.0, 1.0)
    assert fit["concentration"] is None and fit["pairs"] == 0


def request_alone(pattern: str, k=3):
    """A request alone in the log: its prefill step, then one decode step per character
    (``.`` no drafts verified, a digit: that many drafts)."""
    rows = [{"num_prefill_reqs": 1, "num_decode_reqs": 0, "num_verify_tokens": 0}]
    rows += [{"num_prefill_reqs": 0, "num_decode_reqs": 1, "num_verify_tokens": 0 if ch == "." else int(ch)}
             for ch in pattern]
    return rows


def test_onset_is_the_median_token_count_of_the_first_match():
    from simcap.calibrate.ngram import fit_proposal_onset, rows_after_onset

    # Drafts first verified in decode steps 5, 5, 6, 8: proposed at 5, 5, 6, 8 tokens; one
    # request never drafted.
    rows = (request_alone("....1333") + request_alone("....13") + request_alone(".....2333")
            + request_alone(".......3") + request_alone("......"))
    fit = fit_proposal_onset(rows)
    assert fit["onset_tokens"] == 5 and fit["requests"] == 4 and fit["never_drafted"] == 1
    after = rows_after_onset(rows, 5)
    verify = [r["num_verify_tokens"] for r in after if not r["num_prefill_reqs"]]
    assert verify == [1, 3, 3, 3] + [1, 3] + [0, 2, 3, 3, 3] + [0, 0, 0, 3] + [0, 0]


def test_a_request_cut_short_by_another_is_not_counted_as_never_drafting():
    from simcap.calibrate.ngram import fit_proposal_onset

    rows = request_alone("...") + [{"num_prefill_reqs": 1, "num_decode_reqs": 1, "num_verify_tokens": 0}]
    assert fit_proposal_onset(rows)["never_drafted"] == 0


def test_onset_from_stream_chunks():
    from simcap.calibrate.ngram import onset_from_records
    from simcap.metrics.records import RequestRecord

    def rec(i, tokens):
        return RequestRecord(i, 0.0, 16, sum(tokens), chunk_times=[1.0] * len(tokens), chunk_tokens=tokens,
                             finish_time=2.0)

    # First multi-token chunks after 5, 5, 7 tokens; one request never drafted.
    records = [rec(0, [1, 1, 1, 1, 1, 4, 4]), rec(1, [1, 1, 1, 1, 1, 2, 4]), rec(2, [1] * 7 + [4]),
               rec(3, [1] * 9)]
    fit = onset_from_records(records)
    assert fit["onset_tokens"] == 5 and fit["requests"] == 3
