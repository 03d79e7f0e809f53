"""Prometheus metric names: the observability contract the dashboard and alert rules query."""

from __future__ import annotations

PREFIX = "gpuobj_"

# Operator.
OBJECTS = "gpuobj_objects"  # gauge{state}
OBJECT_BYTES = "gpuobj_object_bytes"  # gauge{state}
CLAIMS = "gpuobj_claims"  # gauge
CLAIM_OLDEST_AGE = "gpuobj_claim_oldest_age_seconds"  # gauge{namespace}: age of its oldest live claim (0: none)
CLAIM_HELD_BYTES = "gpuobj_claim_held_bytes"  # gauge{namespace,age=under_10m|10m_to_1h|over_1h}: by oldest claim
LEAKED_BYTES = "gpuobj_leaked_bytes"  # gauge{namespace,pod}
DEAD_HOLDER_BYTES = "gpuobj_dead_holder_bytes"  # gauge{namespace,pod}: the part of leaked bytes held by gone holders
CLAIMS_DROPPED = "gpuobj_claims_dropped_total"  # counter{holder=pod|process|ttl|quota}
RECLAIMED_BYTES = "gpuobj_reclaimed_bytes_total"  # counter{namespace}
FREE_LATENCY = "gpuobj_free_latency_seconds"  # histogram: last reference gone -> agent ack
FREES = "gpuobj_frees_total"  # counter{result}
FREE_FAILURES = "gpuobj_free_failures_total"  # counter{reason}
CLAIMS_CHECKS = "gpuobj_claims_checks_total"  # counter{how=ledger|marker|read}: how a free knew every claim
CLAIMS_MARKER_WRITES = "gpuobj_claims_marker_writes_total"  # counter{result=written|failed}
LOST_OBJECTS = "gpuobj_lost_objects_total"  # counter
AUDIT_RUNS = "gpuobj_audit_runs_total"  # counter{result}
OPERATOR_LEADER = "gpuobj_operator_leader"  # gauge: 1 while this replica holds the leader lease
# counter{resource,selection=shard|unlabelled|all}: events the API server sent its watches of objects and streams
WATCH_EVENTS = "gpuobj_operator_watch_events_total"
NAMESPACE_QUOTA_BYTES = "gpuobj_namespace_quota_bytes"  # gauge{namespace}: the byte quota a platform team set
NAMESPACE_USED_BYTES = "gpuobj_namespace_used_bytes"  # gauge{namespace}: bytes of its admitted GPUObjects
QUOTA_REFUSALS = "gpuobj_quota_refusals_total"  # counter{namespace}: GPUObjects refused over the quota

# Agent.
AGENT_STORE_BYTES = "gpuobj_agent_store_bytes"  # gauge{device}
AGENT_STORE_OBJECTS = "gpuobj_agent_store_objects"  # gauge
AGENT_NIXL_REGISTERED_BYTES = "gpuobj_agent_nixl_registered_bytes"  # gauge
AGENT_NIXL_REGISTRATIONS = "gpuobj_agent_nixl_registrations_total"  # counter{op=register|deregister}
AGENT_TRANSFER_BYTES = "gpuobj_agent_transfer_bytes_total"  # counter{direction}
AGENT_TRANSFER_SECONDS = "gpuobj_agent_transfer_seconds"  # histogram{direction}
AGENT_FREES = "gpuobj_agent_frees_total"  # counter{result=freed|noop}
AGENT_FREE_WAIT_SECONDS = "gpuobj_agent_free_wait_seconds"  # histogram: waiting for in-flight reads
AGENT_ERRORS = "gpuobj_agent_errors_total"  # counter{kind}
AGENT_INFLIGHT_READS = "gpuobj_agent_inflight_reads"  # gauge
AGENT_FREE_SECONDS = "gpuobj_agent_free_seconds"  # histogram: one free request, received -> answered
AGENT_QUARANTINED_BYTES = "gpuobj_agent_quarantined_bytes"  # gauge: freed bytes held until their NIXL agent is fenced
AGENT_QUARANTINE_SECONDS = "gpuobj_agent_quarantine_seconds"  # histogram: free -> memory released (fence latency)
AGENT_NIXL_GENERATIONS = "gpuobj_agent_nixl_generations"  # gauge{state=active|sealed}: NIXL agents alive
AGENT_NIXL_ROTATIONS = "gpuobj_agent_nixl_rotations_total"  # counter: NIXL agents replaced to fence stale readers
AGENT_MIGRATIONS = "gpuobj_agent_migrations_total"  # counter: live objects re-registered in a newer NIXL agent
AGENT_READ_TICKETS = "gpuobj_agent_read_tickets_total"  # counter{result=issued|ended|expired}
