"""Requests that do not parse are diagnosed down to the offending field."""

from __future__ import annotations

from typing import Any

from llmmesh.runtime.registration import MalformedRequest, _lenient, generation_ids
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


def test_the_generations_a_malformed_stream_message_names_are_read_from_its_bytes() -> None:
    controls = [
        generation_pb2.GenerateControl(
            generation_id=n, start=generation_pb2.GenerateStart(request=_request("QQ"))
        )
        for n in (3, 300)
    ]
    data = generation_pb2.GenerateStreamRequest(controls=controls).SerializeToString()
    data = data.replace(b"QQ", b"\xff\xfe")
    parsed = _lenient(generation_pb2.GenerateStreamRequest)(data)
    assert isinstance(parsed, MalformedRequest)
    assert parsed.error.field == "controls.start.request.prompt"
    assert generation_ids(parsed.data) == [3, 300]
    assert generation_ids(b"\xff\xff\xff") == []  # nothing to tell: the stream ends


def _request(prompt: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt)


def test_garbage_is_reported_as_unparseable() -> None:
    parsed = _lenient(generation_pb2.GenerateRequest)(b"\xff\xff\xff")
    assert isinstance(parsed, MalformedRequest)
    assert parsed.error.field == "request"


def test_a_core_error_becomes_its_status_and_the_callers_request_id_is_bound() -> None:
    """Through a real grpc.aio server: a handler only raises, the wrapper answers."""
    import asyncio

    import grpc

    from llmmesh.runtime.errors import NotFound
    from llmmesh.runtime.logs import request_id_var
    from llmmesh.runtime.registration import add_servicer
    from llmmesh.v1 import context_pb2, context_pb2_grpc

    seen: list[str] = []

    class Sessions(context_pb2_grpc.ContextServicer):  # the other methods: unimplemented
        async def LoadSession(  # noqa: N802
            self, request: context_pb2.LoadSessionRequest, context: object
        ) -> context_pb2.Session:
            seen.append(request_id_var.get())
            raise NotFound("no session 's1'")

    servicer: Any = Sessions  # abstract for mypy: the test calls one method only

    async def scenario() -> grpc.aio.AioRpcError:
        server = grpc.aio.server()
        add_servicer(server, servicer(), context_pb2.DESCRIPTOR.services_by_name["Context"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = context_pb2_grpc.ContextStub(channel)
                request = context_pb2.LoadSessionRequest(tenant="t", session_id="s1")
                try:
                    await stub.LoadSession(request, metadata=(("x-request-id", "req-7"),))
                except grpc.aio.AioRpcError as err:
                    return err
                raise AssertionError("the call succeeded")
        finally:
            await server.stop(0)

    err = asyncio.run(scenario())
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no session 's1'")
    assert seen == ["req-7"]


def test_an_error_quoting_a_huge_input_is_cut_to_fit_its_trailer() -> None:
    from llmmesh.runtime.errors import InvalidArgument
    from llmmesh.runtime.grpc_status import MAX_MESSAGE_CHARS, to_status

    status = to_status(InvalidArgument("rule_set", f"unknown rule set '{'a' * 20_000}'"))
    assert len(status.message) <= MAX_MESSAGE_CHARS and status.message.endswith("(cut)")
    assert status.ByteSize() < 2 * MAX_MESSAGE_CHARS + 200  # message and detail, both cut
