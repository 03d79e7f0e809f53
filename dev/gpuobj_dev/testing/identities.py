"""Real identities for tests and the demo: ServiceAccounts with the chart's RBAC, and projected tokens.

Why: the operator and every workload must run as their own ServiceAccounts, bound to exactly the
roles the chart ships, or a missing permission (or an extra one) goes unseen. A kubelet would mount
projected tokens into each pod; the dev control plane has no kubelet, so `ProjectedToken` does its
job: it asks the TokenRequest API (`serviceaccounts/<name>/token`) for a token with the audience,
expiry and pod binding a projected volume would carry, writes it to a file atomically, and renews it
at 80% of its life, as the kubelet does. Only this harness (playing the kubelet and the cluster admin
who installs the chart) uses the admin credentials; the processes under test never see them.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import ssl
import tempfile
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuobj_contract import names
from gpuobj_dev.testing.cluster import REPO, ClusterHandle

CHART = REPO / "charts" / "gpuobj"
RELEASE = "gpuobj"
OPERATOR_SA = "gpuobj-operator"  # <release>-operator, the chart's default with RELEASE
WORKLOAD_SA = "gpuobj-workload"
LEASE_NAME = "gpuobj-operator"
TOKEN_SECONDS = 600  # the shortest expiry the API server grants


def _ssl_context(cluster: ClusterHandle) -> ssl.SSLContext:
    pki = cluster.cluster.pki
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    ctx.load_cert_chain(str(pki.root / "admin.crt"), str(pki.root / "admin.key"))
    return ctx


def request_token(
    cluster: ClusterHandle,
    namespace: str,
    service_account: str,
    *,
    audience: str | None = None,
    pod: tuple[str, str] | None = None,
    seconds: int = TOKEN_SECONDS,
) -> tuple[str, float]:
    """(token, seconds it lives) from the TokenRequest API; bound to the pod (name, uid) when given."""
    spec: dict = {"expirationSeconds": seconds}
    if audience:
        spec["audiences"] = [audience]
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod[0], "uid": pod[1]}
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}).encode()
    url = f"{cluster.state.server}/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=_ssl_context(cluster), timeout=30) as resp:
        status = json.loads(resp.read())["status"]
    expires = dt.datetime.fromisoformat(status["expirationTimestamp"].replace("Z", "+00:00"))
    return status["token"], (expires - dt.datetime.now(dt.UTC)).total_seconds()


class ProjectedToken:
    """A token file kept fresh, like a projected serviceAccountToken volume."""

    def __init__(
        self,
        cluster: ClusterHandle,
        namespace: str,
        service_account: str,
        path: Path,
        *,
        audience: str | None = None,
        pod: tuple[str, str] | None = None,
        seconds: int = TOKEN_SECONDS,
    ) -> None:
        self.cluster, self.namespace, self.service_account = cluster, namespace, service_account
        self.path, self.audience, self.pod, self.seconds = Path(path), audience, pod, seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0

    def refresh(self) -> float:
        """Write a new token now; returns its lifetime in seconds."""
        token, life = request_token(
            self.cluster,
            self.namespace,
            self.service_account,
            audience=self.audience,
            pod=self.pod,
            seconds=self.seconds,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".token-")
        with os.fdopen(fd, "w") as f:
            f.write(token)
        Path(tmp).replace(self.path)  # atomic, as the kubelet's symlink swap
        self.renewals += 1
        return life

    def start(self) -> ProjectedToken:
        life = self.refresh()
        self._thread = threading.Thread(target=self._run, args=(life,), name=f"token-{self.path.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self, life: float) -> None:
        while not self._stop.wait(max(1.0, life * 0.8)):
            try:
                life = self.refresh()
            except OSError:
                life = 10.0  # the API server is busy or going away: try again soon

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def write_token_kubeconfig(cluster: ClusterHandle, token_file: Path, path: Path, namespace: str) -> Path:
    """A kubeconfig that authenticates with the (rotating) token in `token_file`, nothing else."""
    ca = base64.b64encode(cluster.cluster.pki.ca.cert.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dev", "cluster": {"server": cluster.state.server, "certificate-authority-data": ca}}],
        "users": [{"name": "sa", "user": {"tokenFile": str(token_file)}}],
        "contexts": [{"name": "sa", "context": {"cluster": "dev", "user": "sa", "namespace": namespace}}],
        "current-context": "sa",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def render_rbac(cluster: ClusterHandle, namespace: str, *, workload_sas: tuple[str, ...] = (WORKLOAD_SA,)) -> str:
    """The chart's ServiceAccount and RBAC for an operator watching `namespace`, workloads bound in it."""
    args = [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        f"operator.watchNamespace={namespace}",
        "--set",
        f"operator.leaseName={LEASE_NAME}",
        "--set",
        "rbac.aggregateToDefaultRoles=false",
        "--set",
        f"workloads.bindings[0].namespace={namespace}",
    ]
    for i, sa in enumerate(workload_sas):
        args += ["--set", f"workloads.bindings[0].serviceAccounts[{i}]={sa}"]
    for template in ("serviceaccount.yaml", "rbac-operator.yaml", "rbac-workload.yaml", "admission-policy.yaml"):
        args += ["--show-only", f"templates/{template}"]
    return cluster.helm(*args).stdout


def install_identities(
    cluster: ClusterHandle, namespace: str, *, workload_sas: tuple[str, ...] = (WORKLOAD_SA,)
) -> None:
    """What `helm install` would give this namespace: the operator's and workloads' accounts and roles."""
    cluster.kubectl("apply", "-f", "-", input=render_rbac(cluster, namespace, workload_sas=workload_sas))
    for sa in workload_sas:
        cluster.kubectl("create", "serviceaccount", sa, "-n", namespace, check=False)


@dataclass
class Credentials:
    """A process's view of who it is: a kubeconfig (API audience) and an agent-audience token file."""

    kubeconfig: Path
    agent_token: Path
    tokens: tuple[ProjectedToken, ...]

    def stop(self) -> None:
        for t in self.tokens:
            t.stop()


def credentials(
    cluster: ClusterHandle,
    namespace: str,
    service_account: str,
    folder: Path,
    *,
    pod: tuple[str, str] | None = None,
) -> Credentials:
    """Start the two projected tokens a gpuobj pod mounts, and a kubeconfig over the API one."""
    api = ProjectedToken(cluster, namespace, service_account, folder / "api-token", pod=pod).start()
    agent = ProjectedToken(
        cluster, namespace, service_account, folder / "agent-token", audience=names.AGENT_AUDIENCE, pod=pod
    ).start()
    kubeconfig = write_token_kubeconfig(cluster, api.path, folder / "kubeconfig", namespace)
    return Credentials(kubeconfig, agent.path, (api, agent))


def operator_subject(namespace: str) -> str:
    """The value agents are configured with ($GPUOBJ_OPERATOR_SERVICEACCOUNT)."""
    return f"{namespace}/{OPERATOR_SA}"
