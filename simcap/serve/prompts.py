"""What a served request's prompt is to the engine model: its token count and its content.

With a tokenizer (``simcap serve --tokenizer DIR``: a model folder with ``tokenizer.json``, or
that file), a text prompt is tokenised as vLLM's completions endpoint does it (special tokens
added, the tokenizer's own post-processor: a BOS where the model has one), and a chat is first
rendered through the model's chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``; with the generation prompt) and then tokenised without special
tokens, as ``apply_chat_template`` does. Without one, the documented rule: a text is its UTF-8
bytes, one token per 4 bytes (rounded up, at least 1), and a chat is rendered as one
``"<role>: <content>\\n"`` line per message. A prompt given as token ids is those ids. By the rule a token's id is its
4 bytes read as a little-endian number, so ``/tokenize`` and ``/detokenize`` work either way.

Content: the prompt's token ids in blocks of the
engine's ``block_size``; each block is keyed by a hash of everything up to its end (a chain, as
vLLM's block hashes), so two prompts that open with the same blocks share those blocks' KV in
the modelled prefix cache, and no others. The same keys are a Mooncake trace's ``hash_ids``
(``simcap serve --trace``, :mod:`simcap.serve.engine`), so ``simcap simulate`` replays a served workload with
the same sharing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from simcap.errors import ScenarioError

BYTES_PER_TOKEN = 4  # the rule without a tokenizer
_KEY_MASK = (1 << 62) - 1  # content keys are non-negative (a negative key is a request's own)


@dataclass(frozen=True)
class Prompt:
    """A prompt as the engine sees it: its token ids."""

    tokens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def block_keys(self, block_size: int) -> tuple[int, ...]:
        """One key per block of ``block_size`` tokens (the last one as long as the prompt still
        runs): a hash of every token up to the block's end."""
        keys = []
        h = hashlib.blake2b(digest_size=8)
        for start in range(0, len(self.tokens), block_size):
            h.update(repr(self.tokens[start:start + block_size]).encode())
            keys.append(int.from_bytes(h.copy().digest(), "little") & _KEY_MASK)
        return tuple(keys)

    def segments(self, block_size: int) -> tuple[tuple[int, int], ...]:
        """The prompt as the engine's content segments: ``(block key, tokens)`` per block."""
        n = self.num_tokens
        return tuple(
            (key, min(block_size, n - i * block_size))
            for i, key in enumerate(self.block_keys(block_size))
        )


class PromptReader:
    """Turns what a client sent (text, token ids, chat messages) into :class:`Prompt`."""

    def __init__(self, tokenizer: str | Path | None = None) -> None:
        self.source = "rule: 1 token per 4 UTF-8 bytes" if tokenizer is None else str(tokenizer)
        self._tokenizer = None
        self._template = None
        self._special: dict[str, str] = {}
        if tokenizer is not None:
            self._load(Path(tokenizer))

    def _load(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - the serve extra is not installed
            raise ScenarioError(
                "--tokenizer: needs the 'tokenizers' package (pip install 'simcap[serve]')"
            ) from None
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ScenarioError(f"--tokenizer: {path}: no tokenizer.json there (give a model folder or the file)")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library's own error types
            raise ScenarioError(f"--tokenizer: {file}: not a tokenizer file ({exc})") from None
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        for name in ("bos_token", "eos_token"):
            value = config.get(name)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str):
                self._special[name] = value
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, str):
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(template)

    def text(self, text: str, add_special_tokens: bool = True) -> Prompt:
        """A completion's text prompt."""
        if self._tokenizer is None:
            return Prompt(_byte_groups(text))
        return Prompt(tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids back to text (``/detokenize``): the tokenizer's, or the rule's bytes."""
        if self._tokenizer is not None:
            return self._tokenizer.decode(list(ids), skip_special_tokens=False)
        data = b"".join(int(i).to_bytes(BYTES_PER_TOKEN, "little") for i in ids)
        return data.rstrip(b"\0").decode(errors="replace")

    @staticmethod
    def ids(ids: Sequence[int]) -> Prompt:
        """A prompt sent as token ids."""
        return Prompt(tuple(ids))

    def chat(self, messages: Sequence[dict[str, Any]]) -> Prompt:
        """A chat's messages, rendered as the model's template renders them (or by the rule)."""
        if self._tokenizer is None or self._template is None:
            lines = "".join(f"{m.get('role', '')}: {_content(m.get('content'))}\n" for m in messages)
            if self._tokenizer is None:
                return Prompt(_byte_groups(lines))
            return Prompt(tuple(self._tokenizer.encode(lines, add_special_tokens=True).ids))
        rendered = self._template.render(
            messages=[{**m, "content": _content(m.get("content"))} for m in messages],
            add_generation_prompt=True, **self._special,
        )
        return Prompt(tuple(self._tokenizer.encode(rendered, add_special_tokens=False).ids))


def _byte_groups(text: str) -> tuple[int, ...]:
    """The rule's tokens: each group of 4 UTF-8 bytes as a little-endian number (its id)."""
    data = text.encode()
    return tuple(
        int.from_bytes(data[i:i + BYTES_PER_TOKEN], "little") for i in range(0, len(data), BYTES_PER_TOKEN)
    ) or (0,)


def _content(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
