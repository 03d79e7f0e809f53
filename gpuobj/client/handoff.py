"""A receiver's release of a hand-off claim, sent to the source agent whose queue made the claim.

Why apart from core.py: which answers of the source let the receiver delete the claim in the API itself
is the whole correctness of this release, and it is tested on its own against a real HTTP server
(tests/unit/client/test_handoff_release.py).

The source's write-behind queue may still hold the claim's create when the receiver releases it. A
delete in the API made before that create finds nothing, and the create then records a claim that holds
the bytes until the receiver pod dies. So the receiver deletes the claim itself only on an answer that
says the source will never create it:

- 404: the source process does not know the claim (it restarted and its queue went with it; or the
  create landed long ago and the queue forgot it, and then the delete finds the claim);
- connection refused: nothing listens; the source process and its queue are gone.

Any other answer (a timeout, a 5xx, a refused credential or name, a TLS failure) says nothing about the
queued create: the release is asked again, with backoff, for up to ``patience`` seconds, and only then
is the claim deleted in the API, when a create queued for it has long landed (the write window is
0.1 s), unless the API was unreachable for the source all that while.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from gpuobj.client.agent_seam import AgentSeam
from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names

log = logging.getLogger("gpuobj.client")

TIMEOUT = 5.0  # seconds for one ask
PATIENCE = 10.0  # seconds the receiver keeps asking a source that neither took the release nor disowned it
FIRST_GAP = 0.1  # seconds before the second ask; doubled after each, up to MAX_GAP
MAX_GAP = 2.0


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


def source_will_not_create(status: int | None, error: BaseException | None) -> bool | None:
    """True: the source took the release (200). False: it will never create the claim, so the receiver
    deletes it in the API (404, connection refused). None: the answer says nothing of its queued create."""
    if status == 200:
        return True
    if status == 404 or (status is None and refused(error)):
        return False
    return None


async def release_at_source(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    verify: dict[str, Any],
    *,
    timeout: float = TIMEOUT,
    patience: float = PATIENCE,
) -> bool:
    """Post the release to the source. True: the source took it. False: delete the claim in the API."""
    deadline, gap = time.monotonic() + patience, FIRST_GAP
    while True:
        status: int | None = None
        error: BaseException | None = None
        try:
            async with session.post(
                url, json={}, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout), **verify
            ) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = exc
        taken = source_will_not_create(status, error)
        if taken is not None:
            return taken
        if time.monotonic() + gap > deadline:
            log.warning(
                "hand-off release at %s: %s for %.0f s; deleting the claim in the API, where a create the source "
                "still queues would record it again",
                url,
                f"answer {status}" if status is not None else error,
                patience,
            )
            return False
        log.debug("hand-off release at %s: %s; asking again", url, status if status is not None else error)
        await asyncio.sleep(gap)
        gap = min(gap * 2, MAX_GAP)


class SourceReleases:
    """The receiver's side: posts releases of hand-off claims to the source agents that queued them,
    over one HTTP session (made on first use, closed with the client)."""

    def __init__(self, agent: AgentSeam, token: Callable[[], str | None]) -> None:
        self.agent = agent
        self.token = token
        self._http: aiohttp.ClientSession | None = None

    async def post(self, via: tuple[str, str], claim: str) -> bool:
        """Send claim `claim`'s release to the source at ``via`` (endpoint, pod uid). Over TLS the source
        is verified as the pod it means, and this pod presents its own certificate with its token. False:
        delete it in the API instead, which `release_at_source` answers only when the source will never
        create the claim."""
        endpoint, pod_uid = via
        tls = None
        if self.agent.serves_tls:
            tls = self.agent.client_tls()
            if tls is None or not pod_uid:
                return False  # never send a token to a listener we cannot hold to a pod
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        token = self.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if pod_uid:
            headers[names.HEADER_POD_UID] = pod_uid
        verify: dict[str, Any] = {"ssl": tls, "server_hostname": agent_tls.pod_dns_name(pod_uid)} if tls else {}
        url = f"{'https' if tls else 'http'}://{endpoint}{api.RELEASE_HANDOFF.path(claim=claim)}"
        return await release_at_source(self._http, url, headers, verify)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
