"""The operator's Events against a real API server, as the operator's ServiceAccount with the chart's RBAC:
an event that repeats is one Event with its count (events.py, as client-go's EventCorrelator)."""

from __future__ import annotations

import asyncio
import json
import uuid

from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import Credentials
from gpuobj_kube.client import KubeClient
from gpuobj_kube.config import from_kubeconfig
from gpuobj_operator.events import EventRecorder


def _events(cluster: ClusterHandle, namespace: str, reason: str) -> list[dict]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"reason={reason}", "-o", "json")
    return json.loads(out.stdout)["items"]


def test_a_repeated_event_is_one_event_with_its_count(
    gpuobj_cluster: ClusterHandle, namespace: str, operator_identity: Credentials
) -> None:
    """Before, each occurrence was a new Event with count 1 (it failed so: three Events)."""
    uid = str(uuid.uuid4())

    async def post() -> None:
        async with KubeClient(from_kubeconfig(operator_identity.kubeconfig)) as kube:
            recorder = EventRecorder(kube, "gpuobj-operator", "op-1")
            recorder.start()
            for message in ("agent refused: 403", "agent refused: 403", "agent refused: 403", "agent refused: 500"):
                recorder.post(
                    api_version="gpuobj.io/v1alpha1",
                    kind="GPUObject",
                    namespace=namespace,
                    name="w",
                    uid=uid,
                    type_="Warning",
                    reason="FreeFailed",
                    message=message,
                )
            await recorder.stop(timeout=30)

    asyncio.run(post())
    events = _events(gpuobj_cluster, namespace, "FreeFailed")
    counts = sorted((e["message"], e["count"]) for e in events)
    assert counts == [("agent refused: 403", 3), ("agent refused: 500", 1)], events
    [repeated] = [e for e in events if e["count"] == 3]
    assert repeated["involvedObject"]["uid"] == uid and repeated["lastTimestamp"] >= repeated["firstTimestamp"]
