"""Helpers for the install tests: render the chart, read manifests, parse `kubectl auth can-i --list`."""

from __future__ import annotations

import atexit
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

from gpuobj_dev import toolchain

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "gpuobj"
CRDS_DIR = REPO / "crds"
DEPLOY = REPO / "deploy"
CRD_FILES = sorted(CRDS_DIR.glob("gpuobj.io_*.yaml"))
CRD_NAMES = tuple(yaml.safe_load(f.read_text())["metadata"]["name"] for f in CRD_FILES)

# Every optional feature of the chart on (the namespaces are filled in by the caller).
ALL_FEATURES = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "dashboards": {"enabled": True, "annotations": {"grafana_folder": "gpuobj"}},
}


def kube_version() -> str:
    """The Kubernetes version the test control plane runs: `helm template` needs it (see the chart README)."""
    return toolchain.load_tools()["kubernetes"].version.removeprefix("v")


def run(tool: str, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """A toolchain binary without a cluster (helm template/lint/package, kubectl kustomize)."""
    proc = subprocess.run(
        [str(toolchain.binary(tool)), *args], capture_output=True, text=True, input=input, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


_VALUES_DIR: list[Path] = []


def values_file(values: dict | None) -> list[str]:
    """`-f <file>` for a values dict (an empty list for none). The files live in one temporary
    folder that is removed when the test process exits."""
    if not values:
        return []
    if not _VALUES_DIR:
        _VALUES_DIR.append(Path(tempfile.mkdtemp(prefix="gpuobj-values-")))
        atexit.register(shutil.rmtree, _VALUES_DIR[0], True)
    f = tempfile.NamedTemporaryFile("w", dir=_VALUES_DIR[0], suffix=".yaml", delete=False)  # noqa: SIM115
    with f:
        yaml.safe_dump(values, f)
    return ["-f", f.name]


def template_args(release: str, namespace: str, values: dict | None = None, chart: Path | str = CHART) -> list[str]:
    return ["template", release, str(chart), "-n", namespace, "--kube-version", kube_version(), *values_file(values)]


def render(release: str = "t", namespace: str = "gpuobj-test", values: dict | None = None, **kw) -> list[dict]:
    """`helm template` as a list of objects."""
    return parse(run("helm", *template_args(release, namespace, values, **kw)).stdout)


def parse(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: Iterable[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: Iterable[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def merge(base: dict, extra: dict) -> dict:
    """A deep merge of two values dicts (extra wins)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ------------------------------------------------------------------ kubectl auth can-i --list

_CAN_I_ROW = re.compile(
    r"^(?P<resource>\S*)\s+\[(?P<urls>[^\]]*)\]\s+\[(?P<names>[^\]]*)\]\s+\[(?P<verbs>[^\]]*)\]\s*$"
)

Rule = tuple[str, tuple[str, ...], frozenset[str]]  # resource (plural.group[/sub]), resourceNames, verbs


def parse_can_i_list(text: str) -> set[Rule]:
    """Resource rules from `kubectl auth can-i --list` (non-resource URLs are left out)."""
    rules: set[Rule] = set()
    for line in text.splitlines()[1:]:
        m = _CAN_I_ROW.match(line)
        assert m, f"unexpected can-i line: {line!r}"
        if not m["resource"]:
            continue
        rules.add((m["resource"], tuple(m["names"].split()), frozenset(m["verbs"].split())))
    return rules


def rules_from_manifest(rules: list[dict]) -> set[Rule]:
    """The same shape from RBAC rules as written in a (Cluster)Role."""
    out: set[Rule] = set()
    for rule in rules:
        for group in rule.get("apiGroups", [""]):
            for resource in rule["resources"]:
                base, _, sub = resource.partition("/")
                name = f"{base}.{group}" if group else base
                out.add(
                    (name + (f"/{sub}" if sub else ""), tuple(rule.get("resourceNames", ())), frozenset(rule["verbs"]))
                )
    return out
