"""The live view's HTTP edge: an aggregated API server for live.gpuobj.io (docs/live-view.md).

Who asks: only the kube-apiserver's aggregator, which proxies a user's request with its front-proxy
client certificate and the user in X-Remote-User/X-Remote-Group (requestheader authentication, read
from the extension-apiserver-authentication ConfigMap in kube-system). What they may see: whatever a
SubjectAccessReview for (verb, live.gpuobj.io, liveobjects, namespace) allows that user, so namespace
RBAC applies as for any built-in resource. What is shown: the agents' inventories, read on demand for
the namespace asked about (bounded concurrency, each pod's answer kept CACHE_SECONDS, one read in flight
per pod whoever asks; a get by name reads only the pod the name starts with), so nothing is written and an
object is visible as soon as its agent lists it. A paged list's rows are kept for its later pages
(rows.Snapshots): only its first page reads agents."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gpuobj_kube.client import ApiError, KubeClient
from gpuobj_operator.agent_client import AgentClient, AgentError, AgentUnreachable
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.liveview import rows as view
from gpuobj_operator.model import PodInfo

log = logging.getLogger(__name__)

AUTH_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")
CACHE_SECONDS = 1.0  # a list reads each pod's agent at most once a second, whoever asks
# A get by name that does not find the object in its pod's cached answer reads that one pod again once the
# answer is this old: a put is found by name within this plus one inventory read even while lists keep
# every pod cached (the target is 2 s), for at most 1 / MISS_SECONDS more reads of that pod per second.
MISS_SECONDS = 0.25
FAN_OUT = 32  # inventory reads in flight for one request
INVENTORY_TIMEOUT = 5.0


@dataclass(frozen=True)
class RequestHeaderConfig:
    """The front proxy's identity and headers, as the API server publishes them."""

    client_ca: str
    allowed_names: tuple[str, ...] = ()
    username_headers: tuple[str, ...] = ("X-Remote-User",)
    group_headers: tuple[str, ...] = ("X-Remote-Group",)

    @classmethod
    def from_configmap(cls, data: dict[str, str]) -> RequestHeaderConfig:
        """Refuses a ConfigMap without a requestheader CA: without it no request could be trusted."""
        ca = data.get("requestheader-client-ca-file", "")
        if not ca.strip():
            raise ValueError(
                "extension-apiserver-authentication has no requestheader-client-ca-file: the API server runs "
                "without --requestheader-client-ca-file, so it cannot proxy to an aggregated API"
            )

        def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            raw = data.get(key)
            return tuple(json.loads(raw)) if raw else default

        return cls(
            client_ca=ca,
            allowed_names=names("requestheader-allowed-names", ()),
            username_headers=names("requestheader-username-headers", ("X-Remote-User",)),
            group_headers=names("requestheader-group-headers", ("X-Remote-Group",)),
        )


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...]


class Unauthorized(Exception):
    pass


def common_names(peer: dict[str, Any] | None) -> list[str]:
    """The subject CNs of a verified peer certificate, as ssl's getpeercert() gives them."""
    return [value for rdn in (peer or {}).get("subject", ()) for key, value in rdn if key == "commonName"]


def authenticate(config: RequestHeaderConfig, peer: dict[str, Any] | None, headers: Any) -> User:
    """The user the front proxy vouches for. The TLS layer verified the chain to the requestheader CA
    (ssl gives a peer certificate only once verified); here its CN must be an allowed name (any, when the
    list is empty, as the API server does)."""
    if not peer:
        raise Unauthorized("no client certificate: only the API server's front proxy may call this API")
    cns = common_names(peer)
    if config.allowed_names and not set(cns) & set(config.allowed_names):
        raise Unauthorized(f"client certificate CN {cns} is not one of requestheader-allowed-names")
    user = next((headers[h] for h in config.username_headers if headers.get(h)), "")
    if not user:
        raise Unauthorized("the front proxy named no user")
    groups = tuple(g for h in config.group_headers for g in headers.getall(h, ()))
    return User(user, groups)


def serving_context(cert_file: str, key_file: str, config: RequestHeaderConfig) -> ssl.SSLContext:
    """TLS with the operator's serving certificate; a client certificate is verified against the
    requestheader CA when sent (optional at the handshake, required by `authenticate`)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    ctx.load_verify_locations(cadata=config.client_ca)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


@dataclass
class _Cached:
    at: float
    rows: list[view.LiveRow]


@dataclass
class LiveSource:
    """Rows for a namespace (or all), from the agents of that namespace's pods; each pod's inventory is
    read at most once per `max_age` (CACHE_SECONDS unless the caller asks fresher), whoever asks, and
    requests that find the same pod stale share one read. Cost per request: one inventory per pod asked
    about, never per object event."""

    ledger: Callable[[], Ledger | None]
    agents: AgentClient
    cache_seconds: float = CACHE_SECONDS
    fan_out: int = FAN_OUT
    _cache: dict[str, _Cached] = field(default_factory=dict)
    _reading: dict[str, asyncio.Future[list[view.LiveRow]]] = field(default_factory=dict)  # by pod uid
    _gate: asyncio.Semaphore | None = None

    def _read_done(self, uid: str, _: asyncio.Future[list[view.LiveRow]]) -> None:
        self._reading.pop(uid, None)

    async def rows(
        self, namespace: str | None, *, name: str | None = None, max_age: float | None = None
    ) -> list[view.LiveRow]:
        """The scope's rows; with `name`, only the pods that name can belong to (its pod's name and a dot)."""
        ledger = self.ledger()
        if ledger is None:
            raise NotLeading()
        pods = [
            p
            for p in ledger.agent_pods()
            if (namespace is None or p.namespace == namespace) and (name is None or name.startswith(p.name + "."))
        ]
        max_age = self.cache_seconds if max_age is None else max_age
        now = time.monotonic()
        for uid in [u for u, c in self._cache.items() if now - c.at > self.cache_seconds]:
            del self._cache[uid]
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.fan_out)  # one for every request: FAN_OUT reads in all
        gate = self._gate

        async def one(pod: PodInfo) -> list[view.LiveRow]:
            cached = self._cache.get(pod.uid)
            if cached is not None and time.monotonic() - cached.at <= max_age:
                return cached.rows
            reading = self._reading.get(pod.uid)
            if reading is None:
                # A task of its own: a request that gives up (its client went away) cancels only its wait.
                reading = asyncio.ensure_future(read(pod))
                self._reading[pod.uid] = reading
                reading.add_done_callback(functools.partial(self._read_done, pod.uid))
            return await asyncio.shield(reading)

        async def read(pod: PodInfo) -> list[view.LiveRow]:
            async with gate:
                try:
                    inventory = await asyncio.wait_for(
                        self.agents.inventory(pod.endpoint or "", pod_uid=pod.uid), INVENTORY_TIMEOUT
                    )
                except (AgentError, AgentUnreachable, TimeoutError) as exc:
                    log.info("live view: no inventory from %s/%s: %s", pod.namespace, pod.name, exc)
                    return []
            if inventory.pod_uid != pod.uid:
                return []
            recorded = {
                o.spec_object_id: view.Recorded(o.name, ledger.references(o))
                for o in ledger.objects_of_pod(pod.namespace, pod.name)
                if o.spec_object_id is not None
            }
            got = view.rows_of(inventory, recorded)
            self._cache[pod.uid] = _Cached(time.monotonic(), got)
            return got

        parts = await asyncio.gather(*(one(p) for p in pods))
        return [r for part in parts for r in part]


class NotLeading(Exception):
    """This replica does not lead: it has no pods' list to read the agents from."""


class LiveViewServer:
    """Serves live.gpuobj.io/v1alpha1 over HTTPS on its own port."""

    def __init__(
        self,
        kube: KubeClient,
        source: LiveSource,
        *,
        host: str,
        port: int,
        cert_file: str,
        key_file: str,
    ) -> None:
        self.kube = kube
        self.source = source
        self.host, self.port = host, port
        self.cert_file, self.key_file = cert_file, key_file
        self.config: RequestHeaderConfig | None = None
        self.snapshots = view.Snapshots()
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        ns, name = AUTH_CONFIGMAP
        cm = await self.kube.request("GET", f"/api/v1/namespaces/{ns}/configmaps/{name}")
        self.config = RequestHeaderConfig.from_configmap(cm.get("data") or {})
        app = web.Application()
        base = f"/apis/{view.GROUP}/{view.VERSION}"
        app.router.add_get("/healthz", self._ok)
        app.router.add_get("/readyz", self._ok)
        app.router.add_get("/livez", self._ok)
        app.router.add_get("/apis", self._groups)
        app.router.add_get(f"/apis/{view.GROUP}", self._group)
        app.router.add_get(base, self._discovery)
        app.router.add_get(f"{base}/{view.PLURAL}", self._list)
        app.router.add_get(f"{base}/namespaces/{{namespace}}/{view.PLURAL}", self._list)
        app.router.add_get(f"{base}/namespaces/{{namespace}}/{view.PLURAL}/{{name}}", self._get)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.host, self.port, ssl_context=serving_context(self.cert_file, self.key_file, self.config)
        )
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------ edge

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        return web.json_response(view.status(code, reason, message), status=code)

    def _user(self, request: web.Request) -> User:
        assert self.config is not None
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        peer = ssl_object.getpeercert() if ssl_object is not None else None
        return authenticate(self.config, peer, request.headers)

    async def _allowed(self, user: User, verb: str, namespace: str | None, name: str | None = None) -> bool:
        attributes: dict[str, Any] = {"verb": verb, "group": view.GROUP, "version": view.VERSION}
        attributes["resource"] = view.PLURAL
        if namespace is not None:
            attributes["namespace"] = namespace
        if name is not None:
            attributes["name"] = name
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": user.name, "groups": list(user.groups), "resourceAttributes": attributes},
        }
        answer = await self.kube.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body=review)
        return bool((answer.get("status") or {}).get("allowed"))

    async def _admit(
        self, request: web.Request, verb: str, namespace: str | None, name: str | None = None
    ) -> User | web.Response:
        """The user when the request may go on (a SubjectAccessReview on every request, later pages
        included); else the Status to answer."""
        try:
            user = self._user(request)
        except Unauthorized as exc:
            return self._status(401, "Unauthorized", str(exc))
        try:
            allowed = await self._allowed(user, verb, namespace, name)
        except ApiError as exc:
            return self._status(503, "ServiceUnavailable", f"cannot review access: {exc}")
        if not allowed:
            where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            what = f"{view.PLURAL}.{view.GROUP}{f' {name!r}' if name else ''}"
            message = f'{what} is forbidden: User "{user.name}" cannot {verb} resource "{view.PLURAL}" '
            message += f'in API group "{view.GROUP}" {where}'
            return self._status(403, "Forbidden", message)
        return user

    async def _ok(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    @staticmethod
    def _group_body() -> dict[str, Any]:
        version = {"groupVersion": view.API_VERSION, "version": view.VERSION}
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": view.GROUP,
            "versions": [version],
            "preferredVersion": version,
        }

    async def _groups(self, request: web.Request) -> web.Response:
        if (denied := self._authenticated_only(request)) is not None:
            return denied
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group_body()]})

    async def _group(self, request: web.Request) -> web.Response:
        if (denied := self._authenticated_only(request)) is not None:
            return denied
        return web.json_response(self._group_body())

    async def _discovery(self, request: web.Request) -> web.Response:
        if (denied := self._authenticated_only(request)) is not None:
            return denied
        return web.json_response(view.discovery())

    def _authenticated_only(self, request: web.Request) -> web.Response | None:
        """Discovery is for anyone the front proxy vouches for, as the API server's own is."""
        try:
            self._user(request)
        except Unauthorized as exc:
            return self._status(401, "Unauthorized", str(exc))
        return None

    async def _list(self, request: web.Request) -> web.Response:
        namespace = request.match_info.get("namespace")
        if request.query.get("watch") in ("1", "true"):
            return self._status(405, "MethodNotAllowed", "the live view does not serve watch; list again")
        try:
            limit = view.parse_limit(request.query.get("limit"))
            token = request.query.get("continue") or None
            cursor = view.decode_continue(token) if token else None
        except view.BadRequest as exc:
            return self._status(400, "BadRequest", str(exc))
        if isinstance(user := await self._admit(request, "list", namespace), web.Response):
            return user
        if cursor is not None:  # a later page: its list's snapshot, no agent read
            try:
                chosen, next_token = self.snapshots.next(cursor, limit, namespace, user.name)
            except view.Expired as exc:
                return self._status(410, "Expired", str(exc))
            except view.BadRequest as exc:
                return self._status(400, "BadRequest", str(exc))
        else:
            try:
                rows = await self.source.rows(namespace)
            except NotLeading:
                return self._status(503, "ServiceUnavailable", "this operator replica does not lead; try again")
            chosen, next_token = self.snapshots.first(rows, limit, namespace, user.name)
        now = dt.datetime.now(dt.UTC)
        if view.wants_table(request.headers.get("Accept", "")):
            return web.json_response(view.to_table(chosen, next_token, now))
        return web.json_response(view.to_list(chosen, next_token, now))

    async def _get(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if isinstance(denied := await self._admit(request, "get", namespace, name), web.Response):
            return denied
        try:
            row = next((r for r in await self.source.rows(namespace, name=name) if r.name == name), None)
            if row is None:  # put since its pod's answer was cached? ask that pod again, at most every MISS_SECONDS
                fresh = await self.source.rows(namespace, name=name, max_age=MISS_SECONDS)
                row = next((r for r in fresh if r.name == name), None)
        except NotLeading:
            return self._status(503, "ServiceUnavailable", "this operator replica does not lead; try again")
        if row is None:
            return self._status(404, "NotFound", f'{view.PLURAL}.{view.GROUP} "{name}" not found')
        now = dt.datetime.now(dt.UTC)
        if view.wants_table(request.headers.get("Accept", "")):
            return web.json_response(view.to_table([row], "", now))
        return web.json_response(view.to_object(row, now))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The operator's flags for the live view (off unless a port is given, as the chart does when enabled)."""
    p.add_argument(
        "--live-view-port",
        type=int,
        default=int(os.environ.get("GPUOBJ_LIVE_VIEW_PORT", "0")),
        help="serves the live.gpuobj.io aggregated API over HTTPS on this port (docs/live-view.md); 0: off",
    )
    p.add_argument("--live-view-host", default="0.0.0.0")
    p.add_argument(
        "--live-view-cert-dir",
        default=os.environ.get("GPUOBJ_LIVE_VIEW_CERT_DIR", "/var/run/gpuobj/live-view"),
        help="tls.crt and tls.key: the serving certificate the APIService's caBundle verifies",
    )


async def serve(
    args: argparse.Namespace, kube: KubeClient, agents: AgentClient, ledger: Callable[[], Ledger | None]
) -> LiveViewServer | None:
    """Starts the live view when its port is set; None when it is off."""
    if not args.live_view_port:
        return None
    cert_dir = Path(args.live_view_cert_dir)
    server = LiveViewServer(
        kube,
        LiveSource(ledger, agents),
        host=args.live_view_host,
        port=args.live_view_port,
        cert_file=str(cert_dir / "tls.crt"),
        key_file=str(cert_dir / "tls.key"),
    )
    port = await server.start()
    print(f"gpuobj operator: live view ({view.API_VERSION}) on https://{args.live_view_host}:{port}", flush=True)
    return server
