"""The engine's step log: one row per step, in fixed-size blocks, reduced as it grows.

Rows arrive one at a time (the reference path) or as whole stretches of steps (the fast
path). Either way they fill the same blocks of :data:`BLOCK_ROWS` rows, and each full block
is folded into the running KV-usage statistics in one fixed way, so both paths give the same
figures bit for bit. With ``keep=False`` folded blocks are dropped: memory stays bounded
however long the run (a million requests is tens of millions of steps); ``keep=True`` keeps
every row for plots and step-level analysis.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK_ROWS = 1 << 15

FLOAT_FIELDS = ("start", "duration", "kv_cache_usage")
INT_FIELDS = (
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_reqs",
    "num_running",
    "num_waiting",
    "num_preempted",
)
FIELDS = ("start", "duration") + INT_FIELDS[:5] + ("kv_cache_usage", "num_preempted")


class StepLog:
    """One row per engine step: when it started, how long it took, what it computed."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self._kept: list[dict[str, np.ndarray]] = []
        self._block = self._new_block()
        self._fill = 0
        self._num_rows = 0
        # KV-usage reduction over folded rows: sum of usage * (next start - start), the sum of
        # those weights, and the max.
        self._weighted = 0.0
        self._weight = 0.0
        self._max = -np.inf

    @staticmethod
    def _new_block() -> dict[str, np.ndarray]:
        block = {name: np.empty(BLOCK_ROWS, np.float64) for name in FLOAT_FIELDS}
        block.update({name: np.empty(BLOCK_ROWS, np.int64) for name in INT_FIELDS})
        return block

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
        if self._fill == BLOCK_ROWS:
            self._fold(start)
        b, i = self._block, self._fill
        b["start"][i] = start
        b["duration"][i] = duration
        b["num_prefill_tokens"][i] = num_prefill_tokens
        b["num_decode_tokens"][i] = num_decode_tokens
        b["num_reqs"][i] = num_reqs
        b["num_running"][i] = num_running
        b["num_waiting"][i] = num_waiting
        b["kv_cache_usage"][i] = kv_cache_usage
        b["num_preempted"][i] = num_preempted
        self._fill = i + 1
        self._num_rows += 1

    def extend(self, start: np.ndarray, duration: np.ndarray, kv_cache_usage: np.ndarray, **columns: Any) -> None:
        """Append ``len(start)`` rows; ``columns`` give the integer fields (scalars or arrays),
        missing ones are 0."""
        n = len(start)
        done = 0
        while done < n:
            if self._fill == BLOCK_ROWS:
                self._fold(float(start[done]))
            b, i = self._block, self._fill
            k = min(n - done, BLOCK_ROWS - i)
            b["start"][i : i + k] = start[done : done + k]
            b["duration"][i : i + k] = duration[done : done + k]
            b["kv_cache_usage"][i : i + k] = kv_cache_usage[done : done + k]
            for name in INT_FIELDS:
                value = columns.get(name, 0)
                b[name][i : i + k] = value if np.isscalar(value) else value[done : done + k]
            self._fill = i + k
            self._num_rows += k
            done += k

    def _fold(self, next_start: float) -> None:
        """Reduce the full current block (its last row weighs until ``next_start``)."""
        b = self._block
        self._reduce(b["start"], b["kv_cache_usage"], next_start)
        if self.keep:
            self._kept.append(b)
            self._block = self._new_block()
        self._fill = 0

    def _reduce(self, start: np.ndarray, usage: np.ndarray, next_start: float) -> None:
        weights = np.append(start[1:], next_start) - start
        self._weighted += float(np.dot(weights, usage))
        self._weight += float(weights.sum())
        self._max = max(self._max, float(usage.max()))

    # ------------------------------------------------------------------ reading

    def kv_usage_summary(self) -> dict[str, float | None]:
        """Time-weighted mean and max of KV usage (each step's usage holds until the next step)."""
        if self._num_rows == 0:
            return {"mean": None, "max": None}
        weighted, weight, peak = self._weighted, self._weight, self._max
        b, n = self._block, self._fill
        if n:
            start, usage = b["start"][:n], b["kv_cache_usage"][:n]
            ends = start[1:]
            weights = ends - start[:-1]
            weighted += float(np.dot(weights, usage[:-1]))
            weight += float(weights.sum())
            peak = max(peak, float(usage.max()))
        if weight > 0:
            return {"mean": weighted / weight, "max": peak}
        usage = self.as_arrays()["kv_cache_usage"] if self.keep else b["kv_cache_usage"][:n]
        return {"mean": float(usage.mean()), "max": peak}

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Every row, field by field (only when the log keeps its rows)."""
        if not self.keep:
            raise ValueError("this step log kept no rows (simulate(..., steps=True) keeps them)")
        n = self._fill
        return {
            name: np.concatenate([blk[name] for blk in self._kept] + [self._block[name][:n]])
            for name in FIELDS
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepLog):
            return NotImplemented
        if len(self) != len(other) or self.kv_usage_summary() != other.kv_usage_summary():
            return False
        if not (self.keep and other.keep):
            return True
        a, b = self.as_arrays(), other.as_arrays()
        return all(np.array_equal(a[k], b[k]) for k in FIELDS)
