"""The reconciler's executors and its free path driven without an API server (KubeRay's fake-client habit).

A dict-backed client stands in for the API server and a recording one for the agents: the pure
layer under test is what the executors send, in which order, and what they count. The same code runs
against a real API server and real agents in tests/e2e/operator/ (test_free_claim_order.py,
test_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt

import pytest

from gpuobj_contract import names
from gpuobj_contract.agent_api import FreeAnswer, MaterializeAnswer
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, Invalid, NotFound
from gpuobj_operator.actions import Free, Materialize
from gpuobj_operator.agent_client import AgentError, AgentGone, AgentUnreachable
from gpuobj_operator.decisions import decide
from gpuobj_operator.free_path import RetryLater
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.model import parse_object
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.settings import Settings

NS = "ml"


class FakeApi:
    """GPUObjects, claims and pods in dicts; merge and JSON patches as the API server applies them."""

    def __init__(self) -> None:
        self.store: dict[tuple[str, str, str], dict] = {}
        self.rv = 100
        self.calls: list[tuple[str, str, str]] = []

    def put(self, res, body: dict) -> dict:
        self.rv += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.store[(res.plural, body["metadata"]["namespace"], body["metadata"]["name"])] = body
        return copy.deepcopy(body)

    async def get(self, res, name, namespace=None, **_):
        self.calls.append(("get", res.plural, name))
        try:
            return copy.deepcopy(self.store[(res.plural, namespace, name)])
        except KeyError:
            raise NotFound(404, "NotFound", name) from None

    async def list(self, res, namespace=None, field_selector=None, **_):
        self.calls.append(("list", res.plural, field_selector or ""))
        items = [o for (p, ns, _), o in self.store.items() if p == res.plural and namespace in (None, ns)]
        if field_selector and field_selector.startswith("spec.objectName="):
            wanted = field_selector.split("=", 1)[1]
            items = [o for o in items if o["spec"].get("objectName") == wanted]
        return {"metadata": {"resourceVersion": str(self.rv)}, "items": copy.deepcopy(items)}

    async def patch(self, res, name, body, namespace=None, *, patch_type="merge", subresource=None, **_):
        self.calls.append(("patch", res.plural, subresource or patch_type))
        current = self.store.get((res.plural, namespace, name))
        if current is None:
            raise NotFound(404, "NotFound", name)
        current = copy.deepcopy(current)
        if patch_type == "json":
            for op in body:
                path = op["path"].strip("/").split("/")
                if op["op"] == "test":
                    value = (
                        current["metadata"][path[1]] if len(path) == 2 else current["metadata"][path[1]][int(path[2])]
                    )
                    if value != op["value"]:
                        raise Invalid(422, "Invalid", "test failed")
                elif op["op"] == "remove":
                    del current["metadata"][path[1]][int(path[2])]
        elif subresource == "status":
            current["status"] = body["status"]
        else:
            current["metadata"].update(body.get("metadata", {}))
        if current["metadata"].get("deletionTimestamp") and not current["metadata"].get("finalizers"):
            del self.store[(res.plural, namespace, name)]  # the API server finishes the deletion
            return current
        return self.put(res, current)


class FakeAgents:
    def __init__(self) -> None:
        self.freed: list[str] = []
        self.fail_free: Exception | None = None
        self.materialize_error: Exception | None = None

    async def free(self, endpoint, object_id, reason="", *, pod_uid):
        if self.fail_free is not None:
            raise self.fail_free
        self.freed.append(object_id)
        return FreeAnswer(freed=True, bytes=64)

    async def materialize(self, endpoint, object_id, request, *, pod_uid):
        if self.materialize_error is not None:
            raise self.materialize_error
        return MaterializeAnswer(created=True, id=object_id, bytes=64, incarnation="inc-1")


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def post(self, *, reason: str, message: str, **_) -> None:
        self.posted.append((reason, message))


def pod_body() -> dict:
    return {
        "metadata": {"namespace": NS, "name": "src", "uid": "pod-uid-1", "labels": {names.LABEL_AGENT: "true"}},
        "spec": {"containers": [{"name": "w", "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": 8471}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.5"},
    }


def object_body(name: str = "w", *, declared: bool = False) -> dict:
    spec = {"source": {"podName": "src", "podUID": "pod-uid-1"}, "tensors": [{"shape": [16], "dtype": "float32"}]}
    if not declared:
        spec["objectId"] = f"o-{name}"
    return {
        "metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}", "finalizers": [names.FINALIZER_FREE]},
        "spec": spec,
    }


def claim_body(name: str, object_name: str = "w") -> dict:
    return {"metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"}, "spec": {"objectName": object_name}}


def setup(*bodies) -> tuple[Reconciler, FakeApi, FakeAgents, Events]:
    api, agents, events = FakeApi(), FakeAgents(), Events()
    api.put(PODS, pod_body())
    for res, body in bodies:
        api.put(res, body)
    box: list[Reconciler] = []
    r = Reconciler(api, agents, OperatorMetrics(lambda: box[0].ledger), events, Settings(status_delay=0))  # type: ignore[arg-type]
    box.append(r)
    return r, api, agents, events


async def release(r: Reconciler, api: FakeApi, name: str = "w") -> list:
    """The owner's delete: the API server sets deletionTimestamp, the watch delivers it."""
    obj = api.store[("gpuobjects", NS, name)]
    obj["metadata"]["deletionTimestamp"] = "2026-12-02T04:00:00Z"
    r.on_object("MODIFIED", api.put(GPUOBJECTS, obj))
    return decide(r.ledger, "object", (NS, name), dt.datetime.now(dt.UTC))


def test_the_free_path_reads_the_claims_frees_on_the_agent_then_drops_the_finalizer() -> None:
    async def go() -> None:
        r, api, agents, events = setup((GPUOBJECTS, object_body()))
        await r.sync()
        (free,) = await release(r, api)
        assert isinstance(free, Free)
        await r.execute(free)
        assert agents.freed == ["o-w"]
        assert ("gpuobjects", NS, "w") not in api.store  # the finalizer went, so did the object
        kinds = [c for c in api.calls if c[0] != "get"]
        assert kinds[-2:] == [("list", "gpuobjectclaims", "spec.objectName=w"), ("patch", "gpuobjects", "json")]
        assert events.posted == []  # a routine free is logged and counted, not an Event (an API write)
        await r.execute(free)  # the same decision again (a duplicate work item): nothing twice
        assert agents.freed == ["o-w"]
        assert r.metrics.frees.labels("freed")._value.get() == 1

    asyncio.run(go())


def test_a_free_whose_agent_is_gone_is_announced_a_routine_one_is_not() -> None:
    """Only the free a person must notice is an Event (its bytes went with the agent, not by a free)."""

    async def go() -> None:
        r, api, agents, events = setup((GPUOBJECTS, object_body()))
        await r.sync()
        (free,) = await release(r, api)
        agents.fail_free = AgentGone("connection refused")
        await r.execute(free)
        assert ("gpuobjects", NS, "w") not in api.store
        assert [reason for reason, _ in events.posted] == ["Freed"]
        assert "is gone" in events.posted[0][1]
        assert r.metrics.frees.labels("agent-gone")._value.get() == 1

    asyncio.run(go())


def test_a_claim_the_ledger_has_not_seen_stops_the_free_and_it_is_decided_again() -> None:
    async def go() -> None:
        r, api, agents, _ = setup((GPUOBJECTS, object_body()))
        await r.sync()
        (free,) = await release(r, api)
        api.put(CLAIMS, claim_body("late"))  # made before the deletion, not yet delivered by the watch
        await r.execute(free)
        assert agents.freed == [] and ("gpuobjects", NS, "w") in api.store
        r.queue.close()  # the free was re-asked for (after a second: no claims watch to wait on)

    asyncio.run(go())


def test_a_free_whose_finalizer_removal_failed_is_not_freed_twice_on_retry() -> None:
    async def go() -> None:
        r, api, agents, _ = setup((GPUOBJECTS, object_body()))
        await r.sync()
        (free,) = await release(r, api)
        real_patch = api.patch

        async def failing_patch(*a, **kw):
            raise OSError("connection reset")

        api.patch = failing_patch  # type: ignore[method-assign]
        with pytest.raises(OSError):
            await r.execute(free)
        assert agents.freed == ["o-w"]
        api.patch = real_patch  # type: ignore[method-assign]
        await r.execute(free)  # the worker's retry
        assert agents.freed == ["o-w"] and ("gpuobjects", NS, "w") not in api.store

    asyncio.run(go())


def test_an_unreachable_agent_is_retried_and_a_refusing_one_reported() -> None:
    async def go() -> None:
        r, api, agents, events = setup((GPUOBJECTS, object_body()))
        await r.sync()
        (free,) = await release(r, api)
        agents.fail_free = AgentUnreachable("timeout")
        with pytest.raises(RetryLater):
            await r.execute(free)
        agents.fail_free = AgentError(500, "boom")
        with pytest.raises(RetryLater):
            await r.execute(free)
        assert [reason for reason, _ in events.posted] == ["FreeFailed"]
        assert ("gpuobjects", NS, "w") in api.store  # never released without its free

    asyncio.run(go())


@pytest.mark.parametrize(("status", "state", "retried"), [(404, "Pending", True), (400, "Failed", False)])
def test_after_a_materialize_error_the_status_says_what_follows(status: int, state: str, retried: bool) -> None:
    async def go() -> None:
        r, api, agents, events = setup((GPUOBJECTS, object_body(declared=True)))
        await r.sync()
        (action,) = decide(r.ledger, "object", (NS, "w"), dt.datetime.now(dt.UTC))
        assert isinstance(action, Materialize)
        agents.materialize_error = AgentError(status, "no such key")
        if retried:
            with pytest.raises(RetryLater):
                await r.execute(action)
        else:
            await r.execute(action)
        written = parse_object(api.store[("gpuobjects", NS, "w")])
        assert written.state == state
        assert [reason for reason, _ in events.posted] == ([] if retried else ["MaterializeFailed"])

    asyncio.run(go())


def test_a_declared_object_becomes_ready_with_its_bytes_and_references_in_one_status_write() -> None:
    async def go() -> None:
        r, api, _, events = setup((GPUOBJECTS, object_body(declared=True)), (CLAIMS, claim_body("reader")))
        await r.sync()
        (action,) = decide(r.ledger, "object", (NS, "w"), dt.datetime.now(dt.UTC))
        await r.execute(action)
        writes = [c for c in api.calls if c == ("patch", "gpuobjects", "status")]
        status = api.store[("gpuobjects", NS, "w")]["status"]
        assert len(writes) == 1
        assert (status["state"], status["bytes"], status["references"], status["claims"]) == ("Ready", 64, 2, 1)
        assert status["transport"]["agentIncarnation"] == "inc-1"
        assert decide(r.ledger, "object", (NS, "w"), dt.datetime.now(dt.UTC)) == []  # nothing left to write
        assert [reason for reason, _ in events.posted] == ["Materialized"]

    asyncio.run(go())


def test_a_resync_of_an_unchanged_ledger_writes_nothing() -> None:
    """Every state a record settles in (Ready with a claim, Ready alone, Releasing behind a claim, a claim
    Pending on a missing object, a declared object materialized): once its statuses are written and the
    watch has delivered them, the periodic resync (every record decided again, a minute later) writes none."""

    async def go() -> None:
        releasing = object_body("r")
        releasing["metadata"]["deletionTimestamp"] = "2026-12-02T04:00:00Z"
        r, api, _, _ = setup(
            (GPUOBJECTS, object_body("w")),
            (GPUOBJECTS, object_body("alone")),
            (GPUOBJECTS, object_body("d", declared=True)),
            (GPUOBJECTS, releasing),
            (CLAIMS, claim_body("on-w", "w")),
            (CLAIMS, claim_body("on-r", "r")),
            (CLAIMS, claim_body("on-d", "d")),
            (CLAIMS, claim_body("on-missing", "missing")),
        )
        await r.sync()
        keys = [("object", k) for k in r.ledger.objects] + [("claim", k) for k in r.ledger.claims]
        now = dt.datetime.now(dt.UTC)
        for _ in range(3):  # settle: materialize, then the statuses that follow from it
            for kind, key in keys:
                for action in decide(r.ledger, kind, key, now):
                    await r.execute(action)
        for (plural, _, _), body in list(api.store.items()):  # the watch delivers what the API server holds
            if plural == "gpuobjects":
                r.on_object("MODIFIED", copy.deepcopy(body))
            elif plural == "gpuobjectclaims":
                r.on_claim("MODIFIED", copy.deepcopy(body))
        states = {k[2]: o.get("status", {}).get("state") for k, o in api.store.items() if k[0] != "pods"}
        assert states == {
            "w": "Ready",
            "alone": "Ready",
            "d": "Ready",
            "r": "Releasing",
            "on-w": "Bound",
            "on-r": "Bound",
            "on-d": "Bound",
            "on-missing": "Pending",
        }
        writes = len([c for c in api.calls if c[0] == "patch"])
        later = now + dt.timedelta(seconds=60)
        assert {(kind, key): decide(r.ledger, kind, key, later) for kind, key in keys} == {k: [] for k in keys}
        assert len([c for c in api.calls if c[0] == "patch"]) == writes

    asyncio.run(go())


def test_a_held_status_waits_until_what_it_says_has_settled_at_most_four_delays(monkeypatch) -> None:
    """A hand-off's three writes land tenths of a second apart: the object's status is written once, after
    the last, instead of once per change; one that keeps changing is written SETTLE_CAP delays after."""
    api, agents, events = FakeApi(), FakeAgents(), Events()
    box: list[Reconciler] = []
    r = Reconciler(api, agents, OperatorMetrics(lambda: box[0].ledger), events, Settings(status_delay=0.25))  # type: ignore[arg-type]
    box.append(r)
    monkeypatch.setattr(r.queue, "add_after", lambda item, delay: None)  # decided again when due: the test asks
    now = [100.0]
    monkeypatch.setattr("gpuobj_operator.reconciler.time.monotonic", lambda: now[0])
    ready, held, releasing = ({"state": s, "claims": c} for s, c in (("Ready", 0), ("Ready", 1), ("Releasing", 1)))
    key = (NS, "w")
    assert r._status_not_due("object", key, False, ready)  # first ask: held for the delay
    now[0] += 0.1
    assert r._status_not_due("object", key, False, held)  # the claim landed
    now[0] += 0.15  # due (0.25 after the first ask), but it changed 0.15 s ago
    assert r._status_not_due("object", key, False, held)
    now[0] += 0.05
    assert r._status_not_due("object", key, False, releasing)  # the owner's delete landed
    now[0] += 0.25
    assert not r._status_not_due("object", key, False, releasing)  # settled: one write
    assert r._status_not_due("object", key, False, ready)  # a new round of asks starts afresh
    for i in range(20):  # changing every 0.125 s: written SETTLE_CAP (4) delays after the first ask all the same
        now[0] += 0.125
        if not r._status_not_due("object", key, False, held if i % 2 else ready):
            break
    assert now[0] - 100.55 == pytest.approx(4 * 0.25)
    assert not r._status_not_due("object", key, True, {"state": "Lost"})  # urgent: at once


def test_an_urgent_status_is_never_held_behind_a_settling_one(monkeypatch) -> None:
    """Lost goes at once even while a routine status of the same object is settling: the free path's
    release without a free follows it, and a Lost held back would meet a deleted object (never written,
    never counted in gpuobj_lost_objects_total; the chaos test's source-pod-delete found it)."""
    api, agents, events = FakeApi(), FakeAgents(), Events()
    box: list[Reconciler] = []
    r = Reconciler(api, agents, OperatorMetrics(lambda: box[0].ledger), events, Settings(status_delay=0.25))  # type: ignore[arg-type]
    box.append(r)
    monkeypatch.setattr(r.queue, "add_after", lambda item, delay: None)
    now = [100.0]
    monkeypatch.setattr("gpuobj_operator.reconciler.time.monotonic", lambda: now[0])
    key = (NS, "w")
    assert r._status_not_due("object", key, False, {"state": "Ready", "claims": 1})  # settling
    now[0] += 0.3  # due, and it has settled for 0.3 s; then the source goes
    assert not r._status_not_due("object", key, True, {"state": "Lost", "claims": 1})  # at once
    assert r._status_not_due("object", (NS, "v"), False, {"state": "Ready"})
    now[0] += 0.05  # the source goes 0.05 s after the first ask
    assert not r._status_not_due("object", (NS, "v"), True, {"state": "Lost"})  # at once


def test_by_default_an_object_gone_within_a_second_costs_no_status_write(monkeypatch) -> None:
    """The default status delay (1 s) holds a routine status past a lifecycle of the write window plus half
    a second (bench-scale's churn): its writes are the create, the delete and the finalizer's removal."""
    api, agents, events = FakeApi(), FakeAgents(), Events()
    box: list[Reconciler] = []
    r = Reconciler(api, agents, OperatorMetrics(lambda: box[0].ledger), events, Settings())  # type: ignore[arg-type]
    box.append(r)
    monkeypatch.setattr(r.queue, "add_after", lambda item, delay: None)
    now = [100.0]
    monkeypatch.setattr("gpuobj_operator.reconciler.time.monotonic", lambda: now[0])
    ready, key = {"state": "Ready", "claims": 0}, (NS, "short")
    assert r._status_not_due("object", key, False, ready)  # first seen
    now[0] += 0.6
    assert r._status_not_due("object", key, False, ready)  # still held when its delete lands
    now[0] += 0.4
    assert not r._status_not_due("object", key, False, ready)  # one that lives a second gets its one write
