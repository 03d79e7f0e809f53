"""Installing gpuobj on the real control plane: server-side dry runs, helm install / upgrade / uninstall
with both CRD keep policies, RBAC checked by impersonating the ServiceAccounts, and `kubectl apply -k deploy/`.

Every test leaves the cluster as it found it: releases uninstalled, namespaces deleted, and gpuobj's CRDs
back as crds/ defines them (other tests use them; see `crds_restored`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from gpuobj_contract import names
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import Credentials, credentials
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod
from gpuobj_dev.testing.records import user_records
from gpuobj_dev.testing.waits import wait_until
from gpuobj_dev.testing.workload import WorkloadProcess, free_port
from tests.e2e.deploy.support import (
    ALL_FEATURES,
    CHART,
    CRD_NAMES,
    DEPLOY,
    Rule,
    kube_version,
    merge,
    one,
    parse,
    parse_can_i_list,
    render,
    rules_from_manifest,
    run,
    template_args,
    values_file,
)

PSA_RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/warn": "restricted"}
KEEP_ANNOTATION = "helm.sh/resource-policy"
# Minimal stand-ins for prometheus-operator's CRDs, so objects of those kinds can be dry-run.
MONITORING_KINDS = {
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def _deleted_namespaces(gpuobj_cluster: ClusterHandle) -> Iterator[list[str]]:
    """Namespaces whose deletion a test started; the module waits for all of them at its end (in parallel:
    the namespace controller takes seconds per namespace)."""
    deleted: list[str] = []
    yield deleted
    if deleted:
        gpuobj_cluster.kubectl("wait", "--for=delete", "--timeout=120s", *(f"namespace/{n}" for n in deleted))


@pytest.fixture
def namespaces(gpuobj_cluster: ClusterHandle, _deleted_namespaces: list[str]) -> Iterator[Callable[..., str]]:
    """Make namespaces (with labels); all of them are deleted at the end of the test."""
    made: list[str] = []

    def make(prefix: str, labels: dict[str, str] | None = None) -> str:
        name = unique(prefix)
        doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        gpuobj_cluster.kubectl("create", "-f", "-", input=json.dumps(doc))
        made.append(name)
        return name

    yield make
    if made:
        gpuobj_cluster.kubectl("delete", "namespace", *made, "--wait=false")
        _deleted_namespaces.extend(made)


@pytest.fixture
def crds_restored(gpuobj_cluster: ClusterHandle) -> Iterator[None]:
    """After the test, gpuobj's CRDs are exactly as before: extra labels and annotations (Helm's ownership,
    the keep policy, kubectl's last-applied) removed, deleted CRDs re-created from crds/."""
    k = gpuobj_cluster.kubectl

    def metadata() -> dict[str, dict]:
        listed = json.loads(k("get", "crd", "-o", "json").stdout)["items"]
        return {c["metadata"]["name"]: c["metadata"] for c in listed if c["metadata"]["name"] in CRD_NAMES}

    before = metadata()
    assert set(before) == set(CRD_NAMES), "the gpuobj_cluster fixture installs the CRDs"
    yield
    current = metadata()
    terminating = [f"crd/{name}" for name, meta in current.items() if meta.get("deletionTimestamp")]
    if terminating:  # a test that failed halfway through deleting them: let that finish, then re-create
        k("wait", "--for=delete", "--timeout=60s", *terminating)
        current = metadata()
    for name, meta in current.items():
        extra_labels = set(meta.get("labels") or {}) - set(before[name].get("labels") or {})
        extra_annotations = set(meta.get("annotations") or {}) - set(before[name].get("annotations") or {})
        if extra_labels:
            k("label", "crd", name, *(f"{key}-" for key in sorted(extra_labels)))
        if extra_annotations:
            k("annotate", "crd", name, *(f"{key}-" for key in sorted(extra_annotations)))
    gpuobj_cluster.apply_crds()
    after = metadata()
    for name, meta in after.items():
        assert (meta.get("labels"), meta.get("annotations")) == (
            before[name].get("labels"),
            before[name].get("annotations"),
        )


@pytest.fixture(scope="module")
def monitoring_crds(gpuobj_cluster: ClusterHandle) -> Iterator[None]:
    k = gpuobj_cluster.kubectl
    created = []
    for kind, plural in MONITORING_KINDS.items():
        name = f"{plural}.monitoring.coreos.com"
        if k("get", "crd", name, "--ignore-not-found", "-o", "name").stdout.strip():
            continue  # someone else's: leave it alone
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name, "labels": {"gpuobj.io/test": "deploy"}},
            "spec": {
                "group": "monitoring.coreos.com",
                "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                "scope": "Namespaced",
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                ],
            },
        }
        k("create", "-f", "-", input=json.dumps(crd))
        created.append(name)
    if created:
        k("wait", "--for", "condition=Established", "--timeout=60s", *(f"crd/{n}" for n in created))
    yield
    if created:
        k("delete", "crd", *created, "--wait=true", "--timeout=60s")


def _render_text(release: str, namespace: str, values: dict | None) -> str:
    return run("helm", *template_args(release, namespace, values)).stdout


def _adopt_crds(k: Callable, release: str, namespace: str) -> None:
    """What the chart README tells users with existing CRDs: let the release take them over."""
    k("label", "crd", *CRD_NAMES, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    k("annotate", "crd", *CRD_NAMES, f"meta.helm.sh/release-name={release}",
      f"meta.helm.sh/release-namespace={namespace}", "--overwrite")  # fmt: skip


def _assert_release_objects_exist(cluster: ClusterHandle, release: str, namespace: str) -> list[dict]:
    manifest = parse(cluster.helm("get", "manifest", release, "-n", namespace).stdout)
    by_namespace: dict[str, list[str]] = {}
    for doc in manifest:
        by_namespace.setdefault(doc["metadata"].get("namespace", namespace), []).append(
            f"{doc['kind'].lower()}/{doc['metadata']['name']}"
        )
    for ns, refs in by_namespace.items():
        found = cluster.kubectl("get", "-n", ns, *refs, "-o", "name").stdout.split()
        assert len(found) == len(refs), (refs, found)
    return manifest


# ------------------------------------------------------------------ server-side dry runs


@pytest.mark.parametrize("features", ["defaults", "every optional feature"])
def test_rendered_manifests_pass_a_server_side_dry_run(
    gpuobj_cluster: ClusterHandle, monitoring_crds: None, namespaces: Callable[..., str], features: str
) -> None:
    release_ns = namespaces("gpuobj-dry", PSA_RESTRICTED)
    values = None
    if features != "defaults":
        workload_ns = namespaces("gpuobj-dry-wl")
        values = merge(
            ALL_FEATURES, {"workloads": {"bindings": [{"namespace": workload_ns, "serviceAccounts": ["t"]}]}}
        )
    manifests = _render_text("dry", release_ns, values)
    proc = gpuobj_cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "--force-conflicts", "--field-manager=gpuobj-deploy-test",
        "-f", "-", input=manifests,
    )  # fmt: skip
    applied = [line for line in proc.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(applied) == len(parse(manifests)), proc.stdout
    # The operator pod meets the restricted Pod Security Standard (the namespace enforces and warns).
    assert "PodSecurity" not in proc.stderr, proc.stderr


def test_examples_apply_in_a_restricted_namespace(
    gpuobj_cluster: ClusterHandle, namespaces: Callable[..., str]
) -> None:
    ns = namespaces("gpuobj-examples", PSA_RESTRICTED)
    proc = gpuobj_cluster.kubectl("apply", "-n", ns, "-f", str(DEPLOY / "examples"))
    assert "PodSecurity" not in proc.stderr, proc.stderr
    names = gpuobj_cluster.kubectl("get", "-n", ns, "gpuobj,pod,sa,rolebinding", "-o", "name").stdout.split()
    expected = {"gpuobject.gpuobj.io/weights", "gpuobjectclaim.gpuobj.io/weights-reader", "pod/trainer-0",
                "serviceaccount/gpuobj-workload", "rolebinding.rbac.authorization.k8s.io/gpuobj-workload"}  # fmt: skip
    assert expected <= set(names), names
    # No operator runs here, so nothing holds a finalizer: they go at once.
    gpuobj_cluster.kubectl("delete", "-n", ns, "-f", str(DEPLOY / "examples"), "--wait=true", "--timeout=60s")


# ------------------------------------------------------------------ helm install / upgrade / uninstall


def test_install_upgrade_and_uninstall_keep_the_crds_and_their_objects_and_create_no_secret(
    gpuobj_cluster: ClusterHandle, namespaces: Callable[..., str], crds_restored: None
) -> None:
    k, helm = gpuobj_cluster.kubectl, gpuobj_cluster.helm
    ns, workload_ns = namespaces("gpuobj-rel"), namespaces("gpuobj-rel-wl")
    release = unique("keep")
    _adopt_crds(k, release, ns)
    values = {"workloads": {"bindings": [{"namespace": workload_ns, "serviceAccounts": ["trainer"]}]}}
    notes = helm("install", release, str(CHART), "-n", ns, *values_file(values)).stdout
    try:
        assert "The CRDs are kept on `helm uninstall`" in notes and f"{workload_ns}/trainer" in notes, notes
        manifest = _assert_release_objects_exist(gpuobj_cluster, release, ns)
        kinds = {d["kind"] for d in manifest}
        assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                "Role", "RoleBinding", "Service"} <= kinds  # fmt: skip
        assert "Secret" not in kinds  # no shared token: each pod presents its own projected token
        k("wait", "--for", "condition=Established", "--timeout=60s", *(f"crd/{n}" for n in CRD_NAMES))
        for name in CRD_NAMES:
            meta = json.loads(k("get", "crd", name, "-o", "json").stdout)["metadata"]
            assert meta["annotations"][KEEP_ANNOTATION] == "keep"
        assert (
            k("get", "secret", "-n", workload_ns, "-l", f"app.kubernetes.io/instance={release}", "-o", "name").stdout
            == ""
        )

        # Upgrade: new values reach the Deployment.
        helm("upgrade", release, str(CHART), "-n", ns, "--reuse-values", "--set", "operator.logLevel=DEBUG")
        deployment = one(manifest, "Deployment")["metadata"]["name"]
        args = json.loads(
            k(
                "get", "deployment", "-n", ns, deployment, "-o", "jsonpath={.spec.template.spec.containers[0].args}"
            ).stdout
        )
        assert "--log-level=DEBUG" in args
        assert json.loads(helm("status", release, "-n", ns, "-o", "json").stdout)["version"] == 2

        # An object someone declared, which uninstalling must not destroy.
        k("apply", "-n", workload_ns, "-f", str(DEPLOY / "examples" / "gpuobject.yaml"))
    finally:
        out = helm("uninstall", release, "-n", ns).stdout
    assert "kept due to the resource policy" in out, out
    assert (
        k("get", "gpuobject", "-n", workload_ns, "weights", "-o", "name").stdout.strip()
        == "gpuobject.gpuobj.io/weights"
    )
    for name in CRD_NAMES:
        assert k("get", "crd", name, "-o", "name").stdout.strip()
    leftovers = k("get", "clusterrole,clusterrolebinding,deployment,secret,role,rolebinding,service,serviceaccount",
                  "-A", "-l", f"app.kubernetes.io/instance={release}", "-o", "name").stdout  # fmt: skip
    assert leftovers == "", leftovers
    k("delete", "-n", workload_ns, "-f", str(DEPLOY / "examples" / "gpuobject.yaml"), "--wait=true")


def test_uninstall_with_keep_false_deletes_the_crds(
    gpuobj_cluster: ClusterHandle, namespaces: Callable[..., str], crds_restored: None
) -> None:
    k, helm = gpuobj_cluster.kubectl, gpuobj_cluster.helm
    # (An operator's progress marker holds nothing: it may go with the CRDs.)
    others = user_records(k("get", "gpuobjects,gpuobjectclaims,gpuobjectstreams", "-A", "-o", "name").stdout)
    if others:
        pytest.skip(f"deleting the CRDs would destroy objects other tests left behind: {others[:5]}")
    ns = namespaces("gpuobj-nokeep")
    release = unique("nokeep")
    _adopt_crds(k, release, ns)
    helm("install", release, str(CHART), "-n", ns, "--set", "crds.keep=false")
    try:
        k("wait", "--for", "condition=Established", "--timeout=60s", *(f"crd/{n}" for n in CRD_NAMES))
        for name in CRD_NAMES:
            meta = json.loads(k("get", "crd", name, "-o", "json").stdout)["metadata"]
            assert KEEP_ANNOTATION not in (meta.get("annotations") or {})
    finally:
        helm("uninstall", release, "-n", ns)
    k("wait", "--for=delete", "--timeout=60s", *(f"crd/{n}" for n in CRD_NAMES))
    assert k("get", "crd", *CRD_NAMES, "--ignore-not-found", "-o", "name").stdout == ""
    # crds_restored puts them back for the other tests.


# ------------------------------------------------------------------ RBAC, by impersonation


@pytest.fixture(scope="module")
def rbac_release(gpuobj_cluster: ClusterHandle, _deleted_namespaces: list[str]) -> Iterator[dict[str, str]]:
    """A release with the CRDs left to the fixture, and a workload namespace bound to the workload role."""
    k = gpuobj_cluster.kubectl
    ns, workload_ns, release = unique("gpuobj-rbac"), unique("gpuobj-rbac-wl"), unique("rbac")
    k("create", "namespace", ns)
    k("create", "namespace", workload_ns)
    try:
        k("create", "serviceaccount", "trainer", "-n", workload_ns)
        values = {"crds": {"enabled": False},
                  "workloads": {"bindings": [{"namespace": workload_ns, "serviceAccounts": ["trainer"]}]}}  # fmt: skip
        gpuobj_cluster.helm("install", release, str(CHART), "-n", ns, *values_file(values))
        docs = render(release, ns, values)
        yield {
            "ns": ns,
            "workload_ns": workload_ns,
            "release": release,
            "operator": f"system:serviceaccount:{ns}:{one(docs, 'ServiceAccount')['metadata']['name']}",
            "workload": f"system:serviceaccount:{workload_ns}:trainer",
            "nobody": f"system:serviceaccount:{workload_ns}:nobody",
            "lease": one(docs, "Role", f"{release}-gpuobj-operator-leader-election")["rules"][1]["resourceNames"][0],
            "operator_rules": yaml.safe_dump(one(docs, "ClusterRole", f"{release}-gpuobj-operator")["rules"]),
            "lease_rules": yaml.safe_dump(one(docs, "Role", f"{release}-gpuobj-operator-leader-election")["rules"]),
            "marker_rules": yaml.safe_dump(one(docs, "Role", f"{release}-gpuobj-operator-progress-marker")["rules"]),
            "signer_rules": yaml.safe_dump(
                one(docs, "ClusterRole", f"{release}-gpuobj-operator-agent-signer")["rules"]
            ),
            "ca_rules": yaml.safe_dump(one(docs, "Role", f"{release}-gpuobj-operator-agent-ca")["rules"]),
            "ca_secret": one(docs, "Role", f"{release}-gpuobj-operator-agent-ca")["rules"][1]["resourceNames"][0],
            "workload_rules": yaml.safe_dump(one(docs, "ClusterRole", f"{release}-gpuobj-workload")["rules"]),
        }
        gpuobj_cluster.helm("uninstall", release, "-n", ns)
    finally:
        k(
            "delete",
            "clusterrole,clusterrolebinding",
            "-l",
            f"app.kubernetes.io/instance={release}",
            "--ignore-not-found",
        )
        k("delete", "namespace", ns, workload_ns, "--wait=false", "--ignore-not-found")
        _deleted_namespaces.extend([ns, workload_ns])


def _granted(cluster: ClusterHandle, subject: str, namespace: str, baseline_subject: str) -> set[Rule]:
    """What `subject` may do in `namespace` beyond what every authenticated ServiceAccount may."""

    def listed(who: str) -> set[Rule]:
        return parse_can_i_list(cluster.kubectl("auth", "can-i", "--list", "--as", who, "-n", namespace).stdout)

    return listed(subject) - listed(baseline_subject)


def _merged(rules: set[Rule]) -> dict[tuple[str, tuple[str, ...]], frozenset[str]]:
    """Verbs per (resource, resource names), however many rules grant them."""
    verbs: dict[tuple[str, tuple[str, ...]], frozenset[str]] = {}
    for resource, names_, granted in rules:
        verbs[(resource, names_)] = verbs.get((resource, names_), frozenset()) | granted
    return verbs


def _can(cluster: ClusterHandle, subject: str, *request: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", *request, "--as", subject, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.returncode == 0


def test_operator_service_account_has_exactly_the_rules_the_operator_uses(
    gpuobj_cluster: ClusterHandle, rbac_release: dict[str, str]
) -> None:
    r = rbac_release
    cluster_rules = rules_from_manifest(yaml.safe_load(r["operator_rules"]))
    lease_rules = rules_from_manifest(yaml.safe_load(r["lease_rules"]))
    marker_rules = rules_from_manifest(yaml.safe_load(r["marker_rules"]))
    signer_rules = rules_from_manifest(yaml.safe_load(r["signer_rules"]))
    ca_rules = rules_from_manifest(yaml.safe_load(r["ca_rules"]))
    assert cluster_rules == {
        ("gpuobjects.gpuobj.io", (), frozenset({"get", "list", "watch", "patch", "delete", "free"})),
        ("gpuobjectclaims.gpuobj.io", (), frozenset({"get", "list", "watch", "patch", "delete", "free"})),
        ("gpuobjectstreams.gpuobj.io", (), frozenset({"get", "list", "watch", "patch"})),
        ("gpuobjects.gpuobj.io/status", (), frozenset({"patch"})),
        ("gpuobjectclaims.gpuobj.io/status", (), frozenset({"patch"})),
        ("gpuobjectstreams.gpuobj.io/status", (), frozenset({"patch"})),
        ("pods", (), frozenset({"get", "list", "watch"})),
        ("events", (), frozenset({"create", "patch"})),  # patch: a repeat counted into its Event
    }
    assert lease_rules == {
        ("leases.coordination.k8s.io", (), frozenset({"create"})),
        ("leases.coordination.k8s.io", (r["lease"],), frozenset({"get", "update"})),
    }
    # In its own namespace: the workload rules and its Lease; anywhere else: the workload rules only.
    # The progress marker: create of claims where it lives (admission allows that one claim only).
    assert marker_rules == {("gpuobjectclaims.gpuobj.io", (), frozenset({"create"}))}
    # The agents' signer (cluster-scoped CSRs, its own signer name only) and its CA's Secret, by name.
    assert signer_rules == {
        ("certificatesigningrequests.certificates.k8s.io", (), frozenset({"get", "list", "watch"})),
        ("certificatesigningrequests.certificates.k8s.io/approval", (), frozenset({"update"})),
        ("certificatesigningrequests.certificates.k8s.io/status", (), frozenset({"update"})),
        ("signers.certificates.k8s.io", ("gpuobj.io/agent-serving",), frozenset({"approve", "sign"})),
    }
    assert ca_rules == {("secrets", (), frozenset({"create"})), ("secrets", (r["ca_secret"],), frozenset({"get"}))}
    # kubectl may list a resource's rules from two roles as one line: compare verbs per resource.
    assert _merged(_granted(gpuobj_cluster, r["operator"], r["ns"], r["nobody"])) == _merged(
        cluster_rules | lease_rules | marker_rules | signer_rules | ca_rules
    )
    assert _merged(_granted(gpuobj_cluster, r["operator"], r["workload_ns"], r["nobody"])) == _merged(
        cluster_rules | signer_rules
    )


@pytest.mark.parametrize(
    ("request_", "allowed"),
    [
        (("list", "gpuobjects.gpuobj.io", "-A"), True),
        (("watch", "pods", "-A"), True),
        (("patch", "gpuobjects.gpuobj.io", "--subresource=status", "-n", "{workload_ns}"), True),
        (("delete", "gpuobjectclaims.gpuobj.io", "-n", "{workload_ns}"), True),
        # free: admission lets it delete objects and claims that are not its own (docs/security.md).
        (("free", "gpuobjects.gpuobj.io", "-n", "{workload_ns}"), True),
        (("free", "gpuobjectclaims.gpuobj.io", "-n", "{workload_ns}"), True),
        (("create", "events", "-n", "{workload_ns}"), True),
        (("patch", "events", "-n", "{workload_ns}"), True),
        (("create", "leases.coordination.k8s.io", "-n", "{ns}"), True),
        (("update", "leases.coordination.k8s.io/{lease}", "-n", "{ns}"), True),
        (("list", "secrets", "-A"), False),
        (("get", "secrets", "-n", "{ns}"), False),
        (("delete", "pods", "-n", "{workload_ns}"), False),
        (("patch", "pods", "-n", "{workload_ns}"), False),
        (("update", "leases.coordination.k8s.io/{lease}", "-n", "{workload_ns}"), False),
        (("create", "leases.coordination.k8s.io", "-n", "{workload_ns}"), False),
        (("update", "leases.coordination.k8s.io/some-other-lease", "-n", "{ns}"), False),
        (("delete", "leases.coordination.k8s.io/{lease}", "-n", "{ns}"), False),
        (("create", "gpuobjects.gpuobj.io", "-n", "{workload_ns}"), False),
        (("create", "gpuobjectclaims.gpuobj.io", "-n", "{ns}"), True),
        (("create", "gpuobjectclaims.gpuobj.io", "-n", "{workload_ns}"), False),
        (("update", "gpuobjects.gpuobj.io", "-n", "{workload_ns}"), False),
        (("delete", "gpuobjectstreams.gpuobj.io", "-n", "{workload_ns}"), False),
        (("list", "customresourcedefinitions.apiextensions.k8s.io"), False),
        (("list", "namespaces"), False),
        (("get", "configmaps", "-n", "{ns}"), False),
    ],
)
def test_operator_service_account_is_allowed_what_it_needs_and_denied_the_rest(
    gpuobj_cluster: ClusterHandle, rbac_release: dict[str, str], request_: tuple[str, ...], allowed: bool
) -> None:
    request = [part.format(**rbac_release) for part in request_]
    assert _can(gpuobj_cluster, rbac_release["operator"], *request) is allowed, request


def test_the_operator_may_create_its_progress_marker_and_no_other_claim(
    gpuobj_cluster: ClusterHandle, rbac_release: dict[str, str]
) -> None:
    """RBAC lets it create claims in its namespace only; admission exempts the marker's shape and no other claim."""
    r = rbac_release

    def create(name: str, namespace: str, **spec: object) -> subprocess.CompletedProcess:
        claim = {"apiVersion": names.API_VERSION, "kind": names.KIND_CLAIM,
                 "metadata": {"name": name, "namespace": namespace}, "spec": {"objectName": name, **spec}}  # fmt: skip
        return gpuobj_cluster.kubectl(
            "create", "--dry-run=server", "-f", "-", "--as", r["operator"], input=json.dumps(claim), check=False
        )

    # Any other claim is refused (once the release's policy is in force: policies load asynchronously).
    other = wait_until(
        lambda: (p := create("not-the-marker", r["ns"])).returncode != 0 and p, "the claims policy in force", 30
    )
    assert "claims-for-self-or-as-the-sharer" in other.stderr, other.stderr
    assert create(names.CLAIMS_PROGRESS_MARKER, r["ns"]).returncode == 0
    with_holder = create(names.CLAIMS_PROGRESS_MARKER, r["ns"], holder={"podName": "someone"})
    assert with_holder.returncode != 0 and "claims-for-self-or-as-the-sharer" in with_holder.stderr
    elsewhere = create(names.CLAIMS_PROGRESS_MARKER, r["workload_ns"])
    assert elsewhere.returncode != 0 and "forbidden" in elsewhere.stderr.lower(), elsewhere.stderr


def test_workload_service_account_has_exactly_what_the_client_library_uses(
    gpuobj_cluster: ClusterHandle, rbac_release: dict[str, str]
) -> None:
    r = rbac_release
    workload_rules = rules_from_manifest(yaml.safe_load(r["workload_rules"]))
    assert workload_rules == {
        ("gpuobjects.gpuobj.io", (), frozenset({"create", "get", "list", "watch", "delete"})),
        ("gpuobjectclaims.gpuobj.io", (), frozenset({"create", "get", "delete"})),
        ("gpuobjectstreams.gpuobj.io", (), frozenset({"create", "get", "list", "watch", "patch", "delete"})),
        ("gpuobjectstreams.gpuobj.io/status", (), frozenset({"patch"})),
        ("pods", (), frozenset({"get"})),
    }
    # Plus TokenReview (cluster-scoped, so in every namespace): its agent learns revoked tokens, and CSRs: it
    # asks the operator's signer for a serving certificate with the pod's own token (docs/security.md).
    reviews = {
        ("tokenreviews.authentication.k8s.io", (), frozenset({"create"})),
        ("certificatesigningrequests.certificates.k8s.io", (), frozenset({"create", "get", "watch"})),
    }
    assert _granted(gpuobj_cluster, r["workload"], r["workload_ns"], r["nobody"]) == workload_rules | reviews
    # Bound in its own namespace only.
    assert _granted(gpuobj_cluster, r["workload"], r["ns"], r["nobody"]) == reviews
    for request in (("list", "pods"), ("delete", "pods"), ("patch", "gpuobjects.gpuobj.io"),
                    ("patch", "gpuobjects.gpuobj.io", "--subresource=status"), ("get", "secrets")):  # fmt: skip
        assert not _can(gpuobj_cluster, r["workload"], *request, "-n", r["workload_ns"]), request
    # Every documented action, one by one (a StreamReader lists and watches streams).
    for request in (("create", "gpuobjects.gpuobj.io"), ("delete", "gpuobjects.gpuobj.io"),
                    ("watch", "gpuobjects.gpuobj.io"), ("create", "gpuobjectclaims.gpuobj.io"),
                    ("delete", "gpuobjectclaims.gpuobj.io"), ("list", "gpuobjectstreams.gpuobj.io"),
                    ("watch", "gpuobjectstreams.gpuobj.io"), ("patch", "gpuobjectstreams.gpuobj.io"),
                    ("patch", "gpuobjectstreams.gpuobj.io", "--subresource=status"), ("get", "pods")):  # fmt: skip
        assert _can(gpuobj_cluster, r["workload"], *request, "-n", r["workload_ns"]), request
    # Nothing on claims beyond create/get/delete: a workload cannot rewrite another pod's claim.
    for request in (("patch", "gpuobjectclaims.gpuobj.io"), ("update", "gpuobjectclaims.gpuobj.io"),
                    ("create", "serviceaccounts/token"), ("get", "serviceaccounts"),
                    # free: a workload deletes only what admission finds its own (docs/security.md).
                    ("free", "gpuobjects.gpuobj.io"), ("free", "gpuobjectclaims.gpuobj.io")):  # fmt: skip
        assert not _can(gpuobj_cluster, r["workload"], *request, "-n", r["workload_ns"]), request


def _service_account_kubeconfig(cluster: ClusterHandle, namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount itself (a TokenRequest token), not as an admin."""
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=10m").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    (cluster_entry,) = admin["clusters"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster_entry],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [
            {"name": name, "context": {"cluster": cluster_entry["name"], "user": name, "namespace": namespace}}
        ],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _chart_operator(cluster: ClusterHandle, r: dict[str, str], folder: Path, identity: str) -> OperatorProcess:
    """The real operator (not started), authenticated as the release's ServiceAccount, with the flags the
    chart's Deployment passes and TLS to agents on (the chart's default)."""
    sa_namespace, sa_name = r["operator"].split(":")[2:]
    folder.mkdir(parents=True, exist_ok=True)
    kubeconfig = _service_account_kubeconfig(cluster, sa_namespace, sa_name, folder / "kubeconfig")
    # Its agent token is a real one of its ServiceAccount (TLS to agents names the operator by it in its
    # client certificate): this also runs its CA and signer on the chart's RBAC.
    agent_token = folder / "agent-token"
    audience = f"--audience={names.AGENT_AUDIENCE}"
    token = cluster.kubectl("create", "token", sa_name, "-n", sa_namespace, "--duration=10m", audience).stdout
    agent_token.write_text(token.strip())
    return OperatorProcess(
        kubeconfig, agent_token, identity=identity, lease_namespace=r["ns"],
        extra_args=["--namespace", r["workload_ns"], "--lease-name", r["lease"], "--resync-interval", "2",
                    "--agent-ca-secret", r["ca_secret"], "--agent-tls", "on"],
    )  # fmt: skip


def test_the_operator_runs_on_the_charts_rbac_alone(
    gpuobj_cluster: ClusterHandle, rbac_release: dict[str, str], tmp_path: Path
) -> None:
    """The real operator, authenticated as its ServiceAccount: it leads (its Lease), syncs, watches, adds its
    finalizer, writes status and drops the finalizer on delete, and is never refused by the API server."""
    k, r = gpuobj_cluster.kubectl, rbac_release
    example = str(DEPLOY / "examples" / "gpuobject.yaml")
    op = _chart_operator(gpuobj_cluster, r, tmp_path, identity="rbac-check").start()
    try:
        op.wait_ready(timeout=60)
        holder = k("get", "lease", "-n", r["ns"], r["lease"], "-o", "jsonpath={.spec.holderIdentity}").stdout
        assert holder == "rbac-check"
        k("apply", "-n", r["workload_ns"], "-f", example)
        # Its source pod does not exist: the object stays Pending (status written by the operator).
        k("wait", "-n", r["workload_ns"], "--for=jsonpath={.status.state}=Pending", "-f", example, "--timeout=30s")
        finalizers = k("get", "-n", r["workload_ns"], "-f", example, "-o", "jsonpath={.metadata.finalizers}").stdout
        assert "gpuobj.io/free" in finalizers
        # Deleting it: the operator settles it and drops its finalizer, so the delete completes.
        k("delete", "-n", r["workload_ns"], "-f", example, "--wait=true", "--timeout=30s")
    finally:
        rc = op.stop()
        # Had the operator failed to settle it, its finalizer would keep the namespace from going: drop it.
        if k("get", "-n", r["workload_ns"], "-f", example, "--ignore-not-found", "-o", "name").stdout.strip():
            k("patch", "-n", r["workload_ns"], "-f", example, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
            k("delete", "-n", r["workload_ns"], "-f", example, "--ignore-not-found", "--wait=false")
    output = op.output()
    assert rc == 0, output
    assert "forbidden" not in output.lower() and " 403" not in output, output


@pytest.mark.nixl
def test_a_workload_in_a_namespace_the_chart_binds_connects_with_tls_on_the_charts_rbac_alone(
    gpuobj_cluster: ClusterHandle, rbac_release: dict[str, str], tmp_path: Path
) -> None:
    """Issue 32: a new user's workload, with the chart's default agent TLS, in a namespace listed in
    workloads.bindings. Its process runs as the bound ServiceAccount with pod-bound tokens and nothing else
    (no binding made by hand): its agent gets its certificate from the operator's signer (a cluster-scoped
    CSR, which only the release's ClusterRoleBinding allows), serves HTTPS, and the operator, as its own
    ServiceAccount, reaches it over TLS (the put goes Ready, its release is freed). A ServiceAccount of the
    same namespace that the values do not list is refused, and the error names the binding it lacks."""
    k, r = gpuobj_cluster.kubectl, rbac_release
    wl_ns, operator_subject = r["workload_ns"], "/".join(r["operator"].split(":")[2:])
    op = _chart_operator(gpuobj_cluster, r, tmp_path / "operator", identity="workload-check").start()
    started: list[tuple[WorkloadProcess, Credentials]] = []
    try:
        op.wait_ready(timeout=60)

        def workload(pod_name: str, service_account: str) -> WorkloadProcess:
            port = free_port()

            async def create() -> dict:
                async with gpuobj_cluster.client() as kube:
                    return await create_agent_pod(kube, wl_ns, pod_name, port=port, service_account=service_account)

            uid = asyncio.run(create())["metadata"]["uid"]
            creds = credentials(gpuobj_cluster, wl_ns, service_account, tmp_path / pod_name, pod=(pod_name, uid))
            w = WorkloadProcess(
                pod_name=pod_name, namespace=wl_ns, pod_uid=uid, port=port, token_file=creds.agent_token,
                kubeconfig=creds.kubeconfig,
                env={"GPUOBJ_AGENT_TLS": "csr", "GPUOBJ_OPERATOR_SERVICEACCOUNT": operator_subject},
            )  # fmt: skip
            started.append((w, creds))
            return w.start()

        trainer = workload("trainer-0", "trainer")
        assert trainer.eval("client.agent.serves_tls") is True
        trainer.run("ref = client.put([torch.ones(256)], name='w'); client.flush()")
        k("wait", "-n", wl_ns, "--for=jsonpath={.status.state}=Ready", "gpuobject/w", "--timeout=60s")
        trainer.run("ref.release(); client.flush()")
        k("wait", "-n", wl_ns, "--for=delete", "gpuobject/w", "--timeout=60s")

        k("create", "serviceaccount", "outsider", "-n", wl_ns)
        with pytest.raises(AssertionError) as refused:
            workload("outsider-0", "outsider")
        assert f"ClusterRoleBinding to gpuobj-workload-token-reviewer for ServiceAccount {wl_ns}/outsider" in str(
            refused.value
        ), refused.value
    finally:
        for w, creds in started:
            if w.proc is not None and w.proc.poll() is None:
                w.kill()
            creds.stop()
        rc = op.stop()
    output = op.output()
    assert rc == 0, output
    assert "forbidden" not in output.lower() and " 403" not in output, output


# ------------------------------------------------------------------ kustomize


def test_kubectl_apply_k_deploy_installs_the_crds_and_the_operator(
    gpuobj_cluster: ClusterHandle, crds_restored: None, _deleted_namespaces: list[str]
) -> None:
    k = gpuobj_cluster.kubectl
    built = parse(k("kustomize", str(DEPLOY)).stdout)
    (namespace,) = [d["metadata"]["name"] for d in built if d["kind"] == "Namespace"]
    if k("get", "namespace", namespace, "--ignore-not-found", "-o", "name").stdout.strip():
        pytest.skip(f"namespace {namespace} exists already: not ours to install into and delete")
    try:
        k("apply", "-k", str(DEPLOY))
        found = k("get", "-k", str(DEPLOY), "-o", "name").stdout.split()
        assert len(found) == len(built), (found, [d["metadata"]["name"] for d in built])
        k("wait", "--for", "condition=Established", "--timeout=60s", *(f"crd/{n}" for n in CRD_NAMES))
        assert (
            k("get", "deployment", "-n", namespace, "gpuobj-operator", "-o", "jsonpath={.spec.strategy.type}").stdout
            == "Recreate"
        )
    finally:
        # Everything but the CRDs (deleting those would delete every gpuobj object in the cluster).
        k("delete", "-k", str(DEPLOY / "operator"), "--wait=false", "--ignore-not-found")
        # The flow schemas are cluster-wide: left behind, they would classify every later test's requests.
        k("delete", "-f", str(DEPLOY / "flowcontrol.yaml"), "--ignore-not-found")
        _deleted_namespaces.append(namespace)  # its contents go with it; the module waits for it
    assert (
        k("get", "clusterrole", "gpuobj-operator", "gpuobj-workload", "--ignore-not-found", "-o", "name").stdout == ""
    )


def test_helm_template_and_kube_version_agree_with_the_cluster(gpuobj_cluster: ClusterHandle) -> None:
    """The tests render for the control plane's own version; the chart's kubeVersion admits it."""
    server = json.loads(gpuobj_cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert server.removeprefix("v").startswith(kube_version())
