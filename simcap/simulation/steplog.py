"""The engine's step log: one row per step, reduced as it grows.

Rows arrive one at a time (the reference path) or as whole stretches of decode steps (the
fast path). Either way they are buffered and the KV-usage statistics reduced in fixed blocks
of :data:`FOLD_ROWS` rows, so both paths give the same figures bit for bit. With
``keep=False`` no row is stored and memory stays bounded however long the run (a million
requests is tens of millions of steps); ``keep=True`` stores every row, compactly, for plots
and step-level analysis.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

FIELDS = (
    "start",
    "duration",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_reqs",
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "num_preempted",
)
FLOAT_FIELDS = ("start", "duration", "kv_cache_usage")
_ONE = array("q", [1])


FOLD_ROWS = 1 << 16  # rows reduced at once: always rows [k*FOLD_ROWS, (k+1)*FOLD_ROWS)


class StepLog:
    """One row per engine step: when it started, how long it took, what it computed."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self._columns = {name: array("d" if name in FLOAT_FIELDS else "q") for name in FIELDS}
        self._num_rows = 0
        # Rows not yet reduced: their start times, and their KV usages, each row's holding
        # until the next row's start; then the reduction so far. Rows join the arrays as they
        # come (8 bytes a row: a fleet has one log per replica), a stretch's at once (its
        # start times come as a float array, copied as a block; its usages as a list,
        # ``array.fromlist``, while the floats are fresh). Usages come as runs: ``_run_counts[i]``
        # rows of ``_run_usages[i]`` in turn, expanded into ``_usages`` before a fold.
        self._starts = array("d")
        self._usages = array("d")
        self._run_usages = array("d")
        self._run_counts = array("q")
        self._weighted = 0.0
        self._weight = 0.0
        self._usage_sum = 0.0
        self._max = -math.inf
        # The latest row's (num_running, num_waiting, kv_cache_usage): what the engine last
        # published (a fleet's router scrapes it).
        self.last: tuple[int, int, float] = (0, 0, 0.0)

    def __len__(self) -> int:
        return self._num_rows

    # ------------------------------------------------------------------ writing

    def append(
        self,
        start: float,
        duration: float,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        num_reqs: int,
        num_running: int,
        num_waiting: int,
        kv_cache_usage: float,
        num_preempted: int,
    ) -> None:
        self._starts.append(start)
        self._run_usages.append(kv_cache_usage)
        self._run_counts.append(1)
        self._num_rows += 1
        self.last = (num_running, num_waiting, kv_cache_usage)
        if len(self._starts) > FOLD_ROWS:
            self._fold_full_blocks()
        if self.keep:
            c = self._columns
            c["start"].append(start)
            c["duration"].append(duration)
            c["num_prefill_tokens"].append(num_prefill_tokens)
            c["num_decode_tokens"].append(num_decode_tokens)
            c["num_reqs"].append(num_reqs)
            c["num_running"].append(num_running)
            c["num_waiting"].append(num_waiting)
            c["kv_cache_usage"].append(kv_cache_usage)
            c["num_preempted"].append(num_preempted)

    def extend_decode(
        self, starts: array, durations: list[float], usages: list[float], num_reqs: int,
        num_waiting: int = 0, counts: list[int] | None = None,
    ) -> None:
        """Rows of pure-decode steps of ``num_reqs`` requests, ``num_waiting`` waiting (none
        preempted), started at ``starts`` (a float array, copied as a block; any sequence of
        floats will do). ``usages``: each row's KV usage or, with ``counts``, runs of rows
        that share one: ``counts[i]`` rows of ``usages[i]`` in turn (each count >= 1). Lists."""
        n = len(starts)
        self.last = (num_reqs, num_waiting, usages[-1])
        self._starts.extend(starts)
        self._run_usages.fromlist(usages)
        if counts is None:
            self._run_counts += _ONE * n
        else:
            self._run_counts.fromlist(counts)
        self._num_rows += n
        if len(self._starts) > FOLD_ROWS:
            self._fold_full_blocks()
        if self.keep:
            c = self._columns
            c["start"].extend(starts)
            c["duration"].fromlist(durations)
            if counts is None:
                c["kv_cache_usage"].fromlist(usages)
            else:
                for usage, count in zip(usages, counts):
                    c["kv_cache_usage"].extend(array("d", [usage]) * count)
            zeros = array("q", bytes(8 * n))
            c["num_prefill_tokens"].extend(zeros)
            c["num_waiting"].extend(array("q", [num_waiting]) * n if num_waiting else zeros)
            c["num_preempted"].extend(zeros)
            batch = array("q", [num_reqs]) * n
            c["num_decode_tokens"].extend(batch)
            c["num_reqs"].extend(batch)
            c["num_running"].extend(batch)

    def _expand_runs(self) -> None:
        """Every row's usage into ``_usages`` (the runs expanded)."""
        if not self._run_usages:
            return
        usages = np.frombuffer(self._run_usages, dtype=np.float64)
        counts = np.frombuffer(self._run_counts, dtype=np.int64)
        expanded = usages if len(usages) == len(self._starts) - len(self._usages) else usages.repeat(counts)
        self._usages.frombytes(expanded.tobytes())
        del usages, counts, expanded  # (no view of the arrays left: they may be emptied)
        self._run_usages = array("d")
        self._run_counts = array("q")

    def _fold_full_blocks(self) -> None:
        """Reduce every full block of FOLD_ROWS rows whose next row has come."""
        self._expand_runs()
        while len(self._starts) > FOLD_ROWS:
            self._fold()

    def _fold(self) -> None:
        """Reduce the oldest FOLD_ROWS buffered rows (the next row's start closes the last)."""
        self._reduce(np.frombuffer(self._starts, dtype=np.float64, count=FOLD_ROWS + 1),
                     np.frombuffer(self._usages, dtype=np.float64, count=FOLD_ROWS))
        del self._starts[:FOLD_ROWS], self._usages[:FOLD_ROWS]

    def _reduce(self, starts: np.ndarray, usages: np.ndarray) -> None:
        weights = starts[1:] - starts[:-1]
        # (a pairwise sum, not a BLAS dot: the same bits however many threads BLAS has)
        self._weighted += float((weights * usages[: len(weights)]).sum())
        self._weight += float(weights.sum())
        self._usage_sum += float(usages.sum())
        self._max = max(self._max, float(usages.max()))

    # ------------------------------------------------------------------ reading

    def kv_usage_summary(self) -> dict[str, float | None]:
        """Time-weighted mean and max of KV usage (each step's usage holds until the next step)."""
        if not self._num_rows:
            return {"mean": None, "max": None}
        self._expand_runs()
        saved = self._weighted, self._weight, self._usage_sum, self._max
        if self._starts:
            self._reduce(np.frombuffer(self._starts, dtype=np.float64),
                         np.frombuffer(self._usages, dtype=np.float64))
        weighted, weight, usage_sum, peak = self._weighted, self._weight, self._usage_sum, self._max
        self._weighted, self._weight, self._usage_sum, self._max = saved
        if weight > 0:
            return {"mean": weighted / weight, "max": peak}
        return {"mean": usage_sum / self._num_rows, "max": peak}

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Every row, field by field (only when the log keeps its rows)."""
        if not self.keep:
            raise ValueError("this step log kept no rows (simulate(..., steps=True) keeps them)")
        return {
            name: np.frombuffer(col, dtype=np.float64 if name in FLOAT_FIELDS else np.int64).copy()
            for name, col in self._columns.items()
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepLog):
            return NotImplemented
        if len(self) != len(other) or self.kv_usage_summary() != other.kv_usage_summary():
            return False
        if not (self.keep and other.keep):
            return True
        return self._columns == other._columns
