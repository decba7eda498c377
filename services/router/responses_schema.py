"""The Responses API's request body (``POST /v1/responses``): its input items, tools and
text format, parsed as strictly as the other bodies (``openai_schema``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from llmmesh.runtime.errors import InvalidArgument
from services.router.openai_schema import (
    CACHE_KEY_DOC,
    MAX_CACHE_KEY,
    MAX_TOOLS,
    SAMPLING_NAMES,
    FunctionSpec,
    JsonObjectFormat,
    JsonSchema,
    PlainFormat,
    Strict,
    format_tag,
)
from services.router.request import MAX_CACHE_SALT

LOGPROBS_INCLUDED = "message.output_text.logprobs"  # the Responses API's include for them
MAX_INPUT_ITEMS = 62  # with the answer, what one append to a session may hold


class InputText(Strict):
    # output_text: an earlier response's output item sent back as input, as clients do.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # an output item's, sent back
    logprobs: list[dict[str, Any]] | None = None


class InputMessage(Strict):
    """A message item of the Responses API's ``input``."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an output item's, sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    """A call an earlier response made, sent back as an input item."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str
    arguments: str = Field(description="the arguments as the text of a JSON object")
    id: str | None = None  # an output item's, sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    """A call's result: ``call_id`` names a call among the items or the previous
    response's."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


_ITEM_TAGS = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
}


def _item_tag(value: Any) -> str | None:
    """The member of InputItem an item's ``type`` picks (a message may leave it out)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message="type must be message, function_call or function_call_output",
    ),
]


class FunctionTool(FunctionSpec):
    """The Responses API's function tool: the function's fields beside its type."""

    type: Literal["function"] = Field(description="function tools only")


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextJsonSchemaFormat(JsonSchema):
    """The Responses API's JSON schema format: the schema's fields beside its type."""

    type: Literal["json_schema"] = Field(description="JSON that is an instance of the schema")


TextFormat = Annotated[
    Annotated[PlainFormat, Tag("Text")]
    | Annotated[JsonObjectFormat, Tag("JsonObject")]
    | Annotated[TextJsonSchemaFormat, Tag("JsonSchema")],
    Discriminator(
        format_tag,
        custom_error_type="invalid_format",
        custom_error_message="type must be text, json_object or json_schema",
    ),
]


class TextConfig(Strict):
    format: TextFormat | None = Field(
        default=None,
        description="text; a JSON object; or JSON of a schema (as chat's response_format)",
    )


class ResponseStreamOptions(Strict):
    include_obfuscation: bool = Field(
        default=True, description="each delta event padded to hide its text's length"
    )


class ResponseBody(Strict):
    """``POST /v1/responses``; the conversation continues by ``previous_response_id``."""

    model: str = ""
    input: str | list[InputItem] = Field(
        description="text, or items: messages, function calls and their outputs"
    )
    instructions: str | None = Field(
        default=None, description="a system message for this response (not carried over)"
    )
    previous_response_id: str | None = None
    store: bool = Field(default=True, description="false: nothing of it is kept")
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    truncation: Literal["auto", "disabled"] = Field(
        default="disabled",
        description="auto: a conversation longer than the context is cut by the tenant's "
        "strategy; disabled: refused",
    )
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, description="the mesh's extension")
    seed: int | None = Field(default=None, description="the mesh's extension")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=20, description="with the logprobs included: the k likeliest too"
    )
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        default=None, description="each output token's log probability"
    )
    cache_salt: str | None = Field(
        default=None, max_length=MAX_CACHE_SALT, description="as in chat completions"
    )
    prompt_cache_key: str | None = Field(
        default=None, max_length=MAX_CACHE_KEY, description=CACHE_KEY_DOC
    )
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=512, description="kept with the response")
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(
        default=None, max_length=MAX_TOOLS, description="functions the model may call"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = Field(
        default=None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool = Field(default=True, description="more than one call at once")

    @field_validator("input")
    @classmethod
    def _some_items(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(value, list) and not 1 <= len(value) <= MAX_INPUT_ITEMS:
            raise ValueError(f"1 to {MAX_INPUT_ITEMS} items")
        return value

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if not 1 <= len(key) <= 64 or len(text) > 512:
                raise ValueError("keys of 1-64 characters, values of at most 512")
        return value

    def field_names(self) -> dict[str, str]:
        """The core's names of the fields this body sets, and the body's own."""
        names = {**SAMPLING_NAMES, "sampling.max_tokens": "max_output_tokens"}
        names["sampling.logprobs"] = "top_logprobs"
        # The structure is the tools' grammar, or the text's format.
        names["sampling.structured_output"] = "tools" if self.tools else "text.format"
        return names

    def obfuscated(self) -> bool:
        """Whether streamed delta events are padded (services/router/obfuscation.py)."""
        if self.stream_options is None:
            return self.stream
        if not self.stream:
            raise InvalidArgument("stream_options", "only with stream: true")
        return self.stream_options.include_obfuscation

    def logprobs_wanted(self) -> int | None:
        """The likeliest tokens to give at each output token (None: no log probabilities)."""
        included = LOGPROBS_INCLUDED in (self.include or [])
        if self.top_logprobs is not None and not included:
            raise InvalidArgument("top_logprobs", f"needs include [{LOGPROBS_INCLUDED!r}]")
        return (self.top_logprobs or 0) if included else None

    def structure(self) -> tuple[str, str] | None:
        """``text.format`` as the core's structured output (None: text)."""
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonObjectFormat):
            return ("json_object", "")
        if isinstance(fmt, TextJsonSchemaFormat):
            if fmt.description:
                raise InvalidArgument(
                    "text.format.description",
                    "not supported: the schema is not shown to the model (say it in the input)",
                )
            return ("json_schema", json.dumps(fmt.json_schema or {}))
        return None
