"""Byte-level BPE (GPT-2 style) tokenizers, built with Hugging Face ``tokenizers`` from a
model file's vocabulary and merges, and streamed back to text a token at a time.

A byte-level token stands for bytes, each drawn as one printable character (GPT-2's
byte-to-unicode table); a multi-byte UTF-8 character may span tokens, so streamed text is
decoded from the tokens' bytes, holding a split character until it is whole.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from refengine.tokenizer import StreamDecoder

CONTROL = 3  # GGUF token type of control tokens (<|im_start|>, <|im_end|>, ...)


def byte_level_bpe(tokens: list[str], merges: list[str], special_ids: tuple[int, ...]) -> str:
    """The ``tokenizers`` definition (JSON) of a byte-level BPE with these tokens (id =
    position) and merges ("left right", by priority). Digits are split one by one before
    BPE, as the SmolLM family (llama.cpp's ``smollm`` pre-tokenizer) does; control tokens
    are matched whole in text."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [_pair(merge) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special_ids]
    )
    text: str = tokenizer.to_str()
    return text


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


class BPETokenizer:
    """The engine's tokenizer for a pretrained model: ids as the model file numbers them."""

    def __init__(
        self,
        definition: str,
        *,
        eos_id: int,
        bos_id: int | None,
        add_bos: bool,
        special_ids: tuple[int, ...],
    ) -> None:
        self._tokenizer = Tokenizer.from_str(definition)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_ids = frozenset({eos_id})
        self._bos = [bos_id] if add_bos and bos_id is not None else []
        self._special = frozenset(special_ids)
        self.token_bytes = self._token_bytes()

    def encode(self, text: str) -> list[int]:
        """The prompt's tokens; control tokens written in the text (a chat template's
        ``<|im_start|>``) are those tokens."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [*self._bos, *ids]

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token: int | None) -> str:
        """A token's own text (a control token's name); "" for None."""
        text = self._tokenizer.id_to_token(token) if token is not None else None
        return text or ""

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.token_bytes)

    def output_mask(self) -> npt.NDArray[np.bool_]:
        """Tokens a generation may produce: all but the control tokens, EOS aside."""
        allowed = np.ones(self.vocab_size, dtype=bool)
        allowed[list(self._special - self.eos_ids)] = False
        return allowed

    def _token_bytes(self) -> list[bytes]:
        """Each id's bytes; control tokens have none (they are never shown)."""
        table = _byte_of_char()
        out = [b""] * self.vocab_size
        for token, i in self._tokenizer.get_vocab(with_added_tokens=True).items():
            if i not in self._special:
                out[i] = bytes(table[ch] for ch in token)
        return out


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's table, inverted: printable bytes stand for themselves, the other bytes for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table |= {chr(0x100 + n): b for n, b in enumerate(others)}
    return table
