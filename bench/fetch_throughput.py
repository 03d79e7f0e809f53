"""Fetch throughput: gpuobj fetch vs raw NIXL vs a local torch copy (and Ray RDT if installed).

Two processes: a source agent (a `gpuobj_dev.testing.agent_workload` workload process holding the
objects) and this process, which runs an embedded agent and reads from the source.
For each size it measures, all between the same two processes:
- torch copy: `dst.copy_(src)` in this process on one thread (a one-thread memcpy);
- raw NIXL: the source's descriptors loaded once, destination registered once, one
  READ re-posted back to back (the best NIXL can do, no control plane at all);
- fetch: `AgentRuntime.fetch` (read ticket over HTTP, metadata load, a landing buffer,
  READ, ticket end): one at a time, and 4 in flight;
- grant: `AgentRuntime.fetch_granted_direct` with a cached read grant (what a hand-off
  carries): no request, no thread hop, a landing buffer, READ;
All methods are measured in alternating bursts of 50 ms (median over every burst of --rounds
rounds), so noise from other work on the machine hits all of them alike.
- Ray RDT (actor to actor, tensor_transport="nixl"), if `ray` is importable.
Target: fetch at least 90% of raw NIXL from 1 MiB up.

Usage: .venv/bin/python bench/fetch_throughput.py [--sizes 4KiB,1MiB,64MiB,256MiB] [--seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.layouts import TensorLayout
from gpuobj_agent.nixl_transport import NixlAgent
from gpuobj_agent.runtime import AgentRuntime
from gpuobj_dev.testing.agent_workload import AgentProcess
from gpuobj_dev.testing.issuer import OPERATOR, default_issuer

BURST_SECONDS = 0.05  # methods alternate in bursts this long (a call longer than that is a burst of 2)
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}


def parse_size(text: str) -> int:
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * mult
    return int(text)


def label(nbytes: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}"
    return f"{nbytes} B"


def timed(fn, seconds: float, min_iters: int = 3) -> float:
    """Seconds per call: one warm-up, then repeat for about `seconds`."""
    fn()
    n, start = 0, time.perf_counter()
    while n < min_iters or time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def interleaved(
    methods: dict[str, Callable[[], object]], seconds: float, rounds: int, prepare: Callable[[], None] | None = None
) -> dict[str, float]:
    """Median seconds per call of each method, measured in alternating short bursts.

    The machine is shared and noisy; alternating bursts make every method see the same noise,
    so the ratios hold even when absolute numbers wander. `prepare` runs before each round.
    """
    samples: dict[str, list[float]] = {name: [] for name in methods}
    share = seconds / rounds  # per method and round
    burst = min(BURST_SECONDS, share)
    for _ in range(rounds):
        if prepare is not None:
            prepare()
        spent = 0.0
        while spent < share:  # short bursts, methods alternating: a load spike hits a few bursts of each
            for name, fn in methods.items():
                samples[name].append(timed(fn, burst, min_iters=2))
            spent += burst
    return {name: statistics.median(values) for name, values in samples.items()}


class RawNixl:
    """Raw NIXL between the same two processes: metadata loaded and destination registered once,
    one READ re-posted back to back. No control plane at all: the ceiling for a fetch.

    It holds a read ticket so the source keeps the object where it is; `refresh` (called
    between bursts, outside the timing) takes a new one before the lease runs out, and
    follows the object if the source moved it to a newer NIXL agent meanwhile.
    """

    def __init__(self, src: AgentProcess, oid: str, nbytes: int) -> None:
        self.src, self.oid = src, oid
        self.agent = NixlAgent(f"bench-raw-{oid}", progress_thread=False)
        self.impl = self.agent._a()
        # Allocated as the agent's landing buffers are (numpy: huge pages from 4 MiB; pre-faulted).
        self.dst = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
        self.dst.fill_(0)
        self.reg = self.impl.register_memory(self.dst)
        self.ticket: dict | None = None
        self.handle = None
        self.refresh()

    def refresh(self) -> None:
        old = self.ticket
        status, ticket = self.src.request("POST", f"/v1/objects/{self.oid}/reads", {"reader": "bench-raw"})
        assert status == 200, ticket
        self.ticket = ticket
        if old is not None:
            self.src.request("DELETE", f"/v1/reads/{old['readId']}")
        if old is None or old["nixlAgent"] != ticket["nixlAgent"]:
            if self.handle is not None:
                self.handle.release()
            self.agent.load_remote(base64.b64decode(ticket["agentMetadata"]))
            remote = self.impl.deserialize_descs(base64.b64decode(ticket["descriptors"]))
            self.handle = self.impl.initialize_xfer(
                "READ", self.impl.get_xfer_descs(self.dst), remote, ticket["nixlAgent"]
            )

    def __call__(self) -> None:
        # Polled like the agent's reader polls (spin 5 ms, then yield 50 us per check): a tight
        # Python spin starves the source's progress thread on a small machine (tcp reads need it).
        state = self.impl.transfer(self.handle)
        spin_until = time.monotonic() + 0.005
        while state == "PROC":
            if time.monotonic() > spin_until:
                time.sleep(0.00005)
            state = self.impl.check_xfer_state(self.handle)
        assert state == "DONE", state

    def close(self) -> None:
        self.handle.release()
        self.impl.deregister_memory(self.reg)
        self.src.request("DELETE", f"/v1/reads/{self.ticket['readId']}")
        self.agent.close()


def breakdown(
    rt: AgentRuntime, endpoint: str, oid: str, grant: dict, raw: RawNixl, n: int = 2000, rounds: int = 25
) -> None:
    """Per-step time of one granted fetch on the prepared path, each step timed alone in interleaved
    rounds of n calls (median over the rounds).

    The steps are what `Fetcher.fetch_granted_direct` does per call once the grant is cached and its
    READ prepared; "rest" is the total minus their sum: Python calls and attribute lookups between them.
    """
    fetcher = rt.agent.fetcher
    assert fetcher is not None
    rt.fetch_granted_direct(endpoint, oid, grant)
    entry = fetcher._entry(endpoint, grant)
    if not entry.slots:
        print("  (no prepared read for this grant: breakdown skipped)")
        return
    slot, lock, reader = entry.slots[0], fetcher._direct_lock, fetcher.reader

    def take() -> None:
        with lock:
            slot.bound.busy()

    steps = {
        "grant lookup (parsed once, by id)": lambda: fetcher._entry(endpoint, grant),
        "take a free slot (lock, storage use count)": take,
        "NIXL re-post + poll (prepared READ)": lambda: reader.repost(slot.xfer, time.monotonic() + 5),
        "new tensors over the landing buffer (detach)": slot.bound.hand_out,
        "metrics (bytes counter, latency histogram)": lambda: (
            fetcher._in_bytes.inc(entry.nbytes),
            fetcher._in_seconds.observe(1e-5),
        ),
        "two clock reads": lambda: (time.monotonic(), time.monotonic()),
    }

    methods: dict[str, Callable[[], object]] = {
        "raw": raw,
        "total": lambda: rt.fetch_granted_direct(endpoint, oid, grant),
        **steps,
    }
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):  # interleaved, so a load spike hits every step alike
        for name, fn in methods.items():
            fn()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - start) / n * 1e6)
    us = {name: statistics.median(v) for name, v in samples.items()}
    raw_us, total = us.pop("raw"), us.pop("total")
    parts = us
    print(f"\nper-step time of a {label(entry.nbytes)} granted fetch, us (load {os.getloadavg()[0]:.2f}):")
    print(f"  {'raw NIXL READ (re-post + poll)':46s} {raw_us:6.2f}")
    print(f"  {'granted fetch, total':46s} {total:6.2f}  ({total / raw_us:.2f}x raw)")
    for name, us in parts.items():
        print(f"    {name:44s} {us:6.2f}")
    print(f"    {'rest (calls between the steps)':44s} {total - sum(parts.values()):6.2f}")


def copier(nbytes: int) -> Callable[[], object]:
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


def fetch_parallel(
    rt: AgentRuntime, src: AgentProcess, oid: str, nbytes: int, seconds: float, reader_token: str, inflight: int = 4
) -> float:
    async def run() -> float:
        async def worker(deadline: float) -> int:
            n = 0
            while time.perf_counter() < deadline or n == 0:
                await rt.afetch(src.endpoint, oid, token=reader_token)
                n += 1
            return n

        await asyncio.gather(*(rt.afetch(src.endpoint, oid, token=reader_token) for _ in range(inflight)))
        start = time.perf_counter()
        counts = await asyncio.gather(*(worker(start + seconds) for _ in range(inflight)))
        return sum(counts) * nbytes / (time.perf_counter() - start) / 1e9

    return asyncio.run(run())


def ray_rdt(sizes: list[int], seconds: float) -> dict[int, float] | str:
    """Ray Direct Transport actor-to-actor over NIXL, if ray is installed."""
    try:
        import ray
    except ImportError:
        return "ray not importable (`make bench` installs ray==2.60.0 into .venv)"
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)

        @ray.remote(enable_tensor_transport=True)
        class Producer:
            @ray.method(tensor_transport="nixl")
            def make(self, nbytes: int) -> torch.Tensor:
                return torch.ones(nbytes, dtype=torch.uint8)  # a new object per cycle, as a workload would

        @ray.remote(enable_tensor_transport=True)  # gives it the _ray_system group, where Ray runs the receive
        class Consumer:
            def size(self, t: torch.Tensor) -> int:
                return t.numel()

        producer, consumer = Producer.remote(), Consumer.remote()
        out = {}
        for nbytes in sizes:

            def once(n: int = nbytes) -> None:
                assert ray.get(consumer.size.remote(producer.make.remote(n)), timeout=30) == n

            out[nbytes] = nbytes / timed(once, seconds) / 1e9
        return out
    except Exception as exc:  # report, do not fail the whole benchmark
        return f"Ray RDT failed: {type(exc).__name__}: {exc}"
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4KiB,1MiB,64MiB,256MiB")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per method and size")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 50 ms bursts per size")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument(
        "--thp", action="store_true", help="the source allocates with transparent huge pages (THP_MEM_ALLOC_ENABLE=1)"
    )
    parser.add_argument("--breakdown", action="store_true", help="per-step time of a granted fetch (smallest size)")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)  # the copy column is a one-thread memcpy (the same-node reference)
    load_start = os.getloadavg()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nixl").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="gpuobj-bench-") as tmp:
        token_file = Path(tmp) / "token"
        issuer = default_issuer()  # ServiceAccount tokens, verified by the agents against its keys
        # Two processes of one user on one node, compared with a raw NIXL READ between the same two: a
        # single-tenant setting, so UCX's cma (unbounded by registrations, off by default) is allowed
        # explicitly, as the raw READ uses it too (docs/security.md).
        # --thp: torch's CPU allocator madvises huge pages for the source's tensors. A cma READ pins the
        # source's pages one by one; with 2 MiB pages it runs at 2-3x the speed (bench/README.md).
        env = {"GPUOBJ_ALLOW_CMA": "true", **({"THP_MEM_ALLOC_ENABLE": "1"} if args.thp else {})}
        src = AgentProcess("bench-src", workload=True, workdir=tmp, issuer=issuer, env=env).start()
        reader_token = issuer.token(f"{src.namespace}/default", pod=("bench-dst", "bench-dst-uid"))
        token_file.write_text(reader_token)
        try:
            rt = AgentRuntime(
                AgentConfig(
                    pod_name="bench-dst",
                    namespace=src.namespace,
                    host="127.0.0.1",
                    port=0,
                    token_file=str(token_file),
                    issuer_url=issuer.url,
                    operator_service_accounts=(OPERATOR,),
                    allow_cma=True,
                )
            ).start()
        except BaseException:
            src.kill()  # nothing may outlive the benchmark
            src.close()
            raise
        rows = []
        try:
            for nbytes in sizes:
                oid = f"bench-{nbytes}"
                layout = TensorLayout((nbytes,), "uint8", "cpu")
                status, body = src.request(
                    "POST", "/v1/test/put", {"id": oid, "tensors": [layout.to_json()], "seed": 1}
                )
                assert status == 200, body
                raw = RawNixl(src, oid, nbytes)
                grant: list[dict] = [{}]

                def regrant(o: str = oid, grant: list[dict] = grant, raw: RawNixl = raw) -> None:
                    # A read grant as a reader caches it (from the read endpoint; a hand-off embeds one).
                    # A new dict each time: a grant is immutable (the reader caches its parse by identity).
                    raw.refresh()
                    status, body = src.request("POST", f"/v1/objects/{o}/reads", {"reader": "bench-grant"})
                    assert status == 200, body
                    src.request("DELETE", f"/v1/reads/{body.pop('readId')}")
                    grant[0] = body

                try:
                    per = interleaved(
                        {
                            "copy": copier(nbytes),
                            "raw": raw,
                            "fetch": lambda o=oid: rt.fetch(src.endpoint, o, token=reader_token),
                            "grant": lambda o=oid, g=grant: rt.fetch_granted_direct(src.endpoint, o, g[0]),
                        },
                        args.seconds,
                        args.rounds,
                        prepare=regrant,
                    )
                    if args.breakdown and nbytes == min(sizes):
                        breakdown(rt, src.endpoint, oid, grant[0], raw)
                finally:
                    raw.close()
                par = fetch_parallel(rt, src, oid, nbytes, args.seconds, reader_token)
                gbs = {name: nbytes / value / 1e9 for name, value in per.items()}
                rows.append((nbytes, gbs["copy"], gbs["raw"], gbs["fetch"], per["fetch"] * 1e3, par, gbs["grant"], per))
                src.request("POST", f"/v1/objects/{oid}/free", {})
                print(f"  measured {label(nbytes)}", file=sys.stderr, flush=True)
        finally:
            rt.stop()
            src.stop()
            src.close()
        ray = ray_rdt(sizes, args.seconds) if not args.no_ray else "skipped (--no-ray)"

    load_end = os.getloadavg()
    print(
        f"\nfetch throughput, GB/s (1 GB = 1e9 B), two processes on {os.cpu_count()} CPUs, "
        f"UCX_TLS={os.environ.get('UCX_TLS', 'default')}, source THP {'on' if args.thp else 'off'}; load (1/5/15 min) "
        f"{'/'.join(f'{v:.2f}' for v in load_start)} at start, {'/'.join(f'{v:.2f}' for v in load_end)} at end"
    )
    head = (
        f"{'size':>8} | {'torch copy':>10} | {'raw NIXL':>8} | {'raw us':>7} | {'raw/copy':>8} | {'fetch':>7} | "
        f"{'fetch ms':>8} | {'fetch/raw':>9} | {'fetch x4':>8} | {'x4/raw':>6} | {'grant':>7} | {'grant us':>8} | "
        f"{'grant/raw':>9}"
    )
    if isinstance(ray, dict):
        head += f" | {'Ray RDT':>7} | {'fetch/Ray':>9}"
    print(head)
    print("-" * len(head))
    for nbytes, copy, raw, seq, ms, par, grant, per in rows:
        line = (
            f"{label(nbytes):>8} | {copy:10.2f} | {raw:8.2f} | {per['raw'] * 1e6:7.1f} | {raw / copy:8.0%} | "
            f"{seq:7.2f} | {ms:8.3f} | {seq / raw:9.0%} | {par:8.2f} | {par / raw:6.0%} | {grant:7.2f} | "
            f"{per['grant'] * 1e6:8.1f} | {grant / raw:9.0%}"
        )
        if isinstance(ray, dict):
            line += f" | {ray[nbytes]:7.2f} | {seq / ray[nbytes]:9.1f}x"
        print(line)
    if not isinstance(ray, dict):
        print(f"Ray RDT column: {ray}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
