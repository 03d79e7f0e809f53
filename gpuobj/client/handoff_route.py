"""The source's side of a hand-off release: the route a receiver posts to (docs/agent-api.md,
`POST /v1/claims/{claim}/release`), owned by the client whose write-behind queue made the claim.

Why here and not in the agent: only the client's queue knows a hand-off claim, so the agent knows
nothing of them. The client adds this route when it builds its agent (`register`, the agent's
`extra_routes`), through the agent's typed hook for read routes (`gpuobj_agent.server.add_reader_route`):
the caller's pod-bound token and channel are verified there, as for begin/end read, and this module's
errors are the agent's, answered as every route's. A core with a queue binds itself to its agent by
the agent's incarnation (`bind`), and unbinds at close.

The answers (gpuobj/client/handoff.py `answer_of` reads them): 200 taken; 404 when no live queue
here holds the claim for that pod (no core bound, its queue closed, an unknown claim, another pod's):
only then does the receiver delete it itself; 403 for a caller of another namespace or a token naming
no pod, never a 404. An agent built without this route (the standalone `python -m gpuobj_agent`)
answers 404 for the path too: no queue there made the claim.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from gpuobj_agent.auth import Forbidden
from gpuobj_agent.errors import BadRequest, ObjectNotFound
from gpuobj_agent.server import ReaderCall, add_reader_route
from gpuobj_contract import agent_api as api
from gpuobj_contract import patterns

# A receiver released hand-off claim `claim` (first argument) for pod `pod` (second): True when the
# source's queue took it, False when no live queue here holds it (the route answers 404).
HandoffSink = Callable[[str, str], Coroutine[Any, Any, bool]]

# Agent incarnation -> the sink of the core whose queue owns this process's hand-offs there. One
# process, few agents (the scale fleet runs many in one loop); touched on the agents' loop only.
_SINKS: dict[str, HandoffSink] = {}


def register(app: web.Application) -> None:
    """The agent's `extra_routes`: serve receivers' hand-off releases on this agent."""
    add_reader_route(app, api.RELEASE_HANDOFF, release)


def bind(incarnation: str, sink: HandoffSink) -> None:
    """Releases of hand-offs at agent ``incarnation`` go to ``sink`` (the core's queue owns them)."""
    _SINKS[incarnation] = sink


def unbind(incarnation: str, sink: HandoffSink) -> None:
    """``sink`` no longer takes releases there (a later core's binding is left alone)."""
    if _SINKS.get(incarnation) == sink:
        del _SINKS[incarnation]


def bound(incarnation: str) -> bool:
    return incarnation in _SINKS


def check_claim_name(claim: object) -> str:
    """A hand-off claim's name, checked as the object name the client builds (not as an object id: a
    refused name sent the receiver to its fallback delete, which could race the source's queued create)."""
    if not patterns.CLAIM_NAME.matches(claim):
        raise BadRequest(f"claim name {claim!r} is not valid: a Kubernetes object name (DNS-1123 subdomain)")
    return str(claim)


async def release(call: ReaderCall) -> dict[str, Any]:
    """A receiver drops a claim this process's queue made for it: the queue cancels the claim if it was
    never recorded, or deletes it in order. 404 only when no queue here holds the claim for that pod, so a
    refusal that is not that (another namespace, a token naming no pod) must not be a 404."""
    claim = check_claim_name(call.params["claim"])
    caller = call.caller
    if caller.namespace != call.namespace:
        # A hand-off is a claim in the source's namespace, made for a pod there.
        raise Forbidden(f"{caller.subject} may not release hand-offs of namespace {call.namespace}")
    await call.fields(frozenset())
    if caller.pod_name is None:
        raise Forbidden(f"{caller.subject}: a hand-off is released by its holder pod, and this token names none")
    sink = _SINKS.get(call.incarnation)
    # Bound to the holder: the sink releases the claim only for the pod it was made for (any other pod
    # gets the same 404 as for an unknown claim, so a claim's name is no capability).
    if sink is None or not await sink(claim, caller.pod_name):
        raise ObjectNotFound(claim)
    return api.HandoffReleaseAnswer().to_json()
