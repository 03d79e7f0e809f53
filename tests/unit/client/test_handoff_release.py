"""Which answers of the source let a receiver delete a hand-off claim in the API itself (handoff.py).

Against a real HTTP server on localhost that answers as a source agent would. Before (issue 32), any
answer but 200 sent the receiver to its fallback delete, which could run before the source's queued
create: the claim was then recorded and held the bytes until the receiver pod died.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from gpuobj.client import handoff


async def _serve(answers: list[int]) -> tuple[web.AppRunner, str, list[int]]:
    """A source that answers the release with each status of ``answers`` in turn, then the last again."""
    asked: list[int] = []

    async def release(request: web.Request) -> web.Response:
        status = answers[min(len(asked), len(answers) - 1)]
        asked.append(status)
        return web.json_response({"released": True} if status == 200 else {"error": "no"}, status=status)

    app = web.Application()
    app.router.add_post("/v1/claims/{claim}/release", release)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1/claims/c/release", asked


def _run(answers: list[int], patience: float = 5.0) -> tuple[bool, list[int]]:
    async def go() -> tuple[bool, list[int]]:
        runner, url, asked = await _serve(answers)
        try:
            async with aiohttp.ClientSession() as session:
                taken = await handoff.release_at_source(session, url, {}, {}, timeout=2.0, patience=patience)
        finally:
            await runner.cleanup()
        return taken, asked

    return asyncio.run(go())


def test_the_source_taking_the_release_is_the_end_of_it() -> None:
    assert _run([200]) == (True, [200])


def test_a_source_that_does_not_know_the_claim_sends_the_receiver_to_the_api() -> None:
    assert _run([404]) == (False, [404])


@pytest.mark.parametrize("unclear", [503, 500, 403, 400])
def test_an_answer_that_says_nothing_of_the_queued_create_is_asked_again_not_taken_for_a_refusal(unclear: int) -> None:
    """Before, the first such answer sent the receiver to its fallback delete (it failed so: one ask, False)."""
    assert _run([unclear, unclear, 200]) == (True, [unclear, unclear, 200])
    assert _run([unclear, 404]) == (False, [unclear, 404])


def test_a_source_that_never_answers_clearly_is_given_up_on_after_the_patience() -> None:
    taken, asked = _run([503], patience=0.5)
    assert taken is False and 3 <= len(asked) <= 5  # 0.1 + 0.2 s gaps, then the next would pass the deadline


def test_nothing_listening_sends_the_receiver_to_the_api_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await handoff.release_at_source(
                session, f"http://127.0.0.1:{port}/v1/claims/c/release", {}, {}, timeout=2.0, patience=5.0
            )

    started = asyncio.run(_timed(go))
    assert started[0] is False and started[1] < 1.0


async def _timed(fn: Callable[[], Awaitable[bool]]) -> tuple[bool, float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await fn()
    return result, loop.time() - t0


def test_what_each_answer_means() -> None:
    assert handoff.source_will_not_create(200, None) is True
    assert handoff.source_will_not_create(404, None) is False
    assert handoff.source_will_not_create(None, ConnectionRefusedError()) is False
    assert handoff.source_will_not_create(None, TimeoutError()) is None
    assert handoff.source_will_not_create(502, None) is None
