"""One agent, assembled: store, fencer, fetcher and control server on one event loop.

Why a separate class from the runtime: the standalone process runs it on its main
thread's loop (signals, `asyncio.run`), the embedded runtime on a private thread's loop;
both start and stop it the same way. Startup creates the first NIXL agents (about half a
second the first time in a process); shutdown frees everything, balances registrations
and destroys every NIXL agent before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gpuobj_agent.auth import IssuerKeys, Revocations, ServiceAccountAuth
from gpuobj_agent.buffers import LandingPool
from gpuobj_agent.config import ALLOW_CMA_ENV, AgentConfig
from gpuobj_agent.fencing import Fencer
from gpuobj_agent.fetch import Fetcher
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.nixl_transport import NixlAgent
from gpuobj_agent.server import build_app
from gpuobj_agent.store import ObjectStore
from gpuobj_agent.tls import AgentCertificate
from gpuobj_contract import agent_api as api

if TYPE_CHECKING:  # the kube client (and the kubernetes package under it) only where it is used
    from gpuobj_kube.client import KubeClient

log = logging.getLogger(__name__)


def restrict_transports(config: AgentConfig) -> None:
    """Keep UCX off transports that a registration cannot bound (cma), unless allowed or chosen explicitly.

    Set before this process's first NIXL agent: UCX reads UCX_TLS when a worker is created. The source
    not offering cma is enough: a reader cannot use a transport the source's address does not list.
    """
    if config.allow_cma or "UCX_TLS" in os.environ:
        return
    os.environ["UCX_TLS"] = "^cma"
    log.info("UCX transports: all but cma (set %s=true to allow it)", ALLOW_CMA_ENV)


def build_auth(config: AgentConfig) -> ServiceAccountAuth:
    """Verify tokens against `config.issuer_url`, else against the API server of the pod's kubeconfig."""
    revocations = None
    if config.issuer_url:
        keys = IssuerKeys(config.issuer_url)
    else:
        from gpuobj_kube.config import load

        kube = load(config.kubeconfig)
        keys = IssuerKeys(kube.server, ssl_context=kube.ssl_context, bearer=kube.bearer)
        if config.revocation_fail_closed_after > 0:  # the API server knows which tokens were revoked
            revocations = Revocations(
                kube.server,
                audience=config.audience,
                ssl_context=kube.ssl_context,
                bearer=kube.bearer,
                fail_closed_after=config.revocation_fail_closed_after,
            )
    return ServiceAccountAuth(
        keys, audience=config.audience, operators=frozenset(config.operator_service_accounts), revocations=revocations
    )


class Agent:
    """The per-pod agent. Create, `await start()`, use, `await stop()`; all on one event loop."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        tokens: ServiceAccountAuth | None = None,
        extra_routes: Callable[[web.Application], None] | None = None,
    ) -> None:
        self.config = config
        restrict_transports(config)
        self.incarnation = secrets.token_hex(8)
        self.started_wall = time.time()
        self.write_rate: float | None = None  # the pod's share of the fleet's write budget, as last told
        self.tokens = tokens or build_auth(config)
        self.base_name = config.nixl_base_name(self.incarnation)
        self._control = ThreadPoolExecutor(1, thread_name_prefix="gpuobj-nixl-control")
        self._lifecycle = ThreadPoolExecutor(1, thread_name_prefix="gpuobj-nixl-lifecycle")
        self._transfers = ThreadPoolExecutor(max(1, config.transfer_threads), thread_name_prefix="gpuobj-nixl-xfer")
        self.metrics = AgentMetrics(lambda: self.store.levels())
        # One NIXL state, handed to both the store (puts, frees) and the fencer (rotations, retirements).
        self.nixl = NixlState(self.base_name, control=self._control, metrics=self.metrics)
        self.store = ObjectStore(config, self.metrics, nixl=self.nixl, incarnation=self.incarnation)
        self.reads = self.store.reads  # tickets, grants, read ends (reads.py): the read routes' side
        self.fencer = Fencer(
            self.store, self.nixl, config, self.metrics, lifecycle=self._lifecycle, agent_factory=self._new_nixl_agent
        )
        self.fetcher: Fetcher | None = None
        self.pool: LandingPool | None = None
        self._reader: NixlAgent | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._extra_routes = extra_routes
        self._runner: web.AppRunner | None = None
        self.certificate: AgentCertificate | None = None  # config.tls == "csr": the serving certificate
        self._kube: KubeClient | None = None
        self.port: int | None = None
        self._stopped = False

    def _new_nixl_agent(self, name: str) -> NixlAgent:
        return NixlAgent(name, progress_thread=True, progress_delay_us=self.config.progress_delay_us)

    @property
    def endpoint(self) -> str:
        return f"{self.config.advertise_host()}:{self.port}"

    async def _obtain_certificate(self) -> None:
        """Ask the operator's signer for this pod's certificate (with the pod's own API token): before
        anything is served, so no request is ever answered in plain text."""
        from gpuobj_kube.client import KubeClient
        from gpuobj_kube.config import load

        c = self.config
        if c.tls == "files":
            assert c.tls_dir is not None
            self.certificate = AgentCertificate(None, c.namespace, c.pod_name, c.pod_uid, c.pod_ips())
            self.certificate.load_files(Path(c.tls_dir))
            self.certificate.start_renewal(Path(c.tls_dir))
            return
        self._kube = KubeClient(load(c.kubeconfig))
        self.certificate = AgentCertificate(self._kube, c.namespace, c.pod_name, c.pod_uid, c.pod_ips())
        await self.certificate.obtain()
        self.certificate.start_renewal()

    @property
    def scheme(self) -> str:
        return "https" if self.certificate is not None else "http"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.config.tls != "off":
            await self._obtain_certificate()
        try:  # fetch the issuer keys now, so the first request does not wait; a failure is retried then
            await self.tokens.keys.refresh()
        except Exception as exc:
            log.warning("cannot read the issuer keys yet (%s); retrying on the first request", exc)
        await self.fencer.start()
        # The reader agent never exposes memory (no one gets its metadata), so it is never rotated;
        # its progress comes from our own polling during reads.
        self._reader = await loop.run_in_executor(
            self._lifecycle, lambda: NixlAgent(f"{self.base_name}.r", progress_thread=False)
        )
        self.pool = LandingPool(self._reader, max_idle_bytes=self.config.landing_idle_bytes)
        self.fetcher = Fetcher(
            self._reader,
            name=self.base_name,
            transfers=self._transfers,
            metrics=self.metrics,
            default_timeout=self.config.fetch_timeout,
            pool=self.pool,
        )
        await self.fetcher.start()
        if self.certificate is not None:
            cert = self.certificate
            self.fetcher.tls = lambda: cert.client_context
        self.reads.start_pump()
        self._trim_task = asyncio.create_task(self._trim(), name="gpuobj-landing-trim")
        app = build_app(self, self._extra_routes)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=self.config.shutdown_grace
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.config.host,
            self.config.port,
            reuse_address=True,
            ssl_context=self.certificate.server_context if self.certificate else None,
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("gpuobj agent %s listening on %s", self.base_name, self.endpoint)

    async def stop(self) -> None:
        """Free everything, balance registrations, destroy NIXL agents; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        store = self.store
        store.closing = True
        if self._runner is not None:
            await self._runner.cleanup()  # stop serving first: nothing new can start
        if self._trim_task is not None:
            self._trim_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trim_task
        if self.fetcher is not None:
            await self.fetcher.close()
        tickets = self.reads.tickets
        if not await self.reads.wait_tickets(lambda: tickets.inflight() == 0, self.config.shutdown_grace):
            log.warning("stopping with %d read(s) still in flight", tickets.inflight())
        await self.reads.stop_pump()
        await store.release_all()
        await self.fencer.close()
        await self.tokens.close()
        if self.certificate is not None:
            await self.certificate.close()
        if self._kube is not None:
            await self._kube.close()
        self._transfers.shutdown(wait=True)  # no read is running when the reader agent goes
        if self.pool is not None:
            self.pool.close()
        if self._reader is not None:
            await asyncio.get_running_loop().run_in_executor(self._lifecycle, self._reader.close)
        for pool in (self._control, self._lifecycle):
            pool.shutdown(wait=True)
        led = self.nixl.ledger
        if not self.balanced():
            log.error(
                "registrations do not balance at shutdown: %d registered, %d deregistered",
                led.registrations,
                led.deregistrations,
            )
        else:
            log.info("stopped: %d registrations, all deregistered", led.registrations)

    async def _trim(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            if self.pool is not None:
                await asyncio.get_running_loop().run_in_executor(self._transfers, self.pool.trim)

    def balanced(self) -> bool:
        """Every NIXL registration this agent made (objects, fetch buffers, landing pool) was undone."""
        reader, pool = self._reader, self.pool
        return (
            self.nixl.ledger.balanced()
            and (reader is None or reader.local_registrations == reader.local_deregistrations)
            and (pool is None or pool.registrations == pool.deregistrations)
        )

    # -- views -------------------------------------------------------------------------
    def info(self) -> api.AgentInfo:
        return self.store.agent_info(started_wall=self.started_wall, endpoint=self.endpoint, write_rate=self.write_rate)

    def inventory(self) -> api.Inventory:
        return self.store.inventory()

    def tell_write_rate(self, per_second: float) -> None:
        """The operator's word on a probe: this pod's share of the fleet's write budget; 0: none."""
        self.write_rate = per_second or None

    def stats(self) -> dict[str, Any]:
        """Counts a test asserts on at the end: nothing held, everything balanced."""
        store, nixl = self.store, self.nixl
        reader = self._reader
        return {
            "objects": len(store.objects),
            "storeBytes": sum(o.nbytes for o in store.objects.values()),
            "registrations": nixl.ledger.registrations,
            "deregistrations": nixl.ledger.deregistrations,
            "registeredRegions": nixl.ledger.total(),
            "readerRegistrations": reader.local_registrations if reader else 0,
            "readerDeregistrations": reader.local_deregistrations if reader else 0,
            # Landing buffers stay registered while idle (a bounded cache); at stop all are deregistered.
            "landingBuffersInUse": self.pool.in_use if self.pool else 0,
            "landingIdleBytes": self.pool.idle_bytes if self.pool else 0,
            "landingRegistrations": self.pool.registrations if self.pool else 0,
            "landingDeregistrations": self.pool.deregistrations if self.pool else 0,
            "inflightReads": self.reads.tickets.inflight(),
            "quarantinedBytes": nixl.quarantine.bytes,
            "generations": len(nixl.gens),
            "rotations": nixl.gens.retired_count,
            "pooledFences": nixl.gens.private_retired,
            # Pooled regions registered ahead of their next put, off its path (counted in "registrations" too).
            "registrationsAhead": nixl.registered_ahead,
            "registeringAhead": store.registering_ahead,
            "privateSpares": self.fencer.private_spares,
            # Reads whose source NIXL agent this reader had connected to ahead, from an announcement.
            "preconnectedReads": self.fetcher.preconnected_reads if self.fetcher else 0,
            "connectedAhead": self.fetcher.connected_ahead if self.fetcher else 0,
            "cachedRemoteAgents": self.fetcher.cached_agents if self.fetcher else 0,
        }
