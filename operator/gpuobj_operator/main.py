"""`gpuobj operator`: the composition root. Parse the flags (flags.py), build what lives as long as the
process (the API client, the health server, the elector, the CSR signer, the agent client, the Event
recorder, the live view), lead term after term (term.py), and shut down in order.

Order matters for safety: nothing is decided before this replica leads and before every kind of state
has been listed once (Reconciler.sync). A leader that loses its lease (an API or etcd outage longer than
the lease, a pause) stops everything it runs and tries to lead again in-process; each term as leader
starts from a fresh ledger and a fresh LIST.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

import prometheus_client

from gpuobj_contract import agent_tls
from gpuobj_kube.client import KubeClient
from gpuobj_kube.config import load as load_config
from gpuobj_operator.agent_ca import CertificateAuthority, ClientCertificate, load_or_create, service_account_of
from gpuobj_operator.agent_client import AgentClient
from gpuobj_operator.events import EventRecorder
from gpuobj_operator.flags import Flags, parse
from gpuobj_operator.health import HealthServer
from gpuobj_operator.leader import Backoff, LeaderElector
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.liveview import server as liveview
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.reconciler import new_ledger
from gpuobj_operator.signer import Signer
from gpuobj_operator.term import Outcome, TermParts, TermStuck, lead


async def run(flags: Flags) -> int:
    """Build, lead until asked to stop (or a term fails), shut down; the process's exit status."""
    kube = KubeClient(load_config(flags.kubeconfig))
    # The latest term's ledger (each term is given a new one below): the metrics read it, the live view
    # only while that term leads. Both read this variable when asked, so they follow it from term to term.
    ledger = Ledger()
    metrics = OperatorMetrics(lambda: ledger)
    health = HealthServer(metrics, flags.metrics_host, flags.metrics_port)
    port = await health.start()
    print(
        f"gpuobj operator: metrics and probes on http://{flags.metrics_host}:{port} (/metrics /healthz /readyz)",
        flush=True,
    )
    elector = LeaderElector(kube, flags.lease)
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    stopping = asyncio.create_task(stop.wait())
    ca = None
    if flags.agent_signer or flags.agent_tls:
        ca = await load_or_create(kube, flags.agent_ca_namespace, flags.agent_ca_secret)
    signer = None
    if ca is not None and flags.agent_signer:
        signer = Signer(kube, ca, namespace=flags.settings.namespace, owns=flags.settings.shard.owns)
        signer.start()  # every replica signs (an answer is one write; a lost race is a 409)
        health.checks.append(signer.failure)
    agents = await _agent_client(flags, ca)
    events = EventRecorder(kube, "gpuobj-operator", flags.identity)
    live_view = await liveview.serve(
        flags.live_view, kube, agents, lambda: ledger if health.state == "leading" else None
    )
    events.start()
    parts = TermParts(kube, agents, events, metrics, health, elector, flags.settings, flags.progress_marker_namespace)
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
            print(f"gpuobj operator: leading as {flags.identity} (lease {elector.config.name})", flush=True)
            ledger = new_ledger(flags.settings)
            try:
                outcome: Outcome = await lead(parts, ledger, stopping)
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


async def _agent_client(flags: Flags, ca: CertificateAuthority | None) -> AgentClient:
    """The client of every agent: plain HTTP, or mTLS with a certificate agents bind our token to."""
    client_cert = None
    if ca is not None and flags.agent_tls:
        token = (await asyncio.to_thread(flags.token_file.read_text)).strip() if flags.token_file else ""
        client_cert = ClientCertificate(ca, agent_tls.service_account_uri(*service_account_of(token)))
    return AgentClient(
        flags.token_file,
        tls=client_cert.context if client_cert else None,
        renew=client_cert.maybe_renew if client_cert else None,
    )


def _install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


def main(argv: list[str] | None = None) -> int:
    flags = parse(argv)
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=flags.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        return asyncio.run(run(flags))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
