"""gRPC transport of the router: the public Generation service."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import consul.aio
import grpc
from aiohttp import web

from llmmesh.convert import finish_reason_to_pb, logprobs_to_pb, sampling_from_pb
from llmmesh.runtime import GrpcService
from llmmesh.runtime.config import ConfigError
from llmmesh.runtime.consul import ConsulKeyWatch, connect
from llmmesh.runtime.internal_auth import read_token, token_metadata
from llmmesh.runtime.metadata import (
    AUTHORIZATION,
    COLOR,
    REQUEST_ID,
    SESSION_ID,
    bind_request_id,
    metadata_value,
)
from llmmesh.runtime.multiplex import GENERATE_STREAM, MultiplexSession, OpenSessions
from llmmesh.runtime.registration import add_servicer, takes_malformed
from llmmesh.runtime.watch import watch_file
from llmmesh.types import History
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.router.admission import AdmissionQueue
from services.router.canary_watch import CanaryWatch
from services.router.config import RouterConfig
from services.router.connector import GrpcConnector
from services.router.consul import ConsulDiscovery
from services.router.core import RouterCore
from services.router.dispatch import Dispatcher
from services.router.endpoints import Discovery, DnsDiscovery, FileDiscovery, FixedDiscovery
from services.router.http_errors import HttpRunner
from services.router.mirror import Mirror
from services.router.obfuscation import pad_message
from services.router.openai_api import OpenAiApi
from services.router.policy_gate import PolicyGate
from services.router.rate_limits import rate_limit_headers
from services.router.replicas import ReplicaSet
from services.router.request import GenerateInput, Generation
from services.router.responses_api import ResponsesApi
from services.router.routing import PolicyHolder
from services.router.scheduling import Scheduler, SchedulingState
from services.router.shared import build_shared_state
from services.router.speech import CardSpeeches
from services.router.tenants import SignedIn, Tenants, parse_tenants
from services.router.upstreams import CHANNEL_OPTIONS, GrpcContextClient, GrpcPolicyService

log = logging.getLogger(__name__)

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"]


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: RouterCore, tenants: Tenants) -> None:
        self._core = core
        self._tenants = tenants
        self._streams = OpenSessions()

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = bind_request_id(context)
        # In the trailers, which go out with the status (errors included) at no extra cost;
        # headers sent up front would delay the first token.
        context.set_trailing_metadata(((REQUEST_ID, request_id),))
        tenant = self._tenants.authenticate(metadata_value(context, AUTHORIZATION))
        decoded = _decoded(
            request,
            request_id,
            tenant,
            session_id=metadata_value(context, SESSION_ID) or "",
            color=metadata_value(context, COLOR) or "",
            remaining_s=context.time_remaining(),
        )
        async with self._core.generation(decoded) as generation:
            async for response in _responses(generation, request.obfuscate):
                yield response
            # The tenant's budgets as the answer left them, also in the trailers.
            limits = rate_limit_headers(generation.prepared.lease)
            context.set_trailing_metadata(((REQUEST_ID, request_id), *limits.items()))

    @takes_malformed
    async def GenerateStream(  # noqa: N802 (gRPC method name)
        self,
        requests: AsyncIterator[generation_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        # Refused credentials end the stream now; accepted, the headers say so at once
        # (GenerationStream writes its first start once they have come).
        signed_in = self._tenants.signed_in(metadata_value(context, AUTHORIZATION))
        await context.send_initial_metadata(())
        session = MultiplexSession(
            GENERATE_STREAM,
            lambda start, request_id: self._streamed(start, request_id, signed_in),
        )
        async for message in self._streams.serve(session, requests):
            yield message

    def drain(self) -> None:
        """Shutdown begins: streams take no new generation and end with their last one."""
        self._streams.drain()

    async def _streamed(
        self, start: generation_pb2.GenerateStart, request_id: str, signed_in: SignedIn
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One generation of a stream, as Generate serves a call, for the stream's tenant
        (checked again if the tenants changed since the stream opened)."""
        decoded = _decoded(
            start.request,
            request_id,
            signed_in.tenant(),
            color=start.color,
            remaining_s=start.timeout_ms / 1000 or None,
        )
        async with self._core.generation(decoded) as generation:
            async for response in _responses(generation, start.request.obfuscate):
                yield response


def _decoded(
    request: generation_pb2.GenerateRequest,
    request_id: str,
    tenant: str,
    *,
    session_id: str = "",
    color: str,
    remaining_s: float | None,
) -> GenerateInput:
    """A public request as the core takes it; ``session_id``: the metadata's, which the
    request's own field overrides."""
    return GenerateInput(
        request_id=request_id,
        tenant=tenant,
        model=request.model,
        prompt=request.prompt,
        sampling=sampling_from_pb(request.sampling),
        session_id=request.session_id or session_id,
        color=color,
        deadline=None if remaining_s is None else time.monotonic() + remaining_s,
        truncation=request.truncation,
        cache_salt=request.cache_salt,
        prompt_field="prompt_token_ids" if request.prompt_token_ids else "prompt",
        prompt_ids=tuple(request.prompt_token_ids),
    )


async def _responses(
    generation: Generation, obfuscate: bool = False
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Chunks as public responses: ids on the first, finish reason and usage on the last;
    each padded when ``obfuscate``."""
    first, completion_tokens, cached_tokens = True, 0, 0
    async for chunk in generation.chunks:
        completion_tokens += chunk.num_tokens
        cached_tokens += chunk.cached_tokens
        response = generation_pb2.GenerateResponse(text=chunk.text)
        if chunk.logprobs:  # an empty list costs the constructor as much as the text
            response.logprobs.extend(logprobs_to_pb(chunk.logprobs))
        if chunk.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_pb(chunk.prompt_logprobs))
        if chunk.token_ids:
            response.token_ids.extend(chunk.token_ids)
        if chunk.prompt_token_ids:
            response.prompt_token_ids.extend(chunk.prompt_token_ids)
        if first:
            response.request_id = generation.request.request_id
            response.model = generation.request.model
            if generation.history is not None:
                response.context.CopyFrom(_session_context(generation.history))
            first = False
        if chunk.finish_reason is not None:
            response.finish_reason = finish_reason_to_pb(chunk.finish_reason)
            response.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=generation.prompt_tokens,
                    completion_tokens=completion_tokens,
                    cached_tokens=cached_tokens,
                )
            )
            if chunk.route is not None:
                response.served.CopyFrom(
                    generation_pb2.Served(
                        endpoint=chunk.route.endpoint,
                        subset=chunk.route.subset,
                        region=chunk.route.region,
                        resumed=chunk.resumed,
                        fallback=chunk.route.fallback,
                    )
                )
        if obfuscate:
            pad_message(response)
        yield response


def _session_context(history: History) -> generation_pb2.SessionContext:
    cut = history.dropped_turns > 0 or history.system_prompt_dropped
    return generation_pb2.SessionContext(
        history_turns=history.total_turns,
        dropped_turns=history.dropped_turns,
        summarized_turns=history.summarized_turns,
        truncation=history.truncation if cut else "",
        system_prompt_dropped=history.system_prompt_dropped,
    )


class Upstreams:
    """The router's channels, replica pool and routing sources; closed on shutdown."""

    def __init__(self, config: RouterConfig) -> None:
        self.channels = [
            grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            for address in (config.policy_address, config.context_address)
        ]
        policy_ch, context_ch = self.channels
        auth = token_metadata(read_token(config.internal_token_file))
        timeout = config.upstream_timeout_s
        self.policy = PolicyGate(GrpcPolicyService(policy_ch, timeout, auth))
        self.context = GrpcContextClient(context_ch, timeout, auth)
        self.consul = _consul_client(config)
        self.routing = PolicyHolder()
        routing = _document_source(
            self.consul,
            config.routing_source,
            config.consul_routing_key,
            config.routing_file,
            config.watch_interval_s,
        )
        tenants = _document_source(
            self.consul,
            config.tenants_source,
            config.consul_tenants_key,
            config.tenants_file,
            config.watch_interval_s,
        )
        self.shared = build_shared_state(
            config.state,
            config.redis_url,
            config.shared,
            lambda routers: self.admission.set_share(1 / routers),
        )
        # With a source configured, nobody is let in before its first document.
        self.tenants = Tenants(
            config.default_tenant, enabled=tenants is not None, budgets=self.shared.budgets
        )
        if config.tenants_file and config.tenants_source == "file":
            # Read now, so the service starts with its tenants or not at all.
            try:
                self.tenants.apply(parse_tenants(Path(config.tenants_file).read_text()))
            except (OSError, ValueError) as err:
                raise ConfigError(f"tenants_file: {err}") from None
        self.replicas = ReplicaSet(
            _discovery(config, self.consul),
            GrpcConnector(config.pool.via, auth, config.pool.multiplex),
            config.pool,
            config.region,
            peers=self.shared.peers,
        )
        scheduling = SchedulingState(config.region)
        self.shared.share_scheduling(scheduling, self.replicas.in_flight_counts)
        scheduler = Scheduler(scheduling, default=config.scheduling)
        self.canary = CanaryWatch()
        dispatcher = Dispatcher(
            self.replicas,
            self.routing,
            config.pool,
            scheduler,
            watch=self.canary,
            session_home=self.shared.session_home,
        )
        self.inference = Mirror(dispatcher, self.routing, self.canary)
        self.admission = AdmissionQueue(
            config.admission,
            self.inference.saturated,
            running_slots=dispatcher.running_slots,
        )
        self.replicas.on_report(self.admission.fleet_changed)
        self._documents = [
            (offer, source)
            for offer, source in ((self.routing.offer, routing), (self.tenants.offer, tenants))
            if source is not None
        ]
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.shared.start()
        await self.replicas.start()
        for offer, (name, documents) in self._documents:
            self._tasks.append(asyncio.create_task(_follow(offer, name, documents)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.inference.close()
        await self.replicas.close()
        await self.shared.close()
        await self.policy.close()
        for ch in self.channels:
            await ch.close()
        if self.consul is not None:
            await self.consul.close()


async def _follow(
    offer: Callable[[str | bytes, str], bool], name: str, documents: AsyncIterator[str | bytes]
) -> None:
    """Offers every version of a watched document (invalid ones are refused there)."""
    async for text in documents:
        offer(text, name)


def _consul_client(config: RouterConfig) -> consul.aio.Consul | None:
    if "consul" not in (config.discovery, config.routing_source, config.tenants_source):
        return None
    return connect(config.consul_address, config.consul_token)


def _discovery(config: RouterConfig, client: consul.aio.Consul | None) -> Discovery:
    if client is not None and config.discovery == "consul":
        return ConsulDiscovery(client, config.consul_service)
    if config.discovery == "dns":
        return DnsDiscovery(config.dns_endpoints, config.region, config.dns_interval_s)
    if config.endpoints_file:
        return FileDiscovery(Path(config.endpoints_file), config.watch_interval_s)
    return FixedDiscovery(config.inference_addresses)


def _document_source(
    client: consul.aio.Consul | None, source: str, consul_key: str, file: str, interval_s: float
) -> tuple[str, AsyncIterator[str | bytes]] | None:
    """A watched document (routing, tenants): its Consul KV key or its file, if any."""
    if client is not None and source == "consul":
        return "consul", ConsulKeyWatch(client, consul_key).watch()
    if file:
        return "file", watch_file(Path(file), interval_s)
    return None


def build_service(config: RouterConfig) -> GrpcService:
    upstreams = Upstreams(config)
    core = RouterCore(
        config,
        upstreams.policy,
        upstreams.context,
        upstreams.inference,
        CardSpeeches(upstreams.inference),
        tenants=upstreams.tenants,
        admission=upstreams.admission,
    )
    servicer = GenerationServicer(core, upstreams.tenants)

    def serving() -> bool:
        return any(upstreams.replicas.can_serve(model) for model in config.models)

    token = read_token(config.internal_token_file)
    responses = ResponsesApi(core, upstreams.tenants, upstreams.context, config.http)
    api = OpenAiApi(
        core,
        upstreams.tenants,
        config.models,
        config.http,
        serving=serving,
        metrics_token=token,
        responses=responses,
        canary=upstreams.canary,
    )
    http = HttpFront(config, api)

    async def stop() -> None:
        await http.stop()  # no new HTTP requests; those running finish (grace period)
        await upstreams.close()

    service = GrpcService(
        config,
        [SERVICE.full_name],
        lambda server: add_servicer(server, servicer, SERVICE),
        cleanup=stop,
        internal=False,
    )
    service.on_start(upstreams.start)
    service.on_start(http.start)
    service.on_drain(servicer.drain)
    return service


class HttpFront:
    """The OpenAI-compatible HTTP server, in the gRPC server's event loop."""

    def __init__(self, config: RouterConfig, api: OpenAiApi) -> None:
        self._config = config
        # A client that disconnects cancels its handler, and with it the generation.
        self._runner = HttpRunner(
            api.app(), config.http, handler_cancellation=True, access_log=None
        )
        self.port = 0

    async def start(self) -> None:
        if not self._config.http_port:
            return
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self._config.host,
            self._config.http_port,
            shutdown_timeout=self._config.shutdown_grace_s,
        )
        await site.start()
        log.info("serving HTTP", extra={"fields": {"port": self._config.http_port}})

    async def stop(self) -> None:
        await self._runner.cleanup()
