"""In-process agents for the agent-level benchmarks (fence costs, pooled fence): real runtimes, real NIXL,
on 127.0.0.1 with a throwaway token file, so each benchmark times the agent code and nothing around it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.runtime import AgentRuntime


def runtime_factory(folder: str | Path) -> Callable[[str], AgentRuntime]:
    """A function that starts one named agent runtime; its token file lives in `folder` (a temp dir)."""
    token = Path(folder) / "token"
    token.write_text("bench")

    def runtime(name: str) -> AgentRuntime:
        return AgentRuntime(AgentConfig(pod_name=name, host="127.0.0.1", port=0, token_file=str(token))).start()

    return runtime
