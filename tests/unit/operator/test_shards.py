"""Shards (operator/gpuobj_operator/shards.py): where a namespace goes is the same in every process, the
namespaces spread over the shards, and an operator's ledger holds only its shard's namespaces. The same
code runs with two real operators over real namespaces in tests/e2e/operator/test_shards.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

import pytest

from gpuobj_contract import names
from gpuobj_contract.shard_buckets import BUCKETS, bucket_labels, bucket_of
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, NotFound
from gpuobj_operator.main import main
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.selection import Selection
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


# ------------------------------------------------------------ buckets and the label selector


def test_a_namespace_goes_to_the_same_bucket_in_every_process() -> None:
    code = "from gpuobj_contract.shard_buckets import bucket_of; print([bucket_of(f'team-{i}') for i in range(200)])"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONHASHSEED": "3"}, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str([bucket_of(n) for n in NAMES])
    # Part of the contract like shard_of: mod 4 these are the [1, 0, 0, 1] above, the mapping before buckets.
    assert [bucket_of(n) for n in ("default", "ml", "team-a", "kube-system")] == [125, 164, 180, 129]


@pytest.mark.parametrize("count", [1, 2, 3, 7, 256])
def test_a_shard_owns_exactly_the_namespaces_of_its_buckets(count: int) -> None:
    shards = [Shard(count, i) for i in range(count)]
    assert sorted(b for s in shards for b in s.buckets()) == list(range(BUCKETS))
    for name in NAMES:
        (owner,) = [s for s in shards if s.owns(name)]
        assert bucket_of(name) in owner.buckets() and owner.index == shard_of(name, count)


def test_the_selector_names_the_shards_buckets_and_one_shard_has_none() -> None:
    assert Shard().selector() is None
    assert Shard(2, 1).selector() == f"{names.LABEL_SHARD_BUCKET} in ({','.join(str(b) for b in range(1, 256, 2))})"
    assert Shard(256, 5).selector() == f"{names.LABEL_SHARD_BUCKET} in (5)"
    assert bucket_labels("ml") == {names.LABEL_SHARD_BUCKET: str(bucket_of("ml"))}


def test_more_shards_than_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match="shard count"):
        Shard(BUCKETS + 1, 0)


# ------------------------------------------------------------ Selection: a move is not a deletion
# The same code against a real API server, with a real relabel: tests/e2e/operator/test_shards.py.


class LabelApi:
    """The two calls a Selection makes: GET (is it still there?) and the label patch."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.patches: list[tuple[str, str, dict]] = []

    async def get(self, res, name, namespace):  # type: ignore[no-untyped-def]
        if (namespace, name) not in self.objects:
            raise NotFound(404, "NotFound", name)
        return self.objects[(namespace, name)]

    async def patch(self, res, name, body, namespace):  # type: ignore[no-untyped-def]
        self.patches.append((namespace, name, body["metadata"]["labels"]))
        return self.objects[(namespace, name)]


def _obj(namespace: str, name: str, uid: str = "u1", deleting: bool = False) -> dict:
    meta = {"namespace": namespace, "name": name, "uid": uid}
    return {"metadata": {**meta, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}}


def _selection(api: LabelApi) -> tuple[Selection, list[tuple[str | None, str]]]:
    seen: list[tuple[str | None, str]] = []
    sel = Selection(api, GPUOBJECTS, lambda k, o: seen.append((k, o["metadata"]["name"])), Shard(2, 0))  # type: ignore[arg-type]
    return sel, seen


async def _settle(sel: Selection) -> None:
    while sel._tasks:
        await asyncio.gather(*list(sel._tasks))


def test_a_deletion_with_its_timestamp_passes_at_once_and_one_without_only_once_the_object_is_gone() -> None:
    async def go() -> None:
        mine = _in_shard(0)
        api = LabelApi()
        sel, seen = _selection(api)
        assert sel.mine.label_selector == Shard(2, 0).selector()
        assert sel.unlabelled is not None and sel.unlabelled.label_selector == f"!{names.LABEL_SHARD_BUCKET}"
        sel._on_mine("DELETED", _obj(mine, "a", deleting=True))
        assert seen == [("DELETED", "a")]
        # Left the selection (a user's relabel): still there, so not a deletion.
        api.objects[(mine, "b")] = _obj(mine, "b")
        sel._on_mine("DELETED", _obj(mine, "b"))
        await _settle(sel)
        assert seen == [("DELETED", "a")]
        # Gone, or replaced by a new object of that name: a deletion.
        api.objects[(mine, "c")] = _obj(mine, "c", uid="u2")
        sel._on_mine("DELETED", _obj(mine, "c"))
        sel._on_mine("DELETED", _obj(mine, "d"))
        await _settle(sel)
        assert seen == [("DELETED", "a"), ("DELETED", "c"), ("DELETED", "d")]
        assert api.patches == []

    asyncio.run(go())


def test_an_unlabelled_object_is_taken_in_and_labelled_and_its_move_is_not_a_deletion() -> None:
    async def go() -> None:
        mine, theirs = _in_shard(0), _in_shard(1)
        api = LabelApi()
        sel, seen = _selection(api)
        api.objects[(mine, "p")] = _obj(mine, "p")
        assert sel.unlabelled is not None
        sel._on_unlabelled("ADDED", _obj(mine, "p"))
        sel._on_unlabelled("ADDED", _obj(theirs, "q"))  # its owner labels it
        await _settle(sel)
        assert seen == [("ADDED", "p")]
        assert api.patches == [(mine, "p", {names.LABEL_SHARD_BUCKET: str(bucket_of(mine))})]
        # The label moved it: ADDED in the shard's own watch (the informer records it), then DELETED here.
        sel.mine._known[(mine, "p")] = _obj(mine, "p")
        sel._on_unlabelled("DELETED", _obj(mine, "p"))
        assert not sel._tasks and seen == [("ADDED", "p")]

    asyncio.run(go())


def test_a_wrong_bucket_is_corrected_by_the_shard_it_reached_which_never_takes_it_in() -> None:
    async def go() -> None:
        theirs = _in_shard(1)
        api = LabelApi()
        sel, seen = _selection(api)
        api.objects[(theirs, "w")] = _obj(theirs, "w")
        sel._on_mine("ADDED", _obj(theirs, "w"))
        sel._on_mine("MODIFIED", _obj(theirs, "w"))  # one patch in flight is enough
        await _settle(sel)
        sel._on_mine("DELETED", _obj(theirs, "w"))  # it left: not this shard's business
        assert seen == [] and not sel._tasks
        assert api.patches == [(theirs, "w", {names.LABEL_SHARD_BUCKET: str(bucket_of(theirs))})]
        assert sel.relabelled == 1

    asyncio.run(go())
