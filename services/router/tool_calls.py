"""Tool calling in chat completions (OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``) for models whose chat template has no tool format of its own.

The tools are shown to the model in a system message, and its answer is held, by a
structured output's grammar, to JSON that either calls tools (``{"tool_calls": [{"name":
..., "arguments": {...}}]}``, each call's arguments an instance of its tool's schema) or,
with ``auto``, answers in words (``{"response": "..."}``). The reply turns that JSON into
OpenAI's ``tool_calls`` or ``content``. Earlier calls and their results, sent back with the
conversation, are written in the same JSON, so that the model reads them as it writes them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Role
from services.router.openai_schema import (
    ChatBody,
    FunctionSpec,
    Message,
    NamedToolChoice,
    Tool,
    ToolChoice,
)

CALLS, ANSWER, RESULT = "tool_calls", "response", "tool_response"
# The model's JSON is written with these separators (the engine's JSON layout).
_SEPARATORS = (", ", ": ")
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER}


def _compact(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=_SEPARATORS)


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask of the model: ``choice`` is ``auto``, ``required``,
    ``none`` (the tools are shown, the answer is in words) or ``function``: call the tool
    ``name``."""

    tools: tuple[FunctionSpec, ...]
    choice: Literal["auto", "required", "none", "function"]
    parallel: bool
    name: str = ""

    @property
    def named(self) -> bool:
        return self.choice == "function"

    def _offered(self) -> tuple[FunctionSpec, ...]:
        return tuple(t for t in self.tools if not self.named or t.name == self.name)

    def structure(self) -> tuple[str, str]:
        """The grammar of the answer, as the core's structured output."""
        answering = _object_of(ANSWER, {"type": "string"})
        if self.choice == "none":
            return ("json_schema", json.dumps(answering))
        calls: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": [_call_schema(tool) for tool in self._offered()]},
            "minItems": 1,
        }
        if self.named or not self.parallel:
            calls["maxItems"] = 1
        calling = _object_of(CALLS, calls)
        if self.choice != "auto":
            return ("json_schema", json.dumps(calling))
        return ("json_schema", json.dumps({"anyOf": [calling, answering]}))

    def instructions(self) -> str:
        """The system message that shows the model its tools and how to answer."""
        listed = "\n".join(_compact(_shown(tool)) for tool in self._offered())
        call = _compact({CALLS: [{"name": "<tool name>", "arguments": {}}]})
        lines = [
            "You have these tools (each with the JSON schema of its arguments):",
            listed,
            "Answer with JSON only.",
        ]
        answer = _compact({ANSWER: "<your answer>"})
        if self.choice == "none":
            lines.append(f"Call no tool now; answer in words: {answer}")
        elif self.named:
            lines.append(f"Call the tool {self.name}: {call}")
        elif self.choice == "required":
            lines.append(f"Call one or more tools: {call}")
        else:
            lines.append(f"To call tools: {call}; to answer in words: {answer}")
        result = _compact({RESULT: {"name": "<tool name>", "content": "<result>"}})
        lines.append(f"A tool's result comes back as {result}.")
        return "\n".join(lines)


def _shown(tool: FunctionSpec) -> dict[str, Any]:
    described = {"description": tool.description} if tool.description else {}
    return {"name": tool.name, **described, "parameters": _params(tool)}


def _params(tool: FunctionSpec) -> dict[str, Any]:
    return tool.parameters if tool.parameters is not None else _NO_ARGUMENTS


def _call_schema(tool: FunctionSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": _params(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _object_of(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: schema},
        "required": [key],
        "additionalProperties": False,
    }


def tool_use(body: ChatBody) -> ToolUse | None:
    """The request's tools as the model will be asked to use them; None: no tools, the
    model answers as without them. InvalidArgument naming the field for a choice without
    tools, an unknown tool, or a parameter that cannot go with them."""
    use = tools_asked(body.tools, body.tool_choice, body.parallel_tool_calls)
    if use is None:
        return None
    structured = body.structure_fields()
    if structured:
        raise InvalidArgument(structured[0], "not with tools: the answer is the tools' JSON")
    for name in ("logprobs", "return_token_ids"):
        if getattr(body, name):
            raise InvalidArgument(name, "not with tools")
    return use


def tools_asked(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool
) -> ToolUse | None:
    """Chat completions' tools and the choice among them, checked; None: no tools."""
    specs = [tool.function for tool in tools or []]
    fields = ("tools[{}].function.name", "tool_choice.function.name")
    if isinstance(choice, NamedToolChoice):
        return checked_use(specs, None, choice.function.name, parallel, fields)
    return checked_use(specs, choice, None, parallel, fields)


def checked_use(
    specs: Sequence[FunctionSpec],
    choice: Literal["none", "auto", "required"] | None,
    named: str | None,
    parallel: bool,
    fields: tuple[str, str],
) -> ToolUse | None:
    """The tools and the choice among them (``named``: the function asked for); a choice
    without tools, an unknown or a repeated name is refused naming the field (``fields``:
    where a tool's name and the named choice are, as the API spells them)."""
    if not specs:
        if choice not in (None, "none") or named is not None:
            raise InvalidArgument("tool_choice", "needs tools")
        return None
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        if spec.name in seen:
            raise InvalidArgument(fields[0].format(index), "names must be unique")
        seen.add(spec.name)
    if named is not None and named not in seen:
        raise InvalidArgument(fields[1], f"no tool named {named!r:.70}")
    if named is not None:
        return ToolUse(tuple(specs), "function", parallel, named)
    return ToolUse(tuple(specs), choice or "auto", parallel)


def conversation(messages: Sequence[Message]) -> list[tuple[Role, str]]:
    """Each message as the turn the model reads: an assistant's tool calls and a tool's
    result written as the model's tool JSON, a tool's result as the user's turn.
    InvalidArgument naming the message for a call or a result that does not fit."""
    calls: dict[str, str] = {}  # call id -> tool name, of the calls so far
    turns = []
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        _check_fields(message, field)
        if message.role == "tool":
            name = calls.get(message.tool_call_id or "")
            if name is None:
                raise InvalidArgument(f"{field}.tool_call_id", "no earlier tool call has this id")
            turns.append(result_turn(name, message.text()))
        elif message.tool_calls:
            written = []
            for number, call in enumerate(message.tool_calls):
                calls[call.id] = call.function.name
                where = f"{field}.tool_calls[{number}].function.arguments"
                written.append((call.function.name, arguments_of(call.function.arguments, where)))
            turns.append(calls_turn(written))
        else:
            turns.append((_ROLES.get(message.role, Role.ASSISTANT), message.text()))
    return turns


def calls_turn(calls: Sequence[tuple[str, Any]]) -> tuple[Role, str]:
    """An assistant's calls (name, arguments) as the model writes them."""
    written = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return Role.ASSISTANT, _compact({CALLS: written})


def result_turn(name: str, content: str) -> tuple[Role, str]:
    """A tool's result as the user's turn the model reads it in."""
    return Role.USER, _compact({RESULT: {"name": name, "content": content}})


def _check_fields(message: Message, field: str) -> None:
    if message.tool_calls and message.role != "assistant":
        raise InvalidArgument(f"{field}.tool_calls", "only an assistant's message makes calls")
    if message.tool_calls and message.text():
        raise InvalidArgument(
            f"{field}.content", "empty with tool_calls: the model writes one or the other"
        )
    if (message.tool_call_id is None) != (message.role != "tool"):
        raise InvalidArgument(
            f"{field}.tool_call_id", "required in a tool's message, and only there"
        )


def arguments_of(text: str, field: str) -> Any:
    """A call's arguments sent back: a JSON object, or refused naming ``field``."""
    try:
        arguments = json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's depth: not taken either
        raise InvalidArgument(field, "not JSON") from None
    if not isinstance(arguments, dict):
        raise InvalidArgument(field, "must be a JSON object")
    return arguments


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def answer_of(
    text: str, new_id: Callable[[], str] = call_id
) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the tool calls (OpenAI's shapes) of the model's JSON. Text that is
    not the tools' JSON (cut by max_tokens or a stop string, or changed by an output rule)
    is the content as it is."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return text, []
    if not isinstance(doc, dict) or len(doc) != 1:
        return text, []
    calls = doc.get(CALLS)
    if isinstance(calls, list) and calls and all(_is_call(c) for c in calls):
        return None, [_openai_call(call, new_id()) for call in calls]
    answer = doc.get(ANSWER)
    return (answer if isinstance(answer, str) else text), []


def _is_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call


def _openai_call(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    function = {"name": call["name"], "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def finish_of(finish: str | None, calls: list[dict[str, Any]], use: ToolUse) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when the model chose to call (a named
    choice's call is a plain ``stop``, as OpenAI's)."""
    return "tool_calls" if calls and finish == "stop" and not use.named else finish
