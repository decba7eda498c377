"""Requests that do not parse are diagnosed down to the offending field."""

from __future__ import annotations

from llmmesh.runtime.registration import MalformedRequest, _lenient
from llmmesh.v1 import generation_pb2


def _field(number: int, payload: bytes) -> bytes:
    return bytes([(number << 3) | 2, len(payload)]) + payload


def test_invalid_utf8_in_a_top_level_string_is_named() -> None:
    data = _field(1, b"llm") + _field(2, b"bad \xff\xfe prompt")
    parsed = _lenient(generation_pb2.GenerateRequest)(data)
    assert isinstance(parsed, MalformedRequest)
    assert parsed.error.field == "prompt"


def test_invalid_utf8_in_a_nested_string_is_named() -> None:
    sampling = _field(6, b"\xc3\x28")  # SamplingParams.stop
    parsed = _lenient(generation_pb2.GenerateRequest)(_field(3, sampling))
    assert isinstance(parsed, MalformedRequest)
    assert parsed.error.field == "sampling.stop"


def test_valid_request_parses_normally() -> None:
    message = generation_pb2.GenerateRequest(prompt="ok ✓")
    parsed = _lenient(generation_pb2.GenerateRequest)(message.SerializeToString())
    assert parsed == message


def test_garbage_is_reported_as_unparseable() -> None:
    parsed = _lenient(generation_pb2.GenerateRequest)(b"\xff\xff\xff")
    assert isinstance(parsed, MalformedRequest)
    assert parsed.error.field == "request"
