"""The fleet's write budget: the share each agent is told on its probes, and a new agent probed at once.

Pure and with stand-ins here; tests/e2e/scale/test_scale.py checks that a real operator's probes reach a
fleet of real agents' write-behinds, and bench/scale.py measures what the budget does at 1,000 pods."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from gpuobj_contract.agent_api import AgentInfo
from gpuobj_kube.client import PODS
from gpuobj_operator.agent_client import AgentGone
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.settings import Settings
from gpuobj_operator.shards import Shard
from gpuobj_operator.write_budget import write_share
from tests.unit.operator.test_executors import NS, FakeAgents, FakeApi, pod_body


def test_the_budget_is_split_between_the_shards_then_between_each_ones_agents() -> None:
    assert write_share(0.0, 1000) == 0.0  # no budget: every agent is told 0 (none)
    assert write_share(200.0, 1000) == pytest.approx(0.2)
    assert write_share(200.0, 1000, shards=2) == pytest.approx(0.1)
    assert write_share(200.0, 0) == 200.0  # before any agent: the whole budget (nobody to tell)


class ProbedAgents(FakeAgents):
    def __init__(self, expect: int = 0) -> None:
        super().__init__()
        self.told: dict[str, float | None] = {}
        self.expect = expect
        self.all_told = asyncio.Event()

    async def info(self, endpoint, *, pod_uid, timeout=None, write_rate=None):
        self.told[pod_uid] = write_rate
        if len(self.told) >= self.expect:
            self.all_told.set()
        return AgentInfo(pod="", namespace=NS, pod_uid=pod_uid, incarnation=f"inc-{pod_uid}")


def reconciler(budget: float, pods: int, shards: int = 1) -> tuple[Reconciler, ProbedAgents, FakeApi]:
    api, agents = FakeApi(), ProbedAgents(pods)
    for i in range(pods):
        body = copy.deepcopy(pod_body())
        body["metadata"].update(name=f"p{i}", uid=f"uid-p{i}")
        api.put(PODS, body)
    settings = Settings(fleet_write_budget=budget, shard=Shard(shards, 0))
    box: list[Reconciler] = []
    r = Reconciler(api, agents, OperatorMetrics(lambda: box[0].ledger), None, settings)  # type: ignore[arg-type]
    box.append(r)
    return r, agents, api


async def probe_until(r: Reconciler, done: asyncio.Event, timeout: float) -> None:
    """Run the operator's prober until ``done`` is set (at most ``timeout`` s), then stop it."""
    task = asyncio.create_task(r.prober.run())
    try:
        async with asyncio.timeout(timeout):
            await done.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(("budget", "told"), [(100.0, 25.0), (0.0, 0.0)])
def test_every_probe_tells_the_agent_its_share_and_no_budget_is_told_as_0(budget: float, told: float) -> None:
    async def go() -> None:
        r, agents, _ = reconciler(budget, 4)
        await r.sync()
        await probe_until(r, agents.all_told, 10)
        assert agents.told == {f"uid-p{i}": told for i in range(4)}

    asyncio.run(go())


@pytest.mark.parametrize("budget", [50.0, 0.0])
def test_a_new_agent_pod_is_probed_at_once_only_with_a_budget(budget: float) -> None:
    async def go() -> None:
        r, _, api = reconciler(budget, 1)
        await r.sync()
        body = copy.deepcopy(pod_body())
        body["metadata"].update(name="new", uid="uid-new")
        r.on_pod("ADDED", api.put(PODS, body))
        asked = (NS, "new") in r.prober._probe_asked
        assert asked == (budget > 0)
        r.prober.forget((NS, "new"))
        r.on_pod("MODIFIED", api.put(PODS, body))  # a pod already known is not new
        assert (NS, "new") not in r.prober._probe_asked

    asyncio.run(go())


def test_a_new_agent_pods_first_event_still_records_its_container_run() -> None:
    """The first event that gives a pod an address also carries its first container run: the liveness
    must see that run, or the next restart would look like a first start and wait for a backstop probe."""

    async def go() -> None:
        r, _, api = reconciler(50.0, 1)
        await r.sync()
        body = copy.deepcopy(pod_body())
        body["metadata"].update(name="new", uid="uid-new")
        status = {"name": "w", "restartCount": 0, "containerID": "containerd://a", "state": {"running": {}}}
        body["status"]["containerStatuses"] = [status]
        r.on_pod("ADDED", api.put(PODS, body))
        assert (NS, "new") in r.ledger.liveness.containers
        r.prober.forget((NS, "new"))
        restarted = copy.deepcopy(body)
        restarted["status"]["containerStatuses"] = [{**status, "restartCount": 1, "containerID": "containerd://b"}]
        r.on_pod("MODIFIED", api.put(PODS, restarted))
        assert (NS, "new") in r.prober._probe_asked  # the restart was seen as one: probed at once

    asyncio.run(go())


class RestartingAgents(ProbedAgents):
    """An agent whose new process listens only after two probes were refused (the kubelet reported the
    restart first)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.refused = 0
        self.answered_new = asyncio.Event()

    async def info(self, endpoint, *, pod_uid, timeout=None, write_rate=None):
        if self.refused < 2:
            self.refused += 1
            raise AgentGone("connection refused")
        self.answered_new.set()
        return AgentInfo(pod="", namespace=NS, pod_uid=pod_uid, incarnation="inc-new")


def test_a_restarted_agent_refused_at_first_is_probed_again_until_its_new_process_answers() -> None:
    """A probe asked for at a restart may find nothing listening yet: the refusal (confirmed or not) keeps
    the pod asked for, probed every ASKED_PROBE_GAP, not dropped to the backstop interval (40 s once gone)."""

    async def go() -> None:
        r, _, _ = reconciler(0.0, 1)
        agents = RestartingAgents()
        r.prober.agents = agents  # type: ignore[assignment]
        await r.sync()
        key = (NS, "p0")
        r.ledger.liveness.observe_alive(key, "uid-p0", "inc-old", 0.0)
        r.prober._probe_due[key] = time.monotonic() + 1000  # probed a moment ago: next backstop far off
        r.prober.probe_soon(key)
        await probe_until(r, agents.answered_new, 5)
        assert agents.refused == 2 and r.ledger.liveness.agents[key].incarnation == "inc-new"

    asyncio.run(go())
