"""The OpenAI-compatible HTTP API in front of an `OnlineEngine`, following vLLM's conventions.

- `POST /v1/completions`: `prompt` as token ids or a string (`labkit.serve.tokenizer`),
  `max_tokens`, `stream` (server-sent events, one token per chunk, each chunk's choice with
  its `token_ids`), `stream_options.include_usage`, and vLLM's `ignore_eos` and
  `min_tokens`. labkit's engine never stops early: every request gets exactly
  `max_tokens` tokens, so `ignore_eos` is always in effect and `min_tokens` is met.
  vLLM's `priority`, a JSON integer (default 0, lower is served first), goes with the
  request into the scheduler: `labkit serve --policy priority` orders its queue by it,
  other policies carry it along unread.
- `GET /v1/models`, `GET /health`, and `GET /metrics` (Prometheus, `labkit.serve.metrics`).

Invariants: a bad request gets HTTP 400 with an OpenAI-style error body (`object: "error"`,
a message naming the field and value) and changes nothing; a client that disconnects
mid-stream has its request aborted, so its slot and KV blocks return at the engine's next
step; the engine's thread starts with the app and stops with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from labkit.serve import tokenizer
from labkit.serve.online import Client, OnlineEngine

FINISHED = object()  # the end of a request's token queue


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The fields labkit reads; others that OpenAI clients send are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    prompt: list[int] | str
    max_tokens: int = Field(16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = Field(0, strict=True)  # a JSON integer: neither 1.5, "1" nor true


def error(message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": param, "code": status},
                        status_code=status)


def make_app(online: OnlineEngine, model_name: str) -> FastAPI:
    """The API serving `online` under `model_name`; the engine's thread runs while the app does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        online.start_thread()
        yield
        num_aborted = await asyncio.to_thread(online.stop)
        print(f"labkit serve: stopped after {len(online.step_sizes)} steps; {num_aborted} requests aborted", flush=True)

    app = FastAPI(title="labkit serve", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}", param="body")
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
        return error(f"{where}: {first.get('msg', 'malformed request body')} (got {first.get('input')!r})",
                     param=where)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "labkit",
                                            "max_model_len": online.engine.config.max_seq_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(online.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.model != model_name:
            return error(f"model = {body.model!r}: this server serves {model_name!r}", param="model")
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        if body.min_tokens > body.max_tokens:
            return error(f"min_tokens = {body.min_tokens} exceeds max_tokens = {body.max_tokens}", param="min_tokens")
        completion = Completion(model_name, len(prompt))
        try:
            completion.request_id = online.submit(prompt, body.max_tokens, completion.client(), body.priority)
        except (ValueError, RuntimeError) as problem:
            return error(str(problem))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(completion.events(online, include_usage), media_type="text/event-stream")
        return await completion.whole(online)

    return app


class Completion:
    """One request's tokens, from the engine's thread to the client's stream or answer."""

    def __init__(self, model_name: str, num_prompt_tokens: int):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name, self.num_prompt_tokens = model_name, num_prompt_tokens
        self.request_id = -1
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    def client(self) -> Client:
        """Callbacks for the engine's thread: each hands its item to this request's queue."""
        put = self.queue.put_nowait
        return Client(on_token=lambda token: self.loop.call_soon_threadsafe(put, token),
                      on_finish=lambda reason: self.loop.call_soon_threadsafe(put, (FINISHED, reason)))

    async def next_tokens(self):
        """Yield tokens as they come, until the request finishes."""
        while True:
            item = await self.queue.get()
            if isinstance(item, tuple) and item[0] is FINISHED:
                self.finish_reason = item[1]
                return
            self.tokens.append(item)
            yield item

    async def events(self, online: OnlineEngine, include_usage: bool):
        """Server-sent events: a chunk per token, the usage if asked, then [DONE]. A client that
        leaves mid-stream aborts the request."""
        try:
            async for token in self.next_tokens():
                yield self._event(self._choice([token], finish_reason=None))
            yield self._event(self._choice([], finish_reason=self.finish_reason))
            if include_usage:
                yield self._event({"choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            if self.finish_reason is None:
                online.abort(self.request_id)

    async def whole(self, online: OnlineEngine) -> dict:
        try:
            async for _ in self.next_tokens():
                pass
        finally:
            if self.finish_reason is None:
                online.abort(self.request_id)
        return {**self._head(), "choices": [self._choice(self.tokens, self.finish_reason)], "usage": self._usage()}

    def _head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name}

    def _choice(self, tokens: list[int], finish_reason: str | None) -> dict:
        return {"index": 0, "text": tokenizer.decode(tokens), "token_ids": tokens, "finish_reason": finish_reason}

    def _event(self, payload: dict) -> str:
        if "usage" not in payload:
            payload = {**self._head(), "choices": [payload]}
        else:
            payload = {**self._head(), **payload}
        return f"data: {json.dumps(payload)}\n\n"

    def _usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.num_prompt_tokens + len(self.tokens)}
