"""`gpuobj operator`: leader election, the initial sync, kopf's watches, workers, audit, metrics.

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
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import kopf
import prometheus_client
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuobj_contract import agent_tls, names
from gpuobj_kube.client import CLAIMS, PODS, KubeClient
from gpuobj_kube.config import KubeConfig
from gpuobj_kube.config import load as load_config
from gpuobj_kube.informer import Informer
from gpuobj_operator.agent_ca import ClientCertificate, load_or_create, service_account_of
from gpuobj_operator.agent_client import AgentClient
from gpuobj_operator.claimcheck import Watermark
from gpuobj_operator.events import EventRecorder
from gpuobj_operator.leader import Backoff, LeaderElector, LeaseConfig
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.progress_marker import MarkerMisconfigured, ProgressMarker, marker_namespace, marker_writer
from gpuobj_operator.quota import QuotaLimits, parse_bytes, parse_namespace_quota
from gpuobj_operator.reconciler import LABEL_AGENT_SELECTOR, Reconciler
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
        return web.json_response({"status": "ok", "state": self.state})

    async def _ready(self, _: web.Request) -> web.Response:
        ok = self.state in ("leading", "standby")
        return web.json_response({"state": self.state}, status=200 if ok else 503)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


def build_registry(reconciler: Reconciler, config: KubeConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    # Every handler is a coroutine: kopf runs a plain function in its thread pool, and these feed the
    # ledger and the work queue, which only the event loop may touch (tests/unit/operator/test_handlers.py).
    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        # The same credentials as our own client (the `kubernetes` package's loaders: kubeconfig with exec
        # plugins or auth-providers, or in-cluster). kopf logs in again after a 401 or at `expiration`, and
        # each login loads the credentials anew (a new exec run, a re-read token file). The load may run
        # an exec plugin: a thread does it, and KubeConfig guards its own state with a lock.
        return await asyncio.to_thread(_connection_info, config)

    @kopf.on.event(names.GROUP, names.VERSION, names.PLURAL_OBJECT, registry=registry)
    async def on_object(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.on_object(event["type"], event["object"])

    @kopf.on.event(names.GROUP, names.VERSION, names.PLURAL_STREAM, registry=registry)
    async def on_stream(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.on_stream(event["type"], event["object"])

    return registry


def _connection_info(config: KubeConfig) -> kopf.ConnectionInfo:
    config.invalidate()
    creds = config.credentials()
    scheme, _, token = (creds.authorization or "").partition(" ")
    return kopf.ConnectionInfo(
        server=creds.server,
        ca_path=creds.ca_path,
        insecure=creds.insecure or None,
        certificate_path=creds.cert_path,
        private_key_path=creds.key_path,
        scheme=scheme or None,
        token=token or None,
        default_namespace=creds.namespace,
        expiration=creds.expiry,
    )


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
    )


def kopf_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # we post our own Events, in the background
    settings.scanning.disabled = True  # least privilege: no cluster-wide CRD or namespace watches
    settings.watching.server_timeout = 240
    settings.watching.client_timeout = 300
    settings.networking.request_timeout = 30
    # After an API or etcd outage, watch again within ~2 s of the API's return, not after kopf's default
    # backoffs (1, 1, 2, 3, 5, 8, 13, 21 s: cleanup trailed a 35 s etcd outage by 46 s). Bounded: about a
    # minute of errors in a row ends the process, and its Deployment restarts it.
    settings.networking.error_backoffs = (0.25, 0.5, 1.0, *([2.0] * 28))
    # kopf holds each event for its batch window (0.1 s) waiting for newer ones of the same object.
    # Our handlers only feed the ledger (cheap, latest state wins anyway): no reason to add up to
    # 0.1 s to every event, the free of a recorded object included.
    settings.batching.batch_window = 0.001
    return settings


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
                    args, config, kube, agents, events, metrics, health, elector, stop, stopping, reconciler_box
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
    config: KubeConfig,
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
    """One term as leader: a fresh ledger from a fresh LIST, then kopf's watches, until the lease is
    lost ("lease-lost"), the process is asked to stop ("stopped") or kopf fails ("failed"). Everything
    this term started is stopped before it returns, so nothing it knew outlives it."""
    reconciler = Reconciler(kube, agents, metrics, events, settings_from(args), may_act=elector.holds_lease)
    reconciler_box[:] = [reconciler]
    pods = Informer(kube, PODS, reconciler.on_pod, namespace=args.namespace, label_selector=LABEL_AGENT_SELECTOR)
    # Claims through our own in-order informer, not kopf: its watermark lets a free skip the claims
    # read once every claim event up to the object's deletion is in the ledger (claimcheck.py).
    watermark = Watermark()
    claims = Informer(kube, CLAIMS, reconciler.on_claim, namespace=args.namespace, on_progress=watermark.observe)
    reconciler.free_path.claims_watermark = watermark
    marker_at = progress_marker_namespace(args)
    if marker_at is not None:
        reconciler.free_path.progress_marker = ProgressMarker(
            watermark,
            marker_writer(kube, marker_at),
            on_write=lambda ok: metrics.claims_marker_writes.labels("written" if ok else "failed").inc(),
        )
    kopf_stop = asyncio.Event()
    operator: asyncio.Task[None] | None = None
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
        # Both watches take over from the sync's own lists: a pod or claim deleted since arrives as DELETED.
        for informer, kind in ((pods, "pods"), (claims, "claims")):
            version, stubs = reconciler.intake.listed[kind]
            informer.seed(stubs, version)
            informer.start()
        reconciler.start()
        health.state = "leading"
        print("gpuobj operator: synced and reconciling", flush=True)
        kopf_ready = asyncio.Event()
        operator = asyncio.create_task(
            kopf.operator(
                registry=build_registry(reconciler, config),
                settings=kopf_settings(),
                standalone=True,
                clusterwide=args.namespace is None,
                namespaces=[args.namespace] if args.namespace else (),
                stop_flag=kopf_stop,
                ready_flag=kopf_ready,
            )
        )
        ready_wait = asyncio.create_task(kopf_ready.wait())
        await asyncio.wait({ready_wait, operator, stopping, hold}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        ready_wait.cancel()
        # kopf installed its own signal handlers; take them back so that a SIGTERM stops kopf through
        # its stop flag (a clean stop) and lets us release the lease on the way out.
        _install_signal_handlers(stop)
        watches = {t for t in (pods.task, claims.task) if t is not None}
        done, _ = await asyncio.wait({operator, hold, stopping, *watches}, return_when=asyncio.FIRST_COMPLETED)
        if failed := [t for t in done & watches if not t.cancelled() and t.exception()]:
            # A watch failed for longer than it retries: say why (the real error), and end the process.
            error = failed[0].exception()
            log.error("%s (caused by %r)", error, error and error.__cause__)
            outcome = "failed"
        elif hold in done and not hold.cancelled():
            reason = f": {hold.exception()!r}" if hold.exception() else ""
            print(f"gpuobj operator: lost leadership{reason}; stopping acting", file=sys.stderr, flush=True)
            outcome = "lease-lost"
        elif operator in done and not operator.cancelled() and operator.exception():
            log.error("kopf stopped: %r", operator.exception())
            outcome = "failed"
        return outcome
    finally:
        # Stop acting first (and say so: the leader gauge drops with it), then wind down what only reads.
        metrics.leader.set(0)
        health.state = "standby" if outcome not in ("stopped", "failed") else "stopping"
        # A SIGTERM during the wind-down must still stop the process: our handlers, whatever kopf left.
        _install_signal_handlers(stop)
        hold.cancel()
        stuck = [] if await wind_down(hold, WIND_DOWN_SECONDS) else ["lease renewal"]
        for name, step in (("workers", reconciler.stop), ("pod watch", pods.stop), ("claims watch", claims.stop)):
            if not await wind_down(asyncio.ensure_future(step()), WIND_DOWN_SECONDS):
                stuck.append(name)
        kopf_stop.set()
        if operator is not None and not await wind_down(operator, KOPF_STOP_SECONDS, cancel_first=False):
            stuck.append("kopf")
        # kopf removes the signal handlers it installed on its way out: ours again.
        _install_signal_handlers(stop)
        if stuck:
            # What did not stop may still act on what this term knew: never lead again in this process.
            raise TermStuck(stuck)


WIND_DOWN_SECONDS = 10.0  # each part of a term (workers, watches) must stop within this after its cancel
KOPF_STOP_SECONDS = 15.0  # kopf's own stop (it drains its per-object workers), then it is cancelled


class TermStuck(Exception):
    """Part of a term as leader did not stop when asked: the process must end (its Deployment restarts it)."""

    def __init__(self, parts: list[str]) -> None:
        super().__init__(f"did not stop: {', '.join(parts)}")
        self.parts = parts


async def wind_down(task: asyncio.Future[Any], seconds: float, *, cancel_first: bool = True) -> bool:
    """Stop ``task`` within ``seconds`` (cancelled at once, or after half of them if ``cancel_first`` is
    False, so it can stop on its own first); False if it is still running then. Never waits longer:
    a task that ignores its cancellation must not hang the replica (it would stand by, do nothing and
    ignore SIGTERM)."""
    if not cancel_first:
        await asyncio.wait({task}, timeout=seconds / 2)
    task.cancel()
    await asyncio.wait({task}, timeout=seconds if cancel_first else seconds / 2)
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
    logging.getLogger("kopf").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
