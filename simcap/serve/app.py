"""vLLM's OpenAI-compatible HTTP API in front of a served scenario (Starlette, run by uvicorn).

Endpoints as vLLM 0.32 serves them: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(streamed as server-sent events, one event per engine step that made tokens for a choice, the
last one with the finish reason, then a usage event when ``stream_options.include_usage``, then
``[DONE]``; or one JSON response), ``GET /v1/models``, ``GET /health``, ``GET|POST /ping``,
``POST /tokenize``, ``/detokenize`` and ``/reset_prefix_cache`` (as vLLM's dev mode serves it),
``GET /version`` (the modelled vLLM's version, and
simcap's), ``GET /metrics``
(:mod:`simcap.serve.metrics`) and simcap's own ``GET /simcap`` (provenance, clock lag, load).

Request fields honoured: ``model`` (the served name, or left out), ``prompt`` (a text, token
ids, or a batch of either), ``messages``, ``max_tokens`` (completions default 16; chat default,
and ``max_completion_tokens``: what the context leaves), ``min_tokens``, ``ignore_eos``, ``n``,
``stream``, ``stream_options`` (``include_usage``, ``continuous_usage_stats``). Other sampling
fields are accepted and have no effect on timing, as in the engine model. Bad requests get
vLLM's error body (``{"error": {"message", "type", "param", "code"}}``) and status code, with
vLLM's messages; ``max_tokens`` past the context is cut to what the context leaves, as vLLM
0.32 does. The text is synthetic: one ``" x"`` per output token (count tokens from ``usage``).
A client that goes away (a closed stream, or a dropped connection while it waits for a whole
response) aborts its requests, as vLLM's server does: they leave the engine before its next step
and free their blocks; their records end with finish reason ``abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from simcap._version import __version__
from simcap.errors import SimulationError
from simcap.serve.engine import Chunk, Done, ServedEngine
from simcap.serve.metrics import ServedMetrics
from simcap.serve.prompts import Prompt, PromptReader

TOKEN_TEXT = " x"  # the synthetic text of one output token


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    max_tokens: int | None = 16


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class ApiError(Exception):
    """A request vLLM would refuse: its status code, message, type and parameter."""

    def __init__(self, code: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.kind = kind or {400: "BadRequestError", 404: "NotFoundError"}.get(code, "InternalServerError")

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.code)


def _validation_error(exc: ValidationError) -> ApiError:
    """pydantic's errors as vLLM words them (its request models are pydantic's too)."""
    errors = exc.errors(include_url=False)
    lines = "\n".join(
        "  " + repr({"type": e["type"], "loc": "body." + ".".join(map(str, e["loc"])), "msg": e["msg"],
                     "input": e.get("input")})
        for e in errors
    )
    noun = "error" if len(errors) == 1 else "errors"
    param = "body." + ".".join(map(str, errors[0]["loc"])) if errors else None
    return ApiError(400, f"{len(errors)} validation {noun}:\n{lines}", param, "Bad Request")


class ServeApp:
    """The HTTP side of ``simcap serve``: parses, checks, submits, streams."""

    def __init__(self, engine: ServedEngine, reader: PromptReader, model_name: str) -> None:
        self.engine = engine
        self.reader = reader
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.metrics = ServedMetrics(
            model_name, len(engine.replicas), engine.gauges, engine.prefix_cache,
            _cache_config(engine),
        )
        engine.observer = self.metrics
        self.created = int(time.time())
        self._task: asyncio.Task | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ping", self.health, methods=["GET", "POST"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/simcap", self.status, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._task = asyncio.get_running_loop().create_task(self.engine.run())
        try:
            yield
        finally:
            self._task.cancel()

    def _count_lag(self, lag: float) -> None:
        self.engine.lag.add(lag)
        self.metrics.lag.observe(lag)

    # ------------------------------------------------------------------ small endpoints

    async def models(self, request: Request) -> JSONResponse:
        card = {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.model_name, "parent": None, "max_model_len": self.max_model_len,
            "permission": [],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> JSONResponse:
        try:
            body = await _parse(request, TokenizeRequest)
            self._check_model(body.model)
            if body.messages is not None:
                prompt = self.reader.chat(body.messages)
            else:
                prompt = self.reader.text(body.prompt or "", body.add_special_tokens)
        except ApiError as exc:
            return exc.response()
        tokens = list(prompt.tokens)
        return JSONResponse({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                             "token_strs": None})

    async def detokenize(self, request: Request) -> JSONResponse:
        try:
            body = await _parse(request, DetokenizeRequest)
            self._check_model(body.model)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": self.reader.detokenize(body.tokens)})

    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        return JSONResponse({"success": self.engine.reset_prefix_cache()})

    async def health(self, request: Request) -> Response:
        if self.engine.failure is not None:
            return ApiError(500, self.engine.failure, kind="EngineDeadError").response()
        return Response(status_code=200)

    async def version(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": self.engine.scenario.engine.vllm_version, "simcap_version": __version__})

    async def prometheus(self, request: Request) -> Response:
        self.engine.advance()  # (the gauges as of now)
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def status(self, request: Request) -> JSONResponse:
        self.engine.advance()
        return JSONResponse(self.engine.status())

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        try:
            body = await _parse(request, CompletionRequest)
            self._check_model(body.model)
            prompts = self._completion_prompts(body.prompt)
            return self._generate(body, prompts, body.max_tokens, chat=False)
        except ApiError as exc:
            return exc.response()

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await _parse(request, ChatCompletionRequest)
            self._check_model(body.model)
            prompt = self.reader.chat(body.messages)
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            return self._generate(body, [prompt], max_tokens, chat=True)
        except ApiError as exc:
            return exc.response()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {self.model_name}.", "model")

    def _completion_prompts(self, prompt: Any) -> list[Prompt]:
        if prompt is None or prompt == "" or prompt == []:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                           "prompt")
        if isinstance(prompt, str):
            return [self.reader.text(prompt)]
        if all(isinstance(p, int) for p in prompt):
            return [self.reader.ids(prompt)]
        return [self.reader.text(p) if isinstance(p, str) else self.reader.ids(p) for p in prompt]

    def _generate(self, body: _Sampling, prompts: list[Prompt], max_tokens: int | None, chat: bool) -> Response:
        limit = self.max_model_len
        if max_tokens is not None:
            if max_tokens < 1:
                raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}. "
                                    f"(parameter=max_tokens, value={max_tokens})", "max_tokens")
            if max_tokens > limit:
                raise ApiError(400, f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                                    f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                               "max_tokens")
        if body.n < 1:
            raise ApiError(400, f"n must be at least 1, got {body.n}.", "n")
        if body.min_tokens < 0:
            raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.")
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                                f"got {body.min_tokens}.")
        for prompt in prompts:
            if prompt.num_tokens == 0:
                raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty. "
                                    "(parameter=prompt)", "prompt")
            if prompt.num_tokens >= limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                    f"contains {prompt.num_tokens} input tokens, which exceeds this limit even "
                                    "without any output tokens. Please reduce the length of the input prompt. "
                                    f"(parameter=input_tokens, value={prompt.num_tokens})", "input_tokens")
        queue: asyncio.Queue = asyncio.Queue()
        streams = []
        try:
            for p, prompt in enumerate(prompts):
                room = limit - prompt.num_tokens  # vLLM 0.32 cuts max_tokens to the context left
                asked = room if max_tokens is None else min(max_tokens, room)
                for j in range(body.n):
                    streams.append(self.engine.submit(
                        prompt, asked, min_tokens=min(body.min_tokens, asked), ignore_eos=body.ignore_eos,
                        queue=queue, index=p * body.n + j,
                    ))
        except SimulationError as exc:
            raise ApiError(500, str(exc), kind="EngineDeadError") from None
        usage = _Usage(sum(p.num_tokens for p in prompts))
        # The id begins with the first choice's record's request_id: a client's response finds
        # its line in --records (vLLM's is a bare uuid).
        request_id = ("chatcmpl-" if chat else "cmpl-") + f"{streams[0].request_id}-" + uuid.uuid4().hex[:16]
        reply = _Reply(request_id, self.model_name, int(time.time()), chat, streams, usage, queue, self.engine,
                       self._count_lag)
        if body.stream:
            options = body.stream_options or StreamOptions()
            return StreamingResponse(
                reply.events(bool(options.include_usage), bool(options.continuous_usage_stats)),
                media_type="text/event-stream",
            )
        return _Awaited(reply)


class _Usage:
    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens": self.completion_tokens}


class _Reply:
    """One HTTP request's choices, as they come from the engine."""

    def __init__(self, request_id: str, model: str, created: int, chat: bool, streams: list, usage: _Usage,
                 queue: asyncio.Queue, engine: ServedEngine, on_lag: Callable[[float], None]) -> None:
        self.head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.chat = chat
        self.streams = streams
        self.usage = usage
        self.queue = queue
        self.engine = engine
        self.on_lag = on_lag  # each chunk's lag, as it is handed on

    async def items(self) -> AsyncIterator[Chunk | Done]:
        """Every choice's chunks and ends, each chunk's lag counted as it is handed on."""
        open_choices = len(self.streams)
        engine = self.engine
        while open_choices:
            item = await self.queue.get()
            if isinstance(item, Chunk):
                self.on_lag(time.monotonic() - engine.wall(item.time))
                self.usage.completion_tokens += item.num_tokens
            elif isinstance(item, Done):
                open_choices -= 1
            else:  # Failed
                raise SimulationError(item.message)
            yield item

    def _choice(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish,
                    **({"stop_reason": None} if finish else {})}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

    async def events(self, include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        """Server-sent events as vLLM streams them: a chat's role first, then one event per
        chunk, the one that completes a choice with its finish reason."""
        head = self.head
        produced = {s.index: 0 for s in self.streams}
        ends = {s.index: (s.num_output_tokens, s.finish_reason) for s in self.streams}

        def event(choices: list[dict[str, Any]], usage: bool = False) -> str:
            out = {**head, "choices": choices}
            if usage:
                out["usage"] = self.usage.to_dict()
            return f"data: {_json(out)}\n\n"

        ended = False
        try:
            async for item in self.items():
                if not isinstance(item, Chunk):
                    continue
                index = item.index
                if self.chat and not produced[index]:
                    yield event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                produced[index] += item.num_tokens
                total, reason = ends[index]
                finish = reason if produced[index] >= total else None
                yield event([self._choice(index, TOKEN_TEXT * item.num_tokens, finish)], continuous_usage)
            ended = True
        except SimulationError as exc:
            ended = True
            yield f"data: {_json({'error': {'message': str(exc), 'type': 'EngineDeadError', 'code': 500}})}\n\n"
            return
        finally:
            if not ended:  # the client went away (the stream was closed or cancelled)
                self.engine.abort(self.streams)
        if include_usage:
            yield f"data: {_json({**head, 'choices': [], 'usage': self.usage.to_dict()})}\n\n"
        yield "data: [DONE]\n\n"

    async def whole(self) -> dict[str, Any]:
        texts: dict[int, int] = {s.index: 0 for s in self.streams}
        async for item in self.items():
            if isinstance(item, Chunk):
                texts[item.index] += item.num_tokens
        choices = []
        for s in sorted(self.streams, key=lambda s: s.index):
            text = TOKEN_TEXT * texts[s.index]
            if self.chat:
                choices.append({"index": s.index, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": None})
            else:
                choices.append({"index": s.index, "text": text, "logprobs": None,
                                "finish_reason": s.finish_reason, "stop_reason": None})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": choices, "usage": self.usage.to_dict()}


class _Awaited(Response):
    """A whole (non-streamed) response, sent when every choice has finished."""

    def __init__(self, reply: _Reply) -> None:
        super().__init__(media_type="application/json")
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        async def disconnected() -> None:  # (the body has been read: what comes next is the end)
            while (await receive())["type"] != "http.disconnect":
                pass

        whole = asyncio.ensure_future(self.reply.whole())
        watch = asyncio.ensure_future(disconnected())
        await asyncio.wait({whole, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not whole.done():  # the client went away first
            whole.cancel()
            self.reply.engine.abort(self.reply.streams)
            return
        watch.cancel()
        try:
            body = whole.result()
        except SimulationError as exc:
            await ApiError(500, str(exc), kind="EngineDeadError").response()(scope, receive, send)
            return
        await JSONResponse(body)(scope, receive, send)


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))  # (compact, as vLLM writes its events)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:  # (JSONDecodeError, or bytes that are not UTF-8)
        why = getattr(exc, "msg", None) or "not UTF-8 text"
        raise ApiError(400, f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.0', "
                            f"'msg': 'JSON decode error', 'ctx': {{'error': '{why}'}}}}", "body.0", "Bad Request")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths and methods: FastAPI's body, as vLLM's server gives it."""
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _cache_config(engine: ServedEngine) -> dict[str, str]:
    config = engine.scenario.engine
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(engine.replicas[0].scheduler.kv.num_blocks),
        "enable_prefix_caching": str(config.enable_prefix_caching),
    }
