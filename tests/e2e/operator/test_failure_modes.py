"""The failure modes from Ray's GPU-object and reference-counting history, end to end.

Each test is named after the failure mode of docs/design.md ("Five failure modes the design
prevents") that it proves absent, and would fail if it came back.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_records
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import GPUOBJECTS
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl


def _free(endpoint: str, object_id: str, token_file) -> tuple[int, dict]:
    status, answer = agent_http.request(
        endpoint,
        "POST",
        f"/v1/objects/{object_id}/free",
        token=token_file.read_text().strip(),
        body=b"{}",
        headers=agent_http.meant_for(endpoint),
    )
    return status, json.loads(answer)


def test_owner_side_metadata_gc_leaves_nothing_and_a_repeated_free_is_a_noop(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    # flush: the GPUObject is recorded before anything else happens. The write-behind may record it
    # late (seconds under load), and the wait below for it to be gone must not pass before it existed:
    # the late frees then came before the operator's, and one of them freed the object.
    src.run("ref = client.put([torch.ones(1 << 12)], name='w'); oid = ref.address.object_id; client.flush()")
    object_id = src.eval("oid")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    reader.run(f"h = client.adopt(load_pickle({shared!r})); client.fetch(h); h.release()")
    src.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "w", lambda o: o is None)
    # Late and concurrent frees of the same object: no-ops that say so, never errors (Ray's KeyError).
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _free(pods.endpoint("src"), object_id, token_file), range(4)))
    assert all(code == 200 and body["freed"] is False for code, body in answers), answers
    # Nothing about the object remains: not in the operator, not in either agent, not in the API.
    operator.wait_metric("gpuobj_objects", None, 0)  # every state
    operator.wait_metric("gpuobj_claims", None, 0)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_deregister_after_free_memory_reused_is_registered_once_and_reads_back_right(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """Deregistration happens before the memory can be reused: a new object in the same memory reads correctly."""
    src, reader = pods.workload("src"), pods.workload("reader")
    for round_ in range(3):
        # flush: recorded before the wait below for it to be gone (see the owner-side metadata GC test).
        src.run(f"buf = torch.full((1 << 14,), {round_}.0); ref = client.put([buf], name='r{round_}'); client.flush()")
        shared = src.eval_pickle("client.share(ref, 'reader')")
        reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]; h.release()")
        assert reader.eval("float(got.sum())") == round_ * (1 << 14)
        src.run("ref.release(); del buf")
        wait_object(gpuobj_cluster, namespace, f"r{round_}", lambda o: o is None)
        agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_streamed_item_leak_late_reports_failed_writes_and_stream_deletion_leave_nothing(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    producer, consumer = pods.workload("producer"), pods.workload("consumer")
    producer.run("w = client.stream_writer('tokens')")
    producer.run("for i in range(5): w.emit([torch.full((64,), float(i))])")
    consumer.run("r = iter(client.read_stream('tokens')); first = [float(next(r)[0][0]) for _ in range(3)]")
    assert consumer.eval("first") == [0.0, 1.0, 2.0]
    for consumed in range(3):  # released once read, then freed
        wait_object(gpuobj_cluster, namespace, f"tokens-{consumed}", lambda o: o is None)
    # A report of item 1 arriving after item 1 was consumed (a producer retrying its create):
    late = producer.eval(
        "client.core.object_body('tokens-1', 'o-late-report',"
        " [gpuobj.client.handles.TensorLayout((64,), 'float32', 'cpu')], stream=('tokens', 1, w.uid))"
    )
    kube(gpuobj_cluster, lambda k: k.create(GPUOBJECTS, late, namespace))
    wait_object(gpuobj_cluster, namespace, "tokens-1", lambda o: o is None)  # dropped, never counted
    # A write whose report fails (the name is taken): its bytes are freed at once.
    kube(
        gpuobj_cluster,
        lambda k: k.create(
            GPUOBJECTS,
            {
                "metadata": {"name": "tokens-5"},
                "spec": {"source": {"podName": "elsewhere"}, "tensors": [{"shape": [1], "dtype": "int8"}]},
            },
            namespace,
        ),
    )
    producer.run("try:\n    w.emit([torch.ones(64)])\n    failed = None\nexcept Exception as e:\n    failed = repr(e)")
    failed = producer.eval("failed")
    assert "NameTakenError" in failed and "already exists" in failed  # a GpuObjError, saying what happened
    gpuobj_cluster.kubectl("delete", "gpuobject", "tokens-5", "-n", namespace)
    # An item written but never reported (the producer crashed between the two):
    producer.run("client.agent.put('o-unreported', [torch.ones(64)], stream='tokens', stream_index=6)")
    # Deleting the stream frees every item: reported and unconsumed (3, 4) and unreported alike.
    consumer.run("client.delete_stream('tokens')")
    wait_until(lambda: agent_http.inventory(pods.endpoint("producer"), token_file)["objects"] == [], "items freed")
    agent_http.assert_holds_nothing(pods.endpoint("producer"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("consumer"), token_file)
    wait_until(
        lambda: user_records(gpuobj_cluster.kubectl("get", "gpuobj", "-n", namespace, "-o", "name").stdout) == [],
        "API empty",
    )
    assert_api_empty(gpuobj_cluster, namespace)


def test_teardown_without_deserialization_exiting_with_live_handles_releases_without_fetching(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, holder = pods.workload("src"), pods.workload("holder")
    src.run("big = client.put([torch.ones(1 << 20)], name='big'); client.flush()")  # recorded (see the first test)
    shared = src.eval_pickle("client.share(big, 'holder')")
    holder.run(f"h = client.adopt(load_pickle({shared!r}))")
    holder.run("own = client.put([torch.ones(8)], name='own')")
    # Dropping a handle releases it (garbage collection), without reading anything.
    holder.run("h2 = client.borrow(h); import gc; del h2; gc.collect()")
    # Exit with live handles: interpreter shutdown must release them, not fetch or deserialize them.
    assert holder.stop(timeout=60) == 0
    assert "Traceback" not in holder.output(), holder.output()
    wait_object(gpuobj_cluster, namespace, "own", lambda o: o is None)  # its owner handle was released
    src.run("big.release()")
    wait_object(gpuobj_cluster, namespace, "big", lambda o: o is None)  # the holder's claim went at exit
    assert agent_http.metric(pods.endpoint("src"), "gpuobj_agent_transfer_bytes_total") == 0
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)
