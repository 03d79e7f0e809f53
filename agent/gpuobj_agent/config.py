"""Agent configuration: pod identity, where to listen, and the bounds on every wait.

Why one dataclass: the standalone CLI, the embedded runtime and the tests build the same
thing, and each value (flag, env var, default) is spelled once here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpuobj_contract import names

POD_NAME_ENV = "GPUOBJ_POD_NAME"
POD_NAMESPACE_ENV = "GPUOBJ_POD_NAMESPACE"
POD_UID_ENV = "GPUOBJ_POD_UID"
POD_IP_ENV = "GPUOBJ_POD_IP"
HOST_ENV = "GPUOBJ_AGENT_HOST"
PORT_ENV = "GPUOBJ_AGENT_PORT"
ISSUER_URL_ENV = "GPUOBJ_ISSUER_URL"
REVOCATION_ENV = "GPUOBJ_REVOCATION_FAIL_CLOSED_SECONDS"
OPERATOR_SA_ENV = "GPUOBJ_OPERATOR_SERVICEACCOUNT"
ALLOW_CMA_ENV = "GPUOBJ_ALLOW_CMA"
MAX_STORE_BYTES_ENV = "GPUOBJ_MAX_STORE_BYTES"
TLS_ENV = "GPUOBJ_AGENT_TLS"  # "csr": serve HTTPS with a certificate from the operator's signer; "off": plain HTTP
TLS_DIR_ENV = "GPUOBJ_AGENT_TLS_DIR"  # with GPUOBJ_AGENT_TLS=files: tls.key, tls.crt, ca.crt issued elsewhere
LANDING_IDLE_BYTES_ENV = "GPUOBJ_LANDING_IDLE_BYTES"  # idle landing memory kept registered (a reader of big objects)
# The operator's ServiceAccount in deploy/ (the chart sets $GPUOBJ_OPERATOR_SERVICEACCOUNT in its NOTES).
DEFAULT_OPERATOR_SA = "gpuobj-system/gpuobj-operator"

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class AgentConfig:
    pod_name: str = field(default_factory=lambda: os.environ.get(POD_NAME_ENV, "") or os.uname().nodename)
    namespace: str = field(default_factory=lambda: os.environ.get(POD_NAMESPACE_ENV, "default"))
    pod_uid: str = field(default_factory=lambda: os.environ.get(POD_UID_ENV, ""))
    host: str = field(default_factory=lambda: os.environ.get(HOST_ENV, "0.0.0.0"))
    port: int = field(default_factory=lambda: int(os.environ.get(PORT_ENV, names.DEFAULT_AGENT_PORT)))
    # This pod's own projected ServiceAccount token (audience names.AGENT_AUDIENCE): what the pod
    # presents when it reads from another pod's agent. Not needed to serve.
    token_file: str | None = field(default_factory=lambda: os.environ.get(names.TOKEN_ENV) or None)
    # Who may free, list, materialize (namespace/name, comma-separated in the environment).
    operator_service_accounts: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            s.strip() for s in os.environ.get(OPERATOR_SA_ENV, DEFAULT_OPERATOR_SA).split(",") if s.strip()
        )
    )
    audience: str = names.AGENT_AUDIENCE
    # Where the issuer keys are read: empty means the API server of `kubeconfig` (or in-cluster).
    issuer_url: str | None = field(default_factory=lambda: os.environ.get(ISSUER_URL_ENV) or None)
    kubeconfig: str | None = field(default_factory=lambda: os.environ.get("KUBECONFIG") or None)
    # Revocation (auth.Revocations, docs/security.md): callers' tokens are confirmed with TokenReview at
    # most every 2 s, a request waits for a review once the last is 4 s old (a deleted pod's or
    # ServiceAccount's token is refused within about 4 s), and with no review answered for this many seconds
    # (the API server unreachable) the agent refuses every token. 0: no revocation checks.
    revocation_fail_closed_after: float = field(default_factory=lambda: float(os.environ.get(REVOCATION_ENV, "60")))
    # TLS (agent/gpuobj_agent/tls.py, docs/security.md): "csr" asks the operator's signer for a certificate
    # naming this pod at start (with the pod's own API token), serves HTTPS only and renews it before it
    # expires; "files" serves a certificate issued elsewhere (tls_dir: cert-manager's CSI driver, benches),
    # read again when the files change; "off" serves plain HTTP (agents outside Kubernetes, tests of that path).
    tls: str = field(default_factory=lambda: os.environ.get(TLS_ENV, "off") or "off")
    tls_dir: str | None = field(default_factory=lambda: os.environ.get(TLS_DIR_ENV) or None)
    # Seconds a free waits for in-flight reads of its object before answering 503.
    free_wait_timeout: float = 30.0
    # A read ticket counts as in flight for read_lease seconds plus its bytes at lease_bytes_per_second,
    # unless ended first: a crashed reader holds a free back that long at most.
    read_lease: float = 10.0
    lease_bytes_per_second: float = float(256 << 20)
    # Longest time freed memory that a reader saw waits before its NIXL agent is rotated out:
    # for young objects (put since the last rotation), and for long-lived (tenured) ones.
    fence_interval: float = 0.25
    tenured_fence_interval: float = 1.0
    # Rotate at once (without waiting for fence_interval) when this many freed bytes wait. Well above
    # one large object: at 64 MiB, every free of a 64 MiB object rotated, and every next fetch paid a
    # new NIXL connection (~20-25 ms of the 64 MiB reader step, bench/lifecycle.py).
    quarantine_high_bytes: int = 256 << 20
    # While fewer freed bytes than this wait on an agent, its rotation waits small_fence_interval instead
    # of fence_interval: a rotation costs 20-60 ms of CPU (a new NIXL agent), which a few freed KiB do not
    # justify four times a second (4 pairs of 4 KiB cycles spent about half of 2 CPUs on rotations,
    # bench/lifecycle.py). Above it, and for large objects, the fence is as prompt as before.
    quarantine_low_bytes: int = 16 << 20
    small_fence_interval: float = 2.0
    # UCX progress thread poll timeout in microseconds (see nixl_transport.py).
    progress_delay_us: int = 1000
    # Default bound on one fetch (ticket, transfer, end).
    fetch_timeout: float = 120.0
    transfer_threads: int = 2
    # Idle landing buffers (registered, pre-faulted CPU memory for fetches) kept for reuse.
    # A reader of objects above it (a 1 GB state dict) raises it, or every fetch allocates and registers anew.
    landing_idle_bytes: int = field(
        default_factory=lambda: int(os.environ.get(LANDING_IDLE_BYTES_ENV, "") or 512 << 20)
    )
    shutdown_grace: float = 5.0
    # Largest object (bytes) a declared PUT may allocate.
    max_object_bytes: int = 1 << 40
    # The pod's byte quota: puts and materializations that would make the store hold more are refused
    # (0: none). A declared object cannot make a pod allocate beyond it.
    max_store_bytes: int = field(default_factory=lambda: int(os.environ.get(MAX_STORE_BYTES_ENV, "0") or 0))

    # UCX's cma transport (process_vm_readv) reads any address of the source the reader names: no
    # registration bounds it. Off unless allowed (only where every process that can reach this one by
    # cma is trusted with all of its memory: one pod, or a single-tenant node). See docs/security.md.
    allow_cma: bool = field(default_factory=lambda: os.environ.get(ALLOW_CMA_ENV, "") == "true")

    def __post_init__(self) -> None:
        if self.tls not in ("csr", "files", "off"):
            raise ValueError(f"{TLS_ENV} must be 'csr', 'files' or 'off', not {self.tls!r}")
        if self.tls == "files" and not self.tls_dir:
            raise ValueError(f"{TLS_ENV}=files needs {TLS_DIR_ENV} (the folder of tls.key, tls.crt and ca.crt)")

    def pod_ips(self) -> tuple[str, ...]:
        """The IPs the certificate names: $GPUOBJ_POD_IP (the downward API's status.podIP), else the advertised host."""
        return (os.environ.get(POD_IP_ENV) or self.advertise_host(),)

    def lease_for(self, nbytes: int) -> float:
        return self.read_lease + nbytes / self.lease_bytes_per_second

    def advertise_host(self) -> str:
        """The host others use to reach this agent (a wildcard bind advertises the pod IP)."""
        if self.host in ("0.0.0.0", "::", ""):
            return os.environ.get(POD_IP_ENV, "127.0.0.1")
        return self.host

    def nixl_base_name(self, incarnation: str) -> str:
        """NIXL agent names are unique per pod and incarnation, so no two agents anywhere collide."""
        return "gpuobj." + ".".join(_SAFE.sub("_", p) for p in (self.namespace, self.pod_name, incarnation[:12]))
