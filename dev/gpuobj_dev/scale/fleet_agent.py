"""One fleet agent: the real agent store, fencer and control server of one fake pod, NIXL left out.

Why not `gpuobj_agent.agent.Agent`: each of its NIXL agents is a UCX worker with its own threads
and memory (tens of MB); a thousand of them do not fit on the machine the benchmark runs on. So a
fleet agent assembles the same parts Agent does (ObjectStore, Fencer, NixlState, ServiceAccountAuth,
the control server of `gpuobj_agent.server`) with one difference: its "NIXL agents" are
`UnregisteredTransport`s, which count registrations instead of making them. Everything the operator
and the client talk to is the agents' real code: info, inventory, free, tokens verified against the
API server's JWKS, the store's put/free/grant and write-behind bookkeeping. Nothing can read a fleet
agent's bytes with NIXL (no workload of the benchmark does).

The fleet (fleet.py) also plays the workload's process on top of it: a fleet agent is the
`gpuobj.client.agent_seam.AgentSeam` a pod's `ClientCore` runs on (mypy checks it, at the end of this
module). It is no `ReadingAgent`: it neither reads, nor takes published tensors, nor pools memory.
"""

from __future__ import annotations

import secrets
import ssl
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from gpuobj.client import handoff_route
from gpuobj_agent.auth import IssuerKeys, ServiceAccountAuth
from gpuobj_agent.config import AgentConfig
from gpuobj_agent.fencing import Fencer
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.server import build_app
from gpuobj_agent.store import ObjectStore
from gpuobj_contract import agent_api as api

if TYPE_CHECKING:
    from gpuobj.client.agent_seam import AgentSeam


class UnregisteredTransport:
    """Stands where a NIXL agent stands in a generation: registrations are counted, not made."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.registered = 0
        self.deregistered = 0
        self._closed = False

    def register(self, keys: Sequence[Any]) -> None:
        self.registered += len(keys)

    def deregister(self, keys: Sequence[Any]) -> None:
        self.deregistered += len(keys)

    def partial_metadata(self, keys: Sequence[Any]) -> bytes:
        return b""

    def serialized_descriptors(self, spans: Sequence[Any]) -> bytes | None:
        return None

    def notifications(self) -> dict[str, list[bytes]]:
        return {}

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed


class ObservedStore(ObjectStore):
    """The real store; every free that releases bytes is also told to the fleet (wrong-free accounting)."""

    on_free: Callable[[str, int], None] = staticmethod(lambda object_id, nbytes: None)

    async def free(self, object_id: str, *, reason: str | None = None, wait_fence: bool = False) -> api.FreeAnswer:
        result = await super().free(object_id, reason=reason, wait_fence=wait_fence)
        if result.freed:
            self.on_free(object_id, result.bytes)
        return result


class FleetAgent:
    """A pod's agent inside the fleet process; `start()` binds its control server at the pod's IP."""

    def __init__(
        self,
        config: AgentConfig,
        keys: IssuerKeys,
        *,
        control: Executor,
        lifecycle: Executor,
        on_free: Callable[[str, int], None],
        on_info: Callable[[], None],
    ) -> None:
        self.config = config
        self.incarnation = secrets.token_hex(8)
        self.started_wall = time.time()
        self.write_rate: float | None = None  # the pod's share of the fleet's write budget, as last told
        self.tokens = ServiceAccountAuth(
            keys, audience=config.audience, operators=frozenset(config.operator_service_accounts)
        )
        self.metrics = AgentMetrics(lambda: self.store.levels())
        self.nixl = NixlState(config.nixl_base_name(self.incarnation), control=control, metrics=self.metrics)
        self.store = ObservedStore(config, self.metrics, nixl=self.nixl, incarnation=self.incarnation)
        self.store.on_free = on_free
        self.reads = self.store.reads
        self.fencer = Fencer(
            self.store, self.nixl, config, self.metrics, lifecycle=lifecycle, agent_factory=UnregisteredTransport
        )
        self._on_info = on_info
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.stopped = False

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.port or self.config.port}"

    async def start(self) -> None:
        """Serve at the pod's address; a failed start (say, the address is taken) stops what it began."""
        await self.fencer.start()
        self.reads.start_pump()
        self._runner = web.AppRunner(
            build_app(self, handoff_route.register), access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True, backlog=512)
            await site.start()
        except BaseException:
            await self.die()
            raise
        self.port = int(self._runner.addresses[0][1])

    async def die(self) -> None:
        """The process ends: it stops answering and its memory goes (no free is counted, none was asked)."""
        if self.stopped:
            return
        self.stopped = True
        self.store.closing = True
        if self._runner is not None:
            await self._runner.cleanup()
        await self.reads.stop_pump()
        await self.store.release_all()
        await self.fencer.close()

    # -- what the control server serves (gpuobj_agent.server.Served) --------------------------
    def info(self) -> api.AgentInfo:
        self._on_info()  # the operator's liveness traffic, counted per agent
        return self.store.agent_info(started_wall=self.started_wall, endpoint=self.endpoint, write_rate=self.write_rate)

    def inventory(self) -> api.Inventory:
        return self.store.inventory()

    def tell_write_rate(self, per_second: float) -> None:
        self.write_rate = per_second or None

    def told_write_rate(self) -> float | None:
        return self.write_rate

    # -- what the client core calls on its pod's agent (gpuobj.client.agent_seam.AgentSeam) ---------
    serves_tls = False  # the fleet's control servers speak plain HTTP

    def client_tls(self) -> ssl.SSLContext | None:
        return None

    async def aput(
        self,
        object_id: str,
        tensors: Sequence[torch.Tensor],
        *,
        copy: bool = False,
        stream: str | None = None,
        stream_index: int | None = None,
        shared_with: Sequence[str] = (),
    ) -> None:
        await self.store.put(
            object_id, list(tensors), stream=stream, stream_index=stream_index, copy=copy, shared_with=shared_with
        )

    async def afree(self, object_id: str, *, wait_fence: bool = False) -> dict[str, Any]:
        return (await self.store.free(object_id, wait_fence=wait_fence)).to_json()

    async def agrant(self, object_id: str) -> dict[str, Any]:
        return (await self.reads.grant(object_id)).to_json()

    def set_record_pending(self, object_id: str, pending: bool) -> None:
        self.store.set_record_pending(object_id, pending)

    def set_private(self, object_id: str, private: bool) -> None:
        """The recording policy "shared" (docs/design.md): a held, unrecorded object is marked private in the
        inventory, so the audit neither counts nor reclaims it. Without this member the client records all."""
        self.store.set_private(object_id, private)

    def held_bytes(self) -> dict[str, int]:
        return {oid: obj.nbytes for oid, obj in self.store.objects.items()}


if TYPE_CHECKING:
    _seam: type[AgentSeam] = FleetAgent  # a fleet agent is what a ClientCore runs on
