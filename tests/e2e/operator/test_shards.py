"""Two operators share the cluster by namespace bucket (operator/gpuobj_operator/shards.py, docs/scale.md).

Both watch every namespace as the chart's ServiceAccount, each leads its own shard's Lease, and each
acts only on the namespaces of its shard: every object released in a namespace is freed once, by the
operator of that namespace's shard, and the agents end holding nothing. Then shard 0's operator dies
and a new replica of shard 0 takes its Lease: its namespaces keep being served, shard 1 is untouched.
Each is sent only its own buckets' GPUObjects (a label selector); one without the label or with a wrong
one is labelled for its namespace's shard, and that shard's operator acts on it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_contract import metric_names as m
from gpuobj_contract import names
from gpuobj_contract.shard_buckets import bucket_labels, bucket_of
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.clusterwide import Home, operator_home
from gpuobj_dev.testing.identities import LEASE_NAME, install_identities
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import GPUOBJECTS, LEASES
from gpuobj_kube.informer import Informer, wait_for
from gpuobj_operator.shards import Shard, shard_of
from tests.conftest import failed
from tests.e2e.operator.conftest import FAST_ARGS, Pods, kube

pytestmark = pytest.mark.nixl

ARANGE = "torch.arange(1024, dtype=torch.float32)"
SHARDS = 2
LEASE = ("--lease-seconds", "10")  # long enough that a loaded two-core machine never misses a renewal


def namespaces_in_every_shard(cluster: ClusterHandle) -> list[str]:
    """One fresh namespace per shard: random names, kept by the shard they fall in."""
    found: dict[int, str] = {}
    while len(found) < SHARDS:
        name = f"t-{uuid.uuid4().hex[:10]}"
        found.setdefault(shard_of(name, SHARDS), name)
    for name in found.values():
        cluster.create_namespace(name)
        install_identities(cluster, name)
    return [found[i] for i in range(SHARDS)]


def start_shard(home: Home, index: int, identity: str) -> OperatorProcess:
    return home.operator(identity, (*FAST_ARGS, "--shard-count", str(SHARDS), "--shard-index", str(index), *LEASE))


def release_objects(cluster: ClusterHandle, namespace: str, pods: Pods, names: list[str]) -> None:
    """The workload puts each object and releases it; the operator frees it (the object goes)."""
    src = pods.workloads["src"]
    for name in names:
        src.run(f"r = client.put([{ARANGE}], name={name!r}); client.flush(); r.release(); del r; client.flush()")
    for name in names:
        kube(cluster, lambda k, n=name: wait_for(k, GPUOBJECTS, n, namespace, lambda o: o is None, timeout=60))


def frees_logged(op: OperatorProcess, namespace: str, names: list[str]) -> dict[str, int]:
    """Per object, how many completed frees ``op`` logged (the routine free is logged, not an Event)."""
    out = op.output()
    return {n: out.count(f"freed {namespace}/{n}: ") for n in names}


def assert_freed_once_by(op: OperatorProcess, others: list[OperatorProcess], namespace: str, names: list[str]) -> None:
    """Each object freed exactly once by its shard's operator; the other shard's never names the namespace
    (no free, no status write, no probe of its pods: it is not in its ledger)."""
    once = {n: 1 for n in names}
    wait_until(lambda: frees_logged(op, namespace, names) == once, f"{op.identity}'s frees in {namespace}", timeout=30)
    for other in others:
        assert namespace not in other.output(), f"{other.identity} acted on {namespace}:\n{other.output()}"


def lease_spec(cluster: ClusterHandle, namespace: str, index: int) -> dict:
    name = f"{LEASE_NAME}-shard-{index}"
    return kube(cluster, lambda k: k.get(LEASES, name, namespace))["spec"]


def rss_mib(op: OperatorProcess) -> float:
    assert op.proc is not None
    status = Path(f"/proc/{op.proc.pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) / 1024


@pytest.fixture
def home(gpuobj_cluster: ClusterHandle, tmp_path: Path) -> Iterator[Home]:
    with operator_home(gpuobj_cluster, tmp_path / "operator", (f"operator.shards={SHARDS}",)) as h:
        yield h


def test_each_namespace_is_freed_by_its_shards_operator_and_a_new_replica_takes_over_a_dead_shard(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, home: Home, tmp_path: Path
) -> None:
    cluster = gpuobj_cluster
    spaces = namespaces_in_every_shard(cluster)
    fleet = [Pods(cluster, ns, home.agent_token, tmp_path / ns) for ns in spaces]
    ops = [start_shard(home, i, f"op-shard-{i}") for i in range(SHARDS)]
    replacement: OperatorProcess | None = None
    try:
        for op in ops:
            op.wait_ready()
        for pods in fleet:
            pods.workload("src", env={"GPUOBJ_OPERATOR_SERVICEACCOUNT": home.subject})
        first = [f"a{i}" for i in range(3)]
        for ns, pods in zip(spaces, fleet, strict=True):
            release_objects(cluster, ns, pods, first)
        for i, ns in enumerate(spaces):
            assert_freed_once_by(ops[i], ops[:i] + ops[i + 1 :], ns, first)
            assert lease_spec(cluster, home.namespace, i)["holderIdentity"] == f"op-shard-{i}"
        for pods in fleet:
            agent_http.assert_holds_nothing(pods.endpoint("src"), home.agent_token)
        print(f"\nRSS after the first round: {[f'{rss_mib(op):.0f} MiB' for op in ops]}")

        # Shard 0's operator crashes (no lease handed over); a new replica of shard 0 waits it out and leads.
        shard1_before = lease_spec(cluster, home.namespace, 1)
        ops[0].kill()
        replacement = start_shard(home, 0, "op-shard-0-b").wait_ready(timeout=90)
        assert lease_spec(cluster, home.namespace, 0)["holderIdentity"] == "op-shard-0-b"
        second = [f"b{i}" for i in range(3)]
        for ns, pods in zip(spaces, fleet, strict=True):
            release_objects(cluster, ns, pods, second)
        assert_freed_once_by(replacement, [ops[1]], spaces[0], second)
        assert_freed_once_by(ops[1], [replacement], spaces[1], second)
        for pods in fleet:
            agent_http.assert_holds_nothing(pods.endpoint("src"), home.agent_token)
        shard1_after = lease_spec(cluster, home.namespace, 1)
        assert shard1_after["holderIdentity"] == "op-shard-1"  # untouched: same holder, same term
        assert (shard1_after["acquireTime"], shard1_after.get("leaseTransitions")) == (
            shard1_before["acquireTime"],
            shard1_before.get("leaseTransitions"),
        )
        print(f"RSS at the end: shard 1 {rss_mib(ops[1]):.0f} MiB, new shard 0 {rss_mib(replacement):.0f} MiB")
    finally:
        if failed(request):
            for op in [*ops, *([replacement] if replacement else [])]:
                print(f"\n--- {op.identity} output ---\n{op.output()}")
        for op in [*ops, *([replacement] if replacement else [])]:
            op.stop()
        for pods in fleet:
            pods.close()
        for ns in spaces:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


class SelectedWatch:
    """What the API server sends a watch of ``namespace`` with ``selector``: (event, name) in order.
    The operator's own informer (gpuobj_kube.informer), run in a thread beside the synchronous test."""

    def __init__(self, cluster: ClusterHandle, namespace: str, selector: str | None) -> None:
        self.events: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._listed = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(cluster, namespace, selector),))
        self._thread.start()
        assert self._listed.wait(30), "the watch did not list"

    async def _run(self, cluster: ClusterHandle, namespace: str, selector: str | None) -> None:
        def seen(kind: str | None, obj: dict) -> None:
            self.events.append((kind or "LISTED", obj["metadata"]["name"]))

        async with cluster.client() as client:
            informer = Informer(
                client,
                GPUOBJECTS,
                seen,
                namespace=namespace,
                label_selector=selector,
                on_progress=lambda rv: self._listed.set(),  # first called once it listed
            )
            informer.start()
            await asyncio.to_thread(self._stop.wait, 120)
            await informer.stop()

    def names(self) -> set[str]:
        return {name for _, name in self.events}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def declared(name: str, labels: dict[str, str] | None) -> dict:
    """A GPUObject as a user applies it: no finalizer, whatever labels the user wrote. Its source pod
    does not exist, so its shard's operator makes it Lost and deletes it: the proof that one acted."""
    meta: dict = {"name": name, **({"labels": labels} if labels is not None else {})}
    tensors = [{"name": "t", "shape": [4], "dtype": "float32", "device": "cpu"}]
    spec = {"source": {"podName": "nobody"}, "tensors": tensors}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND_OBJECT, "metadata": meta, "spec": spec}


def acted_on(obj: dict | None) -> bool:
    """An operator took the object in: it holds the free finalizer, and a status says where it stands."""
    assert obj is not None
    return names.FINALIZER_FREE in (obj["metadata"].get("finalizers") or []) and bool(
        obj.get("status", {}).get("state")
    )


def test_a_shard_is_sent_only_its_buckets_and_labels_what_no_writer_or_a_wrong_one_labelled(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, home: Home
) -> None:
    cluster = gpuobj_cluster
    spaces = namespaces_in_every_shard(cluster)
    theirs = spaces[1]  # every object below lives in shard 1's namespace
    wrong_bucket = next(b for b in Shard(SHARDS, 0).buckets() if b != bucket_of(theirs))
    ops = [start_shard(home, i, f"op-shard-{i}") for i in range(SHARDS)]
    watches = [SelectedWatch(cluster, theirs, Shard(SHARDS, i).selector()) for i in range(SHARDS)]
    try:
        for op in ops:
            op.wait_ready()
        before = [op.metric(m.WATCH_EVENTS, {"resource": "gpuobjects", "selection": "shard"}) for op in ops]
        labelled = [f"l{i}" for i in range(5)]
        bodies = [declared(n, bucket_labels(theirs)) for n in labelled]
        bodies += [declared("plain", None), declared("wrong", {names.LABEL_SHARD_BUCKET: str(wrong_bucket)})]
        for body in bodies:
            kube(cluster, lambda k, b=body: k.create(GPUOBJECTS, b, theirs))
        # Shard 1's operator acts on every one of them (its finalizer, then a status): the two it was not
        # sent at first too, once labelled (the unlabelled one by itself, the mislabelled one by shard 0).
        for body in bodies:
            name = body["metadata"]["name"]
            kube(cluster, lambda k, n=name: wait_for(k, GPUOBJECTS, n, theirs, acted_on, timeout=60))
        # A deletion is released by it too (never materialized: nothing to free), and each one goes.
        cluster.kubectl("delete", "gpuobjects", "--all", "-n", theirs, "--wait=false")
        for body in bodies:
            name = body["metadata"]["name"]
            kube(cluster, lambda k, n=name: wait_for(k, GPUOBJECTS, n, theirs, lambda o: o is None, timeout=60))
        wait_until(lambda: f"labelled gpuobjects {theirs}/wrong" in ops[0].output(), "shard 0 relabels", timeout=10)
        assert f"labelled gpuobjects {theirs}/plain" in ops[1].output()
        # What the API server sent each shard's selection of that namespace: shard 0 only the mislabelled
        # one (which left it once labelled), shard 1 all of them.
        wait_until(lambda: watches[1].names() == {*labelled, "plain", "wrong"}, "shard 1's selection", timeout=10)
        assert watches[0].events == [("ADDED", "wrong"), ("DELETED", "wrong")], watches[0].events
        # And the operators' own watches: shard 1's selection was sent all seven, shard 0's the same two
        # events of "wrong" (plus any other test's objects of its buckets meanwhile, none of them here).
        after = [op.metric(m.WATCH_EVENTS, {"resource": "gpuobjects", "selection": "shard"}) for op in ops]
        assert after[1] - before[1] >= 2 * len(bodies), (before, after)
        print(f"\nwatch events of gpuobjects: shard 0 +{after[0] - before[0]:.0f}, shard 1 +{after[1] - before[1]:.0f}")
        # Nothing of that namespace entered shard 0's ledger: it never acted there, it only labelled.
        out0 = ops[0].output().replace(f"labelled gpuobjects {theirs}/wrong", "")
        assert theirs not in out0, out0
    finally:
        for w in watches:
            w.close()
        if failed(request):
            for op in ops:
                print(f"\n--- {op.identity} output ---\n{op.output()}")
        for op in ops:
            op.stop()
        for ns in spaces:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
