"""`gpuobj agent`: the standalone agent process (tests, the demo, sidecar deployments).

Why its own entry point: it owns the process (signals, logging, exit code). SIGTERM or
SIGINT stop it cleanly: every object is freed, every NIXL registration is undone and
every NIXL agent destroyed; the exit code is 0 only if the registrations balanced.
It prints one line saying where it listens, so whoever started it can connect.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from gpuobj_agent.config import ISSUER_URL_ENV, OPERATOR_SA_ENV, AgentConfig
from gpuobj_contract import names


def build_parser(prog: str = "gpuobj agent") -> argparse.ArgumentParser:
    d = AgentConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a standalone gpuobj agent: object store, NIXL agent "
        "(UCX), authenticated control server and Prometheus metrics.",
    )
    p.add_argument("--pod-name", default=d.pod_name, help="pod name (default $GPUOBJ_POD_NAME or the hostname)")
    p.add_argument("--pod-namespace", default=d.namespace, help="pod namespace (default $GPUOBJ_POD_NAMESPACE)")
    p.add_argument("--pod-uid", default=d.pod_uid, help="pod UID (default $GPUOBJ_POD_UID)")
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port",
        type=int,
        default=d.port,
        help=f"port to listen on; 0 picks a free one (default {names.DEFAULT_AGENT_PORT})",
    )
    p.add_argument(
        "--token-file",
        default=d.token_file,
        help=f"this pod's projected token for reading from other agents (default ${names.TOKEN_ENV})",
    )
    p.add_argument(
        "--operator-serviceaccount",
        action="append",
        default=None,
        help=f"namespace/name of the ServiceAccount allowed to free, list and materialize; repeatable "
        f"(default ${OPERATOR_SA_ENV} or {','.join(d.operator_service_accounts)})",
    )
    p.add_argument(
        "--issuer-url",
        default=d.issuer_url,
        help=f"where to read the token issuer's keys (default ${ISSUER_URL_ENV}, else the API server of --kubeconfig)",
    )
    p.add_argument(
        "--kubeconfig",
        default=d.kubeconfig,
        help="kubeconfig for reading the issuer keys (default $KUBECONFIG, else in-cluster)",
    )
    p.add_argument(
        "--free-wait-timeout",
        type=float,
        default=d.free_wait_timeout,
        help="seconds a free waits for in-flight reads before answering 503 (default %(default)s)",
    )
    p.add_argument(
        "--read-lease",
        type=float,
        default=d.read_lease,
        help="seconds (plus one per 256 MiB) a read ticket counts as in flight unless ended (default %(default)s)",
    )
    p.add_argument(
        "--fence-interval",
        type=float,
        default=d.fence_interval,
        help="longest wait before freed memory a reader saw is fenced and released (default %(default)s)",
    )
    p.add_argument(
        "--tenured-fence-interval",
        type=float,
        default=d.tenured_fence_interval,
        help="the same for long-lived objects, whose fence moves every live object (default %(default)s)",
    )
    p.add_argument(
        "--quarantine-high-bytes",
        type=int,
        default=d.quarantine_high_bytes,
        help="fence at once when this many freed bytes wait (default %(default)s)",
    )
    p.add_argument(
        "--quarantine-low-bytes",
        type=int,
        default=d.quarantine_low_bytes,
        help="while fewer freed bytes wait, fence within --small-fence-interval instead (default %(default)s)",
    )
    p.add_argument(
        "--small-fence-interval",
        type=float,
        default=d.small_fence_interval,
        help="longest wait before a few freed bytes are fenced: a fence costs 20-60 ms of CPU (default %(default)s)",
    )
    p.add_argument(
        "--progress-delay-us",
        type=int,
        default=d.progress_delay_us,
        help="UCX progress thread poll timeout in microseconds (default %(default)s)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    if not args.pod_name:
        raise SystemExit("error: --pod-name (or $GPUOBJ_POD_NAME) is required")
    return AgentConfig(
        pod_name=args.pod_name,
        namespace=args.pod_namespace,
        pod_uid=args.pod_uid,
        host=args.host,
        port=args.port,
        token_file=args.token_file,
        operator_service_accounts=tuple(args.operator_serviceaccount or AgentConfig().operator_service_accounts),
        issuer_url=args.issuer_url,
        kubeconfig=args.kubeconfig,
        free_wait_timeout=args.free_wait_timeout,
        read_lease=args.read_lease,
        fence_interval=args.fence_interval,
        tenured_fence_interval=args.tenured_fence_interval,
        quarantine_high_bytes=args.quarantine_high_bytes,
        quarantine_low_bytes=args.quarantine_low_bytes,
        small_fence_interval=args.small_fence_interval,
        progress_delay_us=args.progress_delay_us,
    )


async def serve(config: AgentConfig, extra_routes: Callable[[web.Application], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT; return the exit code."""
    from gpuobj_agent.agent import Agent  # imports torch and nixl: after argument parsing

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = Agent(config, extra_routes=extra_routes)
    try:
        await agent.start()
        active = agent.nixl.gens.active
        assert active is not None  # start() made the first generation
        print(
            f"gpuobj agent listening on {agent.scheme}://{agent.endpoint} (pod {config.namespace}/{config.pod_name}, "
            f"incarnation {agent.incarnation}, NIXL agent {active.name})",
            flush=True,
        )
        await stop.wait()
    finally:
        await agent.stop()
    balanced = agent.balanced()
    print(
        f"gpuobj agent stopped: {agent.nixl.ledger.registrations} NIXL registrations, "
        f"{agent.nixl.ledger.deregistrations} deregistrations",
        flush=True,
    )
    return 0 if balanced else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nixl").setLevel(max(logging.WARNING, logging.getLogger().level))
    config = config_from_args(args)
    try:
        return asyncio.run(serve(config))
    except (ValueError, RuntimeError) as exc:  # no operator named, no kubeconfig, CSR refused
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
