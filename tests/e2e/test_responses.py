"""The Responses API with the official `openai` SDK against the real stack: whole and
streamed, conversations by ``previous_response_id`` kept in the context service (branches,
instructions that are not carried over, truncation), ``store: false``, tenant isolation,
function tools (calls made, answered and stored), and refusals in OpenAI's shape before
anything is stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import grpc
import openai
import pytest
from openai.types.responses import (
    FunctionToolParam,
    ResponseInputItemParam,
    ToolChoiceFunctionParam,
)
from pydantic import BaseModel

from llmmesh.client import internal_channel
from llmmesh.launcher import Stack
from llmmesh.v1 import context_pb2, context_pb2_grpc
from tests.e2e.test_tenants import http_tenant_router

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars

TINY: dict[str, Any] = {"model": "llm", "max_output_tokens": 6, "temperature": 0.0}


@dataclass(frozen=True)
class Tenants:
    alice: openai.OpenAI
    bob: openai.OpenAI
    context: context_pb2_grpc.ContextStub

    def session(self, response_id: str, tenant: str = "alice") -> context_pb2.Session | None:
        try:
            request = context_pb2.LoadSessionRequest(tenant=tenant, session_id=response_id)
            return self.context.LoadSession(request, timeout=5)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            return None

    def session_ids(self, tenant: str = "alice") -> list[str]:
        listed = self.context.ListSessions(context_pb2.ListSessionsRequest(tenant=tenant))
        return list(listed.session_ids)


@pytest.fixture(scope="module")
def tenants(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    """A router with two tenants over the stack's services (its context service too)."""
    tmp = tmp_path_factory.mktemp("responses")
    pair: dict[str, dict[str, object]] = {"alice": {"id": "alice"}, "bob": {"id": "bob"}}
    with (
        http_tenant_router(stack, tmp, pair) as (base, keys),
        internal_channel(stack.address("context"), stack.internal_token) as channel,
    ):
        yield Tenants(
            openai.OpenAI(base_url=base, api_key=keys["alice"], max_retries=0),
            openai.OpenAI(base_url=base, api_key=keys["bob"], max_retries=0),
            context_pb2_grpc.ContextStub(channel),
        )


def test_a_whole_response_as_the_sdk_parses_it(tenants: Tenants) -> None:
    response = tenants.alice.responses.create(
        input="Hello there", instructions="Be brief.", metadata={"case": "whole"}, **TINY
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text and response.usage is not None
    assert response.usage.output_tokens == 6
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    assert (response.instructions, response.metadata) == ("Be brief.", {"case": "whole"})
    stored = tenants.alice.responses.retrieve(response.id)
    assert stored.output_text == response.output_text and stored.usage == response.usage
    assert stored.instructions == "Be brief." and stored.metadata == {"case": "whole"}


def test_a_streamed_response_is_the_sdks_event_sequence(tenants: Tenants) -> None:
    events = list(tenants.alice.responses.create(input="Once upon a", stream=True, **TINY))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Each delta padded to hide its text's length (stream obfuscation, on by default).
    padded = [getattr(e, "obfuscation", None) for e in events if e.type.endswith(".delta")]
    assert None not in padded
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == text and last.response.usage is not None
    assert tenants.alice.responses.retrieve(last.response.id).output_text == text


def test_three_turns_by_previous_response_id_and_a_branch(tenants: Tenants) -> None:
    """Each response's session holds the conversation through its answer, the next turn's
    prompt grows by it, and a second answer to an earlier response branches without
    touching the first branch."""
    first = tenants.alice.responses.create(input="My name is Ada.", **TINY)
    second = tenants.alice.responses.create(
        input="I like tea.", previous_response_id=first.id, **TINY
    )
    third = tenants.alice.responses.create(
        input="What is my name?", previous_response_id=second.id, **TINY
    )
    assert first.usage and second.usage and third.usage
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    # Turn 3's prompt starts with turn 2's prompt and answer: read from the prefix cache.
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16
    stored = tenants.session(third.id)
    assert stored is not None
    assert [t.text for t in stored.turns] == [
        "My name is Ada.",
        first.output_text,
        "I like tea.",
        second.output_text,
        "What is my name?",
        third.output_text,
    ]
    # The conversation's responses share their first 16 hex digits (replica affinity).
    assert first.id[:21] == second.id[:21] == third.id[:21] and first.id != second.id
    branch = tenants.alice.responses.create(
        input="I like coffee.", previous_response_id=first.id, **TINY
    )
    branched, kept = tenants.session(branch.id), tenants.session(second.id)
    assert branched is not None and kept is not None
    assert [t.text for t in branched.turns][2] == "I like coffee."
    assert [t.text for t in kept.turns][2] == "I like tea." and len(kept.turns) == 4


def test_instructions_are_the_responses_own_and_items_continue_it(tenants: Tenants) -> None:
    first = tenants.alice.responses.create(input="Hi", instructions="Answer in French.", **TINY)
    second = tenants.alice.responses.create(
        input=[
            {"role": "developer", "content": "Use short words."},
            {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]},
        ],
        previous_response_id=first.id,
        **TINY,
    )
    assert tenants.alice.responses.retrieve(second.id).instructions is None
    stored = tenants.session(second.id)
    assert stored is not None and stored.system_prompt == ""  # not carried over
    roles = [context_pb2.Role.Name(t.role) for t in stored.turns]
    assert roles[2:] == ["ROLE_SYSTEM", "ROLE_USER", "ROLE_ASSISTANT"]
    assert [t.text for t in stored.turns][2:4] == ["Use short words.", "And now?"]


def test_store_false_keeps_nothing(tenants: Tenants) -> None:
    kept = tenants.alice.responses.create(input="Remember this.", **TINY)
    before = tenants.session_ids()
    alone = tenants.alice.responses.create(input="Forget this.", store=False, **TINY)
    after = tenants.alice.responses.create(
        input="And this.", previous_response_id=kept.id, store=False, **TINY
    )
    assert after.usage and kept.usage and after.usage.input_tokens > kept.usage.input_tokens
    assert tenants.session_ids() == before  # no session made, none grew
    stored = tenants.session(kept.id)
    assert stored is not None and len(stored.turns) == 2
    for response in (alone, after):
        with pytest.raises(openai.NotFoundError):
            tenants.alice.responses.retrieve(response.id)


def test_another_tenants_response_is_not_found(tenants: Tenants) -> None:
    mine = tenants.alice.responses.create(input="Private.", **TINY)
    with pytest.raises(openai.NotFoundError) as info:
        tenants.bob.responses.retrieve(mine.id)
    assert info.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as continued:
        tenants.bob.responses.create(input="Go on.", previous_response_id=mine.id, **TINY)
    assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        tenants.bob.responses.delete(mine.id)
    assert tenants.session_ids("bob") == []
    assert tenants.alice.responses.retrieve(mine.id).output_text == mine.output_text
    tenants.alice.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        tenants.alice.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        tenants.alice.responses.retrieve("resp_not-an-id")


def test_truncation_disabled_refuses_what_auto_cuts(tenants: Tenants) -> None:
    long = "word " * 300  # 1,500 tokens of the tiny model's 2,048
    first = tenants.alice.responses.create(input=long, **TINY)
    before = tenants.session_ids()
    with pytest.raises(openai.BadRequestError) as info:
        tenants.alice.responses.create(input=long, previous_response_id=first.id, **TINY)
    assert info.value.body["param"] == "input"  # type: ignore[index]
    assert "truncation" in info.value.message
    assert tenants.session_ids() == before  # the refused one's fork is gone
    cut = tenants.alice.responses.create(
        input=long, previous_response_id=first.id, truncation="auto", **TINY
    )
    assert cut.usage and first.usage and cut.usage.input_tokens < 2 * first.usage.input_tokens


def test_refusals_name_the_parameter_and_store_nothing(tenants: Tenants) -> None:
    first = tenants.alice.responses.create(input="Hello", **TINY)
    before = tenants.session_ids()
    with pytest.raises(openai.PermissionDeniedError, match="deny-weapons") as denied:
        tenants.alice.responses.create(
            input="hi", instructions="how to build a bomb", previous_response_id=first.id, **TINY
        )
    assert denied.value.code == "policy_violation"
    assert denied.value.body["param"] == "instructions"  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError, match="deny-weapons"):
        tenants.alice.responses.create(
            input=[
                {"role": "user", "content": "how to build a bomb"},
                {"role": "user", "content": "ok"},
            ],
            **TINY,
        )
    refusals: dict[str, dict[str, Any]] = {
        "tools[0].type": {"tools": [{"type": "web_search"}]},
        "tool_choice.name": {
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"},
        },
        "input[0].role": {"input": [{"role": "assistant", "content": "I speak last"}]},
        "reasoning": {"extra_body": {"reasoning": {"effort": "low"}}},
        "text.format": {"text": {"format": {"type": "xml"}}},
        "input": {"input": []},
        "user": {"user": "u" * 600},
        # The core's own checks, named as this API names the field.
        "max_output_tokens": {"max_output_tokens": 5000},
        "temperature": {"temperature": -1.0},
        # Chat's session header: a response's conversation is its previous_response_id.
        "x-session-id": {"extra_headers": {"x-session-id": "s-1"}},
    }
    nonsense = {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}
    asked = [*refusals.items(), ("text.format", {"text": {"format": nonsense}})]
    for param, kwargs in asked:
        with pytest.raises(openai.BadRequestError) as info:
            tenants.alice.responses.create(**{"input": "hi", **TINY, **kwargs})
        assert info.value.body["param"] == param, kwargs  # type: ignore[index]
    assert tenants.session_ids() == before
    for session_id in before:
        stored = tenants.session(session_id)
        assert stored is not None and "bomb" not in str(stored)


CITY: FunctionToolParam = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": None,
}


def output(call_id: str, text: str) -> ResponseInputItemParam:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def test_a_function_call_is_made_answered_and_stored(tenants: Tenants) -> None:
    """The model is held to a call of the named function; its output's call is answered
    by ``previous_response_id`` and a function_call_output; the stored conversation holds
    the call and its result as the model's JSON, and the response reads back the same."""
    named: ToolChoiceFunctionParam = {"type": "function", "name": "weather"}
    asked: dict[str, Any] = {**TINY, "max_output_tokens": 120, "tools": [CITY]}
    called = tenants.alice.responses.create(input="Weather?", tool_choice=named, **asked)
    assert called.status == "completed" and called.output_text == ""
    (call,) = called.output
    assert call.type == "function_call" and call.name == "weather"
    assert json.loads(call.arguments)["city"] in {"Paris", "Rome"}
    assert tenants.alice.responses.retrieve(called.id).output == called.output
    assert [t.name for t in called.tools] == ["weather"]
    answered = tenants.alice.responses.create(
        input=[output(call.call_id, "Sunny")],
        previous_response_id=called.id,
        tool_choice="none",
        tools=[CITY],
        **TINY,
    )
    (message,) = answered.output
    assert message.type == "message" and answered.status in {"completed", "incomplete"}
    (given,) = tenants.alice.responses.input_items.list(answered.id).data
    assert given.model_dump(include={"type", "call_id", "output"}) == {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": "Sunny",
    }
    stored = tenants.session(answered.id)
    assert stored is not None
    texts = [t.text for t in stored.turns]
    assert json.loads(texts[1]) == {
        "tool_calls": [{"name": "weather", "arguments": json.loads(call.arguments)}]
    }
    assert json.loads(texts[2]) == {"tool_response": {"name": "weather", "content": "Sunny"}}
    # The tools are shown to the model, never stored as what it reads (the response
    # object's echo of them is the record's, beside the client's metadata).
    assert not any("The weather in a city" in text for text in [stored.system_prompt, *texts])


def test_the_calls_output_items_sent_back_carry_a_conversation_without_storing(
    tenants: Tenants,
) -> None:
    """As clients that keep the conversation themselves do: the response's output items
    sent back as input, then the call's output, with ``store: false``."""
    asked: dict[str, Any] = {**TINY, "tools": [CITY], "store": False}
    question: ResponseInputItemParam = {"role": "user", "content": "Weather?"}
    one: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
    called = tenants.alice.responses.create(
        input=[question], **one, **{**asked, "max_output_tokens": 120}
    )
    (call,) = called.output
    assert call.type == "function_call"
    sent_back = [
        cast(ResponseInputItemParam, item.model_dump(exclude_unset=True)) for item in called.output
    ]
    before = tenants.session_ids()
    items = [question, *sent_back, output(call.call_id, "Sunny")]
    answered = tenants.alice.responses.create(input=items, **asked)
    assert answered.output and answered.usage and called.usage
    # The call and its output are in what the model read.
    assert answered.usage.input_tokens > called.usage.input_tokens + 10
    assert tenants.session_ids() == before


def test_function_calls_stream_as_the_sdk_accumulates_them(tenants: Tenants) -> None:
    asked: dict[str, Any] = {**TINY, "max_output_tokens": 120, "tools": [CITY]}
    one: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
    with tenants.alice.responses.stream(input="Weather?", **one, **asked) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") >= 1
    assert "response.output_text.delta" not in kinds
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in {"Paris", "Rome"}
    (stored,) = tenants.alice.responses.retrieve(final.id).output
    assert stored.model_dump() == call.model_dump(exclude={"parsed_arguments"})


def test_an_output_must_answer_a_call(tenants: Tenants) -> None:
    first = tenants.alice.responses.create(input="Hello", **TINY)
    before = tenants.session_ids()
    unknown = output("call_x", "Sunny")
    with pytest.raises(openai.BadRequestError) as info:
        tenants.alice.responses.create(input=[unknown], previous_response_id=first.id, **TINY)
    assert info.value.body["param"] == "input[0].call_id"  # type: ignore[index]
    assert tenants.session_ids() == before


class Pick(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


def test_the_sdks_parse_gets_an_instance_of_its_model(tenants: Tenants) -> None:
    """``responses.parse`` sends the model's JSON schema as text.format: the answer is held
    to it, parsed by the SDK, echoed and read back the same."""
    parsed = tenants.alice.responses.parse(
        input="Pick one.", text_format=Pick, **{**TINY, "max_output_tokens": 60}
    )
    assert isinstance(parsed.output_parsed, Pick)
    assert parsed.text is not None and parsed.text.format is not None
    assert parsed.text.format.type == "json_schema"
    stored = tenants.alice.responses.retrieve(parsed.id)
    assert Pick.model_validate_json(stored.output_text) == parsed.output_parsed


def test_a_responses_input_items_are_listed_page_by_page(tenants: Tenants) -> None:
    """``responses.input_items.list``: the items the response was given (not the earlier
    responses'), newest first by default, the SDK following the pages."""
    first = tenants.alice.responses.create(input="My name is Ada.", **TINY)
    given: list[ResponseInputItemParam] = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "I like tea."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What do I like?"},
    ]
    second = tenants.alice.responses.create(input=given, previous_response_id=first.id, **TINY)
    listed = [
        item.model_dump() for item in tenants.alice.responses.input_items.list(second.id, limit=3)
    ]
    texts = [item["content"][0]["text"] for item in listed]
    assert texts == ["What do I like?", "Noted.", "I like tea.", "Answer in French."]
    assert [item["role"] for item in listed] == ["user", "assistant", "user", "developer"]
    ascending = tenants.alice.responses.input_items.list(second.id, order="asc")
    assert [item.id for item in ascending.data] == [item["id"] for item in reversed(listed)]
    (only,) = tenants.alice.responses.input_items.list(first.id).data
    assert only.model_dump()["content"][0]["text"] == "My name is Ada."
    with pytest.raises(openai.NotFoundError):
        tenants.bob.responses.input_items.list(second.id)


def test_log_probabilities_come_with_the_text_when_included(tenants: Tenants) -> None:
    asked: dict[str, Any] = {**TINY, "include": ["message.output_text.logprobs"]}
    whole = tenants.alice.responses.create(input="Once upon a", top_logprobs=2, **asked)
    (message,) = whole.output
    assert message.type == "message" and whole.usage is not None
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None
    assert len(part.logprobs) == whole.usage.output_tokens == 6
    assert "".join(p.token for p in part.logprobs) == whole.output_text
    assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in part.logprobs)
    events = list(tenants.alice.responses.create(input="Once upon a", stream=True, **asked))
    streamed = [p for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    assert len(streamed) == 6 and all(p.top_logprobs == [] for p in streamed)
    with pytest.raises(openai.BadRequestError) as info:
        tenants.alice.responses.retrieve(whole.id, include=["message.output_text.logprobs"])
    assert info.value.body["param"] == "include"  # type: ignore[index]
