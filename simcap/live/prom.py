"""The server's own view: scrape vLLM's Prometheus ``/metrics`` and compare snapshots.

A :class:`ServerMetrics` snapshot holds every counter (summed over label sets, keyed by the
family name without ``_total``), histogram sums and counts, gauges, and the labels of
``vllm:cache_config_info``. :func:`metrics_delta` turns two snapshots into what happened in
between (tokens, preemptions, prefix-cache hits, speculative decoding acceptance), and
:func:`cross_check` sets the client's token totals against the server's counters as relative
differences: a mismatch is reported, never hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from simcap.metrics.records import RequestRecord

COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
)


@dataclass
class ServerMetrics:
    """One scrape of ``/metrics``."""

    time: float  # time.time() of the scrape
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histogram_sum: dict[str, float] = field(default_factory=dict)
    histogram_count: dict[str, float] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)
    success_by_reason: dict[str, float] = field(default_factory=dict)
    # vllm:spec_decode_num_accepted_tokens_per_pos, by draft position (0-based): present only
    # on a server with speculative decoding; its positions give k.
    spec_accepted_per_pos: dict[int, float] = field(default_factory=dict)
    # The exposition text this snapshot was parsed from (kept so a recorded run holds the
    # server's whole /metrics, histogram buckets included); None when built otherwise.
    text: str | None = field(default=None, repr=False, compare=False)

    @property
    def num_speculative_tokens(self) -> int | None:
        """k of a drafting server (its per-position acceptance counters), else None."""
        return max(self.spec_accepted_per_pos) + 1 if self.spec_accepted_per_pos else None

    def counter(self, name: str) -> float | None:
        return self.counters.get(name)

    @property
    def block_size(self) -> int | None:
        return _int(self.cache_config.get("block_size"))

    @property
    def num_gpu_blocks(self) -> int | None:
        return _int(self.cache_config.get("num_gpu_blocks"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "counters": dict(self.counters),
            "gauges": dict(self.gauges),
            "histogram_sum": dict(self.histogram_sum),
            "histogram_count": dict(self.histogram_count),
            "cache_config": dict(self.cache_config),
            "success_by_reason": dict(self.success_by_reason),
            "spec_accepted_per_pos": {str(k): v for k, v in sorted(self.spec_accepted_per_pos.items())},
        }


def _int(value: Any) -> int | None:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def parse_metrics(text: str, when: float | None = None) -> ServerMetrics:
    """Parse Prometheus text exposition into a snapshot (all label sets summed)."""
    snap = ServerMetrics(time=time.time() if when is None else when, text=text)
    for family in text_string_to_metric_families(text):
        name, kind = family.name, family.type
        if name == "vllm:cache_config_info":
            for sample in family.samples:
                snap.cache_config.update({k: str(v) for k, v in sample.labels.items()})
            continue
        for sample in family.samples:
            sname, value = sample.name, float(sample.value)
            if kind == "counter":
                if sname != name + "_total":
                    continue  # skip _created
                snap.counters[name] = snap.counters.get(name, 0.0) + value
                if name == "vllm:request_success":
                    reason = sample.labels.get("finished_reason", "")
                    snap.success_by_reason[reason] = snap.success_by_reason.get(reason, 0.0) + value
                elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                    pos = _int(sample.labels.get("position"))
                    if pos is not None:
                        snap.spec_accepted_per_pos[pos] = snap.spec_accepted_per_pos.get(pos, 0.0) + value
            elif kind == "histogram":
                if sname == name + "_sum":
                    snap.histogram_sum[name] = snap.histogram_sum.get(name, 0.0) + value
                elif sname == name + "_count":
                    snap.histogram_count[name] = snap.histogram_count.get(name, 0.0) + value
            elif kind == "gauge":
                snap.gauges[name] = snap.gauges.get(name, 0.0) + value
    return snap


async def scrape_text(client: httpx.AsyncClient, base_url: str) -> tuple[str, float] | None:
    """GET ``/metrics``: its text and the ``time.time()`` it came back (parse it later with
    :func:`parse_metrics`, off a run's busy loop); None when the server exposes none."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return resp.text, time.time()


async def scrape(client: httpx.AsyncClient, base_url: str) -> ServerMetrics | None:
    """GET ``/metrics``; None when the server exposes none (or it cannot be read)."""
    got = await scrape_text(client, base_url)
    if got is None:
        return None
    try:
        return parse_metrics(got[0], when=got[1])
    except ValueError:
        return None


def metrics_delta(before: ServerMetrics | None, after: ServerMetrics | None) -> dict[str, Any]:
    """Counter increments between two snapshots, and what they imply.

    Keys: one per counter in :data:`COUNTERS` (short names, e.g. ``generation_tokens``; None
    when the server lacks it), ``prefix_cache_hit_rate``, ``spec_decode_mean_acceptance_length``
    (1 + accepted / drafts: tokens emitted per draft step, None without drafts),
    ``spec_decode_num_speculative_tokens`` (k, None without speculation),
    ``spec_decode_acceptance_rates`` (per draft position: accepted / drafts), the mean of
    each histogram over the interval (``mean_<name>``, seconds), and the cache config labels.
    """
    out: dict[str, Any] = {}
    if before is None or after is None:
        return {"available": False}
    out["available"] = True
    out["interval_s"] = after.time - before.time
    for name in COUNTERS:
        short = name.split(":", 1)[1]
        a, b = after.counters.get(name), before.counters.get(name, 0.0)
        out[short] = None if a is None else a - b
    reasons = set(after.success_by_reason) | set(before.success_by_reason)
    out["request_success_by_reason"] = {
        r: after.success_by_reason.get(r, 0.0) - before.success_by_reason.get(r, 0.0)
        for r in sorted(reasons)
    }
    q, h = out.get("prefix_cache_queries"), out.get("prefix_cache_hits")
    out["prefix_cache_hit_rate"] = (h / q) if q and h is not None else None
    drafts, accepted = out.get("spec_decode_num_drafts"), out.get("spec_decode_num_accepted_tokens")
    out["spec_decode_mean_acceptance_length"] = (
        1.0 + accepted / drafts if drafts and accepted is not None else None
    )
    positions = sorted(after.spec_accepted_per_pos)
    out["spec_decode_num_speculative_tokens"] = after.num_speculative_tokens
    # P(draft position i accepted) per draft: vLLM's per-position acceptance rates.
    out["spec_decode_acceptance_rates"] = [
        (after.spec_accepted_per_pos[p] - before.spec_accepted_per_pos.get(p, 0.0)) / drafts
        for p in positions
    ] if drafts and positions else None
    for name in HISTOGRAMS:
        short = name.split(":", 1)[1]
        dc = after.histogram_count.get(name, 0.0) - before.histogram_count.get(name, 0.0)
        ds = after.histogram_sum.get(name, 0.0) - before.histogram_sum.get(name, 0.0)
        out[f"mean_{short}"] = ds / dc if dc > 0 else None
        out[f"count_{short}"] = dc
    out["cache_config"] = dict(after.cache_config)
    return out


def _rel(client_value: float, server_value: float | None) -> float | None:
    if server_value is None:
        return None
    if server_value == 0:  # no relative scale: the raw counts beside it tell the story
        return 0.0 if client_value == 0 else None
    return (client_value - server_value) / server_value


def cross_check(records: Iterable[RequestRecord], delta: dict[str, Any]) -> dict[str, Any]:
    """Client token totals vs the server's counter deltas, as relative differences.

    Counts every record the server answered (successful ones: the server also counts tokens of
    requests that failed on the client side mid-stream, so a failed run can differ). A relative
    difference of 0.0 means the two agree exactly; None means the server gave no counter.
    """
    recs = list(records)
    ok = [r for r in recs if r.succeeded]
    client_prompt = sum(r.num_prompt_tokens for r in ok)
    client_gen = sum(r.num_output_tokens for r in ok)
    out: dict[str, Any] = {
        "client_prompt_tokens": client_prompt,
        "server_prompt_tokens": delta.get("prompt_tokens"),
        "client_generation_tokens": client_gen,
        "server_generation_tokens": delta.get("generation_tokens"),
        "client_requests_succeeded": len(ok),
        "server_request_success": delta.get("request_success"),
    }
    out["prompt_tokens_rel_diff"] = _rel(client_prompt, delta.get("prompt_tokens"))
    out["generation_tokens_rel_diff"] = _rel(client_gen, delta.get("generation_tokens"))
    out["requests_rel_diff"] = _rel(len(ok), delta.get("request_success"))
    return out
