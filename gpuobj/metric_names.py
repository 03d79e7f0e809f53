"""Prometheus metric names: the observability contract the dashboard and alert rules query."""

from __future__ import annotations

PREFIX = "gpuobj_"

# Operator.
OBJECTS = "gpuobj_objects"  # gauge{state}
OBJECT_BYTES = "gpuobj_object_bytes"  # gauge{state}
CLAIMS = "gpuobj_claims"  # gauge
LEAKED_BYTES = "gpuobj_leaked_bytes"  # gauge{namespace,pod}
RECLAIMED_BYTES = "gpuobj_reclaimed_bytes_total"  # counter{namespace}
FREE_LATENCY = "gpuobj_free_latency_seconds"  # histogram: last reference gone -> agent ack
FREES = "gpuobj_frees_total"  # counter{result}
FREE_FAILURES = "gpuobj_free_failures_total"  # counter{reason}
LOST_OBJECTS = "gpuobj_lost_objects_total"  # counter
AUDIT_RUNS = "gpuobj_audit_runs_total"  # counter{result}
OPERATOR_LEADER = "gpuobj_operator_leader"  # gauge: 1 while this replica holds the leader lease

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
