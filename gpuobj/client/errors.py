"""Errors the client library raises: one hierarchy under GpuObjError, each message saying what to do.

Why one hierarchy: a workload writes `except gpuobj.GpuObjError` once and catches everything the
library can meet (the API server's refusals, the agent's, the transport's, bad arguments), never a
bare exception from a library underneath. Where a standard exception fits too (ValueError for a bad
tensor, PermissionError, TimeoutError, ConnectionError), the error is also one of those.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp

from gpuobj_kube.client import ApiError, ApiTimeout, Conflict, Invalid, NotFound
from gpuobj_kube.config import KubeConfigError


class GpuObjError(Exception):
    """Base class for every error the gpuobj client library raises."""


class ObjectNotFoundError(GpuObjError):
    """The GPUObject does not exist (never created, or freed after its last reference went)."""


class ObjectLostError(GpuObjError):
    """The object's source pod or agent is gone: its bytes can no longer be read."""


class FetchError(GpuObjError):
    """Reading the bytes failed (the source refused, timed out, or the object was freed meanwhile)."""


class StreamClosedError(GpuObjError):
    """The stream was deleted or closed while reading or writing."""


class NameTakenError(GpuObjError):
    """A GPUObject (or claim) of that name already exists in the namespace."""


class PodNotFoundError(GpuObjError):
    """The pod named (a receiver to share with) does not exist in the namespace."""


class InvalidTensorError(GpuObjError, ValueError):
    """The argument is not a tensor gpuobj can hold (type, dtype, device, layout)."""


class ReleasedHandleError(GpuObjError):
    """The handle was released: it no longer holds a reference, so it cannot be fetched, shared or borrowed."""


class LeaseExpiredError(ReleasedHandleError):
    """The handle's claim was made with a ttl that has passed: the operator drops the claim then, so the
    handle no longer reads (not even bytes still in the source's memory); borrow or adopt a new one."""


class QuotaExceededError(GpuObjError):
    """A byte quota refused the object: the pod's (`GPUOBJ_MAX_STORE_BYTES`: nothing was stored) or its
    namespace's (the chart's `quota.namespaces`: the operator marked it Failed and freed its bytes)."""


class PermissionDeniedError(GpuObjError, PermissionError):
    """The API server refused this pod's identity (401/403): its ServiceAccount lacks a role."""


class InvalidRequestError(GpuObjError, ValueError):
    """The API server's schema or validation refused what the library sent (422)."""


class ApiUnavailableError(GpuObjError, ConnectionError):
    """The API server could not be reached or answered with a server error."""


class GpuObjTimeoutError(GpuObjError, TimeoutError):
    """An operation did not finish within its deadline."""


class ConfigurationError(GpuObjError):
    """The client cannot start: missing environment, unreadable kubeconfig or credentials."""


# A 403 for the cluster-scoped resources the agent needs (its certificate, token revocation), with the
# ServiceAccount the API server names.
_CLUSTER_SCOPE_REFUSAL = re.compile(
    r'User "system:serviceaccount:(?P<namespace>[^:"]+):(?P<name>[^"]+)" cannot \w+ resource'
    r' "(?:certificatesigningrequests|tokenreviews)"'
)


def translate(exc: BaseException, *, what: str) -> BaseException:
    """The GpuObjError for an exception from a layer underneath (`what`: the operation, for the message).

    Errors already in the hierarchy, and BaseExceptions that are not errors (KeyboardInterrupt,
    cancellation), pass through unchanged.
    """
    if isinstance(exc, GpuObjError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, ApiTimeout):  # an API request, not the operation, ran out of time: say so
        return GpuObjTimeoutError(f"{what}: {exc.message}; the API server is down or overloaded, retry")
    if isinstance(exc, Conflict) and exc.already_exists:
        return NameTakenError(f"{what}: {exc.message}; choose another name (or omit it for a generated one)")
    if isinstance(exc, NotFound):
        return ObjectNotFoundError(f"{what}: {exc.message}")
    if isinstance(exc, Invalid):
        return InvalidRequestError(f"{what}: the API server refused it: {exc.message}")
    if isinstance(exc, ApiError) and exc.status in (401, 403):
        cluster_scope = _CLUSTER_SCOPE_REFUSAL.search(exc.message)
        if cluster_scope is not None:  # a RoleBinding cannot grant these: name the binding a new user misses
            account = f"{cluster_scope['namespace']}/{cluster_scope['name']}"
            return PermissionDeniedError(
                f"{what}: the API server refused this pod's identity ({exc.status} {exc.reason}: {exc.message});"
                f" add a ClusterRoleBinding to gpuobj-workload-token-reviewer for ServiceAccount {account}"
                " (the chart names it <release fullname>-workload-token-reviewer, this for a release called gpuobj;"
                " `kubectl get clusterrole -l app.kubernetes.io/component=workload` lists yours):"
                " add the namespace and ServiceAccount to the chart's workloads.bindings, or apply"
                " deploy/operator/rbac-workload.yaml"
            )
        return PermissionDeniedError(
            f"{what}: the API server refused this pod's identity ({exc.status} {exc.reason}: {exc.message}); "
            "bind the pod's ServiceAccount to the gpuobj workload Role (charts/gpuobj, deploy/)"
        )
    if isinstance(exc, ApiError) and exc.status >= 500:
        return ApiUnavailableError(f"{what}: the API server failed ({exc.status} {exc.reason}: {exc.message}); retry")
    if isinstance(exc, ApiError):
        return GpuObjError(f"{what}: the API server refused it ({exc.status} {exc.reason}: {exc.message})")
    if isinstance(exc, KubeConfigError):
        return ConfigurationError(f"{what}: {exc}")
    if isinstance(exc, aiohttp.ClientConnectionError | ConnectionError):
        return ApiUnavailableError(f"{what}: the API server is unreachable ({exc}); retry when it is back")
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return GpuObjTimeoutError(f"{what}: did not finish in time ({exc or 'deadline passed'})")
    return exc


def agent_error(exc: BaseException, *, what: str) -> BaseException:
    """The GpuObjError for an error of the embedded agent (gpuobj_agent.errors), e.g. a non-contiguous tensor."""
    from gpuobj_agent import errors as agent_errors  # the agent is the workload's own (embedded)

    if isinstance(exc, agent_errors.BadRequest):
        return InvalidTensorError(f"{what}: {exc}")
    if isinstance(exc, agent_errors.QuotaExceeded):
        return QuotaExceededError(f"{what}: {exc}")
    if isinstance(exc, agent_errors.AgentError):
        return GpuObjError(f"{what}: {exc}")
    return translate(exc, what=what)
