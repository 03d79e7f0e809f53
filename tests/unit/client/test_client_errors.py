"""The client's error hierarchy and argument checks, without a cluster (the e2e test above it is
tests/e2e/operator/test_client_errors.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

import gpuobj
from gpuobj.client import errors
from gpuobj.client.client import _pod_environment
from gpuobj.client.core import live_address, tensor_list
from gpuobj.client.handles import ObjectAddress, ObjectRef
from gpuobj_agent import errors as agent_errors
from gpuobj_kube.client import ApiError, Conflict, Invalid, NotFound
from gpuobj_kube.config import KubeConfigError


@pytest.mark.parametrize(
    ("exc", "expected", "also"),
    [
        (Conflict(409, "AlreadyExists", 'gpuobjects "w" already exists'), errors.NameTakenError, None),
        (NotFound(404, "NotFound", "gone"), errors.ObjectNotFoundError, None),
        (Invalid(422, "Invalid", "spec.tensors: bad"), errors.InvalidRequestError, ValueError),
        (ApiError(403, "Forbidden", "cannot create gpuobjectclaims"), errors.PermissionDeniedError, PermissionError),
        (ApiError(401, "Unauthorized", "token expired"), errors.PermissionDeniedError, PermissionError),
        (ApiError(503, "ServiceUnavailable", "etcd down"), errors.ApiUnavailableError, ConnectionError),
        (aiohttp.ClientConnectionError("refused"), errors.ApiUnavailableError, ConnectionError),
        (TimeoutError(), errors.GpuObjTimeoutError, TimeoutError),
        (KubeConfigError("no kubeconfig"), errors.ConfigurationError, None),
        (agent_errors.BadRequest("not contiguous"), errors.InvalidTensorError, ValueError),
        (agent_errors.QuotaExceeded("over the pod's quota"), errors.QuotaExceededError, None),
    ],
)
def test_errors_from_below_become_gpuobj_errors(exc: Exception, expected: type, also: type | None) -> None:
    got = errors.agent_error(exc, what="put")
    assert isinstance(got, expected) and isinstance(got, gpuobj.GpuObjError)
    assert also is None or isinstance(got, also)
    assert str(got).startswith("put: ")


def test_permission_denied_says_which_role_to_bind() -> None:
    got = errors.translate(ApiError(403, "Forbidden", "nope"), what="share")
    assert "workload Role" in str(got)


def test_cluster_scope_refusal_names_the_missing_token_reviewer_binding() -> None:
    """The agent's certificate (and token revocation) need a ClusterRoleBinding the namespace's RoleBinding
    cannot give: the error names it and the ServiceAccount to bind (issue 32, a new user's first connect)."""
    message = (
        'certificatesigningrequests.certificates.k8s.io is forbidden: User "system:serviceaccount:team-a:trainer"'
        ' cannot create resource "certificatesigningrequests" in API group "certificates.k8s.io" at the cluster scope'
    )
    got = errors.translate(ApiError(403, "Forbidden", message), what="connect")
    assert isinstance(got, errors.PermissionDeniedError)
    assert "ClusterRoleBinding to gpuobj-workload-token-reviewer for ServiceAccount team-a/trainer" in str(got)
    # A release under another name has its own role name: the message says how to find it.
    assert "kubectl get clusterrole -l app.kubernetes.io/component=workload" in str(got)
    assert "workloads.bindings" in str(got)


def test_non_errors_pass_through_unchanged() -> None:
    cancel = asyncio.CancelledError()
    assert errors.translate(cancel, what="x") is cancel
    mine = errors.ObjectLostError("lost")
    assert errors.translate(mine, what="x") is mine


def test_every_exported_error_is_a_gpuobj_error() -> None:
    exported = [getattr(gpuobj, n) for n in gpuobj.__all__ if n.endswith("Error")]
    assert len(exported) >= 12
    assert all(issubclass(e, gpuobj.GpuObjError) for e in exported)


def test_put_argument_must_be_tensors() -> None:
    t = torch.ones(2)
    assert tensor_list(t, what="put") == [t]
    assert tensor_list((t, t), what="put") == [t, t]
    with pytest.raises(errors.InvalidTensorError, match="item 1 is a list"):
        tensor_list([t, [1, 2]], what="put")
    with pytest.raises(errors.InvalidTensorError, match="no tensors"):
        tensor_list([], what="put")
    with pytest.raises(ValueError):  # also a ValueError, as Python users expect
        tensor_list("weights", what="put")


def test_released_handle_refuses_but_an_address_does_not() -> None:
    address = ObjectAddress("ns", "w", "uid-1", "o-1", "src", "127.0.0.1:1")
    released: list[tuple] = []
    ref = ObjectRef(address, "owner", lambda *a: released.append(a))
    assert live_address(ref, "fetch") is address
    ref.release()
    assert released == [("object", "ns", "w", "uid-1", None)]  # (kind, namespace, name, uid, via)
    with pytest.raises(errors.ReleasedHandleError, match="cannot fetch GPUObject ns/w"):
        live_address(ref, "fetch")
    assert live_address(address, "fetch") is address  # a plain address holds no reference to check
    with pytest.raises(TypeError):
        live_address("w", "fetch")  # type: ignore[arg-type]


def test_connect_reads_the_downward_api_and_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUOBJ_POD_NAME", "GPUOBJ_POD_NAMESPACE", "GPUOBJ_POD_UID", "GPUOBJ_TOKEN_FILE", "GPUOBJ_AGENT_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUOBJ_POD_NAME", "trainer-0")
    monkeypatch.setenv("GPUOBJ_POD_NAMESPACE", "ml")
    with pytest.raises(errors.ConfigurationError) as err:
        _pod_environment()
    assert "GPUOBJ_POD_UID" in str(err.value) and "GPUOBJ_TOKEN_FILE" in str(err.value)
    assert "GPUOBJ_POD_NAME" not in str(err.value)
    monkeypatch.setenv("GPUOBJ_POD_UID", "u-1")
    monkeypatch.setenv("GPUOBJ_TOKEN_FILE", "/var/run/secrets/gpuobj/token")
    got = _pod_environment()
    assert got == {
        "pod_name": "trainer-0",
        "namespace": "ml",
        "pod_uid": "u-1",
        "token_file": "/var/run/secrets/gpuobj/token",
        "port": 8471,
    }
    assert _pod_environment(pod_name="other", port=9000)["pod_name"] == "other"
    monkeypatch.setenv("GPUOBJ_AGENT_PORT", "http")
    with pytest.raises(errors.ConfigurationError, match="not a port"):
        _pod_environment()
