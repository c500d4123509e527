"""Records -> Summary: the one metrics path for simulated and live runs.

Both the simulator and the live client produce ``RequestRecord``s; this module turns them into a
``Summary`` with the definitions ``vllm bench serve`` uses, so simulated and measured numbers are
computed identically. ``MetricsAccumulator`` is the streaming form: it takes each request's
scalars as the request finishes (``add_request``) and chunk gaps in bulk as weighted samples
(``add_itl``: a stretch of identical decode steps gives the same gaps to every request in the
batch), keeping the ITL samples as a sorted table of (value, count), so memory grows with the
number of distinct gaps, not of chunks. ITL samples are kept to the nanosecond
(:data:`ITL_RESOLUTION_S`): gaps that differ only by float rounding (a run of equal steps
gives gaps that differ in their last bits) count as one value, which keeps that table small
over millions of steps. Each batch is shrunk as it comes, in linear time: runs of equal gaps
merged, and gaps whose chunks carry token counts (``add_itl`` with tokens per gap;
``add_shared_itl``, gaps every request of a verify stretch sees, each with its own tokens)
counted per distinct (gap, tokens) pair, so the table is sorted over few entries, not over
every gap. ``summarize(records)`` feeds the records to one.

Definitions (all times in seconds, per completed request, i.e. ``record.succeeded``):

- TTFT = first chunk time - arrival time.
- E2E = finish time - arrival time.
- TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
- Queue = first scheduled time - arrival time, where the record knows its scheduled time.
- ITL (per chunk) = every gap between consecutive stream chunks of a request, pooled over
  requests. One chunk is one engine step, so this is the field's ITL.
- ITL per token: a gap ``g`` whose later chunk carried ``k`` tokens contributes ``k`` samples of
  ``g / k``.

Percentiles use ``np.percentile``'s default linear interpolation, like ``vllm bench``, computed
on the (value, count) table with the same result, bit for bit, as on the expanded samples. Means
are taken over the sorted table, so that a summary does not depend on the order in which
requests and gaps were added, nor on how gaps were grouped (it is identical, byte for byte).
Per-request statistics are over completed requests in request-id order. Each distribution says
whether its sample count is enough for a p90/p95/p99 claim by MLPerf loadgen's early-stopping
rule (confidence 0.99) allowing one query over the bound.

Sessions (multi-turn workloads, :mod:`simcap.workloads.sessions`): requests that carry a session id and
turn index also give, per turn index, the TTFT distribution and the prefix-hit share (cached
prompt tokens over prompt tokens), and per session its duration (first turn sent to last
answer's last token; sessions with every turn completed). The summary's ``sessions`` block
holds them with the counts of overflowing turns (``session_overflow``, from the workload).

Goodput follows ``vllm bench``: a completed request is good when its own TTFT, TPOT and E2E are
each within the SLO targets named for those metrics (requests with one output token have no
TPOT and pass that check; ITL targets only apply to the run-level SLO check). ``fraction`` is
good requests over all requests (completed + failed), since a failed request is not good.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from array import array
from dataclasses import dataclass, field
from math import nan
from typing import Any, Iterable, Sequence

import numpy as np

from simcap.metrics.records import RequestRecord

ITL_DECIMALS = 9  # ITL samples are rounded to this many decimals of a second
ITL_RESOLUTION_S = 10.0**-ITL_DECIMALS
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
ADEQUACY = {"p90": 0.90, "p95": 0.95, "p99": 0.99}
SLO_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
SLO_STATS = ("mean", "p50", "p90", "p95", "p99")
GOODPUT_METRICS = ("ttft", "tpot", "e2e")
# One request's row of MetricsAccumulator._times (array "d") and ._ints (array "q").
_PACK_TIMES = struct.Struct("=4d").pack
_PACK_INTS = struct.Struct("=4q").pack


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), 0 < p < 1: the sum of its terms, each in log space
    (no overflow for large n; every summary needs this, so it does not wait for scipy)."""
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(n + 1)
    return min(1.0, sum(
        math.exp(log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
        for i in range(min(k, n) + 1)
    ))


@functools.lru_cache(maxsize=None)
def early_stopping_min_queries(percentile: float, overlatency: int, confidence: float = 0.99) -> int:
    """Minimum query count N for a ``percentile`` claim with ``overlatency`` queries over the bound.

    MLPerf loadgen early stopping: the smallest N with
    ``binomial_cdf(overlatency, N, 1 - percentile) <= 1 - confidence``.
    """
    if not 0.0 < percentile < 1.0:
        raise ValueError(f"percentile must be in (0, 1), got {percentile}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if overlatency < 0:
        raise ValueError(f"overlatency must be >= 0, got {overlatency}")
    q, alpha = 1.0 - percentile, 1.0 - confidence

    def ok(n: int) -> bool:
        return binomial_cdf(overlatency, n, q) <= alpha

    lo, hi = overlatency, overlatency + 1  # cdf is 1 for n <= overlatency, so lo never passes
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: not ok(lo), ok(hi); cdf decreases in n
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of one latency distribution, in seconds (stats None when empty)."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    samples_adequate: dict[str, bool] = field(
        default_factory=lambda: {k: False for k in ADEQUACY}
    )

    @classmethod
    def of(cls, samples: np.ndarray) -> "Distribution":
        """Build from a 1-D array of samples."""
        values, counts = np.unique(np.asarray(samples, dtype=float), return_counts=True)
        return cls.of_weighted(values, counts)

    @classmethod
    def of_weighted(cls, values: np.ndarray, counts: np.ndarray) -> "Distribution":
        """Build from samples given as distinct ``values``, each seen ``counts`` times.

        Percentiles equal ``np.percentile`` of the expanded samples exactly; the mean is
        computed from the sorted table, so it does not depend on the order samples came in.
        """
        values, counts = _merge_table(values, counts)
        n = int(counts.sum())
        if n == 0:
            return cls(count=0)
        pct = _table_percentiles(values, counts, n, list(PERCENTILES.values()))
        return cls(
            count=n,
            mean=float((values * counts).sum() / n),
            **{k: float(v) for k, v in zip(PERCENTILES, pct)},
            max=float(values[-1]),
            samples_adequate={
                k: n >= early_stopping_min_queries(p, 1) for k, p in ADEQUACY.items()
            },
        )

    def stat(self, name: str) -> float | None:
        return getattr(self, name)

    def stat_adequate(self, name: str) -> bool:
        """Whether the sample count supports a claim about stat ``name``."""
        return self.samples_adequate[name] if name in ADEQUACY else self.count > 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict: count, mean, p50, p90, p95, p99, max, samples_adequate."""
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p95": self.p95,
            "p99": self.p99,
            "max": self.max,
            "samples_adequate": dict(self.samples_adequate),
        }


@dataclass(frozen=True)
class Summary:
    """Aggregate metrics of one run (simulated or live)."""

    completed: int
    failed: int
    duration_s: float
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    itl_per_token_s: Distribution
    e2e_s: Distribution
    queue_s: Distribution
    throughput: dict[str, float]
    preemptions: int
    prefix_cache_hit_tokens: int
    goodput: dict[str, float | None] | None
    slo: dict[str, dict[str, Any]] | None
    slo_pass: bool | None
    kv_cache_usage: dict[str, float | None] | None
    output_tokens: int
    input_tokens: int
    # vLLM's spec-decode counters and the mean acceptance length they give; None without drafts.
    spec_decode: dict[str, Any] | None = None
    # Multi-turn sessions: per turn and per session (see the module doc); None without.
    sessions: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict with keys in field order."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "sessions" and value is None:
                continue  # (a run without sessions prints as it did before they existed)
            if isinstance(value, Distribution):
                value = value.to_dict()
            elif isinstance(value, dict):
                value = {k: (dict(v) if isinstance(v, dict) else v) for k, v in value.items()}
            out[name] = value
        return out


# KV-cache usage of a run: a (step start times, usage fractions) series, or its already
# reduced {"mean", "max"} (time-weighted mean: each value holds until the next time).
KVUsage = tuple[Sequence[float], Sequence[float]] | dict[str, float | None]


def requests_running(summary: Summary) -> float | None:
    """Requests in the engine's batch on average over a run (Little's law: completed x mean
    time from first scheduled to finished / duration; a run that knows no queue time, a live
    one, counts from arrival). None for a run without completed requests or duration. How far
    a prediction reaches past the load its profile was fitted at is counted in it
    (``simcap.accuracy.model_form``)."""
    mean = summary.e2e_s.mean
    if not summary.completed or mean is None or not summary.duration_s:
        return None
    queued = summary.queue_s.mean if summary.queue_s.count else None
    return float(summary.completed * (mean - (queued or 0.0)) / summary.duration_s)


def _parse_slo(slo: dict[str, float]) -> list[tuple[str, str, str, float]]:
    parsed = []
    for key, target in slo.items():
        metric, _, stat = key.partition("_")
        if metric not in SLO_METRICS or stat not in SLO_STATS:
            raise ValueError(
                f"bad SLO key {key!r}: expected METRIC_STAT with METRIC in "
                f"{sorted(SLO_METRICS)} and STAT in {list(SLO_STATS)}"
            )
        parsed.append((key, metric, stat, float(target)))
    return parsed


def _kv_usage(kv_usage: KVUsage) -> dict[str, float | None]:
    if isinstance(kv_usage, dict):  # already reduced (the simulator's step log does it)
        return {"mean": kv_usage["mean"], "max": kv_usage["max"]}
    times = np.asarray(kv_usage[0], dtype=float)
    usages = np.asarray(kv_usage[1], dtype=float)
    if times.shape != usages.shape:
        raise ValueError("kv_usage times and usages must have the same length")
    if usages.size == 0:
        return {"mean": None, "max": None}
    if usages.size == 1:
        return {"mean": float(usages[0]), "max": float(usages[0])}
    # The last value has no following time, so it holds for zero duration.
    weights = np.diff(times)
    total = float(weights.sum())
    mean = float(np.dot(weights, usages[:-1]) / total) if total > 0 else float(usages.mean())
    return {"mean": mean, "max": float(usages.max())}


def _merge_neighbours(values: np.ndarray, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """``values`` with each run of equal neighbours made one entry, its counts summed (int64),
    when that at least halves them; else ``values`` as they are.

    ``counts``: one per value, or one int for all. A stretch of equal steps gives a run of
    equal gaps (each kept to the nanosecond), so this shrinks a batch of gaps many times over
    in one linear pass, before anything is sorted. Mostly distinct values (measured gaps)
    stay one by one: a few merges would not shorten their sort, and plain samples (counts of
    one) sort faster (see :func:`_merge_table`).
    """
    size = values.size
    if size < 2:
        counts = np.full(size, counts, dtype=np.int64) if np.ndim(counts) == 0 else counts
        return values, counts
    starts = np.flatnonzero(values[1:] != values[:-1])
    if np.ndim(counts) == 0:
        if (starts.size + 1) * 2 > size:
            return values, np.full(size, counts, dtype=np.int64)
        ends = np.append(starts, size - 1)
        lengths = np.diff(ends, prepend=-1).astype(np.int64, copy=False)
        return values[ends], lengths * counts if counts != 1 else lengths
    if (starts.size + 1) * 2 > size:
        return values, counts
    starts = np.concatenate(([0], starts + 1))
    return values[starts], np.add.reduceat(counts, starts)


def _merge_table(
    values: np.ndarray, counts: Any, *, sorted_runs: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A (value, count) table sorted by value, equal values merged, zero counts dropped.

    ``counts``: int64-able, one per value or one for all. ``sorted_runs``: the input is a few
    sorted runs (tables concatenated). Otherwise runs of equal neighbours are merged first
    (:func:`_merge_neighbours`), so that a sort sees each run once. Values that mostly ascend
    (fewer than one descent in eight: a run's gaps without noise, as periods grow with the
    context) are ordered by a stable sort, which merges runs in about linear time (2-5x
    faster there than numpy's default sort, which is faster on shuffled values). -0.0
    becomes 0.0, so that equal values merge to the same one whatever order they came in.
    """
    values = np.asarray(values, dtype=np.float64).ravel() + 0.0
    counts = np.asarray(counts, dtype=np.int64).ravel()
    if counts.size == 1:
        counts = np.full(values.shape, counts[0])
    if counts.shape != values.shape:
        raise ValueError(f"{counts.size} counts for {values.size} values")
    if counts.size and counts.min() < 0:
        raise ValueError("counts must be >= 0")
    if values.size > 1 and not (values[1:] > values[:-1]).all():
        if not sorted_runs and (counts == 1).all():  # plain samples: np.unique sorts faster
            values, counts = np.unique(values, return_counts=True)
        else:  # equal values merge, so their order does not matter
            if not sorted_runs:
                values, counts = _merge_neighbours(values, counts)
            runs = sorted_runs or np.count_nonzero(values[1:] < values[:-1]) * 8 < values.size
            order = np.argsort(values, kind="stable" if runs else None)
            values, counts = values[order], counts[order]
            starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
            if starts.size < values.size:
                values, counts = values[starts], np.add.reduceat(counts, starts)
    keep = counts > 0
    if not keep.all():
        values, counts = values[keep], counts[keep]
    return values, counts


def _table_percentiles(
    values: np.ndarray, counts: np.ndarray, n: int, percentiles: list[float]
) -> np.ndarray:
    """``np.percentile(np.repeat(values, counts), percentiles)``, bit for bit, without expanding.

    ``values`` sorted and distinct, ``counts`` > 0 summing to ``n``. Mirrors numpy's 'linear'
    method: virtual index ``(n - 1) * q``, neighbours at its floor and floor + 1 (both the last
    sample at or past the end, with the gap taken from index -1 as numpy does), and numpy's
    ``_lerp``, which computes ``b - (b - a) * (1 - t)`` where ``t >= 0.5``.
    """
    q = np.true_divide(percentiles, 100)
    virtual = (n - 1) * q
    prev = np.floor(virtual)
    nxt = prev + 1
    past_end = virtual >= n - 1
    prev[past_end] = -1
    nxt[past_end] = -1
    prev, nxt = prev.astype(np.intp), nxt.astype(np.intp)
    t = virtual - prev
    cum = np.cumsum(counts)  # sample i of the sorted expansion is values[first j with cum[j] > i]
    a = values[np.searchsorted(cum, np.where(prev < 0, n + prev, prev), side="right")]
    b = values[np.searchsorted(cum, np.where(nxt < 0, n + nxt, nxt), side="right")]
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)


class _WeightedSamples:
    """Samples kept as a sorted (value, count) table. Incoming batches come already shrunk
    (equal neighbours merged, or counted per distinct value) and are buffered; the buffer is
    merged into the table when it holds ``compact_at`` entries (or the table's size, so that
    a table of mostly distinct values is not re-merged too often), and on read."""

    def __init__(self, compact_at: int) -> None:
        self.compact_at = compact_at
        self.values = np.zeros(0)
        self.counts = np.zeros(0, dtype=np.int64)
        self._values: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []
        self._pending = 0

    def add(self, values: np.ndarray, counts: np.ndarray) -> None:
        """``values`` (1-D float64), each counted ``counts`` times (int64, one per value)."""
        self._values.append(values)
        self._counts.append(counts)
        self._pending += values.size
        if self._pending >= max(self.compact_at, self.values.size):
            self.compact()

    def compact(self) -> None:
        if not self._values:
            return
        values, counts = _merge_table(np.concatenate(self._values), np.concatenate(self._counts))
        self.values, self.counts = _merge_table(
            np.concatenate((self.values, values)),
            np.concatenate((self.counts, counts)),
            sorted_runs=True,
        )
        self._values, self._counts, self._pending = [], [], 0

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        self.compact()
        return self.values, self.counts

    def distribution(self) -> Distribution:
        return Distribution.of_weighted(*self.table())


class MetricsAccumulator:
    """Streaming form of summarize(): per-request scalars, ITLs as weighted samples.

    Feed each request once with ``add_request`` (or a whole record with ``add_record``) and its
    chunk gaps with ``add_itl``, in any order and grouping; ``summary`` gives the same
    ``Summary`` as ``summarize`` over the full records, byte for byte, whatever the order.
    Per-request values are kept as compact arrays (64 bytes a request); ITL samples as
    (value, count) tables, so their memory grows with the number of distinct values only.
    ``compact_at``: how many buffered ITL table entries (a batch's distinct values, or its
    runs of equal values) trigger a merge into the tables.
    """

    def __init__(self, *, compact_at: int = 1 << 20) -> None:
        # Per request, in arrival order of the calls; NaN stands for None.
        self._times = array("d")  # arrival, first token, finish, scheduled
        self._ints = array("q")  # request id, prompt tokens, output tokens, succeeded
        self._failed = 0
        self._preemptions = 0
        self._cached = 0
        self._itl = _WeightedSamples(compact_at)
        self._itl_token = _WeightedSamples(compact_at)
        # Session turns only: request id, session id, turn, cached prompt tokens.
        self._session_ints = array("q")

    def __len__(self) -> int:
        """Number of requests added."""
        return len(self._ints) // 4

    @classmethod
    def merged(cls, parts: Iterable["MetricsAccumulator"]) -> "MetricsAccumulator":
        """One accumulator holding everything ``parts`` hold (e.g. a fleet's replicas): its
        summary is the one of all their requests and samples fed to a single accumulator."""
        out = cls()
        for part in parts:
            out._times.extend(part._times)
            out._ints.extend(part._ints)
            out._session_ints.extend(part._session_ints)
            out._failed += part._failed
            out._preemptions += part._preemptions
            out._cached += part._cached
            for mine, theirs in ((out._itl, part._itl), (out._itl_token, part._itl_token)):
                values, counts = theirs.table()
                if values.size:
                    mine.add(values.copy(), counts.copy())  # (a table: no runs to merge)
        return out

    def add_request(
        self,
        request_id: int,
        arrival_time: float,
        *,
        first_token_time: float | None,
        finish_time: float | None,
        scheduled_time: float | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        num_preemptions: int = 0,
        num_cached_tokens: int = 0,
        succeeded: bool = True,
        session_id: int | None = None,
        turn: int | None = None,
    ) -> None:
        """One request's scalars. Preemptions and cached tokens count for failed requests too;
        a failed request gives no latency samples (and its gaps must not be fed to add_itl).
        ``session_id`` and ``turn``: the session turn it is, if any."""
        if succeeded:
            if first_token_time is None or finish_time is None:
                raise ValueError("a succeeded request needs first_token_time and finish_time")
        # (packed, then appended as bytes: a third cheaper than extending by tuples)
        times = _PACK_TIMES(
            arrival_time,
            nan if first_token_time is None else first_token_time,
            nan if finish_time is None else finish_time,
            nan if scheduled_time is None else scheduled_time,
        )
        ints = _PACK_INTS(request_id, num_prompt_tokens, num_output_tokens, 1 if succeeded else 0)
        if not succeeded:
            self._failed += 1
        self._times.frombytes(times)
        self._ints.frombytes(ints)
        self._preemptions += num_preemptions
        self._cached += num_cached_tokens
        if session_id is not None:
            if turn is None:
                raise ValueError("a session's request needs its turn index")
            self._session_ints.extend((request_id, session_id, turn, num_cached_tokens))

    def add_itl(
        self, gaps: float | np.ndarray, weight: int | np.ndarray = 1, tokens: int | Any = 1
    ) -> None:
        """Chunk gaps (seconds), each counted ``weight`` times (one int, or one per gap).

        ``tokens``: tokens carried by the later chunk of each gap (one int, or one per gap).
        Per chunk, each gap is one sample; per token, a gap ``g`` with ``k > 0`` tokens gives
        ``k`` samples of ``g / k``, and ``k == 0`` none.
        """
        # (np.round makes a copy: callers reuse their buffers)
        g = np.round(np.asarray(gaps, dtype=np.float64).ravel(), ITL_DECIMALS)
        if isinstance(weight, np.ndarray):
            weight = weight.astype(np.int64).ravel()
            if weight.shape != g.shape:
                raise ValueError(f"weight has {weight.size} entries for {g.size} gaps")
            if weight.size and weight.min() < 1:
                raise ValueError("weights must be >= 1")
        else:
            weight = operator.index(weight)
            if weight < 1:
                raise ValueError(f"weight must be >= 1, got {weight}")
        if isinstance(tokens, (int, np.integer)):
            k = int(tokens)
            if k < 0:
                raise ValueError(f"tokens must be >= 0, got {k}")
            if not g.size:
                return
            runs = _merge_neighbours(g, weight)
            self._itl.add(*runs)
            if k == 1:
                self._itl_token.add(*runs)
            elif k > 1:
                self._itl_token.add(*_merge_neighbours(np.round(g / k, ITL_DECIMALS), weight * k))
            return
        k = np.asarray(tokens, dtype=np.int64).ravel()
        if k.shape != g.shape:
            raise ValueError(f"tokens has {k.size} entries for {g.size} gaps")
        if k.size and k.min() < 0:
            raise ValueError("tokens must be >= 0")
        if g.size:
            self._add_with_tokens(g, None, k, weight)

    def add_shared_itl(self, gaps: np.ndarray, sizes: np.ndarray, tokens: np.ndarray) -> None:
        """Chunk gaps each seen by several requests: gap ``j`` by ``sizes[j]`` of them, with
        ``tokens`` the tokens of each one's later chunk, gap by gap (the ``sizes[0]`` of gap 0
        first). The samples of ``add_itl(np.repeat(gaps, sizes), 1, tokens)``, without
        repeating the gaps (a verify stretch's requests see the same gaps)."""
        g = np.round(np.asarray(gaps, dtype=np.float64).ravel(), ITL_DECIMALS)
        sizes = np.asarray(sizes, dtype=np.int64).ravel()
        k = np.asarray(tokens, dtype=np.int64).ravel()
        if sizes.shape != g.shape:
            raise ValueError(f"sizes has {sizes.size} entries for {g.size} gaps")
        if not g.size:
            return
        if sizes.min() < 1:
            raise ValueError("sizes must be >= 1")
        if k.size != sizes.sum():
            raise ValueError(f"tokens has {k.size} entries for {sizes.sum()} requests' gaps")
        if k.min() < 0:
            raise ValueError("tokens must be >= 0")
        self._add_with_tokens(g, sizes, k, 1)

    def _add_with_tokens(
        self, g: np.ndarray, sizes: np.ndarray | None, k: np.ndarray, weight: int | np.ndarray
    ) -> None:
        """Samples: gap ``g[j]`` seen ``sizes[j]`` times (once each when None), the s-th of
        them with ``k[s]`` tokens in its later chunk and counted ``weight`` times (one int, or
        one per sample). Gaps from steps of a few distinct periods (in runs of equal ones), in
        chunks of a few distinct token counts, are counted per distinct (gap, tokens) pair: a
        sort of the gaps' runs, then one linear count. Gaps mostly distinct (measured ones)
        are added sample by sample, to be sorted once when the table is merged."""
        change = g[1:] != g[:-1]
        num_runs = int(np.count_nonzero(change)) + 1
        width = int(k.max()) + 1
        if num_runs * 2 > k.size or width * num_runs > 8 * k.size + 65536:
            if sizes is not None:
                g = np.repeat(g, sizes)
            self._itl.add(*_merge_neighbours(g, weight))
            some = k > 0
            if not some.all():
                g, k = g[some], k[some]
                weight = weight[some] if isinstance(weight, np.ndarray) else weight
            if k.size:
                self._itl_token.add(*_merge_neighbours(np.round(g / k, ITL_DECIMALS), weight * k))
            return
        starts = np.flatnonzero(np.concatenate(([True], change)))
        values, which = np.unique(g[starts], return_inverse=True)  # (sorted, distinct)
        which = which[np.cumsum(np.concatenate(([0], change)))]  # each gap's value
        if sizes is not None:
            which = np.repeat(which, sizes)
        key = k * values.size + which
        if isinstance(weight, np.ndarray):
            seen = np.zeros(width * values.size, dtype=np.int64)
            np.add.at(seen, key, weight)
        else:
            seen = np.bincount(key, minlength=width * values.size) * weight
        # seen[k, i]: the samples of gap values[i] whose later chunk carried k tokens.
        seen = seen.reshape(width, values.size)
        self._itl.add(values, seen.sum(axis=0))
        k, i = np.nonzero(seen[1:])  # (no per-token sample without tokens)
        if k.size:
            k += 1
            self._itl_token.add(np.round(values[i] / k, ITL_DECIMALS), seen[k, i] * k)

    def add_record(self, record: RequestRecord) -> None:
        """A full record: its scalars, and the gaps between its chunks if it succeeded."""
        self.add_records((record,))

    def add_records(self, records: Iterable[RequestRecord]) -> None:
        """Full records, as ``add_record`` on each, with their gaps fed in large batches."""
        times: list[float] = []
        tokens: list[int] = []
        lens: list[int] = []
        for r in records:
            succeeded = r.succeeded
            self.add_request(
                r.request_id,
                r.arrival_time,
                first_token_time=r.first_token_time,
                finish_time=r.finish_time,
                scheduled_time=r.scheduled_time,
                num_prompt_tokens=r.num_prompt_tokens,
                num_output_tokens=r.num_output_tokens,
                num_preemptions=r.num_preemptions,
                num_cached_tokens=r.num_cached_tokens,
                succeeded=succeeded,
                session_id=r.session_id,
                turn=r.turn,
            )
            if succeeded:
                times += r.chunk_times
                tokens += r.chunk_tokens
                lens.append(len(r.chunk_times))
                if len(times) >= self._itl.compact_at:
                    self._add_chunks(times, tokens, lens)
                    times, tokens, lens = [], [], []
        self._add_chunks(times, tokens, lens)

    def _add_chunks(self, times: list[float], tokens: list[int], lens: list[int]) -> None:
        """The gaps within each of several requests whose chunk lists are concatenated."""
        if len(times) == len(lens):  # at most one chunk each: no gaps
            return
        gaps = np.diff(np.array(times))
        within = np.ones(gaps.size, dtype=bool)  # not the gap into a request's first chunk
        within[np.cumsum(lens[:-1], dtype=np.intp) - 1] = False
        self.add_itl(gaps[within], 1, np.array(tokens[1:], dtype=np.int64)[within])

    # ------------------------------------------------------------------ read access

    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, ints) as (requests, 4) arrays in the order requests were added (no copy)."""
        times = np.frombuffer(self._times, dtype=np.float64).reshape(-1, 4)
        ints = np.frombuffer(self._ints, dtype=np.int64).reshape(-1, 4)
        return times, ints

    def _by_id(self, column: int) -> np.ndarray:
        """One column of ``_times`` for every request, in request-id order."""
        times, ints = self._table()
        return times[np.argsort(ints[:, 0], kind="stable"), column]

    @property
    def request_ids(self) -> np.ndarray:
        """Request ids of every request added, sorted."""
        return np.sort(self._table()[1][:, 0])

    @property
    def arrival_times(self) -> np.ndarray:
        """Arrival times of every request, in request-id order."""
        return self._by_id(0)

    @property
    def finish_times(self) -> np.ndarray:
        """Finish times of every request, in request-id order; np.inf where not finished."""
        finish = self._by_id(2)
        finish[np.isnan(finish)] = np.inf
        return finish

    @property
    def num_output_tokens(self) -> np.ndarray:
        """Output tokens of every request, in request-id order."""
        _, ints = self._table()
        return ints[np.argsort(ints[:, 0], kind="stable"), 2]

    def completed_latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """(TTFT, E2E) of the completed requests, in the order they were added, computed as
        the summary computes them."""
        times, ints = self._table()
        done = ints[:, 3] != 0
        arrival = times[done, 0]
        return times[done, 1] - arrival, times[done, 2] - arrival

    def itl_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-chunk ITL samples as (sorted distinct values, int64 counts)."""
        values, counts = self._itl.table()
        return values.copy(), counts.copy()

    # ------------------------------------------------------------------ summary

    def summary(
        self,
        *,
        slo: dict[str, float] | None = None,
        duration_s: float | None = None,
        kv_usage: KVUsage | None = None,
        spec_decode: dict[str, Any] | None = None,
        session_overflow: dict[str, int] | None = None,
    ) -> Summary:
        """The ``Summary`` of everything added so far; arguments as for ``summarize``."""
        times, ints = self._table()
        done = np.flatnonzero(ints[:, 3])
        done = done[np.argsort(ints[done, 0], kind="stable")]  # completed, in request-id order
        n, failed = done.size, self._failed
        # One column at a time, to keep the peak memory of a million requests low.
        arrival = times[done, 0]
        ttft = times[done, 1] - arrival
        e2e = times[done, 2] - arrival
        queue = times[done, 3] - arrival
        queue = queue[~np.isnan(queue)]  # NaN: scheduled time unknown
        out_tok = ints[done, 2]
        multi = out_tok > 1
        tpot = (e2e[multi] - ttft[multi]) / (out_tok[multi] - 1)

        output_tokens, input_tokens = int(out_tok.sum()), int(ints[done, 1].sum())
        if duration_s is None:
            duration_s = float(times[done, 2].max() - arrival.min()) if n else 0.0
        duration_s = float(duration_s)

        def rate(x: float) -> float:
            return float(x / duration_s) if duration_s > 0 else 0.0

        throughput = {
            "requests_per_s": rate(n),
            "output_tokens_per_s": rate(output_tokens),
            "input_tokens_per_s": rate(input_tokens),
            "total_tokens_per_s": rate(output_tokens + input_tokens),
        }
        dists = {
            "ttft_s": Distribution.of(ttft),
            "tpot_s": Distribution.of(tpot),
            "itl_s": self._itl.distribution(),
            "itl_per_token_s": self._itl_token.distribution(),
            "e2e_s": Distribution.of(e2e),
            "queue_s": Distribution.of(queue),
        }

        slo_out = goodput = slo_pass = None
        if slo:
            parsed = _parse_slo(slo)
            slo_out = {}
            for key, metric, stat, target in parsed:
                dist = dists[SLO_METRICS[metric]]
                value = dist.stat(stat)
                slo_out[key] = {
                    "target": target,
                    "value": value,
                    "pass": value is not None and value <= target,
                    "samples_adequate": dist.stat_adequate(stat),
                }
            slo_pass = all(v["pass"] for v in slo_out.values())

            per_request = {"ttft": ttft, "e2e": e2e}
            tpot_full = np.full(n, np.nan)
            tpot_full[multi] = tpot
            per_request["tpot"] = tpot_full
            good = np.ones(n, dtype=bool)
            for _, metric, _, target in parsed:
                if metric in GOODPUT_METRICS:
                    # NaN (no TPOT) compares False against the target, so it passes this check.
                    good &= ~(per_request[metric] > target)
            n_good = int(good.sum())
            total = n + failed
            goodput = {
                "requests_per_s": rate(n_good),
                "fraction": float(n_good / total) if total else None,
            }

        return Summary(
            completed=n,
            failed=failed,
            duration_s=duration_s,
            **dists,
            throughput=throughput,
            preemptions=int(self._preemptions),
            prefix_cache_hit_tokens=int(self._cached),
            goodput=goodput,
            slo=slo_out,
            slo_pass=slo_pass,
            kv_cache_usage=None if kv_usage is None else _kv_usage(kv_usage),
            output_tokens=output_tokens,
            input_tokens=input_tokens,
            spec_decode=spec_decode,
            sessions=self._sessions(session_overflow),
        )

    def _sessions(self, overflow: dict[str, int] | None) -> dict[str, Any] | None:
        """The summary's ``sessions`` block (see the module doc); None without session turns."""
        if not self._session_ints and overflow is None:
            return None
        times, ints = self._table()
        sess = np.frombuffer(self._session_ints, dtype=np.int64).reshape(-1, 4)
        sess = sess[np.argsort(sess[:, 0], kind="stable")]  # request-id order
        order = np.argsort(ints[:, 0], kind="stable")
        rows = order[np.searchsorted(ints[order, 0], sess[:, 0])]
        done = ints[rows, 3] != 0
        arrival, first, finish = times[rows, 0], times[rows, 1], times[rows, 2]
        prompt = ints[rows, 1]
        session_ids, turns, cached = sess[:, 1], sess[:, 2], sess[:, 3]

        def share(mask: np.ndarray) -> float | None:
            total = int(prompt[mask].sum())
            return float(cached[mask].sum() / total) if total else None

        by_turn = []
        for k in np.unique(turns).tolist():
            at = turns == k
            ok = at & done
            by_turn.append({
                "turn": int(k),
                "requests": int(ok.sum()),
                "ttft_s": Distribution.of(first[ok] - arrival[ok]).to_dict(),
                "mean_prompt_tokens": float(prompt[ok].mean()) if ok.any() else None,
                "prefix_hit_share": share(ok),
            })
        # Sessions: first send to last answer's end, over sessions with every turn completed.
        order = np.argsort(session_ids, kind="stable")
        ids, firsts = np.unique(session_ids[order], return_index=True)
        if ids.size:
            start = np.minimum.reduceat(arrival[order], firsts)
            end = np.maximum.reduceat(np.where(done, finish, -np.inf)[order], firsts)
            complete = np.logical_and.reduceat(done[order], firsts)
            turns_per = np.diff(np.append(firsts, order.size))
        else:
            start = end = np.zeros(0)
            complete = np.zeros(0, dtype=bool)
            turns_per = np.zeros(0, dtype=np.int64)
        return {
            "sessions": int(ids.size),
            "completed_sessions": int(complete.sum()),
            "turns": int(turns.size),
            "mean_turns": float(turns_per.mean()) if ids.size else None,
            "prefix_hit_share": share(done),
            "duration_s": Distribution.of(end[complete] - start[complete]).to_dict(),
            "by_turn": by_turn,
            **(dict(overflow) if overflow else {}),
        }


def summarize(
    records: Iterable[RequestRecord],
    *,
    slo: dict[str, float] | None = None,
    duration_s: float | None = None,
    kv_usage: KVUsage | None = None,
    spec_decode: dict[str, Any] | None = None,
    session_overflow: dict[str, int] | None = None,
) -> Summary:
    """Summarize request records into a ``Summary`` (see the module docstring for definitions).

    ``slo`` maps ``METRIC_STAT`` keys (e.g. ``"ttft_p95"``) to targets in seconds;
    ``duration_s`` overrides the run duration (default: last finish - first arrival of completed
    requests); ``kv_usage`` is a ``(times, usages)`` step series of KV-cache usage fractions
    (or its reduced ``{"mean", "max"}``);
    ``spec_decode`` holds the engine's speculative-decoding counters (simulated, or the server's
    Prometheus deltas in a live run), passed through unchanged; ``session_overflow`` the
    session workload's counts of overflowing turns (``truncated_turns``, ``dropped_turns``,
    ``ended_sessions``), reported in the ``sessions`` block.
    """
    acc = MetricsAccumulator()
    acc.add_records(records)
    return acc.summary(
        slo=slo, duration_s=duration_s, kv_usage=kv_usage, spec_decode=spec_decode,
        session_overflow=session_overflow,
    )
