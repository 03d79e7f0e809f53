"""Lifecycle benchmark, gpuobj against Ray RDT, each side measured alone, one table with ratios.

The same cycle on both sides: put -> hand to the reader -> fetch with bytes verified ->
every reference released -> the source's memory freed, *observed in the source* (its
free function returned there). Each side runs in its own subprocess, one after the other:
Ray's cluster is shut down before gpuobj's control plane starts, and the reverse.

- Ray 2.60 RDT: a producer actor returns the tensor with ``tensor_transport="nixl"``, a
  consumer actor (``enable_tensor_transport=True``, which gives it Ray's ``_ray_system``
  concurrency group where the receive runs) checks it, the driver drops the ref. The free is
  observed in the producer: ``RDTStore.pop_object`` returning.
- gpuobj: the source workload process puts, shares to the reader process (a SharedRef
  over a local socket), the reader adopts, fetches, checks and releases, the source
  releases; the free is observed in the source: the agent's ``ObjectStore.free`` returning.

Columns: cycles/s with a persistent tensor (the same one every cycle) and a fresh tensor
(a new allocation per cycle), free latency (release call -> freed in the source, exact
timestamps, not histogram buckets) p50/p99 per size, API writes per cycle (kube-apiserver's
own ``apiserver_request_total`` delta, every client included), and 4 producer/reader pairs at
once (aggregate cycles/s). Then a burst: 2 clients x N short-lived 4 KiB objects (32 in
flight each): frees/s, free p99 and API requests per object. Recorded frees (objects that outlive
the write window, freed by the operator), with the owner's or the reader's release last, per step
(``--recorded N``; ``--recorded-only`` for just these). The machine's load is printed.

    make bench
    .venv/bin/python bench/lifecycle.py --cycles 200 --sizes 4096 1048576 67108864 [--no-ray]

A benchmark, not a test: numbers vary with the machine; nothing here asserts a timing.
Bytes are verified by sampling (first, last and every 4096th element) on both sides alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._cluster import BenchCluster, load, ray_init, settle  # noqa: E402  (the shared start-up)

SMALL = 1 << 20


def human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each named process has used so far (/proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_busy() -> tuple[float, float]:
    """Seconds the machine's CPUs were busy and in all, since boot (/proc/stat): how much of the
    machine one pair keeps busy bounds what more pairs can add on it."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def cycles_for(size: int, base: int) -> int:
    return base if size <= SMALL else max(20, base // 5)


# ----------------------------------------------------------------------------------- Ray side


class FreeLog:
    """Free timestamps written by the source process, read by the driver: shared memory, one writer."""

    def __init__(self, name: str | None = None, capacity: int = 1 << 16) -> None:
        from multiprocessing import shared_memory

        self.capacity = capacity
        size = 8 * (capacity + 1)
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        self.name = self.shm.name
        self.owner = name is None

    def record(self, ts: float) -> None:
        import struct

        n = struct.unpack_from("q", self.shm.buf, 0)[0]
        struct.pack_into("d", self.shm.buf, 8 * (1 + n % self.capacity), ts)
        struct.pack_into("q", self.shm.buf, 0, n + 1)

    def count(self) -> int:
        import struct

        return struct.unpack_from("q", self.shm.buf, 0)[0]

    def at(self, i: int) -> float:
        import struct

        return struct.unpack_from("d", self.shm.buf, 8 * (1 + i % self.capacity))[0]

    def wait(self, n: int, timeout: float = 60.0) -> float:
        """Spin (yielding) until `n` frees happened; the n-th one's timestamp."""
        deadline = time.monotonic() + timeout
        while self.count() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"free {n} not observed in the source within {timeout:g}s")
            time.sleep(0.00002)
        return self.at(n - 1)

    def close(self) -> None:
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def ray_side(args: argparse.Namespace) -> dict:

    import ray
    import torch

    ray_init()
    logs: list[FreeLog] = []
    try:

        @ray.remote(num_cpus=0, enable_tensor_transport=True)
        class Producer:
            def __init__(self, log_name: str) -> None:
                from ray.experimental.rdt import rdt_store

                self.log = FreeLog(log_name)
                self.persistent: dict[int, torch.Tensor] = {}
                original, log = rdt_store.RDTStore.pop_object, self.log

                def pop_object(store, obj_id):  # the source frees: observe it here
                    out = original(store, obj_id)
                    log.record(time.monotonic())
                    return out

                rdt_store.RDTStore.pop_object = pop_object

            @ray.method(tensor_transport="nixl")
            def produce(self, n: int, fresh: bool, value: float):
                if fresh:
                    return torch.full((n // 4,), value, dtype=torch.float32)
                t = self.persistent.get(n)
                if t is None:
                    t = self.persistent[n] = torch.full((n // 4,), value, dtype=torch.float32)
                return t

        @ray.remote(num_cpus=0, enable_tensor_transport=True)
        class Consumer:
            def consume(self, t, value: float) -> bool:
                return bool((t[::4096] == value).all() and t[0] == value and t[-1] == value)

        def pair():
            log = FreeLog()
            logs.append(log)
            return Producer.remote(log.name), Consumer.remote(), log

        def run_cycles(p, c, log: FreeLog, size: int, cycles: int, fresh: bool) -> tuple[float, list[float]]:
            lat = []
            started = time.perf_counter()
            for i in range(cycles):
                value = float(i % 97) if fresh else 7.0
                ref = p.produce.remote(size, fresh, value)
                assert ray.get(c.consume.remote(ref, value), timeout=120), "bytes differ"
                base = log.count()
                t_release = time.monotonic()
                del ref
                lat.append(log.wait(base + 1) - t_release)
            return cycles / (time.perf_counter() - started), lat

        out: dict = {"load_start": load(), "rows": {}, "pairs": {}, "errors": [], "npairs": args.pairs}
        p, c, log = pair()
        run_cycles(p, c, log, 4096, 5, False)  # warm up the transport
        for size in args.sizes:
            n = cycles_for(size, args.cycles)
            row: dict = {}
            for policy in ("persistent", "fresh"):
                try:
                    rate, lat = run_cycles(p, c, log, size, n, policy == "fresh")
                except Exception as exc:  # report it; keep what was measured
                    out["errors"].append(f"{human(size)} {policy}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                row[policy] = {"rate": rate, "free_ms": [x * 1000 for x in lat]}
                print(f"# ray {human(size)} {policy}: {rate:.1f} cycles/s", file=sys.stderr, flush=True)
            out["rows"][str(size)] = row
        try:
            ray_pairs(args, out, pair, run_cycles, (p, c, log))
        except Exception as exc:
            out["errors"].append(f"{args.pairs} pairs: {type(exc).__name__}: {str(exc)[:200]}")
        out["load_end"] = load()
        return out
    finally:
        ray.shutdown()
        for log in logs:
            log.close()


def ray_pairs(args: argparse.Namespace, out: dict, pair, run_cycles, first) -> None:
    """4 producer/consumer pairs at once (driver threads): aggregate cycles/s."""
    p, c, log = first
    if args.pairs <= 1:
        return
    pairs = [pair() for _ in range(args.pairs - 1)] + [(p, c, log)]
    for pp, cc, ll in pairs:
        run_cycles(pp, cc, ll, 4096, 3, False)
    for size in [s for s in args.sizes if s <= SMALL]:
        n = cycles_for(size, args.cycles) // 2
        rates: list[float] = []

        def one(pp, cc, ll, size=size, n=n, rates=rates) -> None:
            with contextlib.suppress(Exception):  # a failed pair is reported by the count
                rates.append(run_cycles(pp, cc, ll, size, n, False)[0])

        threads = [threading.Thread(target=one, args=x) for x in pairs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(rates) == len(pairs):
            out["pairs"][str(size)] = sum(rates)
        else:
            out["errors"].append(f"{args.pairs} pairs, {human(size)}: {len(pairs) - len(rates)} pair(s) failed")


# -------------------------------------------------------------------------------- gpuobj side

SOURCE_SETUP = r"""
import asyncio, base64, pickle, socket, threading, time
_store = client.agent.agent.store
_orig_free = _store.free
freed = {}
_freed_cv = threading.Condition()

async def _observed_free(object_id, **kw):
    out = await _orig_free(object_id, **kw)
    if out.freed:  # the store answers gpuobj_contract.agent_api.FreeAnswer
        with _freed_cv:
            freed[object_id] = time.monotonic()
            _freed_cv.notify_all()
    return out

_store.free = _observed_free  # the source frees: observe it here

def wait_freed(object_id, timeout=120):
    with _freed_cv:
        if not _freed_cv.wait_for(lambda: object_id in freed, timeout):
            raise TimeoutError(f"{object_id} not freed in the source within {timeout}s")
        return freed.pop(object_id)

def connect(port):
    global _conn, _f
    _conn = socket.create_connection(("127.0.0.1", port))
    _conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _f = _conn.makefile("rwb")

_persistent = {}

STEPS = ("alloc", "put", "share", "reader", "release", "free wait")

def cycles(size, n, fresh, reader, reader_uid):
    lat = []
    steps = [0.0] * len(STEPS)
    rsteps = [0.0, 0.0, 0.0]
    started = time.perf_counter()
    for i in range(n):
        t0 = time.monotonic()
        value = float(i % 97) if fresh else 7.0
        if fresh:
            t = torch.full((size // 4,), value, dtype=torch.float32)
        else:
            t = _persistent.get(size)
            if t is None:
                t = _persistent[size] = torch.full((size // 4,), value, dtype=torch.float32)
        t1 = time.monotonic()
        ref = client.put([t])
        t2 = time.monotonic()
        shared = client.share(ref, reader, pod_uid=reader_uid)
        t3 = time.monotonic()
        _f.write(base64.b64encode(pickle.dumps((shared, value))) + b"\n")
        _f.flush()
        answer = _f.readline().split()
        assert answer[0] == b"1", "bytes differ"
        for j, x in enumerate(answer[1:]):
            rsteps[j] += float(x)
        oid = ref.address.object_id
        t_release = time.monotonic()
        client.release(ref)
        t5 = time.monotonic()
        t6 = wait_freed(oid)
        lat.append(t6 - t_release)
        for j, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t_release - t3, t5 - t_release, t6 - t5)):
            steps[j] += dt
        del ref, t
    rate = n / (time.perf_counter() - started)
    breakdown = {k: v / n * 1000 for k, v in zip(STEPS, steps)}
    breakdown.update({f"reader {k}": v / n * 1000 for k, v in zip(("adopt+fetch", "verify", "release"), rsteps)})
    return rate, lat, breakdown

from gpuobj_kube.client import KubeClient as _KubeClient
_orig_delete = _KubeClient.delete
deleted_at = {}

async def _observed_delete(self, res, name, *a, **kw):
    out = await _orig_delete(self, res, name, *a, **kw)
    deleted_at[(res.plural, name)] = time.monotonic()  # the API server answered this DELETE
    return out

_KubeClient.delete = _observed_delete

def recorded_frees(n, reader, reader_uid, reader_last=False):
    # Objects that outlive the write window: recorded, and freed by the operator. Either the owner's
    # release is the last (the reader fetched and released first; its claim's DELETE answered) or the
    # reader's is (the owner released first; the reader's claim DELETE is the last reference going).
    out = []
    for i in range(n):
        ref = client.put([torch.full((1024,), 7.0)])
        shared = client.share(ref, reader, pod_uid=reader_uid)
        _f.write(base64.b64encode(pickle.dumps((shared, 7.0) + ((True,) if reader_last else ()))) + b"\n")
        _f.flush()
        assert _f.readline().split()[0] == b"1"
        client.flush()
        oid = ref.address.object_id
        if reader_last:
            client.release(ref)
            client.flush()
            _f.write(b"release %s\n" % oid.encode())
            _f.flush()
            t_release = float(_f.readline())
            key = ("gpuobjectclaims", shared.claim_name)
        else:
            key = ("gpuobjects", ref.name)
            t_release = time.monotonic()
            client.release(ref)
        t_freed = wait_freed(oid)
        client.flush()
        out.append({"object_id": oid, "release": t_release, "deleted": deleted_at.pop(key, None), "freed": t_freed})
        deleted_at.clear()
    return out

def burst(n, inflight=32):
    async def run():
        sem = asyncio.Semaphore(inflight)
        released = {}
        async def one(i):
            async with sem:
                ref = await client.aput([torch.full((1024,), 1.0)])
                oid = ref.address.object_id
                released[oid] = time.monotonic()
                await client.arelease(ref)
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        return t0, released
    t0, released = asyncio.run(run())
    done = {oid: wait_freed(oid) for oid in released}
    return t0, [done[o] - released[o] for o in released], max(done.values())
"""

READER_SETUP = r"""
import base64, pickle, socket, threading, time
_srv = socket.socket()
_srv.bind(("127.0.0.1", 0))
_srv.listen()
reader_port = _srv.getsockname()[1]

_held = {}

def _handle(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = conn.makefile("rwb")
    while line := f.readline():
        if line.startswith(b"release "):  # the reader's reference is the last to go: release it now
            h = _held.pop(line.split()[1].decode())
            t_release = time.monotonic()
            client.release(h)
            del h
            f.write(b"%f\n" % t_release)
            f.flush()
            continue
        shared, value, *hold = pickle.loads(base64.b64decode(line))
        t0 = time.monotonic()
        h = client.adopt(shared)
        t = client.fetch(h)[0]
        t1 = time.monotonic()
        ok = bool((t[::4096] == value).all() and t[0] == value and t[-1] == value)
        t2 = time.monotonic()
        if hold:
            _held[shared.address.object_id] = h
        else:
            client.release(h)
        del t, h
        t3 = time.monotonic()
        f.write(b"%d %f %f %f\n" % (ok, t1 - t0, t2 - t1, t3 - t2))
        f.flush()

def _serve():
    while True:
        conn, _ = _srv.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()

threading.Thread(target=_serve, daemon=True).start()
"""


def gpuobj_side(args: argparse.Namespace) -> dict:
    from gpuobj_dev.cluster import DevCluster
    from gpuobj_dev.testing.api_requests import delta, request_counts, writes

    if args.apiserver_arg:  # an experiment on the API server's side (e.g. the claims watch cache off)
        spawn = DevCluster._spawn

        def _spawn(self, state, name, argv, *a, **kw):  # type: ignore[no-untyped-def]
            return spawn(
                self, state, name, [*argv, *args.apiserver_arg] if name == "kube-apiserver" else argv, *a, **kw
            )

        DevCluster._spawn = _spawn  # type: ignore[method-assign]
    out: dict = {"load_start": load(), "rows": {}, "pairs": {}, "writes": {}, "npairs": args.pairs}
    env = {
        "GPUOBJ_WRITE_WINDOW": str(args.window),
        # One user's processes on one node, as Ray's actors here, which use UCX's cma: the same
        # transport on both sides (off by default across tenants, docs/security.md).
        "GPUOBJ_ALLOW_CMA": "true",
    }
    with BenchCluster(operator_args=args.operator_arg, env=env) as bench:
        handle, operator, workloads, start = bench.handle, bench.operator, bench.workloads, bench.start

        def make_pair(k: int):
            src, _ = start(f"src-{k}")
            reader, reader_uid = start(f"reader-{k}")
            src.run(SOURCE_SETUP)
            reader.run(READER_SETUP)
            src.run(f"connect({reader.eval('reader_port')})")
            return src, f"reader-{k}", reader_uid

        src, rname, ruid = make_pair(0)
        # Whose CPU one pair's cycle uses: where the time goes when more pairs do not scale.
        pids = {"producer (client + agent)": workloads[0].proc.pid, "reader (client + agent)": workloads[1].proc.pid,
                "operator": operator.proc.pid, **{n: p for n, p in handle.state.pids.items()}}  # fmt: skip
        src.eval(f"cycles(4096, 5, False, {rname!r}, {ruid!r})[0]")  # warm up
        for size in args.sizes:
            n = cycles_for(size, args.cycles)
            row = {}
            for policy in ("persistent", "fresh"):
                before = request_counts(handle)
                busy0, all0 = cpu_busy()
                cpu0 = cpu_seconds(pids)
                rate, lat, breakdown = src.eval(
                    f"cycles({size}, {n}, {policy == 'fresh'}, {rname!r}, {ruid!r})", timeout=1800
                )
                busy1, all1 = cpu_busy()
                cpu1 = cpu_seconds(pids)
                src.run("client.flush()")
                sent = delta(request_counts(handle), before)
                row[policy] = {
                    "rate": rate,
                    "free_ms": [x * 1000 for x in lat],
                    "writes_per_cycle": writes(sent) / n,
                    "steps_ms": breakdown,
                    "requests": {f"{v} {r}": c for (v, r), c in sent.items()},
                    # The whole machine: the pair, the operator, the API server and etcd (and any other load).
                    "cpu_busy": (busy1 - busy0) / max(all1 - all0, 1e-9),
                    "cpu_ms_per_cycle": (busy1 - busy0) / n * 1000,
                    "cpu_ms_per_cycle_by_process": {k: (cpu1[k] - cpu0[k]) / n * 1000 for k in cpu1 if k in cpu0},
                }
                print(f"# gpuobj {human(size)} {policy}: {rate:.1f} cycles/s", file=sys.stderr, flush=True)
            out["rows"][str(size)] = row
        if args.recorded:
            out["recorded"] = {}
            for order in ("owner last", "reader last"):
                samples = src.eval(
                    f"recorded_frees({args.recorded}, {rname!r}, {ruid!r}, {order == 'reader last'})", timeout=1800
                )
                out["recorded"][order] = {
                    "free_ms": [(x["freed"] - x["release"]) * 1000 for x in samples],
                    "steps": recorded_steps(samples, operator.lines),
                }
        out["stats"] = src.eval("client.write_stats()")
        if args.pairs > 1:
            pairs = [(src, rname, ruid)] + [make_pair(k) for k in range(1, args.pairs)]
            for s, rn, ru in pairs[1:]:
                s.eval(f"cycles(4096, 3, False, {rn!r}, {ru!r})[0]")
            for size in [s for s in args.sizes if s <= SMALL]:
                n = cycles_for(size, args.cycles) // 2
                rates: list[float] = []

                def one(s, rn, ru, size=size, n=n, rates=rates) -> None:
                    rates.append(s.eval(f"cycles({size}, {n}, False, {rn!r}, {ru!r})[0]", timeout=1800))

                threads = [threading.Thread(target=one, args=x) for x in pairs]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                out["pairs"][str(size)] = sum(rates)
        if args.burst:
            sources = [src] + ([pairs[1][0]] if args.pairs > 1 else [start("src-b")[0]])
            for s in sources[1:]:
                if args.pairs <= 1:
                    s.run(SOURCE_SETUP)
            before = request_counts(handle)
            results: list = []

            def fire(s) -> None:
                results.append(s.eval(f"burst({args.burst})", timeout=1800))

            threads = [threading.Thread(target=fire, args=(s,)) for s in sources]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for s in sources:
                s.run("client.flush()")
            sent = delta(request_counts(handle), before)
            t0 = min(r[0] for r in results)
            end = max(r[2] for r in results)
            lat = [x for r in results for x in r[1]]
            total = args.burst * len(sources)
            out["burst"] = {
                "objects": total,
                "frees_per_s": total / (end - t0),
                "free_p50_ms": pct(lat, 0.5) * 1000,
                "free_p99_ms": pct(lat, 0.99) * 1000,
                "requests_per_object": sum(sent.values()) / total,
                "writes_per_object": writes(sent) / total,
            }
        out["load_end"] = load()
        return out


def recorded_steps(samples: list[dict], operator_lines) -> dict:
    """Where a recorded free's time goes, per step (median and p99, ms), from monotonic stamps (one
    clock for every process here): the workload's release call and its DELETE answered, the operator's
    "freeing ..." log line (it saw the last reference go, decided, checked the claims, sends the free),
    and the source's free returned."""
    import re

    rx = re.compile(
        r"freeing \S+ \(object (\S+),.*; claims by (\w+); seen t=([\d.]+), decided \+([\d.]+) ms, "
        r"checked \+([\d.]+) ms"
    )
    op: dict[str, tuple[str, float, float, float]] = {}
    for line in list(operator_lines):
        m = rx.search(line)
        if m:
            seen = float(m.group(3))
            op[m.group(1)] = (m.group(2), seen, seen + float(m.group(4)) / 1000, seen + float(m.group(5)) / 1000)
    steps: dict[str, list[float]] = {
        "release call -> DELETE answered": [],
        "DELETE answered -> operator saw it": [],
        "saw -> decided (work queue)": [],
        "decided -> claims checked": [],
        "checked -> freed in the source": [],
    }
    how: dict[str, int] = {}
    for x in samples:
        o = op.get(x["object_id"])
        if o is None or x["deleted"] is None:
            continue
        plan, seen, decided, checked = o
        how[plan] = how.get(plan, 0) + 1
        stamps = (x["release"], x["deleted"], seen, decided, checked, x["freed"])
        for key, a, b in zip(steps, stamps, stamps[1:], strict=False):
            steps[key].append((b - a) * 1000)
    table = {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in steps.items()}
    return {"steps": table, "claims_checked_by": how, "matched": len(steps["saw -> decided (work queue)"])}


# ------------------------------------------------------------------------------------ the table


def run_side(side: str, argv: list[str]) -> dict | str:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        proc = subprocess.run([sys.executable, __file__, "--side", side, "--out", path, *argv], check=False)
        if proc.returncode != 0:
            return f"{side} side exited {proc.returncode} (see its output above)"
        return json.loads(Path(path).read_text())
    finally:
        Path(path).unlink(missing_ok=True)


def report(ray: dict | str, ours: dict | str, sizes: list[int]) -> None:
    print()
    for name, side in (("Ray RDT", ray), ("gpuobj", ours)):
        if isinstance(side, dict):
            print(f"{name}: load (1/5/15 min) {side['load_start']} at start, {side['load_end']} at end")
            for error in side.get("errors", []):
                print(f"  {name} failed: {error}")
        else:
            print(f"{name}: not measured: {side}")
    head = (
        f"{'object':>7} | {'policy':>10} | {'Ray c/s':>8} | {'gpuobj c/s':>10} | {'ratio':>6} | "
        f"{'Ray free p50/p99 ms':>19} | {'gpuobj free p50/p99 ms':>22} | {'API writes/cycle':>16}"
    )
    print(head)
    print("-" * len(head))
    for size in sizes:
        for policy in ("persistent", "fresh"):
            r = ray["rows"].get(str(size), {}).get(policy) if isinstance(ray, dict) else None
            o = ours["rows"].get(str(size), {}).get(policy) if isinstance(ours, dict) else None
            rr = f"{r['rate']:8.1f}" if r else f"{'n/a':>8}"
            oo = f"{o['rate']:10.1f}" if o else f"{'n/a':>10}"
            ratio = f"{o['rate'] / r['rate']:5.2f}x" if r and o else f"{'n/a':>6}"
            rf = f"{pct(r['free_ms'], 0.5):.2f} / {pct(r['free_ms'], 0.99):.2f}" if r else "n/a"
            of = f"{pct(o['free_ms'], 0.5):.2f} / {pct(o['free_ms'], 0.99):.2f}" if o else "n/a"
            w = f"{o['writes_per_cycle']:.2f}" if o else "n/a"
            print(f"{human(size):>7} | {policy:>10} | {rr} | {oo} | {ratio} | {rf:>19} | {of:>22} | {w:>16}")
    if isinstance(ours, dict) or isinstance(ray, dict):
        for size in sizes:
            rp = ray["pairs"].get(str(size)) if isinstance(ray, dict) else None
            op = ours["pairs"].get(str(size)) if isinstance(ours, dict) else None
            if rp is None and op is None:
                continue
            solo = ours["rows"].get(str(size), {}).get("persistent", {}) if isinstance(ours, dict) else {}
            one = solo.get("rate")
            scale = f", {op / one:.2f}x one pair" if op and one else ""
            if op and one and solo.get("cpu_busy"):
                # How much of the machine one pair leaves to more pairs (a guide, not a bound: costs per
                # second, such as fences, do not grow with the number of cycles).
                scale += (
                    f" (one pair kept the {os.cpu_count()} CPUs {solo['cpu_busy']:.0%} busy, "
                    f"{solo['cpu_ms_per_cycle']:.2f} ms of CPU per cycle)"
                )
                by = solo.get("cpu_ms_per_cycle_by_process") or {}
                if by:
                    scale += "\n  one pair's CPU per cycle, ms: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])
                    )
            ratio = f" ({op / rp:.2f}x Ray)" if op and rp else ""
            npairs = (ours if isinstance(ours, dict) else ray).get("npairs", 4)  # type: ignore[union-attr]
            print(
                f"{npairs} pairs, {human(size)}: Ray {rp or float('nan'):.1f} c/s, gpuobj {op or float('nan'):.1f} c/s"
                f"{ratio}{scale}"
            )
    if isinstance(ours, dict):
        for order, rec in (ours.get("recorded") or {}).items():
            ms, rs = rec["free_ms"], rec["steps"]
            print(
                f"gpuobj free latency of recorded objects ({order}; freed by the operator): "
                f"p50 {pct(ms, 0.5):.1f} ms, p99 {pct(ms, 0.99):.1f} ms ({len(ms)} samples)"
            )
            print(f"  per step, p50 / p99 ms ({rs['matched']} matched; claims checked by {rs['claims_checked_by']}):")
            for step, v in rs["steps"].items():
                print(f"    {step:<36} {v['p50']:7.2f} / {v['p99']:7.2f}")
        print(f"gpuobj write-behind: {ours.get('stats')}")
        b = ours.get("burst")
        if b:
            print(
                f"burst {b['objects']} short-lived 4 KiB objects (2 clients, 32 in flight each): "
                f"{b['frees_per_s']:.0f} frees/s, free p50 {b['free_p50_ms']:.1f} ms, p99 {b['free_p99_ms']:.1f} ms, "
                f"{b['requests_per_object']:.2f} API requests/object ({b['writes_per_object']:.2f} writes)"
            )
        for size in sizes:
            for policy in ("persistent", "fresh"):
                o = ours["rows"].get(str(size), {}).get(policy)
                if not o:
                    continue
                steps = ", ".join(f"{k} {v:.2f}" for k, v in o.get("steps_ms", {}).items())
                print(f"  gpuobj {human(size)} {policy}, ms per cycle: {steps}")
                if o.get("requests"):
                    print(f"    API requests: {o['requests']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200, help="cycles per size up to 1 MiB (a fifth above)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 64 << 20])
    parser.add_argument("--pairs", type=int, default=4, help="producer/reader pairs for the concurrency column")
    parser.add_argument("--burst", type=int, default=1000, help="short-lived objects per client in the burst (0: skip)")
    parser.add_argument("--window", type=float, default=0.1, help="gpuobj's write-behind window, seconds")
    parser.add_argument(
        "--recorded", type=int, default=200, help="recorded-object frees to time (outlive the window; 0: skip)"
    )
    parser.add_argument(
        "--recorded-only",
        action="store_true",
        help="only the recorded-object frees: no table sizes, pairs, burst or Ray (a short run)",
    )
    parser.add_argument(
        "--apiserver-arg",
        action="append",
        default=[],
        help="extra kube-apiserver flag (gpuobj side), e.g. --watch-cache-sizes=gpuobjectclaims.gpuobj.io#0",
    )
    parser.add_argument(
        "--operator-arg",
        action="append",
        default=[],
        help="extra operator flag, e.g. --operator-arg=--claims-read-delay=0",
    )
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray RDT side")
    parser.add_argument(
        "--settle",
        type=float,
        default=1.5,
        help="before each side, wait up to 3 minutes for the 1-minute load to fall below this (0: don't wait)",
    )
    parser.add_argument("--side", choices=["ray", "gpuobj"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.recorded_only:
        args.sizes, args.pairs, args.burst, args.no_ray = [], 1, 0, True
        args.recorded = args.recorded or 200
    if args.side:
        result = ray_side(args) if args.side == "ray" else gpuobj_side(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    passthrough = [
        "--cycles", str(args.cycles), *(["--sizes", *map(str, args.sizes)] if args.sizes else []),
        "--pairs", str(args.pairs),
        "--burst", str(args.burst), "--window", str(args.window), "--recorded", str(args.recorded),
        *(["--recorded-only"] if args.recorded_only else []),
        *[f"--apiserver-arg={a}" for a in args.apiserver_arg], *[f"--operator-arg={a}" for a in args.operator_arg],
    ]  # fmt: skip
    print(f"# {os.cpu_count()} CPUs, load {load()} before the run", flush=True)
    if args.apiserver_arg or args.operator_arg:
        print(f"# gpuobj side with kube-apiserver {args.apiserver_arg}, operator {args.operator_arg}", flush=True)
    ray: dict | str = "skipped (--no-ray)"
    if not args.no_ray:
        try:
            import ray as _ray  # noqa: F401
        except ImportError:
            ray = "ray not importable (make bench installs ray==2.60.0)"
        else:
            settle(args.settle, 180)
            ray = run_side("ray", passthrough)
    settle(args.settle, 180)
    ours = run_side("gpuobj", passthrough)
    report(ray, ours, args.sizes)
    return 0 if isinstance(ours, dict) else 1


if __name__ == "__main__":
    sys.exit(main())
