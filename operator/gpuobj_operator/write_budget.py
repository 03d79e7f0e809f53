"""The fleet's write budget: how many API writes a second each agent's pod may send (pure).

Why the operator decides it: a pod's own back-off only answers what the API server already queued, and a
thousand pods that start writing together send a thousand writes before any answer comes back. The
operator is the one party that knows how many agents there are; it splits a cluster budget
(`--fleet-write-budget`, writes a second; a chart value sized for the API server) between them, and
tells each its share on every probe (prober.py; the write-behind paces at it, gpuobj/client/congestion.py).
"""

from __future__ import annotations


def write_share(budget: float, agents: int, shards: int = 1) -> float:
    """Each agent's share in writes a second; 0 when there is no budget.

    ``agents``: the agent pods this operator probes. Sharded operators each see only their namespaces' pods,
    so each splits its part of the budget (an even split between the shards) between its own agents."""
    if budget <= 0:
        return 0.0
    return budget / max(1, shards) / max(1, agents)
