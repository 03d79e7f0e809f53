"""Restart at scale: N live GPUObjects, the operator killed and restarted; how long to reconcile, and no wrong free.

    .venv/bin/python bench/restart_scale.py --objects 10000

One workload pod puts N small objects (its agent really holds them) and records them as
GPUObjects; a first operator reconciles them (status Ready); it is killed with SIGKILL; a
second operator starts. Printed: the second operator's time to list everything (sync),
to reconcile (its work queue idle, measured by the audit and status being current), its
resident memory, and the frees it performed (must be 0: every object is still referenced).
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._cluster import PUT_MANY, count_ready, one_namespace, rss_mib, start_workload  # noqa: E402  (the shared start-up)
from gpuobj_dev.testing.agent_tls import PLAIN  # noqa: E402
from gpuobj_dev.testing.operator import OperatorProcess  # noqa: E402

NAMESPACE = "gpuobj-scale"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    args = parser.parse_args(argv)
    n = args.objects

    with one_namespace(NAMESPACE, "gpuobj-scale-") as run:
        handle, identities, procs = run.handle, run.identities, run.procs
        op = identities.operator()
        # Plain HTTP: the workload starts before any operator (a TLS agent would wait for the signer), and
        # what is measured is the operator's sync and audit at N objects (TLS per request: bench/agent_tls.py).
        env = {**identities.workload_env, **PLAIN}
        src, _ = start_workload(handle, NAMESPACE, "src", lambda uid: identities.workload("src", uid), env)
        procs.append(src)
        src.run(PUT_MANY)
        t0 = time.perf_counter()
        src.run(f"client.runner.call(put_many({n}), 'put many')", timeout=3600)
        print(f"# put {n} objects (agent put + GPUObject create) in {time.perf_counter() - t0:.1f}s", flush=True)

        extra = ["--namespace", NAMESPACE, "--lease-seconds", "5", "--audit-interval", "5", "--status-delay", "0"]
        extra += ["--agent-tls", "off"]
        first = OperatorProcess(
            op.kubeconfig, op.agent_token, identity="op-1", lease_namespace=NAMESPACE, extra_args=extra
        )
        procs.append(first)
        t0 = time.perf_counter()
        first.start().wait_ready(timeout=600)
        while count_ready(handle, NAMESPACE) < n:
            time.sleep(1)
        print(f"# first operator wrote {n} statuses in {time.perf_counter() - t0:.1f}s", flush=True)
        first.kill()

        second = OperatorProcess(
            op.kubeconfig, op.agent_token, identity="op-2", lease_namespace=NAMESPACE, extra_args=extra
        )
        procs.append(second)
        t0 = time.perf_counter()
        second.start()
        second.wait_for_line("synced:", timeout=600)
        synced = time.perf_counter() - t0
        # Reconciled: an audit pass over the agent's inventory has compared all N (every object held).
        second.wait_for_line("synced and reconciling", timeout=600)
        audits_before = second.metric("gpuobj_audit_runs_total", {"result": "ok"})
        while second.metric("gpuobj_audit_runs_total", {"result": "ok"}) <= audits_before:
            time.sleep(0.5)
        reconciled = time.perf_counter() - t0
        frees = second.metric("gpuobj_frees_total")
        lost = second.metric("gpuobj_lost_objects_total")
        ready = second.metric("gpuobj_objects", {"state": "Ready"})
        memory = rss_mib(second.proc.pid)  # type: ignore[union-attr]
        print()
        print(f"{'live GPUObjects':>28} | {n}")
        print(f"{'restart: listed (sync)':>28} | {synced:.1f} s")
        print(f"{'restart: audited all':>28} | {reconciled:.1f} s")
        print(f"{'operator resident memory':>28} | {memory:.0f} MiB")
        print(f"{'objects Ready after restart':>28} | {ready:.0f}")
        print(f"{'frees after restart':>28} | {frees:.0f} (must be 0)")
        print(f"{'objects marked Lost':>28} | {lost:.0f} (must be 0)")
        return 0 if frees == 0 and lost == 0 and ready == n else 1


if __name__ == "__main__":
    sys.exit(main())
