"""What the engine needs of a tokenizer, and the byte-level one of the reference model:
one token per UTF-8 byte, plus BOS and EOS."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

BYTE_VOCAB = 256
BOS = 256
EOS = 257
VOCAB_SIZE = 258


class StreamDecoder:
    """Turns a stream of tokens into text, never splitting a multi-byte character."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._bytes[token])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: frozenset[int]

    @property
    def token_bytes(self) -> Sequence[bytes]:
        """Each token's bytes (none for control tokens)."""

    def encode(self, text: str) -> list[int]:
        """A prompt's tokens, BOS included where the model expects one."""

    def count(self, text: str) -> int:
        """Tokens ``text`` takes in a prompt (without BOS)."""

    def decode(self, ids: list[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def output_mask(self) -> npt.NDArray[np.bool_]:
        """[vocab]: which tokens a generation may produce (EOS included)."""


class ByteTokenizer:
    """Token ids 0..255 are bytes; ``BOS`` starts every prompt; ``EOS`` ends generation."""

    vocab_size = VOCAB_SIZE
    bos = BOS
    eos = EOS
    eos_ids = frozenset({EOS})
    token_bytes = [bytes((i,)) for i in range(BYTE_VOCAB)] + [b"", b""]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.token_bytes)

    def output_mask(self) -> npt.NDArray[np.bool_]:
        """Printable ASCII and newline, so every stream of this untrained model is valid
        UTF-8 text."""
        allowed = np.zeros(VOCAB_SIZE, dtype=bool)
        allowed[32:127] = True
        allowed[10] = True
        allowed[EOS] = True
        return allowed
