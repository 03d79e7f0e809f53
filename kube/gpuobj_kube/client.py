"""A small async Kubernetes REST client on aiohttp.

Why not the official client: it is synchronous and slow per call, and the client
library runs inside workloads' processes where a blocking call per put or release
would cost more than the transfer. This speaks plain REST (JSON, merge and JSON
patches, watches) and maps API errors to exceptions that say what went wrong.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from gpuobj_contract import names

# The longest watch event line read: an event carries a whole object, and aiohttp's line reader stops at
# 512 KiB, which a GPUObject near the CRD's limits applied with `kubectl apply` (its spec
# again in the last-applied annotation) passes; the watch then failed and relisted forever (issue 32).
# The API server takes requests up to 3 MiB and etcd stores objects up to 1.5 MiB by default: 8 MiB is
# over twice either, and only bounds the buffer of one line, which is as long as the event it holds.
WATCH_LINE_LIMIT = 8 << 20

if TYPE_CHECKING:  # gpuobj_kube.config imports the kubernetes package; its errors below must not need it
    from gpuobj_kube.config import KubeConfig


@dataclass(frozen=True)
class Resource:
    """One API resource type: where its REST paths live."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


PODS = Resource("", "v1", "pods", "Pod")
EVENTS = Resource("", "v1", "events", "Event")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
SECRETS = Resource("", "v1", "secrets", "Secret")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
CSRS = Resource(
    "certificates.k8s.io", "v1", "certificatesigningrequests", "CertificateSigningRequest", namespaced=False
)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False)
GPUOBJECTS = Resource(names.GROUP, names.VERSION, names.PLURAL_OBJECT, names.KIND_OBJECT)
CLAIMS = Resource(names.GROUP, names.VERSION, names.PLURAL_CLAIM, names.KIND_CLAIM)
STREAMS = Resource(names.GROUP, names.VERSION, names.PLURAL_STREAM, names.KIND_STREAM)


class ApiError(Exception):
    """The API server refused a request."""

    def __init__(self, status: int, reason: str, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    """409: resourceVersion conflict, or AlreadyExists on create."""

    @property
    def already_exists(self) -> bool:
        return self.reason == "AlreadyExists"


class ApiTimeout(ApiError, TimeoutError):
    """No answer from the API server within the request's deadline: it is down, overloaded or cut off.

    A TimeoutError too, so code that waits on deadlines treats it as one; its message names the request."""


class Gone(ApiError):
    """410: a watch's resourceVersion is too old; list again."""


class Invalid(ApiError):
    """422: schema or CEL validation refused the object."""


_ERRORS = {404: NotFound, 409: Conflict, 410: Gone, 422: Invalid}

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",
}


class KubeClient:
    """One aiohttp session to one API server. Use as an async context manager or call close()."""

    def __init__(self, config: KubeConfig | None = None, *, request_timeout: float = 30.0, pool: int = 32) -> None:
        if config is None:
            from gpuobj_kube.config import load as load_config

            config = load_config()
        self.config = config
        self.request_timeout = request_timeout
        self._pool = pool
        self._session: aiohttp.ClientSession | None = None
        self.throttled = 0  # 429 answers so far, retried or not: callers that pace themselves read it

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context, limit=self._pool)
            self._session = aiohttp.ClientSession(connector=connector, headers={"User-Agent": "gpuobj/0.1"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        authorization = self.config.authorization()
        if authorization:
            headers["Authorization"] = authorization
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def _fresh_credentials(self) -> None:
        """Reload expired credentials off the event loop: an exec plugin may take a while to answer."""
        if self.config.needs_refresh():
            await asyncio.to_thread(self.config.credentials)

    @staticmethod
    async def _raise_for(resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        text = await resp.text()
        try:
            body = json.loads(text)
        except ValueError:
            body = {}
        cls = _ERRORS.get(resp.status, ApiError)
        raise cls(resp.status, body.get("reason", resp.reason or ""), body.get("message", text[:500]), body)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One API call. A 429 (priority and fairness, a CRD's cache warming up) is retried after
        its Retry-After, as client-go does, within the same deadline; a 401 once, with credentials
        loaded again (an expired exec-plugin token, a rotated token file)."""
        data = None if body is None else (body if isinstance(body, str | bytes) else json.dumps(body))
        deadline = asyncio.get_running_loop().time() + (timeout or self.request_timeout)
        reauthenticated = False
        while True:
            await self._fresh_credentials()
            left = deadline - asyncio.get_running_loop().time()
            try:
                async with self.session.request(
                    method,
                    self.config.server + path,
                    params={k: str(v) for k, v in (params or {}).items() if v is not None},
                    data=data,
                    headers=self._headers(content_type if data is not None else None),
                    timeout=aiohttp.ClientTimeout(total=max(left, 0.1)),
                ) as resp:
                    if resp.status == 429:
                        self.throttled += 1
                        delay = min(float(resp.headers.get("Retry-After", "1") or 1), 1.0)
                        if asyncio.get_running_loop().time() + delay < deadline:
                            await asyncio.sleep(delay)
                            continue
                    if resp.status == 401 and not reauthenticated:
                        reauthenticated = True
                        await asyncio.to_thread(self.config.invalidate)
                        continue
                    await self._raise_for(resp)
                    if resp.status == 204:
                        return {}
                    answer: dict[str, Any] = await resp.json(content_type=None)
                    return answer
            except TimeoutError as exc:
                waited = timeout or self.request_timeout
                message = f"{method} {path}: no answer from the API server at {self.config.server} in {waited:g}s"
                raise ApiTimeout(0, "Timeout", message) from exc

    # ------------------------------------------------------------ verbs

    async def get(
        self, res: Resource, name: str, namespace: str | None = None, *, subresource: str | None = None
    ) -> dict[str, Any]:
        return await self.request("GET", res.path(namespace, name, subresource))

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        not_older_than: str | None = None,
        exact: str | None = None,
    ) -> dict[str, Any]:
        """List all pages; the result's metadata.resourceVersion is the last page's (good for a watch).

        ``not_older_than``: a resourceVersion; the API server may answer from its watch cache once
        that cache has reached it (no quorum read from etcd), and never from an older state.
        ``exact``: the state at exactly that resourceVersion (Gone once etcd compacted it away)."""
        if not_older_than and exact:
            raise ValueError("list: not_older_than and exact exclude each other")
        version, match = (exact, "Exact") if exact else (not_older_than, "NotOlderThan" if not_older_than else None)
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            page = await self.request(
                "GET",
                res.path(namespace),
                params={
                    "labelSelector": label_selector,
                    "fieldSelector": field_selector,
                    "limit": limit,
                    "continue": cont,
                    "resourceVersion": version if cont is None else None,
                    "resourceVersionMatch": match if cont is None else None,
                },
            )
            items.extend(page.get("items", []))
            cont = page.get("metadata", {}).get("continue")
            if not cont:
                page["items"] = items
                return page

    async def create(
        self, res: Resource, body: dict[str, Any], namespace: str | None = None, *, subresource: str | None = None
    ) -> dict[str, Any]:
        body.setdefault("apiVersion", res.api_version)
        body.setdefault("kind", res.kind)
        path = res.path(namespace, body["metadata"]["name"], subresource) if subresource else res.path(namespace)
        return await self.request("POST", path, body=body)

    async def replace(
        self,
        res: Resource,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return await self.request("PUT", res.path(namespace, name, subresource), body=body)

    async def patch(
        self,
        res: Resource,
        name: str,
        body: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
        field_manager: str | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"fieldManager": field_manager}
        if patch_type == "apply":
            params["force"] = "true" if force else None
        return await self.request(
            "PATCH",
            res.path(namespace, name, subresource),
            params=params,
            body=body,
            content_type=PATCH_TYPES[patch_type],
        )

    async def delete(
        self,
        res: Resource,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
        propagation: str | None = None,
        grace_period_seconds: int | None = None,
    ) -> dict[str, Any]:
        """Delete, optionally only a given incarnation (uid) or version: a late delete never hits a successor."""
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        pre = {k: v for k, v in {"uid": uid, "resourceVersion": resource_version}.items() if v}
        if pre:
            options["preconditions"] = pre
        if propagation:
            options["propagationPolicy"] = propagation
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        return await self.request("DELETE", res.path(namespace, name), body=options)

    async def watch(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield (type, object) until the server ends the watch; raises Gone when the version is too old."""
        await self._fresh_credentials()
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "labelSelector": label_selector,
            "fieldSelector": field_selector,
            "timeoutSeconds": timeout_seconds,
        }
        async with self.session.get(
            self.config.server + res.path(namespace),
            params={k: str(v) for k, v in params.items() if v is not None},
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.request_timeout, sock_read=timeout_seconds + 30
            ),
        ) as resp:
            if resp.status == 401:  # the caller watches again, with credentials loaded again
                await asyncio.to_thread(self.config.invalidate)
            await self._raise_for(resp)
            while raw := await _watch_line(resp.content):
                line = raw.strip()
                if not line:
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    status = event["object"]
                    code = status.get("code", 500)
                    raise _ERRORS.get(code, ApiError)(code, status.get("reason", ""), status.get("message", ""), status)
                yield event["type"], event["object"]


class WatchLineTooLong(ApiError):
    """A watch sent an event line over WATCH_LINE_LIMIT: not an API server's (see there)."""


async def _watch_line(content: aiohttp.StreamReader) -> bytes:
    """The next line of a watch (b"" at its end), up to WATCH_LINE_LIMIT bytes, not aiohttp's 512 KiB."""
    try:
        return await content.readuntil(b"\n", max_size=WATCH_LINE_LIMIT)
    except aiohttp.http_exceptions.LineTooLong:
        raise WatchLineTooLong(
            0, "LineTooLong", f"a watch event line longer than {WATCH_LINE_LIMIT} bytes (WATCH_LINE_LIMIT)"
        ) from None
