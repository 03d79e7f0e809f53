"""The client's release route (handoff_route.py) checks a hand-off claim's name as the object name the
client builds (issue 32): a name the client made must never be refused (a refusal sent the receiver to a
fallback delete that could race the source's queued create)."""

from __future__ import annotations

import pytest

from gpuobj.client.handoff_route import check_claim_name
from gpuobj_agent.errors import BadRequest


def test_the_longest_name_the_client_builds_is_accepted() -> None:
    # gpuobj/client/core.py: f"{address.name[:200]}-{holder_pod[:40]}-{id[:6]}", 248 characters at most.
    name = f"{'w' * 200}-{'p' * 40}-abc123"
    assert len(name) == 248
    assert check_claim_name(name) == name


@pytest.mark.parametrize("bad", ["", "Upper-case", "a/b", "x" * 254, "trailing-\n", "-lead"])
def test_a_name_no_claim_can_have_is_refused(bad: str) -> None:
    with pytest.raises(BadRequest):
        check_claim_name(bad)
