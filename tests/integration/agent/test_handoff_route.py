"""The hand-off release route is the client's (gpuobj/client/handoff_route.py, issue 32): an agent built
with it answers receivers as docs/agent-api.md says; the agent itself knows nothing of hand-offs, and one
built without the route (the standalone agent) answers 404 for the path, which a receiver reads as
"no queue here holds the claim" (handoff.answer_of) and not as a refusal to ask again forever.

Real in-process agents (real control server, real token verification by the loopback issuer)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from gpuobj.client import handoff, handoff_route
from gpuobj_agent.runtime import AgentRuntime

from .conftest import ISSUER, OPERATOR_TOKEN, TOKEN

pytestmark = pytest.mark.nixl

CLAIM = "w-obj-reader-abc123"


def release(rt: AgentRuntime, claim: str, token: str | None, body: object = None) -> tuple[int, Any]:
    data = json.dumps({} if body is None else body).encode()
    req = urllib.request.Request(f"http://{rt.endpoint}/v1/claims/{claim}/release", data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_an_agent_without_the_clients_route_disowns_every_hand_off(make_runtime) -> None:
    """The standalone agent: 404 to a receiver's release (before the route moved, the agent's own route
    answered it; a path it does not serve must not ask for the operator's token and read as unclear)."""
    rt = make_runtime("plain")
    for token in (TOKEN, None):
        status, answer = release(rt, CLAIM, token)
        assert status == 404, answer
        assert handoff.answer_of(status, None) is handoff.Answer.DISOWNED


def test_the_clients_route_takes_a_holders_release_and_refuses_as_the_contract_says(make_runtime) -> None:
    rt = make_runtime("source", extra_routes=handoff_route.register)
    taken: list[tuple[str, str]] = []

    async def sink(claim: str, pod: str) -> bool:
        taken.append((claim, pod))
        return pod == "reader"  # the claim was made for pod "reader"

    assert release(rt, CLAIM, TOKEN)[0] == 404  # no core bound: no queue here holds it
    handoff_route.bind(rt.incarnation, sink)
    try:
        assert release(rt, CLAIM, TOKEN) == (200, {"released": True})
        other = ISSUER.token("default/default", pod=("other", "other-uid"))
        assert release(rt, CLAIM, other)[0] == 404  # not its holder: the answer of an unknown claim
        assert taken == [(CLAIM, "reader"), (CLAIM, "other")]
        # Refusals that are not "no queue holds it" are never a 404 (the receiver would delete the claim).
        assert release(rt, CLAIM, ISSUER.token("default/default"))[0] == 403  # a token naming no pod
        assert release(rt, CLAIM, ISSUER.token("b/default", pod=("thief", "uid-t")))[0] == 403
        assert release(rt, CLAIM, OPERATOR_TOKEN)[0] in (401, 403)  # the operator holds no hand-off
        assert release(rt, CLAIM, None)[0] == 401
        assert release(rt, "Not-A-Name", TOKEN)[0] == 400
        assert release(rt, CLAIM, TOKEN, {"extra": 1})[0] == 400
        assert len(taken) == 2  # none of the refused reached the client's queue
    finally:
        handoff_route.unbind(rt.incarnation, sink)
    assert not handoff_route.bound(rt.incarnation)
    assert release(rt, CLAIM, TOKEN)[0] == 404
