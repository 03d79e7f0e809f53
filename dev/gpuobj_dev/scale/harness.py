"""One scale run's cluster side: namespace and chart identities, kwok nodes, the fleet, the operator.

Why shared: `bench/scale.py` and tests/e2e/scale set up the same thing at different sizes. The
operator runs as its own ServiceAccount with the chart's roles, reaches agents at their pod IPs (no
--allow-agent-host-annotation), and can be killed and started again (cold restart). Teardown undoes
everything in reverse, whatever failed: fleet, operator, kwok (and its route), nodes, namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from gpuobj_dev.cluster import FRONT_PROXY_CN
from gpuobj_dev.scale.fleet import Fleet
from gpuobj_dev.scale.kwok import DEFAULT_CIDR, NODE_LABEL, Kwok
from gpuobj_dev.scale.liveview import LiveViewEndpoint, rbac
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import OPERATOR_SA, Identities, operator_subject
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.workload import free_port
from gpuobj_kube.client import Resource

NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = re.search(r"VmRSS:\s+(\d+)", status)
    return int(m.group(1)) / 1024 if m else 0.0


class ScaleHarness:
    """Use as `async with ScaleHarness(...) as h:`; `h.fleet`, `h.operator`, `h.kwok` are live inside."""

    def __init__(
        self,
        handle: ClusterHandle,
        namespace: str,
        folder: Path,
        *,
        nodes: int,
        cidrs: tuple[str, ...] = (DEFAULT_CIDR,),
        operator_args: list[str] | None = None,
        log: Callable[[str], None] = print,
        record: str = "all",
        live_view: bool = False,
    ) -> None:
        """`record`: the fleet's recording policy (GPUOBJ_RECORD). `live_view`: the operator also serves the
        live view on a loopback port (`h.live_view`), as it would behind the chart's APIService."""
        self.handle, self.namespace, self.folder = handle, namespace, Path(folder)
        self.record = record
        self.live_view: LiveViewEndpoint | None = None
        self._want_live_view = live_view
        self.node_count = nodes
        self.run_id = uuid.uuid4().hex[:8]
        self.node_names = [f"kwok-{self.run_id}-{i:03d}" for i in range(nodes)]
        self.kwok = Kwok(handle.kubeconfig, self.folder / "logs", run_id=self.run_id, cidrs=cidrs)
        self.operator_args = operator_args or []
        self.log = log
        self.identities: Identities | None = None
        self.operator: OperatorProcess | None = None
        self.operator_starts = 0
        self.fleet: Fleet | None = None
        self._op_creds = None
        self._live_view_rbac: list[tuple[str, dict]] = []

    # ------------------------------------------------------------ setup

    async def __aenter__(self) -> ScaleHarness:
        try:
            await self._setup()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _setup(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.handle.kubectl, "create", "namespace", self.namespace)
        self.identities = await asyncio.to_thread(Identities, self.handle, self.namespace, self.folder / "identities")
        self._op_creds = await asyncio.to_thread(self.identities.operator)
        if self._want_live_view:
            await self._setup_live_view()
        async with self.handle.client() as kube:
            for name in self.node_names:
                await kube.create(NODES, self.kwok.node_body(name))
        await asyncio.to_thread(self.kwok.start)
        await self.wait_nodes_ready(timeout=120)
        self.fleet = Fleet(
            self.handle,
            self.namespace,
            self.folder / "pods",
            nodes=self.node_names,
            pod_ip=self.kwok.pod_ip,
            operator_subject=operator_subject(self.namespace),
            record=self.record,
        )
        await self.fleet.start()
        await self.start_operator()

    async def _setup_live_view(self) -> None:
        """The chart's delegated-auth bindings for the operator, its serving certificate, its flags."""
        docs = rbac(self.namespace, OPERATOR_SA, self.run_id)
        await asyncio.to_thread(
            self.handle.kubectl, "apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs)
        )
        self._live_view_rbac = [(d["kind"].lower(), d["metadata"]) for d in docs]
        port = free_port()
        self.live_view = await asyncio.to_thread(LiveViewEndpoint.make, self.handle, self.folder, port, FRONT_PROXY_CN)
        self.operator_args = [  # a new list: the caller's is not ours to change
            *self.operator_args,
            "--live-view-port",
            str(port),
            "--live-view-host",
            "127.0.0.1",
            "--live-view-cert-dir",
            str(self.live_view.cert_dir),
        ]

    async def wait_nodes_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        async with self.handle.client() as kube:
            while True:
                items = (await kube.list(NODES, label_selector=f"{NODE_LABEL}={self.run_id}"))["items"]
                ready = sum(
                    1
                    for n in items
                    if any(
                        c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (n.get("status") or {}).get("conditions") or []
                    )
                )
                if ready == self.node_count:
                    return time.monotonic() - t0
                if not self.kwok.alive():
                    raise RuntimeError(f"kwok exited:\n{self.kwok.log_tail()}")
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{ready}/{self.node_count} kwok nodes Ready after {timeout:.0f}s")
                await asyncio.sleep(0.5)

    def new_operator(self) -> OperatorProcess:
        assert self._op_creds is not None
        self.operator_starts += 1
        op = OperatorProcess(
            self._op_creds.kubeconfig,
            self._op_creds.agent_token,
            identity=f"op-{self.operator_starts}",
            lease_namespace=self.namespace,
            # The fleet's stand-in agents serve plain HTTP: the per-event cost of the operator is what is
            # measured here (TLS per request: bench/agent_tls.py).
            extra_args=["--namespace", self.namespace, "--agent-tls", "off", *self.operator_args],
        )
        # Agents are reached at status.podIP, as in production: no host from an annotation.
        op.args.remove("--allow-agent-host-annotation")
        return op

    async def start_operator(self, ready_timeout: float = 600) -> OperatorProcess:
        op = self.new_operator()
        self.operator = op
        await asyncio.to_thread(op.start)
        await asyncio.to_thread(op.wait_ready, ready_timeout)
        return op

    async def kill_operator(self) -> None:
        if self.operator is not None:
            await asyncio.to_thread(self.operator.kill)
            self.keep_operator_log()

    def keep_operator_log(self) -> None:
        """The operator's last lines (OperatorProcess keeps 5,000) under logs/, beside kwok's: what a miss
        needs explained (which path a free took) outlives the run."""
        if self.operator is not None:
            logs = self.folder / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"operator-{self.operator_starts}.log").write_text("\n".join(self.operator.lines) + "\n")

    # ------------------------------------------------------------ measurement

    def pids(self) -> dict[str, int]:
        """The processes whose CPU a run accounts: the control plane, kwok, the operator, this one (fleet)."""
        out = dict(self.handle.cluster.load_state().pids) if self.handle.cluster.load_state() else {}
        if self.kwok.proc is not None:
            out["kwok"] = self.kwok.proc.pid
        if self.operator is not None and self.operator.proc is not None:
            out["operator"] = self.operator.proc.pid
        out["fleet"] = os.getpid()
        return out

    def cpu(self) -> dict[tuple[str, int], float]:
        """CPU seconds by (process, pid): a restarted operator is a new pid, counted from 0."""
        return {(name, pid): cpu_seconds(pid) for name, pid in self.pids().items()}

    @staticmethod
    def cpu_used(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> dict[str, float]:
        """CPU seconds each process (by name) used between two `cpu()` readings."""
        used: dict[str, float] = {}
        for (name, pid), secs in after.items():
            used[name] = used.get(name, 0.0) + max(0.0, secs - before.get((name, pid), 0.0))
        return used

    # ------------------------------------------------------------ teardown

    async def aclose(self) -> None:
        if self.fleet is not None:
            with contextlib.suppress(Exception):
                await self.fleet.stop()
        if self.operator is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.operator.kill)
            with contextlib.suppress(Exception):
                self.keep_operator_log()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.kwok.stop)
        if self.identities is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.identities.stop)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                self.handle.kubectl, "delete", "nodes", "-l", f"{NODE_LABEL}={self.run_id}", "--wait=false", check=False
            )
        for kind, meta in self._live_view_rbac:
            where = ["-n", meta["namespace"]] if "namespace" in meta else []
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.handle.kubectl, "delete", kind, meta["name"], *where, check=False)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                self.handle.kubectl, "delete", "namespace", self.namespace, "--wait=false", check=False
            )
