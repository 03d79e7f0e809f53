"""gpuobj agent: the per-pod object store, its NIXL agents and its control server.

Modules, outside in:
- main (`gpuobj agent`, standalone process), runtime (embedded in a workload), agent (assembly)
- server (HTTP API, docs/agent-api.md), auth (bearer token file), metrics (Prometheus)
- store (objects, puts, read tickets, frees), fetch (reading other agents' objects),
  buffers (registered landing buffers for fetches)
- fencing (why and how stale readers are fenced), generations, quarantine,
  registrations (the ledger), tickets: plain-Python bookkeeping
- nixl_transport (every NIXL call), layouts (shape/dtype/device), errors, config
- testing (AgentProcess and a scriptable workload, for this and other test suites)
"""
