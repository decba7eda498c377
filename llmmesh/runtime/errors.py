"""Errors raised by service cores. They carry no gRPC types; transports map them."""

from __future__ import annotations


class MeshError(Exception):
    """Base class: a failure the client should see, with a message safe to show it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(MeshError):
    """A request field is invalid. ``field`` is the field's path, e.g. ``sampling.top_p``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Unauthenticated(MeshError):
    """No credentials, or credentials that name no one."""


class PermissionDenied(MeshError):
    """The caller may not do this (e.g. a policy rule denied the prompt)."""


class NotFound(MeshError):
    """The named thing does not exist (or is not visible to this caller)."""


class ResourceExhausted(MeshError):
    """Shed or over budget; the client may retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(MeshError):
    """The request's deadline passed before it could be served."""


class Unavailable(MeshError):
    """A dependency (Triton, a replica, a service) cannot be reached right now."""
