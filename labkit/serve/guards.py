"""What stands between a shared `labkit serve` and its clients: the API key, limits on what
a request may send and how slowly, on open connections and on the log, and a shutdown that
ends open requests with an error instead of a cut connection. `labkit.serve.limits.Limits`
holds the numbers.

Invariants:

- every refusal is an OpenAI-style error body (`error`), and no error echoes more than a
  short prefix of what the client sent (`shown`);
- with an API key, every path but /health and /metrics needs `Authorization: Bearer KEY`
  (401 otherwise), checked before the body is read. vLLM's `--api-key` checks the paths that
  begin with /v1 and so leaves /health, /metrics, /version and /ping open; labkit protects
  every path but the two it has, so no path can slip past in another spelling;
- a request body is counted as it arrives and refused with 413 as soon as it passes
  `max_body_bytes` (at once when its Content-Length says it will), before anything parses
  it; it must arrive within `read_timeout` of the request's head, or the answer is 408;
- a connection must send a whole request head within `read_timeout` of opening or of its
  previous response, or it is closed; an idle keep-alive connection closes after
  `KEEP_ALIVE_SECONDS` (uvicorn's `timeout_keep_alive`);
- at most `max_connections` connections are open, fewer when the open-file limit is lower
  (less `RESERVED_FILES` for the process's own files), and at most
  `max_connections_per_client` from one address: one more is closed as soon as it is
  accepted. uvicorn's `limit_concurrency` is not used: it answers 503 only once a request's
  head has arrived, so sockets that never send one would still use up file descriptors;
- every 503 carries `Retry-After` (RETRY_AFTER_S seconds);
- a message the server logs again and again (a refused connection, an accept that failed
  for want of file descriptors, a malformed request, an application error) is logged once
  a minute at most, saying how many like it were dropped; asyncio's error for an accept()
  retried after the listening socket closed (a shutdown within a second of running out of
  file descriptors) is not logged, since nothing failed;
- on shutdown (SIGINT, SIGTERM) no new request is taken, requests in flight get
  `shutdown_grace` seconds to finish, then the engine aborts the rest: a stream ends with
  an error chunk and `data: [DONE]`, a whole completion gets a 503, and the log line counts
  them. A second SIGINT skips what is left of the grace period.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import reprlib
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from labkit.serve.limits import Limits

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
RETRY_AFTER_S = 5  # a 503's Retry-After: a fixed guess, since the server cannot know when a slot will free
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key, as in vLLM
SHOWN_CHARACTERS = 60  # the most of a client's input an error message repeats
KEEP_ALIVE_SECONDS = 5.0  # uvicorn's default
RESERVED_FILES = 64  # file descriptors kept for the process's own files (it uses about 10)
FLUSH_SECONDS = 1.0  # at shutdown, how long aborted requests get to send their error
LOG_REPEAT_SECONDS = 60.0  # a repeated log message is let through at most this often
QUIETED_LOGGERS = ("uvicorn.error", "asyncio")


def shown(value: object) -> str:
    """`repr(value)`, cut to SHOWN_CHARACTERS: an error names a value without echoing a large input."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = SHOWN_CHARACTERS
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    short.maxlevel = 3
    text = short.repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."


def error_body(message: str, status: int = 400, kind: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object, as vLLM writes it."""
    return {"object": "error", "message": message, "type": kind or ERROR_TYPES.get(status, "Error"),
            "param": param, "code": status}


def error(message: str, status: int = 400, kind: str | None = None, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error; a 503 says when to try again (`Retry-After`), so clients that honour
    it (the openai client does) back off instead of retrying at once."""
    if status == 503:
        headers = {"retry-after": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(message, status, kind, param), status_code=status, headers=headers)


# The API key and the body: an ASGI middleware


class Refused(Exception):
    """A request turned away before the app sees it, with the response that says why."""

    def __init__(self, message: str, status: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.response = error(message, status, headers={"connection": "close", **(headers or {})})


class ClientLeft(Exception):
    """The client went away while its request was being read."""


class RequestGuard:
    """ASGI middleware: checks the API key, then reads the whole body within the size and time
    limits, and only then hands the request, body and all, to the app."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits
        self.key_digest = None if limits.api_key is None else _digest(limits.api_key.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_key(scope)
            body = await self._read_body(scope, receive)
        except Refused as refusal:
            return await refusal.response(scope, receive, send)
        except ClientLeft:
            return None
        return await self.app(scope, _replaying(body, receive), send)

    def _check_key(self, scope) -> None:
        if self.key_digest is None or scope["path"] in OPEN_PATHS:
            return
        scheme, _, key = _header(scope, b"authorization").partition(b" ")
        if scheme.lower() != b"bearer" or not key:
            raise Refused("this server needs an API key: send the header 'Authorization: Bearer KEY'", 401,
                          {"www-authenticate": "Bearer"})
        if not secrets.compare_digest(_digest(key), self.key_digest):
            raise Refused("the API key is not valid", 401, {"www-authenticate": "Bearer"})

    async def _read_body(self, scope, receive) -> bytes:
        limit = self.limits.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > limit:
            raise Refused(f"the body is {int(declared)} bytes; this server takes at most {limit}", 413)
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientLeft
                    body += message.get("body", b"")
                    if len(body) > limit:
                        raise Refused(f"the body is more than {limit} bytes, the most this server takes", 413)
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            raise Refused(f"the body did not arrive within {self.limits.read_timeout:g} s", 408) from None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()  # equal lengths, so compare_digest takes the same time for any key


def _header(scope, name: bytes) -> bytes:
    return next((value for key, value in scope["headers"] if key == name), b"")


def _replaying(body: bytes, receive):
    """A `receive` that gives the app the body already read, then the connection's own messages
    (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


# Connections: uvicorn's HTTP/1.1 protocol with a head timeout and a cap


def max_open_connections(max_connections: int) -> int:
    """`max_connections`, lowered to what the open-file limit allows; a ValueError when it allows none."""
    soft = open_file_limit()
    if soft is None:
        return max_connections
    if soft - RESERVED_FILES < 1:
        raise ValueError(f"the open-file limit ({soft}) leaves no file descriptors for connections: "
                         f"raise it (ulimit -n) above {RESERVED_FILES}")
    return min(max_connections, soft - RESERVED_FILES)


def open_file_limit() -> int | None:
    """The process's soft limit on open files; None where the platform has none to read."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard one, as vLLM does at start; where the
    system refuses, the soft limit stays and `max_open_connections` follows it."""
    try:
        import resource
    except ImportError:  # Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # macOS caps an unlimited hard limit lower
            pass


def guarded_protocol(max_open: int, read_timeout: float, max_per_address: int | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that exceeds `max_open`, or `max_per_address`
    from its address, as soon as it is made, and one that has not sent a whole request head
    `read_timeout` seconds after it opened or after its last response."""

    class GuardedH11Protocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_open:
                self.logger.warning("refused a connection: %d are open, the most this server keeps", max_open)
                self.transport.close()
            elif max_per_address is not None and self._num_from_address() > max_per_address:
                self.logger.warning("refused a connection: %d are open from one address, the most this server "
                                    "keeps", max_per_address)
                self.transport.close()
            else:
                self._await_head()

        def _num_from_address(self) -> int:
            host = self.client[0] if self.client else None
            return sum(1 for other in self.connections if other.client and other.client[0] == host)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.head_timer = self.loop.call_later(read_timeout, self._close_if_headless)

        def _close_if_headless(self) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request under way
                self.transport.close()

    return GuardedH11Protocol


# The log


class QuietRepeats(logging.Filter):
    """Lets a message (keyed by its logger and the first line of its template) through the first
    time, then at most once every `interval` seconds, saying how many like it were dropped."""

    def __init__(self, interval: float = LOG_REPEAT_SECONDS):
        super().__init__()
        self.interval = interval
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last let through, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg).split("\n", 1)[0])
        last, dropped = self.seen.get(key, (None, 0))
        if last is not None and record.created - last < self.interval:
            self.seen[key] = (last, dropped + 1)
            return False
        self.seen[key] = (record.created, 0)
        if dropped:
            record.msg = f"{record.msg} [{dropped} more like it in the last {record.created - last:.0f} s]"
        return True


class ClosedListenerRetries(logging.Filter):
    """Drops asyncio's error for a retried accept() that finds the listening socket closed.

    When accept() fails for want of file descriptors, asyncio stops listening and tries again
    a second later (`ACCEPT_RETRY_DELAY`). A shutdown within that second closes the socket, and
    the retry then logs "ValueError: Invalid file descriptor: -1": nothing is lost, since the
    server has stopped listening on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        retried_accept = str(record.msg).startswith("Exception in callback BaseSelectorEventLoop._start_serving")
        return not (retried_accept and record.exc_info and record.exc_info[0] is ValueError)


@contextmanager
def quiet_log(names: tuple[str, ...] = QUIETED_LOGGERS) -> Iterator[QuietRepeats]:
    """A `QuietRepeats` on these loggers, and `ClosedListenerRetries` on asyncio's, while the block runs."""
    quiet, loggers = QuietRepeats(), [logging.getLogger(name) for name in names]
    closed_listener, asyncio_log = ClosedListenerRetries(), logging.getLogger("asyncio")
    asyncio_log.addFilter(closed_listener)
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        asyncio_log.removeFilter(closed_listener)


# The server: uvicorn's, with the guards and labkit's shutdown


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first gives requests in flight the grace period, then
    has the engine abort the rest so that each ends with an error rather than a cut."""

    def __init__(self, config: uvicorn.Config, online, grace: float):
        super().__init__(config)
        self.online, self.grace = online, grace

    async def serve(self, sockets=None) -> None:
        with quiet_log():
            await super().serve(sockets)

    async def shutdown(self, sockets=None) -> None:
        self.online.close()
        for server in self.servers:
            server.close()
        await self._wait_for(lambda: not self.online.num_in_flight(), self.grace, until_forced=True)
        num_cut = await asyncio.to_thread(self.online.stop)
        await self._wait_for(lambda: not self.server_state.tasks, FLUSH_SECONDS)
        print(f"labkit serve: stopped after {len(self.online.step_sizes)} steps; {num_cut} requests cut short "
              f"at shutdown", flush=True)
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn then skips the app's shutdown; labkit's cannot hang: the engine has stopped
            await self.lifespan.shutdown()

    async def _wait_for(self, done: Callable[[], bool], seconds: float, until_forced: bool = False) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while not done() and asyncio.get_running_loop().time() < deadline and not (until_forced and self.force_exit):
            await asyncio.sleep(0.05)


def make_server(app, online, limits: Limits, host: str = "127.0.0.1", port: int = 8000) -> GracefulServer:
    """The uvicorn server for `app` (from `make_app`) and its `online` engine, under `limits`."""
    protocol = guarded_protocol(max_open_connections(limits.max_connections), limits.read_timeout,
                                limits.max_connections_per_client)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=protocol,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS, timeout_graceful_shutdown=FLUSH_SECONDS)
    return GracefulServer(config, online, limits.shutdown_grace)
