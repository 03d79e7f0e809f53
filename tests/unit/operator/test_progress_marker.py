"""When the operator writes its claims progress marker (progress_marker.py), driven by a fake write.

The real tests above these: tests/e2e/operator/test_progress_marker.py (an owner-last free, on an API
server with its claims watch cache, learns every claim through the marker and reads none; the marker
never shows in a person's `kubectl get gpuobj` of the workloads' namespace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gpuobj_kube.client import ApiError
from gpuobj_operator.claimcheck import Watermark
from gpuobj_operator.flags import build_parser, progress_marker_namespace
from gpuobj_operator.main import main
from gpuobj_operator.progress_marker import MarkerMisconfigured, ProgressMarker, marker_manifest, marker_namespace

WAIT = 5.0  # seconds: every wait in these tests ends long before, or the test fails


class FakeApi:
    """A write that takes the next etcd revision, and a watch that delivers it when told to."""

    def __init__(self, watermark: Watermark, revision: int) -> None:
        self.watermark = watermark
        self.revision = revision
        self.writes: list[int] = []
        self.gate: asyncio.Event | None = None  # set: writes wait for it (a write under way)
        self.failures = 0
        self.results: list[int] = []  # preset versions for the next writes (else the next revision)
        self.written = asyncio.Event()

    async def write(self) -> int:
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), WAIT)
        if self.failures:
            self.failures -= 1
            raise ApiError(403, "Forbidden", "cannot create gpuobjectclaims")
        self.revision = self.results.pop(0) if self.results else self.revision + 1
        self.writes.append(self.revision)
        self.written.set()
        return self.revision

    def deliver(self) -> None:
        """The claims watch delivers everything written so far."""
        self.watermark.observe(str(self.revision))


def run(scenario: Callable[[ProgressMarker, FakeApi, Watermark], Awaitable[None]], **kwargs: float) -> list[str]:
    outcomes: list[str] = []

    async def go() -> None:
        mark = Watermark()
        mark.observe("100")
        api = FakeApi(mark, 100)
        marker = ProgressMarker(
            mark, api.write, on_write=lambda ok: outcomes.append("ok" if ok else "failed"), **kwargs
        )
        task = asyncio.create_task(marker.run())
        try:
            await scenario(marker, api, mark)
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(asyncio.wait_for(go(), WAIT * 2))
    return outcomes


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_no_write_while_the_watch_has_passed_the_version_on_its_own() -> None:
    async def scenario(marker: ProgressMarker, api: FakeApi, mark: Watermark) -> None:
        marker.request("90")
        marker.request("100")
        marker.request("not-a-version")
        await settle()
        assert api.writes == []

    assert run(scenario) == []


def test_one_write_serves_every_free_waiting_when_it_is_made() -> None:
    async def scenario(marker: ProgressMarker, api: FakeApi, mark: Watermark) -> None:
        api.revision = 110  # deletions at 105..110 happened meanwhile; the watch is at 100
        for rv in ("105", "108", "110"):
            marker.request(rv)
        await asyncio.wait_for(api.written.wait(), WAIT)
        await settle()
        assert api.writes == [111]
        api.deliver()
        reached = mark.reached("110")
        await asyncio.wait_for(reached, WAIT)
        marker.request("110")  # asked again after the watch passed: nothing to write
        await settle()
        assert api.writes == [111]

    assert run(scenario) == ["ok"]


def test_a_free_asking_during_a_write_for_a_newer_version_gets_the_next_write() -> None:
    async def scenario(marker: ProgressMarker, api: FakeApi, mark: Watermark) -> None:
        api.gate = asyncio.Event()
        api.results = [105, 121]  # the first write lands before the deletion at 120, the next after it
        marker.request("104")
        await settle()  # the write is under way
        marker.request("120")
        api.gate.set()
        while len(api.writes) < 2:
            api.written.clear()
            await asyncio.wait_for(api.written.wait(), WAIT)
        api.deliver()
        await asyncio.wait_for(mark.reached("120"), WAIT)
        await settle()
        assert api.writes == [105, 121]

    assert run(scenario) == ["ok", "ok"]


def test_a_request_older_than_the_write_under_way_needs_no_second_write() -> None:
    async def scenario(marker: ProgressMarker, api: FakeApi, mark: Watermark) -> None:
        api.gate = asyncio.Event()
        api.revision = 104
        marker.request("104")
        await settle()
        marker.request("103")
        api.gate.set()
        await asyncio.wait_for(api.written.wait(), WAIT)
        await settle()
        assert api.writes == [105]

    assert run(scenario) == ["ok"]


def test_a_failed_write_is_counted_and_tried_again_until_it_lands() -> None:
    async def scenario(marker: ProgressMarker, api: FakeApi, mark: Watermark) -> None:
        api.failures = 2
        api.revision = 101
        marker.request("101")
        await asyncio.wait_for(api.written.wait(), WAIT)
        assert api.writes == [102]

    assert run(scenario, retry_min=0.001, retry_max=0.002) == ["failed", "failed", "ok"]


def test_the_marker_is_a_claim_of_its_own_name_with_no_holder() -> None:
    manifest = marker_manifest("gpuobj-claims-progress", {"gpuobj.io/progress": "1"})
    assert manifest["kind"] == "GPUObjectClaim"
    assert manifest["spec"] == {"objectName": "gpuobj-claims-progress"}
    assert manifest["metadata"]["annotations"] == {"gpuobj.io/progress": "1"}


def test_frees_asking_during_the_pause_after_a_write_share_the_next_write() -> None:
    """A burst of owner-last frees costs one write per pause, not one per free (docs/scale.md, writes)."""

    async def scenario(marker: ProgressMarker, api: FakeApi, mark: Watermark) -> None:
        api.revision = 101
        marker.request("101")
        await asyncio.wait_for(api.written.wait(), WAIT)
        assert api.writes == [102]
        api.written.clear()
        api.deliver()
        for rv in range(103, 123):  # twenty frees inside the pause that follows the write
            api.revision = rv
            marker.request(str(rv))
        await asyncio.wait_for(api.written.wait(), WAIT)
        await settle()
        assert api.writes == [102, 123]  # one write for all twenty, newer than every deletion
        api.deliver()
        await asyncio.wait_for(mark.reached("122"), WAIT)

    assert run(scenario, spacing=0.3) == ["ok", "ok"]


def test_the_marker_lives_in_the_operators_namespace_and_only_with_a_watch_of_every_namespace() -> None:
    assert marker_namespace(None, "gpuobj-system", None) == "gpuobj-system"
    assert marker_namespace(None, "gpuobj-system", True) == "gpuobj-system"
    assert marker_namespace(None, "gpuobj-system", False) is None
    # Watching one namespace: never a claim of the operator's among the users' (they read instead).
    assert marker_namespace("ml", "gpuobj-system", None) is None
    assert marker_namespace("ml", "ml", False) is None
    with pytest.raises(MarkerMisconfigured, match="kubectl get gpuobj"):
        marker_namespace("ml", "gpuobj-system", True)


def test_the_operator_refuses_a_marker_with_a_watch_of_one_namespace_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--namespace", "ml", "--claims-progress-marker"])
    assert exited.value.code == 2
    assert "kubectl get gpuobj" in capsys.readouterr().err
    assert progress_marker_namespace(build_parser().parse_args(["--namespace", "ml"])) is None
    everywhere = build_parser().parse_args(["--lease-namespace", "gpuobj-system"])
    assert progress_marker_namespace(everywhere) == "gpuobj-system"
