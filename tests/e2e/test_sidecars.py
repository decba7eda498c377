"""The local sidecar mode through real Envoy: mTLS with SPIFFE identities, RBAC from
mesh/consul's intentions, and the picker's choice honoured through the sidecar."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmmesh.canary import FileRouting
from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.sidecars import validate
from llmmesh.mesh.pki import Identity, LocalCA
from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.v1 import (
    context_pb2,
    context_pb2_grpc,
    generation_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from tests.conftest import SIDECARS, collect

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars


@pytest.fixture(scope="module")
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The session stack if it runs with sidecars, otherwise a sidecar stack of its own."""
    if SIDECARS:
        yield request.getfixturevalue("stack")
        return
    with Stack(tmp_path_factory.mktemp("sidecars"), StackPorts.free(), sidecars=True) as stack:
        yield stack


def identity(stack: Stack, service: str) -> Identity:
    ca = stack.workdir / "mesh" / "ca"
    return Identity(service, ca / f"{service}.pem", ca / f"{service}-key.pem", ca / "ca.pem")


def mtls_channel(address: str, who: Identity, trusted: Path | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(trusted or who.ca).read_bytes(),
        private_key=who.key.read_bytes(),
        certificate_chain=who.cert.read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", "localhost")]
    return grpc.secure_channel(address, credentials, options=options)


def watch_load(channel: grpc.Channel, token: str = "") -> grpc.StatusCode:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.WatchLoadRequest(max_interval_ms=50)
    call = stub.WatchLoad(request, timeout=5, metadata=token_metadata(token))
    try:
        next(call)
    except grpc.RpcError as err:
        return err.code()
    finally:
        call.cancel()
    return grpc.StatusCode.OK


def test_every_generated_envoy_config_validates(mesh: Stack) -> None:
    configs = sorted((mesh.workdir / "mesh").glob("envoy-*.json"))
    assert len(configs) == 5
    for config in configs:
        validate(config)


def test_generation_and_sessions_go_through_the_sidecars(mesh: Stack) -> None:
    assert mesh.sidecar_ports is not None
    canary_sidecar = mesh.sidecar_ports.inbound_address("inference_canary")
    with authorized_channel(mesh.address("router"), mesh.api_key) as channel:
        first = collect(channel, "hello", max_tokens=4, session_id="through-envoy", ignore_eos=True)
        second = collect(channel, "again", max_tokens=4, session_id="through-envoy")
        stub = generation_pb2_grpc.GenerationStub(channel)
        pinned = list(
            stub.Generate(
                build_request("hi", max_tokens=2), metadata=(("x-llm-color", "canary"),), timeout=30
            )
        )
    assert first[-1].usage.completion_tokens == 4
    assert second[-1].usage.prompt_tokens > first[-1].usage.prompt_tokens  # history came back
    # The picker's exact choice, honoured by the router's sidecar.
    assert pinned[-1].served.endpoint == canary_sidecar


def test_only_the_router_identity_may_call_inference(mesh: Stack) -> None:
    assert mesh.sidecar_ports is not None
    inference = mesh.sidecar_ports.inbound_address("inference")
    token = mesh.internal_token
    with mtls_channel(inference, identity(mesh, "router")) as channel:
        assert watch_load(channel, token) == grpc.StatusCode.OK
        # Behind its sidecar too, the service wants the mesh's token.
        assert watch_load(channel) == grpc.StatusCode.UNAUTHENTICATED
    with mtls_channel(inference, identity(mesh, "policy")) as channel:
        assert watch_load(channel, token) == grpc.StatusCode.PERMISSION_DENIED


def test_a_caller_gets_only_the_methods_its_intention_lists(mesh: Stack) -> None:
    assert mesh.sidecar_ports is not None
    context = mesh.sidecar_ports.inbound_address("context")
    with mtls_channel(context, identity(mesh, "router")) as channel:
        stub = context_pb2_grpc.ContextStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListSessions(
                context_pb2.ListSessionsRequest(tenant="demo"),
                timeout=5,
                metadata=token_metadata(mesh.internal_token),
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as missing:  # allowed: reaches the service
            stub.LoadSession(
                context_pb2.LoadSessionRequest(tenant="demo", session_id="nobody"),
                timeout=5,
                metadata=token_metadata(mesh.internal_token),
            )
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_plaintext_and_foreign_certificates_are_refused(mesh: Stack, tmp_path: Path) -> None:
    assert mesh.sidecar_ports is not None
    inference = mesh.sidecar_ports.inbound_address("inference")
    with grpc.insecure_channel(inference) as channel:
        assert watch_load(channel) == grpc.StatusCode.UNAVAILABLE
    # A "router" certificate from another CA is no router.
    impostor = LocalCA(tmp_path / "other-ca").issue("router")
    with mtls_channel(inference, impostor, trusted=identity(mesh, "router").ca) as channel:
        assert watch_load(channel) == grpc.StatusCode.UNAVAILABLE


def test_a_canary_weight_change_applies_within_a_second(mesh: Stack) -> None:
    routing = FileRouting(mesh.routing_file)
    before = routing.read().get("split") or {}
    try:
        with authorized_channel(mesh.address("router"), mesh.api_key) as channel:
            routing.update({"canary": 100})
            written = time.monotonic()
            while collect(channel, "hi", max_tokens=1)[-1].served.subset != "canary":
                assert time.monotonic() - written < 1.0, "the new split did not apply in 1 s"
    finally:
        routing.update(dict(before) or {"stable": 100, "canary": 0})
