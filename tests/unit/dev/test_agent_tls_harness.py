"""The harness runs agents as the chart does (TLS on), from one setting (gpuobj_dev.testing.agent_tls)."""

from __future__ import annotations

import base64
import json

import pytest

from gpuobj_contract import agent_tls as contract
from gpuobj_dev.testing import agent_http, agent_tls


def test_tls_is_the_default_and_one_setting_turns_both_sides_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(agent_tls.SETTING_ENV, raising=False)
    assert agent_tls.operator_args(["--namespace", "n"]) == ["--namespace", "n", "--agent-tls", "on"]
    assert agent_tls.workload_env() == {"GPUOBJ_AGENT_TLS": "csr"}
    monkeypatch.setenv(agent_tls.SETTING_ENV, "off")
    assert agent_tls.operator_args([]) == ["--agent-tls", "off"]
    assert agent_tls.workload_env() == {"GPUOBJ_AGENT_TLS": "off"}
    monkeypatch.setenv(agent_tls.SETTING_ENV, "maybe")
    with pytest.raises(ValueError, match="'on' or 'off'"):
        agent_tls.enabled()


def test_a_test_that_names_the_flag_keeps_it() -> None:
    assert agent_tls.operator_args(["--agent-tls", "off", "-v"]) == ["--agent-tls", "off", "-v"]


def _jwt(claims: dict) -> str:
    def part(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


def test_a_token_is_presented_with_a_certificate_of_its_own_holder() -> None:
    """The agent binds a token to its holder's certificate: a pod's token to the pod, the operator's to its
    ServiceAccount. The harness reads whose the token is, so any test presents it as its holder would."""
    pod = _jwt(
        {
            "sub": "system:serviceaccount:ns:gpuobj-workload",
            "kubernetes.io": {"namespace": "ns", "pod": {"name": "p", "uid": "u-1"}, "serviceaccount": {"name": "w"}},
        }
    )
    assert agent_http.identity_of(pod) == contract.pod_uri("ns", "p", "u-1")
    operator = _jwt({"sub": "system:serviceaccount:ops:gpuobj-x-operator"})
    assert agent_http.identity_of(operator) == contract.service_account_uri("ops", "gpuobj-x-operator")
