"""Write-behind and elision end to end: the real API server, operator and agent processes.

The client queues its API writes (gpuobj/client/writebehind.py); these tests check the
semantics, never timings: what lives inside the window is never recorded and is freed;
a hand-off survives the sender's release; an API outage slows puts with a clear error and
loses no write; a process killed inside the window leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.api_requests import delta, request_counts, writes
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, GPUOBJECTS
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.tcp_proxy import TcpProxy, server_address
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl

ARANGE = "torch.arange({n}, dtype=torch.float32)"
LONG_WINDOW = {"GPUOBJ_WRITE_WINDOW": "30"}  # the whole scenario fits inside it, however slow the machine


def held(pods: Pods, name: str, token_file: Path) -> list[str]:
    return [o["id"] for o in agent_http.inventory(pods.endpoint(name), token_file)["objects"]]


def test_an_elided_object_is_visible_while_alive_freed_and_never_recorded(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src", LONG_WINDOW), pods.workload("reader", LONG_WINDOW)
    # The API server's counters are cluster-wide: let the namespace controller finish emptying earlier
    # tests' namespaces (its LIST and DELETE of gpuobjects/claims) before we count.
    wait_until(
        lambda: not gpuobj_cluster.terminating_namespaces(), "earlier test namespaces to go", timeout=120, interval=0.2
    )
    before = request_counts(gpuobj_cluster, {"gpuobjects", "gpuobjectclaims"})
    src.run(f"ref = client.put([{ARANGE.format(n=1 << 16)}], name='short')")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    # Alive and unrecorded: the agent's inventory and metrics show its bytes, for the audit to see.
    assert held(pods, "src", token_file) == [src.eval("ref.address.object_id")]
    assert agent_http.metric(pods.endpoint("src"), "gpuobj_agent_store_bytes") == 4 << 16
    assert src.eval("ref.pending") is True
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval(f"bool(torch.equal(got, {ARANGE.format(n=1 << 16)}))")
    reader.run("h.release(); client.flush()")
    src.run("ref.release()")  # the last reference, inside the window: freed here and now
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    src.run("client.flush()")
    assert src.eval("client.write_stats()['elided_families']") == 1
    sent = delta(request_counts(gpuobj_cluster, {"gpuobjects", "gpuobjectclaims"}), before)
    assert writes(sent) == 0, sent
    assert_api_empty(gpuobj_cluster, namespace)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)


def test_a_hand_off_inside_the_window_survives_the_senders_release(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    env = {"GPUOBJ_WRITE_WINDOW": "0.2"}
    src, reader = pods.workload("src", env), pods.workload("reader", env)
    src.run(f"ref = client.put([{ARANGE.format(n=1 << 16)}], name='handed')")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    src.run("ref.release()")  # inside the window; the receiver's claim must be recorded before this delete
    src.run("client.flush()")
    # Recorded in order (object, claim, then the owner's delete): Releasing, held by the claim alone.
    wait_object(gpuobj_cluster, namespace, "handed", lambda o: o and (o.get("status") or {}).get("references") == 1)
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval(f"bool(torch.equal(got, {ARANGE.format(n=1 << 16)}))")
    reader.run("h.release()")  # goes to the source, whose queue deletes the recorded claim
    wait_object(gpuobj_cluster, namespace, "handed", lambda o: o is None)
    wait_until(lambda: held(pods, "src", token_file) == [], "the source to free the object")
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_only_the_source_deletes_a_hand_off_it_queued_so_a_release_never_runs_ahead_of_its_create(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """Issue 32: a receiver that deleted a hand-off's claim in the API itself (here one that writes its own
    records at once, GPUOBJ_WRITE_BEHIND=0) deleted nothing, since the source's queue still held the claim's
    create; the create then recorded the claim, which held the bytes until the receiver's process ended.
    It failed so: after the source's last release and flush the object stayed, Releasing, with the claim.
    The release goes to the source, whose queue takes the claim back: nothing is ever written."""
    src = pods.workload("src", LONG_WINDOW)
    reader = pods.workload("reader", {"GPUOBJ_WRITE_BEHIND": "0"})
    src.run(f"ref = client.put([{ARANGE.format(n=1 << 16)}], name='queued')")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval(f"bool(torch.equal(got, {ARANGE.format(n=1 << 16)}))")
    reader.run("h.release(); client.flush()")  # inside the source's window: its create is still queued
    src.run("ref.release(); client.flush()")  # the last reference: the family never leaves the queue
    assert src.eval("client.write_stats()['elided_families']") == 1
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_an_api_outage_slows_puts_with_a_clear_error_and_loses_no_write(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file, tmp_path
) -> None:
    proxy = TcpProxy(*server_address(gpuobj_cluster.kubeconfig)).up()
    try:
        pods.workload("src")  # its pod and ServiceAccount credentials; then the process again, through the proxy
        pods.extra_env["src"] = {
            "KUBECONFIG": str(proxy.kubeconfig(pods.credentials["src"].kubeconfig, tmp_path / "via-proxy")),
            "GPUOBJ_WRITE_WINDOW": "0",  # record everything: no elision here
            "GPUOBJ_MAX_PENDING_WRITES": "4",
            "GPUOBJ_BACKPRESSURE_TIMEOUT": "1",
        }
        src = pods.restart_process("src")
        src.run("refs = [client.put([torch.ones(1024)], name=f'kept-{i}') for i in range(2)]; client.flush()")
        proxy.down()  # the API server is gone, for this client only
        src.run("refs += [client.put([torch.ones(1024)], name=f'kept-{i}') for i in range(2, 4)]")
        src.run("refs[0].release(); refs[1].release()")  # releases queue even when full: never dropped
        src.run(
            "try:\n    client.put([torch.ones(1024)], name='over')\n    err = None\n"
            "except gpuobj.GpuObjError as e:\n    err = str(e)"
        )
        err = src.eval("err")
        assert err and "API writes are waiting" in err and "Nothing was dropped" in err, err
        assert src.eval("[r.pending for r in refs]") == [True, True, True, True]
        proxy.up()  # it comes back: every queued write lands, in order
        src.run("client.flush(60)")

        def names() -> set[str]:
            return {
                o["metadata"]["name"] for o in kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"]
            }

        # 0 and 1 were created, then deleted (the operator frees them); 'over' was never queued.
        wait_until(lambda: names() == {"kept-2", "kept-3"}, "the released objects to go, the kept ones to stay")
        assert src.eval("[r.pending for r in refs[2:]]") == [False, False]
        wait_until(lambda: len(held(pods, "src", token_file)) == 2, "the source to free the released objects")
        src.run("refs[2].release(); refs[3].release(); client.flush(60)")
        wait_until(lambda: held(pods, "src", token_file) == [], "the source to free every object")
        wait_object(gpuobj_cluster, namespace, "kept-3", lambda o: o is None)
        agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
        assert_api_empty(gpuobj_cluster, namespace)
    finally:
        proxy.close()


def test_a_process_killed_inside_the_window_leaves_nothing_after_the_audit(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src", LONG_WINDOW), pods.workload("reader", LONG_WINDOW)
    src.run(f"ref = client.put([{ARANGE.format(n=1 << 16)}], name='doomed')")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    src.kill()  # the bytes die with the process; nothing was recorded
    fresh = pods.restart_process("src")
    assert fresh.eval("1") == 1
    # The receiver's release finds the source gone and falls back to the API (nothing there).
    reader.run(f"h = client.adopt(load_pickle({shared!r})); h.release(); client.flush()")
    # Two more audits of every agent after the restart: neither finds anything leaked or missing.
    audits = operator.metric("gpuobj_audit_runs_total")
    wait_until(lambda: operator.metric("gpuobj_audit_runs_total") >= audits + 4, "two more audit rounds", 30)
    assert operator.metric("gpuobj_leaked_bytes") == 0
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_an_outage_longer_than_the_leak_grace_never_lets_the_audit_free_a_live_object(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file, tmp_path
) -> None:
    """The client cannot reach the API server, the operator can: the put's GPUObject waits in the client's
    queue past --leak-grace (2 s here) while the operator audits the agent. Its inventory says the record is
    pending, so the audit counts the bytes but never frees them; once the API answers, the record lands."""
    proxy = TcpProxy(*server_address(gpuobj_cluster.kubeconfig)).up()
    try:
        pods.workload("src")
        pods.extra_env["src"] = {
            "KUBECONFIG": str(proxy.kubeconfig(pods.credentials["src"].kubeconfig, tmp_path / "via-proxy")),
            "GPUOBJ_WRITE_WINDOW": "0",  # record at once: no elision
        }
        src = pods.restart_process("src")
        proxy.down()  # for this client only
        src.run(f"ref = client.put([{ARANGE.format(n=1024)}], name='late')")

        def inventory() -> list[dict]:
            return agent_http.inventory(pods.endpoint("src"), token_file)["objects"]

        assert [o["recordPending"] for o in inventory()] == [True]
        audited = operator.metric("gpuobj_audit_runs_total", {"result": "ok"})
        # Past the grace, and audited twice more after that: a reclaim would have happened by now.
        wait_until(lambda: all(o["ageSeconds"] > 3 for o in inventory()), "the object to outlive the grace", 30)
        wait_until(lambda: operator.metric("gpuobj_audit_runs_total", {"result": "ok"}) >= audited + 8, "audits", 30)
        assert [o["recordPending"] for o in inventory()] == [True]  # still held, still waiting
        assert operator.metric("gpuobj_reclaimed_bytes_total") == 0
        operator.wait_metric("gpuobj_leaked_bytes", None, 4096)  # past the grace it shows, though
        proxy.up()
        src.run("client.flush(60)")
        assert [o["recordPending"] for o in inventory()] == [False]
        wait_object(gpuobj_cluster, namespace, "late", lambda o: o is not None)
        assert src.eval(f"bool(torch.equal(client.fetch(ref)[0], {ARANGE.format(n=1024)}))")
        src.run("ref.release(); client.flush(60)")
        wait_object(gpuobj_cluster, namespace, "late", lambda o: o is None)
        agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
        operator.wait_metric("gpuobj_leaked_bytes", None, 0)
        assert operator.metric("gpuobj_reclaimed_bytes_total") == 0
        assert_api_empty(gpuobj_cluster, namespace)
    finally:
        proxy.close()


def test_a_private_object_makes_no_api_write_and_the_audit_leaves_it_until_it_is_shared(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """GPUOBJ_RECORD=shared: an unnamed object its own process holds lives past the window and the leak
    grace (2 s here) with no API write; the inventory marks it private, so the audit neither counts nor
    reclaims it. A share records it, before the claim, and its releases free it as for any object."""
    src = pods.workload("src", {"GPUOBJ_RECORD": "shared", "GPUOBJ_WRITE_WINDOW": "0"})
    reader = pods.workload("reader")
    wait_until(
        lambda: not gpuobj_cluster.terminating_namespaces(), "earlier test namespaces to go", timeout=120, interval=0.2
    )
    before = request_counts(gpuobj_cluster, {"gpuobjects", "gpuobjectclaims"})
    src.run(f"ref = client.put([{ARANGE.format(n=1024)}]); client.flush()")

    def inventory() -> list[dict]:
        return agent_http.inventory(pods.endpoint("src"), token_file)["objects"]

    assert [o["private"] for o in inventory()] == [True]
    audited = operator.metric("gpuobj_audit_runs_total", {"result": "ok"})
    wait_until(lambda: all(o["ageSeconds"] > 3 for o in inventory()), "the object to outlive the grace", 30)
    wait_until(lambda: operator.metric("gpuobj_audit_runs_total", {"result": "ok"}) >= audited + 8, "audits", 30)
    assert operator.metric("gpuobj_reclaimed_bytes_total") == 0
    assert operator.metric("gpuobj_leaked_bytes") == 0
    sent = delta(request_counts(gpuobj_cluster, {"gpuobjects", "gpuobjectclaims"}), before)
    assert writes(sent) == 0, sent
    assert src.eval("client.write_stats()['private']") == 1
    # Shared: recorded (the GPUObject, then the reader's claim), read, released, freed.
    shared = src.eval_pickle("client.share(ref, 'reader')")
    src.run("client.flush()")
    assert [o["private"] for o in inventory()] == [False]
    wait_object(gpuobj_cluster, namespace, src.eval("ref.address.name"), lambda o: o is not None)
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval(f"bool(torch.equal(got, {ARANGE.format(n=1024)}))")
    # The reader's claim (pinned to the object's uid) reads Bound from the CRD's default, with no status
    # write: once the object's status counts the claim, the claim's status is still the default alone.
    name = src.eval("ref.address.name")
    wait_object(gpuobj_cluster, namespace, name, lambda o: ((o or {}).get("status") or {}).get("claims") == 1)
    (held,) = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    assert held["spec"].get("objectUID") and held["status"] == {"state": "Bound"}, held
    src.run("ref.release(); client.flush()")
    reader.run("h.release(); client.flush()")
    wait_until(lambda: not inventory(), "the shared object to be freed", 60)
    assert_api_empty(gpuobj_cluster, namespace)
    assert operator.metric("gpuobj_reclaimed_bytes_total") == 0
