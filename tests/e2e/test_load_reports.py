"""Inference replicas push their load; a router-side watcher sees a generation come and go."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request, internal_channel
from llmmesh.launcher import Stack
from llmmesh.v1 import generation_pb2_grpc, inference_pb2, inference_pb2_grpc

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars


def _llm(report: inference_pb2.LoadReport) -> inference_pb2.ModelLoad | None:
    return next((m for m in report.models if m.model == "llm"), None)


def test_load_reports_follow_a_generation(stack: Stack) -> None:
    with internal_channel(stack.address("inference"), stack.internal_token) as channel:
        stub: Any = inference_pb2_grpc.InferenceStub(channel)
        reports = stub.WatchLoad(inference_pb2.WatchLoadRequest(max_interval_ms=50), timeout=60)
        first = next(reports)
        assert first.engine_reachable and first.replica == stack.address("inference")
        llm = _llm(first)
        assert llm is not None
        # Its running limit (config.pbtxt's max_running): a router's window without engine
        # priority grows to the fleet's.
        assert llm.metrics["max_running_sequences"] == 32

        router = generation_pb2_grpc.GenerationStub(
            authorized_channel(stack.address("router"), stack.api_key)
        )
        call = router.Generate(build_request("keep busy", max_tokens=1000, ignore_eos=True))
        reader = threading.Thread(target=_read_until_cancelled, args=(call,), daemon=True)
        reader.start()

        busy = next(r for r in reports if (m := _llm(r)) and m.running >= 1 and r.in_flight >= 1)
        assert _llm(busy).kv_utilization > 0  # type: ignore[union-attr]
        call.cancel()
        idle = next(r for r in reports if (m := _llm(r)) and m.running == 0 and r.in_flight == 0)
        assert idle.timestamp_ms > busy.timestamp_ms
        reports.cancel()


def _read_until_cancelled(call: Any) -> None:
    """Reads the stream; the test cancels it, maybe before its first reply."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise


def test_negative_interval_is_invalid(stack: Stack) -> None:
    with internal_channel(stack.address("inference"), stack.internal_token) as channel:
        stub: Any = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            next(stub.WatchLoad(inference_pb2.WatchLoadRequest(max_interval_ms=-1), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_interval_ms" in (info.value.details() or "")
