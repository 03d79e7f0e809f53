"""Bearer-token authentication for the control API, with the token read from a file.

Why a file: in Kubernetes the token is a mounted Secret, which the kubelet rewrites in
place when the Secret changes; the file is re-read when its modification time changes,
so a rotated token takes effect without a restart. An agent with no token, or an empty
one, refuses to start rather than serve an open API.
"""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


class TokenError(RuntimeError):
    """The token file is missing, unreadable or empty."""


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise TokenError(f"cannot read token file {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TokenError(f"token file {path} is not UTF-8 text") from exc
    if not token:
        raise TokenError(f"token file {path} is empty")
    return token


class TokenFile:
    """The current token of one file; `check` compares in constant time."""

    RECHECK_SECONDS = 1.0  # a rotated Secret is noticed within a second; no stat per request

    def __init__(self, path: str) -> None:
        self.path = path
        self._token = _read(path).encode()
        self._stamp = self._mtime()
        self._checked = time.monotonic()

    def _mtime(self) -> float | None:
        try:
            return Path(self.path).stat().st_mtime_ns
        except OSError:
            return None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.RECHECK_SECONDS:
            return
        self._checked = now
        stamp = self._mtime()
        if stamp is None or stamp == self._stamp:
            return
        try:
            self._token = _read(self.path).encode()
            self._stamp = stamp
        except TokenError as exc:  # mid-rotation: keep the last good token
            log.warning("keeping the previous token: %s", exc)

    def check(self, authorization: str | None) -> bool:
        """True when the Authorization header carries the current bearer token."""
        if not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "bearer" or not value:
            return False
        self._refresh()
        return hmac.compare_digest(value.strip().encode(), self._token)
