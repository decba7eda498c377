"""The Responses API's request as the core's: its input items as the turns the model
reads (messages as they are, function calls and their outputs in the model's tool JSON,
as chat completions write them), each named by its own field, and its function tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import History, Role, Sampling, Turn
from services.router.openai_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    NamedFunctionChoice,
    ResponseBody,
)
from services.router.tool_calls import ToolUse, arguments_of, calls_turn, checked_use, result_turn

_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER}


@dataclass(frozen=True)
class InputItems:
    """The input as the turns before the last item, the last one as the prompt, and each
    item's field (whose text it is: a message's content, a call's arguments, an output)."""

    history: History
    prompt: str
    names: tuple[str, ...]


_TEXT_FIELDS = {InputMessage: "content", FunctionCallItem: "arguments"}


def input_items(body: ResponseBody, earlier_calls: dict[str, str]) -> InputItems:
    """The input items as the model reads them: a message as its turn; a call and its
    output in the model's tool JSON (each call a turn of its own). An output's ``call_id``
    names a call among the items or in ``earlier_calls`` (call id -> name: the previous
    response's). The last item must be the user's message or a call's output."""
    items = body.input
    if isinstance(items, str):
        items = [InputMessage(role="user", content=items)]
    _check_last(items[-1], len(items) - 1)
    calls = dict(earlier_calls)
    turns: list[tuple[Role, str]] = []
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls[item.call_id] = item.name
            arguments = arguments_of(item.arguments, f"input[{index}].arguments")
            turns.append(calls_turn([(item.name, arguments)]))
        elif isinstance(item, FunctionCallOutputItem):
            name = calls.get(item.call_id)
            if name is None:
                raise InvalidArgument(f"input[{index}].call_id", "no earlier function call has it")
            turns.append(result_turn(name, item.text()))
        else:
            turns.append((_ROLES.get(item.role, Role.ASSISTANT), item.text()))
    *earlier, (_, prompt) = turns
    history = tuple(Turn(role, text) for role, text in earlier)
    names = tuple(
        f"input[{i}].{_TEXT_FIELDS.get(type(item), 'output')}" for i, item in enumerate(items)
    )
    return InputItems(History(turns=history, total_turns=len(history)), prompt, names)


def _check_last(item: InputMessage | FunctionCallItem | FunctionCallOutputItem, at: int) -> None:
    why = "the last item must be the user's message or a function call's output"
    if isinstance(item, FunctionCallItem):
        raise InvalidArgument(f"input[{at}].type", why)
    if isinstance(item, InputMessage) and item.role != "user":
        raise InvalidArgument(f"input[{at}].role", why)


def unknown_outputs(body: ResponseBody) -> bool:
    """Whether an output answers a call that is not among the items."""
    if isinstance(body.input, str):
        return False
    made = {item.call_id for item in body.input if isinstance(item, FunctionCallItem)}
    return any(
        isinstance(item, FunctionCallOutputItem) and item.call_id not in made for item in body.input
    )


def tool_use(body: ResponseBody) -> ToolUse | None:
    """The request's tools as the model will be asked to use them; None: no tools."""
    specs = list(body.tools or [])
    choice, parallel = body.tool_choice, body.parallel_tool_calls
    fields = ("tools[{}].name", "tool_choice.name")
    if isinstance(choice, NamedFunctionChoice):
        return checked_use(specs, None, choice.name, parallel, fields)
    return checked_use(specs, choice, None, parallel, fields)


def sampling_of(body: ResponseBody, tools: ToolUse | None) -> Sampling:
    kwargs: dict[str, Any] = {"max_tokens": body.max_output_tokens or 0}
    for name in ("temperature", "top_p", "seed", "top_k"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    structured = body.structure()
    if tools is not None and structured is not None:
        raise InvalidArgument("text.format", "not with tools: the answer is the tools' JSON")
    return Sampling(structured=tools.structure() if tools else structured, **kwargs)
