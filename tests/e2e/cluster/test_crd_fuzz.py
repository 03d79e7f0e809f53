"""Property-based fuzzing of the CRD schemas against the real API server (server-side dry runs).

Properties: the API server answers every body with an acceptance or a 4xx (never a 5xx), and
whatever the schema admits, the code downstream takes without error: the operator parses it, the
object id (and every shared namespace) passes the agent's own checks, so an admitted object can
never make the operator send an agent something it refuses, or crash on it.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuobj_agent.layouts import parse_layouts
from gpuobj_agent.objects import check_id
from gpuobj_contract import names
from gpuobj_contract.layouts import tensor_bytes
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, ApiError
from gpuobj_operator.model import parse_claim, parse_object

NAMESPACE = "default"
NAMES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
WEIRD = st.one_of(st.text(max_size=30), NAMES, st.integers(), st.none(), st.booleans())
SHAPES = st.lists(st.one_of(st.integers(min_value=-2, max_value=1 << 20), st.integers()), max_size=9)
TENSORS = st.lists(
    st.fixed_dictionaries(
        {"shape": st.one_of(SHAPES, WEIRD), "dtype": st.one_of(st.sampled_from(names.DTYPES), WEIRD)},
        optional={"device": st.one_of(st.sampled_from(["cpu", "cuda", "cuda:1", "cuda:0\n", "tpu"]), WEIRD)},
    ),
    max_size=3,
)
OBJECT_SPECS = st.fixed_dictionaries(
    {"source": st.one_of(st.fixed_dictionaries({"podName": st.one_of(NAMES, WEIRD)}), WEIRD), "tensors": TENSORS},
    optional={
        "objectId": st.one_of(st.from_regex(r"[A-Za-z0-9._-]{1,130}\n?", fullmatch=True), WEIRD),
        "sharedWith": st.one_of(st.lists(st.one_of(NAMES, WEIRD), max_size=3), WEIRD),
        "key": WEIRD,
    },
)
CLAIM_SPECS = st.fixed_dictionaries(
    {"objectName": st.one_of(NAMES, WEIRD)},
    optional={"holder": st.one_of(st.fixed_dictionaries({"podName": st.one_of(NAMES, WEIRD)}), WEIRD)},
)


def dry_run(cluster: ClusterHandle, res, spec: object) -> dict | ApiError:
    body = {"apiVersion": names.API_VERSION, "metadata": {"name": "fuzz"}, "spec": spec}

    async def go():
        async with cluster.client() as kube:
            try:
                return await kube.request("POST", res.path(NAMESPACE), params={"dryRun": "All"}, body=body)
            except ApiError as exc:
                return exc

    return asyncio.run(go())


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=OBJECT_SPECS)
def test_what_the_gpuobject_schema_admits_the_operator_and_agent_accept(gpuobj_cluster: ClusterHandle, spec) -> None:
    answer = dry_run(gpuobj_cluster, GPUOBJECTS, spec)
    if isinstance(answer, ApiError):
        assert 400 <= answer.status < 500, answer
        return
    info = parse_object(answer)
    assert info.source_pod and tensor_bytes(info.tensors) >= 0
    if info.spec_object_id is not None:
        check_id(info.spec_object_id)  # never "o-1\n": the schema and the agent agree
    for ns in info.shared_with:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", ns), ns
    layouts = [{k: t[k] for k in ("shape", "dtype", "device") if k in t} for t in info.tensors]
    parse_layouts(layouts)  # what the operator would send to materialize it


@pytest.mark.timeout(300)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=CLAIM_SPECS)
def test_what_the_claim_schema_admits_the_operator_parses(gpuobj_cluster: ClusterHandle, spec) -> None:
    answer = dry_run(gpuobj_cluster, CLAIMS, spec)
    if isinstance(answer, ApiError):
        assert 400 <= answer.status < 500, answer
        return
    claim = parse_claim(answer)
    assert claim.object_name
