"""The seam between the client core and the pod's agent: the members the core uses, and nothing else.

Why a Protocol of its own: the core used to hold the agent as `Any` and probe it (getattr, hasattr,
inspect.signature), so a member renamed on the agent's side failed at run time, or silently turned a
feature off. Here every member is declared once with its types; mypy holds each implementation to it
where one is passed as an `AgentSeam` (the embedded `gpuobj_agent.runtime.AgentRuntime` in
`Client.connect`; the scale fleet's `FleetAgent` in its module).

Two levels, and the core asks which one it has once, at construction (`reader_of`), never per call:

- `AgentSeam`: every agent a core runs on stores, frees and grants this pod's objects, serves the
  write-behind's bookkeeping (record pending, private). Receivers' hand-off releases are the client's
  own route (gpuobj/client/handoff_route.py), added where the agent is built; nothing of the seam.
- `ReadingAgent`: an agent that also reads other agents' objects (fetch, granted and direct reads),
  takes published tensors and pools memory (a put with ``on_release``). The embedded runtime is one;
  the scale fleet's agents are not (they hold bytes nobody reads). Only methods, so that the
  `isinstance` check evaluates no property.

Where the core runs (`loop_of`, asked once by `gpuobj.Client`): an agent that runs an event loop of
its own (`LoopHost`: the embedded runtime, on its thread) lends it to the core, so the process runs
one loop and every call across this seam is a plain await on it. An agent with no loop of its own
(the scale fleet's, or a unit test's) runs on whatever loop awaits it: the core's.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from gpuobj.client.shards import Piece

# A read grant as the source agent writes it (gpuobj_contract.agent_api.ReadTicket's JSON, with
# `generation`): it travels inside a SharedRef to the receiver, so it stays the wire form.
Grant = dict[str, Any]


class AgentSeam(Protocol):
    """What every agent a ClientCore runs on offers."""

    @property
    def endpoint(self) -> str:
        """host:port where other pods and the operator reach this agent."""
        ...

    @property
    def incarnation(self) -> str:
        """This agent process's random id: a claim made for it dies with it."""
        ...

    @property
    def serves_tls(self) -> bool:
        """Whether this agent serves (and calls other agents over) TLS."""
        ...

    def client_tls(self) -> ssl.SSLContext | None:
        """What this pod presents when it calls another agent (None when it serves plain HTTP)."""
        ...

    async def aput(
        self,
        object_id: str,
        tensors: Sequence[torch.Tensor],
        *,
        copy: bool = False,
        stream: str | None = None,
        stream_index: int | None = None,
        shared_with: Sequence[str] = (),
    ) -> object:
        """Hold and register `tensors` under `object_id` (the core reads nothing of the answer)."""
        ...

    async def afree(self, object_id: str) -> object:
        """Free an object held here (idempotent; the core reads nothing of the answer)."""
        ...

    async def agrant(self, object_id: str) -> Grant:
        """A read grant for an object held here, to embed in a hand-off."""
        ...

    def set_record_pending(self, object_id: str, pending: bool) -> None:
        """The write-behind's word: the object's GPUObject is (not yet) recorded (on the agent's loop)."""
        ...

    def set_private(self, object_id: str, private: bool) -> None:
        """The write-behind's word: the object is private, held and never recorded (docs/design.md; on the
        agent's loop)."""
        ...

    def told_write_rate(self) -> float | None:
        """This pod's share of the fleet's write budget (writes a second) as the operator last told the
        agent on a probe, or None: no budget (docs/write-behind.md, "A budget the fleet shares")."""
        ...


@runtime_checkable
class ReadingAgent(Protocol):
    """An agent that also reads, publishes and pools: the embedded runtime (methods only, see above)."""

    async def aput(
        self,
        object_id: str,
        tensors: Sequence[torch.Tensor],
        *,
        copy: bool = False,
        stream: str | None = None,
        stream_index: int | None = None,
        shared_with: Sequence[str] = (),
        on_release: Callable[[], None] | None = None,
    ) -> object:
        """``on_release``: the tensors are pooled memory; the region stays registered past the free."""
        ...

    async def afetch(
        self,
        endpoint: str,
        object_id: str,
        *,
        device: str = "cpu",
        token: str | None = None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """Read an object from the agent at `endpoint` (`select`: only these pieces)."""
        ...

    async def afetch_granted(
        self,
        endpoint: str,
        object_id: str,
        grant: Grant,
        *,
        device: str = "cpu",
        token: str | None = None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """Read with a hand-off's grant (no request to the source unless the grant went stale)."""
        ...

    def fetch_granted_direct(
        self, endpoint: str, object_id: str, grant: Grant, *, device: str = "cpu", timeout: float | None = None
    ) -> list[torch.Tensor]:
        """Read with a grant in the calling thread; raises if the grant went stale."""
        ...

    def publish(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Offer tensors under `key` for a GPUObject declared with kubectl to bind."""
        ...


@runtime_checkable
class LoopHost(Protocol):
    """An agent that runs its own event loop on a thread of its own (the embedded runtime)."""

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the agent serves on; the client core runs there too."""
        ...


def loop_of(agent: AgentSeam) -> asyncio.AbstractEventLoop | None:
    """The agent's own loop for the core to run on, or None when it runs on its caller's loop."""
    return agent.event_loop() if isinstance(agent, LoopHost) else None


def reader_of(agent: AgentSeam) -> ReadingAgent | None:
    """The agent as a ReadingAgent, or None when it only stores (asked once, by the core's constructor)."""
    return agent if isinstance(agent, ReadingAgent) else None
