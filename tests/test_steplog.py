"""The step log: rows kept or not, and the KV-usage reduction independent of how rows came."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simcap.simulation.steplog as steplog
from simcap.simulation.steplog import StepLog


USAGES = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.5]))  # (repeats: runs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-4, 1.0), USAGES), min_size=1, max_size=60),
    st.lists(st.integers(1, 9), min_size=1, max_size=30),
    st.booleans(),
    st.sampled_from([1, 2, 5, 7]),
)
def test_kv_usage_is_the_same_row_by_row_or_in_stretches(steps, cuts, keep, fold):
    """Rows one at a time against rows in stretches (every other one with its usages as runs
    of equal values, expanded when a block folds), folded every few rows, across stretch
    boundaries: the same figures."""
    old = steplog.FOLD_ROWS
    steplog.FOLD_ROWS = fold
    try:
        starts, t = [], 0.0
        for period, _ in steps:
            starts.append(t)
            t += period
        usages = [u for _, u in steps]
        one = StepLog(keep=keep)
        for s, u in zip(starts, usages):
            one.append(s, 0.01, 0, 3, 3, 3, 0, u, 0)
        many = StepLog(keep=keep)
        i = 0
        for cut in cuts * 60:
            if i >= len(starts):
                break
            j = min(i + cut, len(starts))
            if cut % 2:
                runs = [(u, len(list(g))) for u, g in itertools.groupby(usages[i:j])]
                many.extend_decode(starts[i:j], [0.01] * (j - i), [u for u, _ in runs], 3,
                                   counts=[c for _, c in runs])
            else:
                many.extend_decode(starts[i:j], [0.01] * (j - i), usages[i:j], 3)
            i = j
        assert one == many and one.kv_usage_summary() == many.kv_usage_summary()
        summary = one.kv_usage_summary()
        assert summary["max"] == max(usages)
        if len(starts) > 1:
            weights = [b - a for a, b in zip(starts, starts[1:])]
            expected = sum(w * u for w, u in zip(weights, usages)) / sum(weights)
            assert summary["mean"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    finally:
        steplog.FOLD_ROWS = old


def test_rows_kept_only_when_asked():
    kept, dropped = StepLog(keep=True), StepLog(keep=False)
    for log in (kept, dropped):
        log.append(0.0, 0.5, 100, 0, 1, 1, 0, 0.25, 0)
        log.extend_decode([0.5, 0.6], [0.1, 0.1], [0.5, 0.5], 1)
    arrays = kept.as_arrays()
    assert arrays["start"].tolist() == [0.0, 0.5, 0.6]
    assert arrays["num_prefill_tokens"].tolist() == [100, 0, 0]
    assert arrays["num_decode_tokens"].tolist() == [0, 1, 1]
    assert kept.kv_usage_summary() == dropped.kv_usage_summary() == {
        "mean": (0.25 * 0.5 + 0.5 * 0.1) / 0.6, "max": 0.5}
    assert len(dropped) == 3
    with pytest.raises(ValueError, match="steps=True"):
        dropped.as_arrays()
