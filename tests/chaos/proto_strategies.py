"""Hypothesis strategies for any protobuf message, built from its descriptor: every
field of every public RPC's request is fuzzed with values of its type across the type's
whole range (and past what the services accept), nested messages and maps included."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# Texts: anything Unicode that protobuf can carry (no lone surrogates), biased towards
# the shapes services parse: names, numbers, whitespace, long runs.
_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=64),
    st.sampled_from(["", " ", "\n\t", "llm", "stable", "0", "-1", "a" * 5000, "x/y", "é"]),
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INTS:
        low, high = _INTS[kind]
        return st.one_of(
            st.integers(low, high), st.sampled_from([low, high, 0, 1, -1 if low else 0])
        )
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        if kind == FieldDescriptor.TYPE_FLOAT:
            return st.floats(width=32, allow_nan=True, allow_infinity=True)
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 50))
    raise TypeError(f"no strategy for field {field.full_name}")


def messages(
    descriptor: Descriptor, cls: type[Message], depth: int = 3
) -> st.SearchStrategy[Message]:
    """Messages of ``cls``: each field set or left unset, at random."""

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        for field in descriptor.fields:
            if not draw(st.booleans()):
                continue
            _fill(draw, message, field, depth)
        return message

    return build()


def _fill(draw: st.DrawFn, message: Message, field: FieldDescriptor, depth: int) -> None:
    target = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        for k in draw(st.lists(_scalar(key), max_size=4)):
            if value.message_type is None:
                target[k] = draw(_scalar(value))
        return
    if field.message_type is not None:
        if depth <= 0:
            return
        if field.is_repeated:
            for _ in range(draw(st.integers(0, 3))):
                element = target.add()
                element.CopyFrom(draw(messages(field.message_type, type(element), depth - 1)))
            return
        target.CopyFrom(draw(messages(field.message_type, type(target), depth - 1)))
        return
    if field.is_repeated:
        target.extend(draw(st.lists(_scalar(field), max_size=20)))
        return
    setattr(message, field.name, draw(_scalar(field)))
