"""The operator calls a pod's agent at the pod's own IP: an annotation cannot send its token elsewhere."""

from __future__ import annotations

from gpuobj_contract import names
from gpuobj_operator.model import parse_pod


def _pod(annotations: dict[str, str], pod_ip: str | None = "10.1.2.3") -> dict:
    return {
        "metadata": {"namespace": "ml", "name": "p", "uid": "u", "annotations": annotations},
        "spec": {"containers": [{"name": "w", "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": 9000}]}]},
        "status": {"phase": "Running", **({"podIP": pod_ip} if pod_ip else {})},
    }


def test_the_agent_host_annotation_is_ignored_unless_the_operator_allows_it() -> None:
    lure = {names.ANNOTATION_AGENT_HOST: "attacker.example", names.ANNOTATION_AGENT_PORT: "8000"}
    assert parse_pod(_pod(lure)).endpoint == "10.1.2.3:8000"  # the port may be chosen, the host may not
    assert parse_pod(_pod(lure, pod_ip=None)).endpoint is None  # no IP yet: nothing to call
    assert parse_pod(_pod(lure), allow_host_annotation=True).endpoint == "attacker.example:8000"
    assert parse_pod(_pod({})).endpoint == "10.1.2.3:9000"
