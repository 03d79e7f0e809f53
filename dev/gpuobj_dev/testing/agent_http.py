"""Look at an agent from outside, through its documented HTTP contract (docs/agent-api.md)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpuobj_contract import agent_api as api


def _get(url: str, token: str | None = None, timeout: float = 10) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return r.read()


def inventory(endpoint: str, token_file: Path) -> dict:
    return json.loads(_get(f"http://{endpoint}{api.INVENTORY.path()}", token_file.read_text().strip()))


def metric(endpoint: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(_get(f"http://{endpoint}{api.METRICS.path()}").decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def assert_holds_nothing(endpoint: str, token_file: Path, timeout: float = 15.0) -> None:
    """The end of every scenario: no object, no registered byte, registrations balanced.

    Waits (bounded) for pending fences: a freed region a reader was granted stays registered,
    parked, until its NIXL agent is retired (within the agent's fence interval)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _holds_nothing(endpoint, token_file)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _holds_nothing(endpoint: str, token_file: Path) -> None:
    held = inventory(endpoint, token_file)["objects"]
    assert held == [], f"agent {endpoint} still holds {held}"
    assert metric(endpoint, "gpuobj_agent_nixl_registered_bytes") == 0
    registered = metric(endpoint, "gpuobj_agent_nixl_registrations_total", {"op": "register"})
    deregistered = metric(endpoint, "gpuobj_agent_nixl_registrations_total", {"op": "deregister"})
    assert registered == deregistered, f"{registered} registrations, {deregistered} deregistrations"
    assert metric(endpoint, "gpuobj_agent_store_bytes") == 0
