"""The operator's tunables in one place: what flags.py reads from the command line, and what the reconciler,
its free path, its prober and the auditor run with. Defaults are the production ones."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuobj_operator.claim_ttl import ClaimTTLDefaults
from gpuobj_operator.quota import QuotaLimits
from gpuobj_operator.shards import Shard


@dataclass(frozen=True)
class Settings:
    workers: int = 8
    namespace: str | None = None  # watch one namespace; None: all
    shard: Shard = field(default_factory=Shard)  # act only on the namespaces of this shard (shards.py)
    allow_agent_host_annotation: bool = False  # dev clusters without a pod network only
    leak_settle_seconds: float = 5.0  # before an unreferenced object counts as leaked
    leak_grace_seconds: float = 30.0  # before leaked bytes are reclaimed
    audit_interval: float = 10.0  # seconds between agent inventory audits
    resync_interval: float = 60.0  # seconds between re-decisions of everything
    # A routine status write waits this long: an object or claim gone sooner costs no status write (a
    # lifecycle under a second is its create, its delete and the finalizer's removal); the live view shows
    # every object at once, so kubectl's GPUObject status is the durable record, not the prompt one.
    status_delay: float = 1.0
    stream_status_interval: float = 1.0  # a busy stream's counters are written at most this often
    liveness_interval: float = 20.0  # seconds between backstop probes of each agent (docs/liveness.md)
    liveness_max_backoff: float = 60.0  # the longest gap between probes while they fail
    probe_timeout: float = 2.0
    # API writes a second that all agents' pods may send together, split between them on each probe
    # (write_budget.py); 0: none, each pod backs off on its own (docs/write-behind.md).
    fleet_write_budget: float = 0.0
    # Seconds a free waits for the claims watch before it also reads the claims (docs/operator-free-path.md).
    claims_read_delay: float = 0.05
    # Byte quotas per namespace (quota.py; chart values quota.namespaces and quota.default).
    quota: QuotaLimits = field(default_factory=QuotaLimits)
    # Default claim ttl per namespace (claim_ttl.py; chart value claimTTL.namespaces).
    claim_ttl: ClaimTTLDefaults = field(default_factory=ClaimTTLDefaults)
