"""Rights end when they end (issues 19 and 21): a handle whose claim's ttl passed reads nothing.

Before: the operator dropped the claim at its ttl, and the still-running holder's fetch returned the
bytes (read with the grant it held, from memory another reference kept alive). The handle now knows
when its lease ends and refuses from then on (LeaseExpiredError), whether it reads with a grant or a
ticket; the bound on a raw reader replaying a grant is the source's fence (docs/security.md).
"""

from __future__ import annotations

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl

OUTCOME = """
try:
    outcome = float({call}[0].sum())
except Exception as exc:
    outcome = type(exc).__name__ + ': ' + str(exc)
"""


@pytest.mark.parametrize("how", ["share", "borrow"])
def test_a_handle_whose_claim_ttl_passed_refuses_to_fetch(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, how: str
) -> None:
    src = pods.workload("src")
    src.run("ref = client.put([torch.arange(256, dtype=torch.float32)], name='leased')")
    wait_object(gpuobj_cluster, namespace, "leased", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    holder = pods.workload("holder")
    if how == "share":  # a hand-off with a read grant: the fetch asks the source nothing
        src.run("shared = client.share(ref, 'holder', ttl=2); client.flush(30)")
        holder.run(f"got = client.adopt(load_pickle({src.eval_pickle('shared')!r}))")
    else:  # the holder's own claim: the fetch takes read tickets
        holder.run(f"got = client.borrow(load_pickle({src.eval_pickle('ref.address')!r}), ttl=2); client.flush(30)")
    holder.run(OUTCOME.format(call="client.fetch(got)"))
    assert holder.eval("outcome") == float(sum(range(256)))

    def claims() -> list[str]:
        return [
            c["metadata"]["name"]
            for c in user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
        ]

    assert len(claims()) == 1
    wait_until(lambda: claims() == [], "the operator to drop the claim at its ttl", 30)
    # The source still holds the object (its own reference): its bytes are there, the lease is not.
    assert agent_http.inventory(pods.endpoint("src"), pods.token_file)["objects"]
    holder.run(OUTCOME.format(call="client.fetch(got)"))
    outcome = holder.eval("outcome")
    assert isinstance(outcome, str) and outcome.startswith("LeaseExpiredError") and "ttl" in outcome, outcome
    assert holder.eval("got.alive") is False
    src.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "leased", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)
