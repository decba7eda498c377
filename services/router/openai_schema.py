"""The HTTP API's request bodies (chat, completions, tokenize; the Responses API's are in
``responses_schema``): pydantic models that both validate every request and are published
as the OpenAPI document (``openapi_doc``).

Bodies are parsed strictly, in one pass by pydantic's JSON parser: ``application/json``
only; no coercion (``"stream": "yes"`` and ``"max_tokens": true`` are refused); nesting
beyond the parser's recursion limit, a lone UTF-16 surrogate escape and numbers out of
range are refused as invalid JSON; the body's size is bounded by the HTTP server
(``HttpSettings.max_body_bytes``) and the time to send it by ``body_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import ErrorDetails

from llmmesh.runtime.errors import FieldError, InvalidArgument
from llmmesh.runtime.metadata import SESSION_ID
from llmmesh.structures import choice_spec
from llmmesh.types import PENALTIES
from services.router.request import MAX_CACHE_SALT

B = TypeVar("B", bound=BaseModel)
MAX_CHOICES = 8
MAX_TOOLS = 64
MAX_CACHE_KEY = 256
CACHE_KEY_DOC = (
    "requests of the tenant with the same key go to the same replica (its prefix cache) "
    "and canary subset, as a session's turns do (the key, when given, instead of the "
    "session's or the conversation's)"
)
JSON_TYPES = ("application/json",)
# A path element naming a field or a key (not a union member's type tag, e.g. "str").
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


# The sampling fields the core checks, by the names these bodies give them where the
# name is the same (max_tokens and logprobs differ between the APIs).
SAMPLING_NAMES = {
    f"sampling.{name}": name
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
        "allowed_token_ids",
        "bad_words",
        "return_token_ids",
        *PENALTIES,
    )
} | {"sampling.structured_output": "response_format", "sampling.prompt_logprobs": "prompt_logprobs"}


class UnsupportedMediaType(FieldError):
    code, http_status, http_type = "INVALID_ARGUMENT", 415, "invalid_request_error"


class RequestTimeout(FieldError):
    code, http_status, http_type = "DEADLINE_EXCEEDED", 408, "invalid_request_error"


class Strict(BaseModel):
    # A parameter this API does not implement is refused by name (never ignored: a
    # client that asks for tools or a JSON format must not get plain text as if it had
    # them); those it takes must have their documented JSON types.
    model_config = ConfigDict(extra="forbid", strict=True)


def _no_op(default: Any, description: str) -> Any:
    """A parameter taken only at the value that asks for nothing."""
    return Field(default=default, description=f"{description}; only {default!r} is supported")


class PlainFormat(Strict):
    type: Literal["text"] = Field(description="plain text: the only format supported")


class JsonObjectFormat(Strict):
    type: Literal["json_object"] = Field(description="any JSON object")


class JsonSchema(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(
        default=None, description="empty only: the schema is not shown to the model"
    )
    # "schema" would shadow BaseModel's own attribute: the body's key is its alias.
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", description="the JSON schema (none: any JSON)"
    )
    strict: bool | None = Field(
        default=None, description="taken either way: the output is always held to the schema"
    )


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"] = Field(description="JSON that is an instance of the schema")
    json_schema: JsonSchema


_FORMAT_TAGS = {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}


def format_tag(value: Any) -> str | None:
    """The member of ResponseFormat a body's ``type`` picks. The tags are capitalised: in
    an error's location they are not field names, and field_path leaves them out."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[PlainFormat, Tag("Text")]
    | Annotated[JsonObjectFormat, Tag("JsonObject")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchema")],
    Discriminator(
        format_tag,
        custom_error_type="invalid_format",
        custom_error_message="type must be text, json_object or json_schema",
    ),
]


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: what the output must be, one kind at most."""

    # "json" would shadow BaseModel's own attribute: the body's key is its alias.
    json_spec: dict[str, Any] | str | None = Field(
        default=None, alias="json", description="a JSON schema (or its JSON text)"
    )
    regex: str | None = Field(
        default=None, min_length=1, description="a regular expression the whole output matches"
    )
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="the output is one of these texts, exactly"
    )
    json_object: bool | None = Field(default=None, description="true: any JSON object")
    disable_any_whitespace: bool = _no_op(
        False, "JSON is written with ', ' and ': ' and no other whitespace"
    )
    disable_additional_properties: bool = _no_op(False, "a schema is read as written")
    whitespace_pattern: str | None = _no_op(None, "JSON's whitespace is fixed")

    def kinds(self) -> list[str]:
        """The kinds asked for, by their keys; InvalidArgument naming a no-op set."""
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name):
                raise InvalidArgument(f"structured_outputs.{name}", "not supported (only False)")
        if self.whitespace_pattern is not None:
            raise InvalidArgument("structured_outputs.whitespace_pattern", "not supported")
        asked = [k for k in ("regex", "choice") if getattr(self, k) is not None]
        return (
            (["json"] if self.json_spec is not None else [])
            + asked
            + (["json_object"] if self.json_object else [])
        )


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = Field(
        default=True, description="each chunk padded to hide its text's length (as OpenAI)"
    )


class Body(Strict):
    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="samples of the prompt")
    user: str | None = Field(default=None, description="the end user, for the caller's records")
    ignore_eos: bool = Field(
        default=False, description="vLLM's extension: generate exactly max_tokens"
    )
    top_k: int | None = Field(
        default=None, ge=0, description="vLLM's extension: sample from the k likeliest; 0: all"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        max_length=64,
        description="vLLM's extension: the model's token ids that end the generation (a "
        "token's text is kept unless it is a control token)",
    )
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        max_length=4096,
        description="vLLM's extension: only these of the model's tokens may be generated "
        "(the end of sequence too only if listed)",
    )
    bad_words: list[str] | None = Field(
        default=None,
        max_length=64,
        description="vLLM's extension: words the output never has (each 1-256 characters)",
    )
    min_p: float | None = Field(
        default=None,
        description="vLLM's extension, in [0, 1]: sample only tokens at least this share of "
        "the likeliest one's probability; 0: all",
    )
    presence_penalty: float | None = Field(
        default=None, description="in [-2, 2]: subtracted once from a token the output has"
    )
    frequency_penalty: float | None = Field(
        default=None, description="in [-2, 2]: subtracted per occurrence in the output"
    )
    logit_bias: dict[str, float] | None = Field(
        default=None,
        description="token id (the model's, as a string) -> bias in [-100, 100], added to "
        "its logit; at most 300",
    )
    repetition_penalty: float | None = Field(
        default=None,
        description="vLLM's extension, > 0: divides the logits of the prompt's and the "
        "output's tokens (multiplies negative ones); 1: none",
    )
    min_tokens: int = Field(
        default=0,
        ge=0,
        description="vLLM's extension: no end (EOS or stop string) before this many tokens",
    )
    # What routers in front of vLLM and SGLang servers (vllm-router, for one) forward at
    # their defaults: each asks for nothing here, and anything else is refused by name.
    skip_special_tokens: bool = _no_op(True, "vLLM's; special tokens are never shown")
    spaces_between_special_tokens: bool = _no_op(True, "vLLM's; special tokens are never shown")
    priority: int = _no_op(0, "vLLM's request priority; the tenant's tier decides")
    no_stop_trim: bool = Field(
        default=False, description="SGLang's name of include_stop_str_in_output"
    )
    include_stop_str_in_output: bool = Field(
        default=False, description="vLLM's extension: the stop string that ends the text is in it"
    )
    return_hidden_states: bool = _no_op(False, "SGLang's; hidden states are never returned")
    response_format: ResponseFormat | None = Field(
        default=None,
        description="text; a JSON object; or JSON of a schema (written with ', ' and ': ' "
        "and no other whitespace)",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None,
        description="vLLM's extension: what the output must be (not with response_format)",
    )
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="vLLM's older name of structured_outputs.json"
    )
    guided_regex: str | None = Field(
        default=None, min_length=1, description="vLLM's older name of structured_outputs.regex"
    )
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="vLLM's older name of structured_outputs.choice"
    )
    cache_salt: str | None = Field(
        default=None,
        max_length=MAX_CACHE_SALT,
        description="vLLM's extension: shares cached prefixes only with the same salt "
        "(within the tenant's own cache)",
    )
    prompt_cache_key: str | None = Field(
        default=None, max_length=MAX_CACHE_KEY, description=CACHE_KEY_DOC
    )
    return_token_ids: bool = Field(
        default=False,
        description="vLLM's extension: each choice's token_ids (the output's, as the model "
        "sampled them) and prompt_token_ids (the prompt's as the model read it: a "
        "completion's in each choice, a chat's beside the choices); streamed too",
    )
    return_tokens_as_token_ids: bool = Field(
        default=False,
        description="vLLM's extension: the log probabilities name each token 'token_id:N' "
        "(N its id in the model's vocabulary; its bytes are still its text's)",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="vLLM's extension: each prompt token's log probability after what "
        "precedes it and the k likeliest there (a completion's in each choice, a chat's "
        "beside its choices); not streamed",
    )

    def check_no_ops(self) -> None:
        """Refuses, by name, a parameter set to anything but its no-op value, stream
        options without a stream (as OpenAI and vLLM do: there is no stream to end with
        the usage), and prompt log probabilities with one (vLLM's rule: they have no place
        in its chunks)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options", "only with stream: true")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidArgument("prompt_logprobs", "not with stream: true")
        fmt = self.response_format
        if isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.description:
            raise InvalidArgument(
                "response_format.json_schema.description",
                "not supported: the schema is not shown to the model (say it in a message)",
            )
        for name, default in self._forwarded_defaults().items():
            if getattr(self, name) != default:
                raise InvalidArgument(name, f"not supported (only {default!r})")

    def _forwarded_defaults(self) -> dict[str, object]:
        return {
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "priority": 0,
            "return_hidden_states": False,
        }

    def structure(self) -> tuple[str, str] | None:
        """The core's structured output (None: text), from ``response_format`` or vLLM's
        fields; InvalidArgument naming the second field if two ask for one."""
        fields = self.structure_fields()
        if len(fields) > 1:
            raise InvalidArgument(fields[1], f"not with {fields[0]}: one structure at most")
        if not fields:
            return None
        fmt, vllm = self.response_format, self.structured_outputs
        if isinstance(fmt, JsonSchemaFormat):
            return ("json_schema", json.dumps(fmt.json_schema.json_schema or {}))
        if fields[0] in ("response_format", "structured_outputs.json_object"):
            return ("json_object", "")
        if fields[0].startswith("structured_outputs.") and vllm is not None:
            return _structure(vllm.json_spec, vllm.regex, vllm.choice)
        # The older names (beside a structured_outputs that asks for nothing, if any).
        return _structure(self.guided_json, self.guided_regex, self.guided_choice)

    def obfuscated(self) -> bool:
        """Whether streamed chunks are padded: unless ``stream_options`` says not."""
        return self.stream_options is None or self.stream_options.include_obfuscation

    def structure_fields(self) -> list[str]:
        """The fields that ask for a structured output, in the order they are read."""
        fmt, vllm = self.response_format, self.structured_outputs
        fields = ["response_format"] if fmt is not None and fmt.type != "text" else []
        fields += [f"structured_outputs.{kind}" for kind in vllm.kinds()] if vllm else []
        guided = ("guided_json", "guided_regex", "guided_choice")
        return fields + [name for name in guided if getattr(self, name) is not None]

    def biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; InvalidArgument naming it for a key
        that is not a token id."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise InvalidArgument("logit_bias", f"keys are token ids, got {key!r:.40}")
            pairs.append((int(key), bias))
        return tuple(sorted(pairs))

    def field_names(self) -> dict[str, str]:
        """The core's names of the fields this body sets, and the body's own."""
        max_tokens = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        names = {**SAMPLING_NAMES, "sampling.max_tokens": max_tokens, "sampling.stop": "stop"}
        names["session_id"] = SESSION_ID  # over HTTP a session is named by its header
        structured = self.structure_fields()
        if structured:
            names["sampling.structured_output"] = structured[0]
        return names

    def prompt_logprobs_wanted(self) -> int | None:
        """The prompt's log probabilities the engine is asked for (the k likeliest)."""
        return self.prompt_logprobs


def check_continuation(messages: list[Message], continued: bool, cue: bool) -> None:
    """vLLM's rules for ``continue_final_message`` (``continued``): not with
    ``add_generation_prompt`` (``cue``), and the message continued is the assistant's, in
    words."""
    if continued and cue:
        raise InvalidArgument(
            "add_generation_prompt", "false with continue_final_message: no new message"
        )
    last = messages[-1]
    if continued and (last.role != "assistant" or last.tool_calls):
        raise InvalidArgument(
            f"messages[{len(messages) - 1}].role",
            "the assistant's, in words, to continue it (continue_final_message)",
        )


def _structure(
    schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None
) -> tuple[str, str]:
    """The core's structured output of vLLM's kinds (one of them given)."""
    if schema is not None:
        return ("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
    if regex is not None:
        return ("regex", regex)
    assert choice is not None
    return ("choice", choice_spec(choice))


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments as the text of a JSON object")


class ToolCall(Strict):
    """A call an earlier assistant message made, sent back with the conversation."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = ""
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="an assistant message's calls of tools"
    )
    tool_call_id: str | None = Field(default=None, description="a tool message's call")
    # What an earlier reply's message has when a client sends it back as it came: taken
    # where it says nothing (null, or no annotations).
    refusal: None = Field(default=None, description="null only: the served models never refuse")
    annotations: list[Any] | None = Field(default=None, max_length=0, description="none")
    audio: None = Field(default=None, description="null only: no audio")
    function_call: None = Field(default=None, description="null only: tool_calls instead")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionSpec(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str = Field(default="", description="shown to the model with the tool")
    parameters: dict[str, Any] | None = Field(
        default=None, description="the JSON schema of the arguments (none: no arguments)"
    )
    strict: bool | None = Field(
        default=None, description="taken either way: the arguments are held to the schema"
    )


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(default=False, description="each output token's log probability")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=20, description="with logprobs: the k likeliest tokens too"
    )
    add_generation_prompt: bool = Field(
        default=True,
        description="vLLM's: the assistant's cue after the messages; false only with "
        "continue_final_message",
    )
    continue_final_message: bool = Field(
        default=False,
        description="vLLM's: the last message, the assistant's, is the start of the answer "
        "and the model goes on with it (with add_generation_prompt: false; not in a session, "
        "nor with tools; a structured output holds what the model adds)",
    )
    echo: bool = Field(
        default=False,
        description="vLLM's: with continue_final_message, the answer's content begins with "
        "the last message's text",
    )
    # SGLang's, for models that reason apart from their answer; the served models do not.
    separate_reasoning: bool = _no_op(True, "SGLang's; the served models write no reasoning")
    stream_reasoning: bool = _no_op(True, "SGLang's; the served models write no reasoning")
    include_reasoning: bool = _no_op(True, "SGLang's; the served models write no reasoning")
    store: bool | None = Field(
        default=None,
        description="false only: a chat completion is never stored (the Responses API stores)",
    )
    service_tier: Literal["auto", "default"] | None = Field(
        default=None, description="the tenant's tier decides a request's priority"
    )
    tools: list[Tool] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description="functions the model may call: shown to it in a system message, its "
        "answer held to JSON that calls them or answers in words",
    )
    tool_choice: ToolChoice | None = Field(
        default=None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool = Field(default=True, description="false: one call at most")

    def continues_answer(self) -> bool:
        """vLLM's ``continue_final_message``: whether the last message starts the answer.
        InvalidArgument naming what cannot go with it."""
        check_continuation(self.messages, self.continue_final_message, self.add_generation_prompt)
        if not self.continue_final_message:
            if not self.add_generation_prompt:  # the answer is the assistant's
                raise InvalidArgument(
                    "add_generation_prompt", "false only with continue_final_message: true"
                )
            return False
        if self.tools:  # the tools' JSON is a whole answer, not one under way
            raise InvalidArgument("tools", "not with continue_final_message")
        return True

    def check_no_ops(self) -> None:
        super().check_no_ops()
        if self.store:
            raise InvalidArgument(
                "store", "not supported: chat completions are not stored (/v1/responses are)"
            )

    def _forwarded_defaults(self) -> dict[str, object]:
        return {
            **super()._forwarded_defaults(),
            "separate_reasoning": True,
            "stream_reasoning": True,
            "include_reasoning": True,
        }

    def field_names(self) -> dict[str, str]:
        names = {**super().field_names(), "sampling.logprobs": "top_logprobs"}
        if self.tools:  # the tools' grammar is the structure
            names["sampling.structured_output"] = "tools"
        return names

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionBody(Body):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a prompt, or several (n choices each); as text or as the model's "
        "token ids (read as given: no BOS added)"
    )

    @field_validator("prompt")
    @classmethod
    def _some_prompts(cls, prompt: Any) -> Any:
        several = isinstance(prompt, list) and not _ids(prompt)
        if several and not 1 <= len(prompt) <= MAX_CHOICES:
            raise ValueError(f"1 to {MAX_CHOICES} prompts")
        return prompt

    @property
    def listed(self) -> bool:
        """Whether the body has several prompts (each named ``prompt[i]``)."""
        return isinstance(self.prompt, list) and not _ids(self.prompt)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        items: list[Any] = list(self.prompt)
        if _ids(items):
            return [items]
        return items

    logprobs: int | None = Field(
        default=None, ge=0, le=20, description="the k likeliest tokens' log probabilities"
    )
    max_tokens: int | None = Field(
        default=None, ge=0, description="0 only with echo: the prompt alone, no output"
    )
    echo: bool = Field(
        default=False,
        description="each choice's text after its prompt as the model read it (input "
        "policy's redactions made); with logprobs, the prompt's tokens' first (the first "
        "token's log probability null)",
    )

    def field_names(self) -> dict[str, str]:
        names = {**super().field_names(), "sampling.logprobs": "logprobs"}
        if self.prompt_logprobs is None:
            names["sampling.prompt_logprobs"] = "logprobs"  # echoed
        return names

    def check_no_ops(self) -> None:
        super().check_no_ops()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidArgument("max_tokens", "0 only with echo: true (the prompt alone)")

    def prompt_alone(self) -> bool:
        """OpenAI's ``echo`` with ``max_tokens: 0``: the prompt (and its tokens' log
        probabilities), no output."""
        return self.echo and self.max_tokens == 0

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def echoed_logprobs(self) -> int | None:
        """The k of the prompt's tokens echoed with logprobs, as OpenAI's legacy API."""
        return self.logprobs if self.echo else None

    def prompt_logprobs_wanted(self) -> int | None:
        wanted = [k for k in (self.prompt_logprobs, self.echoed_logprobs()) if k is not None]
        return max(wanted, default=None)


def _ids(prompt: list[Any]) -> bool:
    """Whether a list prompt is one prompt's token ids (not several prompts)."""
    return bool(prompt) and isinstance(prompt[0], int)


class TokenizeBody(Strict):
    """vLLM's ``/tokenize``: a prompt, or messages rendered with the model's template."""

    model: str = ""
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        default=False, description="with messages: the last one left open, as a chat has it"
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="the tokens the engine adds to a prompt (its BOS, if any); default: "
        "true for a prompt, false for messages (their template writes its own), as vLLM",
    )
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description="with messages: the tools' system message, as a chat completion has it",
    )
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def text_or_messages(self) -> str | list[Message]:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("prompt", "give either prompt or messages")
        if self.tools and self.prompt is not None:
            raise InvalidArgument("tools", "only with messages")
        if self.messages is not None:
            check_continuation(
                self.messages, self.continue_final_message, self.add_generation_prompt
            )
        elif self.continue_final_message:
            raise InvalidArgument("continue_final_message", "only with messages")
        return self.prompt if self.prompt is not None else self.messages or []

    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None


class DetokenizeBody(Strict):
    model: str = ""
    tokens: list[int]


async def parse_body(request: web.Request, model: type[B], timeout_s: float) -> B:
    """The request's body as ``model``, or the client's error naming the field."""
    for name in request.query:  # the body says it all: a parameter here would be ignored
        raise InvalidArgument(name.removesuffix("[]"), "not supported as a query parameter")
    if request.content_type not in JSON_TYPES:
        raise UnsupportedMediaType("Content-Type", "must be application/json")
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise RequestTimeout("body", f"not received within {timeout_s:g} s") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise InvalidArgument("body", errors[0]["msg"]) from None
        # An object of a type not taken: its type is what is wrong, not its other fields.
        typed = [e for e in errors if e["loc"][-1:] == ("type",)]
        if typed:
            raise InvalidArgument(field_path(typed[0]["loc"]), typed[0]["msg"]) from None
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            raise InvalidArgument(field_path(unknown[0]["loc"]), "not supported") from None
        # For a union, each member's error: the one that got deepest says most, and of
        # those a rule the value broke says more than its not being another member's type.
        deepest = max(errors, key=lambda e: (len(field_path(e["loc"])), _broke_a_rule(e)))
        raise InvalidArgument(field_path(deepest["loc"]), deepest["msg"]) from None


def _broke_a_rule(error: ErrorDetails) -> bool:
    """Whether pydantic's error is a rule of the value's type (not that the type is wrong)."""
    kind = error["type"]
    return not (kind.endswith("_type") or kind.endswith("_parsing"))


def field_path(loc: tuple[int | str, ...]) -> str:
    """``messages[1].content`` from pydantic's location, without union type tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or "body"
