"""The claims progress marker: one claim the operator owns and writes to move its claims watch on.

Why: a free must know every claim created before the object's deletion (claimcheck.py). When the
last reference to go is the owner's GPUObject, no claim event follows the deletion, so the in-order
claims watch stays behind it; and any read of claims at or after that version waits until the API
server's claims watch cache learns from etcd that it is current (40-100 ms, docs/operator-free-path.md).
A write to a claim gets a version newer than the deletion. Once the watch delivers that write, it has
delivered every claim before it: the ledger then knows them all, with no read.

One write serves every free waiting when it is made, and none is made while the watch passes on its
own (claims come and go). Writes come one at a time, at least ``spacing`` apart: the frees that ask
meanwhile share the next write, so the operator's marker writes stay under 1/spacing per second at
any free rate. The marker holds nothing: the operator keeps it out of its ledger (``is_marker``) and
out of every read of claims.

Where it lives (``marker_namespace``): in the operator's own namespace, and only when the operator
watches claims in every namespace, so its watch delivers that write. An operator that watches one
namespace would have to write it there, where it shows in the users' ``kubectl get gpuobj``; such an
operator has no marker, and an owner-last free reads the object's claims instead (a read, no write).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from gpuobj_contract import names
from gpuobj_kube.client import CLAIMS, ApiError, Conflict, KubeClient, NotFound
from gpuobj_operator.claimcheck import Watermark, parse_revision

log = logging.getLogger("gpuobj.operator.progress")

Write = Callable[[], Awaitable[int]]


class ProgressMarker:
    """Asks for writes to the marker until the claims watch has passed every version a free waits on."""

    def __init__(
        self,
        watermark: Watermark,
        write: Write,
        *,
        on_write: Callable[[bool], None] | None = None,
        retry_min: float = 0.2,
        retry_max: float = 10.0,
        spacing: float = 0.02,
    ) -> None:
        self.watermark = watermark
        self._write = write
        self._on_write = on_write or (lambda ok: None)
        self.retry_min = retry_min
        self.retry_max = retry_max
        self.spacing = spacing  # seconds between two writes: frees asking meanwhile share the next one
        self._wanted: int | None = None  # the highest version a free waits for the watch to pass
        self._written: int | None = None  # the version of the last write: the watch passes it soon
        self._wake = asyncio.Event()

    def request(self, rv: str) -> None:
        """A free waits for the claims watch to pass ``rv``: write the marker unless it already has."""
        wanted = parse_revision(rv)
        if wanted is None or self.watermark.passed(rv):
            return
        if self._wanted is None or wanted > self._wanted:
            self._wanted = wanted
        self._wake.set()

    def _pending(self) -> int | None:
        """The version to write past, if neither the watch nor a write already has."""
        wanted = self._wanted
        if wanted is None:
            return None
        for passed in (self.watermark.revision, self._written):
            if passed is not None and passed >= wanted:
                return None
        return wanted

    async def run(self) -> None:
        """Until cancelled: one write at a time, while some free waits on a version the watch has not passed."""
        delay = self.retry_min
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._pending() is None:
                continue
            try:
                written = await self._write()
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                # Frees do not stop: each also reads its claims after --claims-read-delay.
                self._on_write(False)
                log.warning("could not write the claims progress marker (retry in %.1f s): %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)
                self._wake.set()
                continue
            delay = self.retry_min
            self._written = max(written, self._written or 0)
            self._on_write(True)
            if self.spacing > 0:
                # Coalesce: every free asking during this pause is served by one write after it.
                await asyncio.sleep(self.spacing)
            if self._pending() is not None:  # asked for during the write or the pause, for a newer version
                self._wake.set()


class MarkerMisconfigured(ValueError):
    """The progress marker was asked for where the operator's claims watch cannot see it."""


def marker_namespace(watch_namespace: str | None, own_namespace: str, wanted: bool | None) -> str | None:
    """Where the operator writes its marker, or None for no marker (owner-last frees read their claims).

    ``wanted``: the command line's choice (None: the default, on exactly when the operator watches every
    namespace). Only a claims watch of every namespace delivers a write in the operator's own; a
    marker in a watched namespace would be a claim in the users' ``kubectl get gpuobj``."""
    if watch_namespace is None:
        return own_namespace if wanted is not False else None
    if wanted:
        raise MarkerMisconfigured(
            f"--claims-progress-marker needs the operator to watch every namespace: with --namespace "
            f"{watch_namespace} its claims watch sees only that namespace, where the marker would show in "
            "every user's `kubectl get gpuobj`; without it an owner-last free reads the object's claims"
        )
    return None


def marker_writer(kube: KubeClient, namespace: str, name: str = names.CLAIMS_PROGRESS_MARKER) -> Write:
    """The write: a new value in the marker's annotation (created on first use), returning its new version."""

    async def write() -> int:
        stamp = {names.ANNOTATION_PROGRESS: str(time.time_ns())}
        for _ in range(3):
            try:
                written = await kube.patch(CLAIMS, name, {"metadata": {"annotations": stamp}}, namespace)
            except NotFound:
                try:
                    written = await kube.create(CLAIMS, marker_manifest(name, stamp), namespace)
                except Conflict:
                    continue  # created meanwhile (an earlier leader): write to it
            revision = parse_revision(written["metadata"].get("resourceVersion"))
            if revision is None:  # never trusted (claimcheck.py): the frees read instead
                raise ApiError(0, "UnparsableVersion", f"claims progress marker {namespace}/{name} has no revision")
            return revision
        raise Conflict(409, "Conflict", f"claims progress marker {namespace}/{name} kept changing under its writer")

    return write


def marker_manifest(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    """The marker: a claim on an object of its own name that nobody creates; it has no holder."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND_CLAIM,
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "gpuobj-operator"},
            "annotations": annotations,
        },
        "spec": {"objectName": name},
    }
