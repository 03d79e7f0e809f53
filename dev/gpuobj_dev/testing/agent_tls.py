"""TLS to agents in the harness (tests, the demo, the benchmarks): on by default, as the chart runs it.

Why one module: the operator's `--agent-tls` and the workloads' `GPUOBJ_AGENT_TLS` must agree (an operator
with TLS on cannot reach a plain agent, and a TLS agent waits for the operator's signer before it serves),
so one setting decides both. `GPUOBJ_TEST_AGENT_TLS=off` runs the whole harness plain, the path of agents
outside Kubernetes; a test that probes the plain path on purpose asks for it by name (``PLAIN``).
"""

from __future__ import annotations

import os

SETTING_ENV = "GPUOBJ_TEST_AGENT_TLS"  # "on" (the default) or "off"
AGENT_ENV = "GPUOBJ_AGENT_TLS"  # what a workload pod sets: "csr" (the signer's certificate) or "off"
OPERATOR_FLAG = "--agent-tls"


def enabled() -> bool:
    value = os.environ.get(SETTING_ENV, "on")
    if value not in ("on", "off"):
        raise ValueError(f"{SETTING_ENV} must be 'on' or 'off', not {value!r}")
    return value == "on"


def workload_env() -> dict[str, str]:
    """The workload pod's setting: a certificate from the operator's signer, or plain HTTP."""
    return {AGENT_ENV: "csr" if enabled() else "off"}


PLAIN = {AGENT_ENV: "off"}  # a workload that serves plain HTTP whatever the harness default


def operator_args(args: list[str]) -> list[str]:
    """`args` plus the operator's TLS flag, unless `args` already name it."""
    if OPERATOR_FLAG in args:
        return list(args)
    return [*args, OPERATOR_FLAG, "on" if enabled() else "off"]


def serves_tls(env: dict[str, str]) -> bool:
    return env.get(AGENT_ENV, "off") == "csr"
