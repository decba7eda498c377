"""A request field this build's schema does not have is refused, naming where it is."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from llmmesh.runtime.registration import MalformedRequest, _lenient, unknown_field
from llmmesh.v1 import common_pb2, context_pb2, generation_pb2


def unknown_varint(number: int) -> bytes:
    """A field ``number`` holding the integer 1, as a newer schema would send it."""
    tag, encoded = number << 3, bytearray()
    while tag > 0x7F:
        encoded.append(tag & 0x7F | 0x80)
        tag >>= 7
    return bytes([*encoded, tag, 1])


def request(sampling_extra: bytes = b"", extra: bytes = b"") -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=3).SerializeToString() + sampling_extra
    message = generation_pb2.GenerateRequest(
        model="llm", prompt="hi", sampling=common_pb2.SamplingParams.FromString(sampling)
    )
    return generation_pb2.GenerateRequest.FromString(message.SerializeToString() + extra)


def test_a_request_of_known_fields_passes() -> None:
    assert unknown_field(request()) is None


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [
        (request(extra=unknown_varint(99)), "GenerateRequest", 99),
        (request(sampling_extra=unknown_varint(40)), "sampling", 40),
        (
            context_pb2.Session.FromString(
                context_pb2.Session(
                    turns=[
                        context_pb2.Turn(text="a"),
                        context_pb2.Turn.FromString(
                            context_pb2.Turn(text="b").SerializeToString() + unknown_varint(2000)
                        ),
                    ]
                ).SerializeToString()
            ),
            "turns[1]",
            2000,
        ),
    ],
    ids=["top-level", "nested", "in-a-list"],
)
def test_an_unknown_field_is_refused_naming_where_it_is(
    message: Message, field: str, number: int
) -> None:
    refusal = unknown_field(message)
    assert refusal is not None and refusal.field == field
    assert f"field number {number}" in refusal.reason


def test_the_deserializer_refuses_unknown_fields_and_takes_any_known_encoding() -> None:
    deserialize = _lenient(generation_pb2.GenerateRequest)
    known = request().SerializeToString()
    assert deserialize(known) == request()
    refused = deserialize(known + unknown_varint(99))
    assert isinstance(refused, MalformedRequest) and refused.error.field == "GenerateRequest"
    # Known fields, not in their shortest encoding (sampling's max_tokens, 3, as a
    # two-byte varint): no unknown field, so taken, though its size is not the message's.
    padded = b"\x0a\x03llm" + b"\x1a\x03" + b"\x08\x83\x00"
    taken = deserialize(padded)
    assert isinstance(taken, generation_pb2.GenerateRequest)
    assert (taken.model, taken.sampling.max_tokens) == ("llm", 3)
