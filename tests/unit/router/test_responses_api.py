"""The Responses API's pieces, without a server: function tools' input items written for
the model as chat completions write them (each named by its own field), the output's
items (message or function calls) built whole and as the SDK's events from the model's
tool JSON, log probabilities, the stored record read back with the same ids, and input
items listed back."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Chunk, FinishReason, Role, TokenLogprob, Turn
from services.router.response_items import (
    ItemPage,
    affinity_of,
    check_storable,
    echoed,
    input_items,
    input_record,
    sampling_of,
    stored_items,
    tool_use,
    unknown_outputs,
)
from services.router.response_object import ENTRY_CHARS, RECORD_KEY, ResponseDraft
from services.router.responses_schema import ResponseBody
from services.router.tool_stream import ToolStream

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = {"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}
TWO = {"tool_calls": [*CALL["tool_calls"], {"name": "weather", "arguments": {"city": "Rome"}}]}
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
ITEMS: TypeAdapter[ResponseItem] = TypeAdapter(ResponseItem)


def body(**fields: Any) -> ResponseBody:
    return ResponseBody.model_validate({"input": "hi", "tools": [WEATHER], **fields})


def draft(tools: bool = True) -> ResponseDraft:
    settings = {"tools": [WEATHER] if tools else [], "store": True}
    tools_read = ToolStream() if tools else None
    return ResponseDraft("resp_" + "a" * 32, "llm", 0, settings, tools=tools_read, streaming=True)


def written(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(", ", ": "))


def stream(
    text: str, cuts: int = 3, finish: FinishReason = FinishReason.STOP
) -> tuple[ResponseDraft, list[bytes]]:
    """The answer ``text`` streamed in pieces of ``cuts`` characters: the draft, its events."""
    out = draft()
    events = list(out.opening())
    pieces = [text[i : i + cuts] for i in range(0, len(text), cuts)]
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        events += out.add(Chunk(piece, 1, finish if last else None))
    events += out.closing()
    return out, events


def parsed(events: list[bytes]) -> list[Any]:
    docs = []
    for raw in events:
        kind, data = raw.decode().split("\n")[:2]
        doc = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {doc['type']}"
        docs.append(EVENTS.validate_python(doc))
    return docs


def test_calls_stream_as_the_sdk_builds_them() -> None:
    out, events = stream(written(TWO))
    docs = parsed(events)
    kinds = [d.type for d in docs]
    call_events = [
        "response.output_item.added",
        *["response.function_call_arguments.delta"]
        * kinds.count("response.function_call_arguments.delta"),
    ]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == 2
    assert kinds.count("response.function_call_arguments.done") == 2
    assert set(kinds[2:-1]) <= {
        *call_events,
        "response.function_call_arguments.done",
        "response.output_item.done",
    }
    # The SDK's own accumulator, fed the events, builds what the object holds (and checks
    # each item's identity from added to done to completed).
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for doc in docs:
        state.handle_event(doc)
    final = Response.model_validate(out.object())
    built = state._ResponseStreamState__current_snapshot  # type: ignore[attr-defined]
    assert [o.model_dump(exclude={"parsed_arguments"}) for o in built.output] == [
        o.model_dump() | {"status": "in_progress"} for o in final.output
    ]
    first, second = final.output
    assert first.type == second.type == "function_call"
    assert (first.name, json.loads(first.arguments)) == ("weather", {"city": "Paris"})
    assert json.loads(second.arguments) == {"city": "Rome"}
    assert first.call_id != second.call_id and first.id == "fc_" + first.call_id[5:]
    assert [d.sequence_number for d in docs] == list(range(len(docs)))
    assert final.output_text == ""


@pytest.mark.parametrize("cuts", [1, 2, 7, 1000])
def test_an_answer_in_words_is_one_message_wherever_split(cuts: int) -> None:
    answer = "It is \u00e9t\u00e9 \U0001f600."
    out, events = stream(json.dumps({"response": answer}), cuts)  # escaped, as the model may
    kinds = [d.type for d in parsed(events)]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(out.object())
    assert final.output_text == answer
    (message,) = final.output
    assert message.type == "message"


def test_a_call_cut_by_max_tokens_is_incomplete() -> None:
    out, _ = stream(written(CALL)[:52], finish=FinishReason.LENGTH)
    final = Response.model_validate(out.object())
    assert final.status == "incomplete" and final.incomplete_details is not None
    (call,) = final.output
    assert call.type == "function_call" and call.status == "incomplete"


def test_the_record_reads_back_with_the_same_call_ids() -> None:
    out, _ = stream(written(TWO))
    out.settings["tools"] = [WEATHER] * 60  # longer than one metadata entry
    record = out.record()
    assert len(record) > 1 and all(len(value) <= ENTRY_CHARS for value in record.values())
    back = ResponseDraft.from_record(out.id, record, "", written(TWO))
    assert back is not None and back.object() == out.object()
    assert ResponseDraft.from_record(out.id, {}, "", "") is None
    assert RECORD_KEY in record


def test_without_tools_the_message_opens_at_once() -> None:
    out = draft(tools=False)
    kinds = [d.type for d in parsed(list(out.opening()))]
    assert kinds[2:] == ["response.output_item.added", "response.content_part.added"]
    out.add(Chunk("Hello", 1, FinishReason.STOP))
    assert Response.model_validate(out.object()).output_text == "Hello"


def test_items_are_written_as_the_model_writes_calls_and_results() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "weather",
            "arguments": '{"city": "Paris"}',
        },
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "weather",
            "arguments": '{"city": "Rome"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "Rain"}],
        },
    ]
    written_items = input_items(body(input=items), {})
    assert (
        [(t.role, t.text) for t in written_items.history.turns]
        == [
            (Role.USER, "Weather in Paris and Rome?"),
            (Role.ASSISTANT, written(CALL)),  # each call a turn of its own
            (Role.ASSISTANT, written({"tool_calls": TWO["tool_calls"][1:]})),
            (Role.USER, '{"tool_response": {"name": "weather", "content": "Sunny"}}'),
        ]
    )
    assert written_items.prompt == '{"tool_response": {"name": "weather", "content": "Rain"}}'
    assert written_items.names == (
        "input[0].content",
        "input[1].arguments",
        "input[2].arguments",
        "input[3].output",
        "input[4].output",
    )
    assert not unknown_outputs(body(input=items))
    answer = [{"type": "function_call_output", "call_id": "c9", "output": "Hail"}]
    assert unknown_outputs(body(input=answer))
    prompt = input_items(body(input=answer), {"c9": "weather"}).prompt  # the previous response's
    assert '"name": "weather"' in prompt


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "function_call_output", "call_id": "c9", "output": "x"}], "input[0].call_id"),
        (
            [{"type": "function_call", "call_id": "c", "name": "weather", "arguments": "{}"}],
            "input[0].type",
        ),
        (
            [
                {"type": "function_call", "call_id": "c", "name": "weather", "arguments": "[1]"},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ],
            "input[0].arguments",
        ),
        ([{"role": "assistant", "content": "I speak last"}], "input[0].role"),
    ],
)
def test_items_that_do_not_fit_are_refused_by_name(items: list[Any], param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        input_items(body(input=items), {})
    assert info.value.field == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "name": "clock"}}, "tool_choice.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_choice_that_does_not_fit_the_tools_is_refused_by_name(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        tool_use(body(**fields))
    assert info.value.field == param


def test_the_choice_holds_the_answer() -> None:
    named = tool_use(body(tool_choice={"type": "function", "name": "weather"}))
    assert named is not None and named.named and named.name == "weather"
    single = tool_use(body(parallel_tool_calls=False))
    assert single is not None and '"maxItems": 1' in single.structure()[1]
    assert tool_use(body(tools=None)) is None


def test_a_stored_responses_input_items_come_back_from_its_turns() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ]
    sent = body(input=items)
    written = input_items(sent, {})
    turns = [*written.history.turns, Turn(Role.USER, written.prompt)]
    back = stored_items("resp_" + "b" * 32, input_record(sent), turns)
    assert [item["type"] for item in back] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
    ]
    assert back[0]["role"] == "developer" and back[1]["content"][0]["text"] == "Weather in Paris?"
    assert (back[2]["call_id"], back[2]["name"]) == ("c1", "weather")
    assert json.loads(back[2]["arguments"]) == {"city": "Paris"}
    assert (back[3]["call_id"], back[3]["output"]) == ("c1", "Sunny")
    assert len({item["id"] for item in back}) == 4
    for item in back:  # each as the SDK's own item types read it
        ITEMS.validate_python(item)
    # A session that kept fewer turns: the last items, with the same ids.
    assert stored_items("resp_" + "b" * 32, input_record(sent), turns[2:]) == back[2:]


def test_a_page_of_items_as_openais_lists() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    first = ItemPage(limit=2).list(items)
    assert [i["id"] for i in first["data"]] == ["i4", "i3"] and first["has_more"]
    rest = ItemPage(limit=2, after="i3").list(items)
    assert [i["id"] for i in rest["data"]] == ["i2", "i1"] and rest["has_more"]
    last = ItemPage(order="asc", limit=3, after="i1").list(items)
    assert [i["id"] for i in last["data"]] == ["i2", "i3", "i4"] and not last["has_more"]
    assert (last["first_id"], last["last_id"]) == ("i2", "i4")


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
        ({"include[]": "message.input_image.image_url"}, "include"),
    ],
)
def test_a_page_that_cannot_be_given_is_refused_by_name(query: dict[str, str], param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        ItemPage.of(query)
    assert info.value.field == param
    with pytest.raises(InvalidArgument) as unknown:
        ItemPage(after="nope").list([{"id": "i0"}])
    assert unknown.value.field == "after"


def test_log_probabilities_stream_with_their_text_and_stay_in_the_message() -> None:
    out = draft(tools=False)
    events = list(out.opening())
    tokens = (
        TokenLogprob(1, "Hel", -0.5, 1, ((1, "Hel", -0.5), (2, "Hi", -1.5))),
        TokenLogprob(2, "lo", -0.1, 1, ((2, "lo", -0.1),)),
    )
    events += out.add(Chunk("Hel", 1, None, logprobs=tokens[:1]))
    events += out.add(Chunk("lo", 1, FinishReason.STOP, logprobs=tokens[1:]))
    events += out.closing()
    docs = parsed(events)
    deltas = [d for d in docs if d.type == "response.output_text.delta"]
    assert [[p.token for p in d.logprobs] for d in deltas] == [["Hel"], ["lo"]]
    top = deltas[0].logprobs[0].top_logprobs
    assert top is not None and [(t.token, t.logprob) for t in top] == [("Hel", -0.5), ("Hi", -1.5)]
    final = Response.model_validate(out.object())
    (message,) = final.output
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None
    assert [(p.token, p.logprob, p.bytes) for p in part.logprobs] == [
        ("Hel", -0.5, list(b"Hel")),
        ("lo", -0.1, list(b"lo")),
    ]


def test_log_probabilities_are_asked_of_the_engine_when_included() -> None:
    sent = ResponseBody.model_validate(
        {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    )
    assert sampling_of(sent, None).logprobs == 2
    assert sampling_of(body(tools=None), None).logprobs is None


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("fmt", "structured"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, ("json_object", "")),
        (
            {"type": "json_schema", "name": "c", "schema": CITY_SCHEMA, "strict": True},
            ("json_schema", json.dumps(CITY_SCHEMA)),
        ),
    ],
)
def test_a_text_format_is_a_structured_output_as_chats_response_format(
    fmt: dict[str, Any] | None, structured: tuple[str, str] | None
) -> None:
    sent = ResponseBody.model_validate({"input": "hi", "text": {"format": fmt}})
    assert sampling_of(sent, None).structured == structured
    assert sent.field_names()["sampling.structured_output"] == "text.format"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"text": {"format": {"type": "json_schema", "name": "c", "description": "A city"}}},
            "text.format.description",
        ),
        (
            {
                "text": {"format": {"type": "json_object"}},
                "tools": [{"type": "function", "name": "f"}],
            },
            "text.format",
        ),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include"),
    ],
)
def test_sampling_that_cannot_be_given_is_refused_by_name(
    fields: dict[str, Any], param: str
) -> None:
    sent = ResponseBody.model_validate({"input": "hi", **fields})
    with pytest.raises(InvalidArgument) as info:
        sampling_of(sent, tool_use(sent))
    assert info.value.field == param


def test_settings_too_long_to_keep_are_refused_only_when_kept() -> None:
    big = {**WEATHER, "description": "x" * 4000}
    kept = body(tools=[big] * 30)
    with pytest.raises(InvalidArgument) as info:
        check_storable(kept, echoed(kept))
    assert info.value.field == "store"
    unkept = body(tools=[big] * 30, store=False)
    check_storable(unkept, echoed(unkept))  # nothing kept: nothing to fit
    check_storable(body(), echoed(body()))


def test_a_prompt_cache_key_is_the_affinity_before_the_conversation() -> None:
    assert affinity_of(body(prompt_cache_key="k"), "c0ffee") == "prompt_cache_key:k"
    assert affinity_of(body(), "c0ffee") == "c0ffee"
    assert affinity_of(body(), "") == ""


def test_stream_options_ask_for_obfuscation_or_not_and_only_with_a_stream() -> None:
    assert body(stream=True).obfuscated() and not body().obfuscated()
    options = {"include_obfuscation": False}
    assert not body(stream=True, stream_options=options).obfuscated()
    with pytest.raises(InvalidArgument, match="only with stream: true") as info:
        body(stream_options=options).obfuscated()
    assert info.value.field == "stream_options"
