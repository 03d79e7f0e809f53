"""A claim made just before the last release keeps the bytes: what the free's claims check protects.

The operator learns of objects and of claims through two watches, so it can see an object's
deletion before a claim made just before it. A free therefore first makes sure it has every claim
up to the deletion's version: from the in-order claims watch once that has passed it, else from a
read at exactly that version (operator/gpuobj_operator/claimcheck.py). The first test forces the
dangerous order (the deletion known, the claim not yet) on the real free path against the real API
server and a real agent; the second runs the real operator through the same sequence.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest

from gpuobj_contract import metric_names as m
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.agent_tls import PLAIN
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, ApiTimeout, KubeClient
from gpuobj_kube.config import from_kubeconfig
from gpuobj_kube.informer import wait_for
from gpuobj_operator.actions import Free
from gpuobj_operator.agent_client import AgentClient
from gpuobj_operator.claimcheck import Watermark
from gpuobj_operator.decisions import decide
from gpuobj_operator.events import EventRecorder
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.settings import Settings
from tests.e2e.operator.conftest import Pods, kube

pytestmark = pytest.mark.nixl

ARANGE = "torch.arange(4096, dtype=torch.float32)"


def operators_free_path(api: KubeClient, agents: AgentClient, namespace: str) -> Reconciler:
    """The operator's reconciler, driven by the test (no workers, watches or lease), as its ServiceAccount."""
    box: list[Reconciler] = []
    r = Reconciler(
        api,
        agents,
        OperatorMetrics(lambda: box[0].ledger),
        EventRecorder(api, "gpuobj-operator", "test"),
        Settings(namespace=namespace, allow_agent_host_annotation=True),
    )
    box.append(r)
    return r


def test_the_free_path_sees_a_claim_made_before_the_deletion_that_its_watch_has_not_delivered(
    gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, token_file: Path
) -> None:
    """No operator runs: the test drives the operator's own free path and plays its claims watch (plain HTTP:
    no signer runs to certify the agents, and the free path here calls them without TLS)."""
    src, late = pods.workload("src", env=PLAIN), pods.workload("late", env=PLAIN)
    src.run(f"ref = client.put([{ARANGE}], name='w'); client.flush()")

    async def scenario() -> None:
        async with KubeClient(from_kubeconfig(token_file.with_name("kubeconfig"))) as api:
            agents = AgentClient(token_file)
            r = operators_free_path(api, agents, namespace)
            mark = r.free_path.claims_watermark = Watermark()
            try:
                await r.sync()
                mark.observe((await api.list(CLAIMS, namespace))["metadata"]["resourceVersion"])  # no claim yet

                # A claim for a reader, then the owner's release, back to back (the write-behind keeps
                # this order): the claim exists before the deletion.
                src.run("shared = client.share(ref, 'late'); ref.release(); client.flush()")
                deleting = await api.get(GPUOBJECTS, "w", namespace)
                assert deleting["metadata"]["deletionTimestamp"]
                (claim,) = user_claims((await api.list(CLAIMS, namespace))["items"])
                assert int(claim["metadata"]["resourceVersion"]) < int(deleting["metadata"]["resourceVersion"])

                # The objects watch delivered the deletion; the claims watch has not delivered the claim.
                r.on_object("MODIFIED", deleting)
                actions = decide(r.ledger, "object", (namespace, "w"), dt.datetime.now(dt.UTC))
                assert any(isinstance(a, Free) for a in actions), actions  # the ledger alone would free
                for action in actions:
                    await r.execute(action)
                # The free read the claims at the deletion's version, saw the claim, and freed nothing.
                assert agent_http.inventory(pods.endpoint("src"), token_file)["objects"] != []
                assert (await api.get(GPUOBJECTS, "w", namespace))["metadata"]["finalizers"]

                # Once the claims watch has applied the claim, the object is decided again, and holds.
                while len(r.queue):  # (nothing works the queue here: empty it to see what comes back)
                    r.queue.done(await r.queue.get())
                mark.observe(claim["metadata"]["resourceVersion"])
                await asyncio.sleep(0)  # the watermark's callback runs
                assert len(r.queue) == 1 and ("object", (namespace, "w")) == await r.queue.get()
                r.on_claim("ADDED", claim)
                held = decide(r.ledger, "object", (namespace, "w"), dt.datetime.now(dt.UTC))
                assert not any(isinstance(a, Free) for a in held), held

                # The reader fetches the right bytes under its claim, then releases: the last reference.
                shared = src.eval_pickle("shared")
                late.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
                assert late.eval(f"bool(torch.equal(got, {ARANGE}))")
                late.run("h.release(); del got")  # through the source agent: its write-behind deletes it
                await wait_for(api, CLAIMS, claim["metadata"]["name"], namespace, lambda o: o is None, timeout=30)
                gone = await api.list(CLAIMS, namespace)
                r.on_claim("DELETED", claim)
                mark.observe(gone["metadata"]["resourceVersion"])  # the watch has passed the deletion
                actions = decide(r.ledger, "object", (namespace, "w"), dt.datetime.now(dt.UTC))
                assert any(isinstance(a, Free) for a in actions), actions
                for action in actions:
                    await r.execute(action)  # from the ledger: no claims read needed any more
                await wait_for(api, GPUOBJECTS, "w", namespace, lambda o: o is None, timeout=30)
            finally:
                await agents.close()

    asyncio.run(scenario())
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("late"), token_file)
    assert kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"] == []


def test_a_claim_made_just_before_the_owners_release_keeps_the_bytes_until_it_goes(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file: Path
) -> None:
    src, late = pods.workload("src"), pods.workload("late")
    rounds = 5
    for i in range(rounds):
        src.run(f"r{i} = client.put([{ARANGE} + {i}], name='w{i}'); client.flush()")
        # The claim lands a few milliseconds before the deletion: the two watches race.
        src.run(f"s{i} = client.share(r{i}, 'late'); r{i}.release(); client.flush()")
    for i in range(rounds):
        obj = kube(gpuobj_cluster, lambda k, i=i: k.get(GPUOBJECTS, f"w{i}", namespace))
        assert obj["metadata"]["deletionTimestamp"] and obj["metadata"]["finalizers"]
    assert len(agent_http.inventory(pods.endpoint("src"), token_file)["objects"]) == rounds
    for i in range(rounds):
        late.run(f"h = client.adopt(load_pickle({src.eval_pickle(f's{i}')!r})); got = client.fetch(h)[0]")
        assert late.eval(f"bool(torch.equal(got, {ARANGE} + {i}))")
        late.run("h.release(); del got, h")
    for i in range(rounds):
        kube(
            gpuobj_cluster, lambda k, i=i: wait_for(k, GPUOBJECTS, f"w{i}", namespace, lambda o: o is None, timeout=30)
        )
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, rounds)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("late"), token_file)
    assert kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"] == []
    assert user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"]) == []


def test_a_free_whose_finalizer_removal_failed_is_finished_by_its_retry_and_counted_once(
    gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, token_file: Path
) -> None:
    """The agent freed the bytes, then the API timed out removing the finalizer: the retry only removes
    the finalizer, and the free is counted and announced as freed (not as a no-op of a second free).
    No operator runs (plain HTTP, as above)."""
    src = pods.workload("src", env=PLAIN)
    src.run(f"ref = client.put([{ARANGE}], name='f'); client.flush(); ref.release(); client.flush()")

    async def scenario() -> None:
        async with KubeClient(from_kubeconfig(token_file.with_name("kubeconfig"))) as api:
            agents = AgentClient(token_file)
            r = operators_free_path(api, agents, namespace)
            patch, failures = api.patch, []

            async def times_out_once(*args, **kwargs):
                if not failures:
                    failures.append(args)
                    raise ApiTimeout(0, "Timeout", "no answer from the API server (injected)")
                return await patch(*args, **kwargs)

            try:
                await r.sync()
                (free,) = [a for a in decide(r.ledger, "object", (namespace, "f"), dt.datetime.now(dt.UTC))
                           if isinstance(a, Free)]  # fmt: skip
                api.patch = times_out_once  # type: ignore[method-assign]
                with pytest.raises(ApiTimeout):
                    await r.execute(free)  # freed on the agent; the finalizer stays
                assert agent_http.inventory(pods.endpoint("src"), token_file)["objects"] == []
                assert (await api.get(GPUOBJECTS, "f", namespace))["metadata"]["finalizers"]
                await r.execute(free)  # the retry
                await wait_for(api, GPUOBJECTS, "f", namespace, lambda o: o is None, timeout=30)
                frees = {s.labels["result"]: s.value for s in r.metrics.frees.collect()[0].samples if s.name == m.FREES}
                assert frees["freed"] == 1 and frees["noop"] == 0, frees
            finally:
                await agents.close()

    asyncio.run(scenario())
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
