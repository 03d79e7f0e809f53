"""The claims progress marker stays out of the users' sight, and still closes the owner-last race.

When the owner's release is the last reference to an object, no claim event follows its deletion, so
the operator's in-order claims watch stays behind it (operator/gpuobj_operator/claimcheck.py). An
operator that watches every namespace then writes its progress marker, a claim in its own namespace;
one that watches a single namespace has none (it would be a claim in the users' `kubectl get gpuobj`)
and reads the object's claims instead. Either way a person working in the namespace sees only what
the workloads made, and the bytes are freed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuobj_contract import metric_names as m
from gpuobj_contract import names
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.clusterwide import operator_home
from gpuobj_dev.testing.identities import operator_subject
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, NotFound
from gpuobj_kube.informer import wait_for
from tests.e2e.operator.conftest import FAST_ARGS, Pods, kube, start_operator

pytestmark = pytest.mark.nixl

ARANGE = "torch.arange(4096, dtype=torch.float32)"
PERSON = "alice"  # a person who works in the namespace: may get, list and watch what the chart's view role grants


@dataclass
class Operator:
    process: OperatorProcess
    namespace: str  # its own: where its Lease (and, watching every namespace, its marker) lives
    agent_token: Path  # what it presents at agents
    subject: str  # agents' GPUOBJ_OPERATOR_SERVICEACCOUNT


def person_may_view(cluster: ClusterHandle, namespace: str) -> None:
    """The chart's view rules (rbac.aggregateToDefaultRoles) for one person in this namespace."""
    resources = ",".join(f"{r}.{names.GROUP}" for r in ("gpuobjects", "gpuobjectclaims", "gpuobjectstreams"))
    cluster.kubectl(
        "create", "role", "gpuobj-view", "-n", namespace, "--verb=get,list,watch", f"--resource={resources}"
    )
    cluster.kubectl("create", "rolebinding", "gpuobj-view", "-n", namespace, "--role=gpuobj-view", f"--user={PERSON}")


def what_the_person_sees(cluster: ClusterHandle, namespace: str) -> list[str]:
    return cluster.kubectl("get", "gpuobj", "-n", namespace, "-o", "name", "--as", PERSON).stdout.split()


@pytest.fixture
def namespaced_operator(gpuobj_cluster: ClusterHandle, namespace: str, token_file: Path) -> Iterator[Operator]:
    op = start_operator(gpuobj_cluster, token_file, namespace).wait_ready()
    yield Operator(op, namespace, token_file, operator_subject(namespace))
    assert op.stop() == 0, op.output()


@contextlib.contextmanager
def clusterwide(
    cluster: ClusterHandle, namespace: str, folder: Path, extra: tuple[str, ...] = ()
) -> Iterator[Operator]:
    """The operator in a namespace of its own, watching every namespace, with the chart's cluster-wide RBAC."""
    with operator_home(cluster, folder) as home:
        op: OperatorProcess | None = home.operator("op-all", (*FAST_ARGS, *extra))
        try:
            assert op is not None
            op.wait_ready()
            yield Operator(op, home.namespace, home.agent_token, home.subject)
            rc = op.stop()
            assert rc == 0, f"operator exited {rc}:\n{op.output()}"
            op = None
        finally:
            if op is not None:
                op.stop()


@pytest.fixture
def clusterwide_operator(gpuobj_cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    with clusterwide(gpuobj_cluster, namespace, tmp_path / "operator-all") as op:
        yield op


def claims_on(cluster: ClusterHandle, namespace: str, object_name: str) -> list[dict]:
    listed = kube(cluster, lambda k: k.list(CLAIMS, namespace))["items"]
    return [c for c in listed if c["spec"]["objectName"] == object_name]


def owner_last_lifecycles(cluster: ClusterHandle, namespace: str, pods: Pods, op: Operator, rounds: int) -> None:
    """Put, share, the reader fetches and releases, then the owner's release: the last reference."""
    env = {"GPUOBJ_OPERATOR_SERVICEACCOUNT": op.subject}
    src, reader = pods.workload("src", env=env), pods.workload("reader", env=env)
    for i in range(rounds):
        src.run(f"r = client.put([{ARANGE} + {i}], name='o{i}'); s = client.share(r, 'reader'); client.flush()")
        reader.run(f"h = client.adopt(load_pickle({src.eval_pickle('s')!r})); got = client.fetch(h)[0]")
        assert reader.eval(f"bool(torch.equal(got, {ARANGE} + {i}))")
        reader.run("h.release(); del got, h; client.flush()")  # the claim goes first...
        wait_until(lambda i=i: not claims_on(cluster, namespace, f"o{i}"), "the reader's claim deleted", timeout=30)
        src.run("r.release(); del r, s; client.flush()")  # ...and the owner's release is the last reference
        kube(cluster, lambda k, i=i: wait_for(k, GPUOBJECTS, f"o{i}", namespace, lambda o: o is None, timeout=30))
    op.process.wait_metric(m.FREES, {"result": "freed"}, rounds)
    agent_http.assert_holds_nothing(pods.endpoint("src"), op.agent_token)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), op.agent_token)


@pytest.mark.parametrize("mode", ["namespaced", "clusterwide"])
def test_a_person_in_the_namespace_sees_only_the_workloads_objects_after_owner_last_frees(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, mode: str
) -> None:
    op: Operator = request.getfixturevalue(f"{mode}_operator")
    person_may_view(gpuobj_cluster, namespace)
    bystander = pods.workload("bystander", env={"GPUOBJ_OPERATOR_SERVICEACCOUNT": op.subject})
    bystander.run(f"kept = client.put([{ARANGE}], name='kept'); client.flush()")
    owner_last_lifecycles(gpuobj_cluster, namespace, pods, op, rounds=3)
    assert what_the_person_sees(gpuobj_cluster, namespace) == [f"{names.KIND_OBJECT.lower()}.{names.GROUP}/kept"]
    written = op.process.metric(m.CLAIMS_MARKER_WRITES, {"result": "written"})
    if mode == "namespaced":  # no marker anywhere: each owner-last free read the object's claims
        assert written == 0 and op.process.metric(m.CLAIMS_CHECKS, {"how": "read"}) >= 3
        with pytest.raises(NotFound):
            kube(gpuobj_cluster, lambda k: k.get(CLAIMS, names.CLAIMS_PROGRESS_MARKER, namespace))
    else:  # the marker was written, in the operator's own namespace
        assert written >= 1
        kube(gpuobj_cluster, lambda k: k.get(CLAIMS, names.CLAIMS_PROGRESS_MARKER, op.namespace))


def test_an_owner_last_free_learns_every_claim_from_the_progress_marker_and_reads_none(
    gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, tmp_path: Path
) -> None:
    """Watching every namespace, the operator writes its marker in its own namespace, and its claims watch
    then passes the deletion. The read of claims it would fall back to is put off for good here
    (--claims-read-delay 600), so only the marker can free."""
    with clusterwide(gpuobj_cluster, namespace, tmp_path / "operator-all", ("--claims-read-delay", "600")) as op:
        rounds = 3
        owner_last_lifecycles(gpuobj_cluster, namespace, pods, op, rounds)
        p = op.process
        assert p.metric(m.CLAIMS_CHECKS, {"how": "read"}) == 0
        assert p.metric(m.CLAIMS_MARKER_WRITES, {"result": "failed"}) == 0
        assert p.metric(m.CLAIMS_CHECKS, {"how": "marker"}) == rounds  # nothing else moved the watch
        assert p.metric(m.CLAIMS_MARKER_WRITES, {"result": "written"}) == rounds  # rounds seconds apart
        # The marker: the operator's one claim, in its own namespace, holding nothing and counted nowhere.
        marker = kube(gpuobj_cluster, lambda k: k.get(CLAIMS, names.CLAIMS_PROGRESS_MARKER, op.namespace))
        assert marker["spec"] == {"objectName": names.CLAIMS_PROGRESS_MARKER}  # no holder
        assert "conditions" not in marker.get("status", {})  # the operator decides nothing about it
        assert p.metric(m.CLAIMS) == 0
        assert kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"] == []
        assert kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"] == []
        # Refused nothing here (it watches every namespace: earlier tests' namespaces may be going away).
        refused = [line for line in p.output().lower().splitlines() if "forbidden" in line]
        assert not [line for line in refused if namespace in line or op.namespace in line], refused
