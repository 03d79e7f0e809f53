"""Lifecycle benchmark: put -> claim -> fetch -> release -> free cycles per second, against the real API server.

Prints a table with gpuobj's rate and, side by side, Ray RDT's (tensor_transport="nixl",
actor to actor: produce, consume, free) on the same machine, with the ratio; plus the
operator's free latency p50/p99 and a stream's items per second.

    make bench                      # installs ray==2.60.0 into .venv if missing, runs both benchmarks
    .venv/bin/python bench/lifecycle.py --cycles 200 --sizes 4096 1048576 67108864

A benchmark, not a test: numbers vary with the machine; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuobj_dev.cluster import DevCluster  # noqa: E402
from gpuobj_dev.testing.cluster import ClusterHandle  # noqa: E402
from gpuobj_dev.testing.identities import WORKLOAD_SA, Identities  # noqa: E402
from gpuobj_dev.testing.operator import OperatorProcess  # noqa: E402
from gpuobj_dev.testing.pods import create_agent_pod  # noqa: E402
from gpuobj_dev.testing.workload import WorkloadProcess, free_port  # noqa: E402

NAMESPACE = "gpuobj-bench"

CYCLE_SRC = """
def cycle_put(i, n):
    global ref
    ref = client.put([payload], name=f"b-{i}")
    return dump_pickle(client.share(ref, "reader"))

def cycle_release():
    ref.release()
"""

CYCLE_READER = """
def cycle_read(shared):
    h = client.adopt(load_pickle(shared))
    got = client.fetch(h)
    h.release()
    return got[0].numel()
"""


def human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def gpuobj_cycles(
    cluster: ClusterHandle, src: WorkloadProcess, reader: WorkloadProcess, size: int, cycles: int
) -> float:
    """Sequential cycles; the rate counts a cycle only once its GPUObject is freed and gone."""
    src.run(f"payload = torch.ones({size // 4}, dtype=torch.float32)")
    src.run(CYCLE_SRC)
    reader.run(CYCLE_READER)
    started = time.perf_counter()
    spent = [0.0, 0.0, 0.0]
    for i in range(cycles):
        t0 = time.perf_counter()
        shared = src.eval(f"cycle_put({i}, {size})")
        t1 = time.perf_counter()
        reader.eval(f"cycle_read({shared!r})")
        t2 = time.perf_counter()
        src.run("cycle_release()")
        t3 = time.perf_counter()
        for j, dt in enumerate((t1 - t0, t2 - t1, t3 - t2)):
            spent[j] += dt
    ms = [x / cycles * 1000 for x in spent]
    print(f"#   per cycle: put+share {ms[0]:.1f} ms, adopt+fetch+release {ms[1]:.1f} ms, owner release {ms[2]:.1f} ms")
    cluster.kubectl("wait", "--for=delete", "gpuobject", "--all", "-n", NAMESPACE, "--timeout=120s")
    return cycles / (time.perf_counter() - started)


# DESIGN.md's reference figures for Ray 2.60 RDT on this kind of machine (cycles/s by object size),
# shown when Ray cannot be measured side by side here.
RAY_REFERENCE = {4096: "35-90", 1 << 20: "35-90", 64 << 20: "7-11"}
_RAY_FAILED: list[str] = []


def ray_cycles(size: int, cycles: int) -> float | str:
    """Ray RDT: a producer actor returns a tensor over NIXL, a consumer actor reads it, the ref goes out of scope.

    Returns cycles/s, or why it could not be measured.
    """
    if _RAY_FAILED:
        return _RAY_FAILED[0]
    try:
        import ray
        import torch
    except ImportError:
        return "ray not installed"
    try:
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

        @ray.remote
        class Producer:
            @ray.method(tensor_transport="nixl")
            def produce(self, n: int):
                return torch.ones(n, dtype=torch.float32)

        @ray.remote
        class Consumer:
            def consume(self, t) -> int:
                return t.numel()

        producer, consumer = Producer.remote(), Consumer.remote()
        ray.get(consumer.consume.remote(producer.produce.remote(16)), timeout=90)  # warm up the transport
        started = time.perf_counter()
        for _ in range(cycles):
            ref = producer.produce.remote(size // 4)
            ray.get(consumer.consume.remote(ref), timeout=60)
            del ref
        return cycles / (time.perf_counter() - started)
    except Exception as exc:  # report, do not hide: the table says why the column is empty
        _RAY_FAILED.append(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        ray.shutdown()
        return _RAY_FAILED[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 64 << 20])
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray RDT baseline")
    args = parser.parse_args(argv)

    state = Path(tempfile.mkdtemp(prefix="gpuobj-bench-"))
    cluster = DevCluster(state, tie_to_parent=True, log=lambda m: print(f"# {m}", flush=True))
    handle = ClusterHandle(cluster, cluster.up())
    workloads: list[WorkloadProcess] = []
    operator = None
    try:
        handle.apply_crds()
        handle.kubectl("create", "namespace", NAMESPACE)
        # The operator and the workloads run as their ServiceAccounts with the chart's roles, as in a cluster.
        identities = Identities(handle, NAMESPACE, state / "identities")
        op = identities.operator()
        operator = (
            OperatorProcess(
                op.kubeconfig, op.agent_token, lease_namespace=NAMESPACE, extra_args=["--namespace", NAMESPACE]
            )
            .start()
            .wait_ready()
        )

        async def pod(name: str, port: int) -> str:
            async with handle.client() as kube:
                created = await create_agent_pod(kube, NAMESPACE, name, port=port, service_account=WORKLOAD_SA)
                return created["metadata"]["uid"]

        for name in ("src", "reader"):
            port = free_port()
            uid = asyncio.run(pod(name, port))
            creds = identities.workload(name, uid)
            workloads.append(
                WorkloadProcess(
                    pod_name=name,
                    namespace=NAMESPACE,
                    pod_uid=uid,
                    port=port,
                    token_file=creds.agent_token,
                    kubeconfig=creds.kubeconfig,
                    env=identities.workload_env,
                ).start()
            )
        src, reader = workloads
        rows = []
        for size in args.sizes:
            cycles = max(5, args.cycles if size <= (1 << 20) else args.cycles // 10)
            print(f"# {human(size)}: {cycles} gpuobj cycles ...", flush=True)
            ours = gpuobj_cycles(handle, src, reader, size, cycles)
            theirs = "skipped (--no-ray)" if args.no_ray else ray_cycles(size, cycles)
            rows.append((size, ours, theirs))
        stream_rate = stream_items(src, reader, handle)
        p50 = quantile(operator, 0.5)
        p99 = quantile(operator, 0.99)
        print()
        print(f"{'object':>10} | {'gpuobj cycles/s':>16} | {'Ray RDT cycles/s':>16} | {'ratio':>6}")
        print(f"{'-' * 10}-+-{'-' * 16}-+-{'-' * 16}-+-{'-' * 6}")
        notes = set()
        for size, ours, theirs in rows:
            if isinstance(theirs, float):
                print(f"{human(size):>10} | {ours:16.1f} | {theirs:16.1f} | {ours / theirs:5.2f}x")
            else:
                notes.add(str(theirs))
                ref = RAY_REFERENCE.get(size, "?")
                print(f"{human(size):>10} | {ours:16.1f} | {ref + ' (ref)':>16} | {'n/a':>6}")
        if notes:
            print(f"Ray RDT not measured here ({'; '.join(sorted(notes))}): (ref) = DESIGN.md's reference figures")
        print(f"\nstream items/s (64 KiB items, producer -> consumer): {stream_rate:.1f}")
        print(
            f"operator free latency (last reference gone -> agent ack): p50 {p50 * 1000:.1f} ms,"
            f" p99 {p99 * 1000:.1f} ms"
        )
        return 0
    finally:
        for w in workloads:
            w.kill()
        if operator:
            operator.stop()
        cluster.down(quiet=True)


def stream_items(src: WorkloadProcess, reader: WorkloadProcess, handle: ClusterHandle, items: int = 200) -> float:
    src.run("w = client.stream_writer('bench')")
    started = time.perf_counter()

    def produce() -> None:
        src.run(f"for i in range({items}): w.emit([torch.ones(16384)])\nw.close()", timeout=600)

    t = threading.Thread(target=produce)
    t.start()
    reader.run("n = sum(1 for _ in client.read_stream('bench'))", timeout=600)
    t.join()
    rate = items / (time.perf_counter() - started)
    handle.kubectl("delete", "gpuobjectstream", "bench", "-n", NAMESPACE, "--timeout=60s")
    return rate


def quantile(operator: OperatorProcess, q: float) -> float:
    """histogram_quantile over the operator's free-latency buckets (linear within a bucket)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = []
    for family in text_string_to_metric_families(operator.metrics()):
        for s in family.samples:
            if s.name == "gpuobj_free_latency_seconds_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total:
        return float("nan")
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


if __name__ == "__main__":
    sys.exit(main())
