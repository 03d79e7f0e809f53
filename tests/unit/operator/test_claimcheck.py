"""How a free re-checks claims (claimcheck.py), and the in-order informer that moves the watermark.

The real test above these: tests/e2e/operator/test_free_claim_order.py (a claim made just before
the last release keeps the bytes, against a real API server and operator).
"""

from __future__ import annotations

import asyncio

from gpuobj_kube.client import CLAIMS, Gone
from gpuobj_kube.informer import Informer
from gpuobj_operator import claimcheck
from gpuobj_operator.claimcheck import Plan, Watermark
from gpuobj_operator.model import ClaimInfo


def test_no_version_seen_means_a_consistent_read() -> None:
    assert claimcheck.plan(None, Watermark()) is Plan.LATEST
    assert claimcheck.plan("", Watermark()) is Plan.LATEST
    assert claimcheck.plan("not-a-number", Watermark()) is Plan.LATEST


def test_a_watch_behind_the_decision_means_a_read_at_exactly_its_version() -> None:
    mark = Watermark()
    assert claimcheck.plan("100", mark) is Plan.EXACT  # nothing applied yet
    mark.observe("99")
    assert claimcheck.plan("100", mark) is Plan.EXACT
    assert claimcheck.plan("100", None) is Plan.EXACT  # no in-order watch wired: always read


def test_a_watch_that_passed_the_decision_needs_no_read() -> None:
    mark = Watermark()
    mark.observe("100")
    assert claimcheck.plan("100", mark) is Plan.LEDGER  # the event at 100 itself was applied
    assert claimcheck.plan("42", mark) is Plan.LEDGER
    assert claimcheck.plan("101", mark) is Plan.EXACT


def test_the_watermark_never_moves_back_and_ignores_what_it_cannot_compare() -> None:
    mark = Watermark()
    mark.observe("200")
    mark.observe("150")  # a list after a restart at an older version cannot unsee anything
    mark.observe("garbage")
    mark.observe(None)
    assert mark.revision == 200
    assert mark.passed("200") and not mark.passed("201") and not mark.passed("x")


def test_holding_counts_every_claim_not_deleting_and_not_pinned_elsewhere() -> None:
    def c(name: str, **kw) -> ClaimInfo:
        return ClaimInfo("ns", name, f"u-{name}", object_name="w", **kw)

    claims = [c("plain"), c("pinned", object_uid="obj-1"), c("other", object_uid="obj-0"), c("gone", deleting=True)]
    assert [x.name for x in claimcheck.holding(claims, "obj-1")] == ["plain", "pinned"]
    assert claimcheck.holding([], "obj-1") == []


def test_a_read_blocks_only_with_claims_the_watch_has_not_applied_yet() -> None:
    def c(name: str, rv: str, **kw) -> ClaimInfo:
        return ClaimInfo("ns", name, f"u-{name}", object_name="w", resource_version=rv, **kw)

    read = [c("new", "120"), c("seen", "90"), c("seen-then-deleted", "95"), c("going", "130", deleting=True)]
    mark = Watermark()
    mark.observe("100")
    # "seen..." the ledger already weighed (it may know they were deleted since: a read at an older
    # version still shows them); "new" it has not: that one stops the free until the watch applies it.
    assert [x.name for x in claimcheck.blocking(read, "obj-1", mark)] == ["new"]
    assert [x.name for x in claimcheck.blocking(read, "obj-1", None)] == ["new", "seen", "seen-then-deleted"]
    assert [x.name for x in claimcheck.blocking(read, "obj-1", Watermark())] == ["new", "seen", "seen-then-deleted"]


# ------------------------------------------------------------------ the informer that moves it


def _claim(name: str, rv: str) -> dict:
    return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": rv}}


class ScriptedKube:
    """A list, then scripted watches: the wire, without the server (pure ordering logic under test)."""

    def __init__(self, listed: list[dict], list_rv: str, watches: list[list[tuple[str, dict]] | Exception]) -> None:
        self.listed, self.list_rv, self.watches = listed, list_rv, watches
        self.lists = 0
        self.watched_from: list[str | None] = []
        self.done = asyncio.Event()

    async def list(self, res, namespace=None, **_) -> dict:
        self.lists += 1
        return {"items": list(self.listed), "metadata": {"resourceVersion": self.list_rv}}

    async def watch(self, res, namespace=None, *, resource_version=None, **_):
        self.watched_from.append(resource_version)
        if not self.watches:
            self.done.set()
            await asyncio.Event().wait()  # an idle watch, until the informer stops
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        for event in script:
            yield event


def _informer(kube: ScriptedKube, handler) -> Informer:
    """The claims informer as the operator wires it: its progress moves a Watermark (kept on it here)."""
    mark = Watermark()
    informer = Informer(kube, CLAIMS, handler, on_progress=mark.observe, backoff=(0.0, 0.0))  # type: ignore[arg-type]
    informer.watermark = mark  # type: ignore[attr-defined]
    return informer


def _run(kube: ScriptedKube, handler) -> Informer:
    async def go() -> Informer:
        informer = _informer(kube, handler)
        informer.start()
        await asyncio.wait_for(kube.done.wait(), timeout=5)
        await informer.stop()
        return informer

    return asyncio.run(go())


def test_the_watermark_moves_only_once_each_event_was_handled_in_order() -> None:
    marks_at_handling: list[tuple[str | None, str, int | None]] = []
    informer_box: list[Informer] = []

    def handler(kind: str | None, obj: dict) -> None:
        mark = informer_box[0].watermark.revision  # type: ignore[attr-defined] if informer_box else None
        marks_at_handling.append((kind, obj["metadata"]["resourceVersion"], mark))

    kube = ScriptedKube(
        [_claim("a", "5")],
        "10",
        [
            [
                ("ADDED", _claim("b", "11")),
                ("BOOKMARK", {"metadata": {"resourceVersion": "15"}}),
                ("DELETED", _claim("a", "16")),
            ]
        ],
    )

    async def go() -> Informer:
        informer = _informer(kube, handler)
        informer_box.append(informer)
        informer.start()
        await asyncio.wait_for(kube.done.wait(), timeout=5)
        await informer.stop()
        return informer

    informer = asyncio.run(go())
    # Each event is handled while the watermark is still below it; the bookmark moved it without a call.
    assert marks_at_handling == [(None, "5", None), ("ADDED", "11", 10), ("DELETED", "16", 15)]
    assert informer.watermark.revision == 16
    assert kube.watched_from == ["10", "16"]


def test_a_handler_that_fails_makes_the_informer_list_again_and_never_skip_the_event() -> None:
    seen: list[tuple[str | None, str]] = []
    fail_once = [True]

    def handler(kind: str | None, obj: dict) -> None:
        if kind == "ADDED" and fail_once[0]:
            fail_once[0] = False
            raise RuntimeError("bug while applying")
        seen.append((kind, obj["metadata"]["name"]))

    kube = ScriptedKube([], "10", [[("ADDED", _claim("b", "11"))]])
    informer = _run(kube, handler)
    # Listed again after the failure (the list now stands for the event that was not applied), and the
    # watermark never passed the event at 11 that the ledger did not get.
    assert seen == []
    assert kube.lists == 2
    assert informer.watermark.revision == 10
    assert kube.watched_from == ["10", "10"]


def test_seeded_claims_missing_from_the_first_list_are_reported_deleted() -> None:
    seen: list[tuple[str | None, str]] = []
    kube = ScriptedKube([_claim("kept", "7")], "10", [])
    informer = _informer(kube, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))
    informer.seed([_claim("kept", "7"), _claim("gone-meanwhile", "8")])

    async def go() -> None:
        informer.start()
        await asyncio.wait_for(kube.done.wait(), timeout=5)
        await informer.stop()

    asyncio.run(go())
    assert seen == [(None, "kept"), ("DELETED", "gone-meanwhile")]


def test_a_gone_watch_lists_again_from_scratch() -> None:
    seen: list[tuple[str | None, str]] = []
    kube = ScriptedKube([_claim("a", "5")], "10", [Gone(410, "Expired", "too old")])
    informer = _run(kube, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))
    assert kube.lists == 2 and informer.watermark.revision == 10
    assert seen == [(None, "a"), (None, "a")]


def test_waiting_for_the_watermark_ends_once_it_passed_and_never_on_an_unparsable_version() -> None:
    async def go() -> tuple[bool, bool, bool, bool]:
        mark = Watermark()
        mark.observe("10")
        already = mark.reached("10").done()
        later = mark.reached("12")
        never = mark.reached("x")
        abandoned = mark.reached("11")
        abandoned.cancel()
        mark.observe("11")
        early = later.done()
        mark.observe("12")
        return already, early, later.done(), never.done()

    assert asyncio.run(go()) == (True, False, True, False)


def test_the_read_delay_goes_once_reads_answer_fast_and_comes_back_when_they_slow() -> None:
    delay = claimcheck.ReadDelay(0.005, fast=0.010, window=8, least=4)
    assert delay.seconds == 0.005  # nothing known: wait for the watch first
    for _ in range(3):
        delay.observe(0.002)
    assert delay.seconds == 0.005  # too few reads to judge
    delay.observe(0.002)
    assert delay.seconds == 0.0  # reads answer fast (no claims watch cache): read at once
    for _ in range(5):
        delay.observe(0.070)  # a watch cache again: reads wait for it
    assert delay.seconds == 0.005
