"""Live multi-turn sessions: each turn's prompt as the exact token ids of the conversation so far.

A :class:`~simcap.workloads.sessions.Conversation` says which content a turn's prompt holds, as
``(content key, tokens)`` segments: the shared prefix, every earlier turn's new tokens and
answer, then the turn's own new tokens. :class:`SessionPrompts` turns those segments into the
token ids the completions endpoint is sent: new tokens (and the shared prefix) from the
seeded :class:`~simcap.live.prompts.PromptBuilder`, answers as the very ids the server
streamed back (``return_token_ids``). So turn k+1's prompt opens with turn k's prompt and
answer token for token, and the server's prefix cache sees what a chat client's resent history
gives it. The answer's length in the conversation is the number of ids that came back.
"""

from __future__ import annotations

from typing import Sequence

from simcap.live.prompts import PromptBuilder
from simcap.workloads.requests import RequestSpec
from simcap.workloads.sessions import Conversation


class SessionPrompts:
    """One live session's prompts: ``request(rid)`` -> (turn, prompt ids), ``answered(ids)``."""

    def __init__(self, conversation: Conversation, builder: PromptBuilder) -> None:
        self.conversation = conversation
        self.builder = builder
        self.answers: dict[int, list[int]] = {}  # answer key -> the ids that came back
        self._answer_key: int | None = None

    @property
    def done(self) -> bool:
        return self.conversation.done

    def request(self, request_id: int) -> tuple[RequestSpec, list[int]] | None:
        """The next turn as request ``request_id`` and its prompt ids; None when the session is over."""
        spec = self.conversation.request(request_id)
        if spec is None:
            return None
        ids: list[int] = []
        for key, n in spec.segments:
            answer = self.answers.get(key)
            if answer is None:
                ids.extend(self.builder.segment_ids(key, n))
            elif len(answer) != n:
                raise ValueError(f"session {spec.session_id}: answer {key} has {len(answer)} ids, prompt says {n}")
            else:
                ids.extend(answer)
        if len(ids) != spec.num_prompt_tokens:
            raise ValueError(
                f"request {request_id}: segments give {len(ids)} tokens, spec says {spec.num_prompt_tokens}"
            )
        # Answers of turns truncation dropped are never sent again.
        kept = {key for key, _ in spec.segments}
        for key in [k for k in self.answers if k not in kept]:
            del self.answers[key]
        self._answer_key = spec.output_key
        return spec, ids

    def answered(self, token_ids: Sequence[int]) -> float:
        """The pending turn's answer came back as ``token_ids``; returns the think time before
        the next turn."""
        if self._answer_key is None:
            raise ValueError("session: no turn awaits an answer")
        self.answers[self._answer_key] = [int(t) for t in token_ids]
        self._answer_key = None
        return self.conversation.answered(len(token_ids))
