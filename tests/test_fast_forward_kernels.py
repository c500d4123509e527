"""The fast paths' small kernels against hand-computed cases and against their plain
definitions (itertools.accumulate and bisect for the start times; every block event listed
and sorted for the KV blocks; list.count for the accepted drafts)."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from itertools import accumulate

from hypothesis import given
from hypothesis import strategies as st

from simcap.simulation.fast_forward import decode_starts, take_decode_blocks, usage_runs_by_step
from simcap.simulation.fast_verify import count_accepted


# --------------------------------------------------------------------------- decode_starts


def test_decode_starts_by_hand():
    # 0 -> 1.5 -> 3 -> 4.5: the step starting at 3.0 is the first at or after 2.5.
    starts = decode_starts([1.5, 1.5, 1.5, 1.5], 0.0, 2.5, 0)
    assert isinstance(starts, array) and starts.typecode == "d"
    assert list(starts) == [0.0, 1.5, 3.0]  # two steps run; the last entry is their end
    assert list(decode_starts([1.0, 2.0], 0.0, 10.0, 0)) == [0.0, 1.0, 3.0]  # none cut
    # A step from index lo runs whatever its start: with lo=1 the first always does.
    assert list(decode_starts([1.0, 1.0], 5.0, 5.0, 1)) == [5.0, 6.0]
    assert list(decode_starts([1.0, 1.0], 5.0, 5.0, 0)) == [5.0]
    assert list(decode_starts([], 2.0, 1.0, 0)) == [2.0]


def test_decode_starts_adds_one_step_at_a_time():
    # 0.1 + 0.2 + 0.3 in turn is not 0.6 in floats: the sum must be the running one.
    starts = decode_starts([0.1, 0.2, 0.3], 0.0, float("inf"), 0)
    assert list(starts) == list(accumulate([0.1, 0.2, 0.3], initial=0.0))
    assert starts[-1] == (0.1 + 0.2) + 0.3 != 0.6


@given(
    st.lists(st.floats(0.0, 10.0), max_size=40),
    st.floats(-5.0, 50.0),
    st.floats(-5.0, 400.0) | st.just(float("inf")),
    st.integers(0, 1),
)
def test_decode_starts_is_accumulate_cut_by_bisect(periods, t, horizon, lo):
    full = list(accumulate(periods, initial=t))
    m = bisect_left(full, horizon, min(lo, len(periods)), len(periods))
    assert list(decode_starts(periods, t, horizon, lo)) == full[: m + 1]


# --------------------------------------------------------------------------- take_decode_blocks


class _Req:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _by_events(running, needs, m, bs, free, scale):
    """The plain definition: every block event listed, sorted by (step, batch), cut where
    the pool runs out, then usage runs of the steps that run."""
    n = len(running)
    events = sorted(j * n + b for b, need in enumerate(needs) for j in range(max(need, 0), m, bs))
    if len(events) > free:
        m = events[free] // n
        del events[free:]
    usages, counts, _ = usage_runs_by_step(events, n, m, free, scale)
    return m, usages, counts, [running[e % n] for e in events]


def test_take_decode_blocks_by_hand():
    a, b, c = _Req("a"), _Req("b"), _Req("c")
    # bs 4 over 6 steps: a needs blocks at steps 2 and 6 (not run), b at 0 and 4, c at 1 and 5.
    runs, usages, counts, takers = take_decode_blocks([a, b, c], [2, -3, 1], 6, 4, 10, 100)
    assert runs == 6
    assert takers == [b, c, a, b, c]  # steps 0, 1, 2, 4, 5
    # free 10 -> 9 at step 0 -> 8 at 1 -> 7 at 2 -> 6 at 4 -> 5 at 5: usage after each step
    assert usages == [1 - 9 / 100, 1 - 8 / 100, 1 - 7 / 100, 1 - 6 / 100, 1 - 5 / 100]
    assert counts == [1, 1, 2, 1, 1]
    # With 3 free blocks the 4th (b's at step 4) is missing: steps 0-3 run.
    runs, usages, counts, takers = take_decode_blocks([a, b, c], [2, -3, 1], 6, 4, 3, 100)
    assert (runs, takers, counts) == (4, [b, c, a], [1, 1, 2])
    # Two requests needing a block in the same step take them in batch order; with one
    # free block, the second's is missing and that step does not run, the first keeps its.
    runs, usages, counts, takers = take_decode_blocks([a, b], [3, 3], 8, 16, 1, 10)
    assert (runs, takers, usages, counts) == (3, [a], [1 - 1 / 10], [3])
    # No block needed: one run of the current usage.
    assert take_decode_blocks([a], [9], 5, 16, 4, 10) == (5, [1 - 4 / 10], [5], [])


@given(
    st.integers(1, 6).flatmap(lambda n: st.tuples(
        st.lists(st.integers(-20, 40), min_size=n, max_size=n),
        st.integers(1, 60),  # steps
        st.sampled_from([1, 2, 3, 16]),  # block size
        st.integers(0, 30),  # free blocks
    ))
)
def test_take_decode_blocks_is_the_sorted_events(case):
    needs, m, bs, free = case
    running = [_Req(f"r{b}") for b in range(len(needs))]
    runs, usages, counts, takers = take_decode_blocks(running, list(needs), m, bs, free, 100)
    assert (runs, usages, counts, takers) == _by_events(running, needs, m, bs, free, 100)
    if runs:
        assert sum(counts) == runs and min(counts) >= 1


# --------------------------------------------------------------------------- count_accepted


def test_count_accepted_by_hand():
    hist = [7, 0, 1, 0]  # k = 3; index 0 is not touched
    count_accepted(hist, [1, 4, 2, 2, 1, 3, 4])  # tokens = accepted + 1
    assert hist == [7, 2, 2, 2]


@given(st.integers(1, 6).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(1, k + 1), max_size=200))
))
def test_count_accepted_is_list_count(case):
    k, news = case
    hist = [0] * (k + 1)
    count_accepted(hist, news)
    assert hist == [0] + [news.count(a + 1) for a in range(1, k + 1)]
