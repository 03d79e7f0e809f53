"""The sync's four lists seed the operator's four informers: each watches from its own list's version
(nothing after the sync is missed: an object deleted in between arrives as DELETED and leaves the
ledger), and what they remember of the listed objects is their identity, never the bodies.

A scripted API (pure logic: the intake and the ledger are real); tests/e2e/operator/test_informer.py
drives the informer against a real API server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS
from gpuobj_operator.claimcheck import Watermark
from gpuobj_operator.expectations import Expectations
from gpuobj_operator.intake import Intake
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.main import build_informers
from gpuobj_operator.prober import Prober
from gpuobj_operator.settings import Settings

NS = "ml"


def meta(name: str, rv: str) -> dict:
    return {"namespace": NS, "name": name, "uid": f"u-{name}", "resourceVersion": rv}


LISTS = {
    STREAMS.plural: ("11", [{"metadata": meta("s", "3"), "spec": {"producer": {"podName": "p"}}}]),
    CLAIMS.plural: ("12", [{"metadata": meta("c", "4"), "spec": {"objectName": "o1", "holder": {"podName": "p"}}}]),
    PODS.plural: ("13", [{"metadata": meta("p", "5"), "status": {"phase": "Running", "podIP": "10.0.0.1"}}]),
    GPUOBJECTS.plural: (
        "14",
        [
            {
                "metadata": meta(name, "6"),
                "spec": {"source": {"podName": "p"}, "tensors": [{"shape": [4], "dtype": "float32"}]},
                "status": {"state": "Ready", "bytes": 16},
            }
            for name in ("o1", "o2")
        ],
    ),
}


class ScriptedKube:
    """Answers the sync's lists; each watch delivers what `events` scripts for its kind, then stays quiet."""

    def __init__(self, events: dict[str, list[tuple[str, dict]]]) -> None:
        self.events = events
        self.lists: list[str] = []
        self.limits: set[int | None] = set()
        self.watched: dict[str, str | None] = {}
        self.all_watching = asyncio.Event()

    async def list_pages(self, res, namespace=None, *, limit=None, **_):
        """The sync's lists, one item per page (as a page limit would cut them): each page is applied."""
        self.lists.append(res.plural)
        self.limits.add(limit)
        rv, items = LISTS[res.plural]
        for item in items:
            yield {"items": [item], "metadata": {"resourceVersion": rv}}

    async def watch(self, res, namespace=None, *, resource_version=None, **_):
        self.watched[res.plural] = resource_version
        if len(self.watched) == len(LISTS):
            self.all_watching.set()
        for event in self.events.pop(res.plural, []):
            yield event
        await asyncio.Event().wait()


def test_the_sync_seeds_every_informer_and_a_deletion_in_between_arrives() -> None:
    gone = {"metadata": meta("o2", "20"), "spec": {"source": {"podName": "p"}, "tensors": []}}
    kube = ScriptedKube({GPUOBJECTS.plural: [("DELETED", gone)]})
    ledger = Ledger()

    async def go() -> dict[str, tuple[str, list[dict]]]:
        settings = Settings(namespace=NS)
        prober = Prober(ledger, None, lambda keys: None, settings)  # type: ignore[arg-type]
        intake = Intake(ledger, kube, Expectations(), prober, settings, lambda *a, **k: None, lambda: None)  # type: ignore[arg-type]
        await intake.sync()
        listed = dict(intake.listed)
        assert ledger.synced and set(ledger.objects) == {(NS, "o1"), (NS, "o2")}
        deleted = asyncio.Event()

        def on_object(kind: str | None, raw: dict) -> None:
            intake.on_object(kind, raw)
            if kind == "DELETED":
                deleted.set()

        handlers = SimpleNamespace(
            on_object=on_object, on_stream=intake.on_stream, on_pod=intake.on_pod, on_claim=intake.on_claim
        )
        informers = build_informers(kube, handlers, NS, Watermark())  # type: ignore[arg-type]
        assert set(informers) == set(listed)  # one informer per list of the sync, no more, no fewer
        for kind, informer in informers.items():
            informer.seed(*reversed(listed[kind]))  # type: ignore[arg-type]
            informer.start()
        async with asyncio.timeout(10):
            await asyncio.gather(deleted.wait(), kube.all_watching.wait())
        for informer in informers.values():
            await informer.stop()
        return listed

    listed = asyncio.run(go())
    # Each watch starts at its own list's version: no list of their own, nothing after the sync missed.
    assert kube.lists == [STREAMS.plural, CLAIMS.plural, PODS.plural, GPUOBJECTS.plural]
    assert None not in kube.limits  # paged: the operator never holds a whole list's bodies
    assert kube.watched == {plural: rv for plural, (rv, _) in LISTS.items()}
    assert set(ledger.objects) == {(NS, "o1")}  # the deletion between the sync and the watch arrived
    # Identities only: no spec (but a claim's objectName), no status, no resourceVersion kept.
    for _, identities in listed.values():
        for kept in identities:
            assert set(kept["metadata"]) == {"namespace", "name", "uid"}
            assert "status" not in kept and set(kept.get("spec", {})) <= {"objectName"}


def test_a_deletion_that_carries_only_the_identity_leaves_the_ledger() -> None:
    """A relist reports what vanished by the identity the informer kept (no spec): the typed parse of a
    GPUObject or stream body would refuse that, so a deletion goes by the ledger's own record."""
    ledger = Ledger()

    async def go() -> None:
        settings = Settings(namespace=NS)
        prober = Prober(ledger, None, lambda keys: None, settings)  # type: ignore[arg-type]
        intake = Intake(ledger, ScriptedKube({}), Expectations(), prober, settings, lambda *a, **k: None, lambda: None)  # type: ignore[arg-type]
        await intake.sync()
        assert (NS, "o2") in ledger.objects and (NS, "s") in ledger.streams
        intake.on_object("DELETED", {"metadata": {"namespace": NS, "name": "o2", "uid": "u-o2"}})
        intake.on_stream("DELETED", {"metadata": {"namespace": NS, "name": "s", "uid": "u-s"}})
        intake.on_object("DELETED", {"metadata": {"namespace": NS, "name": "o1", "uid": "an-older-o1"}})

    asyncio.run(go())
    assert set(ledger.objects) == {(NS, "o1")}, "a deletion of another uid under the same name changes nothing"
    assert ledger.streams == {}
