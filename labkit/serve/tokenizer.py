"""A byte-level tokenizer, so `labkit serve` can take a prompt as a string.

TinyGPT's weights are random, so no tokenizer is more "right" than another; this one is
the simplest that round-trips: the UTF-8 bytes b of a string become token ids b + 1, and
id 0 stays the begin-of-sequence token. Decoding reads each id on its own: ids 1..256 as
the Latin-1 character of byte id - 1, and ids past 256, which have no byte, as U+FFFD.

Invariant: decode(encode(text)) == text for ASCII text, and encode never yields 0.
"""

from __future__ import annotations

BYTE_OFFSET = 1  # id 0 is the begin-of-sequence token
NO_BYTE = "\ufffd"


def encode(text: str) -> list[int]:
    return [byte + BYTE_OFFSET for byte in text.encode("utf-8")]


def decode_token(token_id: int) -> str:
    byte = token_id - BYTE_OFFSET
    return bytes([byte]).decode("latin-1") if 0 <= byte < 256 else NO_BYTE


def decode(token_ids: list[int]) -> str:
    return "".join(decode_token(token_id) for token_id in token_ids)
