"""Byte-level tokenizer: one token per UTF-8 byte, plus BOS and EOS."""

from __future__ import annotations

import codecs

BYTE_VOCAB = 256
BOS = 256
EOS = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    """Token ids 0..255 are bytes; ``BOS`` starts every prompt; ``EOS`` ends generation."""

    vocab_size = VOCAB_SIZE
    bos = BOS
    eos = EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        """Tokens ``text`` takes in a prompt (without BOS)."""
        return len(text.encode("utf-8"))


class StreamDecoder:
    """Turns a stream of byte tokens into text, never splitting a multi-byte character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if token >= BYTE_VOCAB:
            return ""
        return self._decoder.decode(bytes((token,)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
