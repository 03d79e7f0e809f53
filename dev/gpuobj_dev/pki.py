"""Certificates and keys for the loopback dev control plane.

Why: a real kube-apiserver serves TLS and authenticates clients by certificate; the
dev cluster should exercise the same paths as a production cluster (RBAC on a
client-certificate identity, service-account tokens signed by a key we own).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class DevPKI:
    """A throwaway CA and the leaf certificates the control plane needs, under one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = KeyPair(root / "ca.crt", root / "ca.key")
        self.service_account_key = root / "sa.key"
        self.service_account_pub = root / "sa.pub"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now(dt.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("gpuobj-dev-ca"))
            .issuer_name(_name("gpuobj-dev-ca"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(ca_key, self.ca.key)
        _write_cert(ca_cert, self.ca.cert)
        # Service-account tokens are signed with RSA, as kube-apiserver expects by default.
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(sa_key, self.service_account_key)
        self.service_account_pub.write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def _ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.ca.cert.read_bytes())
        key = serialization.load_pem_private_key(self.ca.key.read_bytes(), password=None)
        return cert, key  # type: ignore[return-value]

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        org: str | None = None,
        server_names: tuple[str, ...] = (),
        server_ips: tuple[str, ...] = (),
    ) -> KeyPair:
        """Issue a leaf: a server certificate when names/IPs are given, else a client certificate."""
        ca_cert, ca_key = self._ca()
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        server = bool(server_names or server_ips)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, org))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        if server:
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
            sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        pair = KeyPair(self.root / f"{name}.crt", self.root / f"{name}.key")
        _write_key(key, pair.key)
        _write_cert(cert, pair.cert)
        return pair
