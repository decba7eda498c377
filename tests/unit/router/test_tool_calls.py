"""Tool calling in chat completions: what the model is shown and held to, how earlier calls
and results are written for it, and how its JSON becomes OpenAI's tool_calls or content,
whole and streamed (split anywhere)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.structures import SHARED, check_structure
from llmmesh.types import Chunk, FinishReason, InferenceCall, Role
from services.router.openai_api import OpenAiApi
from services.router.openai_schema import ChatBody, Message
from services.router.tenants import Tenants
from services.router.tool_calls import answer_of, conversation, tool_use
from services.router.tool_stream import ToolStream, whole_answer
from services.router.upstreams import RouteHints
from tests.unit.router.test_core import Context, Inference, gate, make_core

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}
HI = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatBody:
    return ChatBody.model_validate({"messages": HI, "tools": [WEATHER, CLOCK], **fields})


def schema_of(body: ChatBody) -> dict[str, Any]:
    use = tool_use(body)
    assert use is not None
    kind, spec = use.structure()
    check_structure(kind, spec, partition=SHARED)  # the engine's compiler takes it
    return dict(json.loads(spec))


CALL = {"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}
TWO_CALLS = {"tool_calls": [CALL["tool_calls"][0], {"name": "clock", "arguments": {}}]}
ANSWER = {"response": "Hello"}


@pytest.mark.parametrize(
    ("fields", "valid", "invalid"),
    [
        ({}, [CALL, TWO_CALLS, ANSWER], [{"tool_calls": []}, {"response": 1}]),
        ({"tool_choice": "required"}, [CALL, TWO_CALLS], [ANSWER]),
        ({"parallel_tool_calls": False}, [CALL, ANSWER], [TWO_CALLS]),
        (
            {"tool_choice": {"type": "function", "function": {"name": "clock"}}},
            [{"tool_calls": [{"name": "clock", "arguments": {}}]}],
            [CALL, TWO_CALLS, ANSWER, {"tool_calls": [{"name": "clock", "arguments": {"a": 1}}]}],
        ),
    ],
)
def test_the_answer_is_held_to_the_choice(
    fields: dict[str, Any], valid: list[Any], invalid: list[Any]
) -> None:
    schema = schema_of(chat(**fields))
    for doc in valid:
        jsonschema.validate(doc, schema)
    for doc in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)
    wrong_city = {"tool_calls": [{"name": "weather", "arguments": {"city": 1}}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong_city, schema)


def test_the_model_is_shown_the_tools_it_may_call() -> None:
    use = tool_use(chat())
    assert use is not None
    shown = use.instructions()
    assert '{"name": "weather", "description": "The weather in a city", "parameters": ' in shown
    assert '{"name": "clock", "parameters": ' in shown and '{"response": ' in shown
    named = tool_use(chat(tool_choice={"type": "function", "function": {"name": "clock"}}))
    assert named is not None and "weather" not in named.instructions()
    assert "Call the tool clock" in named.instructions()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": [CLOCK, CLOCK]}, "tools[1].function.name"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_what_cannot_go_with_tools_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        tool_use(chat(**fields))
    assert refused.value.field.startswith(param)


def test_with_none_the_model_is_shown_the_tools_and_answers_in_words() -> None:
    assert tool_use(ChatBody.model_validate({"messages": HI})) is None
    assert tool_use(ChatBody.model_validate({"messages": HI, "tool_choice": "none"})) is None
    schema = schema_of(chat(tool_choice="none"))
    jsonschema.validate(ANSWER, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(CALL, schema)
    use = tool_use(chat(tool_choice="none"))
    assert use is not None and "weather" in use.instructions()


def test_a_tool_may_be_named_as_a_choice_is() -> None:
    auto = {"type": "function", "function": {"name": "auto"}}
    named = {"type": "function", "function": {"name": "auto"}}
    schema = schema_of(chat(tools=[WEATHER, auto], tool_choice=named))
    jsonschema.validate({"tool_calls": [{"name": "auto", "arguments": {}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(CALL, schema)


def messages(*docs: dict[str, Any]) -> list[Message]:
    return [Message.model_validate(doc) for doc in docs]


def called(arguments: str) -> dict[str, Any]:
    function = {"name": "weather", "arguments": arguments}
    return {"id": "c1", "type": "function", "function": function}


ASKED: dict[str, Any] = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [called('{"city": "Paris"}')]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}


def test_earlier_calls_and_results_are_written_as_the_model_writes_them() -> None:
    turns = conversation(messages(ASKED, CALLED, RESULT))
    assert turns == [
        (Role.USER, "Weather in Paris?"),
        (Role.ASSISTANT, json.dumps(CALL, separators=(", ", ": "))),
        (Role.USER, '{"tool_response": {"name": "weather", "content": "Sunny"}}'),
    ]


@pytest.mark.parametrize(
    ("docs", "param"),
    [
        ((ASKED, RESULT), "messages[1].tool_call_id"),
        ((ASKED, CALLED | {"content": "and"}), "messages[1].content"),
        ((ASKED | {"tool_calls": CALLED["tool_calls"]},), "messages[0].tool_calls"),
        ((ASKED | {"tool_call_id": "c1"},), "messages[0].tool_call_id"),
        ((ASKED, {"role": "tool", "content": "Sunny"}), "messages[1].tool_call_id"),
        (
            (ASKED, CALLED | {"tool_calls": [called("{")]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            (ASKED, CALLED | {"tool_calls": [called("[1]")]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (  # nested deeper than the parser goes
            (ASKED, CALLED | {"tool_calls": [called("[" * 100_000)]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_a_call_or_result_that_does_not_fit_is_refused_by_name(
    docs: tuple[dict[str, Any], ...], param: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        conversation(messages(*docs))
    assert refused.value.field == param


def test_the_models_json_becomes_openais_calls_or_content() -> None:
    content, calls = answer_of(json.dumps(TWO_CALLS))
    assert content is None
    assert [c["function"] for c in calls] == [
        {"name": "weather", "arguments": '{"city": "Paris"}'},
        {"name": "clock", "arguments": "{}"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert answer_of('{"response": "Hi \\"there\\""}') == ('Hi "there"', [])
    cut = '{"tool_calls": [{"name": "weather", "argu'  # max_tokens ended it
    assert answer_of(cut) == (cut, [])


def streamed(text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]]]:
    stream, deltas = ToolStream(), []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += stream.feed(text[start:end])
    last, calls = stream.end()
    deltas += last
    return "".join(d.get("content") or "" for d in deltas), calls


ESCAPED = json.dumps({"response": 'a "quote"\n\u00e9 \U0001f600 \\ end'})


@pytest.mark.parametrize("text", [ESCAPED, json.dumps({"response": "é😀"}, ensure_ascii=False)])
def test_an_answer_in_words_streams_the_same_wherever_it_is_split(text: str) -> None:
    whole = json.loads(text)["response"]
    for cut in range(len(text) + 1):
        assert streamed(text, [cut]) == (whole, []), cut
    assert streamed(text, list(range(1, len(text)))) == (whole, [])


def test_an_answer_in_words_streams_as_it_comes() -> None:
    stream = ToolStream()
    assert stream.feed('{"resp') == []
    assert stream.feed('onse": "Hel') == [{"content": "Hel"}]
    assert stream.feed("lo\\") == [{"content": "lo"}]  # the escape is not whole yet
    assert stream.feed('n"}') == [{"content": "\n"}]
    assert stream.end() == ([], [])


def accumulated(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls from their deltas, as OpenAI's SDK puts them together."""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return calls


TRICKY = {
    "tool_calls": [
        {"name": "weather", "arguments": {"city": 'Pa}r"is', "at": [1, {"x": "]}"}]}},
        {"name": "clock", "arguments": {}},
    ]
}


@pytest.mark.parametrize("doc", [CALL, TWO_CALLS, TRICKY])
def test_calls_stream_as_they_are_written_wherever_split(doc: dict[str, Any]) -> None:
    text = json.dumps(doc, ensure_ascii=False, separators=(", ", ": "))
    want = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in doc["tool_calls"]]
    for cuts in [*([cut] for cut in range(len(text) + 1)), list(range(1, len(text)))]:
        stream, deltas = ToolStream(), []
        for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
            deltas += stream.feed(text[start:end])
        last, calls = stream.end()
        got = accumulated(deltas + last)
        assert [(c["name"], c["arguments"]) for c in got] == want, cuts
        assert [c["id"] for c in got] == [c["id"] for c in calls] and len(calls) == len(want)
        assert not any("content" in d for d in deltas + last)


def test_a_call_goes_out_once_its_name_is_whole() -> None:
    stream = ToolStream()
    assert stream.feed('{"tool_calls": [{"name": "wea') == []
    ((header,),) = [d["tool_calls"] for d in stream.feed('ther", "argu')]
    assert header["function"] == {"name": "weather", "arguments": ""} and header["index"] == 0
    (piece,) = stream.feed('ments": {"ci')
    assert piece["tool_calls"][0]["function"] == {"arguments": '{"ci'}
    stream.feed('ty": "Paris"}}]}')
    function = {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert stream.end() == ([], [{"id": header["id"], "type": "function", "function": function}])


def test_a_whole_answer_is_read_as_a_streamed_one() -> None:
    """The same arguments' text whole as streamed: as the model wrote it."""
    escaped = '{"tool_calls": [{"name": "weather", "arguments": {"city": "\\u00e9"}}]}'
    content, (call,) = whole_answer(escaped)
    assert content is None and call["function"]["arguments"] == '{"city": "\\u00e9"}'
    assert whole_answer('{"response": "Hi"}') == ("Hi", [])
    assert whole_answer('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])


def test_text_that_leaves_the_layout_goes_out_as_content() -> None:
    """An output rule may change the model's JSON: what cannot be read as calls is
    content, whole, at the end; what went out as calls before stays."""
    assert streamed("[REDACTED] and more", [3]) == ("[REDACTED] and more", [])
    text = json.dumps(CALL, separators=(", ", ": "))[:-2] + "[REDACTED]"
    content, calls = streamed(text, [5, 40])
    assert content == "[REDACTED]" and [c["function"]["name"] for c in calls] == ["weather"]


@dataclass
class Scripted(Inference):
    """Answers every call with ``text``, in chunks of 5 characters."""

    text: str = ""

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        self.calls.append(call)
        pieces = [self.text[i : i + 5] for i in range(0, len(self.text), 5)]
        for piece in pieces[:-1]:
            yield Chunk(piece, 1)
        yield Chunk(pieces[-1], 1, FinishReason.STOP)


async def post(
    inference: Inference,
    doc: dict[str, Any],
    headers: dict[str, str] | None = None,
    context: Context | None = None,
) -> tuple[int, str]:
    core = make_core(gate(), context or Context(), inference)
    api = OpenAiApi(core, Tenants(), ["llm"])
    async with TestClient(TestServer(api.app())) as client:
        response = await client.post("/v1/chat/completions", json=doc, headers=headers)
        return response.status, await response.text()


def test_a_named_call_finishes_as_stop() -> None:
    inference = Scripted(text=json.dumps(CALL))
    named = {"type": "function", "function": {"name": "weather"}}
    doc = {"model": "llm", "messages": HI, "tools": [WEATHER], "tool_choice": named}
    status, text = asyncio.run(post(inference, doc))
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "stop"


def test_in_a_session_the_tools_are_shown_and_never_stored() -> None:
    """A session keeps the conversation, the calls and results in the model's JSON; the
    tools are the request's, shown before the conversation."""
    inference, context = Scripted(text=json.dumps(CALL)), Context()
    doc = {"model": "llm", "messages": [ASKED], "tools": [WEATHER], "max_tokens": 64}
    session = {"x-session-id": "s1"}
    status, _ = asyncio.run(post(inference, doc, session, context))
    assert status == 200
    result = {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}
    doc["messages"] = [ASKED, CALLED, result]
    status, _ = asyncio.run(post(inference, doc, session, context))
    assert status == 200
    ((_, turns),) = context.sessions.items()
    stored = [t.text for t in turns]
    assert stored == [
        ASKED["content"],
        json.dumps(CALL),
        '{"tool_response": {"name": "weather", "content": "Sunny"}}',
        json.dumps(CALL),
    ]
    second = inference.calls[1].prompt
    assert second.index("The weather in a city") < second.index("Weather in Paris?")


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("refusal", None, 200),
        ("annotations", [], 200),
        ("function_call", None, 200),
        ("refusal", "I will not.", 400),
        ("annotations", [{"type": "url_citation"}], 400),
        ("audio", {"id": "a1"}, 400),
    ],
)
def test_a_reply_sent_back_as_it_came_is_taken_where_it_says_nothing(
    field: str, value: Any, status: int
) -> None:
    sent_back = {"role": "assistant", "content": "Hi.", field: value}
    doc = {"model": "llm", "messages": [ASKED, sent_back, ASKED], "max_tokens": 2}
    got, text = asyncio.run(post(Inference(), doc))
    assert got == status, text
    if status == 400:
        assert json.loads(text)["error"]["param"] == f"messages[1].{field}"


def test_tokenize_counts_the_tools_as_a_chat_completion_shows_them() -> None:
    """vLLM's /tokenize with tools: the tokens of the prompt the chat would send (the
    tiny model's tokens are bytes)."""

    async def scenario(inference: Inference) -> tuple[int, int, int]:
        core = make_core(gate(), Context(), inference)
        api = OpenAiApi(core, Tenants(), ["llm"])
        doc = {"model": "llm", "messages": [ASKED], "tools": [WEATHER]}
        async with TestClient(TestServer(api.app())) as client:
            with_tools = await (await client.post("/tokenize", json=doc)).json()
            without = await (await client.post("/tokenize", json={**doc, "tools": None})).json()
            refused = await client.post("/tokenize", json={"prompt": "hi", "tools": [WEATHER]})
            assert (await refused.json())["error"]["param"] == "tools"
            chat = await client.post("/v1/chat/completions", json=doc | {"max_tokens": 64})
            assert chat.status == 200, await chat.text()
        return with_tools["count"], without["count"], refused.status

    inference = Scripted(text=json.dumps(CALL))
    with_tools, without, refused = asyncio.run(scenario(inference))
    assert with_tools == len(inference.calls[0].prompt.encode()) > without
    assert refused == 400
