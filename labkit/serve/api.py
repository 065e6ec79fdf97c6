"""The OpenAI-compatible HTTP API in front of an `OnlineEngine`, following vLLM's conventions.

- `POST /v1/completions`: `prompt` as token ids, used as given (the model's sequence starts
  with them; no begin-of-sequence token is added, as in vLLM), or a string, tokenized as the
  served model's tokenizer does with its special tokens (a checkpoint's own, which adds a
  begin-of-sequence token only if configured to, or TinyGPT's byte-level one, which does;
  `labkit.serve.tokenizer`),
  `max_tokens`, `stream` (server-sent events, one token per chunk, each chunk's choice with
  its `token_ids` and the text it adds), `stream_options.include_usage`, and vLLM's
  `ignore_eos` and `min_tokens`. A request ends at the model's EOS (`finish_reason`
  "stop", the EOS its last token) unless `ignore_eos`, and never before `min_tokens`
  tokens; otherwise, and always for TinyGPT, which has no EOS, it gets exactly
  `max_tokens` tokens ("length").
  vLLM's `priority`, a JSON integer (default 0, lower is served first), goes with the
  request into the scheduler: `labkit serve --policy priority` orders its queue by it,
  other policies carry it along unread.
  vLLM's `allowed_token_ids` (a non-empty list of ids: the only ones it may sample, a
  mask on the logits) and `truncate_prompt_tokens` (N >= 1: the prompt's last N tokens
  are kept, as vLLM keeps them).
- `POST /v1/chat/completions`: `messages` (role and text, a string or text parts),
  `max_completion_tokens` or `max_tokens` (neither: as many as the context leaves), and the
  fields above but `prompt`; the conversation becomes a prompt through the tokenizer's
  `chat_prompt_ids` (a checkpoint's chat template, else plain text); answered as the chat API
  answers (`ChatCompletion`: a message, or deltas whose first names the assistant's role).
- `GET /v1/models` (each model with its `created` time and `max_model_len`), `GET /health`
  (503 until the engine's loop has reported that it runs, as vLLM's answers only once its
  engine core is up; once the loop has failed or stopped; and while it seems stuck in a
  step: `OnlineEngine.stuck`), and
  `GET /metrics` (Prometheus, `labkit.serve.prometheus`).

Requests are read strictly: each field has its JSON type (no "4" for 4, no true for 1),
`max_tokens` >= 1, 0 <= `min_tokens` <= `max_tokens`, `prompt` a string that UTF-8 can
encode or a non-empty list of whole numbers (an empty one is refused, as vLLM refuses it),
`seed` a whole
number, ignored (greedy decoding is deterministic). The engine decodes greedily, so each
sampling field in `GREEDY_ONLY` is refused unless absent, null, or at the value that means
greedy: temperature 0, top_p 1, top_k -1 or 0, min_p 0, n 1, best_of 1, logprobs and
prompt_logprobs null, echo false, stop and stop_token_ids [], suffix null, logit_bias {},
presence_penalty and frequency_penalty 0, repetition_penalty 1. Fields that would change
the output and that labkit does not implement (`NOT_IMPLEMENTED`) are refused the same way
unless absent, null or at the value that changes nothing: response_format {"type": "text"},
guided_json, guided_regex, guided_choice, guided_grammar and structured_outputs null,
bad_words [], use_beam_search false. `user` (OpenAI's end user,
a string) names the request's client, else the address it came from (`client_of`): a
policy that shares the engine between clients (`labkit.Fair`) reads it. Other fields that
OpenAI clients send are accepted and ignored.

Invariants: every error is an OpenAI-style body (`labkit.serve.guards.error`: `object:
"error"`, `message`, `type`, `param`, `code`) whose message names the field and at most a
short prefix of the value, and a refused request changes nothing: 400 for a bad request
(JSON that is malformed, not UTF-8 or nested too deep included), 404 for an unknown model
(as vLLM) or route, 405 for a wrong method, 503 when the engine cannot take the request now
(`Unavailable`); `labkit.serve.guards` adds 401, 408 and 413. A client that disconnects,
mid-stream or while it waits for a whole completion, has its request aborted, so its slot
and KV blocks return at the engine's next step. A request the engine aborts at shutdown, or
loses when the engine fails, ends with an error: in a stream an error chunk and then
`data: [DONE]`, otherwise a 503. The engine's loop (its thread or its process) starts with the app and stops with it.
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
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from labkit.serve import tokenizer as byte_tokenizer
from labkit.serve.guards import SHOWN_CHARACTERS, RequestGuard, error, error_body, shown
from labkit.serve.limits import Limits
from labkit.serve.online import OnlineEngine, Stream, Unavailable
from labkit.serve.tokenizer import TextStream



# Finish reasons of a request the engine could not finish, and what its client is told
INTERRUPTED = {"abort": "the server is shutting down", "error": "the engine stopped after an error",
               "shed": "the server's queue was full and your client held the most of it; try again later"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


def checked_prompt(prompt):
    """`prompt` if it is text UTF-8 can encode or a list of token ids; else a ValueError saying why."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as bad:
            raise ValueError(f"character {bad.start} is {prompt[bad.start]!r}, a lone surrogate, which is not "
                             "valid Unicode") from None
        return prompt
    if not isinstance(prompt, list):
        raise ValueError(f"must be a string or a list of token ids, not {shown(prompt)}")
    for position, token in enumerate(prompt):
        if type(token) is not int:
            raise ValueError(f"position {position} holds {shown(token)}, not a token id (a whole number)")
    return prompt


class GenerationRequest(BaseModel):
    """The fields labkit reads in both APIs, each of its own JSON type; the sampling fields
    (`GREEDY_ONLY`) and others that OpenAI clients send are kept as extras."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0  # a JSON integer: neither 1.5, "1" nor true
    user: str | None = None  # OpenAI's end user: the client `labkit.Fair` shares the engine between
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # vLLM's: the only ids it may sample
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep the prompt's last N tokens
    seed: int | None = None  # accepted and ignored: greedy decoding is deterministic


class CompletionRequest(GenerationRequest):
    prompt: list[int] | str
    max_tokens: int = Field(16, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def text_or_token_ids(cls, prompt):
        return checked_prompt(prompt)


class ChatMessage(BaseModel):
    """A message of a conversation: its role and its text (a string, or a list of text parts,
    joined; a part of any other type is refused by name)."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str = ""

    @field_validator("content", mode="before")
    @classmethod
    def text_of(cls, content):
        if content is None or isinstance(content, str):
            return content or ""
        if not isinstance(content, list):
            raise ValueError(f"must be a string or a list of text parts, not {shown(content)}")
        for position, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                raise ValueError(f"part {position} is {shown(part)}: labkit serve reads text parts only "
                                 f"({{\"type\": \"text\", \"text\": ...}}){f', not {kind!r}' if kind else ''}")
        return "".join(part["text"] for part in content)

    def as_dict(self) -> dict:
        return {"role": self.role, "content": self.content}


class ChatRequest(GenerationRequest):
    """A chat completion's request: the conversation, and at most `max_completion_tokens` (or
    OpenAI's older `max_tokens`) tokens; without either, as many as the model's context leaves."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _is_number(value, target: float) -> bool:
    return type(value) in (int, float) and value == target


# The sampling fields of OpenAI's completions API, and vLLM's: what each may be besides null
# (None: only null), and the test of a value that means greedy decoding
GREEDY_ONLY = {
    "temperature": ("0", lambda value: _is_number(value, 0)),
    "top_p": ("1", lambda value: _is_number(value, 1)),
    "top_k": ("-1 or 0", lambda value: type(value) is int and value in (-1, 0)),
    "min_p": ("0", lambda value: _is_number(value, 0)),
    "n": ("1", lambda value: type(value) is int and value == 1),
    "best_of": ("1", lambda value: type(value) is int and value == 1),
    "logprobs": (None, lambda value: False),
    "prompt_logprobs": (None, lambda value: False),
    "echo": ("false", lambda value: value is False),
    "stop": ("[]", lambda value: value == []),
    "stop_token_ids": ("[]", lambda value: value == []),
    "suffix": (None, lambda value: False),
    "logit_bias": ("{}", lambda value: value == {}),
    "presence_penalty": ("0", lambda value: _is_number(value, 0)),
    "frequency_penalty": ("0", lambda value: _is_number(value, 0)),
    "repetition_penalty": ("1", lambda value: _is_number(value, 1)),
}

# Fields that would change the output and that labkit does not implement: what each may be
# besides null, and the test of a value that changes nothing
NOT_IMPLEMENTED = {
    "response_format": ('{"type": "text"}', lambda value: value == {"type": "text"}),
    "guided_json": (None, lambda value: False),
    "guided_regex": (None, lambda value: False),
    "guided_choice": (None, lambda value: False),
    "guided_grammar": (None, lambda value: False),
    "structured_outputs": (None, lambda value: False),
    "bad_words": ("[]", lambda value: value == []),
    "use_beam_search": ("false", lambda value: value is False),
}


def unsupported_field(body: CompletionRequest) -> tuple[str, str] | None:
    """(field, message) for the first field that would change the output and that labkit cannot
    honour: a sampling field greedy decoding cannot, or one it does not implement; None if none."""
    for table, why in ((GREEDY_ONLY, "labkit serve decodes greedily"), (NOT_IMPLEMENTED, "labkit serve does not "
                                                                         "implement it")):
        for field, (default, changes_nothing) in table.items():
            value = (body.model_extra or {}).get(field)
            if value is not None and not changes_nothing(value):
                allowed = "null" if default is None else f"{default} or null"
                return field, f"{field} = {shown(value)}: not supported, {why}; leave it out or send {allowed}"
    return None


def unparsable(cause: BaseException) -> str:
    """Why FastAPI could not read a body as JSON."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid JSON: it is not UTF-8 ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON: it is nested too deeply"
    return f"the body is not valid JSON ({type(cause).__name__})"


def client_of(body: CompletionRequest, request: Request) -> str:
    """Who sent the request, as a policy that shares the engine between clients counts them:
    its `user` field (OpenAI's end user), else the address it came from."""
    if body.user:
        return f"user {body.user}"
    return f"address {request.client.host if request.client else 'unknown'}"


async def client_leaves(request: Request) -> None:
    """Returns once the client has gone away: once the body is read, uvicorn's next message is
    the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(online: OnlineEngine, model_name: str, tokenizer=byte_tokenizer, limits: Limits = Limits()) -> FastAPI:
    """The API serving `online` under `model_name`, taking and giving text through `tokenizer`
    (`encode(text)`, `decode(token_ids)`), behind `limits`' API key and body limits; the
    engine's loop runs while the app does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        online.start_thread()
        yield
        await asyncio.to_thread(online.stop)  # `guards.GracefulServer` has stopped it already, and said so

    app = FastAPI(title="labkit serve", lifespan=lifespan)
    started = int(time.time())  # the model's `created`: when this server began serving it
    app.add_middleware(RequestGuard, limits=limits)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}", param="body")
        where = ".".join(str(part) for part in first.get("loc", ())[1:])[:SHOWN_CHARACTERS] or "body"
        message = first.get("msg", "malformed request body")
        if first.get("type") == "value_error":  # checked_prompt's message says what it got
            return error(f"{where}: {message.removeprefix('Value error, ')}", param=where)
        return error(f"{where}: {message} (got {shown(first.get('input'))})", param=where)

    @app.exception_handler(HTTPException)
    async def http_problem(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
            return error(unparsable(exc.__cause__), param="body")
        return error(f"{request.method} {shown(request.scope['path'])}: {exc.detail}", exc.status_code,
                     headers=exc.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return error(f"internal error ({type(exc).__name__}); the server's log has the details", 500)

    @app.get("/health")
    async def health() -> Response:
        if online.failure is not None:
            return error(f"the engine stopped after an error: {shown(online.failure)}", 503)
        if not online.is_running():
            return error("the engine is not running", 503)
        if online.last_report is None:
            return error("the engine is starting", 503)
        if stuck := online.stuck():
            silent, usual = stuck
            steps = f"its steps take {usual * 1000:.0f} ms" if usual else "no step has ended yet"
            return error(f"the engine's loop has been silent for {silent:.1f} s with requests in flight ({steps}): "
                         "a step may be stuck", 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "labkit", "max_model_len": online.engine.config.max_seq_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(online.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if refused := refusal(body):
            return refused
        prompt = body.prompt
        if isinstance(prompt, str):  # in a worker thread: the event loop streams on meanwhile
            prompt = await asyncio.to_thread(tokenizer.prompt_ids, prompt)
        return await generate(body, request, prompt, body.max_tokens, Completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if refused := refusal(body):
            return refused
        messages = [message.as_dict() for message in body.messages]
        prompt = await asyncio.to_thread(tokenizer.chat_prompt_ids, messages)
        return await generate(body, request, prompt, body.max_completion_tokens or body.max_tokens, ChatCompletion)

    def refusal(body: GenerationRequest) -> JSONResponse | None:
        """The error for a request for another model, or with a field labkit cannot honour."""
        if body.model != model_name:
            return error(f"model = {shown(body.model)}: this server serves {model_name!r}", 404, param="model")
        if unsupported := unsupported_field(body):
            field, message = unsupported
            return error(message, param=field)
        return None

    async def generate(body: GenerationRequest, request: Request, prompt: list[int], max_tokens: int | None,
                       kind: type[Completion]):
        """Submit the request and answer it, streamed or whole; `max_tokens` None: as many as the
        model's context leaves."""
        if body.truncate_prompt_tokens is not None:
            prompt = prompt[-body.truncate_prompt_tokens :]  # its last N tokens, as vLLM keeps them
        max_tokens = max_tokens or max(1, online.engine.config.max_seq_len - len(prompt))
        if body.min_tokens > max_tokens:
            return error(f"min_tokens = {body.min_tokens} exceeds max_tokens = {max_tokens}", param="min_tokens")
        try:
            request_id, stream = online.submit(prompt, max_tokens, body.priority, ignore_eos=body.ignore_eos,
                                               min_tokens=body.min_tokens, client=client_of(body, request),
                                               allowed_token_ids=body.allowed_token_ids or ())
        except Unavailable as problem:
            return error(str(problem), 503)
        except ValueError as problem:
            return error(str(problem))
        completion = kind(model_name, len(prompt), tokenizer, request_id, stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(completion.events(online, include_usage), media_type="text/event-stream")
        return await completion.whole(online, request)

    return app


class Completion:
    """One request's tokens, from the engine's loop to the client's stream or answer, as the
    completions API gives them."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def __init__(self, model_name: str, num_prompt_tokens: int, tokenizer, request_id: int, stream: Stream):
        self.id = f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.model_name, self.num_prompt_tokens = model_name, num_prompt_tokens
        self.request_id, self.stream = request_id, stream
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    async def next_tokens(self):
        """Yield tokens as they come on the engine's stream, until the request finishes."""
        while isinstance(item := await self.stream.get(), int):
            self.tokens.append(item)
            yield item
        self.finish_reason = item

    async def events(self, online: OnlineEngine, include_usage: bool):
        """Server-sent events: a chunk per token, the usage if asked, then [DONE]. A client that
        leaves mid-stream aborts the request."""
        try:
            text = TextStream(self.tokenizer)
            async for token in self.next_tokens():
                yield self._event(self._chunk_choice([token], text.add(token), finish_reason=None))
            if self.finish_reason in INTERRUPTED:
                yield f"data: {json.dumps({'error': error_body(self._interruption(), 503)})}\n\n"
            else:
                yield self._event(self._chunk_choice([], text.rest(), finish_reason=self.finish_reason))
                if include_usage:
                    yield self._event({"choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            if self.finish_reason is None:
                online.abort(self.request_id)

    async def whole(self, online: OnlineEngine, request: Request) -> dict | Response:
        """The completion once it is done. A client that leaves first aborts the request, as a
        stream's does: the wait watches for its disconnect."""
        gathering = asyncio.ensure_future(self._gather())
        leaving = asyncio.ensure_future(client_leaves(request))
        try:
            await asyncio.wait((gathering, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gathering.cancel()
            leaving.cancel()
            if self.finish_reason is None:
                online.abort(self.request_id)
        if self.finish_reason is None:  # the client left: nobody reads this
            return Response(status_code=499)
        if self.finish_reason in INTERRUPTED:
            return error(self._interruption(), 503)
        choice = self._choice(self.tokens, self.tokenizer.decode(self.tokens), self.finish_reason)
        return {**self._head(self.OBJECT), "choices": [choice], "usage": self._usage()}

    async def _gather(self) -> None:
        async for _ in self.next_tokens():
            pass

    def _interruption(self) -> str:
        return f"{INTERRUPTED[self.finish_reason]}: the request ended after {len(self.tokens)} tokens"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def _choice(self, tokens: list[int], text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "token_ids": tokens, "finish_reason": finish_reason}

    def _chunk_choice(self, tokens: list[int], text: str, finish_reason: str | None) -> dict:
        return self._choice(tokens, text, finish_reason)

    def _event(self, payload: dict) -> str:
        if "usage" not in payload:
            payload = {**self._head(self.CHUNK_OBJECT), "choices": [payload]}
        else:
            payload = {**self._head(self.CHUNK_OBJECT), **payload}
        return f"data: {json.dumps(payload)}\n\n"

    def _usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.num_prompt_tokens + len(self.tokens)}


class ChatCompletion(Completion):
    """The same, as the chat API gives it: the assistant's message whole, or its text in deltas,
    the first saying whose turn it is."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _choice(self, tokens: list[int], text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": tokens,
                "finish_reason": finish_reason}

    role_sent = False  # whether a chunk has said whose message it is

    def _chunk_choice(self, tokens: list[int], text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if self.role_sent else {"role": "assistant", "content": text}
        self.role_sent = True
        return {"index": 0, "delta": delta, "token_ids": tokens, "finish_reason": finish_reason}
