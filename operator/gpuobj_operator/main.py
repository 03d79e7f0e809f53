"""`gpuobj operator`: leader election, the initial sync, the informers, workers, audit, metrics.

Order matters for safety: nothing is decided before this replica leads and before
every kind of state has been listed once (Reconciler.sync). A leader that loses its
lease (an API or etcd outage longer than the lease, a pause) stops everything it runs
and tries to lead again in-process; each term as leader starts from a fresh LIST.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import prometheus_client
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuobj_contract import agent_tls, names
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, KubeClient
from gpuobj_kube.config import load as load_config
from gpuobj_kube.informer import Informer
from gpuobj_operator.agent_ca import ClientCertificate, load_or_create, service_account_of
from gpuobj_operator.agent_client import AgentClient
from gpuobj_operator.claim_ttl import ClaimTTLDefaults, parse_namespace_claim_ttl
from gpuobj_operator.claimcheck import Watermark
from gpuobj_operator.events import EventRecorder
from gpuobj_operator.leader import Backoff, LeaderElector, LeaseConfig
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.liveview import server as liveview
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.progress_marker import MarkerMisconfigured, ProgressMarker, marker_namespace, marker_writer
from gpuobj_operator.quota import QuotaLimits, parse_bytes, parse_namespace_quota
from gpuobj_operator.reconciler import LABEL_AGENT_SELECTOR, Reconciler
from gpuobj_operator.selection import Selection
from gpuobj_operator.settings import Settings
from gpuobj_operator.shards import Shard
from gpuobj_operator.signer import Signer

log = logging.getLogger("gpuobj.operator")
T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
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
        default=0.25,
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


def _flag(parse: Callable[[str], T]) -> Callable[[str], T]:
    """A parser for argparse: its ValueError's message becomes the usage error."""

    def parsed(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


class HealthServer:
    """/metrics, /healthz and /readyz on one port. Ready means leading and synced, or standing by."""

    def __init__(self, metrics: OperatorMetrics, host: str, port: int) -> None:
        self.metrics = metrics
        self.host, self.port = host, port
        self.state = "starting"
        # Parts that run beside the term (the CSR signer): each says why it failed, or None; any failure fails
        # /healthz, naming it, so the kubelet restarts the replica rather than it running without that part.
        self.checks: list[Callable[[], str | None]] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/readyz", self._ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _: web.Request) -> web.Response:
        failures = [why for check in self.checks if (why := check()) is not None]
        if failures:
            return web.json_response({"status": "failing", "state": self.state, "failures": failures}, status=500)
        return web.json_response({"status": "ok", "state": self.state})

    async def _ready(self, _: web.Request) -> web.Response:
        ok = self.state in ("leading", "standby")
        return web.json_response({"state": self.state}, status=200 if ok else 503)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


def progress_marker_namespace(args: argparse.Namespace) -> str | None:
    """Where this operator writes its claims progress marker; None: it has none (progress_marker.py)."""
    return marker_namespace(args.namespace, args.lease_namespace, args.claims_progress_marker)


def settings_from(args: argparse.Namespace) -> Settings:
    """The reconciler's settings from the command line."""
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
        claims_read_delay=read_delay,
        quota=QuotaLimits(MappingProxyType(dict(args.namespace_quota)), args.default_namespace_quota),
        claim_ttl=ClaimTTLDefaults(MappingProxyType(dict(args.namespace_claim_ttl))),
    )


# After an API or etcd outage, watch again within ~2 s of the API's return. Bounded: a minute of errors in
# a row ends the process with the real error, and its Deployment restarts it.
WATCH_BACKOFF = (0.25, 2.0)
WATCH_GIVE_UP_SECONDS = 60.0


async def run(args: argparse.Namespace) -> int:
    config = load_config(args.kubeconfig)
    kube = KubeClient(config)
    reconciler_box: list[Reconciler] = []
    metrics = OperatorMetrics(lambda: reconciler_box[-1].ledger if reconciler_box else _empty_ledger())
    health = HealthServer(metrics, args.metrics_host, args.metrics_port)
    port = await health.start()
    print(
        f"gpuobj operator: metrics and probes on http://{args.metrics_host}:{port} (/metrics /healthz /readyz)",
        flush=True,
    )
    elector = LeaderElector(
        kube,
        LeaseConfig(
            name=Shard(args.shard_count, args.shard_index).lease_name(args.lease_name),
            namespace=args.lease_namespace,
            identity=args.identity,
            lease_seconds=args.lease_seconds,
            renew_seconds=max(0.5, min(5.0, args.lease_seconds / 3)),
            retry_seconds=max(0.5, min(2.0, args.lease_seconds / 6)),
        ),
    )
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    stopping = asyncio.create_task(stop.wait())
    ca = None
    if args.agent_signer or args.agent_tls == "on":
        ca = await load_or_create(kube, args.lease_namespace, args.agent_ca_secret)
    shard = settings_from(args).shard
    signer = (
        Signer(kube, ca, namespace=args.namespace, owns=shard.owns) if ca is not None and args.agent_signer else None
    )
    if signer is not None:
        signer.start()  # every replica signs (an answer is one write; a lost race is a 409)
        health.checks.append(signer.failure)
    client_cert = None
    if ca is not None and args.agent_tls == "on":  # mTLS: agents bind our token to this certificate
        token = (await asyncio.to_thread(Path(args.token_file).read_text)).strip() if args.token_file else ""
        client_cert = ClientCertificate(ca, agent_tls.service_account_uri(*service_account_of(token)))
    agents = AgentClient(
        Path(args.token_file) if args.token_file else None,
        tls=client_cert.context if client_cert else None,
        renew=client_cert.maybe_renew if client_cert else None,
    )
    events = EventRecorder(kube, "gpuobj-operator", args.identity)
    leading = lambda: reconciler_box[-1].ledger if reconciler_box and health.state == "leading" else None  # noqa: E731
    live_view = await liveview.serve(args, kube, agents, leading)
    events.start()
    rc = 0
    stuck = False
    backoff = Backoff(start=0.5, cap=max(1.0, elector.config.retry_seconds * 2))
    try:
        while not stop.is_set():
            health.state = "standby"
            metrics.leader.set(0)
            acquire = asyncio.create_task(elector.acquire())
            await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                acquire.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquire
                break
            metrics.leader.set(1)
            print(f"gpuobj operator: leading as {args.identity} (lease {elector.config.name})", flush=True)
            try:
                outcome = await lead(
                    args, kube, agents, events, metrics, health, elector, stop, stopping, reconciler_box
                )
            except TermStuck as exc:
                print(f"gpuobj operator: {exc}; exiting", file=sys.stderr, flush=True)
                stuck = True
                rc = 1
                break
            if outcome == "stopped":
                break
            if outcome == "failed":
                rc = 1
                break
            # Lost the lease (or the API failed the initial sync): nothing acts now. Try to lead again at
            # once and then with bounded backoff; leading again starts from a fresh LIST, never from
            # what this process knew before. (After a failed sync the lease is still ours: renewed at once.)
            delay = backoff.next() if outcome == "sync-failed" else 0.0
            print(f"gpuobj operator: {outcome}; stopped acting, trying to lead again", file=sys.stderr, flush=True)
            if outcome == "lease-lost":
                backoff.reset()
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stopping), timeout=delay)
    finally:
        health.state = "stopping"
        stopping.cancel()
        metrics.leader.set(0)
        if rc == 0:
            await elector.release()
        await events.stop()
        if signer is not None:
            await signer.stop()
        if live_view is not None:
            await live_view.stop()
        await agents.close()
        await kube.close()
        await health.stop()
        print("gpuobj operator: stopped", flush=True)
    if stuck:
        # asyncio.run would wait for the tasks that ignored their cancellation, forever: end here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


async def lead(
    args: argparse.Namespace,
    kube: KubeClient,
    agents: AgentClient,
    events: EventRecorder,
    metrics: OperatorMetrics,
    health: HealthServer,
    elector: LeaderElector,
    stop: asyncio.Event,
    stopping: asyncio.Task[bool],
    reconciler_box: list[Reconciler],
) -> str:
    """One term as leader: a fresh ledger from a fresh LIST, then the informers take over from it, until
    the lease is lost ("lease-lost"), the process is asked to stop ("stopped") or a watch fails for good
    ("failed"). Everything this term started is stopped before it returns, so nothing it knew outlives it."""
    reconciler = Reconciler(kube, agents, metrics, events, settings_from(args), may_act=elector.holds_lease)
    reconciler_box[:] = [reconciler]
    # Claims feed a watermark: a free skips the claims read once every claim event up to the object's
    # deletion is in the ledger (claimcheck.py).
    watermark = Watermark()
    watch = {"namespace": args.namespace, "backoff": WATCH_BACKOFF, "give_up_after": WATCH_GIVE_UP_SECONDS}
    # GPUObjects and streams: a shard of several is sent only its buckets' (selection.py); claims and agent
    # pods are watched whole and filtered here (claims: one watch keeps the claims watermark sound).
    shard = reconciler.settings.shard

    def counter(plural: str) -> Callable[[str], Callable[[], None]]:
        return lambda selection: metrics.watch_events.labels(plural, selection).inc

    selected = [
        Selection(kube, res, handler, shard, counted=counter(res.plural), **watch)
        for res, handler in ((STREAMS, reconciler.on_stream), (GPUOBJECTS, reconciler.on_object))
    ]
    informers = [
        Informer(kube, CLAIMS, reconciler.on_claim, on_progress=watermark.observe, **watch),
        Informer(kube, PODS, reconciler.on_pod, label_selector=LABEL_AGENT_SELECTOR, **watch),
    ]
    reconciler.free_path.claims_watermark = watermark
    marker_at = progress_marker_namespace(args)
    if marker_at is not None:
        reconciler.free_path.progress_marker = ProgressMarker(
            watermark,
            marker_writer(kube, marker_at),
            on_write=lambda ok: metrics.claims_marker_writes.labels("written" if ok else "failed").inc(),
        )
    # Renew from the start: a sync that outlives the lease must not leave it to lapse.
    hold = asyncio.create_task(elector.hold())
    outcome = "stopped"
    try:
        sync = asyncio.create_task(reconciler.sync())
        await asyncio.wait({sync, hold, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not sync.done():
            sync.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sync
            outcome = "lease-lost" if hold.done() else "stopped"
            return outcome
        if sync.exception() is not None:
            log.warning("initial sync failed: %r", sync.exception())
            outcome = "sync-failed"
            return outcome
        # Every informer takes over from the sync's own list: whatever changed since arrives as an event.
        for informer in informers:
            version, identities = reconciler.intake.listed[informer.resource.plural]
            informer.seed(identities, version)
            informer.start()
        for selection in selected:
            selection.seed(*reconciler.intake.listed[selection.resource.plural])
            selection.start()
        informers += [i for s in selected for i in s.informers]
        reconciler.start()
        health.state = "leading"
        print("gpuobj operator: synced and reconciling", flush=True)
        watches = {t for t in (i.task for i in informers) if t is not None}
        done, _ = await asyncio.wait({hold, stopping, *watches}, return_when=asyncio.FIRST_COMPLETED)
        if failed := [t for t in done & watches if not t.cancelled() and t.exception()]:
            # A watch failed for longer than it retries: say why (the real error), and end the process.
            error = failed[0].exception()
            log.error("%s (caused by %r)", error, error and error.__cause__)
            outcome = "failed"
        elif hold in done and not hold.cancelled():
            reason = f": {hold.exception()!r}" if hold.exception() else ""
            print(f"gpuobj operator: lost leadership{reason}; stopping acting", file=sys.stderr, flush=True)
            outcome = "lease-lost"
        return outcome
    finally:
        # Stop acting first (and say so: the leader gauge drops with it), then wind down what only reads.
        metrics.leader.set(0)
        health.state = "standby" if outcome not in ("stopped", "failed") else "stopping"
        hold.cancel()
        stuck = [] if await wind_down(hold, WIND_DOWN_SECONDS) else ["lease renewal"]
        steps = [("workers", reconciler.stop)] + [(f"{i.resource.plural} watch", i.stop) for i in informers]
        steps += [(f"{s.resource.plural} selection", s.stop) for s in selected]
        for name, step in steps:
            if not await run_within(step(), WIND_DOWN_SECONDS):
                stuck.append(name)
        if stuck:
            # What did not stop may still act on what this term knew: never lead again in this process.
            raise TermStuck(stuck)


WIND_DOWN_SECONDS = 10.0  # each part of a term (workers, watches) must stop within this after its cancel


class TermStuck(Exception):
    """Part of a term as leader did not stop when asked: the process must end (its Deployment restarts it)."""

    def __init__(self, parts: list[str]) -> None:
        super().__init__(f"did not stop: {', '.join(parts)}")
        self.parts = parts


async def run_within(step: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Run a stop step (``reconciler.stop()``, ``informer.stop()``) to its end, for at most ``seconds``;
    False if it is still running then (it is cancelled). Run, never cancelled first: a step cancelled
    before it starts stops nothing, and the term it belongs to would go on acting beside the next one."""
    task = asyncio.ensure_future(step)
    await asyncio.wait({task}, timeout=seconds)
    if not task.done():
        task.cancel()
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("stopping: %r", task.exception())
    return True


async def wind_down(task: asyncio.Future[Any], seconds: float) -> bool:
    """Cancel ``task`` and wait up to ``seconds`` for it to stop; False if it is still running then.
    Never waits longer: a task that ignores its cancellation must not hang the replica (it would
    stand by, do nothing and ignore SIGTERM)."""
    task.cancel()
    await asyncio.wait({task}, timeout=seconds)
    if not task.done():
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("stopping: %r", task.exception())
    return True


def _install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


def _empty_ledger() -> Ledger:
    return Ledger()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        progress_marker_namespace(args)
        shard = Shard(args.shard_count, args.shard_index)
    except (MarkerMisconfigured, ValueError) as exc:
        parser.error(str(exc))
    if shard.count > 1 and args.namespace:
        parser.error("--shard-count shares every namespace between operators; --namespace watches one: choose one")
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
