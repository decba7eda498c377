"""The capacity scenario's load: a Generate request as h2load sends it, and what h2load's
log says was served (bench/capacity.py); generations held on a stream instead
(bench/stream_load.py)."""

from __future__ import annotations

from pathlib import Path

from bench.capacity import (
    Capacity,
    CapacityShape,
    Step,
    Sweep,
    _streams,
    grpc_message,
    read_h2load_log,
)
from bench.stream_load import Held, _ended, _Starts
from llmmesh.v1 import common_pb2, generation_pb2


def test_a_request_is_one_grpc_message_of_the_public_api() -> None:
    wire = grpc_message("hello", 7)
    assert wire[0] == 0  # not compressed
    assert int.from_bytes(wire[1:5], "big") == len(wire) - 5
    request = generation_pb2.GenerateRequest.FromString(wire[5:])
    assert (request.prompt, request.sampling.max_tokens) == ("hello", 7)
    assert request.sampling.ignore_eos


def test_the_log_counts_what_was_served_and_what_failed(tmp_path: Path) -> None:
    log = tmp_path / "h2load.log"
    log.write_text("1\t200\t1500\n2\t200\t2500\n3\t-1\t900\n")
    served, failed, latencies = read_h2load_log(log)
    assert (served, failed) == (2, 1)
    assert latencies == [0.0015, 0.0025]


def _step(load: str, served: float, tokens: float, ttft_ms: float, failed: int = 0) -> Step:
    return Step(load, served, tokens, 10.0, ttft_ms, 2 * ttft_ms, 0.5, 0.3, failed, 18.0)


def test_the_capacity_is_the_highest_step_within_twice_the_first_steps_ttft() -> None:
    sweep = Sweep(
        "streams",
        [
            _step("16 streams", 6, 1_200, 5.0),
            _step("32 streams", 12, 2_400, 9.9),
            _step("64 streams", 24, 4_800, 7.0, failed=1),  # within, but a request failed
            _step("128 streams", 48, 9_600, 10.1),  # past twice the first
        ],
    )
    assert sweep.within() == sweep.steps[1]
    assert sweep.verdict("relayed").startswith("**2,400 tokens/s** relayed over 32 streams")


def test_the_report_sets_the_bare_servers_ceiling_beside_the_routers_figure() -> None:
    rates = Sweep("arrivals", [_step("40 req/s", 40, 40, 4.0), _step("500 req/s", 500, 500, 7.0)])
    streams = Sweep("streams", [_step("16 streams", 6, 1_200, 5.0)])
    bare = Sweep("arrivals", [_step("40 req/s", 40, 40, 2.0), _step("1200 req/s", 1200, 1200, 3)])
    bare_streams = Sweep("streams", [_step("16 streams", 6, 1_200, 2.0)], "server")
    report = Capacity(CapacityShape(), "", rates, streams, bare, bare_streams).report()
    assert "**500 requests/s** admitted and picked" in report
    assert "the bare server: **1200 requests/s** answered" in report
    assert "| server CPU |" in report and "took 18.0 to 18.0 ms" in report


def test_generations_on_a_stream_are_counted_as_they_end_and_replaced() -> None:
    starts = _Starts(generation_pb2.GenerateRequest(prompt="x"))
    first = starts.message(3)
    assert [c.generation_id for c in first.controls] == [1, 2, 3]
    held = Held()
    done = generation_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    message = generation_pb2.GenerateStreamResponse(
        frames=[
            generation_pb2.GenerateFrame(generation_id=1, response=done),
            generation_pb2.GenerateFrame(generation_id=2, error=b""),
            generation_pb2.GenerateFrame(
                generation_id=3, response=generation_pb2.GenerateResponse(text="a")
            ),
        ]
    )
    assert _ended(message, starts, held) == 2  # two to start again
    assert (held.served, held.failed, len(held.latencies_s)) == (1, 1, 1)
    assert list(starts.started_at) == [3]
    assert [c.generation_id for c in starts.message(2).controls] == [4, 5]


def test_the_streams_sweep_holds_generations_on_a_stream_when_asked() -> None:
    (step,) = _streams([64], 200, on_a_stream=True)
    assert (step.label, step.on_a_stream) == ("64 on a stream", True)
    assert step.options == ["--generations", "64"]
    (call,) = _streams([64], 200, on_a_stream=False)
    assert not call.on_a_stream and call.options == ["-c", "64", "-m", "1"]
