"""The Responses API's request as the core's: its input items as the turns the model
reads (messages as they are, function calls and their outputs in the model's tool JSON,
as chat completions write them), each named by its own field, and its function tools;
and back: a stored response's input items from its session's turns."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import History, Role, Sampling, Turn
from services.router.request import SessionUse
from services.router.response_object import MAX_RECORD_CHARS
from services.router.responses_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    NamedFunctionChoice,
    ResponseBody,
)
from services.router.tool_calls import (
    RESULT,
    ToolUse,
    answer_of,
    arguments_of,
    calls_turn,
    checked_use,
    result_turn,
)

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


def echoed(body: ResponseBody) -> dict[str, Any]:
    """What the response object echoes of the request (its settings, kept with it)."""
    choice = body.tool_choice
    named = choice.model_dump() if isinstance(choice, NamedFunctionChoice) else None
    return {
        "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "truncation": body.truncation,
        "store": body.store,
        "user": body.user,
        "tools": [tool.model_dump() for tool in body.tools or []],
        "tool_choice": named or choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": {"format": _format_echo(body)},
    }


def _format_echo(body: ResponseBody) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}


def check_storable(body: ResponseBody, settings: dict[str, Any]) -> None:
    """With ``store``, the settings must fit the response's record (half of it: the
    rest is its status, usage and ids)."""
    if body.store and len(json.dumps(settings)) > MAX_RECORD_CHARS // 2:
        raise InvalidArgument(
            "store", "the tools and text.format are too long to keep (false keeps nothing)"
        )


def affinity_of(body: ResponseBody, conversation: str) -> str:
    """The replica affinity's key: the request's prompt cache key if it names one, else
    its conversation's (empty: neither)."""
    return SessionUse.keyed(body.prompt_cache_key) or conversation


def sampling_of(body: ResponseBody, tools: ToolUse | None) -> Sampling:
    kwargs: dict[str, Any] = {"max_tokens": body.max_output_tokens or 0}
    for name in ("temperature", "top_p", "seed", "top_k"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    structured, logprobs = body.structure(), body.logprobs_wanted()
    if tools is not None and structured is not None:
        raise InvalidArgument("text.format", "not with tools: the answer is the tools' JSON")
    if tools is not None and logprobs is not None:
        raise InvalidArgument("include", "log probabilities not with tools")
    structured = tools.structure() if tools else structured
    return Sampling(structured=structured, logprobs=logprobs, **kwargs)


def input_record(body: ResponseBody) -> list[list[str]]:
    """What a stored response keeps of its input items beside their turns' text: each
    item's type and its role or call id."""
    if isinstance(body.input, str):
        return [["message", "user"]]
    kept = []
    for item in body.input:
        if isinstance(item, InputMessage):
            kept.append(["message", item.role])
        else:
            kept.append([item.type, item.call_id])
    return kept


_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def stored_items(
    response_id: str, kept: Sequence[Sequence[str]], turns: Sequence[Turn]
) -> list[dict[str, Any]]:
    """A stored response's input items, in order, from what it kept of them and their
    turns (the session's turns before the answer; the items' text as policy let it in).
    Where the session holds fewer turns than there were items, the last ones."""
    own = response_id.removeprefix("resp_")
    turns = turns[-len(kept) :] if kept else ()
    first = len(kept) - len(turns)
    items = []
    for index, turn in enumerate(turns, start=first):
        kind, detail = kept[index]
        item_id = f"{_PREFIXES[kind]}_{own}{index:04x}"
        items.append(_stored_item(item_id, kind, detail, turn.text))
    return items


def _stored_item(item_id: str, kind: str, detail: str, text: str) -> dict[str, Any]:
    base = {"id": item_id, "type": kind, "status": "completed"}
    if kind == "function_call":
        _, calls = answer_of(text)
        function = calls[0]["function"] if calls else {"name": "", "arguments": text}
        return {**base, "call_id": detail, **function}
    if kind == "function_call_output":
        return {**base, "call_id": detail, "output": _result_content(text)}
    if detail == "assistant":
        part = {"type": "output_text", "text": text, "annotations": []}
    else:
        part = {"type": "input_text", "text": text}
    return {**base, "role": detail, "content": [part]}


def _result_content(text: str) -> str:
    """A call's output as it was sent, from its turn in the model's tool JSON (the text
    as it is if an input rule changed it past reading)."""
    try:
        content = json.loads(text)[RESULT]["content"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return text
    return content if isinstance(content, str) else text


@dataclass(frozen=True)
class ItemPage:
    """A page of a list, as OpenAI's list endpoints ask for one: in ``order`` (``asc`` or
    ``desc``), at most ``limit`` items, those after the item ``after``."""

    order: str = "desc"
    limit: int = 20
    after: str | None = None

    @classmethod
    def of(cls, query: Mapping[str, str]) -> ItemPage:
        """The page a query asks for; InvalidArgument naming a parameter it cannot take."""
        for name in query:
            if name not in ("order", "limit", "after"):
                raise InvalidArgument(name.removesuffix("[]"), "not supported")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidArgument("order", "asc or desc")
        limit = query.get("limit", "20")
        if not limit.isascii() or not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise InvalidArgument("limit", "an integer from 1 to 100")
        return cls(order, int(limit), query.get("after"))

    def list(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The page of ``items`` (in ascending order) as OpenAI's list object."""
        ordered = list(items) if self.order == "asc" else list(reversed(items))
        start = 0
        if self.after is not None:
            ids = [item["id"] for item in ordered]
            if self.after not in ids:
                raise InvalidArgument("after", "no item of this response has this id")
            start = ids.index(self.after) + 1
        data = ordered[start : start + self.limit]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + self.limit < len(ordered),
        }
