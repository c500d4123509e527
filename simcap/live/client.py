"""The live load generator: a scenario's workload sent to a real vLLM server.

:func:`run_live` sends the same requests the simulator would (``Workload.spec(i)``, same seed)
over HTTP with streaming, and fills one :class:`~simcap.metrics.records.RequestRecord` per request,
so live and simulated runs go through the one metrics path (:func:`simcap.metrics.summary.summarize`).

- Open loop: request ``i`` is sent at ``Workload.arrival_times()[i]`` after the run starts,
  whether or not earlier ones finished (a public trace, ``workload.trace``: its own send
  times and lengths, and for a Mooncake trace its hash ids as shared prompt content). Closed loop: ``concurrency`` workers, each with one
  request in flight (plus ``think_time_s``), pull request ids in order; each record's
  ``client_id`` says which worker sent it.
- A session workload (:mod:`simcap.workloads.sessions`) is sent as sessions: one task per live session
  (open loop: sessions start at ``SessionWorkload.start_times()``; closed loop:
  ``concurrency`` clients, each running one session after another). Turn k+1 is sent once turn
  k's last token has arrived plus its think time; its prompt is the conversation so far as
  exact token ids, the answers as the server streamed them back
  (:mod:`simcap.live.session_prompts`), so the completions endpoint only. Each turn's record carries
  ``session_id`` and ``turn``; a turn that fails ends its session (counted in
  ``LiveRun.sessions["ended_by_error"]``). Request ids are in send order, as the simulator's.
  The server's per-request prefix hit (``usage.prompt_tokens_details.cached_tokens``, vLLM
  with ``--enable-prompt-tokens-details``) fills ``num_cached_tokens`` when sent.
- Prompts (completions endpoint) are lists of token ids built from the spec's content segments
  (:mod:`simcap.live.prompts`): exact lengths, shared prefixes shared token for token. The chat
  endpoint cannot take token ids: there each segment's ids are turned into text with the
  server's ``/detokenize`` and the server retokenizes it and adds its chat template, so the
  prompt length is only approximate; the real length (``usage.prompt_tokens``) is recorded.
- Every request asks for ``max_tokens`` with ``ignore_eos``, temperature 0, ``stream`` with
  ``include_usage``, and ``return_token_ids`` so each chunk's token count is known. The final
  usage's ``completion_tokens`` is authoritative: when the chunk counts disagree the last chunk
  absorbs the difference, and the run lists every such fix-up in ``token_fixups``.
- ``arrival_time`` = send time, chunk times = arrival of each SSE message carrying tokens,
  ``finish_time`` = the last such chunk, all on the run's clock (0 = run start). A failed
  request (HTTP error, cut stream, malformed SSE) gets ``error`` set and never stops the run.
- With ``out_path``, each record is appended to that JSONL file as its request completes
  (one ``RequestRecord.to_dict()`` per line, flushed), so an interrupted run keeps every
  finished request.
- The load generator watches its own event loop while it drives the workload: a task wakes
  every :data:`PAUSE_PROBE_S` and notes each time it woke :data:`PAUSE_MIN_S` or more late
  (``LiveRun.client_pauses``: start and length on the run's clock). While the loop is held
  (its process descheduled on a busy machine, a long collection, a blocking call) no chunk is
  timestamped and no closed-loop request is sent, so the latencies of the requests in flight
  grow by the pause whatever the server did. :func:`pause_spans` names the requests whose
  time to first token spans a pause; the run's notes say how many.
- With ``first_wave_scrape`` (the calibration's phases), a closed loop of several clients on
  one server also scrapes ``/metrics`` once mid-run: when each of the first wave's requests
  (one per client, sent together) has its first token and none has finished, so no later
  request has been sent. The server's counters then split the run into the first wave and the
  requests after it (``LiveRun.metrics_first_wave`` and ``first_wave``: the ids whose first
  token the scrape counted). It is kept only when the server had counted exactly the first
  tokens the client had seen; a note says when not. The burst of a first wave delays the API
  server's arrival stamps, so its server-side TTFT is short against the client's; the
  front-end fit (:func:`simcap.live.frontend_fit.run_figures`) reads the later requests alone.
- ``api_key``: sent as ``Authorization: Bearer KEY`` on every request; it is kept out of every
  record, result and message (any echo of it in a server's error text is masked).
- ``request_timeout_s``: a request that has not completed within that many seconds of its
  send is cut and recorded as failed, ``error`` saying ``timeout: ...`` and how many chunks
  had arrived; the run goes on.
- Several base URLs (a scenario whose ``deployment.replicas`` is their number): the
  deployment's router (:mod:`simcap.live.routing`, the simulated fleet's routers) picks a
  server for each request as it is sent, from its own outstanding counts and the servers'
  ``/metrics`` scraped every ``deployment.scrape_interval_s``; each record names its
  ``replica`` (the URL's index), and the result has the per-replica table and the load
  imbalance (:func:`simcap.fleet.replicas.replica_rows`), and per server its counters' cross-check.
  Every server must take the longest request (its ``max_model_len``). A session workload
  runs on one server (a scenario refuses sessions with a deployment).
"""

from __future__ import annotations

import itertools
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Awaitable, Callable, Literal, Mapping, Sequence

import httpx
import numpy as np

from simcap.config.scenario import ClosedArrival, Scenario
from simcap.errors import SimcapError
from simcap.live.prom import ServerMetrics, cross_check, metrics_delta, parse_metrics, scrape, scrape_text
from simcap.live.prompts import PROBE_TEXT, PromptBuilder
from simcap.live.routing import LiveRouter, check_fleet_urls
from simcap.live.session_prompts import SessionPrompts
from simcap.metrics.records import RequestRecord
from simcap.metrics.summary import Summary, summarize
from simcap.workloads.requests import RequestSpec, Workload
from simcap.workloads.sessions import Conversation, SessionWorkload

PAUSE_PROBE_S = 0.01  # how often the pause watch wakes
PAUSE_MIN_S = 0.05  # a wake-up this late or later is a pause of the load generator
PAUSE_DISTURBS_S = 0.1  # a pause this long or longer disturbs its run (LiveRun.paused)
FIRST_WAVE_POLL_S = 0.005  # how often the first-wave scrape looks for the wave's first tokens

Endpoint = Literal["completions", "chat"]
ENDPOINTS = ("completions", "chat")
API_KEY_ENV = "SIMCAP_API_KEY"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}``, or nothing without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` masked (servers may echo headers in errors)."""
    return text.replace(secret, "***") if secret and text else text


class LiveError(SimcapError):
    """The server cannot be used for this run (unreachable, wrong model, too short context)."""


def check_live_sessions(scenario: Scenario, endpoint: str) -> None:
    """A session workload resends each answer's exact token ids: the completions endpoint
    only (refused before any server is contacted)."""
    if scenario.workload.sessions is not None and endpoint != "completions":
        raise LiveError(
            f"workload.sessions: live sessions need the completions endpoint (each turn resends "
            f"the answers' exact token ids; {endpoint} retokenizes text); use --endpoint completions"
        )


@dataclass
class LiveRun:
    """One live run: its records and how the load it offered compares with what was asked."""

    records: list[RequestRecord]
    specs: dict[int, RequestSpec]
    base_url: str
    model: str
    endpoint: str
    closed_loop: bool
    requested_rate: float | None  # open loop: the scenario's rate, req/s
    scheduled_rate: float | None  # open loop: (N-1) / span of the drawn send schedule
    achieved_rate: float | None  # (N-1) / (last send - first send), as sent
    wall_duration_s: float  # run start to last request done
    max_send_lag_s: float | None  # open loop: worst lateness of a send against its schedule
    metrics_before: ServerMetrics | None = None
    metrics_after: ServerMetrics | None = None
    token_fixups: list[dict[str, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    out_path: str | None = None
    # A session workload: sessions started, ended by an errored turn, and the overflow counts
    # (truncated_turns, dropped_turns, ended_sessions) of simcap.workloads.sessions; None otherwise.
    sessions: dict[str, int] | None = None
    # Records whose usage carried prompt_tokens_details.cached_tokens (vLLM with
    # --enable-prompt-tokens-details): their num_cached_tokens is the server's prefix hit.
    cached_tokens_reported: int = 0
    # Several servers: every base URL, and each server's scrapes before and after the run
    # (``metrics_before``/``metrics_after`` are then None: no one server saw the whole run).
    base_urls: list[str] = field(default_factory=list)
    router: str | None = None
    server_metrics: list[tuple[ServerMetrics | None, ServerMetrics | None]] = field(default_factory=list)
    # The load generator's own pauses (module doc): [start_s, length_s] on the run's clock,
    # each PAUSE_MIN_S or longer; None where not watched (runs recorded before the watch).
    client_pauses: list[list[float]] | None = None
    # A closed loop of several clients on one server (module doc): /metrics once the first
    # wave had its first tokens, and the ids of those requests; None where not taken or kept.
    metrics_first_wave: ServerMetrics | None = None
    first_wave: list[int] | None = None

    @property
    def longest_pause_s(self) -> float:
        """The load generator's longest pause during the run (0: none, or not watched)."""
        return max((length for _, length in self.client_pauses or ()), default=0.0)

    @property
    def paused(self) -> bool:
        """Whether the load generator paused :data:`PAUSE_DISTURBS_S` or longer: a run
        disturbed by its own client (``simcap live validate`` and ``simcap accuracy`` leave
        it out while an undisturbed run remains)."""
        return self.longest_pause_s >= PAUSE_DISTURBS_S

    def disturbed(self, cpu: Mapping[str, Any]) -> bool:
        """Whether the run is disturbed: foreign CPU use in ``cpu`` (a
        :class:`~simcap.live.hostload.CpuWatch` report of the run), or the load generator's own
        pause (:attr:`paused`). Live validate, capacity and crossover all judge a run by it."""
        return bool(cpu.get("disturbed")) or self.paused

    @property
    def pause_line(self) -> str:
        """Why a paused run is disturbed, in a note's words."""
        return (f"disturbed (the load generator paused {len(self.client_pauses or ())} time(s), "
                f"longest {self.longest_pause_s * 1e3:.0f} ms)")

    @property
    def is_fleet(self) -> bool:
        return len(self.base_urls) > 1

    @property
    def last_metrics(self) -> ServerMetrics | None:
        """The first server's scrape after the run (its cache config stands for all)."""
        if self.server_metrics:
            return self.server_metrics[0][1]
        return self.metrics_after

    def fleet(self, slo: dict[str, float] | None = None) -> dict[str, Any] | None:
        """Several servers: the per-replica table, the load imbalance and each server's
        cross-check; None for one server."""
        if not self.is_fleet:
            return None
        from simcap.fleet.replicas import load_imbalance, replica_rows

        rows = replica_rows(self.records, len(self.base_urls), slo)
        for row, url, (before, after) in zip(rows, self.base_urls, self.server_metrics):
            mine = [r for r in self.records if r.replica == row["replica"]]
            row["base_url"] = url
            row["cross_check"] = cross_check(mine, metrics_delta(before, after))
        return {"replicas": len(rows), "router": self.router, "per_replica": rows,
                "load_imbalance": load_imbalance(rows)}

    @property
    def num_failed(self) -> int:
        return sum(1 for r in self.records if not r.succeeded)

    def summary(self, slo: dict[str, float] | None = None) -> Summary:
        """The records summarised as the simulator's are (duration: first send to last finish).

        A session run's per-turn prefix-hit shares need the server's per-request cached
        tokens: without them (no ``--enable-prompt-tokens-details``) they are None, not 0."""
        overflow = None
        if self.sessions is not None:
            overflow = {k: self.sessions[k] for k in ("truncated_turns", "dropped_turns", "ended_sessions")}
        summary = summarize(self.records, slo=slo, session_overflow=overflow)
        if summary.sessions is not None and self.cached_tokens_reported == 0:
            summary.sessions["prefix_hit_share"] = None
            for row in summary.sessions["by_turn"]:
                row["prefix_hit_share"] = None
        return summary

    def server_delta(self) -> dict[str, Any]:
        return metrics_delta(self.metrics_before, self.metrics_after)

    def cross_check(self) -> dict[str, Any]:
        return cross_check(self.records, self.server_delta())

    def to_dict(self, slo: dict[str, float] | None = None) -> dict[str, Any]:
        """Summary fields at the top level (as ``simcap simulate --json``), plus the live facts."""
        return {
            **self.summary(slo).to_dict(),
            "live": {
                "base_url": self.base_url,
                "model": self.model,
                "endpoint": self.endpoint,
                "closed_loop": self.closed_loop,
                "num_requests": len(self.records),
                "failed": self.num_failed,
                "rate_unit": "sessions/s" if self.sessions is not None else "req/s",
                "requested_rate": self.requested_rate,
                "scheduled_rate": self.scheduled_rate,
                "achieved_rate": self.achieved_rate,
                "max_send_lag_s": self.max_send_lag_s,
                "client_pauses": self.client_pauses,
                "wall_duration_s": self.wall_duration_s,
                "interrupted": self.interrupted,
                "out_path": self.out_path,
                "token_fixups": list(self.token_fixups),
                "sessions": None if self.sessions is None else dict(self.sessions),
                "cached_tokens_reported": self.cached_tokens_reported,
                "errors": sorted({r.error for r in self.records if r.error})[:10],
                "notes": list(self.notes),
            },
            "server": self.server_delta(),
            "cross_check": self.cross_check(),
            **({"fleet": self.fleet(slo)} if self.is_fleet else {}),
        }


# --------------------------------------------------------------------------- server probing


async def _get_json(client: httpx.AsyncClient, url: str, what: str) -> Any:
    try:
        resp = await client.get(url, timeout=10.0)
    except httpx.HTTPError as exc:
        raise LiveError(f"cannot reach vLLM server at {url.rsplit('/', 2)[0]}: {_exc_text(exc)}")
    if resp.status_code in (401, 403):
        raise LiveError(
            f"{url}: HTTP {resp.status_code} asking for {what}: the server wants an API key, or "
            f"refused the one given (set {API_KEY_ENV} or --api-key-env NAME)"
        )
    if resp.status_code != 200:
        raise LiveError(f"{url}: HTTP {resp.status_code} asking for {what}")
    try:
        return resp.json()
    except ValueError:
        raise LiveError(f"{url}: not JSON; is this an OpenAI-compatible vLLM server?") from None


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


async def resolve_model(client: httpx.AsyncClient, base_url: str, model: str | None) -> tuple[str, int | None]:
    """The served model name (``model`` or the server's first) and its max_model_len."""
    base = base_url.rstrip("/")
    try:
        await client.get(base + "/health", timeout=10.0)
    except httpx.HTTPError as exc:
        raise LiveError(f"cannot reach vLLM server at {base_url}: {_exc_text(exc)}") from None
    data = await _get_json(client, base + "/v1/models", "the served models")
    served = [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
    if not served:
        raise LiveError(f"{base_url}: the server lists no models at /v1/models")
    names = [m["id"] for m in served]
    if model is None:
        entry = served[0]
    else:
        matches = [m for m in served if m["id"] == model]
        if not matches:
            raise LiveError(f"model {model!r} is not served at {base_url}; served: {', '.join(names)}")
        entry = matches[0]
    max_len = entry.get("max_model_len")
    return entry["id"], int(max_len) if isinstance(max_len, (int, float)) else None


async def discover_token_pool(client: httpx.AsyncClient, base_url: str, model: str) -> list[int]:
    """Ordinary token ids of the served model: ``/tokenize`` of a probe text, no special tokens."""
    url = base_url.rstrip("/") + "/tokenize"
    try:
        resp = await client.post(
            url, json={"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False}, timeout=30.0
        )
    except httpx.HTTPError as exc:
        raise LiveError(f"cannot reach vLLM server at {base_url}: {_exc_text(exc)}") from None
    if resp.status_code != 200:
        raise LiveError(
            f"{url}: HTTP {resp.status_code}; live prompts need the server's /tokenize "
            "(or pass token_pool=)"
        )
    tokens = resp.json().get("tokens") or []
    pool = sorted({int(t) for t in tokens})
    if len(pool) < 16:
        raise LiveError(f"{url}: the probe text gave only {len(pool)} distinct token ids")
    return pool


class _ChatText:
    """Text for chat prompts: each segment's token ids detokenized once by the server."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, builder: PromptBuilder):
        self.client, self.url, self.model, self.builder = client, base_url.rstrip("/") + "/detokenize", model, builder
        self.cache: dict[tuple[int, int], str] = {}

    async def text(self, spec: RequestSpec) -> str:
        parts = []
        for key, n in spec.segments:
            if (key, n) not in self.cache:
                ids = self.builder.segment_ids(key, n)
                resp = await self.client.post(self.url, json={"model": self.model, "tokens": ids}, timeout=30.0)
                if resp.status_code != 200:
                    raise LiveError(f"{self.url}: HTTP {resp.status_code}; the chat endpoint needs /detokenize")
                self.cache[(key, n)] = resp.json()["prompt"]
            parts.append(self.cache[(key, n)])
        return "".join(parts)


# --------------------------------------------------------------------------- one request


def request_body(
    endpoint: str, model: str, spec: RequestSpec, prompt: list[int] | str, return_token_ids: bool = True
) -> dict[str, Any]:
    """The JSON body for one streaming request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if return_token_ids:
        body["return_token_ids"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


class _StreamError(Exception):
    pass


def cancel_requested() -> bool:
    """Whether the running task has been asked to stop. Before Python 3.12, ``asyncio.wait_for``
    returns its result and drops a cancellation that arrives as the awaited request completes;
    a client loop that went on would send the rest of the workload after a Ctrl-C, so each
    finished request checks this (``Task.cancelling``, Python 3.11+) and stops its loop."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling is not None and cancelling())


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    record: RequestRecord,
    t0: float,
    chat: bool,
    fixups: list[dict[str, int]],
    timeout_s: float | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any] | None:
    """Send one request and fill ``record`` from its SSE stream; never raises for its faults.

    ``timeout_s``: the whole request (send to ``[DONE]``) must complete within that many
    seconds, else it is cut and recorded as a timeout with the chunks that had arrived.
    ``token_ids``: a list the answer's token ids are appended to (a chunk with text but no
    ids is then a fault). The final usage's ``prompt_tokens_details.cached_tokens``, when the
    server sends it, is the record's ``num_cached_tokens``. Returns the final usage (None
    without one, or on a fault).
    """
    state: dict[str, Any] = {"usage": None, "ids": token_ids}
    try:
        if timeout_s is not None:
            await asyncio.wait_for(_stream(client, url, body, record, t0, chat, state), timeout_s)
        else:
            await _stream(client, url, body, record, t0, chat, state)
    except asyncio.TimeoutError:
        record.error = (
            f"timeout: not complete within {timeout_s:g} s (request timeout) after "
            f"{len(record.chunk_times)} chunks"
        )
    except _StreamError as exc:
        record.error = str(exc)
    except httpx.TimeoutException as exc:
        record.error = f"timeout: {_exc_text(exc)} (no data within the request timeout) after {len(record.chunk_times)} chunks"
    except httpx.HTTPError as exc:
        record.error = f"{_exc_text(exc)} after {len(record.chunk_times)} chunks"
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        record.error = f"unexpected response shape: {_exc_text(exc)}"
    if record.chunk_times:
        record.finish_time = record.chunk_times[-1]
    if record.error is not None:
        record.finish_reason = "error"
        return None
    usage = state["usage"]
    if usage is not None:
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int):
            record.num_prompt_tokens = prompt_tokens
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            record.num_cached_tokens = cached
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            counted = record.num_output_tokens
            if counted != completion:
                fixups.append({"request_id": record.request_id, "chunk_tokens": counted, "usage_tokens": completion})
                _absorb(record.chunk_tokens, completion - counted)
    return usage


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    record: RequestRecord,
    t0: float,
    chat: bool,
    state: dict[str, Any],
) -> None:
    """The SSE exchange of :func:`stream_request`; raises on every fault."""
    clock = time.perf_counter
    done = False
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace").strip().replace("\n", " ")
            raise _StreamError(f"HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line or line.startswith(":"):
                continue
            now = clock() - t0
            if not line.startswith("data:"):
                continue  # event:/id:/retry: fields carry nothing we use
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                msg = json.loads(payload)
            except ValueError:
                raise _StreamError(f"malformed SSE data after {len(record.chunk_times)} chunks: {payload[:80]!r}") from None
            if not isinstance(msg, dict):
                raise _StreamError(f"malformed SSE data: {payload[:80]!r}")
            if "error" in msg:
                err = msg["error"]
                text = err.get("message") if isinstance(err, dict) else err
                raise _StreamError(f"server error in stream: {str(text)[:300]}")
            if msg.get("usage"):
                state["usage"] = msg["usage"]
            for choice in msg.get("choices") or ():
                if chat:
                    text = (choice.get("delta") or {}).get("content") or ""
                else:
                    text = choice.get("text") or ""
                ids = choice.get("token_ids")
                n = len(ids) if isinstance(ids, list) else (1 if text else 0)
                if state["ids"] is not None and n:
                    if not isinstance(ids, list):
                        raise _StreamError(
                            "stream chunk without token_ids: a session's next turn needs the "
                            "answer's ids (a vLLM that takes return_token_ids)"
                        )
                    state["ids"].extend(int(t) for t in ids)
                if n or text:
                    record.add_chunk(now, n)
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
    if not done:
        raise _StreamError(f"stream ended without [DONE] after {len(record.chunk_times)} chunks")
    if not record.chunk_times:
        raise _StreamError("stream carried no tokens")


def _absorb(tokens: list[int], diff: int) -> None:
    """Add ``diff`` to the last chunk (walking back when it would go below 0)."""
    i = len(tokens) - 1
    while diff and i >= 0:
        new = max(tokens[i] + diff, 0)
        diff -= new - tokens[i]
        tokens[i] = new
        i -= 1


# --------------------------------------------------------------------------- the run


class _Sink:
    def __init__(self, path: str | Path | None) -> None:
        self.fh: IO[str] | None = open(path, "w", encoding="utf-8") if path else None

    def write(self, record: RequestRecord) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps(record.to_dict(), allow_nan=False) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def _progress(total: int | None, enabled: bool):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    prog.start()
    prog.add_task("live requests", total=total)
    return prog


async def run_live_async(scenario: Scenario, base_url: str | Sequence[str], model: str | None = None, **kwargs: Any) -> LiveRun:
    """Async form of :func:`run_live` (same arguments; see :func:`_run_live_async`)."""
    try:
        return await _run_live_async(scenario, base_url, model, **kwargs)
    except LiveError as exc:  # a server may echo the Authorization header in an error text
        raise LiveError(redact(str(exc), kwargs.get("api_key"))) from None


async def _run_live_async(
    scenario: Scenario,
    base_url: str | Sequence[str],
    model: str | None = None,
    *,
    endpoint: Endpoint = "completions",
    out_path: str | Path | None = None,
    progress: bool = True,
    token_pool: Sequence[int] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    request_timeout_s: float | None = 600.0,
    return_token_ids: bool = True,
    on_record: Callable[[RequestRecord], None] | None = None,
    api_key: str | None = None,
    prompt_period: int | None = None,
    first_wave_scrape: bool = False,
) -> LiveRun:
    if endpoint not in ENDPOINTS:
        raise LiveError(f"endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
    check_live_sessions(scenario, endpoint)
    base_urls = [u.rstrip("/") for u in ([base_url] if isinstance(base_url, str) else base_url)]
    check_fleet_urls(scenario, len(base_urls))
    check_request_timeout(request_timeout_s)
    run = _Run(scenario, base_urls, model, endpoint, request_timeout_s, return_token_ids, on_record, api_key,
               first_wave_scrape)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(request_timeout_s, connect=min(30.0, request_timeout_s or 30.0), pool=None)
    try:
        async with httpx.AsyncClient(
            transport=transport, limits=limits, timeout=timeout, headers=auth_headers(api_key)
        ) as client:
            await run.connect(client, token_pool, prompt_period)
            run.sink = _Sink(out_path)
            await run.scrape_before()
            run.prog = _progress(run.n_total, progress)
            await run.drive()
            await run.scrape_after()
    finally:
        if run.prog is not None:
            run.prog.stop()
        run.sink.close()
    return run.result(out_path)


class _Run:
    """One live run: the servers, the workload and what has come back so far.

    :meth:`connect` checks every server takes the longest request and builds the prompts;
    :meth:`drive` sends the workload as its arrival process says (closed-loop clients, open
    loop on its schedule, or sessions of either kind), each request by :meth:`one`, and on an
    interruption stops every request in flight, so only finished requests are kept;
    :meth:`result` is the :class:`LiveRun`.
    """

    def __init__(self, scenario: Scenario, base_urls: list[str], model: str | None, endpoint: Endpoint,
                 request_timeout_s: float | None, return_token_ids: bool,
                 on_record: Callable[[RequestRecord], None] | None, api_key: str | None,
                 first_wave_scrape: bool = False) -> None:
        self.scenario = scenario
        self.base_urls = base_urls
        self.model = model
        self.endpoint = endpoint
        self.request_timeout_s = request_timeout_s
        self.return_token_ids = return_token_ids
        self.on_record = on_record
        self.api_key = api_key
        self.workload = Workload(scenario.workload, scenario.seed)
        self.sessions = (None if scenario.workload.sessions is None
                         else SessionWorkload(scenario.workload, scenario.seed))
        self.arrival = scenario.workload.arrival
        self.closed = isinstance(self.arrival, ClosedArrival)
        self.chat = endpoint == "chat"
        self.urls = [u + ("/v1/chat/completions" if self.chat else "/v1/completions") for u in base_urls]
        self.fleet = len(base_urls) > 1
        self.router: LiveRouter | None = None
        self.notes: list[str] = []
        self.fixups: list[dict[str, int]] = []
        self.records: dict[int, RequestRecord] = {}
        self.specs: dict[int, RequestSpec] = {}
        self.session_counts = dict.fromkeys(
            ("sessions", "ended_by_error", "truncated_turns", "dropped_turns", "ended_sessions"), 0
        )
        self.cached_reported = 0
        self.sink = _Sink(None)  # opened (truncating out_path) once the server is known to serve
        self.prog = None
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        self.next_request_id = 0  # sessions: request ids in send order, as the simulator's
        self.sched_lag: list[float] = []
        self.n_total: int | None = None
        self.times: np.ndarray | None = None
        self.wall = 0.0
        self.pauses: list[tuple[float, float]] = []  # (perf_counter at the late wake-up's due time, lateness)
        self.t0: float | None = None
        self.befores: list[ServerMetrics | None] = []
        self.afters: list[ServerMetrics | None] = []
        self.first_wave_scrape = first_wave_scrape
        # The first-wave scrape as taken: its text and time, the ids with a first token
        # before and after it, and whether a request ended meanwhile.
        self.wave_scrape: tuple[str, float, list[int], list[int], bool] | None = None

    async def connect(self, client: httpx.AsyncClient, token_pool: Sequence[int] | None,
                      prompt_period: int | None) -> None:
        """Every server takes the longest request; the prompts' tokens; the schedule."""
        self.client = client
        scenario, sessions = self.scenario, self.sessions
        what, longest = _longest_request(scenario)
        max_len = None
        for u in self.base_urls:  # every server must take the longest request
            self.model, max_len = await resolve_model(client, u, self.model)
            if max_len is not None and longest > max_len:
                where = f" at {u}" if self.fleet else ""
                raise LiveError(
                    f"{what}: prompt + output up to {longest} tokens exceed the "
                    f"server's max_model_len ({max_len}) for model {self.model!r}{where}"
                )
        self.context_len = scenario.engine.max_model_len
        if sessions is not None and max_len is not None and max_len < self.context_len:
            self.notes.append(
                f"sessions: contexts are kept within the server's max_model_len {max_len} "
                f"(scenario: {self.context_len})"
            )
            self.context_len = max_len
        base_url = self.base_urls[0]
        pool = list(token_pool) if token_pool is not None else await discover_token_pool(client, base_url, self.model)
        self.builder = PromptBuilder(pool, seed=scenario.seed, period=prompt_period)
        self.chat_text = _ChatText(client, base_url, self.model, self.builder) if self.chat else None
        if self.chat:
            self.notes.append(
                "chat endpoint: prompts are detokenized text, retokenized by the server with "
                "its chat template; prompt lengths are approximate (recorded from usage)"
            )
        if sessions is not None:  # turns per run are not known in advance
            self.times = None if self.closed else sessions.start_times()
        elif self.closed:
            self.n_total = self.workload.num_requests
        else:
            self.times = self.workload.arrival_times()
            self.n_total = len(self.times)

    async def scrape_before(self) -> None:
        """Each server's /metrics before the run (and the fleet's router, which reads them)."""
        self.befores = [await scrape(self.client, u) for u in self.base_urls]
        for u, b in zip(self.base_urls, self.befores):
            if b is None:
                where = f" ({u})" if self.fleet else ""
                self.notes.append(f"server{where} has no readable /metrics: no server-side cross-check")
        if self.fleet:
            before = self.befores[0]
            self.router = LiveRouter(
                self.scenario, len(self.base_urls), block_size=before.block_size if before else None,
                capacities=[b.num_gpu_blocks - 1 if b and b.num_gpu_blocks else None for b in self.befores],
            )

    async def scrape_after(self) -> None:
        """Each server's /metrics once its counters have settled on this run's requests."""
        for i, (u, b) in enumerate(zip(self.base_urls, self.befores)):
            mine = [r for r in self.records.values() if not self.fleet or r.replica == i]
            self.afters.append(await _scrape_settled(self.client, u, b, mine))

    async def body_for(self, spec: RequestSpec) -> bytes:
        prompt = await self.chat_text.text(spec) if self.chat_text else self.builder.prompt_ids(spec)
        return json.dumps(request_body(self.endpoint, self.model, spec, prompt, self.return_token_ids)).encode()

    async def one(
        self, spec: RequestSpec, body: bytes, t0: float, client_id: int | None = None,
        token_ids: list[int] | None = None,
    ) -> RequestRecord:
        """Send one request and record it; a finished request is written at once."""
        rec = RequestRecord(spec.request_id, time.perf_counter() - t0, spec.num_prompt_tokens, spec.max_tokens,
                            client_id=client_id, session_id=spec.session_id, turn=spec.turn)
        self.records[spec.request_id] = rec
        router, replica = self.router, 0
        if router is not None:
            replica = rec.replica = router.send(spec, client_id)
        try:
            usage = await stream_request(self.client, self.urls[replica], body, rec, t0, self.chat, self.fixups,
                                         self.request_timeout_s, token_ids)
        finally:
            if router is not None:
                router.ended(replica)
        if usage is not None and isinstance((usage.get("prompt_tokens_details") or {}).get("cached_tokens"), int):
            self.cached_reported += 1
        if rec.error and self.api_key:
            rec.error = redact(rec.error, self.api_key)
        if self.stopping:
            return rec  # cut short by the interruption, not finished: not written
        self.sink.write(rec)
        if self.on_record is not None:
            self.on_record(rec)
        if self.prog is not None:
            self.prog.advance(self.prog.task_ids[0])
        if cancel_requested():  # (a cancellation wait_for swallowed: stop here)
            raise asyncio.CancelledError
        return rec

    async def session(self, i: int, t0: float, client_id: int | None = None) -> None:
        """Session i: each turn sent when the previous answer's last token is back plus the
        think time, its prompt the conversation so far (exact ids)."""
        sessions, counts = self.sessions, self.session_counts
        assert sessions is not None
        cfg = sessions.sessions
        prompts = SessionPrompts(Conversation(sessions.plan(i), self.context_len, cfg.on_overflow), self.builder)
        counts["sessions"] += 1
        try:
            while not self.stopping:
                turn = prompts.request(self.next_request_id)
                if turn is None:
                    break
                spec, ids = turn
                self.next_request_id += 1
                self.specs[spec.request_id] = spec
                body = json.dumps(request_body(self.endpoint, self.model, spec, ids, True)).encode()
                answer: list[int] = []
                rec = await self.one(spec, body, t0, client_id, answer)
                if not rec.succeeded:
                    counts["ended_by_error"] += 1  # its context is unknown: end it
                    break
                think = prompts.answered(answer)
                if prompts.done:
                    break
                assert rec.finish_time is not None
                delay = t0 + rec.finish_time + think - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
        finally:
            conv = prompts.conversation
            counts["truncated_turns"] += conv.truncated_turns
            counts["dropped_turns"] += conv.dropped_turns
            counts["ended_sessions"] += conv.ended

    async def on_schedule(self, times: np.ndarray, start: Callable[[int, float], Awaitable[Any]]) -> float:
        """Open loop: ``start(i, t0)`` as a task at ``times[i]`` after t0 (now), each send's
        lag behind its time kept; then wait for every task. Returns t0."""
        t0 = time.perf_counter()
        for i, t in enumerate(times.tolist()):
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.sched_lag.append(time.perf_counter() - t0 - t)
            self.tasks.append(asyncio.create_task(start(i, t0)))
        await asyncio.gather(*self.tasks)
        return t0

    async def clients(self, send: Callable[[int, float, int], Awaitable[Any]], limit: int | None,
                      duration: float | None) -> float:
        """Closed loop: ``concurrency`` clients, each taking the next index and ``send``-ing it
        (then thinking), until ``limit`` indices or ``duration`` seconds. Returns t0."""
        arrival = self.arrival
        assert isinstance(arrival, ClosedArrival)
        counter = iter(range(limit) if limit is not None else itertools.count())
        t0 = time.perf_counter()

        async def client(c: int) -> None:
            for i in counter:
                if duration is not None and time.perf_counter() - t0 >= duration:
                    return
                await send(i, t0, c)
                if arrival.think_time_s:
                    await asyncio.sleep(arrival.think_time_s)

        self.tasks.extend(asyncio.create_task(client(c)) for c in range(arrival.concurrency))
        await asyncio.gather(*self.tasks)
        return t0

    async def request(self, i: int, t0: float, c: int) -> None:
        """A closed-loop client's request i of the workload."""
        spec = self.workload.spec(i)
        self.specs[i] = spec
        await self.one(spec, await self.body_for(spec), t0, c)

    async def scrape_first_wave(self) -> None:
        """/metrics once each of the first wave's requests has its first token, if none has
        finished by then (module doc); the text is parsed and judged in :meth:`result`."""
        def ended(r: RequestRecord | None) -> bool:  # finished, or failed
            return r is not None and (r.finish_time is not None or r.error is not None)

        def with_first_token() -> list[int]:
            return sorted(i for i, r in self.records.items() if r.chunk_times)

        wave = range(min(self.arrival.concurrency, self.n_total or self.arrival.concurrency))  # type: ignore[union-attr]
        while True:
            await asyncio.sleep(FIRST_WAVE_POLL_S)
            recs = [self.records.get(i) for i in wave]
            if any(ended(r) for r in recs):
                return  # a request ended before the wave had its first tokens: no split
            if all(r is not None and r.chunk_times for r in recs):
                break
        seen = with_first_token()
        got = await scrape_text(self.client, self.base_urls[0])
        if got is not None:
            self.wave_scrape = (got[0], got[1], seen, with_first_token(), any(map(ended, self.records.values())))

    def first_wave_split(self) -> tuple[ServerMetrics | None, list[int] | None]:
        """The first-wave scrape, parsed, and the ids it counted, if the server had counted
        exactly the first tokens the client had seen and no request ended meanwhile (else a
        note, and Nones)."""
        if self.wave_scrape is None:
            return None, None
        text, when, seen, after, ended = self.wave_scrape
        try:
            mid = parse_metrics(text, when=when)
        except ValueError:
            return None, None
        counted = metrics_delta(self.befores[0], mid)["count_time_to_first_token_seconds"]
        if seen != after or ended or counted != len(seen):
            self.notes.append(
                f"the first-wave /metrics scrape was not kept: the server had counted {counted:.0f} first "
                f"token(s), the client had seen {len(seen)} before it and {len(after)} after it"
                + (", and a request ended meanwhile" if ended else "")
            )
            return None, None
        return mid, seen

    async def drive(self) -> None:
        """Send the whole workload; on an interruption (Ctrl-C cancels this task) stop every
        request in flight before the client and the records file close, so only finished
        requests are kept."""
        sessions, router = self.sessions, self.router
        scraper = None
        watch = asyncio.create_task(_watch_pauses(self.pauses))
        if router is not None and router.reads_gauges:
            scraper = asyncio.create_task(_scrape_every(self.client, self.base_urls, router))
        wave = None
        if (self.first_wave_scrape and self.closed and sessions is None and not self.fleet
                and self.befores[0] is not None and self.arrival.concurrency > 1):  # type: ignore[union-attr]
            wave = asyncio.create_task(self.scrape_first_wave())
        try:
            if sessions is not None and self.closed:
                t0 = await self.clients(self.session, sessions.num_sessions, sessions.duration_s)
            elif sessions is not None:
                assert self.times is not None
                t0 = await self.on_schedule(self.times, self.session)
            elif self.closed:
                t0 = await self.clients(self.request, self.n_total, self.workload.duration_s)
            else:
                assert self.times is not None and self.n_total is not None
                bodies = []
                for i in range(self.n_total):
                    spec = self.workload.spec(i)
                    self.specs[i] = spec
                    bodies.append(await self.body_for(spec))
                t0 = await self.on_schedule(self.times, lambda i, t0: self.one(self.specs[i], bodies[i], t0))
        except BaseException:
            self.stopping = True
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            raise
        finally:
            for task in (scraper, watch, wave):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        self.wall = time.perf_counter() - t0
        self.t0 = t0

    def result(self, out_path: str | Path | None) -> LiveRun:
        recs = [self.records[i] for i in sorted(self.records)]
        sessions, times, notes = self.sessions, self.times, self.notes
        # The rate sent: of requests, or of sessions (their first turns).
        sent = [r.arrival_time for r in recs if sessions is None or r.turn == 0]
        sends = np.sort(np.asarray(sent, dtype=float))
        achieved = (len(sends) - 1) / float(sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0] else None
        requested = scheduled = lag = None
        if not self.closed:
            if times is not None and len(times) > 1 and times[-1] > 0:
                scheduled = (len(times) - 1) / float(times[-1])
            # (a trace at its own times asks for its own mean rate)
            arrival = self.arrival
            requested = float(arrival.rate) if arrival is not None else scheduled  # type: ignore[union-attr]
            lag = max(self.sched_lag) if self.sched_lag else None
        if self.fixups:
            notes.append(f"{len(self.fixups)} request(s): chunk token counts differed from usage; usage used")
        pauses = None
        if self.t0 is not None:
            pauses = [[round(due - self.t0, 6), round(late, 6)] for due, late in self.pauses if due + late > self.t0]
            if pauses:
                spans = pause_spans(recs, pauses)
                notes.append(
                    f"the load generator paused {len(pauses)} time(s) for {PAUSE_MIN_S * 1e3:.0f} ms or more "
                    f"(longest {max(p[1] for p in pauses) * 1e3:.0f} ms, {sum(p[1] for p in pauses):.2f} s in all): "
                    f"{len(spans)} request(s)' time to first token spans one and times the pause as the server's"
                )
        if sessions is not None:
            if self.session_counts["ended_by_error"]:
                notes.append(f"{self.session_counts['ended_by_error']} session(s) ended at an errored turn")
            if not self.cached_reported:
                notes.append(
                    "the server reported no per-request cached tokens (start vLLM with "
                    "--enable-prompt-tokens-details): per-turn prefix hits are unknown; the run's "
                    "hit rate is the server's /metrics"
                )
        fleet = self.fleet
        mid, wave = self.first_wave_split()
        return LiveRun(
            records=recs,
            specs=self.specs,
            base_url=self.base_urls[0],
            model=self.model,
            endpoint=self.endpoint,
            closed_loop=self.closed,
            requested_rate=requested,
            scheduled_rate=scheduled,
            achieved_rate=achieved,
            wall_duration_s=self.wall,
            max_send_lag_s=lag,
            metrics_before=None if fleet else self.befores[0],
            metrics_after=None if fleet else self.afters[0],
            token_fixups=self.fixups,
            notes=notes,
            out_path=str(out_path) if out_path else None,
            sessions=self.session_counts if sessions is not None else None,
            cached_tokens_reported=self.cached_reported,
            base_urls=self.base_urls if fleet else [],
            router=self.scenario.deployment.router if fleet and self.scenario.deployment else None,
            server_metrics=list(zip(self.befores, self.afters)) if fleet else [],
            client_pauses=pauses,
            metrics_first_wave=mid,
            first_wave=wave,
        )


async def _watch_pauses(pauses: list[tuple[float, float]]) -> None:
    """Wake every :data:`PAUSE_PROBE_S`; each wake-up :data:`PAUSE_MIN_S` or more late is a
    pause of this event loop: ``(its due time, lateness)`` on ``time.perf_counter``."""
    while True:
        due = time.perf_counter() + PAUSE_PROBE_S
        await asyncio.sleep(PAUSE_PROBE_S)
        late = time.perf_counter() - due
        if late >= PAUSE_MIN_S:
            pauses.append((due, late))


def pause_spans(records: Sequence[RequestRecord], pauses: Sequence[Sequence[float]]) -> set[int]:
    """The ids of the requests whose time to first token (send to first chunk) overlaps one of
    ``pauses`` (``[start_s, length_s]`` on the run's clock)."""
    return {r.request_id for r in records if r.chunk_times
            and any(start < r.chunk_times[0] and start + length > r.arrival_time for start, length in pauses)}


async def _scrape_every(client: httpx.AsyncClient, base_urls: Sequence[str], router: LiveRouter) -> None:
    """Every ``scrape_interval_s`` from the run's start: each server's gauges, to the router."""
    interval = router.scrape_interval_s
    start = time.perf_counter()
    k = 1
    while True:
        delay = start + k * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        k += 1
        for i, u in enumerate(base_urls):
            router.observe(i, await scrape(client, u))


async def _scrape_settled(client, base_url, before, records) -> ServerMetrics | None:
    """Scrape /metrics once the server has counted every request it answered (max ~3 s).

    The server streams the last token before its stat logger records the request, so an
    immediate scrape can miss the last few requests' counters.
    """
    if before is None:
        return None
    answered = sum(1 for r in records if r.succeeded)
    base = before.counters.get("vllm:request_success", 0.0)
    deadline = time.monotonic() + 3.0
    while True:
        after = await scrape(client, base_url)
        if after is None:
            return None
        if after.counters.get("vllm:request_success", 0.0) - base >= answered or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.1)


def _longest_request(scenario: Scenario) -> tuple[str, int]:
    """The field that bounds a request's prompt + output, and that bound (a session turn's:
    its new tokens and answer, since truncation can drop every earlier turn)."""
    wl = scenario.workload
    if wl.sessions is not None and wl.sessions.first_input_len is not None:
        first = wl.sessions.first_input_len.max_value
        if first > wl.input_len.max_value:
            return "workload.sessions.first_input_len", first + wl.output_len.max_value
    return ("workload.trace" if wl.trace is not None else "workload.input_len"), wl.max_request_len


def check_request_timeout(request_timeout_s: float | None) -> None:
    """A request timeout is seconds > 0 (None: none); else a one-line LiveError."""
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise LiveError(f"--request-timeout: must be > 0 s (got {request_timeout_s})")


def run_live(
    scenario: Scenario,
    base_url: str | Sequence[str],
    model: str | None = None,
    *,
    endpoint: Endpoint = "completions",
    out_path: str | Path | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> LiveRun:
    """Run ``scenario``'s workload against the vLLM server at ``base_url``, or routed over
    the servers of a list of base URLs, one per ``deployment`` replica (see module doc).

    ``model``: the served model name (None: the server's first). ``out_path``: JSONL file the
    records are appended to as requests complete (truncated first). ``progress``: a rich
    progress bar on stderr. Keyword options: ``api_key`` (Bearer token, never stored),
    ``request_timeout_s`` (per request, send to done; None: no limit), ``prompt_period``
    (prompts that repeat every that many tokens, see :class:`PromptBuilder`), ``token_pool``,
    ``transport`` (tests only), ``return_token_ids``, ``on_record``, ``first_wave_scrape``
    (one ``/metrics`` scrape after a closed loop's first wave, see module doc). Raises
    :class:`LiveError` (a one-line user error) when the server cannot be reached or cannot
    serve the workload.
    """
    return asyncio.run(
        run_live_async(
            scenario, base_url, model, endpoint=endpoint, out_path=out_path, progress=progress, **kwargs
        )
    )
