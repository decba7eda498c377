"""gRPC transport of the policy service."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from llmmesh.convert import ACTION_FROM_PB, ACTION_TO_PB, STAGE_FROM_PB
from llmmesh.policy import (
    DEFAULT_SET,
    SCHEMA_VERSION,
    OutputStep,
    Part,
    RuleLibrary,
    RuleSet,
    RuleSetError,
    dump_rules,
)
from llmmesh.runtime import GrpcService
from llmmesh.runtime.config import ConfigError
from llmmesh.runtime.consul import ConsulPrefixWatch, connect
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.runtime.logs import request_id_var
from llmmesh.runtime.metadata import bind_request_id
from llmmesh.runtime.registration import add_servicer
from llmmesh.runtime.watch import watch_directory, watch_file
from llmmesh.types import PolicyAction, Verdict
from llmmesh.v1 import policy_pb2, policy_pb2_grpc
from services.policy.audit import AuditLog
from services.policy.config import PolicyConfig
from services.policy.core import OutputCheck, PolicyCore, check_text

SERVICE = policy_pb2.DESCRIPTOR.services_by_name["Policy"]

# WatchRules sends at least this often, so that a watcher knows the stream is alive.
HEARTBEAT_S = 10.0

InputContext = grpc.aio.ServicerContext[policy_pb2.CheckInputRequest, policy_pb2.CheckInputResponse]
OutputContext = grpc.aio.ServicerContext[
    policy_pb2.CheckOutputRequest, policy_pb2.CheckOutputResponse
]
RulesContext = grpc.aio.ServicerContext[policy_pb2.GetRulesRequest, policy_pb2.RuleSetRules]
WatchContext = grpc.aio.ServicerContext[policy_pb2.GetRulesRequest, policy_pb2.WatchRulesResponse]
RecordContext = grpc.aio.ServicerContext[
    policy_pb2.RecordDecisionsRequest, policy_pb2.RecordDecisionsResponse
]


def _parts(request: policy_pb2.CheckInputRequest) -> list[Part]:
    if request.parts and request.text:
        raise InvalidArgument("parts", "send either text or parts, not both")
    if not request.parts:
        return [Part("text", request.text)]
    return [Part(p.field or f"parts[{i}]", p.text) for i, p in enumerate(request.parts)]


def verdict_to_pb(verdict: Verdict, with_parts: bool) -> policy_pb2.CheckInputResponse:
    reply = policy_pb2.CheckInputResponse(
        action=ACTION_TO_PB[verdict.action],
        rule_ids=list(verdict.rule_ids),
        rule_set_version=verdict.rule_set_version,
        checks_output=verdict.checks_output,
        denied_at=verdict.denied_at,
        matches=[policy_pb2.RuleMatch(rule_id=r, field=f) for r, f in verdict.matches],
    )
    if verdict.action is PolicyAction.REDACT:
        if with_parts:
            reply.redacted_parts.extend(verdict.texts)
        else:
            reply.redacted_text = verdict.text
    return reply


def rules_to_pb(name: str, rules: RuleSet, cap: int, audit_text: bool) -> policy_pb2.RuleSetRules:
    return policy_pb2.RuleSetRules(
        rule_set=name,
        rule_set_version=rules.version,
        rules_json=dump_rules(rules),
        holdback_cap=cap,
        audit_text=audit_text,
        schema_version=SCHEMA_VERSION,
        holdback_tokens=rules.holdback_tokens or 0,
    )


class PolicyServicer(policy_pb2_grpc.PolicyServicer):
    def __init__(self, core: PolicyCore) -> None:
        self._core = core

    async def CheckInput(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.CheckInputRequest, context: InputContext
    ) -> policy_pb2.CheckInputResponse:
        bind_request_id(context, request.request_id)
        verdict = await self._core.check_input(
            request.tenant, _parts(request), request.request_id, request.rule_set
        )
        return verdict_to_pb(verdict, with_parts=bool(request.parts))

    async def CheckOutput(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[policy_pb2.CheckOutputRequest],
        context: OutputContext,
    ) -> AsyncGenerator[policy_pb2.CheckOutputResponse, None]:
        check: OutputCheck | None = None
        try:
            async for request in request_iterator:
                if check is None:
                    bind_request_id(context, request.request_id)
                    check_text("lead", request.lead)
                    check = self._core.open_output(
                        request.tenant, request.request_id, request.rule_set, request.lead
                    )
                step = check.feed(request.text, request.final, request.tokens or 1)
                yield _output_response(step, check.version)
                if step.denied_by is not None or request.final:
                    return
        finally:
            if check is not None:
                check.close()  # a stream cut short is still a decision to record

    def _rules(self, name: str) -> policy_pb2.RuleSetRules:
        library = self._core.library
        return rules_to_pb(name, library.get(name), library.holdback_cap, self._core.audits_text)

    async def GetRules(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.GetRulesRequest, context: RulesContext
    ) -> policy_pb2.RuleSetRules:
        return self._rules(request.rule_set)

    async def WatchRules(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.GetRulesRequest, context: WatchContext
    ) -> AsyncGenerator[policy_pb2.WatchRulesResponse, None]:
        changed = asyncio.Event()
        unsubscribe = self._core.library.subscribe(changed.set)
        try:
            sent = ""
            while True:
                rules = self._rules(request.rule_set)
                if rules.rule_set_version != sent:
                    sent = rules.rule_set_version
                    yield policy_pb2.WatchRulesResponse(rules=rules)
                else:
                    yield policy_pb2.WatchRulesResponse()  # a heartbeat
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), HEARTBEAT_S)
                changed.clear()
        finally:  # also when the set is unknown, or no longer exists
            unsubscribe()

    async def RecordDecisions(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.RecordDecisionsRequest, context: RecordContext
    ) -> policy_pb2.RecordDecisionsResponse:
        decisions = [_decision(d, f"decisions[{i}]") for i, d in enumerate(request.decisions)]
        for decision in decisions:
            bound = request_id_var.set(decision["request_id"])  # each logs as its request
            try:
                self._core.record_decision(**decision)
            finally:
                request_id_var.reset(bound)
        return policy_pb2.RecordDecisionsResponse()


def _decision(message: policy_pb2.Decision, field: str) -> dict[str, Any]:
    """A recorded decision's fields, validated (the whole batch is refused otherwise)."""
    action = ACTION_FROM_PB.get(message.action)
    if action is None:
        raise InvalidArgument(f"{field}.action", "must be ALLOW, REDACT or DENY")
    stage = STAGE_FROM_PB.get(message.stage)
    if stage is None:
        raise InvalidArgument(f"{field}.stage", "must be INPUT or OUTPUT")
    if not message.rule_set_version:
        raise InvalidArgument(f"{field}.rule_set_version", "must name the rules that decided")
    check_text(f"{field}.text", message.text)
    return {
        "stage": stage,
        "request_id": message.request_id,
        "tenant": message.tenant,
        "action": action,
        "rule_ids": tuple(message.rule_ids),
        "text": message.text,
        "version": message.rule_set_version,
    }


def _output_response(step: OutputStep, version: str) -> policy_pb2.CheckOutputResponse:
    rule_ids = list(step.rule_ids)
    if step.denied_by is not None:  # the deny rule comes first
        action = policy_pb2.ACTION_DENY
        rule_ids = [step.denied_by, *(r for r in rule_ids if r != step.denied_by)]
    else:
        action = policy_pb2.ACTION_REDACT if step.redacted else policy_pb2.ACTION_ALLOW
    return policy_pb2.CheckOutputResponse(
        text=step.text,
        action=action,
        rule_ids=rule_ids,
        rule_set_version=version,
        held_chars=step.held,
    )


def _read_sets(location: Path) -> dict[str, str]:
    """{set name: YAML} from a rule file (the default set) or a directory of sets."""
    try:
        if location.is_dir():
            return {p.stem: p.read_text("utf-8") for p in sorted(location.glob("*.yaml"))}
        return {DEFAULT_SET: location.read_text("utf-8")}
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"rules_path: {err}") from None


async def _file_sets(
    location: Path, is_dir: bool, interval_s: float
) -> AsyncIterator[dict[str, str]]:
    if is_dir:
        async for texts in watch_directory(location, ".yaml", interval_s):
            yield texts
    else:
        async for text in watch_file(location, interval_s):
            yield {DEFAULT_SET: text}


def _rule_updates(config: PolicyConfig) -> AsyncIterator[dict[str, str]]:
    if config.rules_source == "consul":
        client = connect(config.consul_address, config.consul_token)
        return ConsulPrefixWatch(client, config.consul_policy_prefix).watch()
    location = config.rules_location
    return _file_sets(location, location.is_dir(), config.watch_interval_s)


def build_service(config: PolicyConfig) -> GrpcService:
    audit = (
        AuditLog(
            Path(config.audit_path),
            config.audit_max_bytes,
            config.audit_backups,
            config.audit_include_text,
        )
        if config.audit_path
        else None
    )
    library = RuleLibrary(config.output_holdback_cap)
    try:  # the service starts with valid rules or not at all
        library.load(_read_sets(config.rules_location), str(config.rules_location))
    except RuleSetError as err:
        raise ConfigError(str(err)) from None
    core = PolicyCore(library, audit)
    servicer = PolicyServicer(core)
    watcher: list[asyncio.Task[None]] = []

    async def follow_rules() -> None:
        async for texts in _rule_updates(config):
            library.offer(texts, config.rules_source)

    async def start() -> None:
        watcher.append(asyncio.create_task(follow_rules()))

    async def stop() -> None:
        for task in watcher:
            task.cancel()
        await asyncio.gather(*watcher, return_exceptions=True)
        if audit is not None:
            await asyncio.to_thread(audit.close)

    service = GrpcService(
        config,
        [SERVICE.full_name],
        lambda server: add_servicer(server, servicer, SERVICE),
        cleanup=stop,
    )
    service.on_start(start)
    return service
