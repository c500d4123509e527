"""Calibrate a profile live: drive a vLLM server with a calibration workload, fit its step time.

:func:`calibrate_live` is ``simcap live calibrate``. Two sources, best first:

- **The server's own per-step log** (``log_path``; the server runs with
  ``--enable-logging-iteration-details``): a mix under load is sent -- several phases of
  closed-loop clients (1, 2, a few, ``max_num_seqs``), prompts of several lengths up to past
  the token budget (chunked prefill), outputs of several lengths so requests finish at
  different times and new prefills land in decode steps (mixed steps); last, one client whose
  prompts open with the same half budget of tokens (prefills on a cached context, as a
  session's later turns run) and one client with half-length prompts and long outputs (decode
  over long contexts). In the phases with one request in flight each step's attended context
  and prefill pairs are known exactly (:func:`with_step_contexts`). The ``Iteration(i)``
  lines the server wrote during the workload (read from the log file, from its size before
  the workload on) are saved next to the profile (``<out>.iterations.log``) and fitted with
  :func:`simcap.calibrate.fit_step_samples` (non-negative least squares, pairs bootstrap).
- **Black-box probes** (no log): isolated single requests of several prompt lengths (their
  TTFT is taken as one prefill step) and groups of 1, 2, 4, ... simultaneous streams (their
  time per output token is one decode step at that batch), saved as ``<out>.probes.json``
  and fitted the same way. Isolated probes OVERSTATE prefill cost: a lone prefill step pays
  the frontend's per-request work and runs cold, while under load the same step is much
  cheaper (seen: 40-43 ms isolated vs 26 ms under load for a 384-token prefill). Probe
  periods include the host work between steps, so ``host_overhead`` is 0 there.

**Host overhead** (log source). The log's ``iteration elapsed time`` covers the forward pass
only; the simulator's step period is ``forward + host_overhead`` (no async scheduling on CPU).
The client sees the real period: between a request's first and last token it waits one step
period per decode step. So the mean period seen by decoding requests is
``sum over requests of (last - first token time) / sum over logged steps of decode requests``,
and ``host_overhead`` is that minus the decode-request-weighted mean elapsed time of the logged
steps (never below 0).

**Engine settings**: ``block_size``, ``num_gpu_blocks`` and ``enable_prefix_caching`` from the
server's ``/metrics`` ``vllm:cache_config_info``; ``max_num_seqs`` and
``max_num_batched_tokens`` as given (the server does not publish them); ``max_model_len`` as
given or from ``/v1/models``; ``async_scheduling: false`` (the CPU platform forces it off).
A drafting server (per-position acceptance counters) adds a ``speculative`` section: ``k``
from those counters, the method as given or from ``/server_info`` (dev mode), and the
acceptance length measured during the workload; for ngram also the proposals
(:mod:`simcap.calibrate.ngram`, from the per-step log): the onset (output tokens before a
request's first match), the proposal rate of the request-steps after it, and the spread of
match probabilities over requests (``proposal_concentration``), each left out when the log
does not show it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from simcap.calibrate import (
    TERMS,
    CalibrationError,
    Fit,
    Form,
    Recipe,
    StepSamples,
    fit_step_samples,
    parse_iteration_log,
    profile_dict,
    read_step_samples,
    write_profile,
)
from simcap.calibrate.fit_roofline import decode_context_of_records
from simcap.calibrate.ngram import (
    MIN_ONSET_REQUESTS, fit_proposal_concentration, fit_proposal_onset, onset_from_records, rows_after_onset,
)
from simcap.calibrate.pipeline import check_options
from simcap.config.scenario import EngineConfig, SpeculativeConfig, parse_scenario
from simcap.live.frontend_fit import FrontendFit, fit_frontend, max_in_flight
from simcap.metrics.summary import requests_running
from simcap.live.client import (
    LiveError, LiveRun, auth_headers, check_request_timeout, resolve_model, run_live,
)
from simcap.live.hostload import DEFAULT_THRESHOLD_CORES, CpuWatch
from simcap.live.prom import ServerMetrics, metrics_delta, parse_metrics
from simcap.live.recording import iteration_lines, log_size, read_log_window, save_run
from simcap.live.validate import _local_port, reset_prefix_cache
from simcap.metrics.records import RequestRecord

SOURCE_LOG = "vllm iteration log"
SOURCE_PROBES = "black-box probes"
PROBE_WARNING = (
    "black-box probes: isolated requests OVERSTATE prefill cost (a lone prefill step pays the "
    "frontend's per-request work and runs cold; under load the same step is much cheaper), and "
    "probe periods fold the host work between steps into the coefficients (host_overhead 0). "
    "For a faithful profile run the server with --enable-logging-iteration-details and pass its "
    "log with --log"
)
SPEC_METHODS = ("ngram", "eagle", "eagle3")


@dataclass(frozen=True)
class Phase:
    """One closed-loop stage of the calibration workload."""

    name: str
    concurrency: int
    num_requests: int
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    shared_prefix: int = 0  # tokens every prompt opens with (cached after the first request)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "concurrency": self.concurrency, "num_requests": self.num_requests,
                "input_lens": list(self.input_lens), "output_lens": list(self.output_lens),
                **({"shared_prefix": self.shared_prefix} if self.shared_prefix else {})}


def prompt_lengths(max_num_batched_tokens: int, longest: int) -> tuple[int, ...]:
    """Prompt lengths spanning the token budget: 1/32 .. 3/4 of it, and 1.25x (chunked prefill)."""
    budget = max_num_batched_tokens
    lens = {max(8, int(budget * f)) for f in (1 / 32, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 5 / 4)}
    return tuple(sorted(n for n in lens if n <= longest)) or (max(1, min(8, longest)),)


def default_phases(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_requests: int = 40,
    max_concurrency: int | None = None,
) -> list[Phase]:
    """The calibration mix: 1 client, 2, a few, then ``max_num_seqs`` (capped by the requests),
    then 1 client whose prompts open with the same prefix, and 1 client with long contexts.
    ``num_requests`` is the first four phases'; the last two add a tenth and a twentieth of it
    (at least 3 and 2). The largest phase opens with all its clients' prompts at once, so it
    keeps about two requests per client: its later waves, not that burst, set the decode steps
    at its batch and the front end's delay per chunk at its load.

    Prompts of every length of :func:`prompt_lengths` (the longest, past the budget, only from
    the third phase on), outputs of 4-48 tokens so clients desynchronise and prefills land in
    decode steps. The cached-context phase's prompts share half the budget (its first request
    computes it, the others hit it in the prefix cache), so its prefills run on a cached
    context, as a session's later turns do; the long-context phase's decode steps attend half
    the model length (:func:`with_step_contexts` knows each one's context). ``max_concurrency``:
    no phase has more clients (a profile calibrated at low load only, to predict higher loads).
    """
    if num_requests < 8:
        raise LiveError(f"calibration requests: need at least 8 (got {num_requests})")
    if max_concurrency is not None:
        if max_concurrency < 1:
            raise LiveError(f"calibration concurrency: must be >= 1 client (got {max_concurrency})")
        max_num_seqs = min(max_num_seqs, max_concurrency)
    out_max = 48
    lens = prompt_lengths(max_num_batched_tokens, max(8, max_model_len - out_max - 1))
    short = tuple(n for n in lens if n <= max_num_batched_tokens) or lens[:1]
    outs = tuple(n for n in (8, 16, 32, out_max) if n < max_model_len - max(lens)) or (4,)
    n1 = max(len(short), num_requests // 8)
    n2 = max(4, num_requests // 5)
    n3 = max(4, num_requests // 4)
    n4 = max(4, num_requests - n1 - n2 - n3)
    few = max(1, min(4, max_num_seqs))
    full = max(1, min(max_num_seqs, max(few + 1, n4 // 2)))
    n5 = max(3, num_requests // 10)  # (on top of num_requests: see the docstring)
    n6 = max(2, num_requests // 20)
    return [
        Phase("one client (isolated prefills, decode at batch 1)", 1, n1, short, (4,)),
        Phase("two clients", min(2, max_num_seqs), n2, short[: max(1, len(short) - 1)], outs[:2] + outs[-1:]),
        Phase(f"{few} clients (mixed steps, chunked prefill)", few, n3, lens, outs),
        Phase(f"{full} clients (large decode batches)", full, n4, short, outs),
        *_cached_context_phase(n5, max_num_batched_tokens, max_model_len),
        *_long_context_phase(n6, max_model_len, out_max),
    ]


def _long_context_phase(num_requests: int, max_model_len: int, out: int) -> list[Phase]:
    """One client, prompts of half the model length and long outputs: decode steps that attend
    long contexts, each one's context known exactly (one request in flight). None when the
    model is too short for it to differ from the other phases."""
    prompt = min(max_model_len // 2, max_model_len - out - 1)
    if prompt < 64:
        return []
    return [Phase("one client, long contexts", 1, num_requests, (prompt,), (out,))]


def _cached_context_phase(num_requests: int, budget: int, max_model_len: int) -> list[Phase]:
    """One client; every prompt opens with the same half budget of tokens and adds 1/8 to 1/2
    of the budget more: prefills on a cached context. None when the model is too short."""
    shared = budget // 2
    new = tuple(n for n in {max(8, budget // 8), max(8, budget // 4), max(8, budget // 2)}
                if shared + n <= max_model_len - 5)
    if shared < 16 or not new:
        return []
    return [Phase("one client, prefills on a cached context", 1, num_requests,
                  tuple(sorted(shared + n for n in new)), (4,), shared)]


def _phase_scenario(phase: Phase, engine: dict[str, Any], seed: int):
    def dist(values: Sequence[int]) -> dict[str, Any]:
        return {"dist": "empirical", "values": list(values)} if len(set(values)) > 1 else {"dist": "fixed", "value": values[0]}

    workload: dict[str, Any] = {"arrival": {"process": "closed", "concurrency": phase.concurrency},
                                "num_requests": phase.num_requests,
                                "input_len": dist(phase.input_lens), "output_len": dist(phase.output_lens)}
    if phase.shared_prefix:
        workload["prefix"] = {"shared_tokens": phase.shared_prefix, "num_prefixes": 1}
    return parse_scenario({"name": "live-calibration", "engine": engine, "workload": workload, "seed": seed})


# --------------------------------------------------------------------------- server facts


@dataclass
class ServerFacts:
    model: str
    max_model_len: int | None
    version: str | None
    metrics: ServerMetrics | None
    speculative_method: str | None  # from /server_info (dev mode), when it says


def _server_facts(base_url: str, model: str | None, api_key: str | None, timeout: float = 30.0) -> ServerFacts:
    async def resolve() -> tuple[str, int | None]:
        async with httpx.AsyncClient(headers=auth_headers(api_key)) as client:
            return await resolve_model(client, base_url, model)

    name, max_len = asyncio.run(resolve())
    base = base_url.rstrip("/")
    version = method = None
    metrics = None
    with httpx.Client(headers=auth_headers(api_key), timeout=timeout) as client:
        try:
            resp = client.get(base + "/version")
            if resp.status_code == 200:
                version = str(resp.json().get("version") or "") or None
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        try:
            resp = client.get(base + "/metrics")
            if resp.status_code == 200:
                metrics = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError):
            pass
        try:
            resp = client.get(base + "/server_info")
            if resp.status_code == 200:
                m = re.search(r"SpeculativeConfig\(method='([\w-]+)'", resp.text)
                method = m.group(1) if m else None
        except httpx.HTTPError:
            pass
    return ServerFacts(name, max_len, version, metrics, method)


def _scrape(base_url: str, api_key: str | None) -> ServerMetrics | None:
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", headers=auth_headers(api_key), timeout=30.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None


def _vllm_version(version: str | None) -> str | None:
    """simcap's modelled release for a server version ("0.32.0+cpu" -> "0.32"), if modelled."""
    from typing import get_args

    from simcap.config.scenario import VllmVersion

    if not version:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        return None
    minor = f"{int(m.group(1))}.{int(m.group(2))}"
    return minor if minor in get_args(VllmVersion) else None


# --------------------------------------------------------------------------- host overhead


def host_overhead_from_itl(records: Sequence[RequestRecord], rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Host seconds per step: the client-observed decode step period minus the logged elapsed.

    ``rows``: the iteration log's steps of exactly the requests in ``records``. Each request
    waits one step period per decode step between its first and last token, so the mean
    period seen by decoding requests is ``sum(last - first) / sum(decode requests per step)``;
    the logged forward time, weighted the same way (by decode requests per step), is taken
    off it. Also reports the client's own decode-step count (exact without speculation: one
    token per step) as a check that the log window holds these requests and no others.
    """
    ok = [r for r in records if r.succeeded and r.chunk_times]
    span = float(sum(r.chunk_times[-1] - r.chunk_times[0] for r in ok))
    gen = np.array([row["num_decode_reqs"] for row in rows], dtype=float)
    elapsed = np.array([row["step_time_s"] for row in rows], dtype=float)
    steps = float(gen.sum())
    out: dict[str, Any] = {
        "method": "client decode span / logged decode request-steps, minus the logged elapsed "
                  "time weighted by decode requests per step",
        "client_decode_span_s": round(span, 6),
        "log_decode_request_steps": int(steps),
        "client_decode_request_steps": int(sum(r.num_output_tokens - 1 for r in ok)),
        "client_mean_itl_s": None,
    }
    gaps = [g for r in ok for g in np.diff(r.chunk_times)]
    if gaps:
        out["client_mean_itl_s"] = round(float(np.mean(gaps)), 6)
    if steps <= 0 or span <= 0:
        out.update(step_period_s=None, logged_elapsed_s=None, host_overhead_s=0.0,
                   note="no decode steps in the window: host_overhead 0")
        return out
    period = span / steps
    logged = float((elapsed * gen).sum() / steps)
    out.update(step_period_s=round(period, 6), logged_elapsed_s=round(logged, 6),
               host_overhead_s=round(max(period - logged, 0.0), 6))
    if period < logged:
        out["note"] = "the client saw shorter periods than the log's elapsed times: host_overhead 0"
    return out


# --------------------------------------------------------------------------- step contexts


def one_at_a_time_steps(rows: Sequence[dict[str, float]], records: Sequence[RequestRecord]
                        ) -> list[tuple[float, float]] | None:
    """Each step's prefill (query, key) pairs and attended context, exactly, for a run that had
    one request in flight at a time: its steps are each request's prefill chunks, then one step
    per further chunk of its stream, request after request. A chunk of ``m`` prompt tokens after
    ``s`` already in the KV cache (the prompt's prefix-cache hit, the prompt less what its chunks
    computed, and the chunks before) attends ``m s + m (m + 1) / 2`` pairs and ``s + m`` tokens;
    a decode step, the prompt and the tokens generated so far (plus its verified drafts), as the
    engine counts ``num_context_tokens``. None when the steps do not line up with the requests."""
    out: list[tuple[float, float]] = []
    i = 0
    for rec in sorted((r for r in records if r.succeeded), key=lambda r: r.arrival_time):
        chunks = []
        while i < len(rows) and rows[i]["num_prefill_reqs"] == 1 and rows[i]["num_decode_reqs"] == 0:
            chunks.append(rows[i]["num_prefill_tokens"])
            i += 1
        seen = rec.num_prompt_tokens - sum(chunks)  # its prefix-cache hit
        if not chunks or seen < 0:
            return None
        for m in chunks:
            out.append((m * seen + m * (m + 1) / 2.0, float(seen + m)))
            seen += m
        generated = rec.chunk_tokens[0]
        for tokens in rec.chunk_tokens[1:]:
            if i >= len(rows) or rows[i]["num_prefill_reqs"] or rows[i]["num_decode_reqs"] != 1:
                return None
            out.append((0.0, float(rec.num_prompt_tokens + generated + rows[i]["num_verify_tokens"])))
            generated += tokens
            i += 1
    return out if i == len(rows) else None


def step_contexts(runs: Sequence[tuple[LiveRun, Sequence[str]]], k: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefill pairs and attended context of every logged step of ``runs`` (their log lines
    in order), and which steps were exact (a boolean array). Exact in the runs with one request
    in flight at a time (:func:`one_at_a_time_steps`); elsewhere each step's prefill tokens are split evenly over
    its prefill requests, each chunk a whole prompt from position 0 (``a m (m + 1) / 2`` pairs),
    and each decoding request attends the run's mean decode context (over its requests' decode
    steps: prompt + tokens so far), as the roofline fit reads a log without them."""
    pairs: list[float] = []
    context: list[float] = []
    exact: list[bool] = []
    for run, lines in runs:
        rows = parse_iteration_log(lines, k)
        walked = one_at_a_time_steps(rows, run.records) if max_in_flight(run) == 1 else None
        exact += [walked is not None] * len(rows)
        if walked is not None:
            pairs += [p for p, _ in walked]
            context += [c for _, c in walked]
            continue
        decoded = [r for r in run.records if r.succeeded and r.num_output_tokens > 1]
        per_decode = decode_context_of_records(decoded) if decoded else 0.0  # (else no decode step)
        for row in rows:
            a, b = row["num_prefill_reqs"], row["num_prefill_tokens"]
            m = b / a if a else 0.0
            pairs.append(a * m * (m + 1) / 2.0)
            context.append(row["num_decode_reqs"] * per_decode + b + row["num_verify_tokens"])
    return np.array(pairs, dtype=float), np.array(context, dtype=float), np.array(exact, dtype=bool)


# --------------------------------------------------------------------------- result


@dataclass
class LiveCalibration:
    """What ``simcap live calibrate`` did and fitted."""

    profile_path: Path
    profile: dict[str, Any]
    fit: Fit
    source: str
    data_path: Path
    engine: dict[str, Any]
    speculative: dict[str, Any] | None
    host_overhead: dict[str, Any] | None
    phases: list[dict[str, Any]]
    server: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    frontend: dict[str, Any] | None = None  # the front end's fit (FrontendFit.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": str(self.profile_path),
            "source": self.source,
            "data": str(self.data_path),
            "engine": self.engine,
            "speculative": self.speculative,
            "step_time": self.profile["step_time"],
            "host_overhead": self.host_overhead,
            "frontend": self.frontend,
            "phases": self.phases,
            "server": self.server,
            "fit": self.fit.to_dict() | {"residuals": len(self.fit.residuals)},
            "notes": list(self.notes),
            "wall_s": round(self.wall_s, 2),
        }


def _sibling(out: Path, suffix: str) -> Path:
    name = out.name
    for ext in (".yaml", ".yml"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return out.with_name(name + suffix)


def _phase_summary(phase: Phase, run: LiveRun) -> dict[str, Any]:
    s = run.summary()
    return {
        **phase.to_dict(),
        "completed": s.completed,
        "failed": s.failed,
        "ttft_p50_s": s.ttft_s.p50,
        "itl_p50_s": s.itl_s.p50,
        "tpot_p50_s": s.tpot_s.p50,
        "wall_s": round(run.wall_duration_s, 3),
        "errors": sorted({r.error for r in run.records if r.error})[:3],
    }


def calibrate_live(
    base_url: str,
    model: str | None,
    out: str | Path,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None = None,
    log_path: str | Path | None = None,
    num_requests: int = 40,
    speculative_method: str | None = None,
    api_key: str | None = None,
    request_timeout_s: float | None = 600.0,
    async_scheduling: bool = False,
    name: str | None = None,
    hardware: str | None = None,
    seed: int = 0,
    bootstrap: int = 200,
    warmup: bool = True,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
    server_pids: Sequence[int] = (),
    roofline: dict[str, Any] | None = None,
    noise: str | None = "empirical",
    max_concurrency: int | None = None,
    prompt_period: int | None = None,
    record: str | Path | None = None,
) -> LiveCalibration:
    """Run the calibration workload (or probes) against ``base_url`` and write a profile to ``out``.

    ``server_pids``: the server's processes when known (a local :class:`VllmServer`), so CPU use
    of other processes during the workload is measured (:class:`~simcap.live.hostload.CpuWatch`)
    and a disturbed calibration is flagged in the notes and the provenance.
    ``noise``: fit and write ``step_time.noise`` (``"empirical"`` or ``"lognormal"``) from the
    logged steps' ratios measured / fitted; None: neither (probes never fit it).
    ``max_concurrency``: the log source's phases use at most that many clients (see
    :func:`default_phases`). ``prompt_period``: prompts that repeat (see
    :class:`~simcap.live.prompts.PromptBuilder`), for ngram drafts that find matches.
    ``record``: a folder each phase of the log source's workload is saved to, with its log
    lines (:func:`simcap.live.recording.save_run`), so the fit can be replayed.
    Raises :class:`LiveError` / :class:`CalibrationError` (one-line user errors) when the server
    cannot be used, the log holds no iteration lines, or the fit is impossible.
    """
    t_start = time.monotonic()
    out = Path(out)
    say = progress or (lambda _msg: None)
    notes: list[str] = []
    log = Path(log_path) if log_path is not None else None
    if log is not None:
        log_size(log)  # fails fast on a missing file
    elif roofline is not None:
        raise LiveError("--form roofline: fits the server's iteration log; give --log")
    elif record is not None:
        raise LiveError("--record: keeps the server's iteration log with the runs; give --log")
    if record is not None:
        try:  # (fails before the workload runs, not after)
            Path(record).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LiveError(f"--record {record}: cannot make the folder: {exc.strerror or exc}") from None
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise LiveError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
    check_request_timeout(request_timeout_s)
    check_options(bootstrap=bootstrap, seed=seed)

    facts = _server_facts(base_url, model, api_key)
    model = facts.model
    engine = _engine_of_server(base_url, facts, max_num_seqs, max_num_batched_tokens, max_model_len,
                               async_scheduling, notes)
    max_model_len = engine["max_model_len"]
    metrics = facts.metrics
    assert metrics is not None
    k, method = _drafting(base_url, facts, speculative_method, log, notes)
    if roofline is not None and k and method in ("eagle", "eagle3"):
        roofline = {**roofline, "num_draft_passes": k}  # the drafter's k passes are terms of their own

    live_kw: dict[str, Any] = dict(api_key=api_key, request_timeout_s=request_timeout_s, progress=False,
                                   prompt_period=prompt_period)
    if warmup:
        say("warm-up")
        warm = Phase("warm-up", min(2, max_num_seqs), 4,
                     prompt_lengths(max_num_batched_tokens, max_model_len - 9)[:3], (8,))
        run_live(_phase_scenario(warm, engine, seed + 7919), base_url, model, **live_kw)
    reset = reset_prefix_cache(base_url, api_key=api_key)
    if reset != "ok":
        notes.append(f"prefix cache not reset before calibrating: {reset}")

    watch = CpuWatch(server_pids, DEFAULT_THRESHOLD_CORES, _local_port(base_url)).start()
    before = _scrape(base_url, api_key)
    if log is not None:
        fitted = _fit_from_log(log, out, base_url, model, engine, k, live_kw, seed, say, num_requests,
                               max_concurrency, roofline, bootstrap, noise, notes,
                               None if record is None else Path(record))
    else:
        fitted = _fit_from_probes(out, base_url, model, engine, live_kw, seed, say, bootstrap, noise, notes)
    cpu = watch.stop()
    if cpu.get("disturbed"):
        notes.append(
            f"calibration disturbed: other processes used {cpu['foreign_cores']:.2f} cores (steal "
            f"{cpu['steal_cores']:.2f}; top: {', '.join(cpu['top_foreign'][:3]) or '-'}); the step "
            "times are slower than the server's own; rerun on a quiet machine"
        )
    delta = metrics_delta(before, fitted.after)
    speculative = None
    if k:
        assert method is not None
        speculative = speculative_section(base_url, delta, k, method, fitted, notes)
    source, host = fitted.source, fitted.host
    description = (
        f"Fitted live by simcap live calibrate from {source} of vLLM {facts.version or '?'} serving "
        f"{model!r} at {base_url}."
    )
    assumptions = [
        "engine.block_size, num_gpu_blocks, enable_prefix_caching: the server's vllm:cache_config_info",
        "engine.max_num_seqs, max_num_batched_tokens: given on the command line (not published by the server)",
        f"engine.max_model_len: {'given' if facts.max_model_len != max_model_len else 'the server /v1/models'}",
        f"engine.async_scheduling: {str(async_scheduling).lower()}"
        + (" (the CPU platform forces it off)" if not async_scheduling else " (given)"),
    ]
    if source == SOURCE_PROBES:
        assumptions.append(PROBE_WARNING)
    recipe = Recipe(name=name or _default_name(out), hardware=hardware, model=model, description=description,
                    engine=engine, speculative=speculative, assumptions=assumptions, seed=seed)
    profile = profile_dict(fitted.fit, recipe, command=command)
    frontend = fitted.frontend.to_dict() if fitted.frontend is not None else None
    if frontend is not None and frontend["fitted"] is not None:
        # (after the engine's sections, before the fit's uncertainty and provenance)
        tail = {k: profile.pop(k) for k in ("step_time_ci", "bootstrap", "provenance") if k in profile}
        profile["frontend"] = dict(frontend["fitted"])
        profile.update(tail)
    profile["provenance"]["live"] = {
        "fitted_from": source,
        "base_url": base_url,
        "served_model": model,
        "server_version": facts.version,
        "data_file": fitted.data_path.name,
        "workload": fitted.phases,
        "host_overhead_estimate": host,
        **({"frontend": frontend} if frontend is not None else {}),
        "server_counters": {key: v for key, v in delta.items() if key != "cache_config"},
        "cache_config_info": dict(metrics.cache_config),
        "cpu": cpu,
        "notes": list(notes),
    }
    write_profile(profile, out)
    return LiveCalibration(out, profile, fitted.fit, source, fitted.data_path, engine, speculative, host,
                           fitted.phases, {"version": facts.version, "model": model, "base_url": base_url}, notes,
                           time.monotonic() - t_start,
                           frontend)


def _engine_of_server(base_url: str, facts: Any, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int | None, async_scheduling: bool, notes: list[str]) -> dict[str, Any]:
    """The profile's ``engine`` section: the server's KV pool and release, the given limits."""
    model = facts.model
    if max_model_len is None:
        if facts.max_model_len is None:
            raise LiveError(f"{base_url}: /v1/models gives no max_model_len for {model!r}: give --max-model-len")
        max_model_len = facts.max_model_len
    metrics = facts.metrics
    if metrics is None or not metrics.cache_config:
        raise LiveError(
            f"{base_url}/metrics: no vllm:cache_config_info (block_size, num_gpu_blocks): is this a "
            "vLLM server with metrics enabled?"
        )
    if not metrics.block_size or not metrics.num_gpu_blocks:
        raise LiveError(f"{base_url}/metrics: vllm:cache_config_info lacks block_size or num_gpu_blocks")
    engine: dict[str, Any] = {}
    modelled = _vllm_version(facts.version)
    if modelled:
        engine["vllm_version"] = modelled
    elif facts.version:
        notes.append(f"server vLLM {facts.version} is not a release simcap models; vllm_version left to the default")
    engine.update(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=metrics.block_size,
        num_gpu_blocks=metrics.num_gpu_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=metrics.cache_config.get("enable_prefix_caching", "True") == "True",
        async_scheduling=async_scheduling,
    )
    try:
        EngineConfig(**engine)
    except ValueError as exc:
        raise LiveError(f"engine settings: {str(exc).splitlines()[-1].strip()}") from None
    return engine


def _drafting(base_url: str, facts: Any, speculative_method: str | None, log: Path | None,
              notes: list[str]) -> tuple[int, str | None]:
    """The server's drafts per step (k, 0: none) and the method that drafts them."""
    k = facts.metrics.num_speculative_tokens or 0
    if not k:
        if speculative_method:
            notes.append(f"--speculative-method {speculative_method} ignored: the server does not draft")
        return 0, None
    method = speculative_method or facts.speculative_method
    if method is None:
        raise LiveError(
            f"{base_url}: the server drafts k={k} tokens (speculative decoding) but does not say "
            f"which method: give --speculative-method ({', '.join(SPEC_METHODS)})"
        )
    if method not in SPEC_METHODS:
        raise LiveError(f"speculative method {method!r}: simcap models {', '.join(SPEC_METHODS)}")
    if log is None:
        raise LiveError(
            f"{base_url}: the server drafts k={k} tokens; black-box probes cannot tell verified "
            "drafts from decode work: run the server with --enable-logging-iteration-details "
            "and pass its log with --log"
        )
    return k, method


@dataclass
class _Fitted:
    """What a calibration source gave: the fit and the data behind it."""

    source: str
    fit: Fit
    data_path: Path | None  # the fitted data as saved beside the profile (None: not saved)
    phases: list[dict[str, Any]]
    host: dict[str, Any] | None = None  # the log's host-overhead estimate
    rows: list[dict[str, float]] = field(default_factory=list)  # the log's iteration rows
    records: list[RequestRecord] = field(default_factory=list)  # the workload's requests
    after: ServerMetrics | None = None  # /metrics right after the workload (None: unreadable)
    frontend: FrontendFit | None = None  # the front end the log source's phases show


def _fit_from_log(log: Path, out: Path, base_url: str, model: str, engine: dict[str, Any], k: int,
                  live_kw: dict[str, Any], seed: int, say: Callable[[str], None], num_requests: int,
                  max_concurrency: int | None, roofline: dict[str, Any] | None, bootstrap: int,
                  noise: str | None, notes: list[str], record: Path | None = None) -> _Fitted:
    """Run the calibration phases and fit the steps the server logged meanwhile.

    ``record``: a folder each phase's run is saved to (:func:`simcap.live.recording.save_run`,
    ``phase<i>.run.json.gz`` with the log lines of its window), for replays."""
    phases = default_phases(engine["max_num_seqs"], engine["max_num_batched_tokens"], engine["max_model_len"],
                            num_requests, max_concurrency)
    phases_out: list[dict[str, Any]] = []
    records: list[RequestRecord] = []
    lines: list[str] = []
    runs: list[tuple[LiveRun, list[str]]] = []
    for i, phase in enumerate(phases):
        say(f"phase {i + 1}: {phase.name}, {phase.num_requests} requests")
        offset = log_size(log)
        run = run_live(_phase_scenario(phase, engine, seed + i), base_url, model, first_wave_scrape=True, **live_kw)
        mine = iteration_lines(read_log_window(log, offset))
        if record is not None:
            save_run(record / f"phase{i + 1}", run, iterations=[mine])
        phases_out.append(_phase_summary(phase, run))
        records += run.records
        lines += mine
        runs.append((run, mine))
    after = _scrape(base_url, live_kw["api_key"])
    if not parse_iteration_log(lines, k):
        raise LiveError(
            f"--log {log}: no 'Iteration(i): ...' lines appeared during the calibration workload: "
            "start the server with --enable-logging-iteration-details and give its log file "
            "(or omit --log for black-box probes)"
        )
    data_path = _sibling(out, ".iterations.log")
    data_path.parent.mkdir(parents=True, exist_ok=True)
    data_path.write_text("\n".join(lines) + "\n")
    fitted = fit_calibration_log(read_step_samples(data_path, k), lines, records, k, roofline=roofline,
                                 bootstrap=bootstrap, seed=seed, noise=noise, notes=notes, runs=runs)
    frontend = fit_frontend(runs)
    notes += frontend.notes
    return replace(fitted, data_path=data_path, phases=phases_out, after=after, frontend=frontend)


def fit_calibration_log(samples: StepSamples, lines: Sequence[str], records: Sequence[RequestRecord], k: int,
                        *, roofline: dict[str, Any] | None = None, bootstrap: int = 200, seed: int = 0,
                        noise: str | None = "empirical", notes: list[str] | None = None,
                        runs: Sequence[tuple[LiveRun, Sequence[str]]] | None = None) -> _Fitted:
    """The fit of a calibration workload from what it left behind: the server's per-step log
    lines (``samples`` are those lines as step samples) and the client's records of the same
    requests. The host overhead per step comes from both (:func:`host_overhead_from_itl`); then
    the linear form (:func:`fit_log_samples`) or, with ``roofline`` (``hardware``, ``model``,
    ...), the roofline form (:func:`fit_log_roofline`). ``live calibrate`` fits what it just ran
    with it, and a replay of a recorded calibration fits the recorded lines and records with it.
    ``runs``: the workload's runs, each with its own log lines (``lines`` in order): each step's
    attended context and prefill pairs are then read from them (:func:`step_contexts`: exact
    where one request was in flight at a time, prefix-cache hits included), so both forms can
    price the context (the linear form's ``per_context_token``, the roofline's KV reads and
    prefill attention)."""
    notes = notes if notes is not None else []
    rows = [r for r in parse_iteration_log(lines, k) if r["num_prefill_tokens"] + r["num_decode_tokens"] > 0]
    if not rows:
        raise CalibrationError("the calibration's step log holds no step with tokens")
    host = host_overhead_from_itl(records, rows)
    if not k and host["client_decode_request_steps"] != host["log_decode_request_steps"]:
        notes.append(
            f"the log window holds {host['log_decode_request_steps']} decode request-steps, the "
            f"client counted {host['client_decode_request_steps']}: other clients may have used "
            "the server during the calibration"
        )
    if runs is not None:
        samples = with_step_contexts(samples, runs, k, notes)
    if roofline is not None:
        fit = fit_log_roofline(samples, records, host["host_overhead_s"], roofline,
                               bootstrap=bootstrap, seed=seed, noise=noise)
    else:
        fit = fit_log_samples(samples, k, host["host_overhead_s"], bootstrap=bootstrap, seed=seed,
                              noise=noise)
    if runs:  # how far the workload reached: its phases' requests running, as measured
        loads = [v for v in (requests_running(run.summary()) for run, _ in runs) if v is not None]
        if loads:
            most = round(max(loads), 3)
            fit.extra["fit_load"] = {"all": most, "speculative": most if k else None, "plain": None if k else most}
    fit.notes.append(
        f"host_overhead {host['host_overhead_s']:.4g} s per step: client decode step period "
        f"{_ms(host['step_period_s'])} minus the logged forward time {_ms(host['logged_elapsed_s'])} "
        "(decode-request weighted)"
    )
    return _Fitted(SOURCE_LOG, fit, None, [], host, rows, list(records))


def _fit_from_probes(out: Path, base_url: str, model: str, engine: dict[str, Any], live_kw: dict[str, Any],
                     seed: int, say: Callable[[str], None], bootstrap: int, noise: str | None,
                     notes: list[str]) -> _Fitted:
    """Black-box probes (TTFT and time per output token at chosen sizes) and the linear fit."""
    notes.append(PROBE_WARNING)
    rows_out, probe_phases = _probe(base_url, model, engine, engine["max_num_seqs"],
                                    engine["max_num_batched_tokens"], engine["max_model_len"], seed, live_kw, say)
    after = _scrape(base_url, live_kw["api_key"])
    data_path = _sibling(out, ".probes.json")
    data_path.parent.mkdir(parents=True, exist_ok=True)
    data_path.write_text(json.dumps({"source": SOURCE_PROBES, "note": PROBE_WARNING, "samples": rows_out}, indent=1))
    samples = read_step_samples(data_path)
    fit = fit_step_samples([samples], Form.parse("base,per_prefill_token,per_decode_token"),
                           host_overhead=0.0, bootstrap=bootstrap, seed=seed, noise=None)
    if noise:
        notes.append("step_time.noise not fitted: probes are medians of many steps, not single steps")
    fit.notes.append("host_overhead 0: probe periods (TTFT, time per output token) include the host work")
    return _Fitted(SOURCE_PROBES, fit, data_path, probe_phases, after=after)


def speculative_section(base_url: str, delta: dict[str, Any], k: int, method: str, fitted: _Fitted,
                        notes: list[str]) -> dict[str, Any]:
    """The profile's ``speculative`` section: the acceptance the server counted and, for ngram,
    how often and from when its lookups propose (the step log and the client records)."""
    acc = delta.get("spec_decode_mean_acceptance_length")
    if acc is None:
        raise LiveError(f"{base_url}: the server drafted nothing during the calibration workload")
    speculative: dict[str, Any] = {"method": method, "num_speculative_tokens": k,
                                   "acceptance_length": round(min(acc, k + 1), 4)}
    host, rows, records = fitted.host, fitted.rows, fitted.records
    if method == "ngram" and host is not None and host["log_decode_request_steps"]:
        drafts = delta.get("spec_decode_num_drafts") or 0.0
        steps = host["log_decode_request_steps"]
        # Output tokens before the lookup first matches (requests that ran alone); the
        # rate then counts the request-steps from there on.
        onset = fit_proposal_onset(rows)
        if onset["requests"] < MIN_ONSET_REQUESTS:  # few requests ran alone: the stream chunks
            onset = onset_from_records(records)
        proposal_rows = rows
        if drafts and onset["onset_tokens"] > 1:
            m = onset["onset_tokens"]
            speculative["proposal_onset_tokens"] = m
            steps -= sum(min(m - 1, r.num_output_tokens - 1) for r in records if r.succeeded)
            proposal_rows = rows_after_onset(rows, m)
        rate = drafts / steps if steps > 0 else 1.0
        speculative["proposal_rate"] = round(min(max(rate, 1e-3), 1.0), 4)
        proposals: dict[str, Any] = {"concentration": None, "note": "rate 1: every request-step drafts"}
        if drafts and speculative["proposal_rate"] < 1.0:
            # How much requests differ in matching: the per-step log's drafting counts.
            draft_len = (delta.get("spec_decode_num_draft_tokens") or drafts * k) / drafts
            proposals = fit_proposal_concentration(
                proposal_rows, speculative["proposal_rate"], draft_len, speculative["acceptance_length"] - 1.0)
            proposals["mean_draft_length"] = round(draft_len, 4)
            if proposals["concentration"] is not None:
                speculative["proposal_concentration"] = proposals["concentration"]
        notes.append(
            "ngram proposals: {}rate {:.3g} of decode request-steps{}; {}".format(
                f"onset {onset['onset_tokens']} output tokens (median of {onset['requests']} requests, "
                f"{onset.get('source', 'alone in the step log')}), " if "proposal_onset_tokens" in speculative else "",
                speculative["proposal_rate"],
                " from the onset on" if "proposal_onset_tokens" in speculative else "",
                f"concentration {proposals['concentration']:.3g} over requests "
                f"(step variance {proposals['step_variance']:.3g}, {proposals['pairs']} step pairs)"
                if proposals["concentration"] is not None else proposals.get("note", "")))
    SpeculativeConfig(**speculative)
    return speculative

def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.2f} ms"


def _default_name(out: Path) -> str:
    return _sibling(out, "").name or "live-profile"


def _spread(samples: StepSamples, term: str) -> bool:
    return bool(len(samples) and np.ptp(samples.X[:, TERMS.index(term)]) > 0)


MIN_EXACT_CONTEXT_STEPS = 50


def _contexts_vary(samples: StepSamples, rows: np.ndarray) -> bool:
    """Whether the decode steps ``rows`` include at least 50 whose attended context is known
    exactly (:func:`with_step_contexts`: steps of a run with one request in flight, such as the
    calibration's long-context phase) and those attend contexts that differ by half or more, so
    a cost per context token can be told from the cost per request. (Contexts taken at a run's
    mean vary with the batch alone: a fit on them trades the one cost for the other.)"""
    exact = (samples.counts or {}).get("context_exact")
    if "per_context_token" not in samples.available or exact is None:
        return False
    rows = rows & exact
    ctx = samples.X[rows, TERMS.index("per_context_token")]
    return int(rows.sum()) >= MIN_EXACT_CONTEXT_STEPS and ctx.max() > 1.5 * ctx.min()


def _proportional(samples: StepSamples, a: str, b: str) -> bool:
    """Whether column ``b`` is a fixed multiple of column ``a`` in every step (EAGLE: k verified
    drafts per decode request), so a fit cannot tell their coefficients apart."""
    x, y = samples.X[:, TERMS.index(a)], samples.X[:, TERMS.index(b)]
    if not np.any(x):
        return False
    ratio = y[x > 0] / x[x > 0]
    return bool(np.all(y[x == 0] == 0) and np.ptp(ratio) < 1e-9)


def with_step_contexts(samples: StepSamples, runs: Sequence[tuple[LiveRun, Sequence[str]]], k: int,
                       notes: list[str]) -> StepSamples:
    """``samples`` with the attended context and prefill pairs of :func:`step_contexts` as
    columns (the same samples when the runs' log lines are not exactly their rows)."""
    pairs, context, exact = step_contexts(runs, k)
    if len(pairs) != len(samples) or samples.counts is None:
        return samples
    X = samples.X.copy()
    X[:, TERMS.index("per_context_token")] = context
    counts = {**samples.counts, "num_prefill_pairs": pairs, "num_context_tokens": context,
              "context_exact": exact}
    notes.append(f"attended context and prefill pairs: {int(exact.sum())} of {len(samples)} steps exact (the runs "
                 "with one request in flight, prefix-cache hits included); the others each decoding "
                 "request at its run's mean decode context, each prefill chunk a whole prompt from 0")
    return StepSamples(X, samples.y, samples.available | {"per_context_token"}, samples.source,
                       samples.start_s, counts)


def fit_log_samples(
    samples: StepSamples, k: int, host_overhead: float, *, bootstrap: int = 200, seed: int = 0,
    noise: str | None = "empirical",
) -> Fit:
    """Two-stage NNLS of iteration-log steps with :func:`simcap.calibrate.fit_step_samples`.

    Prefill steps are long and noisy (on a shared CPU their time moves by +-10 %, i.e. by more
    than a whole decode step), so one least-squares fit over all steps lets them set the base
    cost and leaves the decode terms -- which decide ITL -- to chance. So: (1) the decode-only
    steps (many, short, precise) fit ``base``, ``per_decode_token``, with drafts
    ``per_verify_token``, and ``per_context_token`` when the samples say each step's attended
    context (:func:`with_step_contexts`) and it varies per decoding request by half or more;
    (2) all steps, those fixed, fit ``per_prefill_token`` and, when the log
    has mixed steps, ``mixed_step``. Intervals: each stage's pairs bootstrap (stage 2 resamples
    with stage 1's point estimates). Fit quality and residuals: all steps, final coefficients.
    With fewer than 10 decode-only or 3 prefill steps, one fit of all terms over all steps.
    ``noise``: the step-time noise family fitted from all steps' residual ratios, or None.
    """
    pre = samples.X[:, TERMS.index("per_prefill_token")]
    decode_only = pre == 0
    stage1_terms = ["base", "per_decode_token"]
    folded = k and _spread(samples, "per_verify_token") and _proportional(samples, "per_decode_token", "per_verify_token")
    if k and _spread(samples, "per_verify_token") and not folded:
        stage1_terms.append("per_verify_token")
    if _contexts_vary(samples, decode_only):
        stage1_terms.append("per_context_token")
    stage2_terms = ["per_prefill_token"]
    mixed = samples.X[:, TERMS.index("mixed_step")]
    if 0 < mixed.sum() < len(samples) - 1:
        stage2_terms.append("mixed_step")
    fold_note = (
        f"per_verify_token tied to per_decode_token: every decode request verified its k = {k} drafts "
        "(EAGLE drafts every step), so the log cannot tell a decode token from its drafts; each of a "
        f"request's 1 + {k} tokens costs per_decode_token, which holds its share of the draft passes too, "
        "and base their fixed cost"
    ) if folded else None
    if decode_only.sum() < 10 or (~decode_only).sum() < 3:
        fit = fit_step_samples([samples], Form.parse(stage1_terms + stage2_terms),
                               host_overhead=host_overhead, bootstrap=bootstrap, seed=seed, noise=noise)
        if fold_note:
            fit.notes.append(fold_note)
        return fit
    sub = StepSamples(samples.X[decode_only], samples.y[decode_only], samples.available,
                      {**samples.source, "rows": int(decode_only.sum()), "subset": "decode-only steps"})
    form1 = Form.parse(stage1_terms)
    f1 = fit_step_samples([sub], form1, host_overhead=host_overhead, bootstrap=bootstrap, seed=seed,
                          noise=None)
    fixed = {t: f1.coefficients[t] for t in form1.free}
    form2 = Form.parse(stage2_terms)
    f2 = fit_step_samples([samples], form2, fixed=fixed, host_overhead=host_overhead,
                          bootstrap=bootstrap, seed=seed + 1, noise=noise)
    sets = [{**a, **b} for a, b in zip(f1.bootstrap, f2.bootstrap)]
    return Fit(
        kind="step_samples",
        method=("two-stage nnls (scipy.optimize.nnls) on measured step seconds: decode-only steps "
                f"-> {', '.join(form1.free)}; then all steps -> {', '.join(form2.free)}"),
        form=Form(tuple([*form1.free, *form2.free]), dict(form1.tied)),
        coefficients=dict(f2.coefficients), fixed={},
        ci={**f1.ci, **f2.ci}, bootstrap=sets,
        bootstrap_method=(f"pairs bootstrap over step rows per stage ({bootstrap} resamples, seeds "
                          f"{seed}, {seed + 1}; stage 2 holds stage 1's estimates)"),
        level=f2.level, residuals=f2.residuals, sources=f2.sources,
        warnings=list(f2.warnings),
        notes=[*([fold_note] if fold_note else []),
               f"stage 1: {int(decode_only.sum())} decode-only steps, R^2 {f1.quality.get('r2')}, "
               f"median |error| {f1.quality.get('median_abs_rel_error')}",
               f"stage 2: all {len(samples)} steps, R^2 {f2.quality.get('r2')}, median |error| "
               f"{f2.quality.get('median_abs_rel_error')}",
               *(n for n in f2.notes if n.startswith("step_time.noise"))],
        quality=dict(f2.quality), noise=f2.noise, noise_report=f2.noise_report,
    )


def fit_log_roofline(
    samples: StepSamples, records: Sequence[RequestRecord], host_overhead: float,
    roofline: dict[str, Any], *, bootstrap: int = 200, seed: int = 0, noise: str | None = "empirical",
) -> Fit:
    """The roofline form fitted to iteration-log steps
    (:func:`simcap.calibrate.fit_roofline.fit_roofline_samples`), the attended context of each
    step derived from the client's records of the same workload (mean over decode request-steps
    of prompt + tokens generated so far). ``roofline``: ``hardware``, ``model`` and optionally
    ``combine``, ``routing_skew``, ``prior_sd``."""
    from simcap.calibrate.fit_roofline import ContextSource, fit_roofline_samples

    opts = dict(roofline)
    opts.pop("records", None)
    context = ContextSource(decode_context_of_records(records),
                            "the calibration workload's client records: mean over decode "
                            "request-steps of prompt + tokens generated so far")
    return fit_roofline_samples([samples], opts.pop("hardware"), opts.pop("model"), context=context,
                                host_overhead=host_overhead, bootstrap=bootstrap, seed=seed,
                                noise=noise, **opts)


def _probe(base_url, model, engine, max_num_seqs, budget, max_model_len, seed, live_kw, say):
    """Isolated prefills (TTFT) and simultaneous decode groups (time per output token)."""
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    lens = [n for n in prompt_lengths(budget, max_model_len - 3) if n <= budget]
    for i, n in enumerate(lens):
        say(f"prefill probe: {n} tokens")
        phase = Phase(f"isolated prefill {n} tokens", 1, 3, (n,), (2,))
        run = run_live(_phase_scenario(phase, engine, seed + 100 + i), base_url, model, **live_kw)
        ttft = [r.chunk_times[0] - r.arrival_time for r in run.records if r.succeeded]
        if ttft:
            rows.append({"num_prefill_tokens": n, "num_prefill_reqs": 1, "num_decode_tokens": 0,
                         "num_decode_reqs": 0, "step_time_s": float(np.median(ttft)), "probe": "ttft"})
        phases.append(_phase_summary(phase, run))
    sizes = sorted({c for c in (1, 2, 4, 8, 16, 32, 64) if c <= max_num_seqs} | {min(max_num_seqs, 64)})
    out_len = 24
    prompt = max(8, min(16, budget // max(sizes)))
    for c in sizes:
        say(f"decode probe: batch {c}")
        phase = Phase(f"{c} simultaneous streams", c, c, (prompt,), (out_len,))
        run = run_live(_phase_scenario(phase, engine, seed + 200 + c), base_url, model, **live_kw)
        tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1)
                for r in run.records if r.succeeded and r.num_output_tokens > 1]
        if tpot:
            rows.append({"num_prefill_tokens": 0, "num_prefill_reqs": 0, "num_decode_tokens": c,
                         "num_decode_reqs": c, "step_time_s": float(np.median(tpot)), "probe": "tpot"})
        phases.append(_phase_summary(phase, run))
    if len(rows) < 4:
        raise CalibrationError(f"{base_url}: only {len(rows)} probes succeeded; too few to fit")
    return rows, phases


__all__ = [
    "LiveCalibration",
    "Phase",
    "PROBE_WARNING",
    "SOURCE_LOG",
    "SOURCE_PROBES",
    "calibrate_live",
    "default_phases",
    "fit_calibration_log",
    "fit_log_roofline",
    "fit_log_samples",
    "host_overhead_from_itl",
    "prompt_lengths",
    "speculative_section",
]
