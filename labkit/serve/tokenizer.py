"""Tokenizers, so `labkit serve` can take a prompt as a string and answer with text.

TinyGPT's weights are random, so no tokenizer is more "right" than another; this module's
own (`encode`, `decode`) is the simplest that round-trips: the UTF-8 bytes b of a string
become token ids b + 1, and id 0 stays the begin-of-sequence token. Decoding reads each id
on its own: ids 1..256 as the Latin-1 character of byte id - 1, and ids past 256, which have
no byte, as U+FFFD. A checkpoint brings its own tokenizer (`ModelTokenizer`). The API takes
either: anything with `encode(text)` and `decode(token_ids)`.

A text prompt becomes `prompt_ids(text)`, the ids the model's sequence starts with, as the
tokenizer makes them with its special tokens, as vLLM and `transformers serve` tokenize: a
checkpoint's tokenizer adds a begin-of-sequence token only if it is configured to; this
module's always puts id 0 first. Token-id prompts are used as given. A conversation (the chat
API's messages) becomes `chat_prompt_ids(messages)`: through a checkpoint's chat template,
or, for a model without one (TinyGPT), as plain text, each message after its role.

Invariants: decode(encode(text)) == text for ASCII text, and encode never yields 0; neither
tokenizer's `encode` adds a begin-of-sequence token (`prompt_ids` does what the tokenizer says); for
a byte-level tokenizer (this module's, Llama 3's) the pieces a `TextStream` gives add up to
the decoded text of all its tokens.
"""

from __future__ import annotations

BYTE_OFFSET = 1  # id 0 is the begin-of-sequence token
BOS_ID = 0
NO_BYTE = "\ufffd"


def encode(text: str) -> list[int]:
    return [byte + BYTE_OFFSET for byte in text.encode("utf-8")]


def prompt_ids(text: str) -> list[int]:
    """The sequence a text prompt starts: the begin-of-sequence token 0, then its bytes."""
    return [BOS_ID, *encode(text)]


def plain_chat(messages: list[dict]) -> str:
    """A conversation as plain text, for a model with no chat template: each message on a line
    of its own after its role, then the assistant's turn to answer."""
    return "".join(f"{message['role']}: {message['content']}\n" for message in messages) + "assistant: "


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    """The sequence a conversation starts (TinyGPT has no chat template: `plain_chat`)."""
    return prompt_ids(plain_chat(messages))


def decode_token(token_id: int) -> str:
    byte = token_id - BYTE_OFFSET
    return bytes([byte]).decode("latin-1") if 0 <= byte < 256 else NO_BYTE


def decode(token_ids: list[int]) -> str:
    return "".join(decode_token(token_id) for token_id in token_ids)


class ModelTokenizer:
    """A checkpoint's own tokenizer (a transformers one), as the API uses it: text to ids without
    special tokens, and ids to text without them, as `transformers serve` decodes."""

    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, text: str) -> list[int]:
        """The ids the tokenizer makes of a prompt, its special tokens included: a
        begin-of-sequence token only if it is configured to add one."""
        return self.hf_tokenizer.encode(text)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids of a conversation, through the checkpoint's chat template with the assistant's
        turn opened, as vLLM makes them; `plain_chat` through `prompt_ids` if it has none."""
        if not getattr(self.hf_tokenizer, "chat_template", None):
            return self.prompt_ids(plain_chat(messages))
        return list(self.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.hf_tokenizer.decode(token_ids, skip_special_tokens=True)


class TextStream:
    """The text of a growing list of token ids, piece by piece, as a stream sends it, decoded in a
    short window as vLLM's incremental detokenizer does: each piece is what the tokens since the
    last piece add to the text of the token before them (a token alone may decode differently,
    e.g. a word's leading space). A piece that ends in U+FFFD, a character whose bytes have not
    all come, or that adds nothing, waits for the next token, or for `rest`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.context_start = 0  # the window: the last token sent, as context ...
        self.unsent_start = 0  # ... then the tokens not sent yet

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        piece = self._unsent()
        if not piece or piece.endswith(NO_BYTE):
            return ""
        self.context_start, self.unsent_start = self.unsent_start, len(self.token_ids)
        return piece

    def rest(self) -> str:
        """The text not sent yet (what waited for more bytes)."""
        return self._unsent()

    def _unsent(self) -> str:
        context = self.tokenizer.decode(self.token_ids[self.context_start : self.unsent_start])
        return self.tokenizer.decode(self.token_ids[self.context_start :])[len(context) :]
