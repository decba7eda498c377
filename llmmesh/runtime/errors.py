"""Errors raised by service cores. They carry no transport types: each names its status
(the google.rpc code, and the HTTP status and error type of OpenAI's error JSON), which
the transports turn into their own (llmmesh/runtime/grpc_status.py,
services/router/http_errors.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class MeshError(Exception):
    """Base class: a failure the client should see, with a message safe to show it."""

    code: ClassVar[str] = "INTERNAL"  # google.rpc.Code name
    http_status: ClassVar[int] = 500
    http_type: ClassVar[str] = "internal_error"
    http_code: ClassVar[str | None] = None  # OpenAI's error.code, where it has one

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FieldError(MeshError):
    """A failure that one request field explains. ``field`` is the field's path, e.g.
    ``sampling.top_p``; the message is ``field: reason``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def named(self, names: Mapping[str, str]) -> FieldError:
        """The same error with its field under the name a request format gives it (the
        core's ``sampling.max_tokens`` is OpenAI's ``max_tokens``), if ``names`` has one."""
        name = names.get(self.field)
        return self if name is None else type(self)(name, self.reason)


class InvalidArgument(FieldError):
    """A request field is invalid."""

    code, http_status, http_type = "INVALID_ARGUMENT", 400, "invalid_request_error"


class AlreadyExists(FieldError):
    """The field names something another request already made (a reused request id)."""

    code, http_status, http_type = "ALREADY_EXISTS", 409, "invalid_request_error"


class ModelNotFound(FieldError):
    """The request names a model the mesh does not serve (OpenAI's ``model_not_found``)."""

    code, http_status, http_type = "NOT_FOUND", 404, "invalid_request_error"
    http_code = "model_not_found"


class Unauthenticated(MeshError):
    """No credentials, or credentials that name no one."""

    code, http_status, http_type = "UNAUTHENTICATED", 401, "authentication_error"


class PermissionDenied(MeshError):
    """The caller may not do this (e.g. a policy rule denied the prompt)."""

    code, http_status, http_type = "PERMISSION_DENIED", 403, "permission_error"


class PolicyDenied(PermissionDenied):
    """A policy rule denied what the model would read: the message names the rule,
    ``field`` the part of the request where it matched (empty if unknown)."""

    http_code = "policy_violation"

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field

    def named(self, names: Mapping[str, str]) -> PolicyDenied:
        """As FieldError.named: the field, and where the message names it."""
        name = names.get(self.field)
        if name is None or not self.field:
            return self
        return PolicyDenied(self.message.replace(self.field, name), name)


class NotFound(MeshError):
    """The named thing does not exist (or is not visible to this caller)."""

    code, http_status, http_type = "NOT_FOUND", 404, "not_found_error"


class ResourceExhausted(MeshError):
    """Shed or over budget; the client may retry after ``retry_after_s``. ``rate_limits``:
    the refused budget's state, as OpenAI's rate-limit headers."""

    code, http_status, http_type = "RESOURCE_EXHAUSTED", 429, "rate_limit_error"

    def __init__(
        self, message: str, retry_after_s: float, rate_limits: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limits = dict(rate_limits or {})


class DeadlineExceeded(MeshError):
    """The request's deadline passed before it could be served."""

    code, http_status, http_type = "DEADLINE_EXCEEDED", 504, "timeout"


class Unavailable(MeshError):
    """A dependency (Triton, a replica, a service) cannot be reached right now."""

    code, http_status, http_type = "UNAVAILABLE", 503, "service_unavailable"
