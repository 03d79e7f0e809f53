"""The write-behind queue's decisions: elision, order, backpressure, retries, refusals.

A scripted stand-in for the API server answers here (pure logic); the end-to-end tests in
tests/e2e/operator/test_write_behind.py run the same code against the real API server.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from gpuobj.client.congestion import InFlightLimit, jittered
from gpuobj.client.errors import NameTakenError, PodNotFoundError
from gpuobj.client.writebehind import WriteBehind, WriteBehindFullError, WriteFailedError
from gpuobj_contract import resources as crd
from gpuobj_kube.client import Conflict, Invalid


class ScriptedApi:
    """Records every write; `down` makes each call fail like a refused connection."""

    def __init__(self, jitter: float = 0.0) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.down = False
        self.refuse_creates = False
        self.jitter = jitter
        self.uids = 0
        self.throttled = 0  # the kube client's count of 429 answers, retried or not

    async def _pause(self) -> None:
        await asyncio.sleep(random.random() * self.jitter)
        if self.down:
            raise ConnectionRefusedError("connection refused")

    async def create(self, res, body, namespace):
        await self._pause()
        if self.refuse_creates:
            raise Invalid(422, "Invalid", "refused")
        self.uids += 1
        self.calls.append(("create", res.plural, body["metadata"]["name"]))
        return {"metadata": {"name": body["metadata"]["name"], "uid": f"u{self.uids}"}, "spec": body["spec"]}

    async def delete(self, res, name, namespace, uid=None):
        await self._pause()
        self.calls.append(("delete", res.plural, name))
        return {}

    async def get(self, res, name, namespace):  # pragma: no cover - only after a lost answer
        raise AssertionError("not expected")


def object_spec(object_id: str, pod: str = "a") -> dict:
    """A GPUObject's spec as the client writes it (through the CRD's typed shape)."""
    tensor = crd.TensorSpec((2,), "int8", "cpu")
    return crd.GPUObjectSpec(crd.ObjectSource(pod, pod_uid=f"uid-{pod}"), (tensor,), object_id=object_id).to_json()


def body(name: str, spec: dict | None = None) -> dict:
    return {"metadata": {"name": name}, "spec": spec or object_spec(name)}


def claim_body(name: str, obj: str, holder: str = "r") -> dict:
    spec = crd.GPUObjectClaimSpec(obj, holder=crd.ClaimHolder(holder))
    return {"metadata": {"name": name}, "spec": spec.to_json()}


def run(coro):
    return asyncio.run(coro)


def test_an_object_whose_life_fits_in_the_window_is_never_written_and_is_freed_by_the_caller() -> None:
    async def go():
        api, freed = ScriptedApi(), []
        wb = WriteBehind(api, free_local=freed.append, window=5.0)
        await wb.create_object("ns", "o", body("o"), "oid-1")
        await wb.create_claim("ns", "o", "c", claim_body("c", "o"))
        assert wb.release("object", "ns", "o").free_object_id is None  # the hand-off still holds it
        out = wb.release("claim", "ns", "c")
        assert out.elided and out.free_object_id == "oid-1"
        await wb.flush(5)
        assert api.calls == [] and wb.pending_writes == 0 and wb.families == {}
        await wb.close()

    run(go())


def test_a_hand_off_is_created_before_the_senders_release_and_the_claim_pins_the_uid() -> None:
    async def go():
        api = ScriptedApi()
        wb = WriteBehind(api, free_local=lambda _: None, window=0.01)
        obj = await wb.create_object("ns", "o", body("o"), "oid")
        claim_spec = claim_body("c", "o")
        await wb.create_claim("ns", "o", "c", claim_spec)
        wb.release("object", "ns", "o")  # inside the window, but the receiver's claim lives on
        await wb.flush(5)
        assert api.calls == [
            ("create", "gpuobjects", "o"),
            ("create", "gpuobjectclaims", "c"),
            ("delete", "gpuobjects", "o"),
        ]
        assert claim_spec["spec"]["objectUID"] == obj.uid
        wb.release("claim", "ns", "c")
        await wb.flush(5)
        assert api.calls[-1] == ("delete", "gpuobjectclaims", "c")
        assert wb.pending_writes == 0 and wb.families == {}
        await wb.close()

    run(go())


def test_order_holds_per_object_under_concurrency() -> None:
    async def go():
        api = ScriptedApi(jitter=0.003)
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0, concurrency=8)

        async def life(i: int) -> None:
            await wb.create_object("ns", f"o{i}", body(f"o{i}"), f"id{i}")
            await wb.create_claim("ns", f"o{i}", f"c{i}", claim_body(f"c{i}", f"o{i}"))
            await asyncio.sleep(random.random() * 0.01)
            wb.release("object", "ns", f"o{i}")
            await asyncio.sleep(random.random() * 0.01)
            wb.release("claim", "ns", f"c{i}")

        await asyncio.gather(*(life(i) for i in range(60)))
        await wb.flush(10)
        for i in range(60):
            mine = [c for c in api.calls if c[2] in (f"o{i}", f"c{i}")]
            if mine:  # some families may have been elided entirely; a sent family is complete and ordered
                assert mine[:2] == [("create", "gpuobjects", f"o{i}"), ("create", "gpuobjectclaims", f"c{i}")]
                assert sorted(mine[2:]) == [("delete", "gpuobjectclaims", f"c{i}"), ("delete", "gpuobjects", f"o{i}")]
        assert wb.pending_writes == 0 and wb.families == {}
        await wb.close()

    run(go())


def test_an_outage_applies_backpressure_with_a_clear_error_and_loses_no_write() -> None:
    async def go():
        api = ScriptedApi()
        api.down = True
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0, max_pending=3, backpressure_timeout=0.3)
        for i in range(3):
            await wb.create_object("ns", f"o{i}", body(f"o{i}"), f"id{i}")
        with pytest.raises(WriteBehindFullError, match=r"3 API writes are waiting.*ConnectionRefusedError"):
            await wb.create_object("ns", "o3", body("o3"), "id3")
        for i in range(3):  # releases are never refused, even when full
            wb.release("object", "ns", f"o{i}")
        assert wb.pending_writes == 6 and wb.counts["retries"] > 0
        api.down = False
        await wb.flush(10)
        expected = [(verb, "gpuobjects", f"o{i}") for verb in ("create", "delete") for i in range(3)]
        assert sorted(api.calls) == sorted(expected)
        assert wb.pending_writes == 0 and wb.families == {}
        await wb.close()

    run(go())


def test_the_local_agent_hears_while_an_objects_record_waits_and_when_it_no_longer_does() -> None:
    """Pending from the put until its create lands, is taken back (elided) or is refused for good."""

    async def go():
        api, pending = ScriptedApi(), {}

        async def free(object_id: str) -> None:
            pass

        def note(object_id: str, waiting: bool) -> None:
            pending[object_id] = waiting

        api.down = True
        wb = WriteBehind(api, free_local=free, window=0.0, on_record_pending=note)
        await wb.create_object("ns", "landed", body("landed"), "id-landed")
        await asyncio.sleep(0.05)  # tried and refused: still waiting
        assert pending == {"id-landed": True}
        api.down = False
        await wb.flush(10)
        assert pending == {"id-landed": False}
        elided = WriteBehind(api, free_local=free, window=30.0, on_record_pending=note)
        await elided.create_object("ns", "short", body("short"), "id-short")
        assert pending["id-short"] is True
        elided.release("object", "ns", "short")  # inside the window: never written
        assert pending["id-short"] is False
        api.refuse_creates = True
        await wb.create_object("ns", "refused", body("refused"), "id-refused")
        await wb.flush(10, raise_refused=False)
        assert pending["id-refused"] is False  # it never will be recorded (and its bytes were freed)
        await wb.close()
        await elided.close()

    run(go())


def test_a_create_the_api_refuses_frees_the_bytes_and_says_why() -> None:
    async def go():
        api, freed = ScriptedApi(), []

        async def free(object_id: str) -> None:
            freed.append(object_id)

        api.refuse_creates = True
        wb = WriteBehind(api, free_local=free, window=0.0)
        rec = await wb.create_object("ns", "o", body("o"), "oid")
        with pytest.raises(WriteFailedError, match="refused"):
            await wb.flush(5)  # a refusal for good is raised once, by the next flush
        assert freed == ["oid"] and rec.failed is not None and "refused" in str(rec.failed)
        wb.release("object", "ns", "o")
        await wb.flush(5)
        assert wb.pending_writes == 0 and wb.families == {}
        await wb.close()

    run(go())


def test_a_release_refused_with_403_is_retried_until_it_lands() -> None:
    """An API server that has just restarted answers 403 until its RBAC cache is filled (chaos suite)."""
    from gpuobj_kube.client import ApiError

    class ForbiddenAtFirst(ScriptedApi):
        def __init__(self) -> None:
            super().__init__()
            self.forbidden = 3

        async def delete(self, res, name, namespace, uid=None):
            if self.forbidden:
                self.forbidden -= 1
                raise ApiError(403, "Forbidden", 'clusterrole "gpuobj-workload" not found')
            return await super().delete(res, name, namespace, uid)

    async def go():
        api = ForbiddenAtFirst()
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0)
        await wb.create_object("ns", "o", body("o"), "oid-1")
        await wb.flush(5)
        wb.release("object", "ns", "o")
        await wb.flush(10)
        assert api.calls == [("create", "gpuobjects", "o"), ("delete", "gpuobjects", "o")]
        assert wb.pending_writes == 0 and wb.counts["failed"] == 0
        await wb.close()

    run(go())


class ForbiddenCreates(ScriptedApi):
    """Answers creates with 403 the first ``forbidden`` times, as a just-restarted API server does."""

    def __init__(self, forbidden: int) -> None:
        super().__init__()
        self.forbidden = forbidden
        self.refused = 0

    async def create(self, res, body, namespace):
        from gpuobj_kube.client import ApiError

        if self.forbidden:
            self.forbidden -= 1
            self.refused += 1
            raise ApiError(403, "Forbidden", 'clusterrole "gpuobj-workload" not found')
        return await super().create(res, body, namespace)


def test_a_create_refused_with_403_right_after_an_api_restart_is_retried_and_lands() -> None:
    async def go():
        api, freed = ForbiddenCreates(forbidden=3), []

        async def free(object_id: str) -> None:
            freed.append(object_id)

        wb = WriteBehind(api, free_local=free, window=0.0)
        rec = await wb.create_object("ns", "o", body("o"), "oid")
        await wb.flush(10)
        assert api.refused == 3 and api.calls == [("create", "gpuobjects", "o")]
        assert rec.created and rec.failed is None and freed == []
        wb.release("object", "ns", "o")
        await wb.flush(5)
        assert wb.pending_writes == 0 and wb.families == {} and wb.counts["failed"] == 0
        await wb.close()

    run(go())


def test_a_403_that_outlasts_the_grace_fails_the_put_as_permission_denied() -> None:
    from gpuobj import PermissionDeniedError

    async def go():
        api, freed = ForbiddenCreates(forbidden=10**6), []

        async def free(object_id: str) -> None:
            freed.append(object_id)

        wb = WriteBehind(api, free_local=free, window=0.0, forbidden_grace=0.3)
        rec = await wb.create_object("ns", "o", body("o"), "oid")
        with pytest.raises(PermissionDeniedError):
            await wb.flush(10)
        assert api.refused >= 2 and api.calls == []  # retried, then given up
        assert isinstance(rec.failed, PermissionDeniedError) and isinstance(rec.failed, WriteFailedError)
        assert "ServiceAccount" in str(rec.failed) and freed == ["oid"]
        wb.release("object", "ns", "o")
        await wb.flush(5)
        assert wb.pending_writes == 0 and wb.families == {}
        await wb.close()

    run(go())


class NameHeldElsewhere(ScriptedApi):
    """The API server holds object ``taken`` of another pod: a create of that name answers 409 AlreadyExists."""

    async def create(self, res, body, namespace):
        if body["metadata"]["name"] == "taken":
            raise Conflict(409, "AlreadyExists", 'gpuobjects.gpuobj.io "taken" already exists')
        return await super().create(res, body, namespace)

    async def get(self, res, name, namespace):
        return {"metadata": {"name": name, "uid": "theirs"}, "spec": object_spec("o-theirs", pod="b")}


class AnswersLost(ScriptedApi):
    """Every create lands, but its first answer is lost: the retry is answered 409 AlreadyExists, and a get
    finds what the first try made, with a field a newer schema defaults (so not the same dict as sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[str, dict] = {}

    async def create(self, res, body, namespace):
        name = body["metadata"]["name"]
        if name in self.stored:
            raise Conflict(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
        self.stored[name] = await super().create(res, body, namespace)
        raise TimeoutError("the answer was lost")

    async def get(self, res, name, namespace):
        found = self.stored[name]
        return {**found, "spec": {**found["spec"], "defaultedByANewerSchema": True}}


def test_a_create_whose_answer_was_lost_is_taken_as_ours_by_its_typed_spec() -> None:
    async def go():
        api = AnswersLost()
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0)
        obj = await wb.create_object("ns", "o", body("o", object_spec("oid")), "oid")
        claim = claim_body("c", "o")
        await wb.create_claim("ns", "o", "c", claim)
        await wb.flush(5)  # nothing refused: both found as ours
        assert (obj.uid, obj.failed) == ("u1", None)
        assert crd.GPUObjectClaimSpec.from_json(claim["spec"]).object_uid == "u1"  # pinned through the shape
        assert crd.GPUObjectClaimSpec.from_json(api.stored["c"]["spec"]) == crd.GPUObjectClaimSpec(
            "o", object_uid="u1", holder=crd.ClaimHolder("r")
        )
        await wb.close()

    run(go())


def test_a_claim_name_held_by_another_holder_is_name_taken_naming_that_holder() -> None:
    class ClaimHeld(NameHeldElsewhere):
        async def create(self, res, body, namespace):
            if body["metadata"]["name"] == "c-taken":
                raise Conflict(409, "AlreadyExists", 'gpuobjectclaims.gpuobj.io "c-taken" already exists')
            return await ScriptedApi.create(self, res, body, namespace)

        async def get(self, res, name, namespace):
            return {"metadata": {"name": name, "uid": "theirs"}, "spec": claim_body(name, "other", "b")["spec"]}

    async def go():
        wb = WriteBehind(ClaimHeld(), free_local=lambda _: None, window=0.0)
        await wb.create_object("ns", "o", body("o"), "oid")
        await wb.create_claim("ns", "o", "c-taken", claim_body("c-taken", "o"))
        with pytest.raises(NameTakenError, match=r"GPUObjectClaim ns/c-taken .* \(holder pod b\)"):
            await wb.flush(5)
        await wb.close()

    run(go())


def test_a_name_another_pod_holds_fails_the_family_with_name_taken_once_and_frees_the_bytes() -> None:
    async def go():
        api, freed = NameHeldElsewhere(), []

        async def free(object_id: str) -> None:
            freed.append(object_id)

        wb = WriteBehind(api, free_local=free, window=0.0)
        rec = await wb.create_object("ns", "taken", body("taken", object_spec("o-mine")), "o-mine")
        with pytest.raises(NameTakenError, match=r"already exists and is not this process's \(source pod b\)"):
            await wb.flush(5)
        assert isinstance(rec.failed, NameTakenError) and freed == ["o-mine"]
        assert wb.counts["retries"] == 0 and wb.pending_writes == 0  # refused at once, never retried
        await wb.flush(5)  # raised once: the next flush has nothing to say
        wb.release("object", "ns", "taken")
        assert wb.families == {}
        await wb.close()

    run(go())


def test_a_claim_for_a_receiver_is_queued_without_its_uid_and_a_missing_receiver_fails_that_claim_alone() -> None:
    async def go():
        api, created = ScriptedApi(), {}
        real_create = api.create

        async def create(res, body, namespace):
            created[body["metadata"]["name"]] = body
            return await real_create(res, body, namespace)

        api.create = create
        asked: list[tuple[str, str]] = []

        async def pod_uid(namespace: str, pod: str) -> str:
            asked.append((namespace, pod))
            if pod == "ghost":
                raise PodNotFoundError(f"pod {namespace}/{pod} does not exist")
            return "uid-of-" + pod

        api.down = True  # an outage: the claims are queued all the same
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0, pod_uid=pod_uid)
        await wb.create_object("ns", "o", body("o"), "oid")
        for claim, pod in (("c-ghost", "ghost"), ("c-reader", "reader")):
            owned = {"name": claim, "ownerReferences": [{"kind": "Pod", "name": pod, "uid": ""}]}
            spec = claim_body(claim, "o", pod)["spec"]
            await wb.create_claim("ns", "o", claim, {"metadata": owned, "spec": spec}, owner_pod=pod)
        assert asked == [] and wb.pending_writes == 3
        api.down = False
        with pytest.raises(PodNotFoundError, match="ghost"):
            await wb.flush(5)
        assert [c[2] for c in api.calls] == ["o", "c-reader"]  # the object and the other claim still landed
        assert created["c-reader"]["metadata"]["ownerReferences"][0]["uid"] == "uid-of-reader"
        assert wb.release("claim", "ns", "c-ghost").free_object_id is None  # nothing to delete for it
        wb.release("claim", "ns", "c-reader")
        wb.release("object", "ns", "o")
        await wb.flush(5)
        assert sorted(api.calls[2:]) == [("delete", "gpuobjectclaims", "c-reader"), ("delete", "gpuobjects", "o")]
        await wb.close()

    run(go())


class Throttling(ScriptedApi):
    """An overloaded API server: while `throttling`, every write is answered 429 once, which the kube
    client waits out (Retry-After) and retries: the write lands, and only its `throttled` count tells."""

    def __init__(self) -> None:
        super().__init__()
        self.throttling = True
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate = asyncio.Event()  # writes wait for it, so the test sees how many are in flight at once

    async def create(self, res, body, namespace):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.wait_for(self.gate.wait(), 5)
            if self.throttling:
                self.throttled += 1
            return await super().create(res, body, namespace)
        finally:
            self.in_flight -= 1


async def settle() -> None:
    """Let every task that can run do so (each family's first write reaches the gate or waits for room)."""
    for _ in range(100):
        await asyncio.sleep(0)


def test_a_throttling_api_server_halves_the_writes_in_flight_and_unthrottled_writes_grow_them_back() -> None:
    async def go():
        api = Throttling()
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0, concurrency=16)
        api.throttling = False
        for i in range(30):  # slow start: 1 at first, one more per write that lands, up to the ceiling
            await wb.create_object("ns", f"s{i}", body(f"s{i}"), f"oid-s{i}")
        await settle()
        assert api.most_in_flight == 1
        api.gate.set()
        await wb.flush(5)
        assert wb.in_flight.limit == 16 and wb.stats()["throttledCuts"] == 0
        api.gate.clear()
        api.most_in_flight, api.throttling = 0, True
        for i in range(16):
            await wb.create_object("ns", f"a{i}", body(f"a{i}"), f"oid-a{i}")
        await settle()
        assert api.most_in_flight == 16  # the ceiling while nothing was throttled
        api.gate.set()
        await wb.flush(5)
        assert wb.in_flight.limit == 8 and wb.stats()["throttledCuts"] == 1  # one burst of 429s: one cut
        api.gate.clear()
        api.most_in_flight = 0
        for i in range(16):
            await wb.create_object("ns", f"b{i}", body(f"b{i}"), f"oid-b{i}")
        await settle()
        assert api.most_in_flight == 8  # the rest wait their turn
        api.throttling = False
        api.gate.set()
        await wb.flush(5)
        assert wb.in_flight.limit > 8  # grown back by the writes that landed unthrottled
        assert len(api.calls) == 62  # nothing dropped
        await wb.close()

    run(go())


def test_the_in_flight_limit_cuts_once_per_calm_period_and_never_below_its_floor() -> None:
    now = [0.0]
    limit = InFlightLimit(16, floor=2, calm=1.0, clock=lambda: now[0])
    for _ in range(5):
        limit.observe(True)  # one burst
    assert limit.limit == 8 and limit.cuts == 1
    for _ in range(4):
        now[0] += 1.0
        limit.observe(True)
    assert limit.limit == 2 and limit.cuts == 3  # 8, 4, 2, then the floor holds
    for _ in range(2 + 3):  # one round at size 2 (2 writes) and a bit of the next
        limit.observe(False)
    assert limit.limit == 3
    with pytest.raises(ValueError, match="floor"):
        InFlightLimit(4, floor=5)


def test_a_private_object_is_never_written_however_long_it_lives_and_its_release_frees_it() -> None:
    """Recording policy "shared": an unnamed object no one else references makes no API write, even
    flushed and past the window; the agent hears it is private (for the audit), then that it is gone."""

    async def go():
        api, private = ScriptedApi(), {}
        wb = WriteBehind(
            api, free_local=lambda _: None, window=0.0, on_private=lambda oid, p: private.__setitem__(oid, p)
        )
        rec = await wb.create_object("ns", "o", body("o"), "oid", private=True)
        await asyncio.sleep(0.05)  # well past the window
        await wb.flush(5)
        assert api.calls == [] and wb.pending_writes == 0 and not rec.pending
        assert private == {"oid": True}
        out = wb.release("object", "ns", "o")
        assert out.elided and out.free_object_id == "oid"  # the caller frees the bytes at once
        assert private == {"oid": False} and wb.families == {}
        await wb.close()

    run(go())


def test_a_private_objects_first_claim_records_it_before_the_claim_and_its_release_deletes_it() -> None:
    """A share (or borrow) makes it shared: the held create goes first, in order, as for any object."""

    async def go():
        api, private, pending = ScriptedApi(), {}, {}
        wb = WriteBehind(
            api,
            free_local=lambda _: None,
            window=0.0,
            on_private=lambda oid, p: private.__setitem__(oid, p),
            on_record_pending=lambda oid, p: pending.__setitem__(oid, p),
        )
        obj = await wb.create_object("ns", "o", body("o"), "oid", private=True)
        await asyncio.sleep(0.02)
        claim_spec = claim_body("c", "o")
        await wb.create_claim("ns", "o", "c", claim_spec)
        assert private == {"oid": False} and pending == {"oid": True}
        wb.release("object", "ns", "o")
        await wb.flush(5)
        assert api.calls == [
            ("create", "gpuobjects", "o"),
            ("create", "gpuobjectclaims", "c"),
            ("delete", "gpuobjects", "o"),
        ]
        assert claim_spec["spec"]["objectUID"] == obj.uid and pending == {"oid": False}
        await wb.close()

    run(go())


def test_without_a_private_capable_agent_every_object_is_recorded() -> None:
    """A standalone agent cannot mark an object private: its client records it (the audit must see it)."""

    async def go():
        api = ScriptedApi()
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0)
        await wb.create_object("ns", "o", body("o"), "oid", private=True)
        await wb.flush(5)
        assert api.calls == [("create", "gpuobjects", "o")]
        await wb.close()

    run(go())


def test_retry_delays_are_jittered_per_pod_within_half_to_the_whole_delay() -> None:
    """Pods that failed together must not retry together: each draws its own delay in [d/2, d]."""
    assert jittered(2.0, lambda: 0.0) == 1.0 and jittered(2.0, lambda: 1.0) == 2.0
    pods = [random.Random(seed) for seed in range(50)]
    delays = [jittered(0.4, pod.random) for pod in pods]
    assert all(0.2 <= d <= 0.4 for d in delays)
    assert len({round(d, 6) for d in delays}) > 40  # spread, not one wave


class Timed(ScriptedApi):
    """Records when each write reached the API (loop time)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    async def create(self, res, body, namespace):
        self.at.append(asyncio.get_running_loop().time())
        return await super().create(res, body, namespace)


def test_a_told_write_rate_paces_the_writes_after_a_burst_of_one_second_of_it() -> None:
    async def go():
        api, told = Timed(), [4.0]  # 4 writes a second: a burst of one second's worth, then 0.25 s apart
        wb = WriteBehind(api, free_local=lambda _: None, window=0.0, concurrency=16, write_rate=lambda: told[0])
        wb.pace.draw = lambda: 0.0  # no random phase: the first write goes at once
        t0 = asyncio.get_running_loop().time()
        for i in range(6):
            await wb.create_object("ns", f"o{i}", body(f"o{i}"), f"oid-{i}")
        await wb.flush(5)
        offsets = [at - t0 for at in api.at]
        assert max(offsets[:4]) < 0.1  # the burst
        assert offsets[4:] == [pytest.approx(0.25, abs=0.05), pytest.approx(0.5, abs=0.05)]  # then one per slot
        stats = wb.stats()
        assert stats["fleetRate"] == 4.0 and stats["pacedWrites"] == 2 and stats["sent"] == 6
        told[0] = None  # the operator's budget was turned off: nothing waits any more
        for i in range(6, 12):
            await wb.create_object("ns", f"o{i}", body(f"o{i}"), f"oid-{i}")
        await wb.flush(5)
        assert wb.stats()["pacedWrites"] == 2 and wb.stats()["sent"] == 12
        await wb.close()

    run(go())


def test_a_family_released_while_its_first_write_waits_for_its_slot_is_never_written() -> None:
    """Past the window but not yet sent (the fleet's budget holds it): taken back like a family inside the
    window, so an overloaded fleet's short-lived objects never reach the API server at all."""

    async def go():
        api, freed = ScriptedApi(), []
        wb = WriteBehind(api, free_local=freed.append, window=0.0, write_rate=lambda: 0.5)
        wb.pace.draw = lambda: 0.5  # the first slot 1 s away (half of a 2 s interval)
        await wb.create_object("ns", "o", body("o"), "oid-1")
        await settle()
        fam = wb.families[("ns", "o")]
        assert fam.started and fam.slot is not None and not fam.sent
        out = wb.release("object", "ns", "o")
        assert out.elided and out.free_object_id == "oid-1"  # the caller frees its bytes at once
        await wb.flush(5)
        await settle()
        assert api.calls == [] and wb.stats()["elided_while_paced"] == 1
        assert wb.pace.waits == 0  # its slot went back to the schedule
        await wb.close()

    run(go())


def test_a_familys_writes_go_together_at_its_slot_and_the_next_family_waits_for_all_of_them() -> None:
    """Create, claim and the owner's delete sent one slot apart would land as three changes (three statuses
    from the operator); sent together they land as one, and the writes after them wait their slots."""

    async def go():
        api = Timed()  # 2 writes a second: one second's burst is 2 writes, then 0.5 s apart
        wb = WriteBehind(api, free_local=lambda _: None, window=0.05, concurrency=1, write_rate=lambda: 2.0)
        wb.pace.draw = lambda: 0.0
        t0 = asyncio.get_running_loop().time()
        await wb.create_object("ns", "a", body("a"), "oid-a")
        await wb.create_claim("ns", "a", "ca", claim_body("ca", "a"))
        wb.release("object", "ns", "a")  # the producer's reference goes inside the window: queued behind
        await wb.create_object("ns", "b", body("b"), "oid-b")
        await wb.flush(10)
        assert [c[:2] for c in api.calls] == [
            *(("create", "gpuobjects"), ("create", "gpuobjectclaims"), ("delete", "gpuobjects")),
            ("create", "gpuobjects"),
        ]
        first_a, first_b = api.at[0] - t0, api.at[-1] - t0
        assert first_a < 0.3  # family a at once (its first write had the burst's slot), all three together
        assert first_b >= 0.9  # b waits until a's three writes' slots have passed (3 x 0.5 s, less the burst)
        assert wb.stats()["sent"] == 4
        await wb.close()

    run(go())
