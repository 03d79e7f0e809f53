"""Pods without a kubelet: API objects whose status we set, each pointing at a local agent.

Why: the dev control plane runs no kubelet. A Pod object with the agent label, an
agent-host/agent-port annotation and a Running status is, to the operator, exactly
what a scheduled workload pod is.
"""

from __future__ import annotations

from gpuobj_contract import names
from gpuobj_kube.client import PODS, KubeClient, NotFound
from gpuobj_kube.informer import wait_for


async def create_agent_pod(
    kube: KubeClient,
    namespace: str,
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int,
    service_account: str | None = None,
) -> dict:
    """Create a Running pod whose agent listens at host:port; returns the pod (with its uid).

    With `service_account` the pod runs as it, so tokens bound to the pod can be requested for it."""
    body = {
        "metadata": {
            "name": name,
            "labels": {names.LABEL_AGENT: "true", "app.kubernetes.io/part-of": "gpuobj-test"},
            "annotations": {names.ANNOTATION_AGENT_HOST: host, names.ANNOTATION_AGENT_PORT: str(port)},
        },
        "spec": {
            "containers": [
                {
                    "name": "workload",
                    "image": "gpuobj/workload:dev",
                    "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": port}],
                }
            ],
            "terminationGracePeriodSeconds": 0,
            **({"serviceAccountName": service_account} if service_account else {}),
        },
    }
    pod = await kube.create(PODS, body, namespace)
    return (
        await kube.patch(
            PODS,
            name,
            {
                "status": {
                    "phase": "Running",
                    "podIP": host,
                    "podIPs": [{"ip": host}],
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
            },
            namespace,
            subresource="status",
        )
        or pod
    )


async def create_plain_pod(kube: KubeClient, namespace: str, name: str) -> dict:
    """A pod that holds claims but runs no agent of its own (labelled, so the operator watches it)."""
    body = {
        "metadata": {"name": name, "labels": {names.LABEL_AGENT: "true"}},
        "spec": {
            "containers": [{"name": "workload", "image": "gpuobj/workload:dev"}],
            "terminationGracePeriodSeconds": 0,
        },
    }
    return await kube.create(PODS, body, namespace)


async def delete_pod(kube: KubeClient, namespace: str, name: str, timeout: float = 30) -> None:
    """Delete at once (no kubelet to wait for) and wait until the API has forgotten it."""
    try:
        await kube.delete(PODS, name, namespace, grace_period_seconds=0)
    except NotFound:
        return
    await wait_for(kube, PODS, name, namespace, lambda o: o is None, timeout=timeout)
