"""Look at an agent from outside, through its documented HTTP contract (docs/agent-api.md).

Agents of the harness serve HTTPS by default (gpuobj_dev.testing.agent_tls), as the chart runs them: a call
here then verifies the agent by the pod uid it means, as the operator does, and presents a client
certificate of the identity whose token it sends (agents accept a token only so, docs/security.md). The
harness plays the cluster admin: it reads the agent CAs from their Secrets and issues itself that
certificate, which is what lets one test present the operator's token and a pod's in turn.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from prometheus_client.parser import text_string_to_metric_families

from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names
from gpuobj_operator.agent_ca import CertificateAuthority, ClientCertificate, service_account_of, unverified_claims


@dataclass(frozen=True)
class AgentAt:
    """Who serves at an endpoint (WorkloadProcess registers it)."""

    pod_uid: str
    tls: bool = False


_AGENTS: dict[str, AgentAt] = {}
# Every agent CA of the cluster (each operator makes one in its namespace); set by the test session and the demo.
_CA_SOURCE: list[Callable[[], list[CertificateAuthority]]] = []
_ISSUER: dict[str, CertificateAuthority] = {}  # endpoint -> the CA that issued its agent's certificate
_TRUST: dict[bytes, ssl.SSLContext] = {}  # CA certificate -> a context trusting it, presenting nothing
_CERTS: dict[tuple[bytes, str], ClientCertificate] = {}  # (CA certificate, identity URI) -> its certificate
_LOCK = threading.Lock()


def register(endpoint: str, pod_uid: str, tls: bool = False) -> None:
    _AGENTS[endpoint] = AgentAt(pod_uid, tls)
    _ISSUER.pop(endpoint, None)


def use_agent_ca(source: Callable[[], list[CertificateAuthority]]) -> None:
    """Where to find the cluster's agent CAs (the Secrets operators created in their namespaces)."""
    _CA_SOURCE[:] = [source]


def ca_from_secret(kubectl: Callable[..., str]) -> Callable[[], list[CertificateAuthority]]:
    """A CA source reading every operator's agent CA Secret with ``kubectl(*args) -> stdout`` (admin)."""

    def read() -> list[CertificateAuthority]:
        labels = ",".join(f"{k}={v}" for k, v in agent_tls.CA_SECRET_LABELS.items())
        items = json.loads(kubectl("get", "secrets", "-A", "-l", labels, "-o", "json"))["items"]
        return [
            CertificateAuthority.from_pem(
                base64.b64decode(i["data"]["tls.crt"]), base64.b64decode(i["data"]["tls.key"])
            )
            for i in items
        ]

    return read


def meant_for(endpoint: str) -> dict[str, str]:
    """The header that names the pod at `endpoint` (empty for an agent no test registered)."""
    at = _AGENTS.get(endpoint)
    return {names.HEADER_POD_UID: at.pod_uid} if at else {}


def identity_of(token: str) -> str:
    """The SPIFFE identity an agent binds ``token`` to: its pod's for a pod-bound token, else its
    ServiceAccount's (read from the token's claims, unverified: the agent verifies them)."""
    k8s = unverified_claims(token).get("kubernetes.io") or {}
    if pod := k8s.get("pod"):
        return agent_tls.pod_uri(k8s["namespace"], pod["name"], pod["uid"])
    return agent_tls.service_account_uri(*service_account_of(token))


def _served_certificate(endpoint: str, timeout: float) -> x509.Certificate:
    """The certificate the agent at `endpoint` serves (read unverified: only to find its issuer)."""
    host, port = endpoint.rsplit(":", 1)
    look = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    look.check_hostname, look.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection((host, int(port)), timeout) as raw, look.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def _issuer(endpoint: str, timeout: float) -> CertificateAuthority:
    if endpoint in _ISSUER:
        return _ISSUER[endpoint]
    if not _CA_SOURCE:
        raise RuntimeError("an agent serves TLS but the harness was given no CA source (use_agent_ca)")
    leaf = _served_certificate(endpoint, timeout)
    for ca in _CA_SOURCE[0]():
        try:
            leaf.verify_directly_issued_by(ca.cert)
        except (ValueError, TypeError, InvalidSignature):
            continue
        _ISSUER[endpoint] = ca
        return ca
    raise RuntimeError(f"no agent CA of the cluster issued the certificate the agent at {endpoint} serves")


def _context(endpoint: str, identity: str | None, timeout: float) -> ssl.SSLContext:
    """A client context trusting the agent's CA, presenting a certificate of ``identity`` (none: no
    client certificate) that the harness issues itself with that CA, renewed when due."""
    with _LOCK:
        ca = _issuer(endpoint, timeout)
        if identity is None:
            return _TRUST.setdefault(ca.cert_pem, ssl.create_default_context(cadata=ca.cert_pem.decode()))
        cert = _CERTS.get((ca.cert_pem, identity))
        if cert is None:
            cert = _CERTS[(ca.cert_pem, identity)] = ClientCertificate(ca, identity)
        cert.maybe_renew()
        return cert.context


class _PodHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address, verified by the TLS name of the pod meant there (not by the address)."""

    def __init__(self, host: str, port: int, *, context: ssl.SSLContext, tls_name: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls_name = tls_name
        self._ctx = context

    def connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._ctx.wrap_socket(self.sock, server_hostname=self._tls_name)


def request(
    endpoint: str,
    method: str,
    path: str,
    *,
    token: str | None = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    identity: str | None = None,
    timeout: float = 30,
) -> tuple[int, bytes]:
    """One request to the agent at `endpoint`: (status, body). Over TLS when that agent serves it,
    presenting a certificate of ``identity`` (a SPIFFE URI; by default the identity ``token`` is bound
    to, so that the token counts as its holder's would)."""
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    sent = {**auth, **({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
    at = _AGENTS.get(endpoint)
    if at is None or not at.tls:
        req = urllib.request.Request(f"http://{endpoint}{path}", method=method, data=body, headers=sent)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
    host, port = endpoint.rsplit(":", 1)
    ctx = _context(endpoint, identity or (identity_of(token) if token else None), timeout)
    conn = _PodHTTPSConnection(
        host, int(port), context=ctx, tls_name=agent_tls.pod_dns_name(at.pod_uid), timeout=timeout
    )
    try:
        conn.request(method, path, body=body, headers=sent)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _get(endpoint: str, path: str, token: str | None = None, timeout: float = 10, headers=None) -> bytes:
    status, body = request(endpoint, "GET", path, token=token, headers=headers, timeout=timeout)
    if status >= 400:
        raise AssertionError(f"GET {path} at agent {endpoint}: {status} {body[:300]!r}")
    return body


def inventory(endpoint: str, token_file: Path) -> dict:
    return json.loads(_get(endpoint, api.INVENTORY.path(), token_file.read_text().strip(), headers=meant_for(endpoint)))


def metric(endpoint: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(_get(endpoint, api.METRICS.path()).decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def assert_holds_nothing(endpoint: str, token_file: Path, timeout: float = 15.0) -> None:
    """The end of every scenario: no object, no registered byte, registrations balanced.

    Waits (bounded) for pending fences: a freed region a reader was granted stays registered,
    parked, until its NIXL agent is retired (within the agent's fence interval)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _holds_nothing(endpoint, token_file)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _holds_nothing(endpoint: str, token_file: Path) -> None:
    held = inventory(endpoint, token_file)["objects"]
    assert held == [], f"agent {endpoint} still holds {held}"
    assert metric(endpoint, "gpuobj_agent_nixl_registered_bytes") == 0
    registered = metric(endpoint, "gpuobj_agent_nixl_registrations_total", {"op": "register"})
    deregistered = metric(endpoint, "gpuobj_agent_nixl_registrations_total", {"op": "deregister"})
    assert registered == deregistered, f"{registered} registrations, {deregistered} deregistrations"
    assert metric(endpoint, "gpuobj_agent_store_bytes") == 0
