"""The operator's side of the agent control API (docs/agent-api.md): free, inventory, materialize.

Who we are: the operator's projected ServiceAccount token (audience gpuobj.io/agent), re-read
from its file on every call, since the kubelet rotates it. Where it goes: only to the endpoint
the reconciler derived from the pod's own status.podIP, and with the pod uid we mean, which the
agent checks on the same call (an agent serving another pod, or none, answers 409). What we read
back is bounded (MAX_ANSWER_BYTES): an agent is a workload's process and may lie.

TLS (docs/security.md, "TLS to agents"): with `tls` set, every call is HTTPS to the pod's IP with the
TLS name `<pod uid>.pod.gpuobj.io`, verified against the agent CA, so the handshake fails (and nothing,
no token, is sent) unless the agent holds the certificate the signer issued for that very pod.

Why a distinct error for "connection refused": nothing listens at the agent's address, so
the agent process is gone and its memory with it. That is a safe end for a free; a
timeout or a 5xx is not, and is retried.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names
from gpuobj_contract.agent_api import (
    AgentInfo,
    FreeAnswer,
    FreeRequest,
    Inventory,
    InventoryItem,
    MaterializeAnswer,
    MaterializeRequest,
)
from gpuobj_kube.bodies import BodyTooLarge, read_bounded

# A 1,000-object inventory page is about 300 KB of JSON; an agent that sends more than this in one
# answer is refused, not read. The pages of one inventory are bounded too (a million objects).
MAX_ANSWER_BYTES = 16 << 20
MAX_INVENTORY_PAGES = 1000


async def _read_body(resp: aiohttp.ClientResponse, endpoint: str) -> bytes:
    """The whole body, at most MAX_ANSWER_BYTES (an inventory once came back cut and read as empty)."""
    try:
        return await read_bounded(resp, MAX_ANSWER_BYTES, f"the agent at {endpoint}")
    except BodyTooLarge as exc:
        raise AgentError(413, str(exc)) from None


class AgentError(Exception):
    """The agent answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"agent answered {status}: {message}")
        self.status = status
        self.message = message


class AgentUnreachable(Exception):
    """Transient: timeout, reset, DNS. Retry."""


class AgentNotVerified(AgentUnreachable):
    """The TLS handshake failed: whatever listens there is not the pod we mean (or not yet). Nothing was sent."""


class AgentGone(AgentUnreachable):
    """Connection refused: no agent listens at that address any more."""


def _is_refused(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


class AgentClient:
    """HTTP client for agents' control servers, authenticated as the operator's ServiceAccount."""

    def __init__(
        self,
        token_file: Path | None,
        *,
        timeout: float = 10.0,
        free_timeout: float = 60.0,
        tls: ssl.SSLContext | None = None,
        renew: Callable[[], None] | None = None,
    ) -> None:
        self.token_file = token_file
        self.tls = tls  # trusts the agent CA only; None: plain HTTP (agents with GPUOBJ_AGENT_TLS=off)
        self._renew = renew  # renews the client certificate in `tls` when due (agent_ca.ClientCertificate)
        self.timeout = timeout
        self.free_timeout = free_timeout
        self._session: aiohttp.ClientSession | None = None

    def _token(self) -> str:
        # Re-read each time: a rotated projected token is picked up without a restart.
        return self.token_file.read_text().strip() if self.token_file else ""

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self,
        route: api.Route,
        endpoint: str,
        path: str,
        *,
        pod_uid: str,
        body: dict[str, Any] | None = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        if not pod_uid:
            raise AgentError(409, f"no pod uid to hold the agent at {endpoint} to; refusing to call it")
        if self._renew is not None:
            self._renew()
        url = f"{'https' if self.tls else 'http'}://{endpoint}{path}"
        verify: dict[str, Any] = (
            {} if self.tls is None else {"ssl": self.tls, "server_hostname": agent_tls.pod_dns_name(pod_uid)}
        )
        try:
            async with self.session.request(
                route.method,
                url,
                **verify,
                json=body,
                headers={"Authorization": f"Bearer {self._token()}", names.HEADER_POD_UID: pod_uid, **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
                allow_redirects=False,
            ) as resp:
                raw = await _read_body(resp, endpoint)
                try:
                    data = json.loads(raw) if raw.strip() else {}
                except ValueError:
                    if resp.status < 400:  # a cut or garbled answer is an error, never an empty one
                        raise AgentError(502, f"the agent at {endpoint} answered invalid JSON") from None
                    data = {"error": raw[:300].decode(errors="replace")}
                if not isinstance(data, dict):
                    raise AgentError(502, f"the agent at {endpoint} answered something that is not a JSON object")
                if resp.status >= 400:
                    raise AgentError(resp.status, str(data.get("error", resp.reason or "")))
                return data
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
            raise AgentNotVerified(f"{endpoint} is not pod uid {pod_uid}'s agent (TLS): {exc}") from exc
        except aiohttp.ClientConnectorError as exc:
            if _is_refused(exc.os_error) or _is_refused(exc):
                raise AgentGone(f"nothing listens at {endpoint}: {exc}") from exc
            raise AgentUnreachable(f"{endpoint}: {exc}") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise AgentUnreachable(f"{endpoint}: {type(exc).__name__}: {exc}") from exc

    async def free(self, endpoint: str, object_id: str, reason: str = "", *, pod_uid: str) -> FreeAnswer:
        route = api.FREE
        body = FreeRequest(reason=reason or None).to_json()
        path = route.path(id=object_id)
        return FreeAnswer.from_json(
            await self._call(route, endpoint, path, pod_uid=pod_uid, body=body, timeout=self.free_timeout)
        )

    async def inventory(self, endpoint: str, *, pod_uid: str, page: int = api.INVENTORY_PAGE) -> Inventory:
        """The agent's whole inventory, read page by page (agent_api.INVENTORY_PAGE). An object held
        throughout is on exactly one page; the pages must all come from one process (else AgentError)."""
        first: Inventory | None = None
        objects: list[InventoryItem] = []
        token = ""
        for _ in range(MAX_INVENTORY_PAGES):
            query = f"?limit={page}" + (f"&continue={quote(token, safe='')}" if token else "")
            data = await self._call(api.INVENTORY, endpoint, api.INVENTORY.path() + query, pod_uid=pod_uid)
            try:
                part = Inventory.from_json(data)
            except ValueError as exc:
                raise AgentError(502, f"the agent at {endpoint} answered a malformed inventory: {exc}") from None
            if first is None:
                first = part
            elif (part.pod_uid, part.incarnation) != (first.pod_uid, first.incarnation):
                raise AgentError(409, f"the agent at {endpoint} changed process while its inventory was read")
            objects.extend(part.objects)
            if not part.continue_token:
                return dataclasses.replace(first, objects=tuple(objects), continue_token="")
            if part.continue_token == token or not part.objects:
                raise AgentError(502, f"the agent at {endpoint} answered a page that does not move on")
            token = part.continue_token
        raise AgentError(502, f"the agent at {endpoint} answered more than {MAX_INVENTORY_PAGES} inventory pages")

    async def info(
        self, endpoint: str, *, pod_uid: str, timeout: float | None = None, write_rate: float | None = None
    ) -> AgentInfo:
        """Whose agent answers; ``write_rate`` tells it the pod's share of the fleet's write budget (0: none)."""
        told = None if write_rate is None else {names.HEADER_WRITE_RATE: f"{write_rate:.6g}"}
        return AgentInfo.from_json(
            await self._call(api.INFO, endpoint, api.INFO.path(), pod_uid=pod_uid, timeout=timeout, headers=told)
        )

    async def materialize(
        self, endpoint: str, object_id: str, request: MaterializeRequest, *, pod_uid: str
    ) -> MaterializeAnswer:
        route = api.MATERIALIZE
        path = route.path(id=object_id)
        return MaterializeAnswer.from_json(
            await self._call(route, endpoint, path, pod_uid=pod_uid, body=request.to_json())
        )
