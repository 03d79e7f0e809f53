"""The workload process runs one event loop: the client core runs on the embedded agent's.

Before, `gpuobj.Client` ran its core on a loop thread of its own ("gpuobj-client") next to the agent's
("gpuobj-agent"), so a put crossed two loops and the store was written from two threads. Here a real
client (`Client.connect`: the embedded agent, real NIXL, real control server) puts, fetches (from a
workload thread and from an asyncio workload's own loop) and releases, and the process has exactly one
running gpuobj loop, the agent's, on which the core and its release worker run. `close` ends the core's
tasks on that loop before the agent stops. No API server is needed: an unnamed object is private (never
recorded, docs/design.md "Recording policy"), so the client writes nothing.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpuobj import Client
from gpuobj.client import handoff_route
from gpuobj_agent import config as agent_config
from gpuobj_kube.config import KubeConfig

from .conftest import ISSUER, OPERATOR, settle

pytestmark = pytest.mark.nixl

LOOP_THREADS = ("gpuobj-agent", "gpuobj-client")  # the agent's loop thread, and the client's that was


def running_loops() -> list[asyncio.AbstractEventLoop]:
    """Every event loop running in this process now (the test itself runs none)."""
    return [o for o in gc.get_objects() if issubclass(type(o), asyncio.AbstractEventLoop) and o.is_running()]


def loop_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name in LOOP_THREADS)


def task_names(loop: asyncio.AbstractEventLoop) -> set[str]:
    async def names() -> set[str]:
        return {t.get_name() for t in asyncio.all_tasks()}

    return asyncio.run_coroutine_threadsafe(names(), loop).result(10)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Path:
    """An API server nobody listens at: the client must not need one for private objects."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u, namespace: default}}]\n"
    )
    return path


@pytest.fixture
def connected(monkeypatch: pytest.MonkeyPatch, token_file: str, kubeconfig: Path) -> Iterator[Client]:
    monkeypatch.setenv(agent_config.ISSUER_URL_ENV, ISSUER.url)
    monkeypatch.setenv(agent_config.OPERATOR_SA_ENV, OPERATOR)
    monkeypatch.setenv("GPUOBJ_RECORD", "shared")
    client = Client.connect(
        pod_name="one-loop",
        namespace="default",
        pod_uid="one-loop-uid",
        token_file=token_file,
        host="127.0.0.1",
        port=0,
        kubeconfig=kubeconfig,
        timeout=30,
    )
    try:
        yield client
    finally:
        client.close()


def test_a_connected_client_runs_its_core_on_the_agent_loop_and_the_process_runs_one_loop(connected: Client) -> None:
    client = connected
    tensor = torch.arange(1 << 12, dtype=torch.float32)
    ref = client.put(tensor)
    assert torch.equal(client.fetch(ref)[0], tensor)  # from this (workload) thread
    assert torch.equal(asyncio.run(client.afetch(ref))[0], tensor)  # from an asyncio workload's own loop

    loops = running_loops()  # the test's asyncio.run loop has ended
    assert len(loops) == 1 and loop_threads() == ["gpuobj-agent"], (loops, loop_threads())
    agent_loop = client.agent.event_loop()  # type: ignore[attr-defined]
    assert loops == [agent_loop] and client.core.loop is agent_loop
    assert "gpuobj-releases" in task_names(agent_loop)  # the core's worker runs on the agent's loop

    client.release(ref)
    assert client.agent.stats()["objects"] == 0  # type: ignore[attr-defined]
    client.close()
    assert running_loops() == [] and loop_threads() == []  # the core's tasks ended, then the agent stopped


def test_close_ends_the_core_tasks_on_a_shared_agent_and_leaves_the_agent_serving(make_runtime) -> None:
    """A client on an agent it does not own: close cancels the core's tasks on the agent's loop, unhooks the
    hand-off releases, and the agent goes on serving (and stops balanced at teardown)."""
    rt = make_runtime("shared", pod_uid="shared-uid", extra_routes=handoff_route.register)
    client = Client(
        pod_name="shared",
        namespace="default",
        pod_uid="shared-uid",
        agent=rt,
        kube_config=KubeConfig.static("http://127.0.0.1:9"),
        token_file=rt.config.token_file,
        timeout=30,
        write_behind=True,
    )
    assert len(running_loops()) == 1 and loop_threads() == ["gpuobj-agent"], (running_loops(), loop_threads())
    loop = rt.event_loop()
    assert client.core.loop is loop and running_loops() == [loop]
    ref = client.put([torch.ones(1024)])
    assert handoff_route.bound(rt.incarnation) and "gpuobj-releases" in task_names(loop)
    client.release(ref)
    client.close()
    assert "gpuobj-releases" not in task_names(loop) and not handoff_route.bound(rt.incarnation)
    settle(rt.stats)
