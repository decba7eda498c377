"""gRPC transport of the policy service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import grpc

from llmmesh.runtime import GrpcService, MeshError
from llmmesh.runtime.config import ConfigError
from llmmesh.runtime.consul import ConsulPrefixWatch, connect
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.metadata import bind_request_id
from llmmesh.runtime.registration import add_servicer
from llmmesh.runtime.watch import watch_directory, watch_file
from llmmesh.types import PolicyAction
from llmmesh.v1 import policy_pb2, policy_pb2_grpc
from services.policy.audit import AuditLog
from services.policy.config import PolicyConfig
from services.policy.core import OutputCheck, PolicyCore, check_text
from services.policy.library import DEFAULT_SET, RuleLibrary
from services.policy.rules import RuleSetError
from services.policy.streaming import OutputStep

SERVICE = policy_pb2.DESCRIPTOR.services_by_name["Policy"]

_ACTIONS = {
    PolicyAction.ALLOW: policy_pb2.ACTION_ALLOW,
    PolicyAction.DENY: policy_pb2.ACTION_DENY,
    PolicyAction.REDACT: policy_pb2.ACTION_REDACT,
}

InputContext = grpc.aio.ServicerContext[policy_pb2.CheckInputRequest, policy_pb2.CheckInputResponse]
OutputContext = grpc.aio.ServicerContext[
    policy_pb2.CheckOutputRequest, policy_pb2.CheckOutputResponse
]
RulesContext = grpc.aio.ServicerContext[policy_pb2.GetOutputRulesRequest, policy_pb2.OutputRules]
RecordContext = grpc.aio.ServicerContext[
    policy_pb2.RecordOutputRequest, policy_pb2.RecordOutputResponse
]
_ACTIONS_FROM_PB = {pb: action for action, pb in _ACTIONS.items()}


class PolicyServicer(policy_pb2_grpc.PolicyServicer):
    def __init__(self, core: PolicyCore) -> None:
        self._core = core

    async def CheckInput(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.CheckInputRequest, context: InputContext
    ) -> policy_pb2.CheckInputResponse:
        bind_request_id(context, request.request_id)
        try:
            verdict = self._core.check_input(
                request.tenant, request.text, request.request_id, request.rule_set
            )
            checks_output = self._core.has_output_rules(request.rule_set)
        except MeshError as err:
            await abort(context, err)
        return policy_pb2.CheckInputResponse(
            action=_ACTIONS[verdict.action],
            rule_ids=list(verdict.rule_ids),
            redacted_text=verdict.text if verdict.action is PolicyAction.REDACT else "",
            rule_set_version=verdict.rule_set_version,
            checks_output=checks_output,
        )

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
                    check = self._core.open_output(
                        request.tenant, request.request_id, request.rule_set
                    )
                step = check.feed(request.text, request.final)
                yield _output_response(step, check.version)
                if step.denied_by is not None or request.final:
                    return
        except MeshError as err:
            await abort(context, err)
        finally:
            if check is not None:
                check.close()  # a stream cut short is still a decision to record

    async def GetOutputRules(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.GetOutputRulesRequest, context: RulesContext
    ) -> policy_pb2.OutputRules:
        try:
            rules = self._core.library.get(request.rule_set)
        except MeshError as err:
            await abort(context, err)
        specs = [rule.model_dump(mode="json") for rule in rules.output.rules]
        return policy_pb2.OutputRules(
            rule_set_version=rules.version,
            rules_json=json.dumps(specs),
            holdback_cap=self._core.library.holdback_cap,
            audit_text=self._core.audits_text,
        )

    async def RecordOutput(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.RecordOutputRequest, context: RecordContext
    ) -> policy_pb2.RecordOutputResponse:
        bind_request_id(context, request.request_id)
        try:
            action = _ACTIONS_FROM_PB.get(request.action)
            if action is None:
                raise InvalidArgument("action", "must be ALLOW, REDACT or DENY")
            if not request.rule_set_version:
                raise InvalidArgument("rule_set_version", "must name the rules that checked")
            check_text("text", request.text)
            self._core.record_decision(
                stage="output",
                request_id=request.request_id,
                tenant=request.tenant,
                action=action,
                rule_ids=request.rule_ids,
                text=request.text,
                version=request.rule_set_version,
            )
        except MeshError as err:
            await abort(context, err)
        return policy_pb2.RecordOutputResponse()


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
