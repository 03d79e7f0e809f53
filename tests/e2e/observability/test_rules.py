"""Alert rules: generated from code, valid for promtool, unit-tested with promtool, contract names only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from gpuobj_dev import toolchain
from gpuobj_dev.observability import queries, rules
from tests.e2e.observability.test_dashboard import contract_metrics

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "deploy" / "prometheus" / "gpuobj-rules.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "gpuobj-rules.test.yaml"


def promtool(*args: str, cwd: Path = RULES.parent) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(toolchain.binary("promtool")), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def committed_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_committed_rules_are_what_the_code_generates() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpuobj_dev.observability.rules", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rules_reference_only_metrics_in_metric_names() -> None:
    for rule in committed_rules():
        names = queries.referenced_metrics(rule["expr"])
        assert names, rule["alert"]
        assert names <= contract_metrics(), f"{rule['alert']}: {names - contract_metrics()} not in metric_names.py"


def test_required_alerts_have_their_duration_severity_and_annotations() -> None:
    by_name = {r["alert"]: r for r in committed_rules()}
    expected = {
        "GPUObjectLeakedBytes": ("10m", "warning"),
        "GPUObjectLeakedBytesLarge": ("15m", "critical"),
        "GPUObjectLeakedBytesPersistent": ("1h", "critical"),
        "GPUObjectFreeFailures": ("5m", "warning"),
        "GPUObjectNIXLRegistrationsNotUndone": ("5m", "warning"),
        "GPUObjectOperatorNoLeader": ("5m", "critical"),
    }
    for name, (for_, severity) in expected.items():
        rule = by_name[name]
        assert (rule["for"], rule["labels"]["severity"]) == (for_, severity), name
    for rule in by_name.values():
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}, rule["alert"]
        anchor = rule["annotations"]["runbook"].rsplit("deploy/prometheus/README.md#", 1)[1].rstrip(".")
        assert anchor in {n.lower() for n in by_name}, f"{rule['alert']}: runbook anchor {anchor!r}"
    assert by_name["GPUObjectOperatorNoLeader"]["expr"] == "absent(gpuobj_operator_leader == 1)"


def test_every_alert_has_a_unit_test_and_a_runbook_section() -> None:
    tested = {a["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for a in t["alert_rule_test"]}
    readme = (RULES.parent / "README.md").read_text()
    for name in rules.alert_names():
        assert name in tested, f"{name} has no promtool unit test"
        assert name in readme, f"{name} is not in deploy/prometheus/README.md"


def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", RULES.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(committed_rules())} rules found" in proc.stdout


def test_promtool_test_rules() -> None:
    proc = promtool("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout
