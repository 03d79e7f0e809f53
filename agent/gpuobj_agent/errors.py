"""Errors the agent raises, each mapped to one HTTP status by the control server.

Why a module of its own: the store, the fetcher and the server must agree on what a
"not found" or a "bad request" is, and user input must never surface as a 500.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class: every error the agent raises on purpose."""

    status = 500


class BadRequest(AgentError):
    """The caller sent something malformed (HTTP 400)."""

    status = 400


class Unauthorized(AgentError):
    """Missing or wrong bearer token (HTTP 401)."""

    status = 401


class ObjectNotFound(AgentError):
    """The object is unknown: freed, being freed, or never existed (HTTP 404)."""

    status = 404

    def __init__(self, object_id: str, where: str = "") -> None:
        self.object_id = object_id
        suffix = f" on {where}" if where else ""
        super().__init__(f"object {object_id} not found (freed or never existed){suffix}")


class KeyNotPublished(AgentError):
    """A declared object names a key the workload has not published (HTTP 404)."""

    status = 404


class Conflict(AgentError):
    """The id exists with another layout, or a put reuses a live id (HTTP 409)."""

    status = 409


class InsufficientMemory(AgentError):
    """Allocating a declared object's tensors failed (HTTP 507)."""

    status = 507


class QuotaExceeded(AgentError):
    """The pod's store would hold more than its byte quota (HTTP 507); nothing was stored."""

    status = 507


class FreeTimeout(AgentError):
    """In-flight reads did not finish within the free wait bound; nothing was freed (HTTP 503)."""

    status = 503


class NotReady(AgentError):
    """The agent is starting or stopping (HTTP 503)."""

    status = 503


class TransportError(AgentError):
    """A NIXL operation failed."""


class FetchError(AgentError):
    """A fetch failed; the message says why. Never raised with partially valid bytes."""


class SourceUnavailable(FetchError):
    """The source agent cannot be reached or its NIXL agent went away."""


class ReadRefused(FetchError):
    """The source agent refused this reader (403): the object is not readable from the reader's namespace."""

    status = 403


class ObjectGone(FetchError):
    """The source does not have the object (freed, or never existed): nothing was read."""

    status = 404

    def __init__(self, object_id: str, where: str) -> None:
        self.object_id = object_id
        super().__init__(f"object {object_id} not found (freed or never existed) on {where}")
