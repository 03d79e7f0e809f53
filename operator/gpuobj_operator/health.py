"""/metrics, /healthz and /readyz on one port, from the first second of the process to its last.

Why apart from the term: these answer whether or not this replica leads. Ready means leading and
synced, or standing by (a standby is a healthy replica); alive means every part that runs beside the
terms (the CSR signer) still runs, and a failing one is named, so the kubelet restarts the replica
rather than leave it running without that part while /healthz says ok.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuobj_operator.metrics import OperatorMetrics

State = Literal["starting", "standby", "leading", "stopping"]


class HealthServer:
    """/metrics, /healthz and /readyz on one port. Ready means leading and synced, or standing by."""

    def __init__(self, metrics: OperatorMetrics, host: str, port: int) -> None:
        self.metrics = metrics
        self.host, self.port = host, port
        self.state: State = "starting"
        # Parts that run beside the term (the CSR signer): each says why it failed, or None; any failure fails
        # /healthz, naming it, so the kubelet restarts the replica rather than it running without that part.
        self.checks: list[Callable[[], str | None]] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Serves from now on; the port it listens on (the one asked for, or a free one for 0)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/readyz", self._ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _: web.Request) -> web.Response:
        failures = [why for check in self.checks if (why := check()) is not None]
        if failures:
            return web.json_response({"status": "failing", "state": self.state, "failures": failures}, status=500)
        return web.json_response({"status": "ok", "state": self.state})

    async def _ready(self, _: web.Request) -> web.Response:
        ok = self.state in ("leading", "standby")
        return web.json_response({"state": self.state}, status=200 if ok else 503)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
