"""The chart README's RBAC table says what the templates grant: resource by resource, verb by verb.

Pure text (no cluster): the rules are read from the chart's named templates (_helpers.tpl), the
table from the README; a verb added to one and not the other fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "gpuobj"
# README row (subject, first words of its kind column) -> the named template of its rules.
ROWS = {("operator", "ClusterRole"): "gpuobj.operator.rules", ("workloads", "ClusterRole"): "gpuobj.workload.rules"}


def template_rules(name: str) -> dict[str, set[str]]:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    match = re.search(r'\{\{-? define "' + re.escape(name) + r'" -?\}\}\n(.*?)\{\{-? end -?\}\}', text, re.S)
    assert match, name
    granted: dict[str, set[str]] = {}
    for rule in yaml.safe_load(match.group(1)):
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
    return granted


def readme_rules(subject: str, kind: str) -> dict[str, set[str]]:
    readme = (CHART / "README.md").read_text()
    rows = [line.split("|")[1:-1] for line in readme.splitlines() if line.startswith(f"| {subject} | {kind}")]
    assert len(rows) == 1, (subject, kind, rows)
    documented: dict[str, set[str]] = {}
    for part in rows[0][2].split(";"):
        resources, _, verbs = part.partition(":")
        words = re.sub(r"\(.*?\)", "", verbs).split()
        for resource in re.findall(r"`([^`]+)`", resources):
            documented.setdefault(resource, set()).update(words)
    return documented


@pytest.mark.parametrize(("subject", "kind"), sorted(ROWS))
def test_the_readme_rbac_table_matches_the_templates(subject: str, kind: str) -> None:
    assert readme_rules(subject, kind) == template_rules(ROWS[(subject, kind)])
