"""The server shell every service runs in: grpc.aio server, health, reflection, metrics,
graceful drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from llmmesh.runtime import tracing
from llmmesh.runtime.collector_pauses import freeze_startup_heap, watch_pauses
from llmmesh.runtime.config import C, ConfigError, ServiceConfig, load_config
from llmmesh.runtime.internal_auth import RequireToken, read_token
from llmmesh.runtime.logs import configure_logging

log = logging.getLogger(__name__)

Registrar = Callable[[grpc.aio.Server], None]
Hook = Callable[[], Awaitable[None]]

# Streams of generated tokens can be long; allow large prompts but bound them.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class GrpcService:
    """One gRPC server with health checking, reflection and a Prometheus endpoint.

    ``service_names`` are the fully qualified gRPC services ``register`` adds; each is
    reported SERVING once started and NOT_SERVING as soon as shutdown begins. An internal
    service (``internal``, the default) answers only callers that present the mesh's
    token when the config names one; the router's callers are tenants, authenticated
    per request instead.
    """

    def __init__(
        self,
        config: ServiceConfig,
        service_names: Sequence[str],
        register: Registrar,
        cleanup: Hook | None = None,
        internal: bool = True,
    ) -> None:
        self.config = config
        self._interceptors = _guards(config) if internal else []
        self._names = list(service_names)
        self._register = register
        self._cleanup = cleanup
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._startup: list[Hook] = []
        self._drain: list[Callable[[], None]] = []
        self.port = 0

    def on_start(self, hook: Hook) -> None:
        """Runs ``hook`` (e.g. opening a store) before the server accepts calls."""
        self._startup.append(hook)

    def on_drain(self, hook: Callable[[], None]) -> None:
        """Runs ``hook`` as shutdown begins, before in-flight calls are waited for: calls
        that would outlive the grace period (a long-lived stream) end themselves."""
        self._drain.append(hook)

    async def start(self) -> int:
        for hook in self._startup:
            await hook()
        server = grpc.aio.server(
            interceptors=self._interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.grpc_port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.grpc_port}")
        await server.start()
        self._server = server
        if self.config.metrics_port:
            host = self.config.metrics_host or self.config.host
            start_http_server(self.config.metrics_port, addr=host)
        for name in ("", *self._names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"fields": {"port": self.port, "services": self._names}})
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking new calls, lets in-flight ones finish for ``grace_s``, then cancels."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        for hook in self._drain:
            hook()
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self._server.stop(grace)
        self._server = None
        if self._cleanup is not None:
            await self._cleanup()
        log.info("stopped")


def _guards(config: ServiceConfig) -> list[grpc.aio.ServerInterceptor]:
    """The check of the mesh's token, when the config names one."""
    token = read_token(config.internal_token_file)
    return [RequireToken(token)] if token else []


async def run_service(service: GrpcService) -> None:
    """Runs ``service`` until SIGTERM or SIGINT, then drains it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    frozen = freeze_startup_heap()
    log.info("start-up heap frozen", extra={"fields": {"objects": frozen}})
    await stop.wait()
    log.info("draining", extra={"fields": {"grace_s": service.config.shutdown_grace_s}})
    await service.stop()
    tracing.shutdown()


def service_main(
    name: str,
    config_cls: type[C],
    build: Callable[[C], GrpcService],
    argv: Sequence[str] | None = None,
) -> None:
    """Entry point of ``python -m services.<name>``: load config, log it, serve until SIGTERM."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
    parser.add_argument("--config", help="YAML config file (LLM_MESH_* variables override it)")
    args = parser.parse_args(argv)
    try:
        config = load_config(config_cls, name, args.config)
    except ConfigError as exc:
        raise SystemExit(f"{name}: {exc}") from None
    configure_logging(name, config.log_level)
    watch_pauses()
    tracing.configure(name, config.otlp_endpoint)
    log.info("config", extra={"fields": {"config": config.model_dump()}})

    async def serve() -> None:
        try:
            service = build(config)  # in the loop: it opens grpc.aio channels
        except ConfigError as exc:  # a file the config names is missing or invalid
            raise SystemExit(f"{name}: {exc}") from None
        await run_service(service)

    # uvloop: a faster event loop; every token crosses several of them.
    uvloop.run(serve())
