"""The Helm chart and the kustomize base without a cluster: lint, render, package, one source of truth.

Cluster-side checks (server dry run, install, upgrade, uninstall, RBAC) are in test_install.py.
"""

from __future__ import annotations

import json
import re
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

from gpuobj_contract import names
from gpuobj_operator.flags import build_parser
from tests.e2e.deploy import chart_docs
from tests.e2e.deploy.support import (
    ALL_FEATURES,
    CHART,
    CRD_FILES,
    CRD_NAMES,
    CRDS_DIR,
    DEPLOY,
    REPO,
    find,
    kube_version,
    merge,
    one,
    parse,
    render,
    run,
    template_args,
)

RULES_FILE = REPO / "deploy" / "prometheus" / "gpuobj-rules.yaml"
DASHBOARD_FILE = REPO / "deploy" / "grafana" / "gpuobj-leaks-dashboard.json"
DEFAULT_KINDS = {
    "ServiceAccount", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Role",
    "RoleBinding", "Service", "Deployment", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    "FlowSchema", "PriorityLevelConfiguration",
}  # fmt: skip
OPTIONAL_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}


def all_features(workload_ns: str = "ml") -> dict:
    return merge(
        ALL_FEATURES, {"workloads": {"bindings": [{"namespace": workload_ns, "serviceAccounts": ["trainer"]}]}}
    )


# ------------------------------------------------------------------ lint and render


@pytest.mark.parametrize("features", ["defaults", "every optional feature"])
def test_helm_lint_passes_strictly(features: str, tmp_path: Path) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", kube_version()]
    if features != "defaults":
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(all_features()))
        args += ["-f", str(values)]
    out = run("helm", *args).stdout
    assert "0 chart(s) failed" in out, out


def test_template_renders_the_operator_with_defaults_and_nothing_optional() -> None:
    docs = render()
    assert {d["kind"] for d in docs} == DEFAULT_KINDS
    assert not OPTIONAL_KINDS & {d["kind"] for d in docs}


def test_template_renders_every_optional_feature() -> None:
    docs = render(values=all_features())
    assert {d["kind"] for d in docs} == DEFAULT_KINDS | OPTIONAL_KINDS
    monitor = one(docs, "ServiceMonitor")
    # The operator's leaked-bytes series carry the namespace/pod holding the bytes
    # (dev/gpuobj_dev/observability/scrape.py).
    assert [e.get("honorLabels") for e in monitor["spec"]["endpoints"]] == [True]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service = one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert one(docs, "PodMonitor")["spec"]["selector"]["matchLabels"] == {"gpuobj.io/agent": "true"}
    dashboard = one(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    # Workload RBAC lands in the workload namespace (and no Secret anywhere: there is no shared token).
    assert not find(docs, "Secret")
    binding = one(docs, "RoleBinding", "t-gpuobj-workload")
    assert binding["metadata"]["namespace"] == "ml"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainer", "namespace": "ml"}]
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole", "t-gpuobj-workload")["metadata"]["name"]


def test_values_schema_refuses_typos_and_wrong_types() -> None:
    for bad in (["--set", "operator.replicsa=2"], ["--set", "crds.keep=maybe"], ["--set", "operator.metricsPort=0"]):
        proc = run("helm", *template_args("t", "gpuobj-test"), *bad, check=False)
        assert proc.returncode != 0, bad
        assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ one source: CRDs, rules, dashboard


def test_chart_reads_the_crds_through_a_symlink_and_copies_nothing() -> None:
    link = CHART / "files" / "crds"
    assert link.is_symlink() and link.resolve() == CRDS_DIR.resolve()
    assert not link.readlink().is_absolute(), "a relative link survives a clone anywhere"
    # No other file in the chart is a CRD.
    for path in CHART.rglob("*"):
        if path.is_file() and not path.is_relative_to(link):
            assert "kind: CustomResourceDefinition" not in path.read_text(), path


def test_rendered_crds_are_the_repository_crds_plus_metadata() -> None:
    rendered = {d["metadata"]["name"]: d for d in find(render(), "CustomResourceDefinition")}
    assert set(rendered) == set(CRD_NAMES)
    for path in CRD_FILES:
        source = yaml.safe_load(path.read_text())
        crd = rendered[source["metadata"]["name"]]
        assert {k: v for k, v in crd.items() if k != "metadata"} == {k: v for k, v in source.items() if k != "metadata"}
        assert source["metadata"]["labels"].items() <= crd["metadata"]["labels"].items()
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"crds": {"enabled": True, "keep": False}}, "installed, no keep policy"),
        ({"crds": {"enabled": False, "keep": True}}, "not installed"),
    ],
)
def test_crd_switches(values: dict, expected: str) -> None:
    crds = find(render(values=values), "CustomResourceDefinition")
    if expected == "not installed":
        assert crds == []
    else:
        assert len(crds) == len(CRD_NAMES)
        assert all("helm.sh/resource-policy" not in (c["metadata"].get("annotations") or {}) for c in crds)


def test_rules_and_dashboard_come_from_deploy_through_symlinks() -> None:
    for link, target in (
        (CHART / "files" / "prometheus" / "gpuobj-rules.yaml", RULES_FILE),
        (CHART / "files" / "grafana" / "gpuobj-leaks-dashboard.json", DASHBOARD_FILE),
    ):
        assert link.is_symlink() and link.resolve() == target.resolve(), link
    docs = render(values=all_features())
    assert one(docs, "PrometheusRule")["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]
    (data,) = one(docs, "ConfigMap")["data"].values()
    assert json.loads(data) == json.loads(DASHBOARD_FILE.read_text())


def test_helm_package_follows_the_symlinks(tmp_path: Path) -> None:
    run("helm", "package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("gpuobj-*.tgz")
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        for path in CRD_FILES:
            member = members[f"gpuobj/files/crds/{path.name}"]
            assert member.isfile(), "packaged as a file, not as a link"
            assert tar.extractfile(member).read() == path.read_bytes()
        assert "gpuobj/files/crds/kustomization.yaml" not in members
        assert tar.extractfile(members["gpuobj/files/grafana/gpuobj-leaks-dashboard.json"]).read() == (
            DASHBOARD_FILE.read_bytes()
        )
    # The packaged chart renders the same CRDs without the repository around it.
    docs = parse(run("helm", *template_args("t", "gpuobj-test", chart=archive)).stdout)
    assert len(find(docs, "CustomResourceDefinition")) == len(CRD_NAMES)


# ------------------------------------------------------------------ the operator Deployment


def test_operator_deployment_runs_one_hardened_replica_with_the_operators_flags() -> None:
    docs = render(
        values={"operator": {"watchNamespace": "ml", "logLevel": "DEBUG", "extraArgs": ["--lease-seconds=20"]}}
    )
    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    (port,) = container["ports"]
    assert port["name"] == "metrics"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    # The operator's own projected token for the agents' audience, mounted as a directory (rotation reaches
    # it) and passed as --token-file.
    (token_volume,) = [v for v in pod["volumes"] if "projected" in v]
    (source,) = token_volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == names.AGENT_AUDIENCE
    assert source["serviceAccountToken"]["expirationSeconds"] == 600  # the shortest the kubelet allows
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == token_volume["name"]]
    assert "subPath" not in mount
    args = container["args"]
    token_file = f"{mount['mountPath']}/{source['serviceAccountToken']['path']}"
    assert "--allow-agent-host-annotation" not in args  # agents are called at their pod IP only
    assert f"--token-file={token_file}" in args
    assert "--lease-namespace=$(POD_NAMESPACE)" in args and "--identity=$(POD_NAME)" in args
    assert "--namespace=ml" in args and "--log-level=DEBUG" in args and "--metrics-port=8080" in args
    # Every flag exists in the operator's parser (operator/gpuobj_operator/flags.py) and means what the chart says.
    parsed = build_parser().parse_args(
        [a.replace("$(POD_NAMESPACE)", "gpuobj-test").replace("$(POD_NAME)", "op-0") for a in args]
    )
    assert (parsed.metrics_port, parsed.token_file, parsed.lease_namespace, parsed.identity) == (
        8080, token_file, "gpuobj-test", "op-0",
    )  # fmt: skip
    assert parsed.namespace == "ml" and parsed.lease_seconds == 20
    lease_role = one(docs, "Role", "t-gpuobj-operator-leader-election")
    assert [parsed.lease_name] in [r.get("resourceNames") for r in lease_role["rules"]]


def test_watch_namespace_turns_the_operator_clusterrole_into_a_role() -> None:
    docs = render(values={"operator": {"watchNamespace": "ml"}})
    # The one cluster-wide grant left: the CSR signer's (CSRs are cluster-scoped), bound per release namespace.
    assert not find(docs, "ClusterRole", "t-gpuobj-operator")
    assert [b["metadata"]["name"] for b in find(docs, "ClusterRoleBinding")] == [
        "t-gpuobj-operator-agent-signer-gpuobj-test"
    ]
    role = one(docs, "Role", "t-gpuobj-operator")
    assert role["metadata"]["namespace"] == "ml"
    assert one(docs, "RoleBinding", "t-gpuobj-operator")["subjects"][0]["namespace"] == "gpuobj-test"
    cluster = one(render(), "ClusterRole", "t-gpuobj-operator")
    assert role["rules"] == cluster["rules"]


def test_the_progress_marker_role_comes_only_with_a_watch_of_every_namespace() -> None:
    """The marker lives in the operator's namespace; watching one namespace, the operator has none
    (it would show in the users' kubectl get gpuobj there: docs/operator-free-path.md)."""
    role = one(render(), "Role", "t-gpuobj-operator-progress-marker")
    assert role["metadata"]["namespace"] == "gpuobj-test"
    assert one(render(), "RoleBinding", "t-gpuobj-operator-progress-marker")["metadata"]["namespace"] == "gpuobj-test"
    namespaced = render(values={"operator": {"watchNamespace": "ml"}})
    assert not find(namespaced, "Role", "t-gpuobj-operator-progress-marker")
    assert not find(namespaced, "RoleBinding", "t-gpuobj-operator-progress-marker")


def test_shards_render_a_deployment_per_shard_each_with_its_index_and_its_own_granted_lease() -> None:
    """operator.shards (docs/scale.md, Several operators): the operator derives shard i's Lease from
    --lease-name; the chart grants exactly those names, and one shard renders the unsharded Deployment."""
    docs = render(values={"operator": {"shards": 2, "replicas": 2}})
    deployments = sorted(find(docs, "Deployment"), key=lambda d: d["metadata"]["name"])
    assert [d["metadata"]["name"] for d in deployments] == ["t-gpuobj-operator-shard-0", "t-gpuobj-operator-shard-1"]
    (role,) = [d for d in find(docs, "Role") if d["metadata"]["name"] == "t-gpuobj-operator-leader-election"]
    (granted,) = [r["resourceNames"] for r in role["rules"] if "resourceNames" in r]
    leases = []
    for i, d in enumerate(deployments):
        assert d["spec"]["replicas"] == 2 and d["spec"]["strategy"] == {"type": "Recreate"}
        assert d["spec"]["selector"]["matchLabels"]["gpuobj.io/shard"] == str(i)
        assert d["spec"]["template"]["metadata"]["labels"]["gpuobj.io/shard"] == str(i)
        (container,) = d["spec"]["template"]["spec"]["containers"]
        args = [a.replace("$(POD_NAMESPACE)", "gpuobj-test").replace("$(POD_NAME)", "op") for a in container["args"]]
        parsed = build_parser().parse_args(args)
        assert (parsed.shard_count, parsed.shard_index) == (2, i)
        leases.append(f"{parsed.lease_name}-shard-{i}")
    assert granted == leases
    (single,) = find(render(), "Deployment")
    assert single["metadata"]["name"] == "t-gpuobj-operator"
    assert "gpuobj.io/shard" not in single["spec"]["selector"]["matchLabels"]
    assert not [a for a in single["spec"]["template"]["spec"]["containers"][0]["args"] if "shard" in a]
    with pytest.raises(AssertionError, match="watchNamespace"):
        render(values={"operator": {"shards": 2, "watchNamespace": "ml"}})


def test_operator_rbac_grants_nothing_on_secrets_crds_or_namespaces() -> None:
    """Secrets: only its own CA's, in its own namespace (create, then get by name: agent_ca.py)."""
    docs = render()
    for kind in ("ClusterRole", "Role"):
        for role in find(docs, kind):
            if role["metadata"]["name"].startswith("t-gpuobj-operator"):
                for rule in role["rules"]:
                    assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
                    assert not {"customresourcedefinitions", "namespaces"} & set(rule["resources"]), rule
                    if "secrets" in rule["resources"]:
                        assert kind == "Role" and role["metadata"]["name"] == "t-gpuobj-operator-agent-ca", role
                        assert role["metadata"]["namespace"] == "gpuobj-test"
                        assert rule["verbs"] == ["create"] or (
                            rule["verbs"] == ["get"] and rule["resourceNames"] == ["t-gpuobj-agent-ca"]
                        ), rule
    signer = one(docs, "ClusterRole", "t-gpuobj-operator-agent-signer")
    (signers,) = [r for r in signer["rules"] if r["resources"] == ["signers"]]
    assert signers["resourceNames"] == ["gpuobj.io/agent-serving"] and signers["verbs"] == ["approve", "sign"]


def test_the_chart_renders_no_shared_token_in_any_namespace() -> None:
    docs = render(values={"workloads": {"bindings": [{"namespace": "ml", "serviceAccounts": ["a"]},
                                                      {"namespace": "rl", "serviceAccounts": ["b"]}]},
                          "agentAuth": {"tokenExpirationSeconds": 900}})  # fmt: skip
    assert not find(docs, "Secret")
    volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert not [v for v in volumes if "secret" in v]
    (projected,) = [v["projected"]["sources"][0]["serviceAccountToken"] for v in volumes if "projected" in v]
    assert projected["expirationSeconds"] == 900
    # The host-annotation escape hatch is off unless asked for, and then it is one flag.
    args = one(render(values={"operator": {"allowAgentHostAnnotation": True}}), "Deployment")["spec"]["template"][
        "spec"
    ]
    assert "--allow-agent-host-annotation" in args["containers"][0]["args"]


def test_agent_tls_is_on_by_default_and_one_value_turns_it_off() -> None:
    args = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--agent-tls=on" in args and "--agent-ca-secret=t-gpuobj-agent-ca" in args
    parsed = build_parser().parse_args([a for a in args if "$(" not in a])
    assert parsed.agent_tls == "on" and parsed.agent_ca_secret == "t-gpuobj-agent-ca" and parsed.agent_signer
    off = one(render(values={"agentTLS": {"enabled": False}}), "Deployment")["spec"]["template"]["spec"]
    assert "--agent-tls=off" in off["containers"][0]["args"]


# ------------------------------------------------------------------ docs and versions


def test_chart_readme_values_table_is_rendered_from_values_comments() -> None:
    readme = (CHART / "README.md").read_text()
    values = (CHART / "values.yaml").read_text()
    assert chart_docs.render(readme, values) == readme, "run `python tests/e2e/deploy/chart_docs.py --write`"
    documented = {r.key for r in chart_docs.rows(values)}
    assert {"crds.enabled", "crds.keep", "agentAuth.tokenExpirationSeconds", "workloads.bindings"} <= documented
    keep = next(r for r in chart_docs.rows(values) if r.key == "crds.keep")
    assert "GPUObject" in keep.description and "GPUObjectClaim" in keep.description


def test_versions_agree_with_pyproject() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    kustomization = yaml.safe_load((DEPLOY / "operator" / "kustomization.yaml").read_text())
    assert [i["newTag"] for i in kustomization["images"]] == [version]
    for example in (DEPLOY / "examples").glob("*.yaml"):
        for tag in re.findall(r"image: \S+:(\S+)", example.read_text()):
            assert tag == version, example


# ------------------------------------------------------------------ the kustomize base says what the chart says


def _comparable(doc: dict) -> dict:
    """An object without the labels and annotations that differ between Helm and kustomize by design."""
    doc = json.loads(json.dumps(doc))
    doc["metadata"] = {k: v for k, v in doc["metadata"].items() if k in ("name", "namespace")}
    template = doc.get("spec", {}).get("template", {})
    template.get("metadata", {}).pop("labels", None)
    return doc


def test_kustomize_base_renders_the_same_objects_as_the_chart() -> None:
    built = parse(run("kubectl", "kustomize", str(DEPLOY)).stdout)
    chart = render("gpuobj", "gpuobj-system", values={"crds": {"enabled": False}})
    # CRDs: exactly crds/, untouched.
    crds = find(built, "CustomResourceDefinition")
    assert sorted(json.dumps(c, sort_keys=True) for c in crds) == sorted(
        json.dumps(yaml.safe_load(p.read_text()), sort_keys=True) for p in CRD_FILES
    )
    built_rest = {
        (d["kind"], d["metadata"]["name"]): d for d in built if d["kind"] not in ("CustomResourceDefinition",)
    }
    chart_rest = {(d["kind"], d["metadata"]["name"]): d for d in chart}
    # The base adds the namespace; neither has a token Secret.
    assert set(built_rest) - set(chart_rest) == {("Namespace", "gpuobj-system")}
    assert set(chart_rest) == set(built_rest) - {("Namespace", "gpuobj-system")}
    for key, doc in built_rest.items():
        if key[0] == "Namespace":
            continue
        ours, theirs = _comparable(doc), _comparable(chart_rest[key])
        if key[0] == "Deployment":
            (container,) = theirs["spec"]["template"]["spec"]["containers"]
            container["image"] = ours["spec"]["template"]["spec"]["containers"][0]["image"]
        assert ours == theirs, key


def test_examples_are_what_the_end_to_end_tests_expect() -> None:
    objects = parse((DEPLOY / "examples" / "gpuobject.yaml").read_text())
    (obj,) = objects
    assert obj["metadata"] == {"name": "weights"}
    assert obj["spec"]["source"] == {"podName": "trainer-0"} and obj["spec"]["key"] == "weights"
    (claim,) = parse((DEPLOY / "examples" / "gpuobjectclaim.yaml").read_text())
    assert claim["metadata"] == {"name": "weights-reader"}
    assert claim["spec"] == {"objectName": "weights", "holder": {"podName": "reader-0"}}
    pod = one(parse((DEPLOY / "examples" / "workload-pod.yaml").read_text()), "Pod")
    assert pod["metadata"]["name"] == "trainer-0" and "namespace" not in pod["metadata"]
    assert pod["metadata"]["labels"]["gpuobj.io/agent"] == "true"
    (container,) = pod["spec"]["containers"]
    assert {"name": "gpuobj-agent", "containerPort": 8471, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert {"GPUOBJ_POD_NAME", "GPUOBJ_POD_NAMESPACE", "GPUOBJ_POD_UID", "GPUOBJ_TOKEN_FILE"} <= set(env)
    assert env["GPUOBJ_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert "gpuobj.Client.connect(" in container["args"][0] and 'client.publish("weights"' in container["args"][0]
