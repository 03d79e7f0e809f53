"""The tensor-count limit holds on a real API server: a GPUObject with MAX_TENSORS worst-case entries
(longest names, widest shapes) is admitted and stored (the CRD's CEL budget and etcd's ~1.5 MiB
object limit allow it), and one more entry is refused by the schema."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpuobj_contract import names
from gpuobj_contract.layouts import MAX_TENSORS
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_kube.client import GPUOBJECTS, ApiError

NAMESPACE = "default"
WIDEST = {"name": "n" * 253, "shape": [0] + [1099511627776] * 7, "dtype": "complex128", "device": "cuda:99"}


def body(name: str, count: int) -> dict:
    spec = {"source": {"podName": "p"}, "tensors": [WIDEST] * count}
    return {"apiVersion": names.API_VERSION, "kind": "GPUObject", "metadata": {"name": name}, "spec": spec}


def test_the_worst_case_object_at_the_limit_is_stored_and_one_more_refused(gpuobj_cluster: ClusterHandle) -> None:
    full = body("at-limit", MAX_TENSORS)
    assert len(json.dumps(full)) < 1_000_000  # well under etcd's 1.5 MiB with metadata and status

    async def go() -> None:
        async with gpuobj_cluster.client() as kube:
            created = await kube.request("POST", GPUOBJECTS.path(NAMESPACE), body=full)
            try:
                assert len(created["spec"]["tensors"]) == MAX_TENSORS
            finally:
                await kube.request("DELETE", GPUOBJECTS.path(NAMESPACE, "at-limit"))
            with pytest.raises(ApiError) as refused:
                await kube.request("POST", GPUOBJECTS.path(NAMESPACE), body=body("over", MAX_TENSORS + 1))
            assert refused.value.status == 422 and str(MAX_TENSORS) in str(refused.value)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_tensor_summary_stands_in_for_the_list_only_on_a_library_put(gpuobj_cluster: ClusterHandle) -> None:
    """spec.tensorSummary (count and bytes) replaces spec.tensors on objects the client library put (with an
    objectId); a declared object must list its layouts; never both, never neither."""
    summary = {"count": 3, "bytes": 12}
    cases = {
        "put": ({"objectId": "o-1", "tensorSummary": summary}, None),
        "declared": ({"tensorSummary": summary}, "client library put"),
        "both": ({"objectId": "o-2", "tensorSummary": summary, "tensors": [WIDEST]}, "not both"),
        "neither": ({"objectId": "o-3"}, "not both"),
    }

    async def go() -> None:
        async with gpuobj_cluster.client() as kube:
            for name, (fields, refusal) in cases.items():
                spec = {"source": {"podName": "p"}, **fields}
                obj = {"apiVersion": names.API_VERSION, "kind": "GPUObject", "metadata": {"name": name}, "spec": spec}
                if refusal is None:
                    created = await kube.request("POST", GPUOBJECTS.path(NAMESPACE), body=obj)
                    assert created["spec"]["tensorSummary"] == summary
                    await kube.request("DELETE", GPUOBJECTS.path(NAMESPACE, name))
                    continue
                with pytest.raises(ApiError) as refused:
                    await kube.request("POST", GPUOBJECTS.path(NAMESPACE), body=obj)
                assert refused.value.status == 422 and refusal in str(refused.value), (name, refused.value)

    asyncio.run(asyncio.wait_for(go(), 60))
