"""The live view (live.gpuobj.io, docs/live-view.md) as the scale run reads it: straight from the operator.

Why not through the API server's aggregator: the run measures the operator's view (how soon a put is
listed, how long listing everything takes), not the APIService plumbing tests/e2e/liveview checks. So the
run calls the operator's HTTPS port the way the aggregator does: with a client certificate the
requestheader CA signed for the front proxy's name, naming the user in X-Remote-User/X-Remote-Group. The
user is in system:masters, so the operator's SubjectAccessReview allows it at every scope.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gpuobj_dev.testing.cluster import ClusterHandle

GROUP_VERSION = "live.gpuobj.io/v1alpha1"
PLURAL = "liveobjects"
USER = "gpuobj-scale-bench"
GROUPS = ("system:masters",)
PAGE = 5000  # the view's largest page (rows.MAX_LIMIT)


def object_name(pod: str, object_id: str) -> str:
    """The view's name of a live object: the pod and the id its agent gave it (rows.object_name)."""
    return f"{pod}.{object_id}"


def rbac(namespace: str, service_account: str, suffix: str) -> list[dict[str, Any]]:
    """The chart's delegated-auth bindings (charts/gpuobj/templates/liveview.yaml) for the run's operator:
    it reads the requestheader CA in kube-system and asks SubjectAccessReviews."""
    subject = [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]
    name = f"gpuobj-scale-live-view-{suffix}"
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{name}:auth-delegator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:auth-delegator",
            },
            "subjects": subject,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{name}:auth-reader", "namespace": "kube-system"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            },
            "subjects": subject,
        },
    ]


@dataclass
class LiveViewEndpoint:
    """Where the run's operator serves the view, and the credentials the front proxy would use."""

    url: str  # https://127.0.0.1:port
    ca: Path
    client_cert: Path
    client_key: Path
    cert_dir: Path  # tls.crt and tls.key, the operator's --live-view-cert-dir

    @classmethod
    def make(cls, handle: ClusterHandle, folder: Path, port: int, proxy_cn: str) -> LiveViewEndpoint:
        """A serving certificate for 127.0.0.1 and a front-proxy client certificate, both from the cluster's
        CA (which is the API server's requestheader CA on the dev cluster)."""
        pki = handle.cluster.pki
        serving = pki.issue("live-view-serving", "gpuobj-live-view", server_ips=("127.0.0.1",))
        proxy = pki.issue("live-view-proxy-client", proxy_cn)
        cert_dir = folder / "live-view-cert"
        cert_dir.mkdir(parents=True, exist_ok=True)
        (cert_dir / "tls.crt").write_bytes(serving.cert.read_bytes())
        (cert_dir / "tls.key").write_bytes(serving.key.read_bytes())
        return cls(f"https://127.0.0.1:{port}", pki.ca.cert, proxy.cert, proxy.key, cert_dir)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


class LiveViewClient:
    """GET one live object, list them all (paged); use as `async with LiveViewClient(endpoint) as v:`."""

    def __init__(self, endpoint: LiveViewEndpoint, timeout: float = 60.0) -> None:
        self.endpoint = endpoint
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.headers = {"X-Remote-User": USER, "Accept": "application/json"}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LiveViewClient:
        connector = aiohttp.TCPConnector(ssl=self.endpoint.ssl_context(), limit=16)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        assert self._session is not None
        headers = [*self.headers.items(), *(("X-Remote-Group", g) for g in GROUPS)]
        return self._session.get(f"{self.endpoint.url}{path}", params=params, headers=headers)

    async def has(self, namespace: str, name: str) -> bool:
        """Whether the view lists this object now (200), not yet (404); anything else is an error."""
        async with self._get(f"/apis/{GROUP_VERSION}/namespaces/{namespace}/{PLURAL}/{name}") as resp:
            if resp.status == 404:
                return False
            if resp.status != 200:
                raise RuntimeError(f"live view GET {namespace}/{name}: {resp.status} {await resp.text()}")
            return True

    async def list_all(self, namespace: str | None = None, limit: int = PAGE) -> tuple[int, int, float]:
        """Every live object, page after page: (rows, pages, seconds)."""
        path = f"/apis/{GROUP_VERSION}/" + (f"namespaces/{namespace}/" if namespace else "") + PLURAL
        token, rows, pages = "", 0, 0
        t0 = time.monotonic()
        while True:
            params = {"limit": str(limit), **({"continue": token} if token else {})}
            async with self._get(path, params) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"live view list (page {pages + 1}): {resp.status} {await resp.text()}")
                body = json.loads(await resp.read())
            rows += len(body.get("items") or [])
            pages += 1
            token = (body.get("metadata") or {}).get("continue") or ""
            if not token:
                return rows, pages, time.monotonic() - t0
