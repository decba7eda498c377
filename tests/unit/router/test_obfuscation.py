"""Stream obfuscation's padding: an SSE event's JSON and a gRPC response, each brought
to a multiple of BUCKET bytes whatever its text."""

from __future__ import annotations

import json

import pytest

from llmmesh.v1 import generation_pb2
from services.router.obfuscation import BUCKET, pad_message, padded


@pytest.mark.parametrize("size", range(0, 200, 7))
def test_padding_brings_any_object_to_a_multiple_of_the_bucket(size: int) -> None:
    data = json.dumps({"text": "x" * size}, separators=(",", ":"))
    out = padded(data)
    assert len(out) % BUCKET == 0 and json.loads(out)["text"] == "x" * size


@pytest.mark.parametrize("text", ["", "a", "x" * 61, "x" * 62, "x" * 63, "é" * 100])
def test_a_grpc_response_is_padded_to_a_multiple_of_the_bucket(text: str) -> None:
    response = generation_pb2.GenerateResponse(text=text, token_ids=[1, 2, 3])
    pad_message(response)
    assert response.ByteSize() % BUCKET == 0 and response.obfuscation
    assert generation_pb2.GenerateResponse.FromString(response.SerializeToString()).text == text
