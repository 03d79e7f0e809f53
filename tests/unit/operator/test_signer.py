"""The agent-serving signer's decision and the certificates its CA issues (no API server: pure logic).

The real test above these is tests/e2e/operator/test_agent_tls.py (real CSRs, real pods, real TLS).
"""

from __future__ import annotations

import base64
import datetime as dt
import tempfile

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpuobj_agent.tls import make_request, split_chain
from gpuobj_contract import agent_tls, names
from gpuobj_operator.agent_ca import BadRequest, CertificateAuthority, ClientCertificate, parse_request
from gpuobj_operator.signer import decide, pending, requester

UID = "0b6c4c1e-7d1a-4c2e-9a57-3f0d9a4e2b10"
OTHER_UID = "9f1e2d3c-4b5a-4697-8877-665544332211"


def csr_obj(pem: bytes, *, user: str = "system:serviceaccount:ml:trainer", pod: str = "p0", uid: str = UID) -> dict:
    return {
        "metadata": {"name": "gpuobj-agent-x"},
        "spec": {
            "request": base64.b64encode(pem).decode(),
            "signerName": agent_tls.SIGNER_NAME,
            "usages": list(agent_tls.USAGES),
            "username": user,
            "extra": {
                "authentication.kubernetes.io/pod-name": [pod],
                "authentication.kubernetes.io/pod-uid": [uid],
            },
        },
    }


def pod_obj(*, uid: str = UID, ip: str = "10.1.2.3", sa: str = "trainer", labelled: bool = True) -> dict:
    return {
        "metadata": {
            "name": "p0",
            "namespace": "ml",
            "uid": uid,
            "labels": {names.LABEL_AGENT: "true"} if labelled else {},
        },
        "spec": {"serviceAccountName": sa},
        "status": {"podIP": ip, "podIPs": [{"ip": ip}]},
    }


def request_for(uid: str = UID, ips: tuple[str, ...] = ("10.1.2.3",), pod: str = "p0") -> bytes:
    return make_request("ml", pod, uid, ips)[1]


def test_a_live_agent_pods_own_request_is_approved_for_its_names_only() -> None:
    pem = request_for()
    d = decide(csr_obj(pem), pod_obj(), parse_request(pem))
    assert d.approve, d.reason
    assert d.dns_names == (agent_tls.pod_dns_name(UID),) and d.ips == ("10.1.2.3",)
    assert d.uris == (agent_tls.pod_uri("ml", "p0", UID),)


@pytest.mark.parametrize(
    ("csr_kw", "pod", "why"),
    [
        ({"uid": OTHER_UID}, pod_obj(), "is not the pod"),  # the token's pod is another incarnation
        ({}, pod_obj(labelled=False), "not labelled"),
        ({}, pod_obj(sa="other"), "does not run as"),
        ({}, None, "does not exist"),
        ({}, pod_obj(ip=""), "no IP"),
        ({"user": "system:serviceaccount:other:trainer"}, pod_obj(), "the token's pod"),
        ({"pod": "p1"}, pod_obj(), "the token's pod"),
    ],
)
def test_a_request_not_from_that_pod_is_denied(csr_kw: dict, pod: dict | None, why: str) -> None:
    pem = request_for()
    d = decide(csr_obj(pem, **csr_kw), pod, parse_request(pem))
    assert not d.approve and why in d.reason, d.reason


def test_a_request_without_a_pod_bound_token_is_denied() -> None:
    pem = request_for()
    obj = csr_obj(pem)
    obj["spec"]["extra"] = {}
    assert requester(obj) is None
    assert not decide(obj, pod_obj(), parse_request(pem)).approve
    obj = csr_obj(pem, user="alice")
    assert "no pod-bound" in decide(obj, pod_obj(), parse_request(pem)).reason


def test_a_request_naming_another_pod_or_ip_is_denied() -> None:
    """A pod asking (with its own token) for a certificate that names another pod's uid or IP."""
    for pem in (request_for(uid=OTHER_UID), request_for(ips=("10.9.9.9",)), request_for(pod="victim")):
        d = decide(csr_obj(pem), pod_obj(), parse_request(pem))
        assert not d.approve and "names that are not" in d.reason, d.reason


def test_other_signers_usages_and_answered_requests_are_not_ours() -> None:
    pem = request_for()
    obj = csr_obj(pem)
    obj["spec"]["usages"] = ["digital signature", "server auth", "code signing"]
    assert not decide(obj, pod_obj(), parse_request(pem)).approve
    obj = csr_obj(pem)
    obj["spec"]["signerName"] = "kubernetes.io/kube-apiserver-client"
    assert not pending(obj) and not decide(obj, pod_obj(), parse_request(pem)).approve
    obj = csr_obj(pem)
    assert pending(obj)
    obj["status"] = {"conditions": [{"type": "Denied"}]}
    assert not pending(obj)
    obj["status"] = {"conditions": [{"type": "Approved"}]}
    assert pending(obj)  # approved but never signed (cut off): signed on the next event
    obj["status"]["certificate"] = "eA=="
    assert not pending(obj)


def test_garbage_and_forged_requests_are_refused() -> None:
    with pytest.raises(BadRequest):
        parse_request(b"not a pem")
    # A CSR whose signature does not match its content (its last signature byte changed).
    der = bytearray(x509.load_pem_x509_csr(request_for()).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01
    forged = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(BadRequest, match="signature"):
        parse_request(forged)


def test_issued_certificate_verifies_against_the_ca_for_the_pod_name_only() -> None:
    ca = CertificateAuthority.generate()
    key_pem, pem = make_request("ml", "p0", UID, ("10.1.2.3",))
    d = decide(csr_obj(pem), pod_obj(), parse_request(pem))
    leaf_pem = ca.issue(
        parse_request(pem).public_key,
        common_name=d.common_name,
        dns_names=d.dns_names,
        ips=d.ips,
        uris=d.uris,
        lifetime=d.lifetime,
    )
    leaf, ca_pem = split_chain(leaf_pem + ca.cert_pem)
    assert ca_pem == ca.cert_pem
    life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert life <= dt.timedelta(seconds=agent_tls.MAX_LIFETIME_SECONDS) + dt.timedelta(minutes=1)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [agent_tls.pod_dns_name(UID)]
    assert agent_tls.parse_uri(san.get_values_for_type(x509.UniformResourceIdentifier)[0]) == ("pod", "ml", "p0", UID)
    # (the handshake against the name meant, with a real server, is in tests/e2e/operator/test_agent_tls.py)
    with pytest.raises(ValueError):
        split_chain(leaf_pem)  # a chain without its CA is refused
    assert CertificateAuthority.from_pem(ca.cert_pem, ca.key_pem()).cert == ca.cert
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")


def test_the_operators_client_key_is_not_left_on_disk(tmp_path, monkeypatch) -> None:
    """The operator's mTLS key is written only while ssl loads it: a renewal leaves no key file behind
    (before, every operator start left `gpuobj-operator-tls-*/tls.key` in the temp folder for good)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cert = ClientCertificate(
        CertificateAuthority.generate(), agent_tls.service_account_uri("gpuobj-system", "gpuobj-operator")
    )
    cert.maybe_renew(dt.datetime.now(dt.UTC) + dt.timedelta(days=1))  # due: a fresh key, loaded the same way
    assert list(tmp_path.iterdir()) == []
    assert cert.context.cert_store_stats()["x509_ca"] >= 1


def test_a_shards_signer_answers_only_its_shards_namespaces() -> None:
    """With TLS on by default in the tests, every shard's operator signed the CSRs of every namespace (two
    shards answered the same request, one acting on the other's namespace). Now each takes only its own."""
    from gpuobj_operator.shards import Shard, shard_of
    from gpuobj_operator.signer import Signer

    spaces = [f"ns-{i}" for i in range(8)]
    queued: dict[int, list[str]] = {}
    for index in (0, 1):
        signer = Signer(None, CertificateAuthority.generate(), owns=Shard(2, index).owns)  # type: ignore[arg-type]
        for ns in spaces:
            csr = csr_obj(request_for(), user=f"system:serviceaccount:{ns}:trainer")
            csr["metadata"]["name"] = f"csr-{ns}"
            signer._on_csr("ADDED", csr)
        queued[index] = sorted(signer._queued)
    assert queued[0] == sorted(f"csr-{ns}" for ns in spaces if shard_of(ns, 2) == 0)
    assert queued[1] == sorted(f"csr-{ns}" for ns in spaces if shard_of(ns, 2) == 1)
    assert queued[0] and queued[1]


async def _until(check, seconds: float = 10.0) -> None:
    """Wait for ``check()`` to hold, up to a deadline (a fake client has no event to wait on)."""
    import asyncio

    async def poll() -> None:
        while not check():  # noqa: ASYNC110 - a fake client has no event to wait on; bounded by wait_for
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), seconds)


def test_a_signer_that_cannot_watch_fails_healthz_naming_itself() -> None:
    """A 403 on the CSR watch (a missing RBAC rule) must not leave the replica signerless with /healthz ok."""
    import asyncio

    import aiohttp

    from gpuobj_kube.client import ApiError
    from gpuobj_operator.health import HealthServer
    from gpuobj_operator.metrics import OperatorMetrics
    from gpuobj_operator.signer import Signer

    class Forbidden:
        async def list(self, *_a: object, **_k: object) -> dict:
            raise ApiError(403, "Forbidden", 'cannot list resource "certificatesigningrequests"')

    async def go() -> tuple[int, dict]:
        signer = Signer(Forbidden(), CertificateAuthority.generate())  # type: ignore[arg-type]
        health = HealthServer(OperatorMetrics(lambda: None), "127.0.0.1", 0)  # type: ignore[arg-type,return-value]
        health.checks.append(signer.failure)
        port = await health.start()
        signer.start()
        try:
            await _until(lambda: signer.failure() is not None)
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as res:
                return res.status, await res.json()
        finally:
            await signer.stop()
            await health.stop()

    status, body = asyncio.run(go())
    assert status == 500
    assert "CSR signer" in body["failures"][0] and "403" in body["failures"][0]


def test_a_csr_whose_answer_failed_is_retried_not_dropped() -> None:
    """One failed answer (an API error) is requeued with backoff; before, it was logged and dropped."""
    import asyncio

    from gpuobj_kube.client import ApiError
    from gpuobj_operator.signer import Signer

    csr = csr_obj(request_for())
    gets: list[str] = []

    class Flaky:
        async def get(self, _res: object, name: str, *_a: object) -> dict:
            gets.append(name)
            if len(gets) == 1:
                raise ApiError(500, "InternalError", "etcd leader changed")
            return {**csr, "status": {"conditions": [{"type": "Denied"}]}}  # answered: nothing more to do

    async def go() -> None:
        signer = Signer(Flaky(), CertificateAuthority.generate())  # type: ignore[arg-type]
        signer._worker = asyncio.create_task(signer._work())
        signer._on_csr("ADDED", csr)
        try:
            await _until(lambda: len(gets) >= 2)
        finally:
            await signer.stop()

    asyncio.run(go())
    assert gets == ["gpuobj-agent-x", "gpuobj-agent-x"]
