"""A live run kept for replay: everything a prediction of it needs, in one compressed file.

:func:`save_run` writes a :class:`~simcap.live.client.LiveRun` to ``NAME.run.json.gz``: the
run's facts (loop, rates, sessions, servers), what each request asked for (its
:class:`~simcap.workloads.requests.RequestSpec`), every request's record (times rounded to
the microsecond), each server's ``/metrics`` text before and after the run (histogram buckets
included; a calibration phase's first-wave scrape too, with the ids it counted), the lines the
server's per-step log (``--enable-logging-iteration-details``) wrote while the run ran, one
list per server, and the host-load watch. :func:`load_run` gives the
same :class:`LiveRun` back (its ``/metrics`` snapshots parsed again from the text), so a
recorded run is simulated, summarised and fitted by exactly the code a live one goes through.
Same file, same run: replays are deterministic.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simcap._version import __version__
from simcap.live.client import LiveError, LiveRun
from simcap.live.prom import ServerMetrics, parse_metrics
from simcap.metrics.records import RequestRecord
from simcap.workloads.requests import RequestSpec

FORMAT = "simcap recorded live run 1"
SUFFIX = ".run.json.gz"
_RUN_FACTS = ("base_url", "model", "endpoint", "closed_loop", "requested_rate", "scheduled_rate",
              "achieved_rate", "wall_duration_s", "max_send_lag_s", "token_fixups", "notes",
              "interrupted", "sessions", "cached_tokens_reported", "base_urls", "router", "client_pauses",
              "first_wave")


@dataclass
class RecordedRun:
    """A recorded live run: the run, the per-step log lines of each of its servers, the host load."""

    run: LiveRun
    iterations: list[list[str]] = field(default_factory=list)
    cpu: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    simcap_version: str | None = None

    @property
    def iteration_lines(self) -> list[str]:
        """Every server's per-step log lines, servers in order."""
        return [line for lines in self.iterations for line in lines]


def log_size(path: Path) -> int:
    """The size of a server's log file now: where the next run's lines will start."""
    try:
        return path.stat().st_size
    except OSError as exc:
        raise LiveError(f"--log {path}: cannot read: {exc.strerror or exc}") from None


def read_log_window(path: Path, offset: int, settle_s: float = 0.4, max_wait_s: float = 5.0) -> str:
    """The text the server appended to its log since ``offset``, once the log stops growing."""
    deadline = time.monotonic() + max_wait_s
    size = log_size(path)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = log_size(path)
        if now == size:
            break
        size = now
    if size < offset:
        raise LiveError(f"--log {path}: the file shrank during the run (rotated?); rerun")
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read(size - offset)
    return data.decode(errors="replace")


def iteration_lines(text: str) -> list[str]:
    """The per-step lines (``Iteration(i): ...``) of a log text."""
    return [line for line in text.splitlines() if "Iteration(" in line]


def _snapshot(m: ServerMetrics | None) -> dict[str, Any] | None:
    if m is None or m.text is None:
        return None
    return {"time": round(m.time, 6), "text": m.text}


def _parse_snapshot(d: dict[str, Any] | None) -> ServerMetrics | None:
    return None if d is None else parse_metrics(d["text"], when=d["time"])


def _record(r: RequestRecord) -> dict[str, Any]:
    d = r.to_dict()
    for key in ("arrival_time", "scheduled_time", "finish_time"):
        if d[key] is not None:
            d[key] = round(d[key], 6)
    d["chunk_times"] = [round(t, 6) for t in d["chunk_times"]]
    return d


def save_run(path: str | Path, run: LiveRun, *, iterations: list[list[str]] | None = None,
             cpu: dict[str, Any] | None = None) -> Path:
    """Write ``run`` (and its servers' step-log lines, ``iterations``: one list per server) to
    ``path`` (``.run.json.gz`` appended when missing); returns the path written."""
    path = Path(path)
    if not path.name.endswith(SUFFIX):
        path = path.with_name(path.name + SUFFIX)
    if run.is_fleet:
        metrics = [{"before": _snapshot(b), "after": _snapshot(a)} for b, a in run.server_metrics]
    else:
        metrics = [{"before": _snapshot(run.metrics_before), "after": _snapshot(run.metrics_after)}]
        if run.metrics_first_wave is not None:
            metrics[0]["first_wave"] = _snapshot(run.metrics_first_wave)
    data = {
        "format": FORMAT,
        "simcap_version": __version__,
        "run": {key: getattr(run, key) for key in _RUN_FACTS},
        "specs": [list(s) for _, s in sorted(run.specs.items())],
        "records": [_record(r) for r in run.records],
        "metrics": metrics,
        "iterations": [list(lines) for lines in (iterations or [])],
        "cpu": dict(cpu or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":"), sort_keys=True)
    # mtime 0: the same run gives the same bytes.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(text.encode())
    return path


def _spec(row: list[Any]) -> RequestSpec:
    rid, n_prompt, max_tokens, segments, output_key, session_id, turn = row
    return RequestSpec(rid, n_prompt, max_tokens, tuple((int(k), int(n)) for k, n in segments),
                       output_key=output_key, session_id=session_id, turn=turn)


def load_run(path: str | Path) -> RecordedRun:
    """Read a file :func:`save_run` wrote; a missing or foreign file is a one-line :class:`LiveError`."""
    path = Path(path)
    try:
        with gzip.open(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, ValueError) as exc:
        raise LiveError(f"{path}: not a recorded live run ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LiveError(f"{path}: not a recorded live run (format {data.get('format')!r}, "
                        f"expected {FORMAT!r})" if isinstance(data, dict) else f"{path}: not a recorded live run")
    facts = data["run"]
    snaps = [(_parse_snapshot(m["before"]), _parse_snapshot(m["after"])) for m in data["metrics"]]
    fleet = len(facts.get("base_urls") or []) > 1
    run = LiveRun(
        records=[RequestRecord.from_dict(r) for r in data["records"]],
        specs={s.request_id: s for s in map(_spec, data["specs"])},
        metrics_before=None if fleet or not snaps else snaps[0][0],
        metrics_after=None if fleet or not snaps else snaps[0][1],
        server_metrics=snaps if fleet else [],
        metrics_first_wave=None if fleet or not snaps else _parse_snapshot(data["metrics"][0].get("first_wave")),
        **facts,
    )
    return RecordedRun(run, [list(x) for x in data.get("iterations", [])], dict(data.get("cpu") or {}),
                       path, data.get("simcap_version"))
