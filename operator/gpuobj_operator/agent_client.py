"""The operator's side of the agent control API (docs/agent-api.md): free, inventory, materialize.

Why a distinct error for "connection refused": nothing listens at the agent's address, so
the agent process is gone and its memory with it. That is a safe end for a free; a
timeout or a 5xx is not, and is retried.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

import aiohttp


class AgentError(Exception):
    """The agent answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"agent answered {status}: {message}")
        self.status = status
        self.message = message


class AgentUnreachable(Exception):
    """Transient: timeout, reset, DNS. Retry."""


class AgentGone(AgentUnreachable):
    """Connection refused: no agent listens at that address any more."""


@dataclass(frozen=True)
class FreeResult:
    freed: bool
    bytes: int
    waited_seconds: float
    message: str


def _is_refused(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


class AgentClient:
    """HTTP client for agents' control servers, authenticated with the shared bearer token."""

    def __init__(self, token_file: Path | None, *, timeout: float = 10.0, free_timeout: float = 60.0) -> None:
        self.token_file = token_file
        self.timeout = timeout
        self.free_timeout = free_timeout
        self._session: aiohttp.ClientSession | None = None

    def _token(self) -> str:
        # Re-read each time: a rotated Secret is picked up without a restart.
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
        self, method: str, endpoint: str, path: str, *, body: dict | None = None, timeout: float | None = None
    ) -> dict:
        url = f"http://{endpoint}{path}"
        try:
            async with self.session.request(
                method,
                url,
                json=body,
                headers={"Authorization": f"Bearer {self._token()}"},
                timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
            ) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = {"error": (await resp.text())[:300]}
                if resp.status >= 400:
                    raise AgentError(resp.status, (data or {}).get("error", resp.reason or ""))
                return data or {}
        except aiohttp.ClientConnectorError as exc:
            if _is_refused(exc.os_error) or _is_refused(exc):
                raise AgentGone(f"nothing listens at {endpoint}: {exc}") from exc
            raise AgentUnreachable(f"{endpoint}: {exc}") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise AgentUnreachable(f"{endpoint}: {type(exc).__name__}: {exc}") from exc

    async def free(self, endpoint: str, object_id: str, reason: str = "") -> FreeResult:
        data = await self._call(
            "POST", endpoint, f"/v1/objects/{object_id}/free", body={"reason": reason}, timeout=self.free_timeout
        )
        return FreeResult(
            freed=bool(data.get("freed")),
            bytes=int(data.get("bytes", 0)),
            waited_seconds=float(data.get("waitedSeconds", 0.0)),
            message=str(data.get("reason", "")),
        )

    async def inventory(self, endpoint: str) -> dict:
        return await self._call("GET", endpoint, "/v1/objects")

    async def info(self, endpoint: str, *, pod_uid: str = "", timeout: float | None = None) -> dict:
        """``pod_uid``: the pod whose agent the caller expects (the answer's podUID is compared with it)."""
        return await self._call("GET", endpoint, "/v1/info", timeout=timeout)

    async def materialize(self, endpoint: str, object_id: str, spec: dict) -> dict:
        return await self._call("PUT", endpoint, f"/v1/objects/{object_id}", body=spec)
