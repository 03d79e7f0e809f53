"""Nothing of a record the operator forgot comes back: a late answer or a late write for a deleted pod,
stream or object leaves no state behind (issue 32). Expectations are pure; the prober runs with the
executors' fake API and a fake agent whose answer is held until the pod is gone."""

from __future__ import annotations

import asyncio

import pytest

from gpuobj_contract.agent_api import AgentInfo
from gpuobj_kube.client import STREAMS
from gpuobj_operator.agent_client import AgentError, AgentGone, AgentUnreachable
from gpuobj_operator.expectations import STALE_DUE, Expectations
from tests.unit.operator.test_executors import NS, setup
from tests.unit.operator.test_intake import stream_body

SRC = (NS, "src")


def test_a_streams_last_write_is_forgotten_once_its_interval_is_over_even_if_noted_after_its_deletion() -> None:
    """Before, every stream ever written stayed in stream_written_at, and a worker that wrote a stream's
    counters just after the watch reported it deleted noted it again for good (it failed so)."""
    e = Expectations()
    assert e.stream_wait((NS, "a"), interval=1.0, now=0.0) == 0.0
    e.stream_gone((NS, "a"))
    assert e.stream_written_at == {}
    assert e.stream_wait((NS, "a"), interval=1.0, now=0.1) == 0.0  # a worker still on the deleted stream
    assert e.stream_wait((NS, "b"), interval=1.0, now=5.0) == 0.0  # any later write forgets it
    assert list(e.stream_written_at) == [(NS, "b")]
    assert e.stream_wait((NS, "b"), interval=1.0, now=5.5) == pytest.approx(0.5)  # the limit still holds
    assert e.stream_wait((NS, "b"), interval=1.0, now=6.0) == 0.0


def test_a_status_write_held_for_a_record_that_went_is_forgotten_long_past_its_due_time() -> None:
    e = Expectations()
    assert e.status_wait("object", (NS, "w"), urgent=False, delay=0.25, now=0.0) == pytest.approx(0.25)
    e.object_gone("uid-w", (NS, "w"))
    e.status_wait("object", (NS, "w"), urgent=False, delay=0.25, now=0.1)  # a worker still on the gone object
    assert e.status_wait("claim", (NS, "c"), urgent=False, delay=0.25, now=STALE_DUE + 1) > 0
    assert list(e.status_due) == [("claim", (NS, "c"))]
    assert e.status_wait("claim", (NS, "c"), urgent=False, delay=0.25, now=STALE_DUE + 2) == 0.0
    assert e.status_due == {}


def test_the_intake_forgets_a_deleted_streams_last_write() -> None:
    async def go() -> None:
        r, api, _, _ = setup((STREAMS, stream_body()))
        await r.sync()
        r.expected.stream_wait((NS, "s"), interval=1.0, now=0.0)
        r.on_stream("DELETED", api.store[("gpuobjectstreams", NS, "s")])
        assert r.expected.stream_written_at == {}

    asyncio.run(go())


@pytest.mark.parametrize(
    "answer",
    [
        AgentGone("connection refused"),
        AgentError(409, "another pod's agent"),
        AgentUnreachable("timed out"),
        AgentInfo(pod="src", namespace=NS, pod_uid="pod-uid-1", incarnation="s-1"),
    ],
    ids=["refused", "another-pod", "unreachable", "alive"],
)
def test_a_probe_answered_after_its_pod_was_deleted_makes_nothing_of_the_pod_again(answer: object) -> None:
    """Before, the answer of a probe in flight when the pod's DELETED came made the pod's liveness state
    and its probe schedule again, for good (it failed so for every answer)."""

    async def go() -> None:
        r, api, agents, _ = setup()
        await r.sync()
        asked, release = asyncio.Event(), asyncio.Event()

        async def info(endpoint: str, *, pod_uid: str, timeout: float | None = None, **_: object) -> AgentInfo:
            asked.set()
            await release.wait()
            if isinstance(answer, Exception):
                raise answer
            assert isinstance(answer, AgentInfo)
            return answer

        agents.info = info  # type: ignore[attr-defined]
        probe = asyncio.create_task(r.prober.probe(r.ledger.pods[SRC]))
        await asyncio.wait_for(asked.wait(), timeout=5)
        r.on_pod("DELETED", api.store[("pods", NS, "src")])
        release.set()
        await asyncio.wait_for(probe, timeout=5)
        assert SRC not in r.ledger.liveness.agents and SRC not in r.ledger.liveness.containers
        assert SRC not in r.prober._probe_due and SRC not in r.prober._probe_started

    asyncio.run(go())


def test_a_probe_of_a_live_pod_still_records_its_answer() -> None:
    async def go() -> None:
        r, _, agents, _ = setup()
        await r.sync()

        async def info(endpoint: str, *, pod_uid: str, timeout: float | None = None, **_: object) -> AgentInfo:
            return AgentInfo(pod="src", namespace=NS, pod_uid="pod-uid-1", incarnation="s-1")

        agents.info = info  # type: ignore[attr-defined]
        await r.prober.probe(r.ledger.pods[SRC])
        assert r.ledger.liveness.agents[SRC].incarnation == "s-1" and SRC in r.prober._probe_due

    asyncio.run(go())
