"""The per-request record: the one type both the simulator and the live client produce.

Times are float seconds on the run's own clock (0 = start of the run). A record describes
what a streaming client sees: when the request was sent (``arrival_time``), when each stream
chunk arrived and how many tokens it carried. One engine step that emits tokens for a
request is one chunk, so chunk gaps are the field's ITL (per step, not per token).
In a closed-loop run, ``client_id`` says which client (0..concurrency-1) sent the request
(None in an open-loop run), so the run can be replayed client by client
(:class:`simcap.workloads.requests.ClosedLoopTrace`). A turn of a multi-turn session
(:mod:`simcap.workloads.sessions`) carries its ``session_id`` and ``turn`` (0-based); None otherwise.
In a fleet (simulated, or a live run over several servers), ``replica`` says which replica
(0..N-1) the router sent it to; None on a lone engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    # Engine side (simulated, or the server's view where live mode can know it).
    scheduled_time: float | None = None  # first scheduled (queue time ends)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first scheduling
    # Client side.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "length", "stop", "abort" or "error"
    error: str | None = None
    client_id: int | None = None  # closed loop: the client that sent it
    session_id: int | None = None  # a session's turn: which session
    turn: int | None = None  # and which of its turns (0-based)
    replica: int | None = None  # a fleet's: the replica that served it

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def first_token_time(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def succeeded(self) -> bool:
        return self.error is None and self.finish_time is not None and bool(self.chunk_times)

    def add_chunk(self, time: float, num_tokens: int) -> None:
        self.chunk_times.append(time)
        self.chunk_tokens.append(num_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestRecord":
        return cls(**data)
