"""OpenAI's stream obfuscation: each streamed event carries an ``obfuscation`` field of
random characters that brings its size to a multiple of BUCKET bytes, so that the size of
an encrypted event no longer tells an observer on the network how long its text is (a
token's length is enough to guess at what a stream says). Over HTTP on by default, as
OpenAI's (``stream_options.include_obfuscation: false`` leaves it out); over gRPC when a
request asks (``GenerateRequest.obfuscate``).
"""

from __future__ import annotations

import secrets

from google.protobuf.message import Message

BUCKET = 64  # bytes: an event's size says no more than how many buckets it fills
_FIELD = ',"obfuscation":""'


def padded(data: str) -> str:
    """``data``, a JSON object written in ASCII and compactly, with its ``obfuscation``
    field: its length is then a multiple of BUCKET."""
    size = -(len(data) + len(_FIELD)) % BUCKET
    filler = secrets.token_urlsafe(size)[:size]
    return f'{data[:-1]},"obfuscation":"{filler}"}}'


def pad_message(message: Message) -> None:
    """Sets ``message.obfuscation`` (a string field numbered under 16: a one-byte tag, and
    a one-byte length up to 127) so that the message's size is a multiple of BUCKET."""
    size = -(message.ByteSize() + 2) % BUCKET or BUCKET  # an empty string is not sent
    message.obfuscation = secrets.token_urlsafe(size)[:size]  # type: ignore[attr-defined]
