"""Fit the front end (:class:`simcap.config.scenario.FrontendConfig`) from live runs.

What each run gives, all of it things the server and the client already record:

- the server's request histograms (``/metrics`` before and after the run): mean TTFT, as the
  API server measures it (from the request's arrival there to the processing of its first
  output), and the mean queue and prefill times, as the engine core measures them (from the
  request's entry into the scheduler to its first scheduling, and from there to the step that
  made its first token);
- the client's records: its own TTFT of the same requests;
- the server's per-step log (``--enable-logging-iteration-details``): how many requests each
  step served, so how many chunks the step that made a request's first token emitted.

Per run, ``client - server`` (the client's mean TTFT minus the server's) is time after the
API server took the first output up: processing the step's outputs, streaming, the client's
loop. ``server - queue - prefill`` is time before the scheduler took the request and while
its first output crossed back to the API server, plus, when the engine was busy, the rest of
the step in flight at its arrival (which the simulated engine has of its own). So:

- ``arrival_s``: ``server - queue - prefill`` in the runs with one request in flight at a
  time (the engine idle at every arrival, so no step in flight): the median over them;
- ``output_s`` and ``per_chunk_s``: ``client - server`` against the mean number of chunks the
  first-token steps emitted (from the log: a step with ``a`` prefilling and ``c`` decoding
  requests emits about ``a + c``), by non-negative least squares over the runs, each weighted
  by its requests. The slope stands only when every run lies within 2 ms (or 30 % of its own
  figure) of the line: a run whose client stalled (a mean over a dozen requests moves by tens
  of milliseconds with one stall) would set it alone. Otherwise, and with runs at a single batch
  size (no slope to see), ``per_chunk_s`` is 0, ``output_s`` the median over the runs, and a
  note says why.

A closed loop's first wave (one request per client, sent together) reaches the API server as
a burst: its arrival stamps come late, so its server TTFT is short against the client's, and
``client - server`` is larger for it than for any later request (on the CPU server about 26
ms against 5 ms, in a calibration phase of 8 clients). Where the run has the client's
first-wave scrape (:mod:`simcap.live.client`), ``client - server`` and the chunks per
first-token step are read over the requests after the first wave alone: the server's TTFT
histogram from that scrape to the end, the client's records of the same requests, the steps
after the first wave's prefills (from the first step that prefilled nothing).

Whether the front end is a queue (work carried from step to step, which saturates) is decided
by the rate at which it is driven. A queue whose service time per chunk is ``per_chunk_s``
would have been busy ``per_chunk_s x chunks per second`` of each run (``queue_utilisation``):
a run above 1 that kept up rejects the queue, a run that fell behind while its engine did not
confirms it. Below 1 the runs cannot tell the two apart. On the CPU server, 64 streams at
1,650 chunks/s (a queue at the measured 0.9 ms per chunk would have been busy 1.5) kept the
engine's own step period: a delay, as modelled. The fit also reports how far apart one step's
chunks reached their clients (``stream_gap_s``, from the client's chunk times): the serial
streaming per chunk, 0.06-0.15 ms there, a small part of ``per_chunk_s``, which is the
processing of the step's outputs before any is streamed and the wait for the CPU the engine's
next step holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.optimize import nnls

from simcap.calibrate import parse_iteration_log
from simcap.live.client import LiveRun
from simcap.live.prom import metrics_delta

METHOD = (
    "arrival_s: server TTFT - queue - prefill (request histograms) in runs with one request in "
    "flight; output_s + per_chunk_s x chunks per first-token step: client TTFT - server TTFT, "
    "by non-negative least squares over the runs (chunks per step from the step log; a closed "
    "loop's first wave left out where the run scraped /metrics after it)"
)
MIN_SPAN_CHUNKS = 1.0  # the runs' chunks per first-token step must span this much for a slope
# A slope stands only if every run lies this close to its line (seconds, or this share of the
# run's own figure if more): one run a client stall lifted would otherwise set it.
LINE_TOLERANCE_S = 0.002
LINE_TOLERANCE_SHARE = 0.3


@dataclass
class RunFigures:
    """One run's figures for the fit (seconds)."""

    requests: int
    max_in_flight: int
    client_minus_server_s: float
    server_minus_engine_s: float
    chunks_per_first_token_step: float
    chunks_per_s: float
    # The median gap between consecutive chunks of one step at the clients (None: no step
    # with two or more): the front end's serial work per chunk, streaming included.
    stream_gap_s: float | None = None
    # The first-wave requests left out of client_minus_server_s and the chunks per step (0:
    # the run had no first-wave scrape, or it could not be used).
    first_wave_left_out: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def stream_gap(records: Sequence[Any], step_s: float) -> float | None:
    """The median gap between consecutive chunks of one step as the clients got them.

    Every chunk of the run in time order; a gap longer than a third of the median logged step
    (``step_s``) starts another step. Within a step each gap is one more chunk streamed, so
    their median over steps that served two or more requests (one chunk each) is the serial
    cost per chunk."""
    events = sorted((t, r.request_id) for r in records for t in r.chunk_times)
    gaps: list[float] = []
    group: list[tuple[float, int]] = []
    for event in events + [(float("inf"), -1)]:
        if group and event[0] - group[-1][0] > step_s / 3:
            if len(group) > 1 and len({rid for _, rid in group}) == len(group):
                gaps += [b[0] - a[0] for a, b in zip(group, group[1:])]
            group = []
        group.append(event)
    return float(np.median(gaps)) if gaps else None


@dataclass
class FrontendFit:
    """The fitted terms (``config``: the profile's ``frontend`` section, None when nothing
    could be fitted), the runs behind them and what the fit says about them."""

    config: dict[str, float] | None
    runs: list[RunFigures]
    notes: list[str] = field(default_factory=list)

    def queue_utilisation(self) -> list[float | None]:
        """Per run: how busy a queue serving ``per_chunk_s`` per chunk would have been."""
        return [None if self.config is None else round(self.config["per_chunk_s"] * r.chunks_per_s, 3)
                for r in self.runs]

    def to_dict(self) -> dict[str, Any]:
        return {"method": METHOD, "fitted": self.config, "runs": [r.to_dict() for r in self.runs],
                "queue_utilisation": self.queue_utilisation(), "notes": list(self.notes)}


def max_in_flight(run: LiveRun) -> int:
    """The most requests the client had in flight at once."""
    events = sorted([(r.arrival_time, 1) for r in run.records if r.finish_time is not None]
                    + [(r.finish_time, -1) for r in run.records if r.finish_time is not None])
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def run_figures(run: LiveRun, lines: Sequence[str]) -> RunFigures | None:
    """The fit's figures of one run; None when its server histograms or its step log do not
    cover it (no ``/metrics`` on both sides, other requests counted, no first-token step)."""
    ok = [r for r in run.records if r.succeeded]
    delta = run.server_delta()
    if not ok or not delta.get("available"):
        return None
    ttft, queue, prefill = (delta.get(f"mean_{k}") for k in
                            ("time_to_first_token_seconds", "request_queue_time_seconds",
                             "request_prefill_time_seconds"))
    if ttft is None or queue is None or prefill is None:
        return None
    if delta.get("count_time_to_first_token_seconds") != len(ok):
        return None  # the server counted requests the client did not send (or lost some)
    rows = parse_iteration_log(lines)
    span = max(r.finish_time for r in ok) - min(r.arrival_time for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    elapsed = float(np.median([r["step_time_s"] for r in rows])) if rows else 0.0
    used, used_ttft, used_rows, left_out = ok, ttft, rows, 0
    later = _after_first_wave(run, ok, rows)
    if later is not None:
        used, used_ttft, used_rows = later
        left_out = len(ok) - len(used)
    a = np.array([r["num_prefill_reqs"] for r in used_rows], dtype=float)
    c = np.array([r["num_decode_reqs"] for r in used_rows], dtype=float)
    if not a.sum():
        return None
    client = float(np.mean([r.chunk_times[0] - r.arrival_time for r in used]))
    return RunFigures(
        requests=len(used), max_in_flight=max_in_flight(run),
        client_minus_server_s=client - used_ttft, server_minus_engine_s=ttft - queue - prefill,
        chunks_per_first_token_step=float((a * (a + c)).sum() / a.sum()),
        chunks_per_s=chunks / span if span > 0 else 0.0,
        stream_gap_s=stream_gap(ok, elapsed),
        first_wave_left_out=left_out,
    )


def _after_first_wave(run: LiveRun, ok: list[Any], rows: list[dict[str, Any]]
                      ) -> tuple[list[Any], float, list[dict[str, Any]]] | None:
    """The requests after a closed loop's first wave (module doc), the server's mean TTFT of
    them and the steps after the first wave's prefills; None without a usable first-wave scrape."""
    if run.first_wave is None or run.metrics_first_wave is None:
        return None
    wave = set(run.first_wave)
    later = [r for r in ok if r.request_id not in wave]
    delta = metrics_delta(run.metrics_first_wave, run.metrics_after)
    ttft = delta.get("mean_time_to_first_token_seconds")
    if not later or ttft is None or delta.get("count_time_to_first_token_seconds") != len(later):
        return None
    first_decode = next((i for i, r in enumerate(rows) if r["num_prefill_reqs"] == 0), None)
    if first_decode is None:
        return None
    return later, ttft, rows[first_decode:]


def fit_frontend(runs: Sequence[tuple[LiveRun, Sequence[str]]]) -> FrontendFit:
    """The front end of the server that ran ``runs`` (each with its step-log lines)."""
    figures = [f for f in (run_figures(run, lines) for run, lines in runs) if f is not None]
    notes: list[str] = []
    idle = [f for f in figures if f.max_in_flight == 1]
    if not idle:
        notes.append("no front end fitted: no run had one request in flight at a time with the "
                     "server's request histograms and step log")
        return FrontendFit(None, figures, notes)
    arrival = max(float(np.median([f.server_minus_engine_s for f in idle])), 0.0)
    x = np.array([f.chunks_per_first_token_step for f in figures])
    y = np.array([f.client_minus_server_s for f in figures])
    w = np.sqrt([f.requests for f in figures])
    output = per_chunk = None
    if x.max() - x.min() >= MIN_SPAN_CHUNKS:
        (o, k), _ = nnls(np.column_stack([np.ones_like(x), x]) * w[:, None], y * w)
        off = np.abs(y - (o + k * x))
        bad = off > np.maximum(LINE_TOLERANCE_S, LINE_TOLERANCE_SHARE * np.abs(y))
        if bad.any():
            worst = int(np.argmax(off))
            notes.append(
                f"per_chunk_s 0: the runs do not line up on chunks per step (the farthest from "
                f"the best line, {o * 1e3:.2f} + {k * 1e3:.3f} ms per chunk: run {worst + 1}, client - "
                f"server {y[worst] * 1e3:.1f} ms at {x[worst]:.1f} chunks, {off[worst] * 1e3:.1f} ms off); "
                "output_s is the runs' median"
            )
        else:
            output, per_chunk = float(o), float(k)
    else:
        notes.append(f"per_chunk_s 0: the runs' first-token steps all emitted about {x.mean():.1f} "
                     "chunks, so the delay per chunk is not identified; output_s is the runs' median")
    if output is None:
        output, per_chunk = max(float(np.median(y)), 0.0), 0.0
    config = {"arrival_s": round(arrival, 6), "output_s": round(float(output), 6),
              "per_chunk_s": round(float(per_chunk), 7)}
    fit = FrontendFit(config, figures, notes)
    busiest = max(fit.queue_utilisation())
    streamed = [f.stream_gap_s for f in figures if f.stream_gap_s is not None]
    if per_chunk and busiest is not None:
        fit.notes.append(
            f"a delay, not a queue: a queue serving {per_chunk * 1e3:.3f} ms per chunk would have been "
            f"busy {busiest:.2f} of the busiest run" + (
                ", more than it can be, yet the run kept up" if busiest > 1 else
                " (below 1: the runs' rates alone cannot tell a queue from a delay)")
            + ("" if not streamed else
               f"; one step's chunks reached their clients {np.median(streamed) * 1e3:.3f} ms apart "
               "(median): the serial streaming per chunk, a small part of the delay per chunk")
        )
    return fit
