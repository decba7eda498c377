"""Structured outputs: a generation held to a JSON schema, any JSON object, or a regular
expression, as vLLM's ``structured_outputs`` asks. llguidance compiles the grammar and,
at every step, says which tokens keep the output a prefix of some text it accepts; the
others are masked out before sampling. Once the grammar is complete the generation ends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from refengine.contract import RequestError, StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON is written with fixed separators and no other whitespace: a model free to add
# whitespace between tokens may add it for ever (a small one often does).
JSON_LAYOUT: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


def grammar_of(structure: StructuredOutput) -> str:
    """llguidance's grammar for what the output must be."""
    from llguidance import LLMatcher

    if structure.kind == "json":
        return str(LLMatcher.grammar_from_json_schema(structure.spec, overrides=JSON_LAYOUT))
    if structure.kind == "json_object":
        schema = {"type": "object"}
        return str(LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT))
    if structure.kind == "regex":
        return str(LLMatcher.grammar_from_regex(structure.spec))
    choices = json.loads(structure.spec)
    return str(LLMatcher.grammar_from_regex("|".join(_escaped(c) for c in choices)))


def _escaped(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.^$*+?{}[]|()/-" else c for c in text)


class _TokenSource(Protocol):
    """What llguidance needs of the engine's tokenizer."""

    vocab_size: int
    eos_ids: frozenset[int]

    @property
    def token_bytes(self) -> Sequence[bytes]: ...

    def encode(self, text: str) -> list[int]: ...


class _Wrapped:
    """The engine's tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tokenizer: _TokenSource, special: Sequence[int]) -> None:
        self.eos_token_id = min(tokenizer.eos_ids)
        self.bos_token_id = None
        self.tokens = list(tokenizer.token_bytes)
        self.special_token_ids = list(special)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        raw = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return [t for t in self._tokenizer.encode(raw) if t not in self.special_token_ids]


class Grammars:
    """One engine's grammars: its tokenizer as llguidance's, built at the first request
    that asks for a structure (a few milliseconds for a vocabulary of tens of
    thousands), and a matcher per request."""

    def __init__(self, tokenizer: _TokenSource, allowed: npt.NDArray[np.bool_]) -> None:
        self._tokenizer = tokenizer
        self._special = [i for i, ok in enumerate(allowed) if not ok] + list(tokenizer.eos_ids)
        self._compiled: Any = None

    def matcher(self, structure: StructuredOutput) -> Constraint:
        """A fresh matcher; RequestError naming the field if the grammar does not compile."""
        from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

        if self._compiled is None:
            wrapped = TokenizerWrapper(_Wrapped(self._tokenizer, sorted(set(self._special))))
            self._compiled = LLTokenizer(wrapped)
        try:
            grammar = grammar_of(structure)
            matcher = LLMatcher(self._compiled, grammar, log_level=0)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"sampling_parameters.structured_outputs: {exc}") from None
        except BaseException as exc:  # a panic in the compiler arrives as a BaseException
            if not type(exc).__name__.startswith("Panic"):
                raise
            raise RequestError("sampling_parameters.structured_outputs: does not compile") from None
        if matcher.is_error():
            raise RequestError(f"sampling_parameters.structured_outputs: {matcher.get_error()}")
        return Constraint(matcher, self._tokenizer.vocab_size)


class Constraint:
    """One generation's matcher: the additive mask of the tokens it allows next, and the
    tokens it was given."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self._matcher = matcher
        self._vocab = vocab

    def mask(self) -> npt.NDArray[np.float64]:
        allowed = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)[: self._vocab]
        return np.where(allowed > 0, 0.0, -np.inf)

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    def accept_all(self, tokens: Sequence[int]) -> None:
        """Output made before a resume: the text already sent."""
        self._matcher.consume_tokens(list(tokens))

    @property
    def complete(self) -> bool:
        """Nothing more can follow (the grammar has ended)."""
        return bool(self._matcher.is_stopped())

    @property
    def failed(self) -> str:
        """Why the matcher stopped following the output ("" while it follows it)."""
        return str(self._matcher.get_error()) if self._matcher.is_error() else ""
