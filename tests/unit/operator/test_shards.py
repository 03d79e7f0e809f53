"""Shards (operator/gpuobj_operator/shards.py): where a namespace goes is the same in every process, the
namespaces spread over the shards, and an operator's ledger holds only its shard's namespaces. The same
code runs with two real operators over real namespaces in tests/e2e/operator/test_shards.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

import pytest

from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS
from gpuobj_operator.main import main
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.settings import Settings
from gpuobj_operator.shards import Shard, shard_of
from tests.unit.operator.test_executors import Events, FakeAgents, FakeApi, claim_body, object_body, pod_body

NAMES = [f"team-{i}" for i in range(200)]


def test_a_namespace_goes_to_the_same_shard_in_every_process() -> None:
    """Python's own hash() is salted per process: two replicas would disagree. sha256 is not."""
    code = "from gpuobj_operator.shards import shard_of; print([shard_of(f'team-{i}', 7) for i in range(200)])"
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == str([shard_of(n, 7) for n in NAMES])


def test_where_a_namespace_goes_never_changes_between_releases() -> None:
    """Replicas of two releases share a cluster during an upgrade: the mapping is part of the contract."""
    assert [shard_of(n, 4) for n in ("default", "ml", "team-a", "kube-system")] == [1, 0, 0, 1]


def test_namespaces_spread_over_the_shards() -> None:
    counts = Counter(shard_of(f"ns-{i}", 4) for i in range(4000))
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(800 <= c <= 1200 for c in counts.values()), counts


def test_one_shard_owns_everything_and_keeps_the_lease_name() -> None:
    one = Shard()
    assert all(one.owns(n) for n in NAMES)
    assert one.lease_name("gpuobj-operator") == "gpuobj-operator"
    assert Shard(3, 2).lease_name("gpuobj-operator") == "gpuobj-operator-shard-2"


def test_each_namespace_is_owned_by_exactly_one_shard() -> None:
    shards = [Shard(3, i) for i in range(3)]
    assert all(sum(s.owns(n) for s in shards) == 1 for n in NAMES)


@pytest.mark.parametrize(("count", "index"), [(0, 0), (2, 2), (2, -1)])
def test_a_shard_outside_its_count_is_refused(count: int, index: int) -> None:
    with pytest.raises(ValueError, match="shard"):
        Shard(count, index)


def _in_shard(index: int, count: int = 2) -> str:
    return next(n for n in NAMES if shard_of(n, count) == index)


def _reconciler(api: FakeApi, shard: Shard) -> Reconciler:
    box: list[Reconciler] = []
    r = Reconciler(api, FakeAgents(), OperatorMetrics(lambda: box[0].ledger), Events(), Settings(shard=shard))  # type: ignore[arg-type]
    box.append(r)
    return r


def _in(namespace: str, body: dict) -> dict:
    body["metadata"]["namespace"] = namespace
    return body


def test_an_operator_takes_in_only_its_shards_namespaces_from_the_sync_and_the_watches() -> None:
    mine, theirs = _in_shard(0), _in_shard(1)
    api = FakeApi()
    for ns in (mine, theirs):
        api.put(PODS, _in(ns, pod_body()))
        api.put(GPUOBJECTS, _in(ns, object_body("w")))
        api.put(CLAIMS, _in(ns, claim_body("c")))
    r = _reconciler(api, Shard(2, 0))
    asyncio.run(r.sync())
    assert {k[0] for k in r.ledger.objects} == {mine}
    assert {k[0] for k in r.ledger.claims} == {mine}
    assert {p.namespace for p in r.ledger.agent_pods()} == {mine}  # the audit and the probes: its pods only

    # Watch events of the other shard's namespace change nothing, its own do.
    r.on_object("ADDED", _in(theirs, object_body("x")))
    r.on_claim("ADDED", _in(theirs, claim_body("d", "x")))
    r.on_pod("DELETED", _in(theirs, pod_body()))
    r.on_object("ADDED", _in(mine, object_body("y")))
    assert sorted(r.ledger.objects) == [(mine, "w"), (mine, "y")]
    assert {k[0] for k in r.ledger.claims} == {mine}


def test_without_shards_an_operator_takes_in_every_namespace() -> None:
    api = FakeApi()
    for ns in (_in_shard(0), _in_shard(1)):
        api.put(GPUOBJECTS, _in(ns, object_body("w")))
    r = _reconciler(api, Shard())
    asyncio.run(r.sync())
    assert {k[0] for k in r.ledger.objects} == {_in_shard(0), _in_shard(1)}


@pytest.mark.parametrize(
    "argv",
    [["--shard-count", "2", "--shard-index", "2"], ["--shard-count", "2", "--namespace", "ml"]],
    ids=["index-outside-count", "with-one-namespace"],
)
def test_the_operator_refuses_a_shard_it_cannot_be_at_start(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "shard" in capsys.readouterr().err
