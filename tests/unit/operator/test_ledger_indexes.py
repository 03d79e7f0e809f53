"""The ledger's indexes say exactly what its records imply, whatever sequence of updates came.

Why: every per-event decision reads an index instead of scanning a pod's objects (issue: a burst
of releases of one pod cost O(n^2)); an index that drifts from the records decides wrongly. A seeded
random walk of adds, updates (a new source pod, incarnation, stream, deletion), removals and
replacements by a new uid, checked against indexes rebuilt from scratch after every step.
"""

from __future__ import annotations

import random

from gpuobj_operator.ledger import Ledger, StreamTally
from gpuobj_operator.model import ClaimInfo, ObjectInfo, PodInfo, StreamInfo

NS = ("ml", "prod")
PODS = ("a", "b", "c")


def _rebuilt(ledger: Ledger) -> dict:
    by_pod: dict = {}
    by_id: dict = {}
    by_incarnation: dict = {}
    by_stream: dict = {}
    tallies: dict = {}
    for key, o in ledger.objects.items():
        by_pod.setdefault((o.namespace, o.source_pod), set()).add(key)
        by_id.setdefault((o.namespace, o.source_pod, o.object_id), set()).add(key)
        by_incarnation.setdefault((o.namespace, o.source_pod), {}).setdefault(o.source_incarnation, set()).add(key)
        if o.stream:
            by_stream.setdefault((o.namespace, o.stream[0]), set()).add(key)
    for stream in set(by_stream) | set(ledger.streams):
        tally = StreamTally()
        for key in by_stream.get(stream, ()):
            tally.add(ledger.objects[key], +1)
        tallies[stream] = tally
    claims_by_object: dict = {}
    claims_by_pod: dict = {}
    for key, c in ledger.claims.items():
        claims_by_object.setdefault(c.object_key, set()).add(key)
        for pod in {*c.owner_pods, *([c.holder_pod] if c.holder_pod else [])}:
            claims_by_pod.setdefault((c.namespace, pod), set()).add(key)
    producers: dict = {}
    for key, s in ledger.streams.items():
        producers.setdefault((s.namespace, s.producer_pod), set()).add(key)
    return {
        "_objects_by_pod": by_pod,
        "_objects_by_id": by_id,
        "_objects_by_incarnation": by_incarnation,
        "_items_by_stream": by_stream,
        "_claims_by_object": claims_by_object,
        "_claims_by_pod": claims_by_pod,
        "_streams_by_producer": producers,
        "stream_tallies": tallies,
    }


def _assert_consistent(ledger: Ledger, step: int) -> None:
    want = _rebuilt(ledger)
    for name, index in want.items():
        got = getattr(ledger, name)
        if name == "stream_tallies":
            # The highest index ever seen stays (emitted never decreases); counts follow the items.
            got = {k: (t.live_items, t.live_bytes) for k, t in got.items()}
            index = {k: (t.live_items, t.live_bytes) for k, t in index.items()}
        assert got == index, f"step {step}: {name} drifted"


def _object(rng: random.Random, name: str, uid: str) -> ObjectInfo:
    ns = rng.choice(NS)
    return ObjectInfo(
        ns,
        name,
        uid,
        source_pod=rng.choice(PODS),
        tensors=[{"shape": [rng.randint(1, 4)], "dtype": "float32"}],
        spec_object_id=rng.choice([f"o-{name}", "o-shared"]),  # sometimes two name the same bytes
        spec_incarnation=rng.choice([None, "i-1", "i-2"]),
        stream=rng.choice([None, ("s", rng.randint(0, 5))]),
        deleting=rng.random() < 0.3,
        finalized=True,
        resource_version=str(rng.randint(1, 10**6)),
    )


def test_indexes_match_the_records_after_every_add_update_replace_and_delete() -> None:
    rng = random.Random(18)
    ledger = Ledger()
    uids: dict[str, int] = {}
    for step in range(4000):
        name = f"w{rng.randint(0, 30)}"
        op = rng.random()
        if op < 0.45:  # add or update (same uid), or replace (a new uid under the same name)
            gen = uids.setdefault(name, 0) + (1 if rng.random() < 0.1 else 0)
            uids[name] = gen
            o = _object(rng, name, f"{name}-{gen}")
            o.resource_version = ""  # never "older": every update applies
            ledger.upsert_object(o, float(step))
        elif op < 0.6:
            current = [o for o in ledger.objects.values() if o.name == name]
            if current:
                ledger.remove_object(current[0])
        elif op < 0.8:
            c = ClaimInfo(
                rng.choice(NS),
                f"c{rng.randint(0, 20)}",
                "c-uid",
                object_name=name,
                holder_pod=rng.choice([None, *PODS]),
                owner_pods={rng.choice(PODS): "p-uid"} if rng.random() < 0.5 else {},
            )
            if rng.random() < 0.7:
                ledger.upsert_claim(c, float(step))
            else:
                ledger.remove_claim(c, float(step))
        elif op < 0.9:
            s = StreamInfo(rng.choice(NS), "s", "s-uid", producer_pod=rng.choice(PODS))
            if rng.random() < 0.7:
                ledger.upsert_stream(s)
            else:
                ledger.remove_stream(s)
        else:
            p = PodInfo(rng.choice(NS), rng.choice(PODS), "p-uid", phase="Running", endpoint="10.0.0.1:8471")
            ledger.upsert_pod(p) if rng.random() < 0.7 else ledger.remove_pod(p)
        _assert_consistent(ledger, step)
    assert ledger.objects and ledger.claims  # the walk really exercised the indexes


def test_siblings_and_suspects_come_from_the_indexes() -> None:
    ledger = Ledger()
    a = ObjectInfo("ml", "a", "u-a", source_pod="src", tensors=[], spec_object_id="o-1", spec_incarnation="i-1")
    copy = ObjectInfo("ml", "copy", "u-c", source_pod="src", tensors=[], spec_object_id="o-1", spec_incarnation="i-2")
    other = ObjectInfo("ml", "b", "u-b", source_pod="src", tensors=[], spec_object_id="o-2", spec_incarnation="i-2")
    for o in (a, copy, other):
        ledger.upsert_object(o, 0.0)
    assert [o.name for o in ledger.siblings(a)] == ["copy"] and ledger.siblings(other) == []
    assert ledger.describes("ml", "src", "o-2") and not ledger.describes("ml", "other-pod", "o-2")
    ledger.liveness.observe_alive(("ml", "src"), "p-uid", "i-2", 1.0)
    assert ledger.suspect_records(("ml", "src")) == {("object", ("ml", "a"))}  # i-2's own records are not suspect
    ledger.remove_object(copy)
    assert ledger.siblings(a) == []
    # A pod event that changes nothing a decision reads dirties nothing.
    pod = PodInfo("ml", "src", "p-uid", phase="Running", endpoint="10.0.0.1:8471")
    assert ledger.upsert_pod(pod) == {("object", ("ml", "a")), ("object", ("ml", "b"))}
    assert ledger.upsert_pod(PodInfo("ml", "src", "p-uid", phase="Running", endpoint="10.0.0.1:8471")) == set()
