"""The client's async core (gpuobj.client.core) on one loop, with stand-ins for the agent and the API.

Pure logic: what the core writes, frees and refuses. The same code runs against the real API
server and agents in tests/e2e/operator/test_lifecycle.py, test_write_behind.py and
test_client_errors.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from gpuobj.client import errors
from gpuobj.client.core import ClientCore
from gpuobj.client.handles import ObjectAddress, SharedRef
from gpuobj_kube.client import NotFound
from tests.unit.client.test_handoff_release import _serve


class Agent:
    """The embedded agent's seam (gpuobj.client.agent_seam: AgentSeam and ReadingAgent), objects in a dict."""

    endpoint = "10.0.0.1:8470"
    incarnation = "inc-1"
    serves_tls = False

    def __init__(self) -> None:
        self.objects: dict[str, list] = {}
        self.fetched: list[str] = []
        self.private: set[str] = set()

    def client_tls(self) -> None:
        return None

    async def aput(self, object_id: str, tensors: list, copy: bool = False, **_: object) -> None:
        self.objects[object_id] = tensors

    async def afree(self, object_id: str) -> None:
        self.objects.pop(object_id, None)

    async def afetch(self, endpoint: str, object_id: str, *, device: str, token: str | None, **_: object) -> list:
        self.fetched.append(object_id)
        return self.objects[object_id]

    async def afetch_granted(self, endpoint: str, object_id: str, grant: dict, *, device: str, token: str | None, **_):
        return await self.afetch(endpoint, object_id, device=device, token=token)

    def fetch_granted_direct(self, endpoint: str, object_id: str, grant: dict, **_: object) -> list:
        raise LookupError("stale grant")  # the full path (afetch_granted) reads it

    def publish(self, key: str, tensors: list) -> None:
        self.objects[key] = tensors

    async def agrant(self, object_id: str) -> dict:
        return {"object": object_id}

    def set_record_pending(self, object_id: str, pending: bool) -> None:
        pass

    def set_private(self, object_id: str, private: bool) -> None:
        (self.private.add if private else self.private.discard)(object_id)

    def told_write_rate(self) -> float | None:
        return None


class Api:
    """GPUObjects, claims and pods by (plural, name)."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], dict] = {("pods", "reader"): {"metadata": {"uid": "pod-uid-r"}}}
        self.uids = 0
        self.throttled = 0  # the kube client's count of 429 answers (the write-behind paces by it)

    async def create(self, res, body, namespace):
        self.uids += 1
        created = {**body, "metadata": {**body["metadata"], "uid": f"u{self.uids}", "namespace": namespace}}
        self.items[(res.plural, body["metadata"]["name"])] = created
        return created

    async def get(self, res, name, namespace):
        try:
            return self.items[(res.plural, name)]
        except KeyError:
            raise NotFound(404, "NotFound", f"{res.plural} {name} not found") from None

    async def delete(self, res, name, namespace, uid=None, **_: object):
        self.items.pop((res.plural, name), None)

    async def close(self) -> None:
        pass

    def names(self, plural: str) -> list[str]:
        return sorted(n for p, n in self.items if p == plural)


def run(body, *, write_behind: dict | None = None) -> None:
    async def go() -> None:
        agent, api = Agent(), Api()
        core = ClientCore(
            pod_name="src",
            namespace="ns",
            pod_uid="pod-uid-s",
            agent=agent,
            kube=api,  # type: ignore[arg-type]
            token_file=None,
            timeout=5.0,
            write_behind=write_behind,
        )
        worker = asyncio.create_task(core.releases.run())
        try:
            await body(core, agent, api)
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            await core.close_writes()

    asyncio.run(go())


def test_put_then_release_records_the_object_then_deletes_it_and_nothing_is_held() -> None:
    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        ref = await core.put([torch.ones(4)], name="w")
        assert api.names("gpuobjects") == ["w"] and ref.address.uid == "u1"
        assert api.items[("gpuobjects", "w")]["spec"]["source"] == {
            "podName": "src",
            "podUID": "pod-uid-s",
            "incarnation": "inc-1",
        }
        assert await core.fetch(ref) == agent.objects[ref.address.object_id]
        await core.release(ref)
        assert api.names("gpuobjects") == [] and not ref.alive
        with pytest.raises(errors.ReleasedHandleError):
            await core.fetch(ref)
        with pytest.raises(errors.ReleasedHandleError):
            await core.borrow(ref)

    run(body)


def test_a_handle_whose_object_its_namespace_quota_refused_fails_with_quota_exceeded() -> None:
    """The operator marks an object over its namespace's quota Failed (QuotaExceeded) and frees it; the
    real run is tests/e2e/operator/test_namespace_quota.py."""

    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        ref = await core.put([torch.ones(4)], name="w")
        agent.objects.pop(ref.address.object_id)  # freed by the operator
        ready = {"type": "Ready", "status": "False", "reason": "QuotaExceeded", "message": "over team-a's quota"}
        ready["lastTransitionTime"] = "2026-12-02T12:00:00Z"
        api.items[("gpuobjects", "w")]["status"] = {"state": "Failed", "conditions": [ready]}
        with pytest.raises(errors.QuotaExceededError, match="over team-a's quota"):
            await core.fetch(ref)
        del api.items[("gpuobjects", "w")]  # then the record goes
        with pytest.raises(errors.ObjectNotFoundError):
            await core.fetch(ref)

    run(body)


def test_a_put_whose_record_fails_frees_its_bytes() -> None:
    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        async def refuse(*_: object) -> dict:
            raise ConnectionRefusedError("API down")

        api.create = refuse  # type: ignore[method-assign]
        with pytest.raises(ConnectionRefusedError):
            await core.put([torch.ones(4)], name="w")
        assert agent.objects == {}

    run(body)


def test_put_of_something_that_is_not_tensors_is_refused_before_anything_is_stored() -> None:
    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        with pytest.raises(errors.InvalidTensorError, match="item 0 is a list"):
            await core.put([[1.0, 2.0]])
        assert agent.objects == {} and api.names("gpuobjects") == []

    run(body)


def test_share_claims_for_the_receiver_and_a_read_once_adoption_releases_after_its_read() -> None:
    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        ref = await core.put([torch.ones(4)], name="w")
        shared = await core.share(ref, "reader", None, read_once=True)
        [claim] = api.names("gpuobjectclaims")
        assert api.items[("gpuobjectclaims", claim)]["metadata"]["ownerReferences"][0]["uid"] == "pod-uid-r"
        with pytest.raises(errors.PodNotFoundError, match="ns/nobody does not exist"):
            await core.share(ref, "nobody", None)
        # The receiver's core (same pod name here) adopts it; its one read releases the claim.
        mine = SharedRef(shared.address, shared.claim_name, shared.claim_uid, "src", read_once=True)
        adopted = core.adopt(mine)
        with pytest.raises(errors.GpuObjError, match="shared with pod reader"):
            core.adopt(shared)
        await core.fetch(adopted)
        await core.releases.drain()
        assert not adopted.alive and api.names("gpuobjectclaims") == []
        await core.release(ref)
        assert api.names("gpuobjects") == [] and not any(r.alive for r in core.live)

    run(body)


def test_with_write_behind_an_object_released_inside_the_window_is_never_written_and_is_freed() -> None:
    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        ref = await core.put([torch.ones(4)], name="w")
        assert agent.objects and ref.pending
        await core.release(ref)
        await core.flush(5.0)
        assert agent.objects == {}  # freed by the core, since nothing recorded it
        assert api.names("gpuobjects") == []
        assert (await core.write_stats())["pending"] == 0

    run(body, write_behind={"window": 30.0})


# ---------------------------------------------------------------- hand-off releases (handoff.py)
# The source is a real HTTP server on localhost answering as a source agent would; the end-to-end run,
# with the source's queue holding the claim's create, is tests/e2e/operator/test_write_behind.py.


def _handed_to(core: ClientCore, source: str) -> SharedRef:
    """A hand-off made for this core's pod by a source at `source` whose queue holds the claim's create."""
    address = ObjectAddress("ns", "w", "u9", "obj-9", "other", source, source_pod_uid="")
    return SharedRef(address, "w-src-abc123", "", core.pod_name, release_via=source)


def _with_source(answers: list[int], body, *, write_behind: dict | None = None) -> list[int]:
    asked: list[list[int]] = []

    async def go(core: ClientCore, agent: Agent, api: Api) -> None:
        runner, url, answered = await _serve(answers)
        asked.append(answered)
        try:
            await body(core, api, url.split("/")[2])
        finally:
            await core.close_connections()
            await runner.cleanup()

    run(go, write_behind=write_behind)
    return asked[0]


@pytest.mark.parametrize("write_behind", [None, {"window": 30.0}])
def test_a_receivers_release_of_a_hand_off_goes_to_the_source_and_it_deletes_nothing_itself(write_behind) -> None:
    """Before (issue 32), a receiver with no write-behind queue of its own deleted the claim in the API at
    once, before the source's queued create (it failed so: the claim deleted, the source never asked)."""

    async def body(core: ClientCore, api: Api, source: str) -> None:
        handed = core.adopt(_handed_to(core, source))
        api.items[("gpuobjectclaims", "w-src-abc123")] = {"metadata": {"name": "w-src-abc123"}}  # as it landed
        await core.release(handed)
        await core.flush(5.0)
        assert ("gpuobjectclaims", "w-src-abc123") in api.items  # the source's queue deletes it, in order

    asked = _with_source([200], body, write_behind=write_behind)
    assert asked[0] == 200 and len(asked) == 1


@pytest.mark.parametrize("write_behind", [None, {"window": 30.0}])
def test_a_receiver_deletes_a_hand_off_claim_only_once_its_source_disowns_it(write_behind) -> None:
    async def body(core: ClientCore, api: Api, source: str) -> None:
        handed = core.adopt(_handed_to(core, source))
        api.items[("gpuobjectclaims", "w-src-abc123")] = {"metadata": {"name": "w-src-abc123"}}
        await core.release(handed)
        await core.flush(5.0)
        assert ("gpuobjectclaims", "w-src-abc123") not in api.items

    assert _with_source([503, 503, 404], body, write_behind=write_behind) == [503, 503, 404]


def test_a_source_that_never_answers_clearly_keeps_the_claim_and_flush_says_so() -> None:
    async def body(core: ClientCore, api: Api, source: str) -> None:
        handed = core.adopt(_handed_to(core, source))
        api.items[("gpuobjectclaims", "w-src-abc123")] = {"metadata": {"name": "w-src-abc123"}}
        await core.release(handed)
        with pytest.raises(TimeoutError, match="1 hand-off releases wait for their sources"):
            await core.flush(0.5)
        await core.close_connections()  # ends the release still asking: nothing was deleted behind the source
        assert ("gpuobjectclaims", "w-src-abc123") in api.items and core.sources.in_flight == 0

    assert set(_with_source([503], body, write_behind={"window": 30.0})) == {503}


def test_a_source_whose_queue_closed_disowns_its_hand_offs_and_not_before() -> None:
    """Before, a release that reached a closing source was taken into its stopped queue and never sent."""

    async def body(core: ClientCore, agent: Agent, api: Api) -> None:
        ref = await core.put([torch.ones(4)], name="w")
        shared = await core.share(ref, "reader", "pod-uid-r")
        assert await core.handoff_sink(shared.claim_name, "nobody") is False  # not the holder's: the answer of unknown
        await core.close_writes()
        assert await core.handoff_sink(shared.claim_name, "reader") is False  # 404: no queue here will create it

    run(body, write_behind={"window": 30.0})
