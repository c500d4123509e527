"""Records -> Summary: the one metrics path for simulated and live runs.

Both the simulator and the live client produce ``RequestRecord``s; this module turns a batch of
them into a ``Summary`` with the definitions ``vllm bench serve`` uses, so simulated and measured
numbers are computed identically.

Definitions (all times in seconds, per completed request, i.e. ``record.succeeded``):

- TTFT = first chunk time - arrival time.
- E2E = finish time - arrival time.
- TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
- Queue = first scheduled time - arrival time, where the record knows its scheduled time.
- ITL (per chunk) = every gap between consecutive stream chunks of a request, pooled over
  requests. One chunk is one engine step, so this is the field's ITL.
- ITL per token: a gap ``g`` whose later chunk carried ``k`` tokens contributes ``k`` samples of
  ``g / k``.

Percentiles use ``np.percentile``'s default linear interpolation, like ``vllm bench``. Each
distribution says whether its sample count is enough for a p90/p95/p99 claim by MLPerf loadgen's
early-stopping rule (confidence 0.99) allowing one query over the bound.

Goodput follows ``vllm bench``: a completed request is good when its own TTFT, TPOT and E2E are
each within the SLO targets named for those metrics (requests with one output token have no
TPOT and pass that check; ITL targets only apply to the run-level SLO check). ``fraction`` is
good requests over all requests (completed + failed), since a failed request is not good.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from simcap.records import RequestRecord

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
ADEQUACY = {"p90": 0.90, "p95": 0.95, "p99": 0.99}
SLO_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
SLO_STATS = ("mean", "p50", "p90", "p95", "p99")
GOODPUT_METRICS = ("ttft", "tpot", "e2e")


@functools.lru_cache(maxsize=None)
def early_stopping_min_queries(percentile: float, overlatency: int, confidence: float = 0.99) -> int:
    """Minimum query count N for a ``percentile`` claim with ``overlatency`` queries over the bound.

    MLPerf loadgen early stopping: the smallest N with
    ``binom.cdf(overlatency, N, 1 - percentile) <= 1 - confidence``.
    """
    from scipy.special import bdtr  # binomial CDF; scipy takes a while to import

    if not 0.0 < percentile < 1.0:
        raise ValueError(f"percentile must be in (0, 1), got {percentile}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if overlatency < 0:
        raise ValueError(f"overlatency must be >= 0, got {overlatency}")
    q, alpha = 1.0 - percentile, 1.0 - confidence

    def ok(n: int) -> bool:
        return bdtr(overlatency, n, q) <= alpha

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
        n = int(samples.size)
        if n == 0:
            return cls(count=0)
        pct = np.percentile(samples, list(PERCENTILES.values()))
        return cls(
            count=n,
            mean=float(np.mean(samples)),
            **{k: float(v) for k, v in zip(PERCENTILES, pct)},
            max=float(np.max(samples)),
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

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict with keys in field order."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Distribution):
                value = value.to_dict()
            elif isinstance(value, dict):
                value = {k: (dict(v) if isinstance(v, dict) else v) for k, v in value.items()}
            out[name] = value
        return out


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


def _kv_usage(kv_usage: tuple[Sequence[float], Sequence[float]]) -> dict[str, float | None]:
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


def summarize(
    records: Iterable[RequestRecord],
    *,
    slo: dict[str, float] | None = None,
    duration_s: float | None = None,
    kv_usage: tuple[Sequence[float], Sequence[float]] | None = None,
    spec_decode: dict[str, Any] | None = None,
) -> Summary:
    """Summarize request records into a ``Summary`` (see the module docstring for definitions).

    ``slo`` maps ``METRIC_STAT`` keys (e.g. ``"ttft_p95"``) to targets in seconds;
    ``duration_s`` overrides the run duration (default: last finish - first arrival of completed
    requests); ``kv_usage`` is a ``(times, usages)`` step series of KV-cache usage fractions;
    ``spec_decode`` holds the engine's speculative-decoding counters (simulated, or the server's
    Prometheus deltas in a live run), passed through unchanged.
    """
    done: list[RequestRecord] = []
    failed = preemptions = cached = 0
    for r in records:
        preemptions += r.num_preemptions
        cached += r.num_cached_tokens
        if r.succeeded:
            done.append(r)
        else:
            failed += 1
    n = len(done)

    arrival = np.fromiter((r.arrival_time for r in done), float, n)
    finish = np.fromiter((r.finish_time for r in done), float, n)
    sched = np.fromiter(
        (np.nan if r.scheduled_time is None else r.scheduled_time for r in done), float, n
    )
    prompt = np.fromiter((r.num_prompt_tokens for r in done), np.int64, n)
    lens = np.fromiter((len(r.chunk_times) for r in done), np.int64, n)
    total_chunks = int(lens.sum())
    times = np.fromiter(
        itertools.chain.from_iterable(r.chunk_times for r in done), float, total_chunks
    )
    tokens = np.fromiter(
        itertools.chain.from_iterable(r.chunk_tokens for r in done), np.int64, total_chunks
    )
    starts = np.cumsum(lens) - lens  # every completed record has >= 1 chunk

    out_tok = np.add.reduceat(tokens, starts) if n else np.zeros(0, np.int64)
    ttft = times[starts] - arrival
    e2e = finish - arrival
    multi = out_tok > 1
    tpot = (e2e[multi] - ttft[multi]) / (out_tok[multi] - 1)
    queue = (sched - arrival)[~np.isnan(sched)]

    # Gaps across record boundaries are not ITLs: drop the gap ending at each record's start.
    within = np.ones(max(total_chunks - 1, 0), dtype=bool)
    within[starts[1:] - 1] = False
    itl = np.diff(times)[within]
    k = tokens[1:][within]
    del times, tokens, within  # up to 1e8+ chunks: free memory before the per-token copy
    g = itl
    if not k.all():  # chunks without tokens contribute no per-token samples
        g, k = itl[k > 0], k[k > 0]
    itl_tok = np.repeat(g / k, k)

    output_tokens, input_tokens = int(out_tok.sum()), int(prompt.sum())
    if duration_s is None:
        duration_s = float(finish.max() - arrival.min()) if n else 0.0
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
        "itl_s": Distribution.of(itl),
        "itl_per_token_s": Distribution.of(itl_tok),
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
        preemptions=int(preemptions),
        prefix_cache_hit_tokens=int(cached),
        goodput=goodput,
        slo=slo_out,
        slo_pass=slo_pass,
        kv_cache_usage=(
            None if kv_usage is None else kv_usage if isinstance(kv_usage, dict) else _kv_usage(kv_usage)
        ),
        output_tokens=output_tokens,
        input_tokens=input_tokens,
        spec_decode=spec_decode,
    )
