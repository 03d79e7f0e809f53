"""The control server: the agent's HTTP/1.1 JSON API (docs/agent-api.md).

Why it is thin: handlers parse and validate input, call the store, and shape JSON. They
never wait on NIXL data (transfers happen on the reader's side, on threads), so metadata
and tickets are always served promptly, whatever transfers are running (seed 002).
Every `/v1/` route needs the bearer token; malformed input is a 400 with a message,
unknown objects on read paths a 404, and no user input can produce a 500.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gpuobj_agent.errors import AgentError, BadRequest, NotReady, ObjectNotFound, Unauthorized
from gpuobj_agent.layouts import parse_layouts
from gpuobj_agent.store import check_id, check_stream

if TYPE_CHECKING:
    from gpuobj_agent.agent import Agent

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
AGENT_KEY = web.AppKey("gpuobj_agent", object)  # the Agent (typed loosely: agent.py imports this module)
OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Check the token on /v1/, and turn every failure into a JSON answer; only our bugs are a 500.

    One middleware, not two: each layer costs a coroutine per request on the ticket path.
    """
    agent: Agent = request.app[AGENT_KEY]  # type: ignore[assignment]
    try:
        if request.path.startswith("/v1/") and not agent.tokens.check(request.headers.get("Authorization")):
            raise Unauthorized("missing or wrong bearer token")
        return await handler(request)
    except AgentError as exc:
        if exc.status >= 500 and exc.status != 503:
            agent.metrics.error("internal")
            log.error("%s %s failed: %s", request.method, request.path, exc)
        headers = {"WWW-Authenticate": 'Bearer realm="gpuobj-agent"'} if exc.status == 401 else {}
        return _error(exc.status, str(exc), **headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return _error(exc.status, exc.reason or "error", **allow)
    except Exception:
        agent.metrics.error("internal")
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal error (see the agent log)")


async def _body(request: web.Request, allowed: set[str], *, required: bool = False) -> dict[str, Any]:
    """The JSON object body (empty allowed unless required); unknown fields are an error."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("a JSON object body is required")
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(data) - allowed
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return data


def _opt_str(data: dict[str, Any], key: str, limit: int = 1024) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise BadRequest(f"{key} must be a string of at most {limit} characters")
    return value


def _opt_bool(data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false")
    return value


def _opt_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise BadRequest(f"{key} must be an integer")
    return value


class Routes:
    """Handlers bound to one agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.store = agent.store

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.store.ready:
            return web.json_response({"status": "ready", "nixlAgent": self.store.gens.active.name})
        return _error(503, "not ready: the NIXL agent is not up")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.agent.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(self.agent.info())

    async def inventory(self, request: web.Request) -> web.Response:
        return web.json_response(self.agent.inventory())

    async def get_object(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.describe(check_id(request.match_info["id"])))

    async def put_object(self, request: web.Request) -> web.Response:
        object_id = check_id(request.match_info["id"])
        data = await _body(request, {"tensors", "key", "stream", "streamIndex"}, required=True)
        layouts = parse_layouts(data.get("tensors"))
        key = _opt_str(data, "key", 128)
        stream = _opt_str(data, "stream", 253)
        if stream is not None:
            check_stream(stream)
        created, obj = await self.store.materialize(
            object_id, layouts, key=key, stream=stream, stream_index=_opt_int(data, "streamIndex")
        )
        return web.json_response({"created": created, **obj.describe()})

    async def begin_read(self, request: web.Request) -> web.Response:
        object_id = check_id(request.match_info["id"])
        data = await _body(request, {"reader"})
        reader = _opt_str(data, "reader", 256) or "anonymous"
        if not self.store.ready:
            raise NotReady("the agent is stopping")
        return web.json_response(await self.store.begin_read(object_id, reader))

    async def end_read(self, request: web.Request) -> web.Response:
        read_id = check_id(request.match_info["read_id"], "read id")
        return web.json_response(await self.store.end_read(read_id))

    async def free(self, request: web.Request) -> web.Response:
        object_id = check_id(request.match_info["id"])
        data = await _body(request, {"reason", "waitFence"})
        reason = _opt_str(data, "reason")
        return web.json_response(
            await self.store.free(object_id, reason=reason, wait_fence=_opt_bool(data, "waitFence"))
        )

    async def release_handoff(self, request: web.Request) -> web.Response:
        """A receiver drops a claim the source made for it (client write-behind): the source's
        queue cancels the claim if it was never recorded, or deletes it in order. 404: this
        process does not know the claim (restarted, or no client here); delete it in the API."""
        claim = check_id(request.match_info["claim"], "claim name")
        await _body(request, set())
        sink = self.agent.handoff_sink
        if sink is None or not await sink(claim):
            raise ObjectNotFound(claim)
        return web.json_response({"released": True})

    async def free_stream(self, request: web.Request) -> web.Response:
        stream = check_stream(request.match_info["stream"])
        await _body(request, {"reason"})
        return web.json_response(await self.store.free_stream(stream))


def build_app(agent: Agent, extra: Callable[[web.Application], None] | None = None) -> web.Application:
    """The aiohttp application; `extra` may add routes (the test workload does)."""
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    app[AGENT_KEY] = agent
    r = Routes(agent)
    app.router.add_get("/healthz", r.healthz)
    app.router.add_get("/readyz", r.readyz)
    app.router.add_get("/metrics", r.metrics)
    app.router.add_get("/v1/info", r.info)
    app.router.add_get("/v1/objects", r.inventory)
    app.router.add_get("/v1/objects/{id}", r.get_object)
    app.router.add_put("/v1/objects/{id}", r.put_object)
    app.router.add_post("/v1/objects/{id}/reads", r.begin_read)
    app.router.add_delete("/v1/reads/{read_id}", r.end_read)
    app.router.add_post("/v1/objects/{id}/free", r.free)
    app.router.add_post("/v1/streams/{stream}/free", r.free_stream)
    app.router.add_post("/v1/claims/{claim}/release", r.release_handoff)
    if extra is not None:
        extra(app)
    return app
