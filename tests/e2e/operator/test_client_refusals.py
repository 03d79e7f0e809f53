"""What the client library tells a workload when the API server or a source agent refuses it, or is away.

Real workload processes (client library + embedded agent), each as its own pod-bound ServiceAccount
with the chart's workload role, against the real API server and operator:

- a name another pod holds fails the put with NameTakenError (on the handle and from flush), bytes freed;
- a reader in another namespace that the object does not grant hears about spec.sharedWith, never RBAC
  advice; a granted one hears Lost or NotFound from the source agent's answer (it may not read the API);
- share during an API outage is queued like a put;
- a stream reader rides out watch errors other than 410, and raises the real one when it persists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuobj_contract import names
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import install_identities
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.tcp_proxy import TcpProxy, server_address
from tests.e2e.operator.test_lifecycle import assert_api_empty, refs, wait_object

pytestmark = pytest.mark.nixl

CATCH = """
try:
    {stmt}
    err = None
except gpuobj.GpuObjError as e:
    err = [type(e).__name__, str(e)]
"""


def attempt(workload, stmt: str, timeout: float = 60) -> list | None:
    workload.run(CATCH.format(stmt=stmt), timeout=timeout)
    return workload.eval("err")


def via_proxy(pods: Pods, name: str, proxy: TcpProxy, folder: Path, env: dict[str, str] | None = None):
    """Pod ``name``'s process again, its API traffic through ``proxy`` (an outage for this client only)."""
    pods.extra_env[name] = {
        "KUBECONFIG": str(proxy.kubeconfig(pods.credentials[name].kubeconfig, folder / f"{name}-via-proxy")),
        **(env or {}),
    }
    return pods.restart_process(name)


def test_a_name_another_pod_holds_fails_the_put_with_name_taken_and_frees_the_bytes(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    first, second = pods.workload("first"), pods.workload("second")
    first.run("mine = client.put([torch.ones(64)], name='taken'); client.flush()")
    second.run("theirs = client.put([torch.zeros(1 << 16)], name='taken')")  # queued: the name is checked by the API
    name, message = attempt(second, "client.flush(30)")
    assert name == "NameTakenError" and "taken" in message and "another name" in message, message
    assert second.eval("type(theirs.failed).__name__") == "NameTakenError"
    agent_http.assert_holds_nothing(pods.endpoint("second"), token_file)  # its bytes were freed
    assert second.eval("client.write_stats()['pending']") == 0  # nothing retried forever
    assert wait_object(gpuobj_cluster, namespace, "taken", lambda o: o is not None)["spec"]["source"]["podName"] == (
        "first"
    )
    second.run("theirs.release(); client.flush(30)")  # releasing a refused handle is harmless
    first.run("mine.release(); client.flush(30)")
    wait_object(gpuobj_cluster, namespace, "taken", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("first"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


# Plain: the reader lives in another namespace, where no operator runs to sign its agent's certificate
# (a namespaced operator answers the CSRs of its own namespace only).
@pytest.mark.plain_agents
def test_a_reader_of_another_namespace_hears_about_shared_with_and_a_granted_one_hears_freed_or_lost(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, tmp_path: Path
) -> None:
    other = f"{namespace}-b"
    src = pods.workload("src")
    src.run(
        f"opened = client.put([torch.ones(256)], name='opened', shared_with=[{other!r}])\n"
        f"doomed = client.put([torch.ones(256)], name='doomed', shared_with=[{other!r}])\n"
        "closed = client.put([torch.ones(256)], name='closed')\n"
        "client.flush()"
    )
    addresses = {name: src.eval_pickle(f"{name}.address") for name in ("opened", "doomed", "closed")}
    gpuobj_cluster.create_namespace(other)
    readers = Pods(gpuobj_cluster, other, pods.token_file, tmp_path / other, plain=pods.plain)
    try:
        install_identities(gpuobj_cluster, other)
        reader = readers.workload("reader")
        fetch = "client.fetch(load_pickle({!r}))"
        # Not granted: the remedy is spec.sharedWith; RBAC in the source's namespace would be the wrong advice.
        name, message = attempt(reader, fetch.format(addresses["closed"]))
        assert name == "PermissionDeniedError" and "spec.sharedWith" in message, message
        assert "shared_with=" in message and "ServiceAccount" not in message and "Role" not in message, message
        # Granted: it reads; once freed it hears NotFound, once its source is gone it hears Lost.
        assert reader.eval(f"float({fetch.format(addresses['opened'])}[0].sum())") == 256.0
        src.run("opened.release(); client.flush()")
        wait_object(gpuobj_cluster, namespace, "opened", lambda o: o is None)
        name, message = attempt(reader, fetch.format(addresses["opened"]))
        assert name == "ObjectNotFoundError" and "opened" in message, message
        pods.workloads["src"].kill()  # the source process dies: its bytes with it
        name, message = attempt(reader, fetch.format(addresses["doomed"]))
        assert name == "ObjectLostError" and "doomed" in message, message
    finally:
        readers.close()
        gpuobj_cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    pods.delete_pod("src")  # the operator frees what the dead process held
    for name in ("doomed", "closed"):
        wait_object(gpuobj_cluster, namespace, name, lambda o: o is None)
    assert_api_empty(gpuobj_cluster, namespace)


def test_share_during_an_api_outage_is_queued_like_a_put(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file, tmp_path
) -> None:
    proxy = TcpProxy(*server_address(gpuobj_cluster.kubeconfig)).up()
    try:
        pods.workload("src")
        reader = pods.workload("reader")
        src = via_proxy(pods, "src", proxy, tmp_path)
        src.run("ref = client.put([torch.arange(1024, dtype=torch.float32)], name='handed'); client.flush()")
        proxy.down()  # the API server is gone, for the source only
        src.run("shared = client.share(ref, 'reader')")  # no API read on the caller's path: queued
        src.run("ref.release()")  # queued after the claim's create
        shared = src.eval_pickle("shared")
        reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
        assert reader.eval("float(got.sum())") == float(sum(range(1024)))
        assert src.eval("client.write_stats()['pending']") >= 2  # the claim's create and the owner's delete
        proxy.up()
        src.run("client.flush(60)")
        # Recorded in order, for the receiver's current incarnation: the claim alone keeps the object.
        wait_object(gpuobj_cluster, namespace, "handed", lambda o: o is not None and refs(o) == 1)
        claims = kube(
            gpuobj_cluster, lambda k: k.list(CLAIMS, namespace, label_selector=f"{names.LABEL_OBJECT}=handed")
        )["items"]
        assert [c["metadata"]["ownerReferences"][0]["uid"] for c in claims] == [pods.uids["reader"]], claims
        reader.run("h.release(); client.flush(60)")
        wait_object(gpuobj_cluster, namespace, "handed", lambda o: o is None)
        wait_until(lambda: agent_http.inventory(pods.endpoint("src"), token_file)["objects"] == [], "the free")
        agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
        assert_api_empty(gpuobj_cluster, namespace)
    finally:
        proxy.close()


READ_IN_THREAD = """
import threading
import gpuobj.client.streams as streams_module
streams_module.WATCH_GIVE_UP_SECONDS = {seconds}
reader = client.read_stream('tokens', item_timeout=120)
got, failure = [], []
def consume():
    try:
        for tensors in reader:
            got.append(float(tensors[0][0]))
    except gpuobj.GpuObjError as e:
        failure.append([type(e).__name__, str(e)])
consumer = threading.Thread(target=consume, daemon=True)
consumer.start()
"""


def test_a_stream_reader_rides_out_watch_errors_and_raises_the_real_one_when_they_persist(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file, tmp_path
) -> None:
    proxy = TcpProxy(*server_address(gpuobj_cluster.kubeconfig)).up()
    try:
        producer = pods.workload("producer")
        pods.workload("consumer")
        consumer = via_proxy(pods, "consumer", proxy, tmp_path)
        producer.run("w = client.stream_writer('tokens'); w.emit([torch.zeros(8)])")
        # Retries enough for any machine's pace here; the outage below lasts until the reader saw it.
        consumer.run(READ_IN_THREAD.format(seconds=600))
        wait_until(lambda: consumer.eval("got") == [0.0], "the first item")
        proxy.down()
        wait_until(lambda: consumer.eval("reader.watch_failures") >= 2, "the reader's watches to fail")
        proxy.up()
        producer.run("w.emit([torch.ones(8)]); w.emit([torch.full((8,), 2.0)]); w.close()")
        consumer.run("consumer.join(120)")
        assert consumer.eval("failure") == [] and consumer.eval("got") == [0.0, 1.0, 2.0]
        # Now an outage that persists: the reader raises the API server's error, not "did not arrive".
        producer.run("w2 = client.stream_writer('tokens2'); w2.emit([torch.zeros(8)])")
        consumer.run(READ_IN_THREAD.replace("'tokens'", "'tokens2'").format(seconds=3))
        wait_until(lambda: consumer.eval("got") == [0.0], "the first item of the second stream")
        proxy.down()
        consumer.run("consumer.join(120)")
        failure = consumer.eval("failure")
        assert failure and failure[0][0] == "ApiUnavailableError", failure
        assert "did not arrive" not in failure[0][1], failure
        proxy.up()
        producer.run("client.delete_stream('tokens'); client.delete_stream('tokens2')")
        wait_until(lambda: agent_http.inventory(pods.endpoint("producer"), token_file)["objects"] == [], "items freed")
        agent_http.assert_holds_nothing(pods.endpoint("consumer"), token_file)
    finally:
        proxy.close()
