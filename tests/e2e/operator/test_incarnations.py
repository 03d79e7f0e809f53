"""A process that dies while its pod stays: its claims go, its objects become Lost, within seconds.

The Pod object is untouched in each scenario (a container crash or restart under a kubelet), so
the pod watch and the garbage collector see nothing: only the operator's agent probes can tell.
"""

from __future__ import annotations

import json

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, state, wait_object

pytestmark = pytest.mark.nixl


def _events(cluster: ClusterHandle, namespace: str, reason: str) -> list[dict]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"reason={reason}", "-o", "json")
    return json.loads(out.stdout)["items"]


def test_reader_process_killed_while_its_pod_stays_drops_its_claim_and_the_bytes_are_freed(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.ones(1 << 14)], name='kv'); client.flush()")
    address = src.eval_pickle("ref.address")
    reader.run(f"h = client.borrow(load_pickle({address!r})); client.flush(); got = client.fetch(h)[0]")
    [claim] = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    assert claim["spec"]["holder"] == {"podName": "reader", "incarnation": reader.eval("client.incarnation")}
    src.run("ref.release()")  # only the reader's claim holds the bytes now
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Releasing")

    pods.workloads["reader"].kill()  # the container crashes; the Pod object stays
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None)
    [event] = _events(gpuobj_cluster, namespace, "HolderGone")
    assert "is gone" in event["message"] and event["involvedObject"]["name"] == claim["metadata"]["name"]
    operator.wait_metric("gpuobj_claims_dropped_total", {"holder": "process"}, 1)
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_reader_container_restart_drops_the_old_process_claims_and_keeps_the_new_ones(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    address = src.eval_pickle("ref.address")
    reader.run(f"old = client.borrow(load_pickle({address!r})); client.flush()")
    reader = pods.restart_process("reader")  # same pod, same address, a new process
    reader.run(f"new = client.borrow(load_pickle({address!r})); client.flush(); got = client.fetch(new)[0]")
    new_incarnation = reader.eval("client.incarnation")

    def only_new_claim() -> bool:
        claims = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
        return [c["spec"]["holder"].get("incarnation") for c in claims] == [new_incarnation]

    wait_until(only_new_claim, "the old process's claim is dropped, the new one kept", timeout=30)
    operator.wait_metric("gpuobj_claims_dropped_total", {"holder": "process"}, 1)
    assert reader.eval("float(got.sum())") == 1 << 12
    src.run("ref.release()")
    reader.run("new.release()")
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_source_process_killed_while_its_pod_stays_makes_the_object_lost_and_readers_see_it(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    address = src.eval_pickle("ref.address")
    reader.run(f"h = client.borrow(load_pickle({address!r})); client.flush()")
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Ready")

    pods.workloads["src"].kill()  # the source container dies; nothing restarts it yet
    lost = wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Lost")
    available = next(c for c in lost["status"]["conditions"] if c["type"] == "SourceAvailable")
    assert (available["status"], available["reason"]) == ("False", "SourceAgentGone")
    # The reader's fetch says Lost, as for a deleted pod, not "unreachable".
    reader.run(
        "try:\n    client.fetch(h)\n    outcome = 'read'\nexcept gpuobj.ObjectLostError as e:\n    outcome = str(e)"
    )
    assert "Lost" in reader.eval("outcome")
    operator.wait_metric("gpuobj_lost_objects_total", None, 1)
    reader.run("h.release()")  # the last claim: released without a free (the bytes went with the process)
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None)
    operator.wait_metric("gpuobj_frees_total", {"result": "source-lost"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_hung_reader_with_a_ttl_claim_loses_it_when_the_ttl_runs_out(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    shared = src.eval_pickle("client.share(ref, 'reader', ttl=2)")
    src.run("client.flush()")  # recorded: the operator's part is what this test is about
    reader.run(f"h = client.adopt(load_pickle({shared!r}))")  # adopted, and then never released
    src.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None, timeout=30)
    [event] = _events(gpuobj_cluster, namespace, "Expired")
    assert "TTL of 2s expired" in event["message"]
    operator.wait_metric("gpuobj_claims_dropped_total", {"holder": "ttl"}, 1)
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_read_once_hand_off_is_freed_after_its_one_read(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.arange(1024, dtype=torch.float32)], name='kv'); client.flush()")
    incarnation = reader.eval("client.incarnation")
    shared = src.eval_pickle(f"client.share(ref, 'reader', incarnation={incarnation!r}, read_once=True)")
    src.run("client.flush()")  # recorded: the operator's part is what this test is about
    src.run("ref.release()")  # the hand-off: only the reader's claim holds the bytes
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval("float(got.sum())") == float(sum(range(1024)))
    assert not reader.eval("h.alive")  # released by its read
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None)
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_share_made_without_the_receivers_process_dies_with_the_process_that_adopted_it(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """The sender names only the receiver pod. The receiver adopts, reads, and its process is SIGKILLed
    while the Pod object stays (a container crash): the claim goes with that process, within seconds."""
    src, reader = pods.workload("src"), pods.workload("reader")
    incarnation = reader.eval("client.incarnation")
    src.run("ref = client.put([torch.ones(1 << 14)], name='kv'); client.flush()")
    shared = src.eval_pickle("client.share(ref, 'reader')")  # no incarnation=: the sender does not know it
    src.run("client.flush(); ref.release()")
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval("float(got.sum())") == 1 << 14
    [claim] = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    assert claim["spec"]["holder"] == {"podName": "reader"}  # pod-scoped in the API; the operator scopes it
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Releasing")

    pods.workloads["reader"].kill()  # the container crashes; the Pod object stays
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None)
    [event] = _events(gpuobj_cluster, namespace, "HolderGone")
    assert event["involvedObject"]["name"] == claim["metadata"]["name"]
    assert incarnation in event["message"] and "is gone" in event["message"]
    operator.wait_metric("gpuobj_claims_dropped_total", {"holder": "process"}, 1)
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_receiver_alive_but_slow_to_adopt_keeps_its_share(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    src.run("client.flush(); ref.release()")  # only the unadopted share holds the bytes
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Releasing")
    # Many probes and audits pass (0.25 s and 0.5 s apart) while the receiver does not adopt.
    audits = operator.metric("gpuobj_audit_runs_total", {"result": "ok"})
    wait_until(
        lambda: operator.metric("gpuobj_audit_runs_total", {"result": "ok"}) >= audits + 8, "8 more audits", 60, 0.1
    )
    assert len(user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])) == 1
    assert operator.metric("gpuobj_claims_dropped_total", {"holder": "process"}) == 0
    assert wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is not None)["status"]["state"] == "Releasing"
    # It adopts at last: the bytes are there, and its release frees them.
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]; h.release()")
    assert reader.eval("float(got.sum())") == 1 << 12
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None)
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)
