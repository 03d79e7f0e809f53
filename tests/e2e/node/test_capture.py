"""A capture of the pod network shows no bearer token (issue 21, item 3; docs/security.md "TLS to agents").

The chart installed on the real node, two workload pods from deploy/examples/workload-pod.yaml, a raw
packet socket on the pods' bridge (tests/e2e/node/packets.py) while the operator materializes and frees
an object and one pod reads the other's object: with the hand-off's grant (NIXL alone, no request), then
by address over the agent HTTP path (a read ticket with the reader's token, then NIXL). With TLS on, the
grant read and the hand-off's release send nothing to the source's agent (core.py: no release is sent
unverified), so only the read by address puts the reader's token on the wire: it must be there to be
looked for.
TLS on (the chart's default, `GPUOBJ_AGENT_TLS=csr` in the pods): the capture sees TLS handshakes on the
agent port from the operator and from the reader, and no `Bearer ` and no JWT anywhere. TLS off (the
control): the same capture finds `Bearer ` and a JWT on the agent port, which proves it sees payloads.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from gpuobj_dev import node as devnode
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.waits import wait_until
from tests.e2e.deploy.support import CHART
from tests.e2e.node.conftest import Pods, dump_cluster
from tests.e2e.node.packets import BEARER, JWT, Capture, is_client_hello, is_tls_record
from tests.e2e.node.test_real_pods import RELEASE, SYSTEM_NS, Workload, chart_values, gpuobjects, workload_docs

pytestmark = [pytest.mark.node, pytest.mark.timeout(1500)]

AGENT_PORT = 8471  # the container port named gpuobj-agent in the example


def test_the_capture_finds_a_token_split_across_segments_and_keeps_each_segment_once() -> None:
    """The capture itself, on loopback (no node needed, root only): a real connection sends an HTTP header
    in three segments, `Bearer ` and the JWT each cut in two; a TLS ClientHello-shaped record on another."""
    if os.geteuid() != 0:
        pytest.skip("a packet socket needs root")
    token = b"eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"
    parts = [b"GET / HTTP/1.1\r\nAuthorization: Bea", b"rer " + token[:12], token[12:] + b"\r\n\r\n"]
    hello = bytes([0x16, 0x03, 0x01, 0x00, 0x04, 0x01, 0x00, 0x00, 0x00])
    with socket.create_server(("127.0.0.1", 0)) as server, Capture("lo", "127.0.0.0/8") as cap:
        port = server.getsockname()[1]
        for chunks in (parts, [hello]):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(10)
                    got = b""
                    for chunk in chunks:
                        c.sendall(chunk)
                        while not got.endswith(chunk):  # one segment each: the peer has it before the next
                            got += conn.recv(65536)
    mine = {f for f, _ in cap.on_port(port)}  # loopback carries other processes' traffic too
    (bearer,) = [f for f in cap.find(BEARER) if f in mine]
    assert [f for f in cap.find(JWT) if f in mine] == [bearer] and bearer.dport == port
    flows = [(f, d) for f, d in cap.on_port(port) if f.dport == port and d.segments]
    assert sorted(d.payload() for _, d in flows) == sorted([b"".join(parts), hello])
    assert [is_client_hello(d.payload()) for _, d in flows].count(True) == 1
    assert all(is_tls_record(d.payload()) == is_client_hello(d.payload()) for _, d in flows)
    # Loopback shows every frame twice (sent, received): kept once by its sequence number.
    assert all(len(d.segments) == (3 if d.payload() != hello else 1) for _, d in flows)


def pod_docs(names: list[str], tls: bool) -> list[dict]:
    """The example's pods, with TLS as asked."""
    return workload_docs(names, tls=tls)


@contextmanager
def installed(cluster: ClusterHandle, ns: str, tls: bool) -> Iterator[Pods]:
    """The chart (agentTLS.enabled as asked) and the producer and consumer pods; all removed afterwards."""
    cluster.kubectl("create", "namespace", ns)
    pods = Pods(cluster, ns)
    values = Path(cluster.cluster.state_dir) / f"capture-values-{ns}.yaml"
    values.write_text(yaml.safe_dump(chart_values(ns, tls=tls)))
    cluster.helm(
        *("install", RELEASE, str(CHART), "-n", SYSTEM_NS, "--create-namespace", "-f", str(values)),
        *("--wait", "--timeout", "10m"),
        timeout=700,
    )
    try:
        try:
            pods.apply(*pod_docs(["producer", "consumer"], tls))
            for name in ("producer", "consumer"):
                pods.wait_ready(name, timeout=600)
        except BaseException:
            dump_cluster(cluster, f"the workload pods (TLS {'on' if tls else 'off'}) did not become Ready")
            raise
        try:
            yield pods
        except BaseException:
            dump_cluster(cluster, f"the capture test (TLS {'on' if tls else 'off'}) failed")
            raise
    finally:
        pods.kubectl("delete", "pod", "producer", "consumer", "--ignore-not-found", "--wait=true", "--timeout=120s")
        wait_until(lambda: gpuobjects(pods) == [], "every GPUObject freed once its pods are gone", 120, 0.5)
        cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "5m", timeout=400)
        cluster.kubectl("delete", "namespace", SYSTEM_NS, ns, "--wait=true", "--timeout=120s")


def operator_ip(cluster: ClusterHandle) -> str:
    (ip,) = Pods(cluster, SYSTEM_NS).kubectl("get", "pods", "-o", "jsonpath={.items[*].status.podIP}").stdout.split()
    return ip


@pytest.mark.parametrize("tls", [True, False], ids=["tls-on", "tls-off-control"])
def test_a_capture_of_the_pod_network_shows_no_bearer_token(node_cluster: ClusterHandle, tls: bool) -> None:
    ns = f"gpuobj-capture-{'on' if tls else 'off'}"
    with installed(node_cluster, ns, tls) as pods:
        producer, consumer = Workload(pods, "producer"), Workload(pods, "consumer")
        with Capture(devnode.BRIDGE, devnode.POD_SUBNET) as cap:
            put = producer.call("put", key="w", name="weights", seed=7)  # the operator materializes
            consumer.call("adopt", key="w", shared=producer.call("share", key="w", pod="consumer")["shared"])
            assert consumer.call("fetch", key="w")["digest"] == put["digest"]  # the hand-off's grant: NIXL only
            # By address: a read ticket at the producer's agent, the reader's token in the request.
            assert consumer.call("fetch", key="w", ticket=True)["digest"] == put["digest"]
            producer.call("release", key="w")
            consumer.call("release", key="w")
            wait_until(lambda: gpuobjects(pods) == [], "weights freed by the operator", 120, 0.5)
        op_ip, producer_ip, consumer_ip = operator_ip(node_cluster), producer.ip, consumer.ip

    agent = list(cap.on_port(AGENT_PORT))
    packets, wire = sum(d.packets for _, d in agent), sum(d.wire_bytes for _, d in agent)
    to_agent = [(f, d.payload()) for f, d in agent if f.dport == AGENT_PORT]
    callers = {f.src for f, p in to_agent if p}
    print(
        f"\n[capture tls={'on' if tls else 'off'}] {cap.frames} frames on {devnode.BRIDGE}; agent port {AGENT_PORT}: "
        f"{len(to_agent)} connections, {packets} packets, {wire} bytes, callers {sorted(callers)} "
        f"(operator {op_ip}, producer {producer_ip}, consumer {consumer_ip})"
    )
    assert {op_ip, consumer_ip} <= callers, "the capture saw the operator's and the reader's calls to agents"
    hellos = {f.src for f, p in to_agent if is_client_hello(p)}
    bearer, jwt = cap.find(BEARER), cap.find(JWT)
    if tls:
        assert consumer_ip in hellos, "a TLS handshake on the agent port from the reader (a new connection)"
        assert all(is_tls_record(p) for _, p in to_agent if p), "every byte sent to an agent is a TLS record"
        assert bearer == [], f"`Bearer ` on the wire: {bearer}"
        assert jwt == [], f"a JWT on the wire: {jwt}"
    else:
        assert hellos == set()
        assert any(f.dport == AGENT_PORT for f in bearer), "control: plain HTTP shows the operator's Bearer token"
        assert any(f.dport == AGENT_PORT for f in jwt), "control: and the JWT itself"
