"""Shared plumbing for every mesh service: config, errors, logging, the gRPC server shell."""

from llmmesh.runtime.config import ServiceConfig, load_config
from llmmesh.runtime.errors import (
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from llmmesh.runtime.server import GrpcService, run_service, service_main

__all__ = [
    "GrpcService",
    "InvalidArgument",
    "MeshError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ServiceConfig",
    "Unavailable",
    "load_config",
    "run_service",
    "service_main",
]
