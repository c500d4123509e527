"""Multi-turn sessions: conversations and agent loops whose every turn resends the whole
conversation so far.

A session is a sequence of turns. Turn k's prompt is every earlier turn's new tokens and
answer, in order, then turn k's own new tokens; its answer is ``max_tokens`` long; turn k+1 is
sent when turn k's answer has streamed back, plus a think time (a person reading, a tool
running). Every piece of a conversation is public content (keys >= 0, see
:mod:`simcap.engine.request`): turn k+1's prompt opens with exactly the segments turn k
computed, its answer included, so it hits whatever of turn k's blocks the prefix cache still
holds. vLLM caches full blocks of generated tokens too, but not the last answer token's block
when that token fills it: the last sampled token is never fed back, so its KV is never computed.

What is drawn (:class:`SessionWorkload`) is fixed by the scenario and seed: session i's turns,
lengths and think times come from its own random stream, whatever the arrival process or the
engine does. What a turn's prompt holds (:class:`Conversation`) depends on the answers
actually received, so a live client can replay a session with the answers' real tokens: it
sends turn k+1's prompt as the conversation so far (the answers as they came back) plus the
new tokens.

A turn whose prompt plus ``max_tokens`` would exceed ``max_model_len`` (vLLM refuses such a
request) is handled as ``sessions.on_overflow`` says: ``truncate`` drops the oldest whole turns
from its prompt, as a chat client trims its history (the prompt then opens differently, so it
misses the prefix cache), ``end`` ends the session before that turn. Both are counted.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simcap.config.scenario import (
    ClosedArrival, EmpiricalSeconds, ExponentialSeconds, FixedSeconds, UniformSeconds,
    WorkloadConfig,
)
from simcap.workloads.requests import RequestSpec, arrival_times, draw_lengths

# Content keys of session turns: request r's new tokens are SESSION_KEY_BASE + 2r, its answer
# SESSION_KEY_BASE + 2r + 1; above any shared-prefix group key (< MAX_REQUESTS).
SESSION_KEY_BASE = 1 << 40
# Random streams: SeedSequence(seed, spawn_key=(_PLAN_STREAM, i)) draws session i;
# (_START_STREAM,) the open-loop session starts. (Workload's own streams are spawn keys 0-3.)
_PLAN_STREAM = 4
_START_STREAM = 5


class Turn(NamedTuple):
    new_tokens: int  # tokens this turn adds to the conversation before its answer
    max_tokens: int  # the answer's length
    think_s: float  # from this answer's last token to the next turn's send (unused on the last)


class SessionPlan(NamedTuple):
    session_id: int
    turns: tuple[Turn, ...]
    # (group key, tokens) of the shared prefix opening the first turn (counted in its new
    # tokens and kept through truncation); None without workload.prefix.
    prefix: tuple[int, int] | None = None


def draw_seconds(
    spec: FixedSeconds | UniformSeconds | ExponentialSeconds | EmpiricalSeconds,
    rng: np.random.Generator, size: int,
) -> np.ndarray:
    """``size`` durations in seconds drawn from ``spec`` with ``rng``."""
    if isinstance(spec, FixedSeconds):
        return np.full(size, spec.value)
    if isinstance(spec, UniformSeconds):
        return rng.uniform(spec.low, spec.high, size=size)
    if isinstance(spec, ExponentialSeconds):
        return rng.exponential(spec.mean_s, size=size)
    return rng.choice(np.asarray(spec.values, dtype=np.float64), size=size)


class SessionWorkload:
    """The sessions of one scenario and seed: each session's turns, and when sessions start."""

    def __init__(self, config: WorkloadConfig, seed: int) -> None:
        if config.sessions is None:
            raise ValueError("workload.sessions: not a session workload")
        self.config = config
        self.sessions = config.sessions
        self.seed = seed

    @property
    def num_sessions(self) -> int | None:
        return self.sessions.num_sessions

    @property
    def duration_s(self) -> float | None:
        return self.config.duration_s

    @property
    def is_closed_loop(self) -> bool:
        return isinstance(self.config.arrival, ClosedArrival)

    def plan(self, i: int) -> SessionPlan:
        """Session i (0-based): the same for every run of this scenario and seed."""
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_PLAN_STREAM, i)))
        cfg = self.sessions
        n = int(draw_lengths(cfg.turns, rng, 1)[0])
        new = draw_lengths(self.config.input_len, rng, n)
        if cfg.first_input_len is not None:
            new[0] = draw_lengths(cfg.first_input_len, rng, 1)[0]
        out = draw_lengths(self.config.output_len, rng, n)
        think = draw_seconds(cfg.think_time_s, rng, n)
        shared = self.config.prefix
        prefix = None if shared is None else (int(rng.integers(0, shared.num_prefixes)), shared.shared_tokens)
        return SessionPlan(i, tuple(
            Turn(int(a), int(b), float(c)) for a, b, c in zip(new.tolist(), out.tolist(), think.tolist())
        ), prefix)

    def start_times(self) -> np.ndarray:
        """Open loop: when each session sends its first turn (the first at 0)."""
        arrival = self.config.arrival
        if isinstance(arrival, ClosedArrival):
            raise ValueError("a closed-loop workload has no arrival times; clients pace it")
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_START_STREAM,)))
        return arrival_times(arrival, rng, self.num_sessions, self.duration_s)


class Conversation:
    """One session's context as it grows, turn by turn.

    ``request(rid)`` gives the next turn's request (or None when the session is over), and
    ``answered(n)`` appends the ``n`` answer tokens that actually came back. ``history`` holds
    the segments of the turns still in the context, one ``[(new key, tokens), (answer key,
    tokens)]`` pair per turn; a shared prefix (``plan.prefix``) opens every prompt ahead of it
    and is never dropped (as a client keeps its system prompt).
    """

    def __init__(self, plan: SessionPlan, max_model_len: int, on_overflow: str = "truncate") -> None:
        self.plan = plan
        self.max_model_len = max_model_len
        self.on_overflow = on_overflow
        self.history: list[tuple[tuple[int, int], tuple[int, int]]] = []
        self.system: tuple[tuple[int, int], ...] = (plan.prefix,) if plan.prefix else ()
        self.num_tokens = plan.prefix[1] if plan.prefix else 0  # tokens of the prefix and history
        self.next_turn = 0
        self.truncated_turns = 0  # turns sent with their oldest turns dropped
        self.dropped_turns = 0  # turns dropped from the context, all told
        self.ended = False  # ended early (on_overflow: end)
        self._pending: tuple[int, int, int] | None = None  # (new key, new tokens, answer key)

    @property
    def done(self) -> bool:
        return self.ended or self.next_turn >= len(self.plan.turns)

    def request(self, request_id: int) -> RequestSpec | None:
        """The next turn as request ``request_id``; None when the session has ended."""
        if self._pending is not None:
            raise ValueError("session: the previous turn has not been answered")
        if self.done:
            return None
        turn = self.plan.turns[self.next_turn]
        # The first turn's new tokens include the shared prefix, already in num_tokens.
        new_tokens = turn.new_tokens - (self.num_tokens if self.next_turn == 0 else 0)
        need = new_tokens + turn.max_tokens
        if self.num_tokens + need > self.max_model_len:
            if self.on_overflow == "end":
                self.ended = True
                return None
            history = self.history
            dropped = 0
            while history and self.num_tokens + need > self.max_model_len:
                (_, a), (_, b) = history.pop(0)
                self.num_tokens -= a + b
                dropped += 1
            self.truncated_turns += 1
            self.dropped_turns += dropped
        new_key = SESSION_KEY_BASE + 2 * request_id
        segments = (*self.system, *(seg for pair in self.history for seg in pair), (new_key, new_tokens))
        self._pending = (new_key, new_tokens, new_key + 1)
        return RequestSpec(
            request_id, self.num_tokens + new_tokens, turn.max_tokens, segments,
            output_key=new_key + 1, session_id=self.plan.session_id, turn=self.next_turn,
        )

    def answered(self, num_output_tokens: int) -> float:
        """The pending turn's answer came back with ``num_output_tokens`` tokens; returns the
        think time before the next turn."""
        if self._pending is None:
            raise ValueError("session: no turn awaits an answer")
        new_key, new_tokens, answer_key = self._pending
        self._pending = None
        self.history.append(((new_key, new_tokens), (answer_key, num_output_tokens)))
        self.num_tokens += new_tokens + num_output_tokens
        think = self.plan.turns[self.next_turn].think_s
        self.next_turn += 1
        return think
