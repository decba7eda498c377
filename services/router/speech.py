"""The router speaks each model's tokens: it counts with the model's own tokenizer and
writes conversations in the model's chat template, both learnt from the model's card (the
inference service asks the model itself, services/inference/triton.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from tokenizers import Tokenizer

from llmmesh.policy import Part
from llmmesh.runtime.errors import InvalidArgument, MeshError
from llmmesh.types import History, ModelCard, Sampling, Turn, count_tokens
from services.router.chat_layout import MESH_LAYOUT, ChatLayout, TemplateLayout

log = logging.getLogger(__name__)

WORD_JOINER = "\u2060"  # invisible, and no tokenizer reads a control token across it


class Codec(Protocol):
    """Text to a model's token ids and back (its tokenizer). ``bos_id``: the token the
    engine puts before every prompt, if any."""

    @property
    def bos_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """The text's tokens, as in a prompt (no BOS)."""

    def decode(self, ids: Sequence[int]) -> str:
        """InvalidArgument naming ``tokens[i]`` for an id the model does not have."""

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token as the tokenizer's vocabulary writes it."""

    def prompt_text(self, ids: Sequence[int], field: str) -> str:
        """The text of a prompt given as token ids: what the checks read of it (a BOS
        first, as the engine would put it, has none). InvalidArgument naming ``field``
        for an id the model lacks, one that has no text (a control token the checks
        could not see), or bytes that are not UTF-8 text (replacement characters would
        hide from the checks what the model reads)."""


def _after_bos(ids: Sequence[int], bos_id: int | None) -> Sequence[int]:
    return ids[1:] if ids and bos_id is not None and ids[0] == bos_id else ids


def _utf8_text(text: str, field: str) -> str:
    if "\ufffd" in text:
        raise InvalidArgument(field, "the token ids are not UTF-8 text: send text")
    return text


BYTE_BOS, BYTE_VOCABULARY = 256, 258  # the byte-level models' BOS and vocabulary size


class ByteCodec:
    """The byte-level models': a token per UTF-8 byte, and always a BOS."""

    bos_id: int | None = BYTE_BOS
    vocab_size: int = BYTE_VOCABULARY

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        _check_ids(ids, BYTE_VOCABULARY)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def pieces(self, ids: Sequence[int]) -> list[str]:
        _check_ids(ids, BYTE_VOCABULARY)
        return [bytes([i]).decode("latin-1") if i < 256 else f"<{i}>" for i in ids]

    def prompt_text(self, ids: Sequence[int], field: str) -> str:
        text_ids = _after_bos(ids, self.bos_id)
        first = len(ids) - len(text_ids)
        for index, token in enumerate(text_ids, start=first):
            if not 0 <= token < BYTE_BOS:
                raise InvalidArgument(field, f"{token} (at {index}) is not a byte (0-255)")
        try:
            return bytes(text_ids).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(field, "the token ids are not UTF-8 text: send text") from None


@dataclass(frozen=True)
class HuggingFaceCodec:
    tokenizer: Tokenizer
    bos_id: int | None = None

    @property
    def vocab_size(self) -> int:
        size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    def encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        _check_ids(ids, self.vocab_size)
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def pieces(self, ids: Sequence[int]) -> list[str]:
        _check_ids(ids, self.vocab_size)
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def prompt_text(self, ids: Sequence[int], field: str) -> str:
        """Control tokens come out as their text, which the checks of written text
        refuse (``ModelSpeech.check_plain``)."""
        size = self.vocab_size
        for index, token in enumerate(ids):
            if not 0 <= token < size:
                raise InvalidArgument(field, f"{token} (at {index}) is not a token (0-{size - 1})")
        text = self.tokenizer.decode(list(_after_bos(ids, self.bos_id)), skip_special_tokens=False)
        return _utf8_text(str(text), field)


def _check_ids(ids: Sequence[int], size: int) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < size:
            raise InvalidArgument(f"tokens[{index}]", f"not a token of this model (0-{size - 1})")


BYTE_CODEC = ByteCodec()


@dataclass(frozen=True)
class ModelSpeech:
    count: Callable[[str], int]  # tokens a text takes in the model's prompt
    layout: ChatLayout
    max_context: int  # tokens, prompt and generation together
    # The tokenizer's control tokens (<|im_start|>, ...): written in a message, they would
    # be those tokens, so a client could write role markers of its own into the prompt.
    control_tokens: tuple[str, ...] = ()
    codec: Codec = BYTE_CODEC

    @property
    def bos_tokens(self) -> int:
        """Tokens the engine puts before every prompt."""
        return 0 if self.codec.bos_id is None else 1

    @classmethod
    def of_card(cls, card: ModelCard) -> ModelSpeech:
        # Without a tokenizer of its own, the byte-level one's: a token per UTF-8 byte.
        count: Callable[[str], int] = count_tokens
        controls: tuple[str, ...] = ()
        codec: Codec = BYTE_CODEC
        if card.tokenizer_json:
            tokenizer = Tokenizer.from_str(card.tokenizer_json)
            bos = tokenizer.token_to_id(card.bos_token) if card.add_bos else None
            count, codec = _counter(tokenizer), HuggingFaceCodec(tokenizer, bos)
            controls = _control_tokens(card.tokenizer_json)
        layout: ChatLayout = MESH_LAYOUT
        if card.chat_template:
            layout = TemplateLayout(card.chat_template, card.bos_token, card.eos_token)
        return cls(count, layout, card.max_context, controls, codec)

    def check_tokens(self, sampling: Sampling) -> None:
        """INVALID_ARGUMENT naming the sampling field (``logit_bias``, ``stop_token_ids``,
        ``allowed_token_ids``) that has a token this model lacks."""
        size = self.codec.vocab_size
        for name, tokens in (
            ("logit_bias", [token for token, _ in sampling.logit_bias]),
            ("stop_token_ids", sampling.stop_token_ids),
            ("allowed_token_ids", sampling.allowed_token_ids),
        ):
            for token in tokens:
                if token >= size:
                    raise InvalidArgument(
                        f"sampling.{name}", f"{token} is not a token of this model (0-{size - 1})"
                    )

    def defused(self, text: str) -> str:
        """``text`` with no control token left in it, for what the model reads again of
        its own words (a session's stored answers, its summaries): a word joiner after
        each one's first character, so that the model reads the characters it wrote and
        never a role marker (refusing them would end the session)."""
        for token in self.control_tokens:
            if token in text:
                text = text.replace(token, token[0] + WORD_JOINER + token[1:])
        return text

    def defused_history(self, history: History) -> History:
        """A stored history's turns and summary ``defused``, and those it asks the model
        to fold into a new summary."""
        fold = history.fold
        stored = [history.summary, *(t.text for t in history.turns)]
        if fold is not None:
            stored += [fold.summary, *(t.text for t in fold.turns)]
        if not any(token in text for text in stored for token in self.control_tokens):
            return history  # nearly every history, left as it is
        if fold is not None:
            fold = replace(
                fold, turns=self._defused_turns(fold.turns), summary=self.defused(fold.summary)
            )
        return replace(
            history,
            turns=self._defused_turns(history.turns),
            summary=self.defused(history.summary),
            fold=fold,
        )

    def _defused_turns(self, turns: tuple[Turn, ...]) -> tuple[Turn, ...]:
        return tuple(replace(t, text=self.defused(t.text)) for t in turns)

    def check_plain(self, parts: Iterable[Part]) -> None:
        """INVALID_ARGUMENT naming the first part that writes one of the model's control
        tokens: only the mesh's own layout may."""
        for part in parts:
            for token in self.control_tokens:
                if token in part.text:
                    raise InvalidArgument(
                        part.field, f"contains the model's control token {token!r}"
                    )


def _control_tokens(tokenizer_json: str) -> tuple[str, ...]:
    added = json.loads(tokenizer_json).get("added_tokens", [])
    return tuple(t["content"] for t in added if t.get("special") and t.get("content"))


# A text longer than this is encoded as a batch of one: ``encode_batch`` lets go of the
# interpreter while it encodes (``encode`` holds it), so that other threads, and an event
# loop that sent a long conversation's tokenizing to a thread (beside_loop_if_long), run
# meanwhile. It costs
# about 2 µs more a call, which a short text's 10 µs would feel.
_RELEASING_CHARS = 1024


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    if len(text) > _RELEASING_CHARS:
        [encoding] = tokenizer.encode_batch([text], add_special_tokens=False)
    else:
        encoding = tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = encoding.ids
    return ids


def _counter(tokenizer: Tokenizer) -> Callable[[str], int]:
    def count(text: str) -> int:
        return len(_ids(tokenizer, text))

    return count


class Speeches(Protocol):
    async def of(self, model: str) -> ModelSpeech: ...


@dataclass(frozen=True)
class FixedSpeech:
    """The same speech for every model (tests, and a mesh of byte-level models only)."""

    speech: ModelSpeech

    async def of(self, model: str) -> ModelSpeech:
        return self.speech


class CardSource(Protocol):
    async def describe(self, model: str) -> ModelCard:
        """The model's card, from some replica that serves it."""


class CardSpeeches:
    """Each model's speech, built from its card on first use and again every
    ``refresh_s`` (a new version may bring another template); while a refresh fails, the
    last card serves. One fetch at a time per model."""

    def __init__(
        self,
        source: CardSource,
        refresh_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._refresh_s = refresh_s
        self._clock = clock
        self._known: dict[str, tuple[ModelSpeech, float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def of(self, model: str) -> ModelSpeech:
        known = self._known.get(model)
        if known is not None and self._clock() < known[1]:
            return known[0]
        async with self._locks.setdefault(model, asyncio.Lock()):
            known = self._known.get(model)
            if known is not None and self._clock() < known[1]:
                return known[0]
            try:
                speech = ModelSpeech.of_card(await self._source.describe(model))
            except MeshError as err:
                if known is None:
                    raise
                log.warning("model card refresh failed", extra={"fields": {"error": str(err)}})
                speech = known[0]
            self._known[model] = (speech, self._clock() + self._refresh_s)
            return speech
