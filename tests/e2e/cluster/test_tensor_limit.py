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
