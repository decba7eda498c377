"""A field this build's schema does not have is refused by name, wherever it is."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from llmmesh.convert import refuse_unknown_fields
from llmmesh.runtime.errors import InvalidArgument
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
    refuse_unknown_fields(request())


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
    with pytest.raises(InvalidArgument) as info:
        refuse_unknown_fields(message)
    assert info.value.field == field
    assert f"field number {number}" in info.value.reason
