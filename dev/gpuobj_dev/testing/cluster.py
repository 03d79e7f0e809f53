"""A handle on a running dev control plane for tests and the demo: kubectl, helm, an API client."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpuobj_dev import toolchain
from gpuobj_dev.cluster import ClusterState, DevCluster
from gpuobj_kube.client import KubeClient
from gpuobj_kube.config import from_kubeconfig

REPO = Path(__file__).resolve().parents[3]
CRDS_DIR = REPO / "crds"


@dataclass
class ClusterHandle:
    cluster: DevCluster
    state: ClusterState

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.cluster.env()}

    def client(self) -> KubeClient:
        """A new async client; create it inside the event loop that will use it."""
        return KubeClient(from_kubeconfig(self.kubeconfig))

    def run_tool(
        self, tool: str, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        binary = toolchain.binary(tool)
        proc = subprocess.run(
            [str(binary), *args], input=input, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run_tool("kubectl", *args, **kw)

    def terminating_namespaces(self) -> list[str]:
        """Namespaces being deleted: kube-controller-manager's deletions of their contents are writes that a
        test counting API writes must not see (wait until this is empty first)."""
        out = self.kubectl(
            "get", "namespaces", "-o", "jsonpath={.items[?(@.status.phase=='Terminating')].metadata.name}"
        )
        return out.stdout.split()

    def create_namespace(self, name: str, timeout: str = "120s") -> None:
        """A namespace whose `default` ServiceAccount exists: until kube-controller-manager makes it, the
        API server refuses every pod there that names no ServiceAccount (slow on a loaded machine)."""
        self.kubectl("create", "namespace", name)
        self.kubectl("wait", "--for=create", "serviceaccount/default", "-n", name, f"--timeout={timeout}")

    def helm(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run_tool("helm", *args, **kw)

    def apply_crds(self, timeout: str = "60s") -> None:
        """Install gpuobj's CRDs from crds/ (the one source) and wait until they are Established."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(CRDS_DIR))
        self.kubectl(
            "wait",
            "--for",
            "condition=Established",
            "--timeout",
            timeout,
            "-f",
            str(CRDS_DIR / "gpuobj.io_gpuobjects.yaml"),
            "-f",
            str(CRDS_DIR / "gpuobj.io_gpuobjectclaims.yaml"),
            "-f",
            str(CRDS_DIR / "gpuobj.io_gpuobjectstreams.yaml"),
        )
        # Refresh kubectl's discovery cache: `kubectl get gpuobj` expands a category, and kubectl does not
        # re-read discovery for a category it has not seen (a short name would have been retried).
        self.kubectl("api-resources", "--api-group", "gpuobj.io", "--cached=false")
