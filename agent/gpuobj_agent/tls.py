"""The agent's own certificate: a key made here, a CSR to the operator's signer, renewal before expiry.

Why a CSR and not a mounted Secret: the private key never leaves the pod, and the certificate names
the pod the API server says made the request (signer: operator/gpuobj_operator/signer.py). The CSR is
created with the pod's own API token, which is bound to the pod: that binding, not anything in the
request, is what the signer checks. The issued chain is the leaf then the CA; the CA is this agent's
trust anchor for the agents it calls (and the operator holds the same CA).

Callers verify an agent by connecting to its IP with `server_hostname = pod_dns_name(uid)`: the
handshake fails unless the certificate was issued for that very pod, before any request (or token) is sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import ipaddress
import logging
import os
import secrets
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpuobj_contract import agent_tls

if TYPE_CHECKING:  # the kube client imports the kubernetes package: only an agent with tls=csr needs it
    from gpuobj_kube.client import KubeClient

log = logging.getLogger(__name__)

ISSUE_TIMEOUT = 60.0  # seconds an agent waits for the operator to sign its CSR at start
RETRY_SECONDS = 10.0  # a renewal that failed is tried again this soon


class CertificateRefused(RuntimeError):
    """The signer denied the CSR (the message is its reason), or nobody signed it in time."""


@dataclass(frozen=True)
class Issued:
    key_pem: bytes
    chain_pem: bytes  # leaf, then the CA
    ca_pem: bytes
    not_before: dt.datetime
    not_after: dt.datetime

    def renew_at(self) -> dt.datetime:
        return self.not_before + (self.not_after - self.not_before) * agent_tls.RENEW_FRACTION


def make_request(namespace: str, pod_name: str, pod_uid: str, ips: tuple[str, ...]) -> tuple[bytes, bytes]:
    """(key PEM, CSR PEM) naming exactly what the signer will put in the certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(agent_tls.pod_dns_name(pod_uid))]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    names.append(x509.UniformResourceIdentifier(agent_tls.pod_uri(namespace, pod_name, pod_uid)))
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{namespace}/{pod_name}"[:64])]))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM)


def split_chain(chain_pem: bytes) -> tuple[x509.Certificate, bytes]:
    """(the leaf, the CA PEM) of an issued chain; ValueError unless it is a leaf and its CA."""
    certs = x509.load_pem_x509_certificates(chain_pem)
    if len(certs) != 2:
        raise ValueError(f"the issued chain holds {len(certs)} certificates, not a leaf and its CA")
    leaf, ca = certs
    leaf.verify_directly_issued_by(ca)
    return leaf, ca.public_bytes(serialization.Encoding.PEM)


def _finished(csr: dict[str, Any] | None) -> bool:
    if csr is None:
        return True
    status = csr.get("status") or {}
    return bool(status.get("certificate")) or any(
        c.get("type") in ("Denied", "Failed") for c in status.get("conditions") or []
    )


async def request_certificate(
    kube: KubeClient, namespace: str, pod_name: str, pod_uid: str, ips: tuple[str, ...], *, timeout: float
) -> Issued:
    """Ask the signer for a certificate for this pod and wait for it (CertificateRefused if denied)."""
    from gpuobj_kube.client import CSRS
    from gpuobj_kube.informer import wait_for

    key_pem, csr_pem = make_request(namespace, pod_name, pod_uid, ips)
    name = f"{agent_tls.CSR_PREFIX}{pod_uid or pod_name}-{secrets.token_hex(4)}"[:253]
    body = {
        "metadata": {"name": name},
        "spec": {
            "request": base64.b64encode(csr_pem).decode(),
            "signerName": agent_tls.SIGNER_NAME,
            "usages": list(agent_tls.USAGES),
            "expirationSeconds": agent_tls.MAX_LIFETIME_SECONDS,
        },
    }
    await kube.create(CSRS, body)
    try:
        csr = await wait_for(kube, CSRS, name, None, _finished, timeout=timeout)
    except TimeoutError:
        raise CertificateRefused(
            f"CSR {name} was not signed within {timeout:g}s: is the gpuobj operator (signer "
            f"{agent_tls.SIGNER_NAME}) running?"
        ) from None
    status = (csr or {}).get("status") or {}
    if not status.get("certificate"):
        why = "; ".join(c.get("message", "") for c in status.get("conditions") or []) or "deleted"
        raise CertificateRefused(f"CSR {name} refused: {why}")
    chain = base64.b64decode(status["certificate"])
    leaf, ca_pem = split_chain(chain)
    # The CSR stays: kube-controller-manager's cleaner removes issued CSRs after an hour (workloads may not
    # delete CSRs: they would delete each other's).
    return Issued(key_pem, chain, ca_pem, leaf.not_valid_before_utc, leaf.not_valid_after_utc)


def client_context(ca_pem: bytes, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    """What a caller of agents uses: trusts the agent CA only, checks the name, may present a certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


class AgentCertificate:
    """The serving certificate of one agent: obtained at start, renewed in the background.

    The same SSLContext object serves for the agent's whole life; a renewal loads the new chain into it,
    and every handshake after that presents the new certificate.
    """

    def __init__(
        self, kube: KubeClient | None, namespace: str, pod_name: str, pod_uid: str, ips: tuple[str, ...]
    ) -> None:
        self.kube = kube
        self.namespace, self.pod_name, self.pod_uid, self.ips = namespace, pod_name, pod_uid, ips
        self._dir = Path(tempfile.mkdtemp(prefix="gpuobj-agent-tls-"))
        self._dir.chmod(0o700)
        self.issued: Issued | None = None
        self.server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.client_context: ssl.SSLContext | None = None
        self.renewals = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def key_file(self) -> str:
        return str(self._dir / "tls.key")

    @property
    def chain_file(self) -> str:
        return str(self._dir / "tls.crt")

    def _install(self, issued: Issued) -> None:
        for path, data in ((self.key_file, issued.key_pem), (self.chain_file, issued.chain_pem)):
            fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            Path(path + ".new").replace(path)
        self.server_context.load_cert_chain(self.chain_file, self.key_file)
        if self.issued is None or self.issued.ca_pem != issued.ca_pem:
            # Callers may present a certificate of the same CA (mTLS): server.py binds their token to it.
            self.server_context.verify_mode = ssl.CERT_OPTIONAL
            self.server_context.load_verify_locations(cadata=issued.ca_pem.decode())
            # Callers (this agent's fetches) trust the CA that signed us, and present our certificate.
            self.client_context = client_context(issued.ca_pem, (self.chain_file, self.key_file))
        else:
            assert self.client_context is not None
            self.client_context.load_cert_chain(self.chain_file, self.key_file)
        self.issued = issued

    async def obtain(self, timeout: float = ISSUE_TIMEOUT) -> Issued:
        assert self.kube is not None, "no API client: this certificate comes from files"
        issued = await request_certificate(
            self.kube, self.namespace, self.pod_name, self.pod_uid, self.ips, timeout=timeout
        )
        self._install(issued)
        log.info("serving certificate for %s, valid until %s", self.pod_uri, issued.not_after.isoformat())
        return issued

    @property
    def pod_uri(self) -> str:
        return agent_tls.pod_uri(self.namespace, self.pod_name, self.pod_uid)

    def load_files(self, folder: Path) -> Issued:
        """A certificate issued elsewhere (cert-manager's CSI driver, a bench): `tls.key`, `tls.crt` (the
        leaf, or leaf and CA) and `ca.crt` in `folder`. The files are read again when they change."""
        key_pem = (folder / "tls.key").read_bytes()
        chain = (folder / "tls.crt").read_bytes()
        ca_pem = (folder / "ca.crt").read_bytes()
        leaf = x509.load_pem_x509_certificates(chain)[0]
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
        issued = Issued(key_pem, chain, ca_pem, leaf.not_valid_before_utc, leaf.not_valid_after_utc)
        if self.issued != issued:
            self._install(issued)
        return issued

    def start_renewal(self, files: Path | None = None) -> None:
        """Renew through the signer before expiry; or, with `files`, reload them when they change."""
        work = self._renew() if files is None else self._reload(files)
        self._task = asyncio.create_task(work, name="gpuobj-agent-cert-renewal")

    async def _reload(self, folder: Path) -> None:
        while True:
            await asyncio.sleep(RETRY_SECONDS)
            try:
                self.load_files(folder)
            except (OSError, ValueError) as exc:  # mid-rotation, or a bad file: keep serving the current one
                log.warning("reading the certificate files in %s failed: %s", folder, exc)

    async def _renew(self) -> None:
        while True:
            assert self.issued is not None
            wait = (self.issued.renew_at() - dt.datetime.now(dt.UTC)).total_seconds()
            await asyncio.sleep(max(0.0, wait))
            try:
                await self.obtain()
                self.renewals += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the current one still serves until it expires: try again soon
                log.warning("renewing the serving certificate failed: %s; again in %gs", exc, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        shutil.rmtree(self._dir, ignore_errors=True)
