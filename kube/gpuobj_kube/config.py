"""Where the API server is and how to authenticate: kubeconfig or in-cluster ServiceAccount.

Why our own loader: the async client below needs an ``ssl.SSLContext`` and a server URL,
nothing more, and both the operator and workloads must work in and out of a cluster.
"""

from __future__ import annotations

import base64
import hashlib
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(RuntimeError):
    """No usable cluster configuration was found."""


@dataclass
class KubeConfig:
    server: str
    ssl_context: ssl.SSLContext
    token_file: Path | None = None
    token: str | None = None
    namespace: str = "default"
    # The same credentials as files, for libraries that want paths (kopf's login).
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False

    def bearer(self) -> str | None:
        """Read the token each time: projected ServiceAccount tokens rotate."""
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return self.token


def _materialize(data_b64: str | None, path: str | None, base: Path, suffix: str) -> str | None:
    """ssl needs files: write embedded kubeconfig data once to a private, content-addressed file."""
    if path:
        p = Path(path)
        return str(p if p.is_absolute() else base / p)
    if not data_b64:
        return None
    data = base64.b64decode(data_b64)
    folder = Path(tempfile.gettempdir()) / f"gpuobj-kubeconfig-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    target = folder / (hashlib.sha256(data).hexdigest()[:32] + suffix)
    if not target.is_file():
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        Path(tmp).replace(target)
    return str(target)


def from_kubeconfig(path: str | os.PathLike[str] | None = None, context: str | None = None) -> KubeConfig:
    path = Path(path or os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
    ctx_name = context or doc.get("current-context")
    ctx = next((c["context"] for c in doc.get("contexts", []) if c["name"] == ctx_name), None)
    if ctx is None:
        raise KubeConfigError(f"kubeconfig {path} has no context {ctx_name!r}")
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
    user = next((u["user"] for u in doc.get("users", []) if u["name"] == ctx.get("user")), {}) or {}
    base = path.parent
    ca = _materialize(cluster.get("certificate-authority-data"), cluster.get("certificate-authority"), base, ".crt")
    ctx_ssl = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    if cluster.get("insecure-skip-tls-verify"):
        ctx_ssl.check_hostname = False
        ctx_ssl.verify_mode = ssl.CERT_NONE
    cert = _materialize(user.get("client-certificate-data"), user.get("client-certificate"), base, ".crt")
    key = _materialize(user.get("client-key-data"), user.get("client-key"), base, ".key")
    if cert and key:
        ctx_ssl.load_cert_chain(cert, key)
    token_file = Path(user["tokenFile"]) if user.get("tokenFile") else None
    return KubeConfig(
        server=cluster["server"].rstrip("/"),
        ssl_context=ctx_ssl,
        token_file=token_file,
        token=user.get("token"),
        namespace=ctx.get("namespace", "default"),
        ca_path=ca,
        cert_path=cert,
        key_path=key,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


def in_cluster() -> KubeConfig:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not (SA_DIR / "token").is_file():
        raise KubeConfigError("not running in a cluster (no KUBERNETES_SERVICE_HOST or ServiceAccount token)")
    ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
    namespace = (SA_DIR / "namespace").read_text().strip() if (SA_DIR / "namespace").is_file() else "default"
    if ":" in host:
        host = f"[{host}]"
    return KubeConfig(
        server=f"https://{host}:{port}", ssl_context=ctx, token_file=SA_DIR / "token", namespace=namespace
    )


def load(kubeconfig: str | os.PathLike[str] | None = None) -> KubeConfig:
    """An explicit kubeconfig, else $KUBECONFIG, else in-cluster, else ~/.kube/config."""
    if kubeconfig or os.environ.get("KUBECONFIG"):
        return from_kubeconfig(kubeconfig)
    try:
        return in_cluster()
    except KubeConfigError:
        return from_kubeconfig()
