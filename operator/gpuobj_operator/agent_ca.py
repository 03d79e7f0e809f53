"""The agents' certificate authority: its key and certificate, and the certificates it issues.

Why the operator holds it: it already watches every agent pod, so it is the one party that can say
"this public key belongs to pod X at IP Y" (signer.py decides; this module only signs). The key lives in
a Secret of the operator's namespace, made once by whichever replica gets there first (a create that
loses the race reads the winner's). No I/O here but `load_or_create`; issuing is pure.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpuobj_contract import agent_tls
from gpuobj_kube.client import SECRETS, Conflict, KubeClient, NotFound

CA_LIFETIME = dt.timedelta(days=365)
CLOCK_SKEW = dt.timedelta(minutes=1)  # notBefore this far back: a peer whose clock is a little behind accepts it


class BadRequest(ValueError):
    """A CSR we will not sign: the message says why (it goes into the Denied condition)."""


@dataclass(frozen=True)
class Requested:
    """What a CSR asks for, read from its PEM (after its signature was checked)."""

    public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    dns_names: frozenset[str]
    ips: frozenset[str]
    uris: frozenset[str]


def parse_request(pem: bytes) -> Requested:
    """The CSR's key and names; BadRequest if it is not a self-signed CSR with a key we accept."""
    try:
        csr = x509.load_pem_x509_csr(pem)
    except ValueError as exc:
        raise BadRequest(f"spec.request is not a PEM certificate request: {exc}") from None
    if not csr.is_signature_valid:
        raise BadRequest("the request's signature does not verify")
    key = csr.public_key()
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise BadRequest("RSA keys must have at least 2048 bits")
    elif not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in ("secp256r1", "secp384r1"):
        raise BadRequest("the key must be ECDSA P-256/P-384 or RSA >= 2048")
    dns: set[str] = set()
    ips: set[str] = set()
    uris: set[str] = set()
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    if san is not None:
        dns = set(san.get_values_for_type(x509.DNSName))
        ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        uris = set(san.get_values_for_type(x509.UniformResourceIdentifier))
    return Requested(key, frozenset(dns), frozenset(ips), frozenset(uris))


class CertificateAuthority:
    """An ECDSA P-256 CA; `issue` makes leaf certificates for agents (and the operator's client one)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key = key
        self.cert = cert
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def generate(cls, common_name: str = "gpuobj agent CA", *, now: dt.datetime | None = None) -> CertificateAuthority:
        now = now or dt.datetime.now(dt.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> CertificateAuthority:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key is not an ECDSA key")
        return cls(key, x509.load_pem_x509_certificate(cert_pem))

    def issue(
        self,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey,
        *,
        common_name: str,
        dns_names: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        lifetime: dt.timedelta,
        now: dt.datetime | None = None,
    ) -> bytes:
        """A leaf certificate (PEM) for server and client auth, never outliving the CA."""
        now = now or dt.datetime.now(dt.UTC)
        not_after = min(now + lifetime, self.cert.not_valid_after_utc)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        names += [x509.UniformResourceIdentifier(u) for u in uris]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


def secret_name(release: str) -> str:
    return f"{release}-{agent_tls.CA_SECRET_SUFFIX}"


async def load_or_create(kube: KubeClient, namespace: str, name: str) -> CertificateAuthority:
    """The CA from its Secret; made (once, cluster-wide) when there is none."""
    try:
        secret = await kube.get(SECRETS, name, namespace)
    except NotFound:
        ca = CertificateAuthority.generate()
        body = {
            "metadata": {"name": name, "labels": dict(agent_tls.CA_SECRET_LABELS)},
            "type": "kubernetes.io/tls",
            "data": {
                "tls.crt": base64.b64encode(ca.cert_pem).decode(),
                "tls.key": base64.b64encode(ca.key_pem()).decode(),
            },
        }
        try:
            await kube.create(SECRETS, body, namespace)
            return ca
        except Conflict:  # another replica made it first: use theirs
            secret = await kube.get(SECRETS, name, namespace)
    data = secret.get("data") or {}
    try:
        return CertificateAuthority.from_pem(base64.b64decode(data["tls.crt"]), base64.b64decode(data["tls.key"]))
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"Secret {namespace}/{name} does not hold a usable CA (tls.crt, tls.key): {exc}") from None


def unverified_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, read without verifying it (for a token we hold: whose it is)."""
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return claims


def service_account_of(token: str) -> tuple[str, str]:
    """(namespace, name) of our own ServiceAccount token's subject (read, not verified: it is ours)."""
    try:
        sub = unverified_claims(token)["sub"]
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(f"the operator's token is not a JWT with a subject: {exc}") from None
    prefix = "system:serviceaccount:"
    ns, _, name = sub.removeprefix(prefix).partition(":")
    if not sub.startswith(prefix) or not ns or not name:
        raise ValueError(f"the operator's token names no ServiceAccount ({sub!r})")
    return ns, name


class ClientCertificate:
    """A client certificate for agents (mTLS) naming ``uri``, issued by the CA held here, renewed in place:
    the operator's own (its ServiceAccount, `spiffe://gpuobj.io/ns/<ns>/sa/<name>`), or, in the test harness
    that plays the admin, any identity whose token it presents.

    Agents accept a token only over a connection whose client certificate names the same identity: the
    operator's token replayed without this key is refused.
    `context` is one SSLContext for the operator's life; `maybe_renew` loads a fresh certificate into it.
    The key touches disk only while `load_cert_chain` reads it (a private temporary folder, removed at once),
    unless `folder` is given: no operator key is left behind when the process ends.
    """

    def __init__(self, ca: CertificateAuthority, uri: str, *, folder: Path | None = None) -> None:
        self.ca = ca
        self.uri = uri
        self._dir = folder
        self.context = ssl.create_default_context(cadata=ca.cert_pem.decode())
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.renew_at = dt.datetime.min.replace(tzinfo=dt.UTC)
        self.maybe_renew()

    def maybe_renew(self, now: dt.datetime | None = None) -> None:
        now = now or dt.datetime.now(dt.UTC)
        if now < self.renew_at:
            return
        key = ec.generate_private_key(ec.SECP256R1())
        life = dt.timedelta(seconds=agent_tls.MAX_LIFETIME_SECONDS)
        cert = self.ca.issue(key.public_key(), common_name=self.uri, uris=(self.uri,), lifetime=life, now=now)
        if self._dir is not None:
            self._write_and_load(self._dir, key, cert)
        else:
            with tempfile.TemporaryDirectory(prefix="gpuobj-operator-tls-") as folder:
                self._write_and_load(Path(folder), key, cert)
        self.renew_at = now + life * agent_tls.RENEW_FRACTION

    def _write_and_load(self, folder: Path, key: ec.EllipticCurvePrivateKey, cert: bytes) -> None:
        """ssl loads a chain only from files: write them (the key 0600) and load them into `context`."""
        key_file, cert_file = folder / "tls.key", folder / "tls.crt"
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_file.chmod(0o600)
        cert_file.write_bytes(cert + self.ca.cert_pem)
        self.context.load_cert_chain(str(cert_file), str(key_file))
