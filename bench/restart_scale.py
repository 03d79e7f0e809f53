"""Restart at scale: N live GPUObjects, the operator killed and restarted; how long to reconcile, and no wrong free.

    .venv/bin/python bench/restart_scale.py --objects 10000

One workload pod puts N small objects (its agent really holds them) and records them as
GPUObjects; a first operator reconciles them (status Ready); it is killed with SIGKILL; a
second operator starts. Printed: the second operator's time to list everything (sync),
to reconcile (its work queue idle, measured by the audit and status being current), its
resident memory, and the frees it performed (must be 0: every object is still referenced).
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuobj_dev.cluster import DevCluster  # noqa: E402
from gpuobj_dev.testing.cluster import ClusterHandle  # noqa: E402
from gpuobj_dev.testing.identities import WORKLOAD_SA, Identities  # noqa: E402
from gpuobj_dev.testing.operator import OperatorProcess  # noqa: E402
from gpuobj_dev.testing.pods import create_agent_pod  # noqa: E402
from gpuobj_dev.testing.workload import WorkloadProcess, free_port  # noqa: E402
from gpuobj_kube.client import GPUOBJECTS  # noqa: E402

NAMESPACE = "gpuobj-scale"

PUT_MANY = """
import asyncio
async def put_many(n, width=16):
    sem = asyncio.Semaphore(width)
    tensor = torch.ones(16)
    async def one(i):
        async with sem:
            ref = await client.core.put([tensor], name=f"s-{i}")
            ref.detach()  # keep the GPUObject: this benchmark drops no reference
    await asyncio.gather(*(one(i) for i in range(n)))
"""


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def count_ready(handle: ClusterHandle) -> int:
    async def go() -> int:
        async with handle.client() as kube:
            items = (await kube.list(GPUOBJECTS, NAMESPACE, limit=500))["items"]
            return sum(1 for o in items if (o.get("status") or {}).get("state") == "Ready")

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    args = parser.parse_args(argv)
    n = args.objects

    state = Path(tempfile.mkdtemp(prefix="gpuobj-scale-"))
    cluster = DevCluster(state, tie_to_parent=True, log=lambda m: print(f"# {m}", flush=True))
    handle = ClusterHandle(cluster, cluster.up())
    procs: list = []
    try:
        handle.apply_crds()
        handle.kubectl("create", "namespace", NAMESPACE)
        # The operator and the workload run as their ServiceAccounts with the chart's roles, as in a cluster.
        identities = Identities(handle, NAMESPACE, state / "identities")
        op = identities.operator()
        port = free_port()

        async def pod() -> str:
            async with handle.client() as kube:
                created = await create_agent_pod(kube, NAMESPACE, "src", port=port, service_account=WORKLOAD_SA)
                return created["metadata"]["uid"]

        uid = asyncio.run(pod())
        creds = identities.workload("src", uid)
        src = WorkloadProcess(
            pod_name="src",
            namespace=NAMESPACE,
            pod_uid=uid,
            port=port,
            token_file=creds.agent_token,
            kubeconfig=creds.kubeconfig,
            env=identities.workload_env,
        ).start()
        procs.append(src)
        src.run(PUT_MANY)
        t0 = time.perf_counter()
        src.run(f"client.runner.call(put_many({n}), 'put many')", timeout=3600)
        print(f"# put {n} objects (agent put + GPUObject create) in {time.perf_counter() - t0:.1f}s", flush=True)

        extra = ["--namespace", NAMESPACE, "--lease-seconds", "5", "--audit-interval", "5", "--status-delay", "0"]
        first = OperatorProcess(
            op.kubeconfig, op.agent_token, identity="op-1", lease_namespace=NAMESPACE, extra_args=extra
        )
        procs.append(first)
        t0 = time.perf_counter()
        first.start().wait_ready(timeout=600)
        while count_ready(handle) < n:
            time.sleep(1)
        print(f"# first operator wrote {n} statuses in {time.perf_counter() - t0:.1f}s", flush=True)
        first.kill()

        second = OperatorProcess(
            op.kubeconfig, op.agent_token, identity="op-2", lease_namespace=NAMESPACE, extra_args=extra
        )
        procs.append(second)
        t0 = time.perf_counter()
        second.start()
        second.wait_for_line("synced:", timeout=600)
        synced = time.perf_counter() - t0
        # Reconciled: an audit pass over the agent's inventory has compared all N (every object held).
        second.wait_for_line("synced and reconciling", timeout=600)
        audits_before = second.metric("gpuobj_audit_runs_total", {"result": "ok"})
        while second.metric("gpuobj_audit_runs_total", {"result": "ok"}) <= audits_before:
            time.sleep(0.5)
        reconciled = time.perf_counter() - t0
        frees = second.metric("gpuobj_frees_total")
        lost = second.metric("gpuobj_lost_objects_total")
        ready = second.metric("gpuobj_objects", {"state": "Ready"})
        memory = rss_mib(second.proc.pid)  # type: ignore[union-attr]
        print()
        print(f"{'live GPUObjects':>28} | {n}")
        print(f"{'restart: listed (sync)':>28} | {synced:.1f} s")
        print(f"{'restart: audited all':>28} | {reconciled:.1f} s")
        print(f"{'operator resident memory':>28} | {memory:.0f} MiB")
        print(f"{'objects Ready after restart':>28} | {ready:.0f}")
        print(f"{'frees after restart':>28} | {frees:.0f} (must be 0)")
        print(f"{'objects marked Lost':>28} | {lost:.0f} (must be 0)")
        return 0 if frees == 0 and lost == 0 and ready == n else 1
    finally:
        for p in procs:
            p.kill()
        cluster.down(quiet=True)


if __name__ == "__main__":
    sys.exit(main())
