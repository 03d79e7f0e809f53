"""Which answers of the source let a receiver delete a hand-off claim in the API itself (handoff.py).

Against a real HTTP server on localhost that answers as a source agent would. Before (issue 32), any
answer but 200 sent the receiver to its fallback delete, which could run before the source's queued
create: the claim was then recorded and held the bytes until the receiver pod died. Then an unclear
answer was asked again, but for 10 s only, and the fallback delete still raced a create queued longer
(an API server slow for the source). Now only 404 and a refused connection do; the rest is asked again
for as long as the receiver lives. The receiver's core is tested with these sources in test_core.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from gpuobj.client import handoff


def NO_CREDENTIALS() -> tuple[dict[str, str], dict[str, object]]:
    return {}, {}


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
                taken = await handoff.release_at_source(session, url, NO_CREDENTIALS, timeout=2.0, patience=patience)
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


def test_a_source_that_answers_unclearly_past_the_patience_is_still_asked_never_deleted_behind() -> None:
    """Before, past ``patience`` the receiver gave up and deleted the claim in the API, while the source's
    queue could still hold its create (it failed so: False after 2 asks)."""
    taken, asked = _run([503, 503, 503, 503, 200], patience=0.3)
    assert (taken, asked) == (True, [503, 503, 503, 503, 200])


def test_no_certificate_to_present_yet_is_unclear_and_sends_nothing() -> None:
    async def go() -> tuple[bool, list[int]]:
        runner, url, asked = await _serve([200])
        ready = iter([None, None, ({}, {})])  # TLS: no certificate for the first two asks
        try:
            async with aiohttp.ClientSession() as session:
                taken = await handoff.release_at_source(session, url, lambda: next(ready), timeout=2.0)
        finally:
            await runner.cleanup()
        return taken, asked

    assert asyncio.run(go()) == (True, [200])


def test_nothing_listening_sends_the_receiver_to_the_api_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await handoff.release_at_source(
                session, f"http://127.0.0.1:{port}/v1/claims/c/release", NO_CREDENTIALS, timeout=2.0, patience=5.0
            )

    started = asyncio.run(_timed(go))
    assert started[0] is False and started[1] < 1.0


async def _timed(fn: Callable[[], Awaitable[bool]]) -> tuple[bool, float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await fn()
    return result, loop.time() - t0


def test_what_each_answer_means() -> None:
    A = handoff.Answer
    assert handoff.answer_of(200, None) is A.TAKEN
    assert handoff.answer_of(404, None) is A.DISOWNED
    assert handoff.answer_of(None, ConnectionRefusedError()) is A.DISOWNED
    for status, error in ((None, TimeoutError()), (502, None), (503, None), (403, None), (400, None), (401, None)):
        assert handoff.answer_of(status, error) is A.UNCLEAR
