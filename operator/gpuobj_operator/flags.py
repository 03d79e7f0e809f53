"""The operator's command line: its flags, their validation, and the typed values the process runs with.

Why apart from main.py: the flags are the operator's interface to the chart and to users; checking them
whole at start (a usage error, exit 2) and handing on frozen values means nothing later reads argparse,
and a bad combination never reaches a running replica.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

from gpuobj_contract import names
from gpuobj_operator.claim_ttl import ClaimTTLDefaults, parse_namespace_claim_ttl
from gpuobj_operator.leader import LeaseConfig
from gpuobj_operator.liveview import server as liveview
from gpuobj_operator.progress_marker import MarkerMisconfigured, marker_namespace
from gpuobj_operator.quota import QuotaLimits, parse_bytes, parse_namespace_quota
from gpuobj_operator.settings import Settings
from gpuobj_operator.shards import Shard

T = TypeVar("T")


@dataclass(frozen=True)
class Flags:
    """What the process runs with, once the command line is known to be valid."""

    settings: Settings  # the reconciler's, its free path's, prober's and auditor's
    lease: LeaseConfig  # this replica's (its shard's) Lease
    kubeconfig: str | None  # None: in-cluster
    token_file: Path | None  # presented to agents
    metrics_host: str
    metrics_port: int  # 0: a free port
    identity: str
    progress_marker_namespace: str | None  # None: no claims progress marker (progress_marker.py)
    agent_tls: bool  # call agents over HTTPS only
    agent_signer: bool  # run the CSR signer
    agent_ca_namespace: str
    agent_ca_secret: str
    log_level: str
    live_view: argparse.Namespace  # the live view reads its own flags (liveview.server.add_arguments)


def parse(argv: list[str] | None = None) -> Flags:
    """The flags of ``argv``; a combination no replica can run with is a usage error here, not at run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        marker_at = progress_marker_namespace(args)
        settings = settings_from(args)
    except (MarkerMisconfigured, ValueError) as exc:
        parser.error(str(exc))
    if settings.shard.count > 1 and args.namespace:
        parser.error("--shard-count shares every namespace between operators; --namespace watches one: choose one")
    return Flags(
        settings=settings,
        lease=LeaseConfig(
            name=settings.shard.lease_name(args.lease_name),
            namespace=args.lease_namespace,
            identity=args.identity,
            lease_seconds=args.lease_seconds,
            renew_seconds=max(0.5, min(5.0, args.lease_seconds / 3)),
            retry_seconds=max(0.5, min(2.0, args.lease_seconds / 6)),
        ),
        kubeconfig=args.kubeconfig,
        token_file=Path(args.token_file) if args.token_file else None,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        identity=args.identity,
        progress_marker_namespace=marker_at,
        agent_tls=args.agent_tls == "on",
        agent_signer=args.agent_signer,
        agent_ca_namespace=args.lease_namespace,
        agent_ca_secret=args.agent_ca_secret,
        log_level=args.log_level,
        live_view=args,
    )


def progress_marker_namespace(args: argparse.Namespace) -> str | None:
    """Where this operator writes its claims progress marker; None: it has none (progress_marker.py)."""
    return marker_namespace(args.namespace, args.lease_namespace, args.claims_progress_marker)


def settings_from(args: argparse.Namespace) -> Settings:
    """The reconciler's settings from the command line (the rest keep Settings' production defaults)."""
    if args.claims_read_delay is not None:
        read_delay = args.claims_read_delay
    else:  # nothing but the claims themselves moves the watch on without the marker: read soon
        read_delay = 0.05 if progress_marker_namespace(args) else 0.005
    return Settings(
        workers=args.workers,
        namespace=args.namespace,
        shard=Shard(args.shard_count, args.shard_index),
        allow_agent_host_annotation=args.allow_agent_host_annotation,
        leak_settle_seconds=args.leak_settle,
        leak_grace_seconds=args.leak_grace,
        audit_interval=args.audit_interval,
        resync_interval=args.resync_interval,
        status_delay=args.status_delay,
        liveness_interval=args.liveness_interval,
        fleet_write_budget=args.fleet_write_budget,
        claims_read_delay=read_delay,
        quota=QuotaLimits(MappingProxyType(dict(args.namespace_quota)), args.default_namespace_quota),
        claim_ttl=ClaimTTLDefaults(MappingProxyType(dict(args.namespace_claim_ttl))),
    )


def build_parser() -> argparse.ArgumentParser:
    """Every flag with its environment default; the chart's args must parse here (tests/e2e/deploy/test_chart.py)."""
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="gpuobj operator", description="The gpuobj operator: frees GPU objects when out of scope."
    )
    p.add_argument(
        "--kubeconfig", default=env("KUBECONFIG"), help="kubeconfig path (default: $KUBECONFIG, else in-cluster)"
    )
    p.add_argument(
        "--namespace", default=env("GPUOBJ_WATCH_NAMESPACE") or None, help="watch one namespace (default: all)"
    )
    p.add_argument(
        "--token-file",
        default=env(names.TOKEN_ENV),
        help=f"the operator's projected ServiceAccount token (audience {names.AGENT_AUDIENCE}), presented to agents",
    )
    p.add_argument(
        "--allow-agent-host-annotation",
        action="store_true",
        default=env("GPUOBJ_ALLOW_AGENT_HOST_ANNOTATION", "") == "true",
        help=f"call agents at the host a pod's {names.ANNOTATION_AGENT_HOST} annotation names instead of its "
        "status.podIP (dev clusters without a pod network only: a workload could point it anywhere)",
    )
    liveview.add_arguments(p)
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("GPUOBJ_METRICS_PORT", "8080")),
        help="serves /metrics, /healthz, /readyz; 0 picks a free port",
    )
    p.add_argument("--lease-namespace", default=env("POD_NAMESPACE", "default"))
    p.add_argument(
        "--lease-name",
        default="gpuobj-operator",
        help="the Lease the replicas elect a leader on; with --shard-count above 1, shard i's is <name>-shard-<i>",
    )
    p.add_argument(
        "--shard-count",
        type=int,
        default=int(env("GPUOBJ_SHARD_COUNT", "1")),
        help="operators that share the cluster by namespace hash (docs/scale.md, Several operators); 1: one for all",
    )
    p.add_argument(
        "--shard-index",
        type=int,
        default=int(env("GPUOBJ_SHARD_INDEX", "0")),
        help="which of them this one is (0 .. --shard-count - 1): it acts only on the namespaces of its shard",
    )
    p.add_argument("--lease-seconds", type=int, default=15)
    p.add_argument("--identity", default=env("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--audit-interval", type=float, default=10.0, help="seconds between agent inventory audits")
    p.add_argument(
        "--leak-settle", type=float, default=5.0, help="seconds before an unreferenced object counts as leaked"
    )
    p.add_argument("--leak-grace", type=float, default=30.0, help="seconds before leaked bytes are reclaimed")
    p.add_argument("--resync-interval", type=float, default=60.0)
    p.add_argument(
        "--status-delay",
        type=float,
        default=Settings.status_delay,
        help="seconds a routine status write waits (short-lived objects then need none); 0 writes at once",
    )
    p.add_argument(
        "--liveness-interval",
        type=float,
        default=20.0,
        help="seconds between backstop probes of each agent (GET /v1/info): container restarts come from the "
        "pod watch, and a restart or a new share asks for a probe at once (docs/liveness.md); 0 disables",
    )
    p.add_argument(
        "--fleet-write-budget",
        type=_flag(_writes_per_second),
        default=env("GPUOBJ_FLEET_WRITE_BUDGET", "0"),
        help="API writes a second that the workloads' pods may send together (records, claims, releases): each "
        "probe tells a pod's agent its share, this divided by the agents probed, and the pod's write-behind "
        "paces its writes at it (docs/write-behind.md). 0: no budget, each pod backs off on its own",
    )
    p.add_argument(
        "--claims-read-delay",
        type=float,
        default=None,
        help="seconds a free waits for the claims watch to pass the deletion before it also reads the claims, "
        "while such reads are slow (an API server's claims watch cache makes them wait 40-100 ms); none once "
        "they answer fast. Default 0.05 with the progress marker (it moves the watch on in a few ms), else 0.005 "
        "(docs/operator-free-path.md)",
    )
    p.add_argument(
        "--claims-progress-marker",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"write the claim {names.CLAIMS_PROGRESS_MARKER} in the operator's own namespace to move the claims "
        "watch past a deletion that no claim event follows. Default: on when watching every namespace; refused "
        "with --namespace (it would show in users' kubectl get gpuobj: owner-last frees read their claims "
        "instead). The chart grants it (docs/operator-free-path.md)",
    )
    p.add_argument(
        "--namespace-quota",
        action="append",
        type=_flag(parse_namespace_quota),
        default=[],
        metavar="NAMESPACE=BYTES",
        help="the most bytes of GPUObjects a namespace may hold, across its pods (e.g. team-a=8Gi); repeat per "
        "namespace. An object over it is refused: Failed (QuotaExceeded, with an Event) and its bytes freed",
    )
    p.add_argument(
        "--default-namespace-quota",
        type=_flag(parse_bytes),
        default=None,
        metavar="BYTES",
        help="the quota of every namespace --namespace-quota does not name (default: none)",
    )
    p.add_argument(
        "--namespace-claim-ttl",
        action="append",
        type=_flag(parse_namespace_claim_ttl),
        default=[],
        metavar="NAMESPACE=DURATION",
        help="the ttl of a claim without one in that namespace (e.g. team-a=10m): bounds how long a hung reader "
        "holds an object; repeat per namespace (docs/workload-pods.md#hung-readers)",
    )
    p.add_argument(
        "--agent-tls",
        choices=("on", "off"),
        default=env("GPUOBJ_AGENT_TLS_CALLS", "off"),
        help="call agents over HTTPS only, verifying each names the pod uid meant (agents run with "
        "GPUOBJ_AGENT_TLS=csr); off: plain HTTP (docs/security.md)",
    )
    p.add_argument(
        "--agent-signer",
        action=argparse.BooleanOptionalAction,
        default=env("GPUOBJ_AGENT_SIGNER", "true") == "true",
        help="run the gpuobj.io/agent-serving CSR signer (operator/gpuobj_operator/signer.py)",
    )
    p.add_argument(
        "--agent-ca-secret",
        default=env("GPUOBJ_AGENT_CA_SECRET", "gpuobj-agent-ca"),
        help="the Secret (in --lease-namespace) holding the agent CA; created once when missing",
    )
    p.add_argument("--log-level", default=env("GPUOBJ_LOG_LEVEL", "INFO"))
    return p


def _flag(read: Callable[[str], T]) -> Callable[[str], T]:
    """A parser for argparse: its ValueError's message becomes the usage error."""

    def parsed(text: str) -> T:
        try:
            return read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


def _writes_per_second(text: str) -> float:
    """A rate of writes a second: a finite number, 0 or more (NaN and infinity are refused)."""
    rate = float(text)
    if not 0 <= rate < float("inf"):
        raise ValueError(f"a number of writes a second, 0 or more, not {text!r}")
    return rate
