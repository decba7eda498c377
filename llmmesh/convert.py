"""Protobuf <-> core conversions shared by transports."""

from __future__ import annotations

from llmmesh.types import FinishReason, Sampling
from llmmesh.v1 import common_pb2

_TO_PB = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.POLICY: common_pb2.FINISH_REASON_POLICY,
    FinishReason.BUDGET: common_pb2.FINISH_REASON_BUDGET,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


def finish_reason_to_pb(reason: FinishReason | None) -> common_pb2.FinishReason.ValueType:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _TO_PB[reason]


def finish_reason_from_pb(value: int) -> FinishReason | None:
    return _FROM_PB.get(common_pb2.FinishReason.ValueType(value))


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )
    if sampling.seed is not None:
        message.seed = sampling.seed
    return message


def sampling_from_pb(message: common_pb2.SamplingParams) -> Sampling:
    """Copies fields as sent; validation is the receiving core's job."""
    return Sampling(
        max_tokens=message.max_tokens,
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        ignore_eos=message.ignore_eos,
    )
