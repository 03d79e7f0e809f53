"""A 429 is waited out (Retry-After) and retried by the kube client, and counted, so a caller that
paces itself (the client's write-behind, gpuobj/client/congestion.py) learns of it though it succeeds.

Why a real socket: the answers come from an HTTP server, as the API server's priority and fairness
sends them.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from gpuobj_kube.client import GPUOBJECTS, KubeClient
from gpuobj_kube.config import KubeConfig


def test_a_throttled_request_is_retried_after_its_retry_after_and_counted() -> None:
    answers = [429, 429, 200]

    async def handle(request: web.Request) -> web.Response:
        status = answers.pop(0)
        if status == 429:
            return web.json_response({"reason": "TooManyRequests"}, status=429, headers={"Retry-After": "0"})
        return web.json_response({"metadata": {"name": "w"}})

    async def go() -> tuple[dict, int]:
        app = web.Application()
        app.router.add_get("/apis/gpuobj.io/v1alpha1/namespaces/ml/gpuobjects/w", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        kube = KubeClient(KubeConfig.static(f"http://127.0.0.1:{port}"), request_timeout=5)
        try:
            return await kube.get(GPUOBJECTS, "w", "ml"), kube.throttled
        finally:
            await kube.close()
            await runner.cleanup()

    got, throttled = asyncio.run(asyncio.wait_for(go(), 10))
    assert got == {"metadata": {"name": "w"}}
    assert throttled == 2 and answers == []
