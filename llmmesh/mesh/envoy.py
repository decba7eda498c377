"""Envoy sidecar bootstraps (static, v3 API) for the local sidecar mode.

A sidecar has an inbound listener (mTLS, the peer's SPIFFE identity checked by RBAC
generated from the service's intentions, gRPC methods included) in front of its service,
and an outbound listener per upstream (plaintext from the service on loopback, mTLS to
the upstream's sidecar, whose identity is verified). The inference upstream is an
original-destination cluster: the router's picker names the replica's sidecar in
``x-gateway-destination-endpoint`` and Envoy connects exactly there, the way the Gateway
API Inference Extension lets its endpoint picker steer Envoy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmmesh.mesh.intentions import Grant
from llmmesh.mesh.pki import Identity, spiffe_id
from llmmesh.runtime.metadata import DESTINATION_ENDPOINT

LOOPBACK = "127.0.0.1"
_TLS = "envoy.transport_sockets.tls"
_TYPES = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True)
class Upstream:
    """An outbound listener on ``local_port`` for ``service``: to fixed ``targets``
    (host:port of its sidecars), or, with ``by_header``, wherever the caller names."""

    service: str
    local_port: int
    targets: tuple[str, ...] = ()
    by_header: bool = False


@dataclass(frozen=True)
class Sidecar:
    identity: Identity
    admin_port: int
    inbound_port: int | None = None  # None: no inbound (the front door, reached directly)
    app_port: int | None = None
    grants: tuple[Grant, ...] = ()
    upstreams: tuple[Upstream, ...] = ()


def bootstrap(sidecar: Sidecar) -> dict[str, Any]:
    listeners = [_outbound_listener(u) for u in sidecar.upstreams]
    clusters = [_upstream_cluster(u, sidecar.identity) for u in sidecar.upstreams]
    if sidecar.inbound_port is not None and sidecar.app_port is not None:
        listeners.insert(0, _inbound_listener(sidecar))
        clusters.insert(0, _local_app_cluster(sidecar.app_port))
    return {
        "node": {"id": f"{sidecar.identity.service}-sidecar", "cluster": sidecar.identity.service},
        "admin": {"address": address(LOOPBACK, sidecar.admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": f"{_TYPES}.resource_monitors.downstream_connections.v3"
                        ".DownstreamConnectionsConfig",
                        "max_active_downstream_connections": 10000,
                    },
                }
            ]
        },
    }


def address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _certificates(identity: Identity) -> dict[str, Any]:
    return {
        "tls_certificates": [
            {
                "certificate_chain": {"filename": str(identity.cert)},
                "private_key": {"filename": str(identity.key)},
            }
        ],
        "alpn_protocols": ["h2"],
    }


def _http_manager(
    stat_prefix: str, cluster: str, filters: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "codec_type": "HTTP2",
            "http2_protocol_options": {},
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": cluster,
                        "domains": ["*"],
                        # Streams last as long as a generation: no route timeout.
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "route": {"cluster": cluster, "timeout": "0s"},
                            }
                        ],
                    }
                ]
            },
            "http_filters": [
                *filters,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"},
                },
            ],
        },
    }


def _route_all(cluster: str) -> dict[str, Any]:
    return {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}


def _rbac(grants: Sequence[Grant]) -> dict[str, Any]:
    """An allow-list: a caller matching no policy is refused (PERMISSION_DENIED)."""
    policies = {}
    for grant in grants:
        principal = (
            {"any": True}
            if grant.source == "*"
            else {"authenticated": {"principal_name": {"exact": spiffe_id(grant.source)}}}
        )
        if grant.paths is None:
            permissions: list[dict[str, Any]] = [{"any": True}]
        else:
            permissions = [{"url_path": {"path": {"exact": p}}} for p in grant.paths] + [
                {"url_path": {"path": {"prefix": p}}} for p in grant.prefixes
            ]
        policies[f"from-{grant.source}"] = {"permissions": permissions, "principals": [principal]}
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.rbac.v3.RBAC",
            "rules": {"action": "ALLOW", "policies": policies},
        },
    }


def _inbound_listener(sidecar: Sidecar) -> dict[str, Any]:
    assert sidecar.inbound_port is not None
    return {
        "name": "public",
        "address": address(LOOPBACK, sidecar.inbound_port),
        "filter_chains": [
            {
                "transport_socket": {
                    "name": _TLS,
                    "typed_config": {
                        "@type": f"{_TYPES}.transport_sockets.tls.v3.DownstreamTlsContext",
                        "require_client_certificate": True,
                        "common_tls_context": {
                            **_certificates(sidecar.identity),
                            "validation_context": {
                                "trusted_ca": {"filename": str(sidecar.identity.ca)}
                            },
                        },
                    },
                },
                "filters": [_http_manager("public", "local_app", [_rbac(sidecar.grants)])],
            }
        ],
    }


def _outbound_listener(upstream: Upstream) -> dict[str, Any]:
    return {
        "name": f"upstream-{upstream.service}",
        "address": address(LOOPBACK, upstream.local_port),
        "filter_chains": [
            {"filters": [_http_manager(f"upstream_{upstream.service}", upstream.service, [])]}
        ],
    }


def http2_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def _local_app_cluster(app_port: int) -> dict[str, Any]:
    return {
        "name": "local_app",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": http2_options(),
        "load_assignment": endpoints("local_app", [f"{LOOPBACK}:{app_port}"]),
    }


def endpoints(cluster: str, targets: Sequence[str]) -> dict[str, Any]:
    hosts = [t.rsplit(":", 1) for t in targets]
    return {
        "cluster_name": cluster,
        "endpoints": [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": address(host, int(port))}} for host, port in hosts
                ]
            }
        ],
    }


def _upstream_cluster(upstream: Upstream, identity: Identity) -> dict[str, Any]:
    tls = {
        "name": _TLS,
        "typed_config": {
            "@type": f"{_TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {
                **_certificates(identity),
                "validation_context": {
                    "trusted_ca": {"filename": str(identity.ca)},
                    # Only the service's own sidecar: its SPIFFE identity must match.
                    "match_typed_subject_alt_names": [
                        {"san_type": "URI", "matcher": {"exact": spiffe_id(upstream.service)}}
                    ],
                },
            },
        },
    }
    cluster: dict[str, Any] = {
        "name": upstream.service,
        "connect_timeout": "1s",
        "typed_extension_protocol_options": http2_options(),
        "transport_socket": tls,
    }
    if upstream.by_header:
        cluster |= {
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_ENDPOINT,
            },
        }
    else:
        cluster |= {
            "type": "STATIC",
            "load_assignment": endpoints(upstream.service, upstream.targets),
        }
    return cluster
