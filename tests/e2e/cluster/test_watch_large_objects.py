"""A GPUObject as large as the CRD allows, applied with `kubectl apply`, reaches a watch (issue 32).

`kubectl apply` keeps the whole object again in its last-applied annotation, so the watch event of a
GPUObject near the CRD's limits (2,048 named tensors) is a line of over half a MiB. aiohttp's line reader
stopped at 512 KiB: the watch failed on that event, the informer listed again (which showed the object, so
nothing looked lost), watched again from there and failed on the next such event, with only the watch's
error count to show it. The informer here must see the ADDED event itself, with no error.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import pytest

from gpuobj_contract.layouts import MAX_TENSORS
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_kube.client import GPUOBJECTS
from gpuobj_kube.informer import Informer

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
ANNOTATIONS_LIMIT = 256 * 1024  # the API server's limit on all of an object's annotations together


@pytest.fixture
def namespace(gpuobj_cluster: ClusterHandle) -> Iterator[str]:
    name = f"t-watch-{uuid.uuid4().hex[:8]}"
    gpuobj_cluster.create_namespace(name)
    yield name
    gpuobj_cluster.kubectl("delete", "namespace", name, "--wait=false")


def large_object(name: str) -> dict:
    """MAX_TENSORS tensors with names as a model's layers have, as long as the annotation limit lets
    `kubectl apply` keep a copy of it."""
    tensors = [
        {
            "name": f"model.layers.{i:04d}.self_attn.q_proj.weight.shard-of-a-part1",
            "shape": [4096, 4096],
            "dtype": "bfloat16",
            "device": "cpu",
        }
        for i in range(MAX_TENSORS)
    ]
    return {
        "apiVersion": "gpuobj.io/v1alpha1",
        "kind": "GPUObject",
        "metadata": {"name": name},
        "spec": {"source": {"podName": "trainer-0"}, "key": name, "tensors": tensors},
    }


def test_a_gpuobject_at_the_crds_limits_applied_with_kubectl_reaches_the_watch(
    gpuobj_cluster: ClusterHandle, namespace: str
) -> None:
    body = large_object("big")
    applied = json.dumps(body, separators=(",", ":"))
    assert 200 * 1024 < len(applied) < ANNOTATIONS_LIMIT  # as large as `kubectl apply` can keep

    async def go() -> tuple[list[tuple[str | None, dict]], int]:
        seen: list[tuple[str | None, dict]] = []
        added = asyncio.Event()
        watching = asyncio.Event()

        def handle(kind: str | None, obj: dict) -> None:
            seen.append((kind, obj))
            if kind == "ADDED" and obj["metadata"]["name"] == "big":
                added.set()

        async with gpuobj_cluster.client() as kube:
            informer = Informer(kube, GPUOBJECTS, handle, namespace=namespace, on_progress=lambda rv: watching.set())
            informer.start()
            try:
                await asyncio.wait_for(watching.wait(), 30)  # listed (nothing): the watch starts
                await asyncio.to_thread(gpuobj_cluster.kubectl, "apply", "-n", namespace, "-f", "-", input=applied)
                await asyncio.wait_for(added.wait(), 30)
            finally:
                await informer.stop()
            return seen, informer.errors

    seen, errors = asyncio.run(go())
    assert errors == 0, errors
    (event,) = [obj for kind, obj in seen if kind == "ADDED"]
    assert len(event["spec"]["tensors"]) == MAX_TENSORS
    assert len(event["metadata"]["annotations"][LAST_APPLIED]) >= len(applied)
    assert len(json.dumps(event, separators=(",", ":"))) > 512 * 1024  # its line: over aiohttp's limit
