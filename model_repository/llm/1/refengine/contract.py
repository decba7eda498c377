"""The vLLM backend's request contract: parsing and validating what a client sent.

Inputs: ``text_input`` (prompt), ``stream`` (bool), ``sampling_parameters`` (JSON object),
``exclude_input_in_output`` (bool). Sampling keys follow vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_TOKENS = 16  # vLLM's default


class RequestError(ValueError):
    """A request is invalid; the message names the field and the reason."""


# What a structured output may be, by vLLM's names (its ``structured_outputs`` keys).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice")
MAX_STRUCTURE_CHARS = 65536


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be: ``kind`` one of STRUCTURED_KINDS; ``spec`` its JSON
    schema (JSON text), regular expression, or choices (a JSON list of strings); empty for
    ``json_object``."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Log probabilities of this many most likely tokens at each generated position,
    # beside the sampled token's own (0: the sampled token's only; None: none).
    logprobs: int | None = None
    # vLLM's prompt_logprobs: the log probability of each of the prompt's tokens after
    # what precedes it, and of this many most likely tokens there (None: none). The
    # prompt is then computed whole, not read from the prefix cache (vLLM's rule too).
    prompt_logprobs: int | None = None
    # vLLM's penalties, applied to the logits before temperature (greedy included):
    # presence subtracts once per token the output has, frequency once per occurrence;
    # repetition divides a positive logit (multiplies a negative one) of every token of
    # the prompt or the output. 0, 0 and 1: none.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, added to those tokens' logits before the penalties (vLLM's
    # order); a token the output may not have stays out whatever its bias.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: the end-of-sequence token and stop strings count only once the output has
    # more than this many tokens.
    min_tokens: int = 0
    # vLLM's structured_outputs: the output held to a JSON schema, an object, a regular
    # expression or one of some choices (None: free text).
    structured: StructuredOutput | None = None
    # vLLM's min_p: tokens less likely than this share of the likeliest one's probability
    # (after temperature) are not drawn; 0: none.
    min_p: float = 0.0
    # vLLM's stop_token_ids: the generation ends with any of these tokens (its text kept,
    # as vLLM keeps a token that is not special), once past min_tokens; ascending.
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's include_stop_str_in_output: the stop string that ends the output is in it.
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids: only these may be drawn (the end of sequence too only if
    # it is among them); empty: any. Ascending.
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words: words the output may not have (a word's last token is masked where
    # the output's tokens before it spell the rest of the word).
    bad_words: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def seeded(self) -> bool:
        """Its tokens are drawn from its seed's sequence (not greedy, not fresh entropy)."""
        return self.seed is not None and not self.greedy


MAX_STREAM_GAP_MS = 1000.0


@dataclass(frozen=True)
class StreamGap:
    """The request parameters ``stream_gap_ms`` and ``stream_gap_after``: once a
    streamed generation has sent ``after`` responses (at the model's own
    ``stream_gap_ms``), each later one goes out no sooner than ``seconds`` after the
    previous one, its text held meanwhile (fewer, larger responses, each of which costs
    every hop after the engine a wakeup). Its first and last responses never wait."""

    seconds: float
    after: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    # The optional input ``input_ids`` (TensorRT-LLM's name): the prompt's token ids, read
    # as given (no BOS added, as vLLM reads a prompt of ids); ``prompt`` is then its text.
    prompt_ids: tuple[int, ...] | None = None
    stream: bool = True
    exclude_input_in_output: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # The vLLM backend's optional outputs (each response carries them when asked).
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    return_num_input_tokens: bool = False
    # The engine's own: the prompt tokens read from the prefix cache (first response).
    return_num_cached_tokens: bool = False
    # The engine's own: the prompt's token ids as it read them, BOS included (first
    # response; vLLM's return_token_ids).
    return_prompt_token_ids: bool = False
    # The request parameter ``scheduling_priority``: lower is more urgent (vLLM's and
    # Triton's order); a request without one is 0.
    priority: int = 0
    # The request parameter ``cache_salt`` (vLLM's name): a prompt reuses only prefix
    # blocks computed for requests with the same salt (the mesh sends one per tenant, so
    # that no tenant can read, or time, another's cached prefixes). Empty: shared.
    cache_salt: str = ""
    # The request parameters ``stream_gap_ms`` and ``stream_gap_after`` (None: the model's
    # stream gap applies).
    stream_gap: StreamGap | None = None
    # The request parameter ``resumed_output_chars``: the prompt's last this many
    # characters are output this generation made before, elsewhere (a stream resumed on
    # another replica); its presence and frequency penalties count them as its output.
    resumed_output_chars: int = 0


def parse_priority(parameters: object) -> int:
    """``scheduling_priority`` of a request's parameters (JSON object): a non-negative
    integer, 0 when absent; RequestError naming it otherwise."""
    if not isinstance(parameters, dict) or "scheduling_priority" not in parameters:
        return 0
    value = parameters["scheduling_priority"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"scheduling_priority: must be a non-negative integer, got {value!r}")
    return value


def parse_resumed_output(parameters: object, prompt: str) -> int:
    """``resumed_output_chars`` of a request's parameters (JSON object): a non-negative
    integer no greater than the prompt's length, 0 when absent; RequestError naming it
    otherwise."""
    if not isinstance(parameters, dict) or "resumed_output_chars" not in parameters:
        return 0
    value = parameters["resumed_output_chars"]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= len(prompt):
        raise RequestError(
            "resumed_output_chars: must be an integer in [0, the prompt's length "
            f"{len(prompt)}], got {value!r:.40}"
        )
    return value


MAX_CACHE_SALT = 256


def parse_cache_salt(parameters: object) -> str:
    """``cache_salt`` of a request's parameters (JSON object): a string of at most
    MAX_CACHE_SALT characters, empty when absent; RequestError naming it otherwise."""
    if not isinstance(parameters, dict) or "cache_salt" not in parameters:
        return ""
    value = parameters["cache_salt"]
    if not isinstance(value, str) or len(value) > MAX_CACHE_SALT:
        raise RequestError(
            f"cache_salt: must be a string of at most {MAX_CACHE_SALT} characters, "
            f"got {value!r:.80}"
        )
    return value


def parse_stream_gap(parameters: object) -> StreamGap | None:
    """The request's StreamGap, None without ``stream_gap_ms``; RequestError naming the
    parameter when one is not a number in [0, MAX_STREAM_GAP_MS] or a non-negative
    integer."""
    if not isinstance(parameters, dict):
        return None
    after = parameters.get("stream_gap_after", 0)
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise RequestError(f"stream_gap_after: must be a non-negative integer, got {after!r:.40}")
    if "stream_gap_ms" not in parameters:
        return None
    gap_ms = parameters["stream_gap_ms"]
    valid = isinstance(gap_ms, int | float) and not isinstance(gap_ms, bool)
    if not valid or not 0.0 <= gap_ms <= MAX_STREAM_GAP_MS:
        raise RequestError(
            f"stream_gap_ms: must be a number of milliseconds in [0, "
            f"{MAX_STREAM_GAP_MS:g}], got {gap_ms!r:.40}"
        )
    return StreamGap(gap_ms / 1000.0, after)


SEED_LIMIT = 1 << 63  # seeds are unsigned 63-bit integers, as an int64 field holds them
_KNOWN_KEYS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
    "seed",
    "stop",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "structured_outputs",
}
# vLLM's keys this engine does not implement: accepted at the value that asks for nothing
# (what vLLM clients often send), refused by name at any other.
_NO_OP_VALUES = {
    "n": (1,),
    "best_of": (None, 1),
    "skip_special_tokens": (True,),
}
_ACCEPTED_KEYS = set(_NO_OP_VALUES)


def decode_text(raw: bytes | str, field_name: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            f"{field_name}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None


def parse_sampling_parameters(raw: bytes | str | None) -> SamplingParams:
    """Validates the ``sampling_parameters`` JSON; unknown keys are an error, not ignored."""
    if raw is None or raw in (b"", ""):
        return SamplingParams()
    text = decode_text(raw, "sampling_parameters")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"sampling_parameters: not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise RequestError("sampling_parameters: must be a JSON object")
    unknown = set(doc) - _KNOWN_KEYS - _ACCEPTED_KEYS
    if unknown:
        raise RequestError(f"sampling_parameters: unknown keys {sorted(unknown)}")
    for key, no_op in _NO_OP_VALUES.items():
        value = doc.get(key, no_op[0])
        if not any(value is v or (type(value) is type(v) and value == v) for v in no_op):
            raise RequestError(f"sampling_parameters.{key}: {value!r} is not supported here")
    return SamplingParams(
        max_tokens=_int(doc, "max_tokens", DEFAULT_MAX_TOKENS, minimum=1),
        temperature=_float(doc, "temperature", 1.0, lo=0.0, lo_open=False),
        top_p=_top_p(doc),
        top_k=_top_k(doc),
        seed=_seed(doc),
        stop=_stop(doc),
        ignore_eos=_bool(doc, "ignore_eos", False),
        logprobs=_logprobs(doc, "logprobs"),
        prompt_logprobs=_logprobs(doc, "prompt_logprobs"),
        presence_penalty=_within(doc, "presence_penalty", 0.0, MAX_PENALTY),
        frequency_penalty=_within(doc, "frequency_penalty", 0.0, MAX_PENALTY),
        repetition_penalty=_float(doc, "repetition_penalty", 1.0, lo=0.0, lo_open=True),
        logit_bias=_logit_bias(doc),
        min_tokens=_min_tokens(doc),
        structured=_structured(doc),
        min_p=_min_p(doc),
        stop_token_ids=_token_ids(doc, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        allowed_token_ids=_token_ids(doc, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS),
        include_stop_str_in_output=_bool(doc, "include_stop_str_in_output", False),
        bad_words=_bad_words(doc),
    )


def _int(doc: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"sampling_parameters.{key}: must be an integer")
    if value < minimum:
        raise RequestError(f"sampling_parameters.{key}: must be >= {minimum}, got {value}")
    return value


def _float(doc: dict[str, Any], key: str, default: float, lo: float, lo_open: bool) -> float:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"sampling_parameters.{key}: must be a finite number")
    if value < lo or (lo_open and value == lo):
        bound = ">" if lo_open else ">="
        raise RequestError(f"sampling_parameters.{key}: must be {bound} {lo}, got {value}")
    return float(value)


# Presence and frequency penalties are in [-2, 2], as vLLM and OpenAI take them.
MAX_PENALTY = 2.0


def _within(doc: dict[str, Any], key: str, default: float, bound: float, name: str = "") -> float:
    """A number in [-bound, bound]; errors name it ``name`` (default: ``key``)."""
    try:
        value = _float(doc, key, default, lo=-math.inf, lo_open=False)
    except RequestError:
        raise RequestError(f"sampling_parameters.{name or key}: must be a finite number") from None
    if not -bound <= value <= bound:
        raise RequestError(
            f"sampling_parameters.{name or key}: must be in [-{bound}, {bound}], got {value}"
        )
    return value


MAX_LOGIT_BIAS = 100.0


def _structured(doc: dict[str, Any]) -> StructuredOutput | None:
    """``structured_outputs``: an object with exactly one of vLLM's keys ``json`` (a
    schema: an object, or its JSON text), ``json_object`` (true), ``regex`` (a string) or
    ``choice`` (a list of strings)."""
    value = doc.get("structured_outputs")
    if value is None:
        return None
    field = "sampling_parameters.structured_outputs"
    asked = [k for k in STRUCTURED_KINDS if isinstance(value, dict) and value.get(k) is not None]
    if not isinstance(value, dict) or len(asked) != 1 or set(value) - set(STRUCTURED_KINDS):
        raise RequestError(f"{field}: must have exactly one of {', '.join(STRUCTURED_KINDS)}")
    kind = asked[0]
    spec = _structure_spec(kind, value[kind], f"{field}.{kind}")
    if len(spec) > MAX_STRUCTURE_CHARS:
        raise RequestError(f"{field}.{kind}: at most {MAX_STRUCTURE_CHARS} characters")
    return StructuredOutput(kind, spec)


def _structure_spec(kind: str, value: Any, field: str) -> str:
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{field}: must be true")
        return ""
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise RequestError(f"{field}: must be a non-empty string")
        return value
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise RequestError(f"{field}: must be a list of non-empty strings")
        return json.dumps(value)
    try:
        schema = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise RequestError(f"{field}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise RequestError(f"{field}: nested too deeply") from None
    if not isinstance(schema, dict):
        raise RequestError(f"{field}: must be a JSON schema (an object)")
    return json.dumps(schema)


def _min_tokens(doc: dict[str, Any]) -> int:
    value = _int(doc, "min_tokens", 0, minimum=0)
    most = _int(doc, "max_tokens", DEFAULT_MAX_TOKENS, minimum=1)
    if value > most:
        raise RequestError(
            f"sampling_parameters.min_tokens: must be at most max_tokens ({most}), got {value}"
        )
    return value


def _logit_bias(doc: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token ids (as strings, JSON's keys) to biases in
    [-100, 100]."""
    value = doc.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError("sampling_parameters.logit_bias: must be an object of token ids")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"sampling_parameters.logit_bias: {key!r:.40} is not a token id")
        number = _within({"bias": bias}, "bias", 0.0, MAX_LOGIT_BIAS, "logit_bias")
        pairs.append((int(key), number))
    return tuple(sorted(pairs))


def _top_p(doc: dict[str, Any]) -> float:
    value = _float(doc, "top_p", 1.0, lo=0.0, lo_open=True)
    if value > 1.0:
        raise RequestError(f"sampling_parameters.top_p: must be in (0, 1], got {value}")
    return value


MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 4096


def _token_ids(doc: dict[str, Any], key: str, most: int) -> tuple[int, ...]:
    """A list of token ids (at most ``most``), ascending without repeats."""
    value = doc.get(key)
    if value is None:
        return ()
    field = f"sampling_parameters.{key}"
    if not isinstance(value, list) or len(value) > most:
        raise RequestError(f"{field}: must be a list of at most {most} token ids")
    if not all(type(token) is int and token >= 0 for token in value):
        raise RequestError(f"{field}: each must be a token id (an integer >= 0)")
    return tuple(sorted(set(value)))


def _min_p(doc: dict[str, Any]) -> float:
    value = _float(doc, "min_p", 0.0, lo=0.0, lo_open=False)
    if value > 1.0:
        raise RequestError(f"sampling_parameters.min_p: must be in [0, 1], got {value}")
    return value


def _top_k(doc: dict[str, Any]) -> int:
    value = _int(doc, "top_k", 0, minimum=-1)
    return 0 if value == -1 else value


def _seed(doc: dict[str, Any]) -> int | None:
    value = doc.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError("sampling_parameters.seed: must be an integer")
    if not 0 <= value < SEED_LIMIT:
        raise RequestError(f"sampling_parameters.seed: must be in [0, 2^63), got {value}")
    return value


def _stop(doc: dict[str, Any]) -> tuple[str, ...]:
    value = doc.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError(
            "sampling_parameters.stop: must be a string or a list of non-empty strings"
        )
    return tuple(value)


MAX_BAD_WORDS = 64


def _bad_words(doc: dict[str, Any]) -> tuple[str, ...]:
    value = doc.get("bad_words")
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_BAD_WORDS:
        raise RequestError(f"sampling_parameters.bad_words: a list of at most {MAX_BAD_WORDS}")
    if not all(isinstance(word, str) and word.strip() for word in value):
        raise RequestError("sampling_parameters.bad_words: each must be a word (not blank)")
    return tuple(value)


def _logprobs(doc: dict[str, Any], key: str) -> int | None:
    if doc.get(key) is None:
        return None
    return _int(doc, key, 0, minimum=0)


def _bool(doc: dict[str, Any], key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"sampling_parameters.{key}: must be true or false")
    return value
