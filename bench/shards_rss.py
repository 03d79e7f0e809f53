"""Several operators: what each shard's operator costs in memory when one shard holds all the objects.

    nice -n 10 .venv/bin/python bench/shards_rss.py --objects 2000

One workload pod in a namespace of shard 1 puts N small objects (its agent really holds them) and
keeps them. Two operators with --shard-count 2 watch every namespace as the chart's ServiceAccount.
Printed: each one's resident memory once shard 1's has written every status, the objects each
holds in its ledger, and the GPUObject events the API server sent each one's watches. The objects
carry their namespace's bucket label, and shard 0 watches only its own buckets (operator/
gpuobj_operator/selection.py), so it is sent none of them (docs/scale.md, Several operators).
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
from gpuobj_contract import metric_names as m  # noqa: E402
from gpuobj_dev.testing.agent_tls import PLAIN  # noqa: E402
from gpuobj_dev.testing.clusterwide import operator_home  # noqa: E402
from gpuobj_dev.testing.operator import OperatorProcess  # noqa: E402
from gpuobj_operator.shards import shard_of  # noqa: E402

NAMESPACE = next(f"gpuobj-scale-{i}" for i in range(100) if shard_of(f"gpuobj-scale-{i}", 2) == 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000)
    n = parser.parse_args(argv).objects
    with one_namespace(NAMESPACE, "gpuobj-shards-") as run:
        handle, identities, procs, state = run.handle, run.identities, run.procs, run.state
        with operator_home(handle, state / "operator", ("operator.shards=2",)) as home:
            # Plain HTTP: the workload starts before the operators (a TLS agent would wait for the signer).
            env = {**identities.workload_env, **PLAIN, "GPUOBJ_OPERATOR_SERVICEACCOUNT": home.subject}
            src, _ = start_workload(handle, NAMESPACE, "src", lambda uid: identities.workload("src", uid), env)
            procs.append(src)
            ops: list[OperatorProcess] = []
            for i in range(2):
                op = home.operator(
                    f"op-shard-{i}",
                    ("--shard-count", "2", "--shard-index", str(i), "--status-delay", "0", "--agent-tls", "off"),
                )
                procs.append(op)
                ops.append(op)
            for op in ops:
                op.wait_ready(timeout=600)
            idle = [rss_mib(op.proc.pid) for op in ops]  # type: ignore[union-attr]
            src.run(PUT_MANY)
            t0 = time.perf_counter()
            src.run(f"client.runner.call(put_many({n}), 'put many')", timeout=3600)
            print(f"# put {n} objects in {NAMESPACE} (shard 1) in {time.perf_counter() - t0:.1f}s", flush=True)
            deadline = time.monotonic() + 1800
            while count_ready(handle, NAMESPACE) < n and time.monotonic() < deadline:
                time.sleep(2)
            # Shard 1's ledger has seen its own last status write come back through its watch.
            ops[1].wait_metric("gpuobj_objects", {"state": "Ready"}, n, timeout=600)
            held = [op.metric("gpuobj_objects") for op in ops]
            sent = [op.metric(m.WATCH_EVENTS, {"resource": "gpuobjects", "selection": "shard"}) for op in ops]
            memory = [rss_mib(op.proc.pid) for op in ops]  # type: ignore[union-attr]
            print()
            print(f"{'':>28} | shard 0 (not sent them) | shard 1 (holds them)")
            print(f"{'objects in its ledger':>28} | {held[0]:>23.0f} | {held[1]:.0f}")
            print(f"{'GPUObject events sent':>28} | {sent[0]:>23.0f} | {sent[1]:.0f}")
            print(f"{'RSS before the objects':>28} | {idle[0]:>19.0f} MiB | {idle[1]:.0f} MiB")
            print(f"{'RSS with ' + str(n) + ' objects':>28} | {memory[0]:>19.0f} MiB | {memory[1]:.0f} MiB")
            return 0


if __name__ == "__main__":
    sys.exit(main())
