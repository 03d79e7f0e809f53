"""What the benchmarks share: the machine's load, the gpuobj control plane they run on, and Ray's start-up.

Why one module: bench/lifecycle.py, bench/weight_sync.py, bench/restart_scale.py and bench/shards_rss.py
start the same things the same way (a dev control plane, the operator and every workload as their own
ServiceAccounts with the chart's roles, workload processes in agent pods; Ray at the default priority),
and a fix to one must reach all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMESPACE = "gpuobj-bench"


# Run in a workload process (WorkloadProcess.run): `put_many(n)` puts n small objects, 16 at a time, and
# keeps every GPUObject (the benchmarks that hold objects drop no reference).
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


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def settle(quiet: float, timeout: float) -> None:
    """Wait (at most ``timeout`` s) for the 1-minute load to fall below ``quiet``, so that a side does not
    start on the load the one before it left (the average decays over a minute). 0 skips it."""
    if quiet <= 0:
        return
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= quiet and time.monotonic() < deadline:
        print(f"# waiting for the load to settle below {quiet}: {load()}", flush=True)
        time.sleep(10)


def ray_init() -> None:
    """Ray on this machine's 2 CPUs, quiet. Ray runs its workers at nice 15 by default; on a shared
    machine that would measure the other tenants' load more than Ray. gpuobj's processes run at the
    default priority: so do Ray's here."""
    import logging

    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def count_ready(handle: Any, namespace: str) -> int:
    """The GPUObjects of ``namespace`` whose status is Ready (one list, 500 an answer)."""
    from gpuobj_kube.client import GPUOBJECTS

    async def go() -> int:
        async with handle.client() as kube:
            items = (await kube.list(GPUOBJECTS, namespace, limit=500))["items"]
            return sum(1 for o in items if (o.get("status") or {}).get("state") == "Ready")

    return asyncio.run(go())


@dataclass
class ClusterRun:
    """What `one_namespace` started: the cluster, the namespace's identities, a state folder, and the
    processes a benchmark adds to ``procs`` (killed on the way out)."""

    handle: Any
    identities: Any
    state: Path
    procs: list[Any] = field(default_factory=list)


@contextlib.contextmanager
def one_namespace(namespace: str, prefix: str) -> Iterator[ClusterRun]:
    """A dev control plane with the CRDs and ``namespace``, whose operator and workloads run as their
    ServiceAccounts with the chart's roles (gpuobj_dev.testing.identities.Identities), as in a cluster.
    Leaving it kills every process in ``procs`` and stops the cluster, however the benchmark ended."""
    from gpuobj_dev.cluster import DevCluster
    from gpuobj_dev.testing.cluster import ClusterHandle
    from gpuobj_dev.testing.identities import Identities

    state = Path(tempfile.mkdtemp(prefix=prefix))
    cluster = DevCluster(state, tie_to_parent=True, log=lambda m: print(f"# {m}", flush=True))
    procs: list[Any] = []
    try:
        handle = ClusterHandle(cluster, cluster.up())
        handle.apply_crds()
        handle.kubectl("create", "namespace", namespace)
        yield ClusterRun(handle, Identities(handle, namespace, state / "identities"), state, procs)
    finally:
        for process in procs:
            process.kill()
        cluster.down(quiet=True)


def start_workload(
    handle: Any,
    namespace: str,
    name: str,
    credentials: Callable[[str], Any],
    env: dict[str, str],
    *,
    ready_timeout: float = 60,
) -> tuple[Any, str]:
    """A workload process in a new agent pod ``name`` run as gpuobj-workload, with the tokens
    ``credentials(pod_uid)`` makes bound to that pod; returns the started process and the pod's uid."""
    from gpuobj_dev.testing.identities import WORKLOAD_SA
    from gpuobj_dev.testing.pods import create_agent_pod
    from gpuobj_dev.testing.workload import WorkloadProcess, free_port

    port = free_port()

    async def pod() -> str:
        async with handle.client() as kube:
            created = await create_agent_pod(kube, namespace, name, port=port, service_account=WORKLOAD_SA)
            return str(created["metadata"]["uid"])

    uid = asyncio.run(pod())
    creds = credentials(uid)
    process = WorkloadProcess(
        pod_name=name,
        namespace=namespace,
        pod_uid=uid,
        port=port,
        token_file=creds.agent_token,
        kubeconfig=creds.kubeconfig,
        env=env,
    ).start(ready_timeout=ready_timeout)
    return process, uid


class BenchCluster:
    """A dev control plane with the CRDs, a namespace, the operator as gpuobj-operator, and workload
    processes in agent pods as gpuobj-workload with pod-bound tokens (as the tests run them).

    Use as a context manager: leaving it kills the workloads, stops the operator and the cluster."""

    def __init__(self, *, operator_args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.operator_args = list(operator_args)
        self.env = dict(env or {})  # every workload's environment, on top of the identity's
        self.state = Path(tempfile.mkdtemp(prefix="gpuobj-bench-"))
        self.workloads: list[Any] = []
        self._identities: list[Any] = []
        self.operator: Any = None
        self.handle: Any = None
        self._cluster: Any = None

    def __enter__(self) -> BenchCluster:
        from gpuobj_dev.cluster import DevCluster
        from gpuobj_dev.testing.cluster import ClusterHandle
        from gpuobj_dev.testing.identities import OPERATOR_SA, credentials, install_identities
        from gpuobj_dev.testing.operator import OperatorProcess

        self._cluster = DevCluster(
            self.state, tie_to_parent=True, log=lambda m: print(f"# {m}", file=sys.stderr, flush=True)
        )
        try:
            self.handle = ClusterHandle(self._cluster, self._cluster.up())
            self.handle.apply_crds()
            self.handle.kubectl("create", "namespace", NAMESPACE)
            install_identities(self.handle, NAMESPACE)
            op_creds = credentials(self.handle, NAMESPACE, OPERATOR_SA, self.state / "operator")
            self._identities.append(op_creds)
            self.operator = (
                OperatorProcess(
                    op_creds.agent_token.with_name("kubeconfig"),
                    op_creds.agent_token,
                    lease_namespace=NAMESPACE,
                    extra_args=["--namespace", NAMESPACE, *self.operator_args],
                )
                .start()
                .wait_ready()
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, name: str) -> tuple[Any, str]:
        """A workload process in a new agent pod `name`; returns it and the pod's uid."""
        from gpuobj_dev.testing.identities import WORKLOAD_SA, credentials, operator_subject

        def identity(uid: str) -> Any:
            creds = credentials(self.handle, NAMESPACE, WORKLOAD_SA, self.state / name, pod=(name, uid))
            self._identities.append(creds)
            return creds

        env = {"GPUOBJ_OPERATOR_SERVICEACCOUNT": operator_subject(NAMESPACE), **self.env}
        w, uid = start_workload(self.handle, NAMESPACE, name, identity, env, ready_timeout=180)
        self.workloads.append(w)
        return w, uid

    def close(self) -> None:
        for w in self.workloads:
            w.kill()
        if self.operator:
            self.operator.stop()
        for creds in self._identities:
            with contextlib.suppress(Exception):
                creds.stop()
        if self._cluster is not None:
            self._cluster.down(quiet=True)
