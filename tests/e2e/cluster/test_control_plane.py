"""Smoke tests: the loopback control plane has the Kubernetes semantics gpuobj relies on."""

from __future__ import annotations

import asyncio
import ssl
import textwrap
import urllib.error
import urllib.request
import uuid

import pytest

from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_kube.client import PODS, NotFound, Resource
from gpuobj_kube.informer import wait_for

WIDGETS = Resource("smoke.gpuobj.io", "v1", "widgets", "Widget")
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")

WIDGET_CRD = textwrap.dedent("""\
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata:
      name: widgets.smoke.gpuobj.io
    spec:
      group: smoke.gpuobj.io
      names: {kind: Widget, plural: widgets, singular: widget}
      scope: Namespaced
      versions:
        - name: v1
          served: true
          storage: true
          subresources: {status: {}}
          schema:
            openAPIV3Schema:
              type: object
              properties:
                spec:
                  type: object
                  properties:
                    size: {type: integer, minimum: 0}
                status:
                  type: object
                  properties:
                    phase: {type: string}
    """)


@pytest.fixture(scope="module")
def widgets(dev_cluster: ClusterHandle) -> ClusterHandle:
    dev_cluster.kubectl("apply", "-f", "-", input=WIDGET_CRD)
    dev_cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd/widgets.smoke.gpuobj.io")
    return dev_cluster


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_readyz_answers_ok_through_kubectl(dev_cluster: ClusterHandle) -> None:
    assert dev_cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_crd_applied_with_kubectl_becomes_established(widgets: ClusterHandle) -> None:
    out = widgets.kubectl(
        "get", "crd", "widgets.smoke.gpuobj.io", "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}"
    )
    assert out.stdout == "True"


def test_custom_resource_create_get_list_and_watch(widgets: ClusterHandle) -> None:
    name = _name("w")

    async def scenario() -> None:
        async with widgets.client() as kube:
            listed = await kube.list(WIDGETS, "default")
            watch_from = listed["metadata"]["resourceVersion"]
            created = await kube.create(WIDGETS, {"metadata": {"name": name}, "spec": {"size": 3}}, "default")
            assert created["metadata"]["uid"]
            got = await kube.get(WIDGETS, name, "default")
            assert got["spec"] == {"size": 3}
            names = [w["metadata"]["name"] for w in (await kube.list(WIDGETS, "default"))["items"]]
            assert name in names

            async def first_added() -> dict:
                async for kind, obj in kube.watch(WIDGETS, "default", resource_version=watch_from, timeout_seconds=30):
                    if kind == "ADDED" and obj["metadata"]["name"] == name:
                        return obj
                raise AssertionError("watch ended without the ADDED event")

            seen = await asyncio.wait_for(first_added(), 30)
            assert seen["metadata"]["uid"] == created["metadata"]["uid"]
            await kube.delete(WIDGETS, name, "default")

    asyncio.run(scenario())


def test_schema_rejects_a_negative_size(widgets: ClusterHandle) -> None:
    manifest = "apiVersion: smoke.gpuobj.io/v1\nkind: Widget\nmetadata: {name: bad}\nspec: {size: -1}\n"
    proc = widgets.kubectl("apply", "-f", "-", input=manifest, check=False)
    assert proc.returncode != 0
    assert "spec.size" in proc.stderr
    assert widgets.kubectl("get", "widget", "bad", check=False).returncode != 0


def test_status_patch_leaves_spec_unchanged(widgets: ClusterHandle) -> None:
    name = _name("w")

    async def scenario() -> None:
        async with widgets.client() as kube:
            await kube.create(WIDGETS, {"metadata": {"name": name}, "spec": {"size": 1}}, "default")
            patched = await kube.patch(
                WIDGETS, name, {"spec": {"size": 99}, "status": {"phase": "Ready"}}, "default", subresource="status"
            )
            assert patched["status"] == {"phase": "Ready"}
            assert patched["spec"] == {"size": 1}
            # And a main-resource patch ignores status.
            patched = await kube.patch(WIDGETS, name, {"spec": {"size": 2}, "status": {"phase": "Bogus"}}, "default")
            assert patched["spec"] == {"size": 2}
            assert patched["status"] == {"phase": "Ready"}
            await kube.delete(WIDGETS, name, "default")

    asyncio.run(scenario())


def test_finalizer_holds_deletion_until_removed(widgets: ClusterHandle) -> None:
    name = _name("w")

    async def scenario() -> None:
        async with widgets.client() as kube:
            await kube.create(
                WIDGETS, {"metadata": {"name": name, "finalizers": ["smoke.gpuobj.io/hold"]}, "spec": {}}, "default"
            )
            await kube.delete(WIDGETS, name, "default")
            held = await kube.get(WIDGETS, name, "default")
            assert held["metadata"]["deletionTimestamp"]
            await kube.patch(
                WIDGETS,
                name,
                [
                    {"op": "test", "path": "/metadata/finalizers", "value": ["smoke.gpuobj.io/hold"]},
                    {"op": "remove", "path": "/metadata/finalizers"},
                ],
                "default",
                patch_type="json",
            )
            gone = await wait_for(kube, WIDGETS, name, "default", lambda o: o is None, timeout=30)
            assert gone is None

    asyncio.run(scenario())


def test_deleting_a_pod_garbage_collects_what_it_owns(dev_cluster: ClusterHandle) -> None:
    """kube-controller-manager's garbage collector follows ownerReferences (how claims die with their pod)."""
    pod_name, cm_name = _name("holder"), _name("owned")

    async def scenario() -> None:
        async with dev_cluster.client() as kube:
            pod = await kube.create(
                PODS,
                {"metadata": {"name": pod_name}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}},
                "default",
            )
            owner = {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod["metadata"]["uid"]}
            await kube.create(CONFIGMAPS, {"metadata": {"name": cm_name, "ownerReferences": [owner]}}, "default")
            await kube.delete(PODS, pod_name, "default", grace_period_seconds=0)
            await wait_for(kube, PODS, pod_name, "default", lambda o: o is None, timeout=30)
            await wait_for(kube, CONFIGMAPS, cm_name, "default", lambda o: o is None, timeout=60)
            with pytest.raises(NotFound):
                await kube.get(CONFIGMAPS, cm_name, "default")

    asyncio.run(scenario())


def test_request_without_credentials_is_refused(dev_cluster: ClusterHandle) -> None:
    ctx = ssl.create_default_context(cafile=str(dev_cluster.cluster.pki.ca.cert))
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{dev_cluster.state.server}/api/v1/namespaces", context=ctx, timeout=10)
    assert err.value.code == 401


def test_rbac_denies_an_identity_without_bindings(dev_cluster: ClusterHandle) -> None:
    proc = dev_cluster.kubectl("auth", "can-i", "list", "secrets", "--as", "someone", "-A", check=False)
    assert proc.stdout.strip() == "no"


def test_helm_version_runs(dev_cluster: ClusterHandle) -> None:
    out = dev_cluster.helm("version", "--short").stdout
    assert out.startswith("v3.")


def test_kubectl_reports_the_pinned_server_version(dev_cluster: ClusterHandle) -> None:
    from gpuobj_dev.toolchain import load_tools

    out = dev_cluster.kubectl("version", "-o", "json").stdout
    assert f'"gitVersion": "{load_tools()["kubernetes"].version}"' in out
