"""The revocation schedule (auth.Revocations) with a scripted TokenReview and a clock under the test's control.

The real thing is tests/e2e/operator/test_revocation.py (a deleted pod's and ServiceAccount's tokens, the
real API server); this pins the schedule: when a request passes without a call, when it waits for one,
and when the agent fails closed.
"""

from __future__ import annotations

import asyncio

import pytest

from gpuobj_agent.auth import Revocations, RevocationUnknown
from gpuobj_agent.errors import Unauthorized


class Scripted(Revocations):
    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__("https://api.invalid", audience="gpuobj.io/agent", clock=lambda: self.now)
        self.verdicts: list[bool | Exception] = []
        self.asked = 0

    async def _ask(self, token: str) -> bool:
        self.asked += 1
        verdict = self.verdicts.pop(0)
        if isinstance(verdict, Exception):
            raise verdict
        return verdict


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_token_is_reviewed_first_then_in_the_background_and_refused_once_revoked() -> None:
    async def go() -> None:
        r = Scripted()
        r.verdicts = [True]
        await r.check("t")  # first sight: waits for the review
        assert r.asked == 1
        r.now += 1.0
        await r.check("t")  # confirmed 1 s ago: no call
        assert r.asked == 1
        r.verdicts = [False]
        r.now += 2.5  # 3.5 s: passes, reviewed in the background
        await r.check("t")
        await _settle()
        assert r.asked == 2
        with pytest.raises(Unauthorized, match="revoked"):
            await r.check("t")
        await r.close()

    asyncio.run(go())


def test_a_stale_token_waits_for_its_review() -> None:
    async def go() -> None:
        r = Scripted()
        r.verdicts = [True, False]
        await r.check("t")
        r.now += 5.0  # beyond `stale`: this request waits, and the review says revoked
        with pytest.raises(Unauthorized):
            await r.check("t")
        await r.close()

    asyncio.run(go())


def test_reviews_that_fail_for_longer_than_the_bound_fail_closed() -> None:
    async def go() -> None:
        r = Scripted()
        r.verdicts = [OSError("unreachable")]
        await r.check("new")  # the API server not answering yet: offline checks, within the bound
        r.now += 1.0
        await r.check("new")  # reviews failing: retried at most every 2 s, nobody waits meanwhile
        assert r.asked == 1
        r.now += 60.0
        r.verdicts = [OSError("unreachable")]
        with pytest.raises(RevocationUnknown):
            await r.check("new")  # 61 s without any answer: refused
        r.now += 2.0
        r.verdicts = [True]
        await r.check("t")
        r.now += 30.0
        r.verdicts = [OSError("unreachable")]
        await r.check("t")  # 30 s without news: still within the 60 s bound
        r.now += 31.0
        r.verdicts = [OSError("unreachable")]
        with pytest.raises(RevocationUnknown, match="60s"):
            await r.check("t")
        r.now += 2.0
        r.verdicts = [True]  # the API server answers again: accepted again
        await r.check("t")
        await r.close()

    asyncio.run(go())
