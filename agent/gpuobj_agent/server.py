"""The control server: the agent's HTTP/1.1 JSON API (docs/agent-api.md).

Why it is thin: handlers parse and validate input, call the store or its read side, and turn the
contract's typed answers into JSON (the only place the agent does: JSON only at the server edge). They
never wait on NIXL data (transfers happen on the reader's side, on threads), so metadata
and tickets are always served promptly, whatever transfers are running (docs/design.md, "out-of-order deadlock").
Every `/v1/` route needs the caller's projected ServiceAccount token (gpuobj_agent.auth): the
control routes (free, inventory, materialize, stream-free, info) the operator's, the read routes a
pod-bound token of a pod the object is readable from. Malformed input is a 400 with a message,
unknown objects on read paths a 404, and no user input can produce a 500 or change anything.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from aiohttp import web

from gpuobj_agent.auth import Caller, Forbidden
from gpuobj_agent.config import AgentConfig
from gpuobj_agent.errors import AgentError, BadRequest, Conflict, NotReady, Unauthorized
from gpuobj_agent.layouts import TensorLayout
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.objects import check_id, check_stream
from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names

log = logging.getLogger(__name__)


class Authenticator(Protocol):
    """Verifies a caller's projected token (auth.ServiceAccountAuth)."""

    async def operator(self, authorization: str | None) -> Caller: ...

    async def reader(self, authorization: str | None) -> Caller: ...


class Describable(Protocol):
    def answer(self) -> api.ObjectDescription: ...


class Objects(Protocol):
    """What the routes call on the object store (store.ObjectStore)."""

    @property
    def ready(self) -> bool: ...

    @property
    def active_nixl_agent(self) -> str | None: ...

    def describe(self, object_id: str) -> api.ObjectDescription: ...

    def shared_with(self, object_id: str) -> frozenset[str]: ...

    async def materialize(
        self,
        object_id: str,
        layouts: list[TensorLayout],
        *,
        key: str | None = None,
        stream: str | None = None,
        stream_index: int | None = None,
        shared_with: Sequence[str] = (),
    ) -> tuple[bool, Describable]: ...

    async def free(self, object_id: str, *, reason: str | None = None, wait_fence: bool = False) -> api.FreeAnswer: ...

    async def free_stream(self, stream: str) -> api.StreamFreeAnswer: ...


class Reading(Protocol):
    """What the read routes call on the store's read side (reads.Reads)."""

    async def begin_read(self, object_id: str, reader: str) -> api.ReadTicket: ...

    async def end_read(self, read_id: str) -> api.ReadEndAnswer: ...

    def read_taken_by(self, read_id: str) -> str | None: ...


class Served(Protocol):
    """What the control server needs of the agent it serves (agent.Agent is one); nothing else of it."""

    @property
    def config(self) -> AgentConfig: ...  # the pod's namespace and uid

    @property
    def incarnation(self) -> str: ...  # this process, as the operator records it

    @property
    def tokens(self) -> Authenticator: ...

    @property
    def metrics(self) -> AgentMetrics: ...

    @property
    def store(self) -> Objects: ...

    @property
    def reads(self) -> Reading: ...  # the store's read side

    def info(self) -> api.AgentInfo: ...

    def inventory(self) -> api.Inventory: ...

    def tell_write_rate(self, per_second: float) -> None: ...  # the operator's word on a probe (0: no budget)


MAX_BODY = 1 << 20
AGENT_KEY = web.AppKey("gpuobj_agent", object)  # the Served agent (extra routes, e.g. the test workload's, use more)
ROLES_KEY = web.AppKey("gpuobj_roles", dict)  # (method, route) -> "operator" | "reader"
CALLER = web.RequestKey("gpuobj_caller", Caller)  # the verified caller
OPEN_PATHS = tuple(route.template for route in api.OPEN_ROUTES)
OPERATOR, READER = "operator", "reader"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Request = TypeVar("Request")


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response(api.ErrorAnswer(message).to_json(), status=status, headers=headers or None)


def _check_meant_for_this_pod(agent: Served, role: str, expect: str | None) -> None:
    """The operator's token opens the control routes of every agent, so each of its requests must name the
    pod it means (`Gpuobj-Pod-UID`): a request replayed at another agent, or sent to an address that now
    belongs to another pod, is refused before its token is even looked at. A reader may name it too.

    The answer never says which pod this agent serves: a replayer learns nothing to put in the header.
    """
    if expect is None:
        if role == OPERATOR and agent.config.pod_uid:  # an agent outside Kubernetes serves no pod to name
            raise Conflict(f"name the pod this request is meant for ({names.HEADER_POD_UID}); refused")
        return
    if not agent.config.pod_uid or expect != agent.config.pod_uid:
        # The caller means another pod (its address was reused, a pod lied about it, or a replay).
        raise Conflict(f"this agent does not serve pod uid {expect}; refused")


def _check_bound_to_channel(request: web.Request, role: str, caller: Caller) -> None:
    """Over TLS a bearer token counts only with the client certificate of the same identity (mTLS): the
    operator's names its ServiceAccount, a reader's its pod (docs/security.md, "A token bound to its
    channel"). A token replayed elsewhere, without that key, is refused; a plain-HTTP agent checks nothing."""
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is None:
        return
    cert = transport.get_extra_info("peercert") or {}
    uris = {value for kind, value in cert.get("subjectAltName", ()) if kind == "URI"}
    if role == OPERATOR or not caller.pod_name or not caller.pod_uid:
        want = agent_tls.service_account_uri(caller.namespace, caller.service_account)
    else:
        want = agent_tls.pod_uri(caller.namespace, caller.pod_name, caller.pod_uid)
    if want not in uris:
        raise Unauthorized(f"the bearer token counts only with the client certificate of {want}; refused")


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Check the caller on /v1/, and turn every failure into a JSON answer; only our bugs are a 500.

    One middleware, not two: each layer costs a coroutine per request on the ticket path. A route
    not listed as a read route is an operator route: a new route is closed until someone opens it. A
    path that matches no route here is a 404 (405) to anyone: it serves and changes nothing, and a
    receiver's hand-off release must read this agent's 404 when no embedding client added that route.
    """
    agent: Served = request.app[AGENT_KEY]  # type: ignore[assignment]
    try:
        route = request.match_info.route
        if request.path.startswith(api.PROTECTED_PREFIX) and route.resource is not None:
            method = "GET" if request.method == "HEAD" else request.method
            role = request.app[ROLES_KEY].get((method, route.resource.canonical), OPERATOR)
            _check_meant_for_this_pod(agent, role, request.headers.get(names.HEADER_POD_UID))
            header = request.headers.get("Authorization")
            auth = agent.tokens
            caller = await (auth.reader(header) if role == READER else auth.operator(header))
            _check_bound_to_channel(request, role, caller)
            request[CALLER] = caller
        return await handler(request)
    except AgentError as exc:
        if exc.status >= 500 and exc.status != 503:
            agent.metrics.error("internal")
            log.error("%s %s failed: %s", request.method, request.path, exc)
        headers = {"WWW-Authenticate": 'Bearer realm="gpuobj-agent"'} if exc.status == 401 else {}
        return _error(exc.status, str(exc), **headers)
    except UnicodeError:  # a header or path that is not text: malformed, never a 500
        return _error(400, "request is not valid UTF-8 text")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return _error(exc.status, exc.reason or "error", **allow)
    except Exception:
        agent.metrics.error("internal")
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal error (see the agent log)")


async def _json(request: web.Request, *, required: bool = False) -> Any:
    """The decoded JSON body ({} when empty, unless required); its shape is checked by whoever reads it."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("a JSON object body is required")
        return {}
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None


async def _body(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The JSON object body of a route whose body has no shape of its own (fields of ``allowed`` only)."""
    return _parse(lambda data: api.request_fields(data, allowed), await _json(request))


def _write_rate(text: str) -> float:
    """A told write rate: a finite number of writes a second, 0 or more."""
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not 0 <= rate <= api.MAX_WRITE_RATE:  # NaN fails this too
        raise BadRequest(
            f"{names.HEADER_WRITE_RATE} must be a number of writes a second from 0 to {api.MAX_WRITE_RATE:g}"
        )
    return rate


def _query_int(request: web.Request, key: str, low: int, high: int, *, default: int) -> int:
    text = request.query.get(key)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise BadRequest(f"{key} must be a whole number from {low} to {high}")
    return int(text)


def _parse(shape: Callable[[Any], Request], data: Any) -> Request:
    """A request body read through its agent_api shape; what it refuses is a 400 naming the field."""
    try:
        return shape(data)
    except ValueError as exc:  # agent_api.RequestError
        raise BadRequest(str(exc)) from None


class Routes:
    """Handlers bound to one agent."""

    def __init__(self, agent: Served) -> None:
        self.agent = agent
        self.store = agent.store
        self.reads = agent.reads

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response(api.HealthAnswer("ok").to_json())

    async def readyz(self, request: web.Request) -> web.Response:
        active = self.store.active_nixl_agent
        if active is not None:
            return web.json_response(api.HealthAnswer("ready", active).to_json())
        return _error(503, "not ready: the NIXL agent is not up")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.agent.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def info(self, request: web.Request) -> web.Response:
        """Whose agent this is. The operator's probe may carry the pod's share of the fleet's write budget
        (`Gpuobj-Write-Rate`, writes a second; 0: none), which the pod's write-behind paces its writes at
        (docs/write-behind.md): told here, so the budget costs no request of its own."""
        told = request.headers.get(names.HEADER_WRITE_RATE)
        if told is not None:
            self.agent.tell_write_rate(_write_rate(told))
        return web.json_response(self.agent.info().to_json())

    async def inventory(self, request: web.Request) -> web.Response:
        """Everything, or one page of it (`limit`, `continue`: gpuobj_contract.agent_api.MAX_INVENTORY_PAGE)."""
        answer = self.agent.inventory()
        if "limit" not in request.query and "continue" not in request.query:
            return web.json_response(answer.to_json())
        limit = _query_int(request, "limit", 1, api.MAX_INVENTORY_PAGE, default=api.INVENTORY_PAGE)
        after: tuple[str, str] | None = None
        if "continue" in request.query:
            try:
                after = api.parse_inventory_token(request.query["continue"])
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        ordered = sorted(answer.objects, key=api.inventory_order)
        start = 0 if after is None else bisect.bisect_right(ordered, after, key=api.inventory_order)
        page = ordered[start : start + limit]
        more = start + limit < len(ordered)
        answer = dataclasses.replace(
            answer, objects=tuple(page), continue_token=api.inventory_token(page[-1]) if more else ""
        )
        return web.json_response(answer.to_json())

    async def get_object(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.describe(check_id(request.match_info["id"])).to_json())

    async def put_object(self, request: web.Request) -> web.Response:
        object_id = check_id(request.match_info["id"])
        req = _parse(api.MaterializeRequest.from_json, await _json(request, required=True))
        created, obj = await self.store.materialize(
            object_id,
            list(req.tensors),
            key=req.key,
            stream=req.stream,
            stream_index=req.stream_index,
            shared_with=req.shared_with,
        )
        # The operator records which process holds the bytes (api.MaterializeAnswer): its liveness rules need it.
        described = obj.answer()
        answer = api.MaterializeAnswer(created, described.id, described.bytes, self.agent.incarnation, described)
        return web.json_response(answer.to_json())

    async def begin_read(self, request: web.Request) -> web.Response:
        object_id = check_id(request.match_info["id"])
        # `reader` is informational (the verified token names the reader), but checked like every field.
        _parse(api.ReadRequest.from_json, await _json(request))
        caller: Caller = request[CALLER]
        self._authorize_read(caller, object_id)
        if not self.store.ready:
            raise NotReady("the agent is stopping")
        ticket = await self.reads.begin_read(object_id, caller.pod or caller.subject)
        return web.json_response(ticket.to_json())

    def _authorize_read(self, caller: Caller, object_id: str) -> None:
        """Namespaces are the tenancy boundary: the source's own, or one the object grants.

        Refused the same way whether or not the object exists, so a stranger learns nothing.
        """
        if caller.namespace == self.agent.config.namespace:
            return
        if caller.namespace not in self.store.shared_with(object_id):
            raise Forbidden(
                f"pod {caller.pod} may not read object {object_id} of namespace {self.agent.config.namespace}"
            )

    async def end_read(self, request: web.Request) -> web.Response:
        """Only the pod that took a ticket ends it: an end lets a waiting free proceed, so another pod's
        end would have the free pull the memory from under a read that still counts as valid."""
        read_id = check_id(request.match_info["read_id"], "read id")
        caller: Caller = request[CALLER]
        taken_by = self.reads.read_taken_by(read_id)
        if taken_by is not None and taken_by != (caller.pod or caller.subject):
            raise Forbidden(f"pod {caller.pod} may not end read {read_id}: another pod took it")
        return web.json_response((await self.reads.end_read(read_id)).to_json())

    async def free(self, request: web.Request) -> web.Response:
        object_id = check_id(request.match_info["id"])
        req = _parse(api.FreeRequest.from_json, await _json(request))
        answer = await self.store.free(object_id, reason=req.reason, wait_fence=req.wait_fence)
        return web.json_response(answer.to_json())

    async def free_stream(self, request: web.Request) -> web.Response:
        stream = check_stream(request.match_info["stream"])
        await _body(request, frozenset({"reason"}))
        return web.json_response((await self.store.free_stream(stream)).to_json())


@dataclasses.dataclass(frozen=True)
class ReaderCall:
    """What an extra read route (an embedding client's, e.g. its hand-off release) is given: the caller the
    guard verified as for begin/end read, and the agent it asks. Its errors are the agent's (AgentError,
    auth.Forbidden): the guard answers them as every route's, so the route copies none of that."""

    caller: Caller
    namespace: str  # the agent's pod namespace
    incarnation: str  # the agent process
    params: dict[str, str]  # the path's parameters
    _request: web.Request

    async def fields(self, allowed: frozenset[str]) -> dict[str, Any]:
        """The JSON object body, fields of ``allowed`` only (400 otherwise)."""
        return await _body(self._request, allowed)


ReaderRoute = Callable[[ReaderCall], Awaitable[dict[str, Any]]]  # the 200 answer's JSON


def add_reader_route(app: web.Application, route: api.Route, answer: ReaderRoute) -> None:
    """Open an extra route to readers (called from `extra`, see build_app): the caller's pod-bound token and
    channel are checked as for the read routes, then ``answer`` is awaited; the agent knows nothing else of it."""
    app[ROLES_KEY][(route.method, route.template)] = READER
    agent: Served = app[AGENT_KEY]  # type: ignore[assignment]

    async def handle(request: web.Request) -> web.Response:
        call = ReaderCall(request[CALLER], agent.config.namespace, agent.incarnation, dict(request.match_info), request)
        return web.json_response(await answer(call))

    app.router.add_route(route.method, route.template, handle)


def build_app(agent: Served, extra: Callable[[web.Application], None] | None = None) -> web.Application:
    """The aiohttp application; `extra` may add routes (an embedding client's hand-off release, through
    add_reader_route; the test workload's)."""
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    app[AGENT_KEY] = agent
    app[ROLES_KEY] = {(r.method, r.template): READER for r in (api.BEGIN_READ, api.END_READ)}
    r = Routes(agent)
    for route, handler in (
        (api.HEALTHZ, r.healthz),
        (api.READYZ, r.readyz),
        (api.METRICS, r.metrics),
        (api.INFO, r.info),
        (api.INVENTORY, r.inventory),
        (api.GET_OBJECT, r.get_object),
        (api.MATERIALIZE, r.put_object),
        (api.BEGIN_READ, r.begin_read),
        (api.END_READ, r.end_read),
        (api.FREE, r.free),
        (api.FREE_STREAM, r.free_stream),
    ):
        app.router.add_route(route.method, route.template, handler)
    if extra is not None:
        extra(app)
    return app
