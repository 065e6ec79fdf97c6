"""The limits that let a class share one `labkit serve`: who may send requests, how many
may wait (in all, and of one client's), how large and how slow a request may be, how many
connections may be open (in all, and from one address), and how long open requests get at
shutdown. By default one client may hold at most half the queue and half the connections. `labkit.serve.guards` and the online engine enforce
them; each has a `labkit serve` flag (README).

Standard library only, so `labkit serve --help` needs nothing else.

Invariant: a `Limits` holds only values the server can honour: whole numbers >= 1, timeouts
> 0, and an API key that is absent or not empty; anything else is a ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from labkit.checks import number, whole_number

MIB = 2**20


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None  # without it, anyone who reaches the port may use the API
    max_waiting: int = 512  # requests waiting for a slot; one more sheds the biggest holder's, or gets HTTP 503
    max_waiting_per_client: int = 256  # one client's waiting requests (a client: its user field, else its address)
    max_body_bytes: int = 4 * MIB  # a larger request body gets HTTP 413 before it is parsed
    max_connections: int = 1000  # open at once (fewer when the open-file limit is lower)
    max_connections_per_client: int = 500  # open at once from one address
    read_timeout: float = 10.0  # seconds to send a request's head, and then its body
    shutdown_grace: float = 5.0  # seconds open requests get to finish at shutdown

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"api_key = {self.api_key!r}: must be a non-empty string, or None for no key")
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type == "int":
                whole_number(field.name, value)
            if field.type == "float":
                number(field.name, value, unit="seconds")
