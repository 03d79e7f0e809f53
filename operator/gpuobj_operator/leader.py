"""Leader election on a coordination.k8s.io Lease: one active operator at a time.

Why a Lease and not a framework's own peering (kopf's, say): it is what every Kubernetes controller uses
(controller-runtime, kube-controller-manager), `kubectl get lease` shows the holder,
and a standby replica simply waits. A leader that cannot renew before its lease
expires stops acting, so two replicas never free at the same time; it then tries to
lead again (main.py), and renews its own lease at once when the API server returns.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass
from typing import Any

from gpuobj_kube.client import LEASES, Conflict, KubeClient, NotFound

log = logging.getLogger("gpuobj.operator.leader")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _fmt(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


@dataclass
class LeaseConfig:
    name: str = "gpuobj-operator"
    namespace: str = "default"
    identity: str = "gpuobj-operator"
    lease_seconds: int = 15
    renew_seconds: float = 5.0
    retry_seconds: float = 2.0


def may_take(
    spec: dict[str, Any], identity: str, now: dt.datetime, default_seconds: int
) -> tuple[dt.datetime | None, int] | None:
    """Whether ``identity`` may write the Lease now: None while another replica's lease runs, else the
    acquireTime to keep (None: a new term starts now) and the leaseTransitions to write.

    Our own lease is renewed whatever its age: after an outage longer than the lease, nobody else
    took it (a write would have changed the holder), so leading again needs no wait.
    """
    holder = spec.get("holderIdentity")
    renewed = _parse(spec.get("renewTime"))
    duration = int(spec.get("leaseDurationSeconds") or default_seconds)
    expired = renewed is None or now > renewed + dt.timedelta(seconds=duration)
    if holder not in (None, "", identity) and not expired:
        return None
    transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == identity else 1)
    return (_parse(spec.get("acquireTime")) if holder == identity else None), transitions


class Backoff:
    """Bounded exponential backoff: ``start``, doubling, at most ``cap`` seconds."""

    def __init__(self, start: float, cap: float) -> None:
        self.start, self.cap = start, cap
        self._next = start

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.start


class LeaderElector:
    def __init__(self, kube: KubeClient, config: LeaseConfig) -> None:
        self.kube = kube
        self.config = config
        self.is_leader = False
        self._held_until = float("-inf")  # monotonic: the lease is surely ours until then

    def _spec(self, acquire: dt.datetime | None, transitions: int) -> dict[str, Any]:
        now = _now()
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": self.config.lease_seconds,
            "acquireTime": _fmt(acquire or now),
            "renewTime": _fmt(now),
            "leaseTransitions": transitions,
        }

    async def try_acquire(self) -> bool:
        """One attempt: create the Lease, renew ours, or take an expired one."""
        c = self.config
        try:
            lease = await self.kube.get(LEASES, c.name, c.namespace)
        except NotFound:
            try:
                await self.kube.create(LEASES, {"metadata": {"name": c.name}, "spec": self._spec(None, 0)}, c.namespace)
                return True
            except Conflict:
                return False
        take = may_take(lease.get("spec") or {}, c.identity, _now(), c.lease_seconds)
        if take is None:
            return False
        acquire, transitions = take
        body = {
            "metadata": {"name": c.name, "resourceVersion": lease["metadata"]["resourceVersion"]},
            "spec": self._spec(acquire, transitions),
        }
        try:
            await self.kube.replace(LEASES, c.name, body, c.namespace)
        except (Conflict, NotFound):
            return False
        return True

    async def acquire(self) -> None:
        """Block until this replica leads (no timeout: a standby waits as long as the leader lives)."""
        announced = False
        while not await self._attempt():
            if not announced:
                log.info("waiting for leadership of lease %s/%s", self.config.namespace, self.config.name)
                announced = True
            await asyncio.sleep(self.config.retry_seconds)
        self.is_leader = True
        log.info("acquired lease %s/%s as %s", self.config.namespace, self.config.name, self.config.identity)

    def holds_lease(self) -> bool:
        """True while the lease is surely ours: less than a lease duration since the start of the last
        successful renewal. False after a pause (SIGSTOP, a long GC) that outlived it, until renewed:
        a replica that may have been replaced never frees on what it knew before."""
        return self.is_leader and time.monotonic() < self._held_until

    async def _attempt(self) -> bool:
        sent = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns a renewal that finished as a
            # cancel arrived and swallows the cancel, so a shutdown found the renewal loop still running.
            async with asyncio.timeout(self.config.renew_seconds):
                ok = await self.try_acquire()
            if ok:
                self._held_until = sent + self.config.lease_seconds
            return ok
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure to renew counts against the lease, never kills the elector
            log.warning("lease attempt failed: %s: %s", type(exc).__name__, exc)
            return False

    async def hold(self) -> None:
        """Renew until renewal fails for longer than the lease; then return (the caller stops acting)."""
        c = self.config
        deadline = asyncio.get_running_loop().time() + c.lease_seconds
        while True:
            await asyncio.sleep(c.renew_seconds)
            if await self._attempt():
                deadline = asyncio.get_running_loop().time() + c.lease_seconds
            elif asyncio.get_running_loop().time() >= deadline - c.renew_seconds:
                self.is_leader = False
                log.error("lost lease %s/%s", c.namespace, c.name)
                return

    async def release(self) -> None:
        """On clean shutdown, hand the lease over at once instead of making the standby wait it out."""
        if not self.is_leader:
            return
        c = self.config
        try:
            lease = await self.kube.get(LEASES, c.name, c.namespace)
            if (lease.get("spec") or {}).get("holderIdentity") != c.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["renewTime"] = _fmt(_now() - dt.timedelta(seconds=c.lease_seconds + 1))
            await self.kube.replace(LEASES, c.name, lease, c.namespace)
        except Exception as exc:  # best effort on the way out
            log.info("could not release lease: %s", exc)
        self.is_leader = False
