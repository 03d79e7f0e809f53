"""In-process agents for the agent-level benchmarks (fence costs, pooled fence): real runtimes, real NIXL,
on 127.0.0.1 with a throwaway token file and the loopback token issuer the agent tests use (an agent
refuses to start without an issuer to verify callers against), so each benchmark times the agent code
and nothing around it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.runtime import AgentRuntime
from gpuobj_dev.testing.issuer import OPERATOR, default_issuer


def reader_token() -> str:
    """A reader pod's own token in the namespace the agents serve, as the agent tests present it."""
    return default_issuer().token("default/default", pod=("reader", "reader-uid"))


def runtime_factory(folder: str | Path) -> Callable[[str], AgentRuntime]:
    """A function that starts one named agent runtime; its token file lives in `folder` (a temp dir)."""
    token = Path(folder) / "token"
    token.write_text(reader_token() + "\n")

    def runtime(name: str) -> AgentRuntime:
        config = AgentConfig(
            pod_name=name,
            namespace="default",
            host="127.0.0.1",
            port=0,
            token_file=str(token),
            issuer_url=default_issuer().url,
            operator_service_accounts=(OPERATOR,),
        )
        return AgentRuntime(config).start()

    return runtime
