"""The serving front end between the engine and its clients: when they see what it does.

vLLM's API server takes a request over HTTP, processes it and hands it to the engine core.
After each step its output handler takes the step's outputs and processes them all
(detokenisation, per-request state, stats) before the request streams write their chunks
(``AsyncLLM``'s output handler yields to the streams only between slices of up to 128
outputs); the client's own loop then reads them. None of that is in the engine's step time.
:class:`FrontEnd` adds it to the times clients see (:class:`simcap.config.scenario.FrontendConfig`):

- a request reaches the engine's waiting queue ``arrival_s`` after it was sent (the engine
  takes it then; its record keeps the send time);
- a step that emits ``n`` chunks delivers them ``output_s + n * per_chunk_s`` after it ends.

Not modelled: a queue that carries the front end's work from one step to the next (at 64
streams and 1,650 chunks/s the CPU server's clients still saw the engine's own step period,
where a queue serving the measured 0.9 ms per chunk would have fallen behind: see
:mod:`simcap.live.frontend_fit`, which fits the terms for ``simcap live calibrate``), and the
spread of one step's chunks in batch order (0.06-0.15 ms per chunk there).

A request's offset (its delay past the engine's own time) changes from one step to the next
only when the number of chunks does, so the gaps between the chunks of a stretch of identical
batches are the engine's, its bulk accounting of them stands, and only each request's first
gap in a stretch, its first token and its last change. The engine keeps its own token times;
:class:`FrontEnd` keeps each unfinished request's offsets of its first and its latest chunk.
"""

from __future__ import annotations

from typing import Any

from simcap.config.scenario import FrontendConfig


class FrontEnd:
    """One engine's front end: the delays and each unfinished request's chunk offsets."""

    __slots__ = ("arrival_s", "output_s", "per_chunk_s", "first", "last", "_off")

    def __init__(self, config: FrontendConfig) -> None:
        self.arrival_s = float(config.arrival_s)
        self.output_s = float(config.output_s)
        self.per_chunk_s = float(config.per_chunk_s)
        self.first: dict[int, float] = {}  # request id -> offset of its first chunk
        self.last: dict[int, float] = {}  # request id -> offset of its latest chunk
        self._off = self.output_s  # the current step's chunks' offset

    @classmethod
    def from_config(cls, config: FrontendConfig | None) -> "FrontEnd | None":
        """None without a front end (no section, or every delay 0): times are the engine's."""
        return cls(config) if config is not None and config.active else None

    def new_step(self, num_chunks: int) -> None:
        """A step's ``num_chunks`` chunks follow (:meth:`chunk`, one call each)."""
        self._off = self.output_s + num_chunks * self.per_chunk_s

    def chunk(self, request_id: int) -> tuple[float, float | None]:
        """One chunk of the step: its offset, and the offset of the request's previous chunk
        (None: this is its first)."""
        off = self._off
        return off, self._note(request_id, off)

    def batch(self, request_ids: list[int]) -> tuple[float, list[float | None]]:
        """A stretch of identical batches, a chunk for each of ``request_ids`` at every step:
        their offset, and each one's offset of its chunk before the stretch (None: none)."""
        off = self.output_s + len(request_ids) * self.per_chunk_s
        return off, [self._note(rid, off) for rid in request_ids]

    def _note(self, request_id: int, off: float) -> float | None:
        prev = self.last.get(request_id)
        if prev is None:
            self.first[request_id] = off
        self.last[request_id] = off
        return prev

    def done(self, request_id: int) -> tuple[float, float]:
        """A finished request's offsets of its first and last chunk (forgotten here)."""
        return self.first.pop(request_id, 0.0), self.last.pop(request_id, 0.0)


def describe(config: FrontendConfig | None) -> dict[str, Any] | None:
    """The front end's terms as results and reports show them (None: none)."""
    return config.model_dump() if config is not None and config.active else None
