"""Session fixtures: one real control plane per test run, started on loopback and torn down at the end."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev.cluster import DevCluster
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle

CLUSTER_FIXTURES = {"dev_cluster", "gpuobj_cluster"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Any test that uses the control plane is marked `cluster`, so `-m "not cluster"` runs unit tests alone."""
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[ClusterHandle]:
    """etcd + kube-apiserver + kube-controller-manager for this test session only.

    Its processes die with the test run (PR_SET_PDEATHSIG) even if pytest is killed.
    """
    state_dir = Path(tempfile.mkdtemp(prefix="gpuobj-test-cluster-"))
    cluster = DevCluster(state_dir, tie_to_parent=True, log=lambda msg: print(f"\n[dev-cluster] {msg}"))
    state = cluster.up(timeout=float(os.environ.get("GPUOBJ_CLUSTER_TIMEOUT", "120")))
    try:
        yield ClusterHandle(cluster, state)
    finally:
        cluster.down(quiet=True)


@pytest.fixture(scope="session")
def gpuobj_cluster(dev_cluster: ClusterHandle) -> ClusterHandle:
    """The control plane with gpuobj's CRDs installed from crds/."""
    dev_cluster.apply_crds()
    # Agents serve TLS by default: the harness reads each namespace's agent CA as the cluster admin.
    agent_http.use_agent_ca(agent_http.ca_from_secret(lambda *args: dev_cluster.kubectl(*args).stdout))
    return dev_cluster


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Keep each phase's report on the test item, so fixtures can add evidence when a test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "rep_call", None)
    return report is not None and report.failed
