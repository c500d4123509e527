"""Public traces as workload sources, read as they are published.

``workload.trace: {format, path, ...}`` replaces the synthetic lengths (and, for a trace with
timestamps, the arrival process) by the requests of a published trace file:

- ``azure``: the Azure LLM inference traces (``AzureLLMInferenceTrace_conv.csv``,
  ``..._code.csv``), CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens``; a timestamp is a
  date and time such as ``2023-11-16 18:15:46.6805900``.
- ``mooncake``: Mooncake-style JSON lines (``conversation_trace.jsonl``), one object a line
  with ``timestamp`` (milliseconds), ``input_length``, ``output_length`` and ``hash_ids``. Each
  hash id names one block of ``block_size`` prompt tokens (512 in the Mooncake release) and,
  as a hash chain, the whole prefix up to that block: two requests whose lists agree up to a
  position share that many tokens. Each id becomes a shared content segment of
  ``block_size`` tokens (the last one as long as the prompt still runs; tokens past the last
  id are the request's own). The engine caches at its own ``engine.block_size``: a shared run
  of k trace blocks is ``k x block_size`` shared tokens, of which it hits every whole engine
  block (all of them when the engine's block size divides 512, as 16, 32, 64 and 128 do;
  ``floor(k x 512 / engine block)`` blocks otherwise; never the prompt's last token, as vLLM).
- ``burstgpt``: BurstGPT CSV with ``Timestamp,Model,Request tokens,Response tokens,Total
  tokens,Log Type`` (timestamps in seconds). A failed request has 0 response tokens: a bad
  row (below). ``models: [GPT-4]`` keeps the rows of those ``Model`` values only, as
  ``vllm bench --dataset-name burstgpt`` keeps GPT-4's (the others are counted, not bad).
- ``sharegpt``: the ShareGPT JSON ``vllm bench serve --dataset-name sharegpt`` takes: a list
  of ``{"conversations": [{"from", "value"}, ...]}``. As vLLM's loader does, entries with
  fewer than two messages are left out, the first message is the prompt and the second the
  completion (vLLM's tokenizer-based filter of short and long pairs is not applied); with ``shuffle_seed`` the entries are shuffled as ``vllm bench --seed`` does
  (Python's ``random``), else kept in file order. Lengths are whitespace word counts of the
  two texts (no tokenizer), or a message's ``num_tokens`` where it has one. No timestamps:
  the scenario's ``workload.arrival`` sends them.

Rows are sorted by time (stably). Slicing as ``vllm bench`` and trace replayers offer:
``start_s`` / ``duration_s`` keep the rows in that window of the trace's own clock (0 = its
first row), then ``num_requests`` the first N of them; ``speedup`` divides the gaps. The first
kept request is sent at 0, as a benchmark client starts. A row with a missing, non-numeric,
negative or zero length (or time) is a bad row; a request whose prompt plus output exceed
``engine.max_model_len`` is too long (vLLM rejects it). ``on_bad_row`` / ``on_too_long``:
``stop`` (default) ends with one line naming the row, ``skip`` counts and leaves them out.
"""

from __future__ import annotations

import calendar
import csv
import datetime
import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from simcap.errors import ScenarioError

if TYPE_CHECKING:  # numpy is imported where a trace is read: a scenario without one needs none
    import numpy as np

TraceFormat = Literal["azure", "mooncake", "burstgpt", "sharegpt"]

# The columns (keys) each format is read by, as published.
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_SIZE = 512
_TIMED = {"azure", "mooncake", "burstgpt"}
# Seconds per unit of each format's timestamps (Azure: 100 ns ticks of its date and time).
_TIME_UNIT_S = {"azure": 1e-7, "mooncake": 1e-3, "burstgpt": 1.0, "sharegpt": 1.0}


class TraceConfig(BaseModel):
    """``workload.trace``: which file, in which format, and which part of it to send."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, defer_build=True)

    format: TraceFormat
    path: str = Field(min_length=1, description="the trace file, relative to the scenario")
    speedup: float = Field(1.0, gt=0.0, description="time scaling: gaps divided by this")
    start_s: float = Field(0.0, ge=0.0, description="window start, s after the first row")
    duration_s: float | None = Field(None, gt=0.0, description="window length, s of trace time")
    num_requests: int | None = Field(None, gt=0, description="the first N")
    block_size: int = Field(MOONCAKE_BLOCK_SIZE, gt=0, description="mooncake: tokens per hash id")
    shuffle_seed: int | None = Field(None, ge=0, description="sharegpt: shuffle as vllm bench --seed")
    models: tuple[str, ...] | None = Field(
        None, min_length=1, description="burstgpt: keep rows of these Model values (vllm bench: GPT-4)"
    )
    on_bad_row: Literal["stop", "skip"] = "stop"
    on_too_long: Literal["stop", "skip"] = "stop"

    _requests: "TraceRequests | None" = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: Any) -> Any:
        # (Validation sees Python objects here: a strict tuple field takes a tuple, not a list.)
        if isinstance(data, dict) and isinstance(data.get("models"), list):
            return {**data, "models": tuple(data["models"])}
        return data

    @model_validator(mode="after")
    def _options_fit_format(self) -> "TraceConfig":
        # (Checked by value, not by presence: a dumped scenario carries every default.)
        if self.format not in _TIMED:
            for name, default in (("speedup", 1.0), ("start_s", 0.0), ("duration_s", None)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"workload.trace.{name}: a {self.format} file has no timestamps; "
                        "workload.arrival sends its requests (slice with num_requests)"
                    )
        if self.format != "mooncake" and self.block_size != MOONCAKE_BLOCK_SIZE:
            raise ValueError("workload.trace.block_size: only a mooncake trace has hash ids")
        if self.format != "sharegpt" and self.shuffle_seed is not None:
            raise ValueError("workload.trace.shuffle_seed: only a sharegpt file is shuffled")
        if self.format != "burstgpt" and self.models is not None:
            raise ValueError("workload.trace.models: only a burstgpt trace names a model per row")
        return self

    @property
    def timed(self) -> bool:
        """Whether the format carries send times."""
        return self.format in _TIMED

    @property
    def requests(self) -> "TraceRequests":
        """The loaded requests (:func:`load_trace` fills them in when the scenario is read)."""
        if self._requests is None:
            raise ValueError("workload.trace: not loaded (parse the scenario with parse_scenario)")
        return self._requests


@dataclass(frozen=True)
class TraceRequests:
    """The requests a trace sends, in send order.

    ``times``: send times in seconds (first 0, after slicing and speedup), or None for a file
    without timestamps. ``blocks[i]``: request i's hash ids (mooncake), else empty.
    """

    input_lens: np.ndarray
    output_lens: np.ndarray
    times: np.ndarray | None
    blocks: tuple[tuple[int, ...], ...]
    block_size: int
    summary: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_lens)

    def segments(self, i: int, private_key: int) -> tuple[tuple[int, int], ...]:
        """Request i's prompt as content segments: one shared segment per hash id (its id as
        the key), clipped to the prompt; the rest under ``private_key``."""
        n = int(self.input_lens[i])
        out: list[tuple[int, int]] = []
        covered = 0
        for h in (self.blocks[i] if self.blocks else ()):
            if covered >= n:
                break
            take = min(self.block_size, n - covered)
            out.append((h, take))
            covered += take
        if covered < n:
            out.append((private_key, n - covered))
        return tuple(out)


class _Row:
    __slots__ = ("line", "time", "input_len", "output_len", "blocks")

    def __init__(self, line: int, time: float, input_len: int, output_len: int, blocks: tuple[int, ...] = ()):
        self.line, self.time, self.input_len, self.output_len, self.blocks = line, time, input_len, output_len, blocks


class _BadRow(Exception):
    pass


def _length(value: Any, name: str) -> int:
    """A token count: a whole number > 0 (a JSON number or a CSV cell)."""
    if value is None or value == "":
        raise _BadRow(f"{name} is missing")
    if isinstance(value, bool):
        raise _BadRow(f"{name} is {value!r}, not a number")
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"[+-]?\d+(\.0*)?", text):
            raise _BadRow(f"{name} is {value!r}, not a whole number")
        number = int(text.split(".")[0])
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        raise _BadRow(f"{name} is {value!r}, not a whole number")
    if number < 0:
        raise _BadRow(f"{name} is {number}, negative")
    if number == 0:
        raise _BadRow(f"{name} is 0")
    return number


def _time(value: Any, name: str) -> float:
    """A timestamp in the format's own unit (a JSON integer stays exact)."""
    if value is None or value == "":
        raise _BadRow(f"{name} is missing")
    if isinstance(value, bool):
        raise _BadRow(f"{name} is {value!r}, not a number")
    try:
        t = value if isinstance(value, int) else float(value)
    except (TypeError, ValueError):
        raise _BadRow(f"{name} is {value!r}, not a number") from None
    if not math.isfinite(t) or t < 0:
        raise _BadRow(f"{name} is {value!r}; times must be finite and >= 0")
    return t


_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d+))?")


def _azure_time(value: str | None) -> int:
    """An Azure trace TIMESTAMP in 100 ns ticks since 1970 (as UTC): exact, as published."""
    if not value:
        raise _BadRow("TIMESTAMP is missing")
    m = _AZURE_TIME.fullmatch(value.strip())
    if m is None:
        raise _BadRow(f"TIMESTAMP is {value!r}, not 'YYYY-MM-DD HH:MM:SS.fffffff'")
    try:
        whole = datetime.datetime.strptime(m.group(1).replace("T", " "), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise _BadRow(f"TIMESTAMP is {value!r}, not a date and time") from None
    frac = (m.group(2) or "")[:7].ljust(7, "0")  # (digits past 100 ns dropped)
    return calendar.timegm(whole.timetuple()) * 10**7 + int(frac)


def _not_format(path: Path, fmt: str, expected: str, got: str) -> ScenarioError:
    article = "an" if fmt[0] in "aeiou" else "a"
    return ScenarioError(f"workload.trace: {path} is not {article} {fmt} trace: expected {expected} (got {got})")


def _csv_rows(path: Path, fmt: str, columns: tuple[str, ...], text: str) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in columns if c not in header]
    if missing:
        shown = ",".join(header)[:120] or "an empty file"
        raise _not_format(path, fmt, f"CSV columns {','.join(columns)}", f"columns {shown}" if header else shown)
    reader.fieldnames = header
    for row in reader:
        yield reader.line_num, row


def _read_azure(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    for line, row in _csv_rows(path, "azure", AZURE_COLUMNS, text):
        yield line, lambda row=row: (
            _azure_time(row.get("TIMESTAMP")),
            _length(row.get("ContextTokens"), "ContextTokens"),
            _length(row.get("GeneratedTokens"), "GeneratedTokens"),
            (),
        )


def _read_burstgpt(path: Path, text: str, models: tuple[str, ...] | None,
                   summary: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    if models is not None:
        summary["other_models_left_out"] = 0
    for line, row in _csv_rows(path, "burstgpt", BURSTGPT_COLUMNS, text):
        if models is not None and (row.get("Model") or "").strip() not in models:
            summary["other_models_left_out"] += 1
            continue
        yield line, lambda row=row: (
            _time(row.get("Timestamp"), "Timestamp"),
            _length(row.get("Request tokens"), "Request tokens"),
            _length(row.get("Response tokens"), "Response tokens"),
            (),
        )


def _read_mooncake(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    expected = f"one JSON object a line with keys {', '.join(MOONCAKE_KEYS)}"
    first = True
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if first:
            first = False
            if not isinstance(obj, dict) or not set(MOONCAKE_KEYS) & set(obj):
                got = f"keys {', '.join(map(str, obj))}" if isinstance(obj, dict) else f"line 1: {raw[:60]!r}"
                raise _not_format(path, "mooncake", expected, got)

        def parse(obj: Any = obj, raw: str = raw) -> tuple[float, int, int, tuple[int, ...]]:
            if not isinstance(obj, dict):
                raise _BadRow(f"{raw[:40]!r} is not a JSON object")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
                raise _BadRow(f"hash_ids is {str(ids)[:40]}, not a list of whole numbers >= 0")
            return (
                _time(obj.get("timestamp"), "timestamp"),
                _length(obj.get("input_length"), "input_length"),
                _length(obj.get("output_length"), "output_length"),
                tuple(ids),
            )

        yield line, parse
    if first:
        raise _not_format(path, "mooncake", expected, "an empty file")


def _message_len(message: Any, name: str) -> int:
    if not isinstance(message, dict):
        raise _BadRow(f"{name} is not a message object")
    if "num_tokens" in message:
        return _length(message["num_tokens"], f"{name}.num_tokens")
    value = message.get("value")
    if not isinstance(value, str):
        raise _BadRow(f"{name}.value is missing")
    return _length(len(value.split()), f"{name} (words)")


def _read_sharegpt(path: Path, text: str, shuffle_seed: int | None, summary: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    expected = 'a JSON list of {"conversations": [{"from", "value"}, ...]} entries'
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _not_format(path, "sharegpt", expected, f"invalid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, list) or not any(isinstance(e, dict) and "conversations" in e for e in data):
        got = f"a JSON {type(data).__name__}" if not isinstance(data, list) else "no entry with conversations"
        raise _not_format(path, "sharegpt", expected, got)
    # As vLLM's ShareGPTDataset: keep entries with at least two messages, then shuffle.
    entries = [(i + 1, e) for i, e in enumerate(data)
               if isinstance(e, dict) and isinstance(e.get("conversations"), list) and len(e["conversations"]) >= 2]
    summary["entries_without_two_messages"] = len(data) - len(entries)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(entries)
    for pos, (entry_no, entry) in enumerate(entries):
        conv = entry["conversations"]
        yield entry_no, lambda conv=conv, pos=pos: (
            float(pos), _message_len(conv[0], "conversations[0]"), _message_len(conv[1], "conversations[1]"), ()
        )


def load_trace(config: TraceConfig, *, max_model_len: int, own_times: bool = True) -> TraceRequests:
    """Read ``config.path`` in ``config.format``, slice it and fill in ``config.requests``.

    ``own_times``: the requests are sent at the trace's times (else an arrival process sends
    them, and ``times`` is None).

    Every failure is a :class:`ScenarioError` naming ``workload.trace``: a missing file, a
    file not in the format (with the columns it should have), a bad or too long row under
    ``stop``, nothing left after slicing.
    """
    path = Path(config.path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"workload.trace.path: cannot read {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _not_format(path, config.format, "UTF-8 text", "binary data") from None
    summary: dict[str, Any] = {"format": config.format, "file": path.name,
                               "sha256": hashlib.sha256(raw).hexdigest()}
    readers = {
        "azure": lambda: _read_azure(path, text),
        "burstgpt": lambda: _read_burstgpt(path, text, config.models, summary),
        "mooncake": lambda: _read_mooncake(path, text),
        "sharegpt": lambda: _read_sharegpt(path, text, config.shuffle_seed, summary),
    }
    rows: list[_Row] = []
    bad = 0
    first_bad: str | None = None
    where = "entry" if config.format == "sharegpt" else "line"
    try:
        for line, parse in readers[config.format]():
            try:
                t, n_in, n_out, blocks = parse()
            except _BadRow as exc:
                if config.on_bad_row == "stop":
                    raise ScenarioError(
                        f"workload.trace: {path} {where} {line}: {exc}; lengths must be whole "
                        "numbers > 0 (workload.trace.on_bad_row: skip counts and leaves such rows out)"
                    ) from None
                bad += 1
                first_bad = first_bad or f"{where} {line}: {exc}"
                continue
            rows.append(_Row(line, t, n_in, n_out, blocks))
    except csv.Error as exc:
        raise _not_format(path, config.format, "CSV", f"unreadable CSV: {exc}") from None
    summary["rows"] = len(rows) + bad
    summary["bad_rows_skipped"] = bad
    if first_bad:
        summary["first_bad_row"] = first_bad
    if not rows:
        others = summary.get("other_models_left_out")
        raise ScenarioError(
            f"workload.trace: {path} has no usable rows ({bad} bad"
            + (f", {others} of other models than workload.trace.models)" if others else ")")
        )

    rows.sort(key=lambda r: r.time)  # stable: ties keep file order
    unit = _TIME_UNIT_S[config.format]
    t0 = rows[0].time
    for r in rows:  # seconds after the first row (differences of exact values)
        r.time = (r.time - t0) * unit
    lo = config.start_s
    hi = lo + config.duration_s if config.duration_s is not None else math.inf
    window = [r for r in rows if lo <= r.time < hi] if config.timed else rows
    if not window:
        raise ScenarioError(
            f"workload.trace.start_s: no rows in [{config.start_s:g}, {hi:g}) s of {path} "
            f"(its rows span {rows[-1].time:g} s)"
        )
    kept: list[_Row] = []
    too_long = 0
    limit = config.num_requests if config.num_requests is not None else len(window)
    for r in window:
        if len(kept) >= limit:
            break
        if r.input_len + r.output_len > max_model_len:
            if config.on_too_long == "stop":
                raise ScenarioError(
                    f"workload.trace: {path} {where} {r.line}: prompt ({r.input_len}) + output "
                    f"({r.output_len}) tokens exceed engine.max_model_len ({max_model_len}); vLLM "
                    "rejects such a request (workload.trace.on_too_long: skip counts and leaves them out)"
                )
            too_long += 1
            continue
        kept.append(r)
    summary["too_long_skipped"] = too_long
    if not kept:
        raise ScenarioError(
            f"workload.trace: every request of {path} in the slice exceeds engine.max_model_len "
            f"({max_model_len}); {too_long} skipped"
        )
    import numpy as np

    times = None
    if config.timed and own_times:
        times = (np.fromiter((r.time for r in kept), float, len(kept)) - kept[0].time) / config.speedup
    requests = TraceRequests(
        input_lens=np.fromiter((r.input_len for r in kept), np.int64, len(kept)),
        output_lens=np.fromiter((r.output_len for r in kept), np.int64, len(kept)),
        times=times,
        blocks=tuple(r.blocks for r in kept) if config.format == "mooncake" else (),
        block_size=config.block_size,
        summary=summary,
    )
    summary["requests"] = len(kept)
    if times is not None:
        summary["span_s"] = float(times[-1])
    config._requests = requests
    return requests


def trace_overrides(
    speedup: float | None = None, start_s: float | None = None,
    duration_s: float | None = None, num_requests: int | None = None,
) -> list[str]:
    """``--set`` overrides of ``workload.trace`` for the options given (the CLI's trace flags)."""
    given = (("speedup", speedup), ("start_s", start_s), ("duration_s", duration_s),
             ("num_requests", num_requests))
    return [f"workload.trace.{key}={value!r}" for key, value in given if value is not None]
