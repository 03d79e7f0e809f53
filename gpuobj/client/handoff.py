"""A receiver's release of a hand-off claim, sent to the source agent whose queue made the claim.

Why apart from core.py: when the receiver may delete a hand-off claim in the API itself is the whole
correctness of this release, and it is tested on its own against a real HTTP server
(tests/unit/client/test_handoff_release.py).

The source's write-behind queue may still hold the claim's create when the receiver releases it. A
delete in the API made before that create finds nothing, and the create then records a claim that holds
the bytes until the receiver's process ends. A delete made after the create landed is no better while
the source's queue lives: a create whose answer was lost is sent again, and records the claim anew. So
the source is the only deleter of a claim its live queue made, and the receiver deletes it itself only
when the source answers that no queue of it holds the claim any more:

- 404: the source process does not know the claim (it restarted and its queue went with it; or its
  client closed its queue, after sending what it could);
- connection refused: nothing listens; the source process and its queue are gone.

Any other answer (a timeout, a 5xx, a refused credential or name, a TLS failure, no certificate to
present yet) says nothing about the queued create: the release is asked again, with backoff, for as
long as the receiver's client lives, and never turns into a delete. If the receiver's client closes
first, the claim stays, scoped to the receiver's process: the operator ends it when that process or its
pod goes (docs/write-behind.md, "Crash semantics").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from gpuobj.client.agent_seam import AgentSeam
from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names

log = logging.getLogger("gpuobj.client")

TIMEOUT = 5.0  # seconds for one ask
PATIENCE = 10.0  # seconds of unclear answers before the receiver says (once) that it is still asking
FIRST_GAP = 0.1  # seconds before the second ask; doubled after each, up to MAX_GAP
MAX_GAP = 2.0
CLOSE_WAIT = 2.0  # seconds a closing client gives releases still in flight (each step of close is bounded)


class Answer(enum.Enum):
    """What the source's answer says of the claim's queued create."""

    TAKEN = "taken"  # 200: the source's queue cancels the claim or deletes it in order
    DISOWNED = "disowned"  # no queue of the source holds it: the receiver deletes it in the API
    UNCLEAR = "unclear"  # nothing known of the queued create: ask again, never delete


def refused(exc: BaseException | None) -> bool:
    """Connection refused, wherever it sits in the exception's chain: nothing listens there."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
            return True
        os_error = getattr(exc, "os_error", None)  # aiohttp.ClientConnectorError keeps the cause here
        if isinstance(os_error, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def answer_of(status: int | None, error: BaseException | None) -> Answer:
    """The pure decision: which answers let the receiver delete the claim itself (404, refused)."""
    if status == 200:
        return Answer.TAKEN
    if status == 404 or (status is None and refused(error)):
        return Answer.DISOWNED
    return Answer.UNCLEAR


Ask = Callable[[], Awaitable[Answer]]


async def ask_until_clear(ask: Ask, what: str, *, patience: float = PATIENCE) -> Answer:
    """Ask until the source takes the release or disowns the claim (cancelled when the client closes):
    an unclear answer is never taken for either. After ``patience`` seconds it says so, once."""
    started, gap, warned = time.monotonic(), FIRST_GAP, False
    while True:
        answer = await ask()
        if answer is not Answer.UNCLEAR:
            return answer
        if not warned and time.monotonic() - started >= patience:
            warned = True
            log.warning(
                "hand-off release %s: no clear answer for %.0f s; still asking. The claim is not deleted here "
                "(the source's queue may still create it); if this process ends first, it ends with it",
                what,
                patience,
            )
        await asyncio.sleep(gap)
        gap = min(gap * 2, MAX_GAP)


# What one ask sends: (headers, keyword arguments of the request that verify the source), or None while
# there is nothing to send safely (a TLS source and no certificate of ours yet): an unclear answer.
Credentials = Callable[[], "tuple[dict[str, str], dict[str, Any]] | None"]


async def release_at_source(
    session: aiohttp.ClientSession,
    url: str,
    credentials: Credentials,
    *,
    timeout: float = TIMEOUT,
    patience: float = PATIENCE,
) -> bool:
    """Post the release to the source until it answers clearly. True: the source took it. False: it
    disowned the claim, and the receiver deletes it in the API."""

    async def ask() -> Answer:
        sent = credentials()
        if sent is None:
            return Answer.UNCLEAR
        headers, verify = sent
        try:
            async with session.post(
                url, json={}, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout), **verify
            ) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("hand-off release at %s: %s", url, exc)
            return answer_of(None, exc)
        log.debug("hand-off release at %s: answer %d", url, status)
        return answer_of(status, None)

    return await ask_until_clear(ask, f"at {url}", patience=patience) is Answer.TAKEN


class SourceReleases:
    """The receiver's side: posts releases of hand-off claims to the source agents that queued them,
    over one HTTP session (made on first use, closed with the client). Each release is its own task, so
    a source that does not answer holds up no other release; `settle` waits for them."""

    def __init__(self, agent: AgentSeam, token: Callable[[], str | None]) -> None:
        self.agent = agent
        self.token = token
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, via: tuple[str, str], claim: str, disowned: Callable[[], Awaitable[None]]) -> None:
        """Release claim `claim` at the source ``via`` (endpoint, pod uid); await ``disowned`` (the
        receiver's own delete) only if the source answers that no queue of it holds the claim."""

        async def run() -> None:
            try:
                if not await self.post(via, claim):
                    await disowned()
            except Exception as exc:
                log.warning("release of hand-off claim %s failed: %s", claim, exc)

        task = asyncio.get_running_loop().create_task(run(), name=f"gpuobj-handoff-release-{claim[:40]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def settle(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the releases in flight; how many still wait for their source."""
        if self._tasks and timeout > 0:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        return len(self._tasks)

    async def post(self, via: tuple[str, str], claim: str) -> bool:
        """Send claim `claim`'s release to the source at ``via`` until it answers clearly. Over TLS the
        source is verified as the pod it means, and this pod presents its own certificate with its token;
        with no certificate to present (yet) it waits for one and never sends the token in the clear."""
        endpoint, pod_uid = via
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        serves_tls = self.agent.serves_tls

        def credentials() -> tuple[dict[str, str], dict[str, Any]] | None:
            tls = self.agent.client_tls() if serves_tls else None
            if serves_tls and (tls is None or not pod_uid):
                return None  # never send a token to a listener we cannot hold to a pod
            token = self.token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if pod_uid:
                headers[names.HEADER_POD_UID] = pod_uid
            return headers, ({"ssl": tls, "server_hostname": agent_tls.pod_dns_name(pod_uid)} if tls else {})

        url = f"{'https' if serves_tls else 'http'}://{endpoint}{api.RELEASE_HANDOFF.path(claim=claim)}"
        return await release_at_source(self._http, url, credentials)

    async def close(self, timeout: float) -> None:
        """Wait (bounded) for releases in flight, end those still asking, then close the session."""
        if await self.settle(timeout):
            log.warning(
                "%d hand-off releases still wait for their sources at close: their claims end with this process",
                len(self._tasks),
            )
            for task in list(self._tasks):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
