"""TLS to agents (issue 21, item 3), probed as an attacker would: real CSRs, real pods, real handshakes.

Before: agents served plain HTTP and the operator sent its bearer token to whatever listened at a pod's
address (a labelled impostor at its own IP received it). Now each agent asks the operator's signer
(`gpuobj.io/agent-serving`) for a certificate naming its pod, serves HTTPS only, and the operator sends a
request (and its token) only after the handshake proved the listener holds the certificate of the pod
uid it means (docs/security.md, "TLS to agents").
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import socket
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from gpuobj_agent.tls import AgentCertificate, Issued, client_context, make_request, request_certificate
from gpuobj_contract import agent_tls, names
from gpuobj_dev.testing import agent_tls as agent_tls_harness
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import WORKLOAD_SA, credentials, install_identities
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod
from gpuobj_kube.client import CSRS, KubeClient
from gpuobj_kube.config import from_kubeconfig
from gpuobj_kube.informer import wait_for
from gpuobj_operator.agent_ca import CertificateAuthority, ClientCertificate
from gpuobj_operator.agent_client import AgentClient, AgentNotVerified, AgentUnreachable
from gpuobj_operator.signer import requester
from tests.e2e.operator.conftest import Pods, kube, start_operator
from tests.e2e.operator.test_lifecycle import wait_object

pytestmark = pytest.mark.nixl

TLS_ENV = {"GPUOBJ_AGENT_TLS": "csr"}


@pytest.fixture
def tls_operator(gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str):
    op = start_operator(gpuobj_cluster, token_file, namespace, extra=["--agent-tls", "on"]).wait_ready()
    yield op
    rc = op.stop()
    assert rc == 0, f"operator exited {rc}:\n{op.output()}"


def _as_pod(cluster: ClusterHandle, namespace: str, name: str, folder: Path):
    """A labelled pod of ours and its pod-bound credentials (what its kubelet would mount)."""
    pod = kube(cluster, lambda k: create_agent_pod(k, namespace, name, port=1, service_account=WORKLOAD_SA))
    uid = pod["metadata"]["uid"]
    return uid, credentials(cluster, namespace, WORKLOAD_SA, folder / name, pod=(name, uid))


def _with_pod_client(kubeconfig: Path, fn):
    async def go():
        async with KubeClient(from_kubeconfig(kubeconfig)) as k:
            return await fn(k)

    return asyncio.run(go())


def test_an_agent_serves_https_only_with_a_certificate_naming_its_pod(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, pods: Pods
) -> None:
    src = pods.workload("src", env=TLS_ENV)
    # The operator calls the agent over TLS (materialize/free/inventory): a put and a release are freed.
    src.run("ref = client.put([torch.ones(256)], name='w'); client.flush()")
    wait_object(gpuobj_cluster, namespace, "w", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    src.run("ref.release(); client.flush()")
    wait_object(gpuobj_cluster, namespace, "w", lambda o: o is None)
    host, port = pods.endpoint("src").rsplit(":", 1)
    # Plaintext is refused: no HTTP answer at all, whatever the request.
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://{pods.endpoint('src')}/healthz", timeout=10)
    # Over TLS, the certificate names the pod (its uid as the TLS name) and chains to the operator's CA.
    ca_pem = _ca_pem(gpuobj_cluster, namespace)
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    meant = agent_tls.pod_dns_name(pods.uids["src"])
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=meant) as tls,
    ):
        cert = tls.getpeercert()
    uris = [v for k, v in cert["subjectAltName"] if k == "URI"]
    assert uris == [agent_tls.pod_uri(namespace, "src", pods.uids["src"])]
    # Another pod's uid does not pass the same handshake.
    other = agent_tls.pod_dns_name("00000000-0000-4000-8000-000000000000")
    with socket.create_connection((host, int(port)), timeout=10) as raw, pytest.raises(ssl.SSLCertVerificationError):
        ctx.wrap_socket(raw, server_hostname=other)


def _ca_pem(cluster: ClusterHandle, namespace: str) -> bytes:
    out = cluster.kubectl(
        "get", "secret", "gpuobj-agent-ca", "-n", namespace, "-o", "jsonpath={.data.tls\\.crt}"
    ).stdout
    return base64.b64decode(out)


def test_a_csr_for_another_pods_identity_is_denied(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, tmp_path: Path
) -> None:
    """Pod `mallory` asks, with its own pod-bound token, for a certificate naming pod `victim`."""
    victim_uid, victim = _as_pod(gpuobj_cluster, namespace, "victim", tmp_path)
    _, mallory = _as_pod(gpuobj_cluster, namespace, "mallory", tmp_path)
    try:
        _, pem = make_request(namespace, "victim", victim_uid, ("127.0.0.1",))
        body = {
            "metadata": {"name": f"{agent_tls.CSR_PREFIX}forged-{victim_uid[:8]}"},
            "spec": {
                "request": base64.b64encode(pem).decode(),
                "signerName": agent_tls.SIGNER_NAME,
                "usages": list(agent_tls.USAGES),
            },
        }

        def finished(o: dict | None) -> bool:
            return o is None or any(
                c["type"] in ("Denied", "Approved") for c in (o.get("status") or {}).get("conditions") or []
            )

        async def forge(k: KubeClient) -> dict | None:
            created = await k.create(CSRS, body)
            return await wait_for(k, CSRS, created["metadata"]["name"], None, finished, timeout=30)

        answered = _with_pod_client(mallory.kubeconfig, forge)
        (condition,) = answered["status"]["conditions"]
        assert condition["type"] == "Denied" and "not pod" in condition["message"], condition
        assert not answered["status"].get("certificate")
        # The victim's own request, made the same way with its own token, is signed.
        issued = _with_pod_client(
            victim.kubeconfig,
            lambda k: request_certificate(k, namespace, "victim", victim_uid, ("127.0.0.1",), timeout=30),
        )
        assert issued.not_after > issued.not_before
    finally:
        victim.stop()
        mallory.stop()


class Recorder:
    """A listener at an impostor's address: accepts, optionally completes TLS, records every byte it gets."""

    def __init__(self, server_ctx: ssl.SSLContext | None) -> None:
        self.ctx = server_ctx
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(30)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(5)
            try:
                if self.ctx is not None:
                    conn = self.ctx.wrap_socket(conn, server_side=True)
                while chunk := conn.recv(65536):
                    self.received += chunk
                    if b"\r\n\r\n" in self.received:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                        break
            except (OSError, ssl.SSLError):
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(timeout=10)


def _server_ctx(issued: Issued, folder: Path) -> ssl.SSLContext:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tls.crt").write_bytes(issued.chain_pem)
    (folder / "tls.key").write_bytes(issued.key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(folder / "tls.crt"), str(folder / "tls.key"))
    return ctx


def test_a_labelled_impostor_at_its_own_ip_never_receives_the_operators_token(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, token_file: Path, tmp_path: Path
) -> None:
    """The operator means pod `victim`; at the address it calls listens `impostor`, a labelled pod with a
    valid certificate of its own (or no TLS at all). Before (plain HTTP): the token arrived. Now: nothing
    past the handshake, so no `Bearer`."""
    victim_uid, victim = _as_pod(gpuobj_cluster, namespace, "victim", tmp_path)
    impostor_uid, impostor = _as_pod(gpuobj_cluster, namespace, "impostor", tmp_path)
    try:
        own = _with_pod_client(
            impostor.kubeconfig,
            lambda k: request_certificate(k, namespace, "impostor", impostor_uid, ("127.0.0.1",), timeout=30),
        )
        ca = ssl.create_default_context(cadata=_ca_pem(gpuobj_cluster, namespace).decode())

        async def call(client: AgentClient, endpoint: str) -> None:
            try:
                await client.info(endpoint, pod_uid=victim_uid, timeout=10)
            finally:
                await client.close()

        # The hole, as it was: a plain-HTTP client hands its token to whatever answers.
        plain = Recorder(None)
        asyncio.run(call(AgentClient(token_file), f"127.0.0.1:{plain.port}"))
        plain.close()
        assert b"Bearer " in plain.received
        token = token_file.read_text().strip()
        for listener, refusal in (
            (Recorder(_server_ctx(own, tmp_path / "impostor-tls")), AgentNotVerified),  # its own valid certificate
            (Recorder(None), AgentUnreachable),  # no TLS at all
        ):
            with pytest.raises(refusal):
                asyncio.run(call(AgentClient(token_file, tls=ca), f"127.0.0.1:{listener.port}"))
            listener.close()
            assert b"Bearer " not in listener.received and token.encode() not in listener.received
            assert b"eyJ" not in listener.received
    finally:
        victim.stop()
        impostor.stop()


def test_the_signer_answers_every_agent_pod_at_start(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, pods: Pods
) -> None:
    """Two TLS agents start (each waits for its certificate before it serves); both CSRs are approved."""
    for name in ("a", "b"):
        pods.workload(name, env=TLS_ENV)
    listed = kube(gpuobj_cluster, lambda k: k.list(CSRS))["items"]
    ours = [c for c in listed if c["spec"]["signerName"] == agent_tls.SIGNER_NAME and requester(c)
            and requester(c)[3] in pods.uids.values()]  # fmt: skip
    assert len(ours) == 2 and all(c["status"].get("certificate") for c in ours)


def test_a_reader_fetches_from_a_tls_source_over_https_verified_by_its_pod_uid(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, pods: Pods
) -> None:
    """Reader -> source: the read ticket is an HTTPS request naming the source pod's uid, the bytes come by NIXL."""
    src, reader = pods.workload("src", env=TLS_ENV), pods.workload("reader", env=TLS_ENV)
    src.run("ref = client.put([torch.arange(4096, dtype=torch.float32)], name='w'); client.flush()")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    reader.run(f"h = client.adopt(load_pickle({shared!r}))")
    assert reader.eval("h.address.source_pod_uid") == pods.uids["src"]
    # A fetch by address takes a read ticket (not the hand-off's grant): the HTTPS path.
    reader.run("got = client.fetch(h.address)[0]")
    assert reader.eval("bool(torch.equal(got, torch.arange(4096, dtype=torch.float32)))")
    # The same address with another pod's uid is refused before any request: the handshake fails.
    reader.run(
        "import dataclasses\n"
        "wrong = dataclasses.replace(h.address, source_pod_uid='00000000-0000-4000-8000-000000000000')\n"
        "try:\n    client.fetch(wrong); refused = ''\nexcept Exception as exc:\n    refused = repr(exc)"
    )
    assert "TLS" in reader.eval("refused"), reader.eval("refused")
    src.run("ref.release()")
    reader.run("h.release(); client.flush()")
    wait_object(gpuobj_cluster, namespace, "w", lambda o: o is None)


def _ca(cluster: ClusterHandle, namespace: str) -> CertificateAuthority:
    """The agent CA from its Secret (the test plays the cluster admin, who may read it)."""
    out = cluster.kubectl("get", "secret", "gpuobj-agent-ca", "-n", namespace, "-o", "json").stdout
    data = json.loads(out)["data"]
    return CertificateAuthority.from_pem(base64.b64decode(data["tls.crt"]), base64.b64decode(data["tls.key"]))


def _get(endpoint: str, path: str, token: str, uid: str, ctx: ssl.SSLContext | None, method: str = "GET") -> int:
    async def go() -> int:
        verify = {"ssl": ctx, "server_hostname": agent_tls.pod_dns_name(uid)} if ctx else {}
        headers = {"Authorization": f"Bearer {token}", names.HEADER_POD_UID: uid}
        async with aiohttp.ClientSession() as s:
            url = f"{'https' if ctx else 'http'}://{endpoint}{path}"
            body = None if method == "GET" else {}
            timeout = aiohttp.ClientTimeout(total=30)
            async with s.request(method, url, json=body, headers=headers, timeout=timeout, **verify) as r:
                return r.status

    return asyncio.run(go())


def test_the_operators_token_replayed_at_another_agent_is_refused(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, pods: Pods, token_file: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    """A pod that received the operator's token (every agent does) replays it at agent `b`, with `b`'s uid
    (readable in any GPUObject's spec.source). Before: 200 on the inventory (a plain agent still answers so,
    below). Now the token counts only over a connection whose client certificate names the operator's
    ServiceAccount: without the operator's key, 401."""
    pods.workload("plain", env=agent_tls_harness.PLAIN)
    pods.workload("b", env=TLS_ENV)
    token = token_file.read_text().strip()
    assert _get(pods.endpoint("plain"), "/v1/objects", token, pods.uids["plain"], None) == 200  # the hole
    ca = _ca(gpuobj_cluster, namespace)
    no_cert = ssl.create_default_context(cadata=ca.cert_pem.decode())
    assert _get(pods.endpoint("b"), "/v1/objects", token, pods.uids["b"], no_cert) == 401
    # With a certificate of its own (mallory's pod certificate, from the signer): still 401.
    mallory_uid, mallory = _as_pod(gpuobj_cluster, namespace, "mallory", tmp_path)
    try:
        own = _with_pod_client(
            mallory.kubeconfig,
            lambda k: request_certificate(k, namespace, "mallory", mallory_uid, ("127.0.0.1",), timeout=30),
        )
        (tmp_path / "m.crt").write_bytes(own.chain_pem)
        (tmp_path / "m.key").write_bytes(own.key_pem)
        as_mallory = client_context(ca.cert_pem, (str(tmp_path / "m.crt"), str(tmp_path / "m.key")))
        assert _get(pods.endpoint("b"), "/v1/objects", token, pods.uids["b"], as_mallory) == 401
        # A reader's token is bound the same way: b's own read token presented with mallory's certificate.
        b_token = pods.agent_token("b").read_text().strip()
        reads = "/v1/objects/x/reads"
        assert _get(pods.endpoint("b"), reads, b_token, pods.uids["b"], as_mallory, "POST") == 401
    finally:
        mallory.stop()
    # The operator's own key (what the running operator holds) opens it: the binding, not TLS alone, refused.
    operator_cert = ClientCertificate(ca, agent_tls.service_account_uri(namespace, "gpuobj-operator"), folder=tmp_path)
    assert _get(pods.endpoint("b"), "/v1/objects", token, pods.uids["b"], operator_cert.context) == 200


def test_an_agent_certificate_is_renewed_before_it_expires(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, tmp_path: Path
) -> None:
    """The renewal loop, against the real signer: a certificate whose renewal time has come is replaced
    (a new CSR, a new key) in the same server context. The lifetime is the CSR API's (>= 600 s), so the
    certificate is made to look older instead of waiting."""
    uid, creds = _as_pod(gpuobj_cluster, namespace, "renewing", tmp_path)

    async def go(k: KubeClient) -> tuple[Issued, Issued, int]:
        cert = AgentCertificate(k, namespace, "renewing", uid, ("127.0.0.1",))
        first = await cert.obtain()
        life = first.not_after - first.not_before  # renewal is due at 2/3 of it: make it 3 lifetimes old
        cert.issued = dataclasses.replace(first, not_before=first.not_before - 3 * life)
        cert.start_renewal()
        try:
            await asyncio.wait_for(_renewed(cert), timeout=60)
        finally:
            await cert.close()
        assert cert.issued is not None
        return first, cert.issued, cert.renewals

    try:
        first, second, renewals = _with_pod_client(creds.kubeconfig, go)
    finally:
        creds.stop()
    assert renewals >= 1 and second.key_pem != first.key_pem and second.chain_pem != first.chain_pem
    assert second.not_after >= first.not_after


async def _renewed(cert: AgentCertificate) -> None:
    while cert.renewals == 0:  # noqa: ASYNC110 - the certificate has no event to wait on; bounded by wait_for
        await asyncio.sleep(0.05)


def test_a_hand_off_release_goes_to_the_tls_source_verified_by_its_pod_uid(
    gpuobj_cluster: ClusterHandle, namespace: str, tls_operator: OperatorProcess, pods: Pods
) -> None:
    """The receiver's release of a hand-off claim goes to the source that queued it, over HTTPS verified by
    the source pod's uid (the shared address names it), with the receiver's own certificate. Before, over
    TLS the receiver deleted the claim in the API itself: one more API write per hand-off, and a claim the
    source had not recorded yet could be recorded after that delete found nothing."""
    src, reader = pods.workload("src", env=TLS_ENV), pods.workload("reader", env=TLS_ENV)
    src.run(
        "ref = client.put([torch.arange(1024, dtype=torch.float32)], name='h'); s = client.share(ref, 'reader'); "
        "client.flush(); ref.release(); client.flush()"
    )
    reader.run(f"h = client.adopt(load_pickle({src.eval_pickle('s')!r})); got = client.fetch(h)[0]")
    assert reader.eval("bool(torch.equal(got, torch.arange(1024, dtype=torch.float32)))")
    sent = reader.eval("client.write_stats()['sent']")
    reader.run("h.release(); del got; client.flush()")
    wait_object(gpuobj_cluster, namespace, "h", lambda o: o is None)
    assert reader.eval("client.write_stats()['sent']") == sent  # the source took the release: the reader wrote nothing


def test_a_reader_of_another_namespace_reads_over_tls_under_a_cluster_wide_operator(
    gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, tmp_path: Path
) -> None:
    """The chart's default watch is every namespace: one signer certifies the pods of both namespaces. A
    reader of another namespace reads an object shared with it over HTTPS, verified by the source pod's
    uid, with its own certificate; one not shared with it is refused by the source, naming spec.sharedWith."""
    from tests.e2e.operator.test_client_refusals import attempt
    from tests.e2e.operator.test_namespace_quota import ClusterWideOperator

    identity = ClusterWideOperator(gpuobj_cluster, namespace, tmp_path / "cluster-wide-operator")
    op = identity.start([]).wait_ready()
    other = f"{namespace}-r"
    gpuobj_cluster.create_namespace(other)
    install_identities(gpuobj_cluster, other)
    readers = Pods(gpuobj_cluster, other, identity.creds.agent_token, tmp_path / other)
    env = {"GPUOBJ_OPERATOR_SERVICEACCOUNT": identity.subject, **TLS_ENV}
    try:
        src = pods.workload("src", env=env)
        src.run(
            f"opened = client.put([torch.arange(256, dtype=torch.float32)], name='opened', shared_with=[{other!r}])\n"
            "closed = client.put([torch.ones(256)], name='closed')\nclient.flush()"
        )
        addresses = {name: src.eval_pickle(f"{name}.address") for name in ("opened", "closed")}
        reader = readers.workload("reader", env=env)
        fetch = "client.fetch(load_pickle({!r}))"
        assert reader.eval(f"float({fetch.format(addresses['opened'])}[0].sum())") == float(sum(range(256)))
        name, message = attempt(reader, fetch.format(addresses["closed"]))
        assert name == "PermissionDeniedError" and "spec.sharedWith" in message, message
        src.run("opened.release(); closed.release(); client.flush()")
        for name in ("opened", "closed"):
            wait_object(gpuobj_cluster, namespace, name, lambda o: o is None)
    finally:
        readers.close()
        assert op.stop() == 0, op.output()
        identity.close()
        gpuobj_cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
