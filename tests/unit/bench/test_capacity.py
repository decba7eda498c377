"""The capacity scenario's load: a Generate request as h2load sends it, and what h2load's
log says was served (bench/capacity.py)."""

from __future__ import annotations

from pathlib import Path

from bench.capacity import grpc_message, read_h2load_log
from llmmesh.v1 import generation_pb2


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
