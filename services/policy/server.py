"""gRPC transport of the policy service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from llmmesh.runtime import GrpcService, MeshError
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.metadata import bind_request_id
from llmmesh.runtime.registration import add_servicer
from llmmesh.runtime.watch import watch_file
from llmmesh.types import PolicyAction
from llmmesh.v1 import policy_pb2, policy_pb2_grpc
from services.policy.audit import AuditLog
from services.policy.config import PolicyConfig
from services.policy.core import PolicyCore
from services.policy.rules import RuleSet

SERVICE = policy_pb2.DESCRIPTOR.services_by_name["Policy"]

_ACTIONS = {
    PolicyAction.ALLOW: policy_pb2.ACTION_ALLOW,
    PolicyAction.DENY: policy_pb2.ACTION_DENY,
    PolicyAction.REDACT: policy_pb2.ACTION_REDACT,
}

Context = grpc.aio.ServicerContext[policy_pb2.CheckInputRequest, policy_pb2.CheckInputResponse]


class PolicyServicer(policy_pb2_grpc.PolicyServicer):
    def __init__(self, core: PolicyCore) -> None:
        self._core = core

    async def CheckInput(  # noqa: N802 (gRPC method name)
        self, request: policy_pb2.CheckInputRequest, context: Context
    ) -> policy_pb2.CheckInputResponse:
        bind_request_id(context, request.request_id)
        try:
            verdict = self._core.check_input(request.tenant, request.text, request.request_id)
        except MeshError as err:
            await abort(context, err)
        return policy_pb2.CheckInputResponse(
            action=_ACTIONS[verdict.action],
            rule_ids=list(verdict.rule_ids),
            redacted_text=verdict.text,
            rule_set_version=verdict.rule_set_version,
        )


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
    core = PolicyCore(RuleSet.from_file(config.rules_file), audit)
    servicer = PolicyServicer(core)
    watcher: list[asyncio.Task[None]] = []

    async def follow_rules() -> None:
        async for text in watch_file(config.rules_file, config.watch_interval_s):
            core.offer(text, str(config.rules_file))

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
