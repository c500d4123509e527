"""``/metrics`` of a served scenario: vLLM's metric names, label sets and histogram buckets.

The names, labels (``engine``, ``model_name``; ``finished_reason`` on request counts) and
buckets are vLLM 0.32's, as its ``/metrics`` prints them, so dashboards, alerts and the routers
that scrape vLLM read a served scenario unchanged. A fleet (``--replicas``) is one server with
one engine per replica, labelled ``engine="0"`` .. ``"N-1"``, as vLLM labels the engines of a
data-parallel server.

Figures come from each request's record on the simulated clock (vLLM's engine-side view):
token counts, TTFT and inter-token latency (one per stream chunk) as each chunk is handed on,
the per-request histograms (queue, prefill, decode, inference, TPOT, end-to-end, lengths) and
the finish reason when it finishes, as vLLM adds them; gauges (running, waiting, KV usage) and the prefix-cache
counters are read from the engines at each scrape. ``simcap:clock_lag_seconds`` is simcap's own:
how late each stream chunk was written, against the wall-clock time its step ended.
Not exported: per-step ``iteration_tokens_total`` and the metrics of features simcap does not
model (multi-modal cache, KV offloading, sleep mode, LoRA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from simcap.metrics.records import RequestRecord

# vLLM 0.32's buckets (vllm/v1/metrics/loggers.py), as its /metrics prints them.
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0]
_TOKENS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
_LAG = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0]
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# Per-request histograms: key -> (vLLM's name, its help text, its buckets).
_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT),
    "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL),
    "tpot": ("vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", _ITL),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY),
    "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LATENCY),
    "inference": ("vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", _LATENCY),
    "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                _LATENCY),
    "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _LATENCY),
    "prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS),
    "generation": ("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKENS),
    "max_tokens": ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKENS),
}
_LABELS = ("engine", "model_name")


class ServedMetrics:
    """The registry behind ``/metrics``; :meth:`chunk` and :meth:`finished` add what a request
    did, :meth:`text` renders.

    ``gauges(i)``: engine i's (running, waiting, KV usage) now; ``prefix_cache(i)``: its
    (queried, hit) prompt tokens so far; ``cache_config``: the labels of
    ``vllm:cache_config_info``.
    """

    def __init__(
        self, model_name: str, num_engines: int,
        gauges: Callable[[int], tuple[int, int, float]],
        prefix_cache: Callable[[int], tuple[int, int]],
        cache_config: dict[str, str],
    ) -> None:
        self.model_name = model_name
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, _LABELS + extra, registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.histograms = {
            key: Histogram(name, doc, _LABELS, buckets=buckets, registry=registry)
            for key, (name, doc, buckets) in _HISTOGRAMS.items()
        }
        self.lag = Histogram(
            "simcap:clock_lag_seconds",
            "How late each stream chunk was written, against the wall-clock time its simulated step ended.",
            buckets=_LAG, registry=registry,
        )
        engines = [str(i) for i in range(num_engines)]
        for engine in engines:  # every series from the start, at 0, as vLLM shows them
            for reason in FINISHED_REASONS:
                self.success.labels(engine, model_name, reason)
            for metric in (self.prompt_tokens, self.generation_tokens, self.preemptions):
                metric.labels(engine, model_name)
        registry.register(_EngineState(model_name, engines, gauges, prefix_cache, cache_config))

    def chunk(self, engine: int, record: RequestRecord, j: int) -> None:
        """Chunk ``j`` of a request has been handed on: its tokens; TTFT at the first chunk,
        an inter-token latency at each later one (as vLLM counts them, step by step)."""
        labels = (str(engine), self.model_name)
        times = record.chunk_times
        self.generation_tokens.labels(*labels).inc(record.chunk_tokens[j])
        if j == 0:
            self.prompt_tokens.labels(*labels).inc(record.num_prompt_tokens)
            self.histograms["ttft"].labels(*labels).observe(times[0] - record.arrival_time)
        else:
            self.histograms["itl"].labels(*labels).observe(times[j] - times[j - 1])

    def finished(self, engine: int, record: RequestRecord, max_tokens: int) -> None:
        """A finished request's figures, from its record (times on the simulated clock)."""
        labels = (str(engine), self.model_name)
        num_out = record.num_output_tokens
        self.success.labels(*labels, record.finish_reason or "length").inc()
        if record.num_preemptions:
            self.preemptions.labels(*labels).inc(record.num_preemptions)
        arrival, finish = record.arrival_time, record.finish_time
        scheduled = record.scheduled_time if record.scheduled_time is not None else arrival
        h = {key: histogram.labels(*labels) for key, histogram in self.histograms.items()}
        h["prompt"].observe(record.num_prompt_tokens)
        h["generation"].observe(num_out)
        h["max_tokens"].observe(max_tokens)
        h["e2e"].observe(finish - arrival)
        if not record.chunk_times:  # (aborted before its first token)
            return
        first = record.chunk_times[0]
        if num_out > 1:
            h["tpot"].observe((finish - first) / (num_out - 1))
        h["queue"].observe(scheduled - arrival)
        h["inference"].observe(finish - scheduled)
        h["prefill"].observe(first - scheduled)
        h["decode"].observe(finish - first)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineState:
    """The figures read from the engines at each scrape."""

    def __init__(self, model_name: str, engines: list[str], gauges: Callable, prefix_cache: Callable,
                 cache_config: dict[str, str]) -> None:
        self.model_name = model_name
        self.engines = engines
        self.gauges = gauges
        self.prefix_cache = prefix_cache
        self.cache_config = cache_config

    def describe(self) -> Iterable[Any]:
        return []  # (collected at scrape time only)

    def collect(self) -> Iterable[Any]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=_LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=_LABELS)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", labels=_LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", labels=_LABELS)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*self.cache_config, "engine"])
        for i, engine in enumerate(self.engines):
            labels = [engine, self.model_name]
            r, w, kv = self.gauges(i)
            running.add_metric(labels, r)
            waiting.add_metric(labels, w)
            usage.add_metric(labels, kv)
            q, h = self.prefix_cache(i)
            queries.add_metric(labels, q)
            hits.add_metric(labels, h)
            info.add_metric([*self.cache_config.values(), engine], 1.0)
        yield from (running, waiting, usage, queries, hits, info)
