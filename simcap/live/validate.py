"""Simulated vs live: run a workload on a real server and predict the very same trace.

:func:`validate` runs the scenario's workload live ``repeats`` times (resetting the server's
prefix cache between runs where it allows it), and for each live run simulates EXACTLY that
run's trace: prompt lengths (as the server counted them), output lengths and prefix segments,
sent as the live run sent them (``simulate(scenario, trace=...)``). An open-loop run is
replayed at its send times. A closed-loop run is replayed as a closed loop
(:class:`~simcap.workloads.requests.ClosedLoopTrace`): the same clients, each sending its own requests
in its order, each send the measured gap after the end of that client's previous response.
A session workload's run is replayed as its sessions (``replay="sessions"``, the default
there): the same sessions and turns, each turn's prompt as sent and its answer as long as it
came back, each turn sent the measured gap after the previous turn's last token; beside the
usual metrics it then compares the server's prefix-hit rate (``/metrics`` hits over queries)
with the simulated engine's same counters, and per turn index the TTFT and prefix-hit share
(:func:`compare_sessions`, from the per-turn summary of :mod:`simcap.metrics.summary` on both sides).
Replaying a closed loop at fixed send times instead (``replay="times"``) sends a request into a full
engine whenever a step is priced a little slow, where a real client would still be waiting
for its previous response: at concurrency = ``max_num_seqs`` a step model 5 % slow inflates
the replayed TTFT median several times over. Run-to-run noise of a real server is
large (medians move +-15-20 %, tails 2-3x), so each prediction is judged against the live
runs' own spread: per metric it reports every repeat's live value, their min-max range, the
prediction, its relative error against the live median, and whether it lies inside the range.
For TTFT and ITL it also gives the two-sample Kolmogorov-Smirnov statistic between the pooled
simulated and live samples.

A server restarted with the same flags and trace moves the medians more than repeats against
one instance do. With ``launch`` (``live validate --launch SERVER.yaml --restarts N``) the
server is started ``N + 1`` times, ``repeats`` runs against each, so the measured band holds
instance-to-instance variance; the result's ``spread`` says which spread the band holds and,
per headline metric, the range of the instances' medians and the range within an instance.

Runs disturbed by foreign processes (see :mod:`simcap.live.hostload`) are flagged and left
out of the range and median while at least one undisturbed run remains.

So are runs in which the load generator itself paused for
:data:`~simcap.live.client.PAUSE_DISTURBS_S` or longer (``LiveRun.paused``): its event loop
was held, so the requests in flight timed the pause and, in a closed loop, every client the
pause held sent its next request as it ended, a burst the server never asked for. Leaving out
only the requests a pause touched would not do: which requests those are depends on the live
run's timing, not the replay's, and the remaining ones are the calm stretches of the live run
against every stretch of the replay.

With speculative decoding, what the drafts achieved is part of the trace too: by default each
run is simulated with that run's own acceptance (vLLM's per-position acceptance counters) and,
for ngram, its proposal rate (drafts per decode request-step, the server's ITL sample count),
so the comparison judges the step-time model, not a guess of acceptance; the scenario's and
the run's values are both in the notes. ``adopt_spec_acceptance=False`` keeps the scenario's.

A fleet (a scenario with ``deployment``, one base URL per replica): each live run, routed by
the deployment's router over the servers, is replayed at its send times through the
simulated fleet with the same router (:func:`simcap.fleet.replicas.simulate_fleet`), which routes the
requests anew from its own simulated state. Besides the fleet-wide metrics above, ``fleet``
compares per replica the requests and tokens routed and TTFT/E2E, and the load imbalance
(max / mean over the replicas of requests and of tokens), live against predicted, and how
many requests the simulated router sent where the live one did. A fleet's servers are given
by their URLs (``launch`` starts one server), and a session workload runs on one server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import httpx
import numpy as np
from rich.table import Table

from simcap.config.scenario import ClosedArrival, Scenario
from simcap.fleet.run import simulate
from simcap.live.client import LiveError, LiveRun, auth_headers, check_live_sessions, run_live
from simcap.live.hostload import DEFAULT_THRESHOLD_CORES, CpuWatch
from simcap.live.prom import ServerMetrics
from simcap.live.recording import iteration_lines, log_size, read_log_window
from simcap.live.routing import check_fleet_urls
from simcap.live.saturation import at_fraction, check_rate_of_saturation, measure_saturation
from simcap.metrics.records import RequestRecord
from simcap.metrics.report import describe_line
from simcap.metrics.summary import Summary
from simcap.simulation.frontend import describe as describe_frontend
from simcap.workloads.requests import ClosedLoopTrace, RequestSpec

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p95", "p99")
METRICS = tuple(f"{m}_{s}" for m in LATENCY_METRICS for s in STATS) + ("output_throughput",)
REPLAYS = ("closed", "times", "sessions")


def metric_value(summary: Summary, key: str) -> float | None:
    """One comparable number of a summary: ``ttft_p95`` (s), ``output_throughput`` (tok/s)."""
    if key == "output_throughput":
        return summary.throughput["output_tokens_per_s"]
    metric, _, stat = key.partition("_")
    return getattr(getattr(summary, f"{metric}_s"), stat)


def samples(records: Iterable[RequestRecord]) -> dict[str, np.ndarray]:
    """Raw TTFT and per-chunk ITL samples (s) of the completed records."""
    ttft, itl = [], []
    for r in records:
        if not r.succeeded:
            continue
        ttft.append(r.chunk_times[0] - r.arrival_time)
        itl.extend(np.diff(r.chunk_times).tolist())
    return {"ttft": np.asarray(ttft), "itl": np.asarray(itl)}


def _replayed_spec(run: LiveRun, rec: RequestRecord, j: int) -> RequestSpec:
    """What ``rec`` asked for, as request ``j`` of the replay.

    Prompt lengths are the server's (``usage.prompt_tokens``); when they differ from the spec
    (chat endpoint), the request's own last segment absorbs the difference so shared prefix
    segments stay shared.
    """
    spec = run.specs[rec.request_id]
    segments = list(spec.segments)
    diff = rec.num_prompt_tokens - spec.num_prompt_tokens
    if diff:
        key, n = segments[-1]
        if n + diff > 0:
            segments[-1] = (key, n + diff)
        else:
            segments = [(key, rec.num_prompt_tokens)]
    if spec.session_id is None:
        return RequestSpec(j, rec.num_prompt_tokens, rec.max_tokens, tuple(segments))
    # A session turn: its answer as long as it came back (the next turn's prompt quotes it
    # under its key), and which session and turn it is.
    return RequestSpec(
        j, rec.num_prompt_tokens, rec.num_output_tokens, tuple(segments), output_key=spec.output_key,
        session_id=spec.session_id, turn=spec.turn,
    )


def trace_of(run: LiveRun) -> list[tuple[float, RequestSpec]]:
    """The live run as a simulator trace of send times: completed requests in send order, ids 0..N-1."""
    done = sorted((r for r in run.records if r.succeeded), key=lambda r: (r.arrival_time, r.request_id))
    return [(rec.arrival_time, _replayed_spec(run, rec, j)) for j, rec in enumerate(done)]


def closed_trace_of(run: LiveRun) -> ClosedLoopTrace:
    """A closed-loop live run as a closed-loop trace: its clients, requests and measured gaps."""
    return ClosedLoopTrace.from_records(run.records, lambda rec, j: _replayed_spec(run, rec, j))


def session_trace_of(run: LiveRun) -> ClosedLoopTrace:
    """A live session run as sessions: the same sessions and turns (each prompt the
    conversation as sent, each answer as long as it came back), each turn sent its measured
    gap (think time and client overhead) after the previous turn's last token. A closed loop
    replays its clients, each running its sessions in order; an open loop one client per
    session, starting at the session's send time."""
    by = "client_id" if run.closed_loop else "session_id"
    return ClosedLoopTrace.from_records(run.records, lambda rec, j: _replayed_spec(run, rec, j), by=by)


def default_replay(scenario: Scenario, fleet: bool = False) -> str:
    """How a live run of ``scenario`` is replayed unless told: as its sessions, as its closed
    loop (one server), else at its send times."""
    if scenario.workload.sessions is not None:
        return "sessions"
    if isinstance(scenario.workload.arrival, ClosedArrival) and not fleet:
        return "closed"
    return "times"


def replay_run(scenario: Scenario, run: LiveRun, replay: str, steps: bool = False) -> Any:
    """The simulation of exactly ``run``'s trace on ``scenario`` (records kept; ``steps``: its
    step rows too): at its send times (``"times"``), as its closed loop (``"closed"``) or as its
    sessions (``"sessions"``); a scenario with a ``deployment`` simulates its fleet."""
    if replay not in REPLAYS:
        raise LiveError(f"replay: must be one of {', '.join(REPLAYS)} (got {replay!r})")
    trace: list[tuple[float, RequestSpec]] | ClosedLoopTrace
    trace = {"closed": closed_trace_of, "sessions": session_trace_of}.get(replay, trace_of)(run)
    return simulate(scenario, trace=trace, records=True, steps=steps)


def speed_of(scenario: Scenario, run: LiveRun, replay: str, lines: Sequence[str], sim: Any) -> tuple[Any, Any]:
    """A run's engine speed against its replay ``sim`` (:mod:`simcap.live.engine_speed`; the
    replay must keep its steps) and the replay at that speed: (speed, result), or (None,
    None) without one server's step log or enough decode steps."""
    from simcap.engine.scheduler import resolve_async_scheduling
    from simcap.live.engine_speed import at_speed, engine_speed

    if not lines or getattr(sim, "steps", None) is None or not len(sim.steps):
        return None, None
    spec = scenario.speculative
    k = spec.num_speculative_tokens if spec is not None else 0
    asynchronous = resolve_async_scheduling(scenario.engine, spec.method if spec is not None else None)
    speed = engine_speed(lines, sim.steps.as_arrays(), scenario.step_time.host_overhead, asynchronous, k)
    if speed is None:
        return None, None
    return speed, replay_run(at_speed(scenario, speed["ratio"], speed["prefill_ratio"]), run, replay)


FLEET_KEYS = ("requests", "tokens", "ttft_p50_s", "e2e_p95_s")


def fleet_pair(run: LiveRun, sim_records: list[RequestRecord]) -> dict[str, Any]:
    """One fleet run, live and its replay: per-replica rows, imbalance, and the fraction of
    requests the simulated router sent to the replica the live one chose (the replay's
    request j is the live run's j-th completed request in send order)."""
    from simcap.fleet.replicas import load_imbalance, replica_rows

    n = len(run.base_urls)
    live_rows = replica_rows(run.records, n)
    sim_rows = replica_rows(sim_records, n)
    done = sorted((r for r in run.records if r.succeeded), key=lambda r: (r.arrival_time, r.request_id))
    sim = sorted(sim_records, key=lambda r: r.request_id)
    same = sum(1 for a, b in zip(done, sim) if a.replica == b.replica)
    return {
        "live": {"per_replica": live_rows, "load_imbalance": load_imbalance(live_rows)},
        "predicted": {"per_replica": sim_rows, "load_imbalance": load_imbalance(sim_rows)},
        "same_replica_fraction": same / len(sim) if sim else None,
    }


def compare_fleet(repeats: Sequence["Repeat"]) -> dict[str, Any]:
    """Per imbalance measure and per replica metric: every repeat's live and predicted value,
    the live range and median, the predicted median and whether it lies in the live range."""
    clean = [r for r in repeats if not r.disturbed] or list(repeats)

    def entry(live_all: list, pred_all: list, live: list, pred: list) -> dict[str, Any]:
        live = [v for v in live if v is not None]
        pred = [v for v in pred if v is not None]
        lo, hi = (min(live), max(live)) if live else (None, None)
        p = float(np.median(pred)) if pred else None
        med = float(np.median(live)) if live else None
        return {"live": live_all, "predicted_per_repeat": pred_all, "live_min": lo, "live_max": hi,
                "live_median": med, "predicted": p, "rel_error": _rel(p, med),
                "in_range": None if p is None or lo is None else bool(lo <= p <= hi)}

    out: dict[str, Any] = {"load_imbalance": {}, "per_replica": []}
    for key in ("requests", "tokens"):
        get = lambda r, side: r.fleet[side]["load_imbalance"][key]  # noqa: E731
        out["load_imbalance"][key] = entry(
            [get(r, "live") for r in repeats], [get(r, "predicted") for r in repeats],
            [get(r, "live") for r in clean], [get(r, "predicted") for r in clean],
        )
    n = len(repeats[0].fleet["live"]["per_replica"])
    for i in range(n):
        row: dict[str, Any] = {"replica": i}
        for key in FLEET_KEYS:
            get = lambda r, side: r.fleet[side]["per_replica"][i][key]  # noqa: E731
            row[key] = entry(
                [get(r, "live") for r in repeats], [get(r, "predicted") for r in repeats],
                [get(r, "live") for r in clean], [get(r, "predicted") for r in clean],
            )
        out["per_replica"].append(row)
    out["same_replica_fraction"] = [r.fleet["same_replica_fraction"] for r in repeats]
    return out


@dataclass
class RunDone:
    """A live run of :func:`validate` as it ended: which one, its records, the host load, and
    the per-step log lines each server wrote while it ran (empty without server logs)."""

    index: int
    instance: int
    run: LiveRun
    cpu: dict[str, Any]
    iterations: list[list[str]]


@dataclass
class Repeat:
    """One live run and its simulated twin."""

    index: int
    live: LiveRun
    live_summary: Summary
    sim_summary: Summary
    sim_records: list[RequestRecord]
    cpu: dict[str, Any]
    prefix_cache_reset: str  # "ok", "not allowed (HTTP 404)", "skipped"
    sim_prefix_cache: dict[str, int] | None = None  # the simulated engine's queries / hits
    instance: int = 0  # which server instance it ran against (restarts)
    fleet: dict[str, Any] | None = None  # several servers: fleet_pair()
    # The engine's speed during the run against the replay's, and the replay at that speed
    # (simcap.live.engine_speed; None without the server's step log).
    engine_speed: dict[str, Any] | None = None
    speed_summary: Summary | None = None

    @property
    def live_prefix_hit_rate(self) -> float | None:
        """The server's prefix-cache hits over queries during the run (``/metrics`` deltas)."""
        return self.live.server_delta().get("prefix_cache_hit_rate")

    @property
    def sim_prefix_hit_rate(self) -> float | None:
        """The same ratio of the simulated engine's counters."""
        pc = self.sim_prefix_cache
        return pc["hits"] / pc["queries"] if pc and pc["queries"] else None

    @property
    def disturbed(self) -> bool:
        """Foreign CPU use, or the load generator paused (``LiveRun.paused``)."""
        return self.live.disturbed(self.cpu)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "instance": self.instance,
            "disturbed": self.disturbed,
            "client_pauses": self.live.client_pauses,
            "prefix_cache_reset": self.prefix_cache_reset,
            "cpu": self.cpu,
            "live": {k: metric_value(self.live_summary, k) for k in METRICS},
            "predicted": {k: metric_value(self.sim_summary, k) for k in METRICS},
            "completed": self.live_summary.completed,
            "failed": self.live_summary.failed,
            "achieved_rate": self.live.achieved_rate,
            "requested_rate": self.live.requested_rate,
            "wall_duration_s": self.live.wall_duration_s,
            "cross_check": self.live.cross_check(),
            "server": {
                k: v for k, v in self.live.server_delta().items() if k != "cache_config"
            },
            "notes": list(self.live.notes),
            "engine_speed": self.engine_speed,
            "predicted_at_measured_speed": None if self.speed_summary is None else {
                k: metric_value(self.speed_summary, k) for k in METRICS},
            **({"sessions": {
                **self.live.sessions,
                "live_prefix_hit_rate": self.live_prefix_hit_rate,
                "predicted_prefix_hit_rate": self.sim_prefix_hit_rate,
                "predicted_prefix_cache": self.sim_prefix_cache,
            }} if self.live.sessions is not None else {}),
            **({"fleet": self.fleet} if self.fleet is not None else {}),
        }


@dataclass
class Validation:
    scenario: Scenario
    simulated_scenario: Scenario
    repeats: list[Repeat]
    metrics: dict[str, dict[str, Any]]
    ks: dict[str, dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    replay: dict[str, Any] = field(default_factory=dict)  # how live runs were simulated
    sessions: dict[str, Any] | None = None  # a session workload: compare_sessions()
    spread: dict[str, Any] = field(default_factory=dict)  # which spread the band holds
    fleet: dict[str, Any] | None = None  # several servers: compare_fleet()
    saturation: list[dict[str, Any]] | None = None  # --rate-of-saturation: each instance's probe

    @property
    def used(self) -> list[Repeat]:
        """Repeats the comparison rests on: the undisturbed ones (all, if every one was)."""
        return [r for r, ok in zip(self.repeats, _used_mask(self.repeats)) if ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario_name": self.scenario.name,
            "scenario_sha256": self.scenario.digest(),
            "simulated_engine": self.simulated_scenario.engine.model_dump(mode="json"),
            # the front end the prediction added (None: none; frontend: null switches it off)
            "frontend": describe_frontend(self.simulated_scenario.frontend),
            "replay": dict(self.replay),
            "spread": dict(self.spread),
            "repeats": [r.to_dict() for r in self.repeats],
            "used_repeats": [r.index for r in self.used],
            "metrics": self.metrics,
            "ks": self.ks,
            **({"sessions": self.sessions} if self.sessions is not None else {}),
            "notes": list(self.notes),
            **({"fleet": self.fleet} if self.fleet is not None else {}),
            **({"saturation": self.saturation} if self.saturation is not None else {}),
        }


def _rel(pred: float | None, ref: float | None) -> float | None:
    if pred is None or ref is None or ref == 0:
        return None
    return (pred - ref) / ref


def used_mask(disturbed: Sequence[bool]) -> list[bool]:
    """Which runs a comparison rests on, given which were disturbed: the undisturbed ones
    (all, if every one was)."""
    mask = [not d for d in disturbed]
    return mask if any(mask) else [True] * len(mask)


def _used_mask(repeats: Sequence[Repeat]) -> list[bool]:
    return used_mask([r.disturbed for r in repeats])


def _entry(live_all: Sequence[float | None], pred_all: Sequence[float | None], used: Sequence[bool]) -> dict[str, Any]:
    """One compared number: every repeat's live value and prediction; over the used repeats
    the live range and median, the median prediction, its error and whether it is in range."""
    live = [v for v, ok in zip(live_all, used) if ok and v is not None]
    pred = [v for v, ok in zip(pred_all, used) if ok and v is not None]
    lo = min(live) if live else None
    hi = max(live) if live else None
    med = float(np.median(live)) if live else None
    p = float(np.median(pred)) if pred else None
    return {
        "live": list(live_all),
        "predicted_per_repeat": list(pred_all),
        "live_min": lo,
        "live_max": hi,
        "live_median": med,
        "predicted": p,
        "rel_error": _rel(p, med),
        "in_range": None if p is None or lo is None else bool(lo <= p <= hi),
    }


def compare(repeats: Sequence[Repeat]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per metric: live values, range, median; prediction, error, in range. And KS tests."""
    from scipy.stats import ks_2samp  # imported here: scipy.stats takes a second to load

    used = _used_mask(repeats)
    clean = [r for r, ok in zip(repeats, used) if ok]
    metrics: dict[str, dict[str, Any]] = {
        key: _entry([metric_value(r.live_summary, key) for r in repeats],
                    [metric_value(r.sim_summary, key) for r in repeats], used)
        for key in METRICS
    }
    if any(r.speed_summary is not None for r in clean):  # the replays at each run's measured speed
        for key, entry in metrics.items():
            at = [metric_value(r.speed_summary, key) for r in clean if r.speed_summary is not None]
            at = [v for v in at if v is not None]
            p = float(np.median(at)) if at else None
            entry["predicted_at_measured_speed"] = p
            entry["rel_error_at_measured_speed"] = _rel(p, entry["live_median"])
    ks: dict[str, dict[str, Any]] = {}
    for name in ("ttft", "itl"):
        live_s = np.concatenate([samples(r.live.records)[name] for r in clean])
        sim_s = np.concatenate([samples(r.sim_records)[name] for r in clean])
        entry: dict[str, Any] = {"live_n": int(live_s.size), "sim_n": int(sim_s.size)}
        if live_s.size and sim_s.size:
            res = ks_2samp(sim_s, live_s)
            entry.update(statistic=float(res.statistic), pvalue=float(res.pvalue))
        else:
            entry.update(statistic=None, pvalue=None)
        per = []
        for r in clean:
            a, b = samples(r.sim_records)[name], samples(r.live.records)[name]
            per.append(float(ks_2samp(a, b).statistic) if a.size and b.size else None)
        entry["per_repeat_statistic"] = per
        ks[name] = entry
    return metrics, ks


TURN_STATS = ("mean", "p50", "p90")


def compare_sessions(repeats: Sequence[Repeat]) -> dict[str, Any]:
    """A session workload's own comparison, each number as :func:`compare`'s entries.

    ``prefix_hit_rate``: the server's ``prefix_cache_hits / prefix_cache_queries`` over the
    run against the simulated engine's same counters. ``prefix_hit_share``: cached over
    prompt tokens of the completed turns (the summary's ``sessions`` block on both sides; live
    only with the server's per-request cached tokens). ``by_turn``: per turn index, the
    completed turns on each side and the TTFT mean, p50 and p90, and the prefix-hit share.
    """
    used = _used_mask(repeats)
    live_blocks = [r.live_summary.sessions or {} for r in repeats]
    sim_blocks = [r.sim_summary.sessions or {} for r in repeats]

    def rows(blocks):
        return [{row["turn"]: row for row in b.get("by_turn", ())} for b in blocks]

    live_rows, sim_rows = rows(live_blocks), rows(sim_blocks)
    turns = sorted({k for table in live_rows for k in table})
    by_turn = []
    for k in turns:
        live_k = [t.get(k) for t in live_rows]
        sim_k = [t.get(k) for t in sim_rows]
        entry: dict[str, Any] = {
            "turn": k,
            "live_requests": [row["requests"] if row else 0 for row in live_k],
            "predicted_requests": [row["requests"] if row else 0 for row in sim_k],
        }
        for stat in TURN_STATS:
            entry[f"ttft_{stat}"] = _entry([row["ttft_s"][stat] if row else None for row in live_k],
                                           [row["ttft_s"][stat] if row else None for row in sim_k], used)
        entry["prefix_hit_share"] = _entry([row["prefix_hit_share"] if row else None for row in live_k],
                                           [row["prefix_hit_share"] if row else None for row in sim_k], used)
        by_turn.append(entry)
    return {
        "prefix_hit_rate": _entry([r.live_prefix_hit_rate for r in repeats],
                                  [r.sim_prefix_hit_rate for r in repeats], used),
        "prefix_hit_share": _entry([b.get("prefix_hit_share") for b in live_blocks],
                                   [b.get("prefix_hit_share") for b in sim_blocks], used),
        "by_turn": by_turn,
    }


def _local_port(base_url: str) -> int | None:
    """The port of a server on this machine (None for a remote one, or no port)."""
    url = httpx.URL(base_url)
    if url.host in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return url.port or (443 if url.scheme == "https" else 80)
    return None


def reset_prefix_cache(base_url: str, timeout: float = 30.0, api_key: str | None = None) -> str:
    """POST /reset_prefix_cache (vLLM with VLLM_SERVER_DEV_MODE=1): "ok" or why not."""
    try:
        resp = httpx.post(base_url.rstrip("/") + "/reset_prefix_cache", timeout=timeout,
                          headers=auth_headers(api_key))
    except httpx.HTTPError as exc:
        return f"failed ({type(exc).__name__})"
    if resp.status_code == 200:
        return "ok"
    return f"not allowed (HTTP {resp.status_code})"


def server_cache_update(engine: Any, metrics: ServerMetrics) -> dict[str, Any]:
    """The engine fields whose value the server reports (``vllm:cache_config_info``: block
    size, KV pool, prefix caching) and that differ from ``engine``'s: ``{field: server's}``."""
    update: dict[str, Any] = {}
    if metrics.block_size and metrics.block_size != engine.block_size:
        update["block_size"] = metrics.block_size
    if metrics.num_gpu_blocks and metrics.num_gpu_blocks != engine.num_gpu_blocks:
        update["num_gpu_blocks"] = metrics.num_gpu_blocks
    pc = metrics.cache_config.get("enable_prefix_caching")
    if pc in ("True", "False") and (pc == "True") != engine.enable_prefix_caching:
        update["enable_prefix_caching"] = pc == "True"
    return update


def _adopt_server_config(scenario: Scenario, run: LiveRun, notes: list[str]) -> Scenario:
    """The scenario with the server's KV cache shape (block size, pool) where it reports it."""
    after = run.last_metrics
    if after is None:
        notes.append("server exposes no cache_config_info: simulating the scenario's KV cache as given")
        return scenario
    eng = scenario.engine
    update = server_cache_update(eng, after)
    if update:
        notes.append(
            "simulated with the server's cache config "
            + ", ".join(f"{k}={v} (scenario: {getattr(eng, k)})" for k, v in update.items())
        )
        scenario = scenario.model_copy(update={"engine": eng.model_copy(update=update)})
    return scenario


def adopt_run_acceptance(scenario: Scenario, run: LiveRun, index: int, notes: list[str]) -> Scenario:
    """The scenario with the run's own speculative acceptance (and ngram proposal rate)."""
    spec = scenario.speculative
    delta = run.server_delta()
    drafts = delta.get("spec_decode_num_drafts")
    if spec is None or not delta.get("available") or not drafts:
        return scenario
    k = spec.num_speculative_tokens
    rates = delta.get("spec_decode_acceptance_rates") or []
    update: dict[str, Any] = {}
    if len(rates) == k:
        clean, low = [], 1.0
        for r in rates:  # P(accepted >= i) cannot rise with i; clip counter noise
            low = min(low, max(0.0, float(r)))
            clean.append(round(low, 6))
        update.update(acceptance_rates=tuple(clean), acceptance_length=None)
    else:
        acc = delta.get("spec_decode_mean_acceptance_length")
        if acc is None:
            return scenario
        update.update(acceptance_length=round(min(float(acc), k + 1.0), 6), acceptance_rates=None)
    steps = delta.get("count_inter_token_latency_seconds")
    if spec.method == "ngram" and steps:
        # With an onset the rate counts the request-steps from there on: each request's first
        # onset - 1 decode steps (one token each) are taken off.
        m = spec.proposal_onset_tokens
        if m > 1:
            steps -= sum(min(m - 1, r.num_output_tokens - 1) for r in run.records if r.succeeded)
        if steps > 0:
            update["proposal_rate"] = round(min(max(drafts / steps, 1e-3), 1.0), 6)
    new = type(spec).model_validate({**spec.model_dump(), **update})
    mine = f"acceptance length {1 + sum(new.per_position_rates):.3f}"
    theirs = f"scenario {1 + sum(spec.per_position_rates):.3f}"
    if "proposal_rate" in update:
        mine += f", proposal rate {new.proposal_rate:.3f}"
        theirs += f", {spec.proposal_rate:.3f}"
    notes.append(f"run {index}: simulated with the run's own speculative {mine} ({theirs})")
    return scenario.model_copy(update={"speculative": new})


def _warmup(scenario: Scenario, base_url: str, model: str | None, endpoint: str, **live_kwargs: Any) -> None:
    """A few unmeasured requests: a fresh server compiles/allocates on its first batches."""
    wl = scenario.workload
    n = min(8, wl.num_requests or 8)
    warm = scenario.model_copy(
        update={
            "seed": scenario.seed + 7919,
            "deployment": None,  # each server of a fleet is warmed on its own
            "workload": wl.model_copy(
                update={"arrival": ClosedArrival(process="closed", concurrency=min(4, n)),
                        "num_requests": n, "duration_s": None, "sessions": None}
            ),
        }
    )
    run_live(warm, base_url, model, endpoint=endpoint, progress=False, **live_kwargs)  # type: ignore[arg-type]


def validate(
    scenario: Scenario,
    base_url: str | Sequence[str] | None,
    model: str | None = None,
    repeats: int = 3,
    *,
    endpoint: str = "completions",
    progress: bool = False,
    warmup: bool = True,
    reset_cache: bool = True,
    adopt_server_cache_config: bool = True,
    adopt_spec_acceptance: bool = True,
    server_pids: Iterable[int] = (),
    disturbance_threshold_cores: float = DEFAULT_THRESHOLD_CORES,
    out_prefix: str | None = None,
    api_key: str | None = None,
    replay: str | None = None,
    launch: Callable[[], Any] | None = None,
    restarts: int = 0,
    logs: Sequence[str | Path] = (),
    on_instance: Callable[[int, list[str], list[Path]], None] | None = None,
    on_run: Callable[[RunDone], None] | None = None,
    rate_of_saturation: float | None = None,
    **live_kwargs: Any,
) -> Validation:
    """Run ``scenario`` live ``repeats`` times and compare each run with its simulated twin.

    ``adopt_server_cache_config``: simulate with the server's block size, KV pool size and
    prefix-caching switch (from ``vllm:cache_config_info``) instead of the scenario's, noted in
    the result. ``adopt_spec_acceptance``: simulate each run with its own measured speculative
    acceptance (see the module doc). ``server_pids``: PIDs of the server when known (a local :class:`VllmServer`);
    vLLM-named processes are recognised anyway. ``out_prefix``: write each live run's records
    to ``{out_prefix}{i}.jsonl``. ``api_key``: Bearer token for every request (never stored).
    ``replay``: how each live run is simulated, ``"closed"`` (a closed-loop workload only: its
    clients and their measured gaps, the default for one) or ``"times"`` (its send times, the
    default and the only choice for an open-loop workload or a fleet), or ``"sessions"`` (a
    session workload, the default there). ``base_url``: a list of one URL per ``deployment``
    replica validates a fleet (see the module doc).
    ``launch``: makes a fresh (not yet started) server, e.g. a
    :class:`~simcap.live.server.VllmServer` from :func:`simcap.live.launch.launch_server`;
    then ``base_url`` is ignored (it may be empty; several URLs are refused: a launch starts
    one server) and ``restarts + 1`` servers are started one after another,
    ``repeats`` runs against each, so the band holds the spread between server instances
    (``Validation.spread`` says which spread it holds).
    ``logs``: each server's log file (one per base URL; a launched server's own log is used
    without it): the per-step lines (``--enable-logging-iteration-details``) each run left there
    are read into its :class:`RunDone`. ``on_instance(instance, base_urls, logs)``: called once
    each server instance is up, before its warm-up (a recorder calibrates there).
    ``on_run(RunDone)``: called as each live run ends, before it is simulated (a recorder saves
    it there, see :func:`simcap.live.recording.save_run`).
    ``rate_of_saturation``: an open-loop workload runs at this fraction of the saturation rate
    measured on each server instance after its warm-up (:mod:`simcap.live.saturation`), its
    ``arrival.rate`` replaced; each run's notes and ``Validation.saturation`` say what was measured.
    Other keyword options go to :func:`~simcap.live.client.run_live`.
    """
    if repeats < 1:
        raise LiveError(f"repeats: must be >= 1 (got {repeats})")
    if restarts < 0:
        raise LiveError(f"--restarts: must be >= 0 (got {restarts})")
    if restarts and launch is None:
        raise LiveError("--restarts: restarting the server between repeats needs --launch (a server simcap starts)")
    check_live_sessions(scenario, endpoint)
    urls = [] if base_url is None else [base_url] if isinstance(base_url, str) else list(base_url)
    urls = [u for u in urls if u]
    if launch is not None and len(urls) > 1:
        raise LiveError(
            f"--launch: starts one server; a fleet's {len(urls)} servers are given by --base-url alone"
        )
    if launch is None and not urls:
        raise LiveError("--base-url: give a running server's URL, or --launch SERVER.yaml")
    check_fleet_urls(scenario, 1 if launch is not None else len(urls))
    fleet = launch is None and len(urls) > 1
    check_rate_of_saturation(scenario, rate_of_saturation, fleet)
    closed = isinstance(scenario.workload.arrival, ClosedArrival)
    has_sessions = scenario.workload.sessions is not None
    if replay is None:
        replay = default_replay(scenario, fleet)
    if replay == "closed" and fleet:
        raise LiveError("replay: a fleet is replayed at its send times (replay: times)")
    if replay not in REPLAYS:
        raise LiveError(f"replay: must be one of {', '.join(REPLAYS)} (got {replay!r})")
    if replay == "sessions" and not has_sessions:
        raise LiveError("replay: sessions needs a session workload (workload.sessions)")
    if replay == "closed" and has_sessions:
        raise LiveError("replay: a session workload replays as sessions (or times), not closed")
    if replay == "closed" and not closed:
        raise LiveError("replay: closed needs a closed-loop workload (workload.arrival.process: closed)")
    notes: list[str] = []
    results: list[Repeat] = []
    simulated = scenario
    sent = scenario  # the workload as sent: with --rate-of-saturation, at each instance's own rate
    sent_note: str | None = None  # and why, in each of the instance's runs
    probes: list[dict[str, Any]] = []

    if logs and len(logs) != max(len(urls), 1):
        raise LiveError(f"--log: one server log per server ({max(len(urls), 1)}), got {len(logs)}")

    def one_instance(base_urls: list[str], server_pids: Iterable[int], instance: int,
                     server_logs: list[Path]) -> None:
        nonlocal simulated, sent, sent_note
        if on_instance is not None:
            on_instance(instance, base_urls, server_logs)
        if warmup:
            for url in base_urls:
                _warmup(scenario, url, model, endpoint, api_key=api_key, **live_kwargs)
        if rate_of_saturation is not None:
            probe = measure_saturation(scenario, base_urls[0], model, endpoint, api_key=api_key, **live_kwargs)
            sent = at_fraction(scenario, rate_of_saturation, probe)
            probes.append({"instance": instance, "fraction": rate_of_saturation,
                           "rate_sent": sent.workload.arrival.rate, **probe.to_dict()})  # type: ignore[union-attr]
            sent_note = probe.line(rate_of_saturation)
            notes.append(f"server instance {instance}: {sent_note}")
        for _ in range(repeats):
            simulated = _one_repeat(len(results), instance, base_urls, server_pids, simulated, server_logs)

    def _one_repeat(i: int, instance: int, base_urls: list[str], server_pids: Iterable[int],
                    simulated: Scenario, server_logs: list[Path]) -> Scenario:
        resets = [reset_prefix_cache(u, api_key=api_key) if reset_cache else "skipped" for u in base_urls]
        reset = next((r for r in resets if r != "ok"), resets[0])
        if reset != "ok" and reset_cache and i == 0:
            notes.append(f"prefix cache not reset between runs: {reset}; reruns may hit the cache")
        watch = CpuWatch(server_pids, disturbance_threshold_cores, _local_port(base_urls[0])).start()
        out = f"{out_prefix}{i}.jsonl" if out_prefix else None
        offsets = [log_size(p) for p in server_logs]
        run = run_live(sent, base_urls, model, endpoint=endpoint, out_path=out, progress=progress,
                       api_key=api_key, **live_kwargs)  # type: ignore[arg-type]
        cpu = watch.stop()
        if sent_note is not None:
            run.notes.append(sent_note)
        lines = [iteration_lines(read_log_window(p, o)) for p, o in zip(server_logs, offsets)]
        if on_run is not None:
            on_run(RunDone(i, instance, run, cpu, lines))
        if i == 0 and adopt_server_cache_config:
            simulated = _adopt_server_config(scenario, run, notes)
        if not any(r.succeeded for r in run.records):
            raise LiveError(f"live run {i}: no request completed ({sorted({r.error for r in run.records if r.error})[:3]})")
        this = adopt_run_acceptance(simulated, run, i, notes) if adopt_spec_acceptance else simulated
        sim = replay_run(this, run, replay, steps=len(lines) == 1)
        speed, at_speed = speed_of(this, run, replay, lines[0], sim) if len(lines) == 1 else (None, None)
        if run.num_failed:
            notes.append(f"run {i}: {run.num_failed} failed request(s) left out of the simulated trace")
        if cpu.get("disturbed"):
            notes.append(
                f"run {i}: disturbed (foreign CPU {cpu['foreign_cores']:.2f} cores, steal "
                f"{cpu['steal_cores']:.2f} cores; top: {', '.join(cpu['top_foreign'][:3]) or '-'})"
            )
        elif not cpu.get("available", True):
            notes.append(f"run {i}: {cpu.get('note')}")
        if run.paused:
            notes.append(f"run {i}: {run.pause_line}" + (
                             "; the server runs in another session's scheduling group, where its engine "
                             "core's spin can hold this client: start it from this session "
                             "(simcap/live/README.md)" if cpu.get("server_own_group") else ""))
        if run.sessions and run.sessions["ended_by_error"]:
            notes.append(f"run {i}: {run.sessions['ended_by_error']} session(s) ended at an errored turn; "
                         "their later turns are in neither run")
        results.append(Repeat(i, run, run.summary(), sim.summary, sim.records, cpu, reset,
                              sim_prefix_cache=sim.prefix_cache, instance=instance,
                              fleet=fleet_pair(run, sim.records) if fleet else None,
                              engine_speed=speed, speed_summary=at_speed and at_speed.summary))
        return simulated

    if launch is None:
        one_instance(urls, server_pids, 0, [Path(p) for p in logs])
    else:
        for instance in range(restarts + 1):
            server = launch()
            with server:
                own = [Path(server.log_path)] if getattr(server, "log_path", None) else []
                one_instance([server.base_url], sorted(server.pids()), instance, own or [Path(p) for p in logs])
            if getattr(server, "failed", False):
                notes.append(f"server instance {instance} did not stop cleanly (log {server.log_path})")
    instances = restarts + 1 if launch is not None else 1
    spread = {
        "kind": "restarts" if instances > 1 else "repeats",
        "instances": instances,
        "repeats_per_instance": repeats,
        "text": (f"{instances} server instances (restarted between them), {repeats} run(s) each: the "
                 "band holds instance-to-instance variance" if instances > 1 else
                 f"{repeats} run(s) against one server instance: the band holds run-to-run variance only"),
        "metrics": spread_figures(results),
    }
    if all(r.disturbed for r in results):
        notes.append("every run was disturbed: the comparison uses them all; rerun on a quiet machine")
    if scenario.engine.async_scheduling is None:
        notes.append(
            "engine.async_scheduling unset: the modelled version's default is used; vLLM's CPU "
            "build always runs without async scheduling (against one, set engine.async_scheduling=false)"
        )
    metrics, ks = compare(results)
    sessions = compare_sessions(results) if has_sessions else None
    if replay == "sessions":
        arrival = scenario.workload.arrival
        who = (f"closed loop, {arrival.concurrency} clients each running its sessions in order"
               if isinstance(arrival, ClosedArrival) else "one client per session, from its send time")
        described = {"mode": "sessions", "clients": getattr(arrival, "concurrency", None),
                     "text": f"sessions ({who}; each turn the measured gap after the previous "
                             "answer's last token, its prompt and answer lengths as measured)"}
    elif replay == "closed":
        assert isinstance(scenario.workload.arrival, ClosedArrival)
        described = {"mode": "closed", "clients": scenario.workload.arrival.concurrency,
                     "text": f"closed loop, {scenario.workload.arrival.concurrency} clients (each client's "
                             "requests in its order, sent the measured gap after its previous response)"}
    else:
        described = {"mode": "times", "clients": None, "text": "send times (each request at its live send time)"}
    if fleet:
        assert scenario.deployment is not None
        described["text"] += (f"; through a simulated fleet of {len(urls)} replicas, router "
                              f"{scenario.deployment.router} (it routes the replay itself)")
    return Validation(scenario, simulated, results, metrics, ks, notes, described, spread=spread,
                      sessions=sessions, fleet=compare_fleet(results) if fleet else None,
                      saturation=probes if rate_of_saturation is not None else None)


SPREAD_METRICS = ("ttft_p50", "tpot_p50", "e2e_p50", "output_throughput")


def spread_figures(repeats: Sequence[Repeat]) -> dict[str, dict[str, float | None]]:
    """Per metric, relative to the median of all runs: the range of the server instances'
    medians (``between_instances``; None with one instance) and the median over instances of
    their runs' range (``within_instance``; None with one run per instance)."""
    by: dict[int, list[Repeat]] = {}
    for r in repeats:
        by.setdefault(r.instance, []).append(r)
    return {key: instance_spread({i: [v for r in rs if (v := metric_value(r.live_summary, key)) is not None]
                                  for i, rs in by.items()})
            for key in SPREAD_METRICS}


def instance_spread(values: dict[int, list[float]]) -> dict[str, float | None]:
    """One metric's runs by server instance, relative to the median of all runs: the range of
    the instances' medians (``between_instances``; None with one instance) and the median over
    instances of their runs' range (``within_instance``; None with one run per instance)."""
    every = [v for vs in values.values() for v in vs]
    mid = float(np.median(every)) if every else None
    if not mid:
        return {"between_instances": None, "within_instance": None}
    medians = [float(np.median(vs)) for vs in values.values() if vs]
    within = [(max(vs) - min(vs)) / mid for vs in values.values() if len(vs) > 1]
    return {"between_instances": (max(medians) - min(medians)) / mid if len(medians) > 1 else None,
            "within_instance": float(np.median(within)) if within else None}


def spread_line(data: dict[str, Any]) -> str:
    """Which spread the measured band shows, from ``to_dict()``."""
    spread = data["spread"]
    parts = []
    for key, fig in spread.get("metrics", {}).items():
        b, w = fig["between_instances"], fig["within_instance"]
        if b is None and w is None:
            continue
        shown = [f"between instances {b * 100:.1f}%" if b is not None else None,
                 f"within an instance {w * 100:.1f}%" if w is not None else None]
        parts.append(f"{key} " + ", ".join(x for x in shown if x))
    return f"spread: {spread['text']}" + (f" ({'; '.join(parts)} of the median)" if parts else "")


# --------------------------------------------------------------------------- rendering


def _fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key == "output_throughput":
        return f"{value:,.1f}"
    return f"{value * 1e3:,.1f}"


def validation_table(data: dict[str, Any]) -> Table:
    """Predicted vs live per metric (ms; throughput in output tok/s), from ``to_dict()``."""
    used = set(data.get("used_repeats", []))
    table = Table(title="simulated vs live (latencies in ms, throughput in output tok/s)", title_justify="left")
    table.add_column("metric", no_wrap=True)
    for r in data["repeats"]:
        mark = "" if not r["disturbed"] else " disturbed" if r["index"] in used else " disturbed, left out"
        table.add_column(f"live {r['index']}{mark}", justify="right")
    at_speed = any("rel_error_at_measured_speed" in m for m in data["metrics"].values())
    for col in ("live range", "predicted", "error vs median", "in range", *(["at measured speed"] if at_speed else [])):
        table.add_column(col, justify="right", no_wrap=True)
    for key, m in data["metrics"].items():
        err = m["rel_error"]
        at = m.get("rel_error_at_measured_speed")
        table.add_row(
            key,
            *(_fmt(key, v) for v in m["live"]),
            f"{_fmt(key, m['live_min'])} - {_fmt(key, m['live_max'])}",
            _fmt(key, m["predicted"]),
            "-" if err is None else f"{err * 100:+.1f}%",
            {True: "yes", False: "NO", None: "-"}[m["in_range"]],
            *([("-" if at is None else f"{at * 100:+.1f}%")] if at_speed else []),
        )
    return table


def speed_line(data: dict[str, Any]) -> str | None:
    """The runs' engine speed against the prediction's (:mod:`simcap.live.engine_speed`), one
    line from ``to_dict()``; None when no run left a step log to measure it."""
    speeds = [(r["index"], r["engine_speed"]) for r in data["repeats"] if r.get("engine_speed")]
    if not speeds:
        return None
    runs = ", ".join(
        f"run {i} {s['ratio']:.2f}x" + (f" (per second {s['per_second']['p10']:.2f}-{s['per_second']['p90']:.2f})"
                                       if s["per_second"] else "") for i, s in speeds)
    return (f"engine speed: the server's decode steps took {runs} the replay's at the same batch sizes "
            "(above 1: slower than the profile priced them); 'at measured speed' is the replay with "
            "each run's factor, a diagnosis from the run's own log, not a prediction")


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def sessions_table(data: dict[str, Any]) -> Table | None:
    """A session workload's comparison from ``to_dict()``: prefix hits, and TTFT by turn (ms)."""
    sessions = data.get("sessions")
    if sessions is None:
        return None
    table = Table(title="sessions: simulated vs live (TTFT in ms; live median over repeats)", title_justify="left")
    for col in ("metric", "turns live/sim", "live median", "live range", "predicted", "error vs median", "in range"):
        table.add_column(col, justify="right" if col != "metric" else "left", no_wrap=True)

    def add(name: str, m: dict[str, Any], fmt, count: str = "") -> None:
        err = m["rel_error"]
        table.add_row(
            name, count, fmt(m["live_median"]),
            "-" if m["live_min"] is None else f"{fmt(m['live_min'])} - {fmt(m['live_max'])}",
            fmt(m["predicted"]), "-" if err is None else f"{err * 100:+.1f}%",
            {True: "yes", False: "NO", None: "-"}[m["in_range"]],
        )

    add("prefix hit rate (server counters)", sessions["prefix_hit_rate"], _share)
    add("prefix hit share (cached / prompt)", sessions["prefix_hit_share"], _share)
    for row in sessions["by_turn"]:
        count = f"{sum(row['live_requests'])}/{sum(row['predicted_requests'])}"
        for stat in TURN_STATS:
            add(f"turn {row['turn']} TTFT {stat}", row[f"ttft_{stat}"], lambda v: _fmt("ttft", v), count)
        add(f"turn {row['turn']} prefix hits", row["prefix_hit_share"], _share, count)
    return table


def replay_line(data: dict[str, Any]) -> str:
    """How the live runs were simulated, and with which front end, from ``to_dict()``."""
    return f"replay: {data['replay']['text']}\n{describe_line(data.get('frontend'))}"


def fleet_table(data: dict[str, Any]) -> Table | None:
    """Fleet validation: per replica and for the imbalance, live range vs predicted, from
    ``to_dict()``; None without a fleet."""
    fleet = data.get("fleet")
    if not fleet:
        return None
    table = Table(title="fleet: simulated vs live (TTFT/E2E in ms)", title_justify="left")
    for col in ("replica", "metric", "live", "live range", "predicted", "error vs median", "in range"):
        table.add_column(col, justify="left" if col in ("replica", "metric") else "right", no_wrap=True)

    def fmt(key: str, v: float | None) -> str:
        if v is None:
            return "-"
        if key.endswith("_s"):
            return f"{v * 1e3:,.1f}"
        return f"{v:,.3f}" if key.startswith("imbalance") else f"{v:,.0f}"

    def add(who: str, key: str, m: dict[str, Any]) -> None:
        err = m["rel_error"]
        table.add_row(
            who, key, " ".join(fmt(key, v) for v in m["live"]),
            f"{fmt(key, m['live_min'])} - {fmt(key, m['live_max'])}", fmt(key, m["predicted"]),
            "-" if err is None else f"{err * 100:+.1f}%",
            {True: "yes", False: "NO", None: "-"}[m["in_range"]],
        )

    for key, m in fleet["load_imbalance"].items():
        add("fleet", f"imbalance {key}", m)
    for row in fleet["per_replica"]:
        for key in FLEET_KEYS:
            add(str(row["replica"]), key, row[key])
    return table


def ks_line(data: dict[str, Any]) -> str:
    parts = []
    for name, k in data["ks"].items():
        if k["statistic"] is None:
            parts.append(f"{name}: no samples")
        else:
            parts.append(f"{name} D={k['statistic']:.3f} (n sim {k['sim_n']}, live {k['live_n']})")
    return "KS simulated vs live: " + "; ".join(parts)
