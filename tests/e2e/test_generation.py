"""Generation through the router, against the real stack (Triton with the reference model)."""

from __future__ import annotations

import re

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack
from llmmesh.v1 import common_pb2, generation_pb2_grpc
from tests.conftest import collect, text_of

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars


def test_tokens_stream_with_usage_at_the_end(
    router_channel: grpc.Channel,
) -> None:
    responses = collect(router_channel, "Once upon a time", max_tokens=32, seed=3, ignore_eos=True)
    first, last = responses[0], responses[-1]
    assert first.request_id and first.model == "llm"
    # The default rules redact PII in the output, so a word is held back until the
    # character after it shows it is not the start of an address. The engine sends a
    # sequence's text after tokens 1, 3, 7, 15 and 31 at the latest (more often when it
    # runs alone), so the first words come long before the end, whatever else it runs.
    # How many responses carry them depends on the machine's load: a relay that fell
    # behind sends what arrived together as one, so the first response may hold several
    # words (where each is released is the unit tests' of the check and the engine).
    text = text_of(responses)
    boundaries = len(re.findall(r"\s+", text.rstrip()))
    assert boundaries >= 4, "seed 3 gives text with spaces"
    assert len(responses) >= 2, "tokens were not streamed as they were generated"
    assert 0 < len(first.text) < len(text), "the text was held back to the end"
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 32
    assert last.usage.prompt_tokens == len("Once upon a time") + 1  # bytes plus BOS
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert len(text) == 32


def test_same_seed_gives_same_text(router_channel: grpc.Channel) -> None:
    a = text_of(collect(router_channel, "seeded", max_tokens=24, seed=5, ignore_eos=True))
    b = text_of(collect(router_channel, "seeded", max_tokens=24, seed=5, ignore_eos=True))
    c = text_of(collect(router_channel, "seeded", max_tokens=24, seed=6, ignore_eos=True))
    assert a == b != c


def test_min_p_of_one_draws_only_the_likeliest_token(router_channel: grpc.Channel) -> None:
    """vLLM's min_p reaches the engine: at 1 only the likeliest token is left to draw,
    so every seed writes the greedy text (which seeds alone do not)."""
    asked = {"max_tokens": 16, "ignore_eos": True}
    greedy = text_of(collect(router_channel, "min-p", temperature=0.0, **asked))
    drawn = {text_of(collect(router_channel, "min-p", seed=s, **asked)) for s in range(3)}
    kept = {text_of(collect(router_channel, "min-p", seed=s, min_p=1.0, **asked)) for s in range(3)}
    assert kept == {greedy} and drawn != {greedy}


def test_a_stop_token_ends_the_stream_with_its_text(router_channel: grpc.Channel) -> None:
    asked = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    free = text_of(collect(router_channel, "stop token", **asked))
    token = ord(free[30])  # the byte model: a character's token is its byte
    responses = collect(router_channel, "stop token", stop_token_ids=[token], **asked)
    assert text_of(responses) == free[: free.index(chr(token)) + 1]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_only_allowed_tokens_are_generated(router_channel: grpc.Channel) -> None:
    allowed = [ord(c) for c in "xyz"]
    text = text_of(collect(router_channel, "allowed", max_tokens=16, allowed_token_ids=allowed))
    assert len(text) == 16 and set(text) <= set("xyz")


def test_bad_words_never_come_out(router_channel: grpc.Channel) -> None:
    asked = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    free = text_of(collect(router_channel, "bad words", **asked))
    word = free[20:23]
    held = text_of(collect(router_channel, "bad words", bad_words=[word], **asked))
    assert word in free and word not in held and len(held) == 40


def test_stop_string_ends_the_stream(router_channel: grpc.Channel) -> None:
    free = text_of(collect(router_channel, "stop", max_tokens=48, temperature=0.0, ignore_eos=True))
    stop = free[30:33]
    responses = collect(
        router_channel, "stop", max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop]
    )
    assert text_of(responses) == free[: free.index(stop)]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    kept = collect(
        router_channel,
        "stop",
        max_tokens=48,
        temperature=0.0,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert text_of(kept) == free[: free.index(stop) + len(stop)]


def test_default_max_tokens_applies_when_unset(router_channel: grpc.Channel) -> None:
    responses = collect(router_channel, "defaults", ignore_eos=True)
    assert responses[-1].usage.completion_tokens == 128


def test_request_id_from_metadata_is_echoed(stack: Stack) -> None:
    from llmmesh.v1 import generation_pb2_grpc

    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(
            build_request("id", max_tokens=2), metadata=(("x-request-id", "my-id-1"),)
        )
        responses = list(call)
        assert dict(call.trailing_metadata())["x-request-id"] == "my-id-1"
    assert responses[0].request_id == "my-id-1"


def test_canary_model_serves_with_other_weights(router_channel: grpc.Channel) -> None:
    kwargs = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    stable = collect(router_channel, "same prompt", model="llm", **kwargs)
    canary = collect(router_channel, "same prompt", model="llm_canary", **kwargs)
    assert canary[0].model == "llm_canary"
    assert canary[-1].usage.completion_tokens == 24
    assert text_of(canary) != text_of(stable)


def test_prompt_logprobs_come_on_the_first_response(router_channel: grpc.Channel) -> None:
    request = build_request("Once upon a time", max_tokens=4, seed=2)
    request.sampling.prompt_logprobs = 1
    stub = generation_pb2_grpc.GenerationStub(router_channel)
    responses = list(stub.Generate(request, timeout=60))
    scored = responses[0].prompt_logprobs
    assert [t.text for t in scored] == list("Once upon a time")
    assert all(t.rank >= 1 and len(t.top) == 1 and t.logprob <= 0.0 for t in scored)
    assert all(not r.prompt_logprobs for r in responses[1:])
    request.sampling.prompt_logprobs = 21
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs" in (refused.value.details() or "")


def test_token_ids_come_with_each_response_and_the_prompts_with_the_first(
    router_channel: grpc.Channel,
) -> None:
    request = build_request("Once upon", max_tokens=6, seed=2, ignore_eos=True)
    request.sampling.return_token_ids = True
    responses = list(
        generation_pb2_grpc.GenerationStub(router_channel).Generate(request, timeout=60)
    )
    assert list(responses[0].prompt_token_ids) == [256, *b"Once upon"]
    assert all(not r.prompt_token_ids for r in responses[1:])
    assert bytes(i for r in responses for i in r.token_ids) == text_of(responses).encode()
    assert all(not r.logprobs for r in responses)  # not asked


def test_a_prompt_of_token_ids_is_read_as_given(router_channel: grpc.Channel) -> None:
    """The byte model's BOS and the text's bytes are the text's own prompt."""
    by_text = collect(router_channel, "Once upon", max_tokens=6, seed=4, ignore_eos=True)
    request = build_request("", max_tokens=6, seed=4, ignore_eos=True)
    request.prompt_token_ids.extend([256, *b"Once upon"])
    stub = generation_pb2_grpc.GenerationStub(router_channel)
    by_ids = list(stub.Generate(request, timeout=60))
    assert text_of(by_ids) == text_of(by_text)
    assert by_ids[-1].usage.prompt_tokens == by_text[-1].usage.prompt_tokens == 10
    refusals = {
        "prompt": ("Once upon", [104]),  # both: which is the prompt?
        "control": ("", [104, 257]),  # the byte model's EOS: no text to check
        "session": ("", [104]),
    }
    for name, (text, ids) in refusals.items():
        bad = build_request(text, max_tokens=2, session_id="s-1" if name == "session" else "")
        bad.prompt_token_ids.extend(ids)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(bad, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "prompt_token_ids" in (refused.value.details() or ""), name


def test_asked_to_each_response_is_padded_to_hide_its_texts_length(
    router_channel: grpc.Channel,
) -> None:
    """GenerateRequest.obfuscate: every response a multiple of 64 bytes; not asked, none
    padded (the text itself is the same)."""
    stub = generation_pb2_grpc.GenerationStub(router_channel)
    request = build_request("Once upon a time", max_tokens=24, seed=3, ignore_eos=True)
    plain = list(stub.Generate(request, timeout=60))
    request.obfuscate = True
    padded = list(stub.Generate(request, timeout=60))
    assert text_of(padded) == text_of(plain) and len(padded) >= 2
    assert all(r.ByteSize() % 64 == 0 and r.obfuscation for r in padded)
    assert not any(r.obfuscation for r in plain)
