"""Core value types shared by the router and inference cores (no protobuf, no gRPC)."""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.sentences import Scored
from llmmesh.structures import SHARED, CachePartition, check_structure, choice_options


class FinishReason(enum.Enum):
    """Why a stream ended; values are the vLLM / OpenAI spellings."""

    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    POLICY = "policy"
    BUDGET = "budget"


# Structured outputs: vLLM's name for each kind the mesh takes (structures.py checks them).
_VLLM_KINDS = {
    "json_schema": "json",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
}

# The penalties' names (as vLLM and OpenAI spell them) and the value that asks for none.
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
# The sampling parameters sent to an engine only when they ask for something, with the
# value that asks for nothing.
_SENT_UNLESS = (
    ("top_k", 0),
    ("min_p", 0.0),
    ("seed", None),
    ("ignore_eos", False),
    ("include_stop_str_in_output", False),
    ("logprobs", None),
    ("prompt_logprobs", None),
    ("min_tokens", 0),
    *PENALTIES.items(),
)


@dataclass(frozen=True)
class Sampling:
    """Validated sampling controls (see SamplingParams in protos/llmmesh/v1/common.proto)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log probabilities per generated token; None: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, ids ascending: added to those tokens' logits
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # no end (EOS or stop string) before this many tokens
    # What the output must be: (kind, spec), kind one of STRUCTURED_KINDS, spec the JSON
    # schema's text, the regular expression or the choices' JSON list ("" for
    # json_object); None: free text.
    structured: tuple[str, str] | None = None
    # vLLM's prompt_logprobs: each prompt token's, and the k likeliest there; None: none
    prompt_logprobs: int | None = None
    # vLLM's min_p: only tokens at least this share of the likeliest one's probability
    # are drawn; 0: none
    min_p: float = 0.0
    # vLLM's stop_token_ids: the generation ends with any of these (ascending, no repeats)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: a stop string ends the output, in it
    # vLLM's allowed_token_ids: only these may be generated (ascending, no repeats); (): any
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()  # vLLM's: words the output never has
    # vLLM's return_token_ids: the prompt's ids (first chunk) and each token's (the log
    # probability entries', which the engine then sends, ``logprobs`` or not)
    return_token_ids: bool = False

    @property
    def scores_tokens(self) -> bool:
        """Whether the engine sends an entry per generated token (log probabilities)."""
        return self.logprobs is not None or self.return_token_ids

    def without_prompt_reports(self) -> Sampling:
        """This sampling for an engine that is not to report on the prompt again (a stream
        resumed elsewhere, a shadow): the tokens' entries still come when asked."""
        logprobs = 0 if self.logprobs is None and self.return_token_ids else self.logprobs
        return replace(self, prompt_logprobs=None, return_token_ids=False, logprobs=logprobs)

    @property
    def penalized(self) -> bool:
        return any(getattr(self, name) != none for name, none in PENALTIES.items())

    @property
    def reads_earlier_output(self) -> bool:
        """Whether the engine must know which of a resumed stream's prompt is its earlier
        output: penalties count it, a grammar continues from it, a seeded draw goes on from
        its place in the seed's sequence."""
        seeded = self.seed is not None and self.temperature > 0.0
        return self.penalized or self.structured is not None or seeded

    def to_vllm_json(self) -> str:
        """The ``sampling_parameters`` JSON of Triton's vLLM backend."""
        doc: dict[str, object] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        for name, none in _SENT_UNLESS:
            if getattr(self, name) != none:
                doc[name] = getattr(self, name)
        if self.return_token_ids and self.logprobs is None:
            doc["logprobs"] = 0  # the sampled tokens' entries, which carry their ids
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            if getattr(self, name):
                doc[name] = list(getattr(self, name))
        if self.logit_bias:
            doc["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        if self.structured is not None:
            kind, spec = self.structured
            value = choice_options(spec) if kind == "choice" else spec or True
            doc["structured_outputs"] = {_VLLM_KINDS[kind]: value}
        return json.dumps(doc, separators=(",", ":"))


@dataclass(frozen=True)
class Route:
    """Where a generation was served: the replica, its subset (version) and region, and
    whether that subset stood in for the one chosen (a fallback)."""

    endpoint: str
    subset: str
    region: str
    fallback: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability (the model's raw distribution), its rank, and
    the most likely tokens at its position: (token, text, log probability)."""

    token: int
    text: str
    logprob: float
    rank: int  # 0: a prompt's first token, which nothing precedes (no log probability)
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class Chunk:
    """A piece of a generation stream: new text, tokens behind it, and on the last one why.

    The router sets ``route`` on the last chunk, and ``resumed``: how many times the stream
    moved to another replica after text had been sent.
    """

    text: str
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    route: Route | None = None
    resumed: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of this chunk, when asked
    cached_tokens: int = 0  # on the first chunk: prompt tokens read from the prefix cache
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first chunk, when asked
    prompt_token_ids: tuple[int, ...] = ()  # on the first chunk, when asked
    # With return_token_ids: this chunk's tokens' ids (its released entries' tokens)
    token_ids: tuple[int, ...] = ()

    def after(self, held: Chunk | None) -> Chunk:
        """This chunk preceded by what ``held`` (earlier chunks whose text the output check
        held back whole) carried besides text: tokens, log probabilities, cache reads."""
        if held is None:
            return self
        return replace(
            self,
            num_tokens=held.num_tokens + self.num_tokens,
            logprobs=held.logprobs + self.logprobs,
            cached_tokens=held.cached_tokens + self.cached_tokens,
            prompt_logprobs=held.prompt_logprobs + self.prompt_logprobs,
            prompt_token_ids=held.prompt_token_ids + self.prompt_token_ids,
        )

    def with_text(self, text: str) -> Chunk:
        """This chunk with other text (what the output check let out of it): as
        ``dataclasses.replace`` would make it, at a fifth of its cost, on every relayed
        chunk of which the check holds part back."""
        copy = object.__new__(Chunk)
        copy.__dict__.update(self.__dict__, text=text)
        return copy


@dataclass(frozen=True)
class InferenceCall:
    """One fully built prompt for one model, as the inference tier receives it."""

    request_id: str
    model: str
    prompt: str
    sampling: Sampling
    # The engine's scheduling priority, lower is more urgent (None: the engine's default).
    priority: int | None = None
    # The engine's prefix-cache partition (empty: shared); the router's per tenant.
    cache_salt: str = ""
    # The prompt's last this many characters are this generation's own earlier output (a
    # stream resumed on another replica), which the engine's penalties count as output.
    resumed_output_chars: int = 0
    # The prompt's token ids, read as given (no BOS added); ``prompt`` is then their text
    # (what routing and the checks read). Empty: the engine tokenizes ``prompt``.
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelCard:
    """What the mesh needs to speak a model's tokens, as the model reports it: its
    tokenizer (a Hugging Face ``tokenizers`` definition; empty: UTF-8 bytes), its chat
    template (Jinja; empty: none) and the context it serves."""

    model: str
    max_context: int
    tokenizer_json: str = ""
    chat_template: str = ""
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False  # the engine puts the BOS token before every prompt


def count_tokens(text: str) -> int:
    """Token count in the reference model's byte-level tokenizer."""
    return len(text.encode("utf-8"))


SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_session_id(session_id: str) -> None:
    if not SESSION_ID.match(session_id):
        raise InvalidArgument(
            "session_id", "1-128 characters of letters, digits, '-', '_', '.', ':'"
        )


SEED_LIMIT = 1 << 63  # a seed is an integer in [0, 2^63): what an int64 field holds
MAX_TEMPERATURE = 100.0  # beyond it sampling is uniform anyway (and a float32 overflows)
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
# A prompt's log probabilities come in one response: at most this many entries (prompt
# tokens x (1 + the likeliest asked for each)), which keeps the engine's JSON of them and
# every message after it within gRPC's default 4 MiB (the reference engine's own bound).
MAX_PROMPT_LOGPROB_ENTRIES = 16_384
MAX_TOP_K = 1 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 64
MAX_PENALTY = 2.0  # presence and frequency penalties: [-2, 2], as OpenAI and vLLM take them
MAX_REPETITION_PENALTY = 100.0  # past it every repeated token is out anyway
MAX_LOGIT_BIAS = 100.0  # a bias is in [-100, 100], as OpenAI takes it
MAX_BIASED_TOKENS = 300
TOKEN_ID_LIMIT = 1 << 31  # token ids are int32 on the wire


def check_sampling(
    sampling: Sampling, max_tokens_limit: int, partition: CachePartition = SHARED
) -> None:
    """Raises InvalidArgument naming the first bad field of ``sampling``: every field an
    engine validates is validated here first, so that a client's mistake is the client's
    error and never a replica's failure. ``partition`` keeps one tenant's checked
    structures apart from another's (see ``check_structure``)."""
    if sampling.max_tokens <= 0:
        raise InvalidArgument("sampling.max_tokens", f"must be > 0, got {sampling.max_tokens}")
    if sampling.max_tokens > max_tokens_limit:
        raise InvalidArgument(
            "sampling.max_tokens", f"must be at most {max_tokens_limit}, got {sampling.max_tokens}"
        )
    _check_draw(sampling)
    if sampling.seed is not None and not 0 <= sampling.seed < SEED_LIMIT:
        raise InvalidArgument(
            "sampling.seed", f"must be an integer in [0, 2^63), got {sampling.seed}"
        )
    _check_stop(sampling.stop)
    _check_bad_words(sampling.bad_words)
    _check_token_lists(sampling)
    _check_penalties(sampling)
    _check_logit_bias(sampling.logit_bias)
    if sampling.structured is not None:
        check_structure(*sampling.structured, partition=partition)
    if not 0 <= sampling.min_tokens <= sampling.max_tokens:
        raise InvalidArgument(
            "sampling.min_tokens",
            f"must be in [0, max_tokens ({sampling.max_tokens})], got {sampling.min_tokens}",
        )
    for name in ("logprobs", "prompt_logprobs"):
        wanted = getattr(sampling, name)
        if wanted is not None and not 0 <= wanted <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"sampling.{name}", f"must be in [0, {MAX_LOGPROBS}], got {wanted}"
            )


def check_prompt_logprobs(sampling: Sampling, prompt_tokens: int) -> None:
    """Raises InvalidArgument naming ``sampling.prompt_logprobs`` when the prompt's log
    probabilities would be more than one response can carry."""
    top = sampling.prompt_logprobs
    if top is not None and prompt_tokens * (1 + top) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidArgument(
            "sampling.prompt_logprobs",
            f"{prompt_tokens} prompt tokens x {1 + top} entries each is past "
            f"{MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer likeliest tokens",
        )


def _check_penalties(sampling: Sampling) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(
                f"sampling.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"
            )
    if not 0.0 < sampling.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(
            "sampling.repetition_penalty",
            f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {sampling.repetition_penalty}",
        )


def _check_logit_bias(biases: tuple[tuple[int, float], ...]) -> None:
    if len(biases) > MAX_BIASED_TOKENS:
        raise InvalidArgument("sampling.logit_bias", f"at most {MAX_BIASED_TOKENS} tokens")
    for token, bias in biases:
        if not 0 <= token < TOKEN_ID_LIMIT:
            raise InvalidArgument("sampling.logit_bias", f"{token} is not a token id")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidArgument(
                "sampling.logit_bias",
                f"the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {bias}",
            )


def _check_draw(sampling: Sampling) -> None:
    """How a token is drawn: temperature, top-p, min-p and top-k in their ranges."""
    if not 0.0 <= sampling.temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(
            "sampling.temperature",
            f"must be a number in [0, {MAX_TEMPERATURE:g}], got {sampling.temperature}",
        )
    if not 0.0 < sampling.top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {sampling.top_p}")
    if not 0.0 <= sampling.min_p <= 1.0:
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {sampling.min_p}")
    if not 0 <= sampling.top_k <= MAX_TOP_K:
        raise InvalidArgument(
            "sampling.top_k", f"must be in [0, {MAX_TOP_K}], got {sampling.top_k}"
        )


def _check_token_lists(sampling: Sampling) -> None:
    """Stop and allowed token ids: bounded lists of ids (the model's vocabulary is the
    router's and the engine's to check)."""
    for name, most in (
        ("stop_token_ids", MAX_STOP_TOKEN_IDS),
        ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS),
    ):
        tokens = getattr(sampling, name)
        if len(tokens) > most or min(tokens, default=0) < 0:
            raise InvalidArgument(f"sampling.{name}", f"at most {most} token ids, each >= 0")


def _check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for index, text in enumerate(stop):
        if not text:
            raise InvalidArgument("sampling.stop", f"stop string {index} is empty")
        if len(text) > MAX_STOP_CHARS:
            raise InvalidArgument(
                "sampling.stop", f"stop string {index} is longer than {MAX_STOP_CHARS} characters"
            )


def _check_bad_words(words: tuple[str, ...]) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise InvalidArgument("sampling.bad_words", f"at most {MAX_BAD_WORDS} words")
    for index, word in enumerate(words):
        if not word.strip() or len(word) > MAX_STOP_CHARS:
            raise InvalidArgument(
                "sampling.bad_words",
                f"word {index} is blank or longer than {MAX_STOP_CHARS} characters",
            )


class Truncation(enum.StrEnum):
    """How a history too long for the model's context is cut (services/context/
    truncation.py): the one list of strategies the router, tenants and context share."""

    LAST_TURNS = "last_turns"
    KEEP_SYSTEM_AND_RECENT = "keep_system_and_recent"
    SLIDING_SUMMARY = "sliding_summary"
    KEY_SENTENCES = "key_sentences"
    MODEL_SUMMARY = "model_summary"


def check_truncation(strategy: str, field: str = "truncation") -> Truncation:
    """The strategy named (empty: last_turns); InvalidArgument naming ``field`` if none."""
    try:
        return Truncation(strategy or Truncation.LAST_TURNS)
    except ValueError:
        known = [t.value for t in Truncation]
        raise InvalidArgument(field, f"unknown strategy '{strategy}'; one of {known}") from None


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class Turn:
    """One utterance of a conversation."""

    role: Role
    text: str
    token_count: int = 0
    request_id: str = ""
    created_at_ms: int = 0


def request_text(turns: Sequence[Turn]) -> str | None:
    """What identifies the request that produced ``turns`` when its id comes back: its
    first user turn's text (its first turn's, if it has none; None for no turns)."""
    first = next((t for t in turns if t.role is Role.USER), turns[0] if turns else None)
    return None if first is None else first.text


def fingerprint(text: str) -> str:
    """SHA-256 (hex) of a request's text, as the context service reports a stored one."""
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class History:
    """A session's history as it goes into a prompt, cut to a token budget: the system
    prompt, a summary standing for older turns, the turns kept whole, and what was left
    out (``truncation`` is the strategy applied)."""

    turns: tuple[Turn, ...] = ()
    system_prompt: str = ""
    tools: str = ""  # the tools shown to the model for this request (never stored)
    summary: str = ""
    truncation: str = ""
    total_turns: int = 0
    dropped_turns: int = 0
    summarized_turns: int = 0
    system_prompt_dropped: bool = False
    # fingerprint() of the text the loading request's id stored already: a retry's
    # (the load leaves that request's own turns out) or a reused id's.
    request_fingerprint: str = ""
    # model_summary: older turns the model should fold into the summary now, and the
    # session's turn count they reach (the new summary's coverage); its room in tokens.
    fold: Fold | None = None
    # key_sentences: the left-out turns' sentences, scored, to choose the summary from
    # again with the message about to be answered; and the room for them (tokens).
    excerpt_candidates: tuple[Scored, ...] = ()
    excerpt_tokens: int = 0


@dataclass(frozen=True)
class Fold:
    """Turns for the model to fold into a session's summary (model_summary): it rewrites
    ``summary`` (covering the session's first ``covered`` turns) with ``turns``, so that
    the new one covers the first ``through``, in at most ``max_tokens``."""

    summary: str
    covered: int
    turns: tuple[Turn, ...]
    through: int
    max_tokens: int


class PolicyAction(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    REDACT = "redact"


@dataclass(frozen=True)
class Verdict:
    """Policy's decision on what a model will read, checked as one text in parts (each
    message, each turn of a history, the new prompt)."""

    action: PolicyAction
    rule_ids: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()  # each part's text as it may go on: redacted where ruled
    rule_set_version: str = ""
    checks_output: bool = False  # the rule set also has rules for generated text
    denied_at: str = ""  # with DENY: the field of the part where the deny rule matched
    matches: tuple[tuple[str, str], ...] = ()  # (rule id, field) of each match, in order

    @property
    def text(self) -> str:
        """The text of a verdict on a single part."""
        return self.texts[0] if self.texts else ""

    @property
    def denial(self) -> str:
        """Why a denied request is refused, for the client: the rule, and where."""
        rule = self.rule_ids[0] if self.rule_ids else "unknown"
        where = f" in {self.denied_at}" if self.denied_at else ""
        return f"prompt denied by policy rule '{rule}'{where}"


@dataclass(frozen=True)
class GuardedText:
    """Generated text after the streamed output check: what may be shown now, or the
    deny rule that stops the generation."""

    text: str
    denied_by: str | None = None
    held: int = 0  # characters of the text checked so far still held back
