"""The Envoy front of several routers (``llm-mesh up --routers N``): one address for
clients, gRPC and the HTTP API, spread over the routers.

Each listener balances over every router (least requests), checks each one actively
(gRPC health for the gRPC API, ``GET /version`` for the HTTP one: the router process
answering, whatever its replicas do), ejects one that keeps failing (outlier detection),
and retries a request on another router when the one it went to failed before answering
anything (connection refused, or reset before the first token's headers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmmesh.mesh.envoy import LOOPBACK, address, endpoints, http2_options

_TYPES = "type.googleapis.com/envoy.extensions"
# Retried on another router: the request never reached one (connect failure, refused
# stream), or the router went away before answering anything (a reset before response
# headers; a router sends them with the first token, and a stream it relayed is ended
# with it, so nothing a client saw is ever generated twice).
RETRY_ON = "connect-failure,refused-stream,reset-before-request,reset"


@dataclass(frozen=True)
class RouterAddresses:
    grpc: str  # host:port
    http: str


@dataclass(frozen=True)
class Front:
    admin_port: int
    grpc_port: int
    http_port: int
    routers: tuple[RouterAddresses, ...]
    health_interval_s: float = 0.5


def front_bootstrap(front: Front) -> dict[str, Any]:
    grpc_cluster = _cluster("routers_grpc", [r.grpc for r in front.routers], front, grpc=True)
    http_cluster = _cluster("routers_http", [r.http for r in front.routers], front, grpc=False)
    return {
        "node": {"id": "router-front", "cluster": "router-front"},
        "admin": {"address": address(LOOPBACK, front.admin_port)},
        "static_resources": {
            "listeners": [
                _listener("grpc", front.grpc_port, "routers_grpc"),
                _listener("http", front.http_port, "routers_http"),
            ],
            "clusters": [grpc_cluster, http_cluster],
        },
    }


def _listener(name: str, port: int, cluster: str) -> dict[str, Any]:
    manager = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"front_{name}",
        "codec_type": "AUTO",  # gRPC clients speak HTTP/2, HTTP clients 1.1 or 2
        "route_config": {
            "virtual_hosts": [
                {
                    "name": cluster,
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            # Streams last as long as a generation: no route timeout.
                            "route": {
                                "cluster": cluster,
                                "timeout": "0s",
                                "retry_policy": {
                                    "retry_on": RETRY_ON,
                                    "num_retries": 2,
                                    # Each retry on a router not tried yet.
                                    "retry_host_predicate": [
                                        {
                                            "name": "envoy.retry_host_predicates.previous_hosts",
                                            "typed_config": {
                                                "@type": f"{_TYPES}.retry.host.previous_hosts"
                                                ".v3.PreviousHostsPredicate"
                                            },
                                        }
                                    ],
                                    "host_selection_retry_max_attempts": 5,
                                },
                            },
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "name": f"front-{name}",
        "address": address(LOOPBACK, port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


def _cluster(name: str, targets: Sequence[str], front: Front, *, grpc: bool) -> dict[str, Any]:
    interval = f"{front.health_interval_s:g}s"
    check: dict[str, Any] = {
        "timeout": "1s",
        "interval": interval,
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "no_traffic_interval": interval,
    }
    if grpc:
        check["grpc_health_check"] = {}
    else:
        check["http_health_check"] = {"path": "/version"}
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": endpoints(name, targets),
        "health_checks": [check],
        "outlier_detection": {
            "consecutive_gateway_failure": 3,
            "consecutive_5xx": 5,
            "interval": interval,
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        },
        # One router's health does not depend on the others': no panic routing to a
        # router found dead while another is up.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        # A router dying fails every request it had not answered at once: each may be
        # retried (Envoy allows 3 retries in flight per cluster by default).
        "circuit_breakers": {"thresholds": [{"max_retries": 10_000}]},
    }
    if grpc:
        cluster["typed_extension_protocol_options"] = http2_options()
    return cluster
