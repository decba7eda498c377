"""Protobuf <-> core conversions shared by transports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.structures import choice_options, choice_spec
from llmmesh.types import PENALTIES, FinishReason, PolicyAction, Role, Sampling, TokenLogprob, Turn
from llmmesh.v1 import common_pb2, context_pb2, policy_pb2

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
        min_tokens=sampling.min_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        allowed_token_ids=list(sampling.allowed_token_ids),
        bad_words=list(sampling.bad_words),
        return_token_ids=sampling.return_token_ids,
    )
    if sampling.seed is not None:
        message.seed = sampling.seed
    if sampling.min_p:
        message.min_p = sampling.min_p
    if sampling.logprobs is not None:
        message.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        message.prompt_logprobs = sampling.prompt_logprobs
    for name, none in PENALTIES.items():
        if getattr(sampling, name) != none:
            setattr(message, name, getattr(sampling, name))
    message.logit_bias.update(dict(sampling.logit_bias))
    if sampling.structured is not None:
        kind, spec = sampling.structured
        if kind == "json_object":
            message.structured_output.json_object = True
        elif kind == "choice":
            message.structured_output.choice.options.extend(choice_options(spec))
        else:
            setattr(message.structured_output, kind, spec)
    return message


def sampling_from_pb(message: common_pb2.SamplingParams) -> Sampling:
    """Copies fields as sent; validation is the receiving core's job."""
    return Sampling(
        max_tokens=message.max_tokens,
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        top_k=message.top_k,
        min_p=message.min_p,
        stop_token_ids=tuple(sorted(set(message.stop_token_ids))),
        include_stop_str_in_output=message.include_stop_str_in_output,
        allowed_token_ids=tuple(sorted(set(message.allowed_token_ids))),
        bad_words=tuple(message.bad_words),
        return_token_ids=message.return_token_ids,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        presence_penalty=_or(message, "presence_penalty"),
        frequency_penalty=_or(message, "frequency_penalty"),
        repetition_penalty=_or(message, "repetition_penalty"),
        logit_bias=tuple(sorted(message.logit_bias.items())),
        min_tokens=message.min_tokens,
        structured=_structure(message),
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
    )


def _structure(message: common_pb2.SamplingParams) -> tuple[str, str] | None:
    if not message.HasField("structured_output"):
        return None
    structure = message.structured_output
    kind = structure.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not structure.json_object):
        return ("", "")  # no kind asked for: refused by the core's check
    if kind == "choice":
        return (kind, choice_spec(list(structure.choice.options)))
    return (kind, "" if kind == "json_object" else getattr(structure, kind))


def _or(
    message: common_pb2.SamplingParams,
    name: Literal["presence_penalty", "frequency_penalty", "repetition_penalty"],
) -> float:
    """A penalty as sent, or the value that asks for none."""
    return getattr(message, name) if message.HasField(name) else PENALTIES[name]


def logprobs_to_pb(tokens: tuple[TokenLogprob, ...]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token=t.token,
            text=t.text,
            logprob=t.logprob,
            rank=t.rank,
            top=[common_pb2.TopLogprob(token=i, text=x, logprob=lp) for i, x, lp in t.top],
        )
        for t in tokens
    ]


def logprobs_from_pb(messages: Sequence[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    if not messages:  # most responses: none asked (a generator costs more than the check)
        return ()
    return tuple(
        TokenLogprob(
            m.token, m.text, m.logprob, m.rank, tuple((t.token, t.text, t.logprob) for t in m.top)
        )
        for m in messages
    )


_ROLE_TO_PB = {
    Role.SYSTEM: context_pb2.ROLE_SYSTEM,
    Role.USER: context_pb2.ROLE_USER,
    Role.ASSISTANT: context_pb2.ROLE_ASSISTANT,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


def turn_to_pb(turn: Turn) -> context_pb2.Turn:
    return context_pb2.Turn(
        role=_ROLE_TO_PB[turn.role],
        text=turn.text,
        token_count=turn.token_count,
        request_id=turn.request_id,
        created_at_ms=turn.created_at_ms,
    )


def turn_from_pb(message: context_pb2.Turn, field: str = "turn") -> Turn:
    """Raises InvalidArgument naming ``field`` when the role is unset or unknown."""
    role = _ROLE_FROM_PB.get(message.role)
    if role is None:
        raise InvalidArgument(f"{field}.role", "must be SYSTEM, USER or ASSISTANT")
    return Turn(role, message.text, message.token_count, message.request_id, message.created_at_ms)


ACTION_TO_PB = {
    PolicyAction.ALLOW: policy_pb2.ACTION_ALLOW,
    PolicyAction.DENY: policy_pb2.ACTION_DENY,
    PolicyAction.REDACT: policy_pb2.ACTION_REDACT,
}
ACTION_FROM_PB = {pb: action for action, pb in ACTION_TO_PB.items()}
STAGE_TO_PB = {"input": policy_pb2.STAGE_INPUT, "output": policy_pb2.STAGE_OUTPUT}
STAGE_FROM_PB = {pb: stage for stage, pb in STAGE_TO_PB.items()}
