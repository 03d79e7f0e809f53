"""The one informer against a real API server, as the operator's ServiceAccount.

Why: the operator's sync lists pods, and its pod watch starts a moment later. A pod deleted in
between once stayed alive in the ledger forever (its objects never became Lost): the informer now
takes over from the sync's own list and its version, so that deletion arrives as DELETED.
"""

from __future__ import annotations

import asyncio

from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import Credentials
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_kube.client import PODS, KubeClient
from gpuobj_kube.config import load
from gpuobj_kube.informer import Informer
from gpuobj_operator.reconciler import LABEL_AGENT_SELECTOR


def test_a_pod_deleted_between_the_sync_and_the_watch_arrives_as_deleted(
    gpuobj_cluster: ClusterHandle, namespace: str, operator_identity: Credentials
) -> None:
    async def go() -> list[tuple[str | None, str]]:
        async with gpuobj_cluster.client() as admin:  # plays the user and the kubelet
            for name in ("stays", "goes"):
                await create_agent_pod(admin, namespace, name, port=1)
            operator = KubeClient(load(str(operator_identity.kubeconfig)))
            try:
                listed = await operator.list(PODS, namespace, label_selector=LABEL_AGENT_SELECTOR)  # the sync
                await delete_pod(admin, namespace, "goes")  # before the watch starts
                events: list[tuple[str | None, str]] = []
                arrived = asyncio.Event()

                def handle(kind: str | None, obj: dict) -> None:
                    events.append((kind, obj["metadata"]["name"]))
                    if kind == "DELETED":
                        arrived.set()

                informer = Informer(operator, PODS, handle, namespace=namespace, label_selector=LABEL_AGENT_SELECTOR)
                informer.seed(listed["items"], listed["metadata"]["resourceVersion"])
                informer.start()
                try:
                    await asyncio.wait_for(arrived.wait(), timeout=30)
                finally:
                    await informer.stop()
                return events
            finally:
                await operator.close()

    events = asyncio.run(go())
    assert ("DELETED", "goes") in events
    assert ("DELETED", "stays") not in events
