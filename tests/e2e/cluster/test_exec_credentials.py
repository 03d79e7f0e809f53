"""A kubeconfig whose user is an `exec` plugin (as on EKS, GKE, AKS) works for the API client and the operator.

The plugin is a small script that prints an ExecCredential holding a ServiceAccount token the dev
API server issued (TokenRequest): the API server authenticates it for real, RBAC authorizes it.
"""

from __future__ import annotations

import asyncio
import stat
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpuobj_contract import names
from gpuobj_dev.testing.cluster import REPO, ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import GPUOBJECTS, PODS, KubeClient
from gpuobj_kube.config import from_kubeconfig

OPERATOR_RBAC = REPO / "deploy" / "operator" / "rbac.yaml"


@pytest.fixture
def namespace(gpuobj_cluster: ClusterHandle) -> Iterator[str]:
    name = f"exec-{uuid.uuid4().hex[:8]}"
    gpuobj_cluster.create_namespace(name)
    yield name
    gpuobj_cluster.kubectl("delete", "namespace", name, "--wait=false")


def _operator_identity(cluster: ClusterHandle, namespace: str) -> str:
    """A ServiceAccount bound to the operator's ClusterRole, lease and agent-CA Roles from deploy/ (not admin)."""
    sa = "gpuobj-operator"
    cluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
    docs = [d for d in yaml.safe_load_all(OPERATOR_RBAC.read_text()) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    role["metadata"]["name"] = f"gpuobj-operator-{namespace}"
    lease_role = next(d for d in docs if d["kind"] == "Role")
    lease_role["metadata"]["namespace"] = namespace
    ca_role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "gpuobj-operator-agent-ca")
    ca_role["metadata"]["namespace"] = namespace  # the agent CA's Secret (the operator is the agents' signer)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, lease_role, ca_role]))
    cluster.kubectl(
        "create", "clusterrolebinding", role["metadata"]["name"], f"--clusterrole={role['metadata']['name']}",
        f"--serviceaccount={namespace}:{sa}",
    )  # fmt: skip
    cluster.kubectl(
        "create", "rolebinding", "lease", "-n", namespace, f"--role={lease_role['metadata']['name']}",
        f"--serviceaccount={namespace}:{sa}",
    )  # fmt: skip
    cluster.kubectl(
        "create", "rolebinding", "agent-ca", "-n", namespace, f"--role={ca_role['metadata']['name']}",
        f"--serviceaccount={namespace}:{sa}",
    )  # fmt: skip
    return cluster.kubectl("create", "token", sa, "-n", namespace, "--duration", "20m").stdout.strip()


def _exec_kubeconfig(cluster: ClusterHandle, tmp_path: Path, token: str, namespace: str) -> Path:
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    cluster_entry = admin["clusters"][0]
    plugin = tmp_path / "get-token.py"
    runs = tmp_path / "plugin-runs"
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": token}}
    plugin.write_text(f"import json\nopen({str(runs)!r}, 'a').write('run\\n')\nprint(json.dumps({credential!r}))\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IEXEC)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster_entry],
        "users": [
            {
                "name": "exec-user",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": sys.executable,
                        "args": [str(plugin)],
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
        "contexts": [
            {"name": "exec", "context": {"cluster": cluster_entry["name"], "user": "exec-user", "namespace": namespace}}
        ],
        "current-context": "exec",
    }
    path = tmp_path / "exec-kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_exec_plugin_kubeconfig_works_for_the_client_and_the_operator(
    gpuobj_cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> None:
    token = _operator_identity(gpuobj_cluster, namespace)
    kubeconfig = _exec_kubeconfig(gpuobj_cluster, tmp_path, token, namespace)

    async def as_exec_user() -> list[dict]:
        async with KubeClient(from_kubeconfig(kubeconfig)) as kube:
            return (await kube.list(PODS, namespace))["items"]

    assert asyncio.run(as_exec_user()) == []
    assert (tmp_path / "plugin-runs").read_text().count("run") >= 1

    agent_token = tmp_path / "agent-token"
    agent_token.write_text(uuid.uuid4().hex)
    op = OperatorProcess(
        kubeconfig,
        agent_token,
        identity="exec-op",
        lease_namespace=namespace,
        # Plain: the exec plugin's user is not a ServiceAccount, and TLS to agents names the operator by its
        # ServiceAccount (its client certificate); this test is about the API credentials alone.
        extra_args=["--namespace", namespace, "--lease-seconds", "3", "--agent-tls", "off"],
    ).start()
    try:
        op.wait_ready(timeout=90)
        # The operator's GPUObject informer runs on the same credentials: a GPUObject naming a pod that does not exist
        # gets a status written by the operator.
        obj = {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND_OBJECT,
            "metadata": {"name": "declared", "namespace": namespace},
            "spec": {"source": {"podName": "nobody"}, "tensors": [{"shape": [4], "dtype": "float32"}]},
        }

        async def create() -> None:
            async with gpuobj_cluster.client() as kube:
                await kube.create(GPUOBJECTS, obj, namespace)

        asyncio.run(create())

        def status_written() -> bool:
            got = gpuobj_cluster.kubectl(
                "get", "gobj", "declared", "-n", namespace, "-o", "jsonpath={.status.conditions[*].type}", check=False
            )
            return "SourceAvailable" in got.stdout

        wait_until(status_written, timeout=60, what="the operator (exec-plugin credentials) to write a status")
        gpuobj_cluster.kubectl("delete", "gobj", "declared", "-n", namespace, "--wait=true", "--timeout=60s")
    finally:
        rc = op.stop()
    assert rc == 0, op.output()
