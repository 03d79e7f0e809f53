"""Errors the client library raises: each says what happened and what to do."""

from __future__ import annotations


class GpuObjError(Exception):
    """Base class for gpuobj client errors."""


class ObjectNotFoundError(GpuObjError):
    """The GPUObject does not exist (never created, or freed after its last reference went)."""


class ObjectLostError(GpuObjError):
    """The object's source pod or agent is gone: its bytes can no longer be read."""


class FetchError(GpuObjError):
    """Reading the bytes failed (the source refused, timed out, or the object was freed meanwhile)."""


class StreamClosedError(GpuObjError):
    """The stream was deleted or closed while reading or writing."""
