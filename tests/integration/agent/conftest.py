"""Fixtures for the agent suite: in-process agents, agent processes, and the end-of-test checks.

Every test that holds objects ends by asserting that nothing is held: no objects, no
store bytes, registrations equal deregistrations, no read in flight, no quarantined bytes,
no fetched tensor alive. Idle landing buffers are a bounded cache that stays registered
until the agent stops; stopping asserts that every registration was undone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.runtime import AgentRuntime
from gpuobj_dev.testing.agent_workload import AgentProcess
from gpuobj_dev.testing.issuer import OPERATOR, default_issuer
from gpuobj_dev.testing.waits import wait_until

# Agents in this suite trust a loopback issuer (gpuobj_dev.testing.issuer); the operator presents
# OPERATOR_TOKEN, and TOKEN is a reader pod's own token in the namespace the agents serve.
ISSUER = default_issuer()
OPERATOR_TOKEN = ISSUER.token(OPERATOR)
TOKEN = ISSUER.token("default/default", pod=("reader", "reader-uid"))

logging.getLogger("nixl").setLevel(logging.WARNING)


def assert_nothing_held(stats: dict[str, Any]) -> None:
    assert stats["objects"] == 0, stats
    assert stats["storeBytes"] == 0, stats
    assert stats["registrations"] == stats["deregistrations"], stats
    assert stats["registeredRegions"] == 0, stats
    assert stats["readerRegistrations"] == stats["readerDeregistrations"], stats
    assert stats.get("landingBuffersInUse", 0) == 0, stats  # no fetched tensor still alive
    assert stats["inflightReads"] == 0, stats
    assert stats["quarantinedBytes"] == 0, stats


def settle(get_stats: Callable[[], dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]:
    """Wait for pending fences (quarantine drains within the fence bound), then assert nothing is held."""
    stats = wait_until(
        lambda: (s := get_stats())["quarantinedBytes"] == 0 and s["inflightReads"] == 0 and s,
        "the quarantine to drain",
        timeout,
    )
    assert_nothing_held(stats)
    return stats


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture
def make_runtime(token_file) -> Iterator[Callable[..., AgentRuntime]]:
    """Start in-process agents (real NIXL, real control server on a free loopback port)."""
    started: list[AgentRuntime] = []

    def make(pod_name: str = "pod", **overrides: Any) -> AgentRuntime:
        config = AgentConfig(
            pod_name=pod_name,
            namespace="default",
            host="127.0.0.1",
            port=0,
            token_file=token_file,
            issuer_url=ISSUER.url,
            operator_service_accounts=(OPERATOR,),
        )
        rt = AgentRuntime(config, **overrides).start()
        started.append(rt)
        return rt

    yield make
    for rt in started:
        rt.stop()
        assert rt.agent.balanced(), rt.agent.stats()


@pytest.fixture
def make_process(tmp_path) -> Iterator[Callable[..., AgentProcess]]:
    """Start agent processes; each must exit 0 (registrations balanced) on SIGTERM at teardown."""
    procs: list[AgentProcess] = []

    def make(pod_name: str, **kwargs: Any) -> AgentProcess:
        proc = AgentProcess(pod_name, workdir=tmp_path / pod_name, **kwargs)
        procs.append(proc)
        return proc.start()

    yield make
    errors = []
    for proc in procs:
        try:
            if proc.alive():
                proc.stop()
        except AssertionError as exc:
            errors.append(str(exc))
        finally:
            proc.close()
    assert not errors, "\n".join(errors)
