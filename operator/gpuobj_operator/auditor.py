"""The audit's I/O: ask every agent pod for its inventory, reclaim old leaks, report missing objects.

Why apart from the reconciler: the audit is a second loop with its own collaborators (the agents'
inventories, a quorum list before a reclaim, the leak gauges); what it finds is decided by the pure
audit.py, and what it changes in the API (a Lost status, an Event) goes through the reconciler's
executors, so a status is written one way only.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable

from gpuobj_contract.agent_api import InventoryItem
from gpuobj_kube.client import GPUOBJECTS, KubeClient
from gpuobj_operator import audit, statuses
from gpuobj_operator.actions import Action, Emit
from gpuobj_operator.agent_client import AgentClient, AgentError
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.model import PodInfo, parse_object

log = logging.getLogger("gpuobj.operator")


class Auditor:
    """Audits every agent pod the ledger knows, every ``interval`` seconds."""

    def __init__(
        self,
        ledger: Ledger,
        kube: KubeClient,
        agents: AgentClient,
        metrics: OperatorMetrics,
        execute: Callable[[Action], Awaitable[None]],
        must_lead: Callable[[], None],
        *,
        interval: float = 10.0,
        settle_seconds: float = 5.0,
        grace_seconds: float = 30.0,
    ) -> None:
        self.ledger = ledger
        self.kube = kube
        self.agents = agents
        self.metrics = metrics
        self.execute = execute
        self.must_lead = must_lead  # raises when a paused leader may have been replaced meanwhile
        self.interval = interval
        self.settle_seconds = settle_seconds
        self.grace_seconds = grace_seconds

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.audit_once()
            except Exception:
                log.exception("audit pass failed")

    async def audit_once(self) -> None:
        """One pass over every agent pod: count leaks, reclaim old ones, mark missing objects Lost."""
        if not self.ledger.synced:
            return
        leaked: dict[tuple[str, str], int] = {}
        pods = self.ledger.agent_pods()
        results = await asyncio.gather(*(self._audit_pod(p) for p in pods), return_exceptions=True)
        for pod, result in zip(pods, results, strict=True):
            if isinstance(result, BaseException):
                self.metrics.audits.labels("error").inc()
                log.info("audit of %s/%s failed: %r", pod.namespace, pod.name, result)
                continue
            self.metrics.audits.labels("ok").inc()
            self.metrics.saw_namespace(pod.namespace)
            leaked[(pod.namespace, pod.name)] = result
        # Bytes held only by claims of dead processes are leaks too, while they wait to be dropped.
        dead_held = self.ledger.dead_holder_bytes()
        for key, size in dead_held.items():
            if key in leaked:
                leaked[key] += size
        self.metrics.set_leaked(leaked, {k: v for k, v in dead_held.items() if k in leaked})

    async def _audit_pod(self, pod: PodInfo) -> int:
        expected = audit.expected_objects(self.ledger, pod)
        inventory = await self.agents.inventory(pod.endpoint, pod_uid=pod.uid)  # type: ignore[arg-type]
        if inventory.pod_uid != pod.uid:  # the agent checked too; an agent without a pod uid is refused
            raise AgentError(409, f"agent at {pod.endpoint} serves pod uid {inventory.pod_uid}, not {pod.uid}")
        now = time.monotonic()
        pending = {
            o.object_id: now - self.ledger.ref_gone_at[o.key]
            for o in self.ledger.objects_of_pod(pod.namespace, pod.name)
            if o.key in self.ledger.ref_gone_at
        }
        findings = audit.evaluate(
            self.ledger,
            pod,
            inventory.objects,
            expected,
            settle_seconds=self.settle_seconds,
            grace_seconds=self.grace_seconds,
            pending_free_age=pending,
        )
        reclaimed = 0
        if findings.reclaim:
            reclaimed = await self._reclaim(pod, findings.reclaim)
        for action in audit.lost_actions(pod, findings.missing, statuses.now_str(dt.datetime.now(dt.UTC))):
            await self.execute(action)
        return max(0, findings.leaked_bytes - reclaimed)

    async def _reclaim(self, pod: PodInfo, items: list[InventoryItem]) -> int:
        # Quorum check: no GPUObject (maybe created since our cache last heard) describes these ids.
        fresh = await self.kube.list(GPUOBJECTS, pod.namespace, field_selector=f"spec.source.podName={pod.name}")
        described = set()
        for raw in fresh["items"]:
            o = parse_object(raw)
            described.add(o.object_id)
        total = 0
        self.must_lead()
        for item in items:
            if item.id in described:
                continue
            result = await self.agents.free(pod.endpoint, item.id, reason="Reclaimed", pod_uid=pod.uid)  # type: ignore[arg-type]
            if result.freed:
                total += result.bytes
                self.metrics.reclaimed_bytes.labels(pod.namespace).inc(result.bytes)
                message = (
                    f"reclaimed {result.bytes} bytes of object {item.id} that no GPUObject referenced "
                    f"for {item.age_seconds:.0f}s"
                )
                await self.execute(Emit("Pod", pod.key, pod.uid, "Warning", "LeakReclaimed", message))
        return total
