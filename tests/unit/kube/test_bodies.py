"""Bodies that arrive in pieces are read whole (gpuobj_kube.bodies), over real HTTP on loopback.

Before read_bounded, the agent read a TokenReview answer with ``resp.content.read(n)``, which returns
what is buffered: an answer split over two writes parsed as "Unterminated string" and the review
failed. The real TokenReview path is tests/e2e/operator/test_revocation.py; this pins the split.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from gpuobj_agent.auth import Revocations
from gpuobj_kube.bodies import BodyTooLarge, read_bounded

REVIEW = json.dumps(
    {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "status": {"authenticated": True, "audiences": ["gpuobj.io/agent"], "user": {"username": "x" * 4000}},
    }
).encode()


async def _split_answer(request: web.Request) -> web.StreamResponse:
    """The answer in two writes with a pause between: the second is not buffered when the first is read."""
    await request.read()
    resp = web.StreamResponse(status=201, headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(REVIEW[:100])
    await asyncio.sleep(0.2)
    await resp.write(REVIEW[100:])
    await resp.write_eof()
    return resp


async def _serve() -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", _split_answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def test_a_review_answer_split_in_two_is_read_whole() -> None:
    async def go() -> None:
        runner, base = await _serve()
        reviews = Revocations(base, audience="gpuobj.io/agent")
        try:
            assert await reviews._ask("a-token") is True
        finally:
            await reviews.close()
            await runner.cleanup()

    asyncio.run(go())


def test_a_body_over_the_limit_is_refused_not_cut() -> None:
    async def go() -> None:
        runner, base = await _serve()
        try:
            url = f"{base}/apis/authentication.k8s.io/v1/tokenreviews"
            async with aiohttp.ClientSession() as session, session.post(url) as resp:
                with pytest.raises(BodyTooLarge, match="more than 1000 bytes"):
                    await read_bounded(resp, 1000, "the test server")
            async with aiohttp.ClientSession() as session, session.post(url) as resp:
                assert await read_bounded(resp, len(REVIEW), "the test server") == REVIEW
        finally:
            await runner.cleanup()

    asyncio.run(go())
