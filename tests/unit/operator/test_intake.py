"""Event intake from the informers: the sync hands each informer its list to take over from, and a
deletion reported after a relist (identity only: namespace, name, uid) removes the ledger's own record.
tests/e2e/operator/test_informer.py and the lifecycle tests drive the same against a real API server."""

from __future__ import annotations

import asyncio

from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS
from gpuobj_kube.informer import identity_of
from tests.unit.operator.test_executors import NS, claim_body, object_body, setup


def stream_body(name: str = "s") -> dict:
    return {"metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"}, "spec": {"producer": {"podName": "src"}}}


def test_the_sync_hands_every_informer_its_list_and_version() -> None:
    async def go() -> None:
        r, api, _, _ = setup((GPUOBJECTS, object_body()), (CLAIMS, claim_body("c")), (STREAMS, stream_body()))
        await r.sync()
        listed = r.intake.listed
        assert sorted(listed) == sorted(res.plural for res in (GPUOBJECTS, CLAIMS, STREAMS, PODS))
        version, identities = listed[GPUOBJECTS.plural]
        assert version == str(api.rv)
        assert identities == [{"metadata": {"namespace": NS, "name": "w", "uid": "uid-w"}}]

    asyncio.run(go())


def test_a_deletion_with_only_an_identity_removes_the_ledgers_record() -> None:
    async def go() -> None:
        r, api, _, _ = setup((GPUOBJECTS, object_body()), (CLAIMS, claim_body("c")), (STREAMS, stream_body()))
        await r.sync()
        assert (NS, "w") in r.ledger.objects and (NS, "c") in r.ledger.claims and (NS, "s") in r.ledger.streams
        r.on_claim("DELETED", identity_of(api.store[("gpuobjectclaims", NS, "c")]))
        r.on_stream("DELETED", identity_of(api.store[("gpuobjectstreams", NS, "s")]))
        r.on_object("DELETED", identity_of(api.store[("gpuobjects", NS, "w")]))
        assert r.ledger.objects == {} and r.ledger.claims == {} and r.ledger.streams == {}

    asyncio.run(go())


def test_a_deletion_of_an_earlier_object_of_the_same_name_leaves_the_new_one() -> None:
    async def go() -> None:
        r, _, _, _ = setup((GPUOBJECTS, object_body()))
        await r.sync()
        r.on_object("DELETED", {"metadata": {"namespace": NS, "name": "w", "uid": "an-earlier-uid"}})
        assert r.ledger.objects[(NS, "w")].uid == "uid-w"

    asyncio.run(go())


def test_a_claim_naming_a_process_other_than_the_one_last_seen_asks_for_a_probe_at_once() -> None:
    """A share made for a process that then died at once (its restart probed before the claim arrived):
    the claim's process can be proved dead only by a probe begun after the claim was learned, so the
    claim asks for one; a claim naming the process last seen alive asks nothing."""

    async def go() -> None:
        r, api, _, _ = setup()
        await r.sync()
        r.ledger.liveness.observe_alive((NS, "src"), "pod-uid-1", "inc-new", 1.0)
        for name, incarnation in (("for-current", "inc-new"), ("for-dead", "inc-old")):
            body = claim_body(name)
            body["spec"]["holder"] = {"podName": "src", "incarnation": incarnation}
            r.prober.forget((NS, "src"))
            r.on_claim("ADDED", api.put(CLAIMS, body))
            assert ((NS, "src") in r.prober._probe_asked) == (incarnation == "inc-old"), name

    asyncio.run(go())
