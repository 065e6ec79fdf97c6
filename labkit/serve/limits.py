"""The limits that let a class share one `labkit serve`: who may send requests, how many
may wait (in all, and of one client's), how large and how slow a request may be, how many
connections may be open (in all, and from one address), and how long open requests get at
shutdown. By default one address may hold at most half the connections, a full queue sheds
the newest request of the client holding the most of it (`OnlineEngine`), and a body may
be as large as the model can use (`Limits.for_model`).
`labkit.serve.guards` and the online engine enforce them; each has a `labkit serve` flag
(README).

Standard library only, so `labkit serve --help` needs nothing else.

Invariant: a `Limits` holds only values the server can honour: whole numbers >= 1, timeouts
> 0, and an API key that is absent or not empty; anything else is a ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from labkit.checks import number, whole_number

MIB = 2**20
BODY_BASE_BYTES, BODY_BYTES_PER_TOKEN = 16 * 1024, 16  # a body the model can use: see `Limits.for_model`


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None  # without it, anyone who reaches the port may use the API
    max_waiting: int = 512  # requests waiting for a slot; one more sheds the biggest holder's, or gets HTTP 503
    max_waiting_per_client: int | None = None  # one client's waiting requests (its user field, else its address)
    max_body_bytes: int | None = None  # a larger body gets HTTP 413 before it is parsed; None: what the model can use
    max_connections: int = 1000  # open at once (fewer when the open-file limit is lower)
    max_connections_per_client: int = 500  # open at once from one address
    read_timeout: float = 10.0  # seconds to send a request's head, and then its body
    shutdown_grace: float = 5.0  # seconds open requests get to finish at shutdown

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"api_key = {self.api_key!r}: must be a non-empty string, or None for no key")
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", "int | None"):
                whole_number(field.name, value, or_none=field.type == "int | None")
            if field.type == "float":
                number(field.name, value, unit="seconds")

    def for_model(self, max_seq_len: int, vocab_size: int) -> Limits:
        """These limits, the body's made to follow the model when it was left to it (None): room
        for the other fields (BODY_BASE_BYTES), and for a prompt and `allowed_token_ids` as long
        as the model takes, each token or id at BODY_BYTES_PER_TOKEN (an id and its comma, or
        text escaped as JSON: a non-ASCII character is six bytes, \\uXXXX)."""
        if self.max_body_bytes is not None:
            return self
        return replace(self, max_body_bytes=BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * (max_seq_len + vocab_size))
