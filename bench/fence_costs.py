"""What fencing costs: free latency, fence latency and rotation cost, with many live objects.

One source agent and one reader agent in this process (real NIXL). For each population of
live objects (default 1,000 and 10,000 tensors of 4 KiB) it runs put -> fetch -> free
cycles on top of that population and reports:
- free latency (the `free` call, p50/p99): objects a reader saw and objects none saw;
- fence latency (free -> memory released, i.e. the NIXL agent that exposed it destroyed),
  from the agent's gpuobj_agent_quarantine_seconds samples;
- a forced rotation with the whole population migrated (free with wait_fence=True).
Targets from docs/design.md ("Performance targets"): free p50 < 20 ms, p99 < 100 ms; 10,000 live objects must not make
each free O(N).

Usage: .venv/bin/python bench/fence_costs.py [--populations 1000,10000] [--cycles 300]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._agents import reader_token, runtime_factory  # noqa: E402  (the shared in-process agents)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ms(v: float) -> str:
    return f"{v * 1e3:8.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--populations", default="1000,10000")
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runtime, token = runtime_factory(tmp), reader_token()

        for population in (int(p) for p in args.populations.split(",")):
            src, dst = runtime("src"), runtime("dst")
            try:
                live = [torch.full((1024,), i, dtype=torch.float32) for i in range(population)]
                t0 = time.perf_counter()
                for i, t in enumerate(live):
                    src.put(f"live-{i}", [t])
                put_each = (time.perf_counter() - t0) / population
                seen, unseen = [], []
                for i in range(args.cycles):
                    src.put(f"c-{i}", [torch.ones(1024)])
                    exposed = i % 2 == 0
                    if exposed:
                        dst.fetch(src.endpoint, f"c-{i}", token=token)
                    t0 = time.perf_counter()
                    src.free(f"c-{i}")
                    (seen if exposed else unseen).append(time.perf_counter() - t0)
                dst.fetch(src.endpoint, "live-0", token=token)
                t0 = time.perf_counter()
                result = src.free("live-0", wait_fence=True)
                forced = time.perf_counter() - t0
                assert result["fenced"], result
                hist = src.agent.metrics.quarantine_seconds.collect()[0].samples
                count = next(s.value for s in hist if s.name.endswith("_count"))
                total = next(s.value for s in hist if s.name.endswith("_sum"))
                stats = src.stats()
                rows.append((population, put_each, seen, unseen, forced, count, total, stats["rotations"]))
                for i in range(1, population):
                    src.free(f"live-{i}")
            finally:
                dst.stop()
                src.stop()
            print(f"  measured {population} live objects", file=sys.stderr, flush=True)

    print("\nfence costs (ms); free = the free call from the workload thread, objects of 4 KiB")
    print(
        f"{'live':>6} | {'put':>6} | {'free seen p50':>13} | {'p99':>8} | {'free unseen p50':>15} | {'p99':>8} | "
        f"{'fence mean':>10} | {'rotations':>9} | {'forced rotation+migrate+fence':>29}"
    )
    for population, put_each, seen, unseen, forced, count, total, rotations in rows:
        print(
            f"{population:>6} | {put_each * 1e3:6.3f} | {ms(statistics.median(seen)):>13} | {ms(pct(seen, 0.99))} | "
            f"{ms(statistics.median(unseen)):>15} | {ms(pct(unseen, 0.99))} | {ms(total / max(count, 1)):>10} | "
            f"{rotations:>9} | {ms(forced):>29}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
