"""What fencing a pooled state-dict version costs: put, fetch and free of a pack buffer reused every version.

One source agent and one reader agent in this process (real NIXL), the client's pack pool (one buffer,
reused by every version). Per size, two loops of `--cycles` versions:
- read: put the version, fetch it twice (the first read of the version's own NIXL agent, the second
  again), free it. Every version was seen by a reader, so its free destroys its NIXL agent before the
  buffer is handed back (the fence); the agent then registers the buffer, in the background, in a spare
  agent whose connection info the reader was handed with the version before and connected to after its
  read (docs/weight-sync.md, "The spare, announced"): the next put registers nothing, and its first fetch
  makes no new connection.
- unread: put, free, with no reader: the region stays parked in its agent, the next put registers nothing
  (what every version cost before the fence, when the region was reused under the key readers held).
Reported: p50/p99 of each call in ms; NIXL registrations per version on the put's path and ahead of it (in
the spare, after the free before), apart; and the share of first fetches that found their agent connected.

Usage: .venv/bin/python bench/pooled_fence.py [--sizes 65536,16777216,100663296] [--cycles 30]
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpuobj.client.state_dicts import PackPool, plan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._agents import reader_token, runtime_factory  # noqa: E402  (the shared in-process agents)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cell(values: list[float]) -> str:
    if not values:
        return f"{'-':>17}"
    return f"{statistics.median(values) * 1e3:8.2f} {pct(values, 0.99) * 1e3:8.2f}"


def quiet(rt) -> dict:
    """The agent's stats once no registration ahead is under way (it runs after a free, in the background)."""
    deadline = time.monotonic() + 30
    while (stats := rt.stats()).get("registeringAhead") and time.monotonic() < deadline:
        time.sleep(0.005)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=f"{64 << 10},{16 << 20},{96 << 20}")
    parser.add_argument("--cycles", type=int, default=30)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runtime, token = runtime_factory(tmp), reader_token()

        src, dst = runtime("src"), runtime("dst")
        try:
            for size in (int(s) for s in args.sizes.split(",")):
                pool = PackPool()
                for mode in ("read", "unread"):
                    t: dict[str, list[float]] = {"put": [], "fetch1": [], "fetch2": [], "free": []}
                    before = quiet(src)
                    hits_before = dst.stats()["preconnectedReads"]
                    for i in range(args.cycles):
                        sd = {"w": torch.full((size // 4,), float(i), dtype=torch.float32)}
                        p = plan(sd)
                        oid = f"{mode}-{size}-{i}"
                        t0 = time.perf_counter()
                        pack = pool.take(p)
                        pack.fill(p)
                        src.put(oid, pack.views, on_release=pool.returner(pack))
                        t["put"].append(time.perf_counter() - t0)
                        if mode == "read":
                            for n in ("fetch1", "fetch2"):
                                t0 = time.perf_counter()
                                [got] = dst.fetch(src.endpoint, oid, token=token)
                                t[n].append(time.perf_counter() - t0)
                                assert got[0].item() == float(i)
                                del got
                            gc.collect()
                        t0 = time.perf_counter()
                        freed = src.free(oid)
                        t["free"].append(time.perf_counter() - t0)
                        assert freed["freed"] and freed["fenced"], freed
                    after = quiet(src)
                    regs = (after["registrations"] - before["registrations"]) / args.cycles
                    fences = (after["pooledFences"] - before["pooledFences"]) / args.cycles
                    ahead = (after["registrationsAhead"] - before["registrationsAhead"]) / args.cycles
                    hits = (dst.stats()["preconnectedReads"] - hits_before) / args.cycles
                    rows.append((size, mode, t, regs - ahead, ahead, hits, fences, pool.stats()["buffers"]))
                    print(f"  measured {size} B, {mode}", file=sys.stderr, flush=True)
        finally:
            dst.stop()
            src.stop()

    print("\npooled version costs (ms, p50 p99); one pack buffer reused by every version")
    print(
        f"{'bytes':>10} | {'mode':>6} | {'put':>17} | {'first fetch':>17} | {'fetch again':>17} | "
        f"{'free':>17} | reg/v | ahead/v | connected | fences/v | buffers"
    )
    for size, mode, t, regs, ahead, hits, fences, buffers in rows:
        print(
            f"{size:>10} | {mode:>6} | {cell(t['put'])} | {cell(t['fetch1'])} | {cell(t['fetch2'])} | "
            f"{cell(t['free'])} | {regs:5.2f} | {ahead:7.2f} | {hits:9.2f} | {fences:8.2f} | {buffers:7d}"
        )
    print("reg/v: registrations on the put's path; ahead/v: in the spare, off it; connected: first fetches")
    print("whose NIXL agent the reader had connected to ahead (from the announcement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
