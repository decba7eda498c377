"""Request metadata conventions: x-request-id, x-session-id, authorization, x-llm-color."""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from llmmesh.runtime.logs import request_id_var

REQUEST_ID = "x-request-id"
SESSION_ID = "x-session-id"
COLOR = "x-llm-color"
AUTHORIZATION = "authorization"
# The inference endpoint the router's picker chose, for the sidecar that routes to it
# (the header the Gateway API Inference Extension's endpoint picker sets).
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
MAX_REQUEST_ID_LEN = 128


def metadata_value(context: grpc.aio.ServicerContext[Any, Any], key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def bind_request_id(context: grpc.aio.ServicerContext[Any, Any], given: str = "") -> str:
    """The request's correlation id (from the message, metadata, or new), bound for logging."""
    request_id = given or metadata_value(context, REQUEST_ID) or uuid.uuid4().hex
    request_id = request_id[:MAX_REQUEST_ID_LEN]
    request_id_var.set(request_id)
    return request_id
