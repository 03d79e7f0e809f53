"""The scale harness small: kwok pods, a fleet of real agents at their pod IPs, the real operator.

What is asserted is behaviour, never a timing (bench/scale.py measures those at size): the fleet's
agents verify real tokens; the operator's liveness traffic stays within its per-pod budget; a cold
restart frees nothing; while nothing changes the operator writes nothing; dead holder processes
lose their claims; a storm frees everything it should and nothing else; nothing is leaked at the end.
One fleet serves the whole module, in test order.
Needs root: kwok's pod CIDR is made a local route (`ip route add local ... dev lo`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from gpuobj.client.loop import LoopThread
from gpuobj_contract import agent_api, names
from gpuobj_dev.scale import scenarios
from gpuobj_dev.scale.harness import ScaleHarness
from gpuobj_dev.scale.kwok import can_route
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import OPERATOR_SA, WORKLOAD_SA, request_token
from gpuobj_dev.testing.waits import wait_until

PODS = 100
NODES = 4
OBJECTS_PER_POD = 5
# Liveness budget of the issue: 0.05 requests per pod per second (one probe per pod of slack for the
# phase of the window).
LIVENESS_PER_POD_S = 0.05
LIVENESS_WINDOW_S = 40.0
# Several test runs may share the machine: each takes the first of these pod CIDRs it can route.
CIDRS = tuple(f"10.{n}.0.0/16" for n in range(219, 230))
# Production probing and audit intervals; only the leak grace is short, so the orphan test need not wait,
# and the resync (every record decided again) comes every 10 s, so the idle window holds two of them.
# A fleet write budget of 10 writes a second per pod: told on every probe, pacing hardly anything here.
FLEET_WRITE_BUDGET = 10.0 * PODS
OPERATOR_ARGS = [
    *("--leak-settle", "0.5", "--leak-grace", "2", "--resync-interval", "10"),
    *("--fleet-write-budget", str(FLEET_WRITE_BUDGET)),
]
IDLE_WINDOW_S = 25.0

pytestmark = pytest.mark.skipif(can_route() is not None, reason=f"scale harness: {can_route()}")


class Run:
    """The harness on a loop of its own; tests submit coroutines to it."""

    def __init__(self, handle: ClusterHandle, folder: Path) -> None:
        self.loop = LoopThread()
        self.handle = handle
        self.h = ScaleHarness(
            handle,
            f"scale-{uuid.uuid4().hex[:8]}",
            folder,
            nodes=NODES,
            cidrs=CIDRS,
            operator_args=OPERATOR_ARGS,
            log=lambda m: print(f"[scale] {m}", flush=True),
        )

    def __call__(self, coro, timeout: float = 600):
        return self.loop.call(coro, timeout)


@pytest.fixture(scope="module")
def run(gpuobj_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    r = Run(gpuobj_cluster, tmp_path_factory.mktemp("scale"))
    try:
        r(r.h.__aenter__(), timeout=1800)  # the first run on a machine builds kwok (~5 min here)
        r(scenarios.ramp(r.h, PODS, OBJECTS_PER_POD, r.h.log), timeout=900)
        yield r
    finally:
        r(r.h.aclose(), timeout=300)
        r.loop.stop()


def _forged_token(namespace: str) -> str:
    """A well-formed ServiceAccount token for the operator's subject, signed by a key nobody trusts."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    claims = {
        "iss": "https://kubernetes.default.svc.cluster.local",
        "sub": f"system:serviceaccount:{namespace}:{OPERATOR_SA}",
        "aud": [names.AGENT_AUDIENCE],
        "iat": 1,
        "exp": 4_000_000_000,
    }
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "not-the-issuers"})


def test_fleet_agents_verify_real_tokens(run: Run) -> None:
    """Each agent serves at its pod IP and checks tokens against the API server's JWKS."""
    h = run.h
    ns = h.namespace
    pod = h.fleet.alive()[0]
    operator, _ = request_token(run.handle, ns, OPERATOR_SA, audience=names.AGENT_AUDIENCE)
    api_audience, _ = request_token(run.handle, ns, OPERATOR_SA)
    workload, _ = request_token(run.handle, ns, WORKLOAD_SA, audience=names.AGENT_AUDIENCE, pod=(pod.name, pod.uid))

    async def ask(token: str | None, pod_uid: str = pod.uid) -> int:
        headers = {names.HEADER_POD_UID: pod_uid, **({"Authorization": f"Bearer {token}"} if token else {})}
        async with aiohttp.ClientSession() as s:
            url = f"http://{pod.ip}:{names.DEFAULT_AGENT_PORT}{agent_api.INVENTORY.template}"
            async with s.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return resp.status

    assert pod.ip.startswith(h.kwok.cidr.split(".")[0] + "."), pod.ip
    assert run(ask(operator)) == 200
    assert run(ask(operator, pod_uid="someone-else")) == 409  # the operator's token, meant for another agent
    assert run(ask(None)) == 401
    assert run(ask(api_audience)) == 401  # a token for the API server is not one for the agent
    assert run(ask(_forged_token(ns))) == 401  # the operator's name, signed by a foreign key
    assert run(ask(workload)) == 403  # a real pod's token: authenticated, but not the operator


def test_every_agent_is_told_its_share_of_the_fleet_write_budget(run: Run) -> None:
    """The operator divides --fleet-write-budget by the agents it probes and tells each its share on every
    probe; the pod's write-behind reads it from its agent. A share told while fewer pods had started was
    larger: the next backstop probe (every 20 s) tells the share of the fleet as it is."""
    fleet = run.h.fleet

    async def told() -> list[float | None]:
        return [p.agent.told_write_rate() for p in fleet.alive()]  # on the fleet's loop, where it is set

    share = FLEET_WRITE_BUDGET / len(fleet.alive())
    rates = wait_until(
        lambda: (r := run(told())) and all(x == pytest.approx(share) for x in r) and r,
        f"every agent told {share:g} writes/s",
        timeout=60,
        interval=0.5,
    )
    assert len(rates) == PODS
    pacing = run(_pacing(fleet))
    assert pacing["told"] == PODS and pacing["rate_median"] == pytest.approx(share)  # what each write-behind reads


async def _pacing(fleet) -> dict[str, float]:
    return fleet.pacing()


def test_liveness_traffic_within_its_per_pod_budget(run: Run) -> None:
    requests, pods = run(scenarios.count_info(run.h, LIVENESS_WINDOW_S), timeout=LIVENESS_WINDOW_S + 60)
    budget = LIVENESS_PER_POD_S * pods * LIVENESS_WINDOW_S + pods
    assert requests <= budget, f"{requests} /v1/info requests to {pods} agents in {LIVENESS_WINDOW_S:g}s"


def test_cold_restart_frees_nothing(run: Run) -> None:
    restart = run(scenarios.cold_restart(run.h, run.h.log), timeout=900)
    assert restart.audited_s is not None, "not every agent was audited after the restart"
    assert restart.frees == 0 and restart.operator_frees == 0
    assert run.h.fleet.wrong_frees == 0


def test_idle_operator_writes_nothing(run: Run) -> None:
    """Nothing changes, two resyncs decide every record again: not one API write by the operator
    (gpuobj.io, events, pods in apiserver_request_total, as bench/scale.py counts them)."""
    run(scenarios.statuses_settled(run.h, 180), timeout=240)
    # Earlier tests' namespaces being emptied by kube-controller-manager write gpuobjects, events and pods.
    wait_until(lambda: not run.handle.terminating_namespaces(), "earlier test namespaces to go", timeout=180)
    idle = run(scenarios.idle(run.h, IDLE_WINDOW_S, run.h.log), timeout=IDLE_WINDOW_S + 60)
    assert idle.operator_writes_per_min == 0, f"writes per minute while idle: {idle.writes_by_resource}"


def test_dead_holders_lose_their_claims(run: Run) -> None:
    dead = run(scenarios.dead_holders(run.h, 2, run.h.log, timeout=240), timeout=400)
    assert dead.claims > 0
    assert dead.undetected == 0, (
        f"{dead.undetected} objects held only by dead processes were never freed; the operator said:\n"
        + run.h.operator.output()[-4000:]
    )
    assert run.h.fleet.wrong_frees == 0


def test_storm_frees_everything_it_should_and_nothing_else(run: Run) -> None:
    storm = run(scenarios.storm(run.h, 0.10, run.h.log, timeout=180), timeout=400)
    assert storm.pods == PODS // 10
    assert storm.referenced > 0
    assert storm.unfreed == 0, (
        f"{storm.unfreed} objects the deleted pods referenced are still held; the operator said:\n"
        + run.h.operator.output()[-4000:]
    )
    assert storm.wrong_frees == 0 and run.h.fleet.wrong_frees == 0


def test_audit_reclaims_orphans_and_nothing_leaks(run: Run) -> None:
    [audit] = run(scenarios.audit_at_size(run.h, [10], 120, run.h.log), timeout=200)
    assert audit.reclaimed == 10
    assert run(scenarios.settle_leaks(run.h, 60), timeout=120) == 0
    assert run.h.fleet.wrong_frees == 0
