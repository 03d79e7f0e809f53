"""Operators that watch every namespace: a namespace of their own with the chart's cluster-wide RBAC
(rendered from the chart, so the test grants exactly what an install grants), and their ServiceAccount's
credentials; any number of operator processes run as that account there."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import CHART, LEASE_NAME, OPERATOR_SA, RELEASE, credentials, operator_subject
from gpuobj_dev.testing.operator import OperatorProcess


@dataclass
class Home:
    namespace: str  # the operators' own: their Leases (and progress marker) live here
    kubeconfig: Path
    agent_token: Path  # what the operators present at agents
    subject: str  # agents' GPUOBJ_OPERATOR_SERVICEACCOUNT

    def operator(self, identity: str, extra: tuple[str, ...] = ()) -> OperatorProcess:
        """One operator process as the home's ServiceAccount, started (not yet waited ready)."""
        return OperatorProcess(
            self.kubeconfig,
            self.agent_token,
            identity=identity,
            lease_namespace=self.namespace,
            extra_args=list(extra),
        ).start()


@contextlib.contextmanager
def operator_home(cluster: ClusterHandle, folder: Path, helm_set: tuple[str, ...] = ()) -> Iterator[Home]:
    """A namespace with the chart's operator ServiceAccount and RBAC (``helm_set``: more chart values)."""
    own = f"op-{uuid.uuid4().hex[:8]}"
    cluster.create_namespace(own)
    sets = [arg for value in (f"operator.leaseName={LEASE_NAME}", *helm_set) for arg in ("--set", value)]
    rbac = cluster.helm(
        "template", RELEASE, str(CHART), "--namespace", own, *sets, "--set", "rbac.aggregateToDefaultRoles=false",
        "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac-operator.yaml",
    ).stdout  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=rbac)
    creds = None
    try:
        creds = credentials(cluster, own, OPERATOR_SA, folder)
        yield Home(own, creds.kubeconfig, creds.agent_token, operator_subject(own))
    finally:
        if creds is not None:
            creds.stop()
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=rbac, check=False)
        cluster.kubectl("delete", "namespace", own, "--wait=false", check=False)
