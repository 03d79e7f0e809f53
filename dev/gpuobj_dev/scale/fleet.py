"""The agent fleet: many fake pods in one asyncio process, each a real agent plus a real client core.

Why one process: a thousand workload processes (torch and NIXL each) do not fit on two cores; a
thousand fleet pods do, because each is only what the operator and the API server see of a pod:
its agent's control server at its own pod IP (fleet_agent.py) and the client library's core
(`gpuobj.client.core.ClientCore`, write-behind included) writing GPUObjects and claims with the
pod's own pod-bound tokens, so admission and RBAC judge every write as they judge a real pod's.

The fleet also knows the truth the benchmark is checked against: which bytes are referenced (an
owner reference still held, or a claim whose holder process is alive and has not released it). A
free of a referenced object is a wrong free; bytes still held by an agent and referenced by nobody
at the end are leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpuobj.client.core import ClientCore
from gpuobj.client.handles import ObjectRef
from gpuobj_agent.auth import IssuerKeys
from gpuobj_agent.config import AgentConfig
from gpuobj_contract import names
from gpuobj_dev.scale.fleet_agent import FleetAgent
from gpuobj_dev.scale.kwok import POD_IP_ANNOTATION
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import WORKLOAD_SA, request_token, write_token_kubeconfig
from gpuobj_kube.client import PODS, KubeClient, NotFound
from gpuobj_kube.config import from_kubeconfig

log = logging.getLogger("gpuobj.scale")

OBJECT_BYTES = 64  # each object is its own small CPU tensor
WRITE_WINDOW = 0.1  # the client's default write-behind window (docs/write-behind.md)

Key = tuple[str, str]  # (source pod name, object id)


@dataclass
class FleetPod:
    """One fake pod: its API object, tokens, agent and client core (replaced together on a restart)."""

    name: str
    node: str
    uid: str = ""
    ip: str = ""
    restarts: int = 0
    agent: FleetAgent | None = None
    core: ClientCore | None = None
    release_task: asyncio.Task | None = None
    owned: dict[str, ObjectRef] = field(default_factory=dict)  # object id -> owner reference still held
    claims: dict[Key, ObjectRef] = field(default_factory=dict)  # claims this pod's process holds
    deleted: bool = False
    info_requests: int = 0

    @property
    def alive(self) -> bool:
        return self.agent is not None and not self.agent.stopped and not self.deleted


class Fleet:
    """Fake pods on kwok nodes in `namespace`; everything runs on the loop that calls `start`."""

    def __init__(
        self,
        handle: ClusterHandle,
        namespace: str,
        folder: Path,
        *,
        nodes: list[str],
        pod_ip: Callable[[int], str],
        operator_subject: str,
        token_concurrency: int = 8,
        record: str = "all",
    ) -> None:
        """`pod_ip(n)`: the address of the run's n-th pod (`Kwok.pod_ip`), which kwok reports as its podIP.
        `record`: every client's recording policy (GPUOBJ_RECORD, docs/design.md): "all" or "shared"."""
        if record not in ("all", "shared"):
            raise ValueError(f"record={record!r}: 'all' or 'shared'")
        self.record = record
        self.handle, self.namespace, self.folder = handle, namespace, Path(folder)
        self.nodes = nodes
        self.pod_ip = pod_ip
        self.operator_subject = operator_subject
        self.pods: dict[str, FleetPod] = {}
        self.admin: KubeClient | None = None
        self.keys: IssuerKeys | None = None
        self._control = ThreadPoolExecutor(4, thread_name_prefix="fleet-control")
        self._lifecycle = ThreadPoolExecutor(2, thread_name_prefix="fleet-lifecycle")
        self._tokens = asyncio.Semaphore(token_concurrency)
        self._refresher: asyncio.Task | None = None
        # The truth: who references what, and what happened to it.
        self.referenced: dict[Key, str] = {}  # key -> why ("owner" or the holder pod)
        self.nbytes: dict[Key, int] = {}
        self.wrong_frees = 0
        self.wrong_free_bytes = 0
        self.frees = 0
        self.freed_at: dict[Key, float] = {}
        self.info_requests = 0

    # ------------------------------------------------------------ setup

    async def start(self) -> None:
        self.admin = self.handle.client()

    def _on_free(self, pod: FleetPod, object_id: str, nbytes: int) -> None:
        key = (pod.name, object_id)
        self.frees += 1
        self.freed_at[key] = time.monotonic()
        if key in self.referenced:
            self.wrong_frees += 1
            self.wrong_free_bytes += nbytes
            log.error("wrong free: %s/%s freed while referenced by %s", *key, self.referenced[key])

    def _on_info(self, pod: FleetPod) -> None:
        pod.info_requests += 1
        self.info_requests += 1

    def pod_body(self, pod: FleetPod) -> dict:
        return {
            "metadata": {
                "name": pod.name,
                "labels": {names.LABEL_AGENT: "true", "app.kubernetes.io/part-of": "gpuobj-scale"},
                "annotations": {POD_IP_ANNOTATION: pod.ip},
            },
            "spec": {
                "nodeName": pod.node,
                "serviceAccountName": WORKLOAD_SA,
                "terminationGracePeriodSeconds": 0,
                "tolerations": [{"operator": "Exists"}],
                "containers": [
                    {
                        "name": "workload",
                        "image": "gpuobj/workload:dev",
                        "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": names.DEFAULT_AGENT_PORT}],
                    }
                ],
            },
        }

    async def create_pods(self, count: int, *, prefix: str = "fp", concurrency: int = 16) -> list[FleetPod]:
        """Create `count` pods bound to the kwok nodes round robin (kwok makes them Running)."""
        assert self.admin is not None
        start = len(self.pods)
        made = [
            FleetPod(f"{prefix}-{start + i:05d}", self.nodes[(start + i) % len(self.nodes)], ip=self.pod_ip(start + i))
            for i in range(count)
        ]
        sem = asyncio.Semaphore(concurrency)

        async def one(pod: FleetPod) -> None:
            async with sem:
                created = await self.admin.create(PODS, self.pod_body(pod), self.namespace)  # type: ignore[union-attr]
                pod.uid = created["metadata"]["uid"]

        await asyncio.gather(*(one(p) for p in made))
        for p in made:
            self.pods[p.name] = p
        return made

    async def wait_running(self, pods: list[FleetPod], timeout: float, progress=None) -> None:
        """Until kwok reports every pod Running with a pod IP (bounded; lists, paged)."""
        assert self.admin is not None
        want = {p.name: p for p in pods}
        deadline = time.monotonic() + timeout
        while True:
            listing = await self.admin.list(PODS, self.namespace, label_selector=f"{names.LABEL_AGENT}=true", limit=500)
            running = 0
            for raw in listing["items"]:
                pod = want.get(raw["metadata"]["name"])
                status = raw.get("status") or {}
                if pod is not None and status.get("phase") == "Running" and status.get("podIP"):
                    if status["podIP"] != pod.ip:  # two agents could then share an address
                        raise RuntimeError(f"kwok reported pod {pod.name} at {status['podIP']}, not {pod.ip}")
                    running += 1
            if progress:
                progress(running, len(want))
            if running == len(want):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{running}/{len(want)} pods Running with a pod IP after {timeout:.0f}s")
            await asyncio.sleep(0.5)

    async def _token(self, pod: FleetPod, audience: str | None) -> tuple[str, float]:
        async with self._tokens:
            return await asyncio.to_thread(
                request_token, self.handle, self.namespace, WORKLOAD_SA, audience=audience, pod=(pod.name, pod.uid)
            )

    def _folder(self, pod: FleetPod) -> Path:
        return self.folder / pod.name

    async def _write_tokens(self, pod: FleetPod) -> float:
        """The pod's two projected tokens (API and agent audience), as the kubelet would mount them."""
        folder = self._folder(pod)
        folder.mkdir(parents=True, exist_ok=True)
        api, life = await self._token(pod, None)
        agent, _ = await self._token(pod, names.AGENT_AUDIENCE)
        for fname, value in (("api-token", api), ("agent-token", agent)):
            tmp = folder / f".{fname}.{uuid.uuid4().hex[:6]}"
            tmp.write_text(value)
            tmp.replace(folder / fname)
        return life

    async def _refresh_tokens(self, life: float) -> None:
        """Renew every live pod's tokens at 80% of their life, as the kubelet does."""
        while True:
            await asyncio.sleep(max(5.0, life * 0.8 - 60))
            for pod in list(self.pods.values()):
                if pod.alive:
                    with contextlib.suppress(Exception):
                        life = await self._write_tokens(pod)

    async def start_agents(self, pods: list[FleetPod], concurrency: int = 16, progress=None) -> None:
        """Tokens, agent and client core for each pod; every agent listens at its pod IP."""
        sem = asyncio.Semaphore(concurrency)
        lives: list[float] = []
        done = 0

        async def one(pod: FleetPod) -> None:
            nonlocal done
            async with sem:
                lives.append(await self._write_tokens(pod))
                if self.keys is None:
                    kube = from_kubeconfig(self._kubeconfig(pod))
                    self.keys = IssuerKeys(kube.server, ssl_context=kube.ssl_context, bearer=kube.bearer)
                    await self.keys.refresh()
                await self._boot(pod)
                done += 1
                if progress:
                    progress(done, len(pods))

        await asyncio.gather(*(one(p) for p in pods))
        if self._refresher is None and lives:
            self._refresher = asyncio.create_task(self._refresh_tokens(min(lives)), name="fleet-tokens")

    def _kubeconfig(self, pod: FleetPod) -> Path:
        path = self._folder(pod) / "kubeconfig"
        if not path.exists():
            write_token_kubeconfig(self.handle, self._folder(pod) / "api-token", path, self.namespace)
        return path

    async def _boot(self, pod: FleetPod) -> None:
        """Start the pod's process: a new agent (new incarnation) and a new client core."""
        assert self.keys is not None
        config = AgentConfig(
            pod_name=pod.name,
            namespace=self.namespace,
            pod_uid=pod.uid,
            host=pod.ip,
            port=names.DEFAULT_AGENT_PORT,
            token_file=str(self._folder(pod) / "agent-token"),
            operator_service_accounts=(self.operator_subject,),
        )
        agent = FleetAgent(
            config,
            self.keys,
            control=self._control,
            lifecycle=self._lifecycle,
            on_free=lambda oid, n, p=pod: self._on_free(p, oid, n),
            on_info=lambda p=pod: self._on_info(p),
        )
        await agent.start()
        core = await ClientCore.create(
            from_kubeconfig(self._kubeconfig(pod)),
            pod_name=pod.name,
            namespace=self.namespace,
            pod_uid=pod.uid,
            agent=agent,
            token_file=self._folder(pod) / "agent-token",
            timeout=120.0,
            write_behind={
                "record": self.record,
                "window": WRITE_WINDOW,
                "max_pending": 100_000,
                "backpressure_timeout": 120.0,
            },
        )
        pod.agent, pod.core = agent, core
        pod.release_task = asyncio.create_task(core.releases.run(), name=f"releases-{pod.name}")

    # ------------------------------------------------------------ workload

    def alive(self) -> list[FleetPod]:
        return [p for p in self.pods.values() if p.alive]

    async def put(self, pod: FleetPod, name: str | None = None) -> ObjectRef:
        """An object through the real client path (agent put + write-behind GPUObject); with the policy
        "shared" an unnamed one stays private, unwritten, until it is shared."""
        assert pod.core is not None
        ref = await pod.core.put(torch.zeros(OBJECT_BYTES, dtype=torch.uint8), name=name)
        key = (pod.name, ref.address.object_id)
        self.referenced[key] = "owner"
        self.nbytes[key] = OBJECT_BYTES
        pod.owned[ref.address.object_id] = ref
        return ref

    async def recorded(self, pod: FleetPod, ref: ObjectRef, timeout: float) -> bool:
        """Until the object's record landed (a fleet write budget may hold it for its slot); False after timeout."""
        assert pod.core is not None
        return await pod.core.written(ref, timeout)

    def pacing(self) -> dict[str, float]:
        """The fleet's write-behinds summed: how the fleet write budget paced them (congestion.FleetPace)."""
        stats = [p.core.wb.stats() for p in self.pods.values() if p.core is not None and p.core.wb is not None]
        rates = sorted(s["fleetRate"] for s in stats if s["fleetRate"])
        return {
            "told": len(rates),
            "rate_median": rates[len(rates) // 2] if rates else 0.0,
            "paced_writes": sum(s["pacedWrites"] for s in stats),
            "paced_s": sum(s["pacedSeconds"] for s in stats),
            "sent": sum(s["sent"] for s in stats),
            "elided_while_paced": sum(s["elided_while_paced"] for s in stats),
        }

    async def release_owner(self, pod: FleetPod, object_id: str) -> None:
        """The producer drops its own reference (the bytes live on while a claim holds them)."""
        assert pod.core is not None
        ref = pod.owned.pop(object_id)
        key = (pod.name, object_id)
        if self.referenced.get(key) == "owner":
            del self.referenced[key]
        await pod.core.release(ref)

    async def hand_off(self, source: FleetPod, object_id: str, holder: FleetPod) -> None:
        """Share an object with `holder`'s current process, which adopts the claim (write-behind)."""
        assert source.core is not None and holder.core is not None and holder.agent is not None
        ref = source.owned[object_id]
        shared = await source.core.share(ref, holder.name, holder.uid, holder.agent.incarnation)
        key = (source.name, object_id)
        holder.claims[key] = holder.core.adopt(shared)
        self.referenced[key] = holder.name

    async def release_claim(self, holder: FleetPod, key: Key) -> None:
        assert holder.core is not None
        ref = holder.claims.pop(key)
        if self.referenced.get(key) == holder.name:
            del self.referenced[key]
        await holder.core.release(ref)

    async def put_shared(self, pod: FleetPod, holder: FleetPod, name: str | None) -> Key:
        """Put, hand off to `holder`, drop the owner reference: the object lives by one claim."""
        ref = await self.put(pod, name)
        object_id = ref.address.object_id
        await self.hand_off(pod, object_id, holder)
        await self.release_owner(pod, object_id)
        return (pod.name, object_id)

    async def flush(self, pods: list[FleetPod] | None = None, timeout: float = 600.0) -> None:
        """Every queued API write of these pods has landed (bounded)."""
        targets = [p for p in (pods or list(self.pods.values())) if p.alive and p.core is not None]
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(p.core.flush(timeout) for p in targets))  # type: ignore[union-attr]

    # ------------------------------------------------------------ trouble

    def _forget_process(self, pod: FleetPod) -> list[Key]:
        """The pod's process is gone: its handles with it (nothing released), its claims no longer count."""
        dropped = []
        for key, ref in pod.claims.items():
            ref.detach()
            if self.referenced.get(key) == pod.name:
                del self.referenced[key]
                dropped.append(key)
        for object_id, ref in pod.owned.items():
            ref.detach()
            self.referenced.pop((pod.name, object_id), None)
        pod.claims, pod.owned = {}, {}
        # Objects this pod's agent held are gone with its memory: nobody can be wrongly freed of them any more.
        for key in [k for k in self.referenced if k[0] == pod.name]:
            del self.referenced[key]
        return dropped

    async def _end_process(self, pod: FleetPod) -> None:
        if pod.release_task is not None:
            pod.release_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pod.release_task
        if pod.core is not None:
            with contextlib.suppress(Exception):
                await pod.core.close_writes()  # what is still queued dies with the process, unsent
            with contextlib.suppress(Exception):
                await pod.core.close_connections()
        if pod.agent is not None:
            await pod.agent.die()

    async def restart(self, pod: FleetPod) -> tuple[float, list[Key]]:
        """A container restart: the process dies, a new one (new incarnation) starts at the same pod IP,
        and the pod's status says so (restartCount + 1, a new containerID) as the kubelet would report it.
        Returns when it died and the claims its old process held."""
        assert self.admin is not None
        died = time.monotonic()
        dropped = self._forget_process(pod)
        await self._end_process(pod)
        pod.restarts += 1
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "containerStatuses": [
                {
                    "name": "workload",
                    "image": "gpuobj/workload:dev",
                    "imageID": "",
                    "containerID": f"containerd://{uuid.uuid4().hex}",
                    "ready": True,
                    "started": True,
                    "restartCount": pod.restarts,
                    "state": {"running": {"startedAt": now}},
                    "lastState": {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": now}},
                }
            ]
        }
        await self.admin.patch(PODS, pod.name, {"status": status}, self.namespace, subresource="status")
        await self._boot(pod)
        return died, dropped

    async def delete(self, pods: list[FleetPod]) -> tuple[float, list[Key]]:
        """Kill the pods' processes and delete them (kwok finishes the deletion, as a kubelet would).
        Returns when, and the claims they held."""
        assert self.admin is not None
        when = time.monotonic()
        dropped: list[Key] = []
        for pod in pods:
            dropped += self._forget_process(pod)
        await asyncio.gather(*(self._end_process(p) for p in pods))
        for pod in pods:
            pod.deleted = True

        async def one(pod: FleetPod) -> None:
            with contextlib.suppress(NotFound):
                await self.admin.delete(PODS, pod.name, self.namespace)  # type: ignore[union-attr]

        sem = asyncio.Semaphore(32)

        async def bounded(pod: FleetPod) -> None:
            async with sem:
                await one(pod)

        await asyncio.gather(*(bounded(p) for p in pods))
        return when, dropped

    # ------------------------------------------------------------ the truth

    def held(self) -> dict[Key, int]:
        """Bytes every live agent holds now, by object."""
        out: dict[Key, int] = {}
        for pod in self.alive():
            for object_id, n in pod.agent.held_bytes().items():  # type: ignore[union-attr]
                out[(pod.name, object_id)] = n
        return out

    def leaked_bytes(self) -> int:
        """Bytes held by a live agent that nothing references."""
        return sum(n for key, n in self.held().items() if key not in self.referenced)

    def unfreed(self, keys: list[Key]) -> list[Key]:
        """Of these, the objects still held by a live agent."""
        held = self.held()
        return [k for k in keys if k in held]

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for pod in self.pods.values():
            if pod.agent is not None and not pod.agent.stopped:
                self._forget_process(pod)
        await asyncio.gather(*(self._end_process(p) for p in self.pods.values()), return_exceptions=True)
        if self.admin is not None:
            await self.admin.close()
        self._control.shutdown(wait=False)
        self._lifecycle.shutdown(wait=False)
