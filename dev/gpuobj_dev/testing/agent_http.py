"""Look at an agent from outside, through its documented HTTP contract (docs/agent-api.md)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpuobj_contract import agent_api as api
from gpuobj_contract import names

# endpoint -> the uid of the pod its agent serves (WorkloadProcess registers it): a test playing the operator
# names the pod it means on every control route, as the operator does (agents refuse a request that does not).
_POD_UIDS: dict[str, str] = {}


def register(endpoint: str, pod_uid: str) -> None:
    _POD_UIDS[endpoint] = pod_uid


def meant_for(endpoint: str) -> dict[str, str]:
    """The header that names the pod at `endpoint` (empty for an agent no test registered)."""
    uid = _POD_UIDS.get(endpoint)
    return {names.HEADER_POD_UID: uid} if uid else {}


def _get(url: str, token: str | None = None, timeout: float = 10, headers: dict[str, str] | None = None) -> bytes:
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers={**auth, **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return r.read()


def inventory(endpoint: str, token_file: Path) -> dict:
    url = f"http://{endpoint}{api.INVENTORY.path()}"
    return json.loads(_get(url, token_file.read_text().strip(), headers=meant_for(endpoint)))


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
