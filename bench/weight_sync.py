"""Weight sync: a trainer publishes a real model's weights every step to rollout readers; gpuobj vs Ray RDT
vs raw NIXL, each side in its own subprocess, one table with ratios.

The model is a Qwen2 architecture built by transformers from a config with random initialisation
(gpuobj_dev.models): "small" (~46 M parameters, ~93 MB in bfloat16) and "large" (Qwen2-0.5B's shape,
~494 M parameters, ~988 MB, 290 tensors); and "many", 2,000 small tensors (~5.6 MB; an object holds at most
2,048), where per-tensor costs show. Per size and reader count (1, 2, 4) the trainer publishes
--versions versions, changing every weight each step; every reader fetches every version, verifies it
(gpuobj_dev.models.checksum: names, shapes, dtypes and sampled bytes, the same function on every side)
and releases the previous one.

- gpuobj: real control plane, operator and workload processes as their ServiceAccounts. The trainer
  `put`s its state_dict (one object per version, packed into a pooled registered region) and shares
  it with each reader (a claim that dies with the reader's process); it releases its own reference to
  the previous version; each reader adopts, fetches, verifies, then releases the version before.
- Ray 2.60 RDT, the documented way: a trainer actor whose method returns the state dict with
  ``tensor_transport="nixl"``, rollout actors (``enable_tensor_transport=True``) that receive the ref as
  an argument and keep the version until the next one, the driver dropping each version's ref.
- raw NIXL: the same bytes, one READ of pre-registered memory, between the trainer and the first
  reader process (no control plane at all; gpuobj_dev.raw_nixl, as the demo's): the ceiling for one
  reader. The floor of a version is pack (the trainer's put) + that READ; each row prints its parts and
  its ratio to it (`floor_ratio_max`, the worst row's; the target is 1.3).
- gpuobj sharded (TP=2, with 2 or more reader processes): two readers each fetch half of every tensor
  that splits along dim 0, the rest whole (`fetch(select=gpuobj.Shard(...))`, docs/weight-sync.md),
  verified against the trainer's `torch.chunk`; `sharded_bytes_ratio` is the bytes NIXL moved for one
  reader over the model's bytes (0.5 when every tensor splits).

Printed per row: median time from the publish call to every reader holding the version (each reader then
verifies it, outside the timed span on every side: the floor's READ is not checksummed either),
fetch GB/s per reader, NIXL registrations per version in the trainer after the second version: on the
version's path (its put; the target is 0) and, apart, those made ahead in a spare agent after the free of
the version before (docs/weight-sync.md), the share of first fetches whose source agent the reader had
connected to ahead, deregistrations per version, and the trainer's peak bytes (its pack buffers) in
versions. The machine's load is printed. A benchmark, not a test: nothing here asserts a timing.

    make bench
    .venv/bin/python bench/weight_sync.py [--small] [--readers 1 2 4] [--versions 10] [--no-ray] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._cluster import BenchCluster, load, ray_init, settle  # noqa: E402  (the shared start-up)
from gpuobj_dev import models  # noqa: E402  (its sizes; transformers is only imported to build one)

TRAINER_SETUP = r"""
import time
from gpuobj_dev import models, raw_nixl
nixl = client.agent.agent.nixl
ledger = nixl.ledger
mine = None

def counts():
    # registrations on a put's path (the total less those made ahead, in a spare after the free before),
    # deregistrations, and those made ahead
    return [ledger.registrations - nixl.registered_ahead, ledger.deregistrations, nixl.registered_ahead]

def build(size):
    global model
    model = models.build(size)
    sd = model.state_dict()
    from gpuobj.client.state_dicts import plan
    return [plan(sd).nbytes, len(sd)]  # tied tensors once, as stored

def publish(version, readers):
    global mine
    models.step(model, version)
    sd = model.state_dict()
    crc = models.checksum(sd)
    regs = counts()
    before = client.pack_stats()
    t0 = time.monotonic()
    ref = client.put(sd)
    put_s = time.monotonic() - t0
    shares = [dump_pickle(client.share(ref, name, incarnation=inc)) for name, inc in readers]
    announce_s = time.monotonic() - t0  # publish to every reader told: the put and the shares
    old, mine = mine, ref
    if old is not None:
        client.release(old)
    after = client.pack_stats()
    # the per-step breakdown: did this put reuse a buffer, wait for a version's free, or make a new one
    step = {"put_s": put_s, "new_buffer": after["buffers"] > before["buffers"],
            "waited_s": after["waitSeconds"] - before["waitSeconds"],
            "wait_ran_out": after["waitTimeouts"] > before["waitTimeouts"], "idle_before": before["idle"],
            "announce_s": announce_s}
    return [t0, crc, shares, regs, step]

def finish():
    global mine
    if mine is not None:
        mine.release()
        mine = None
    client.flush()
    return [counts(), client.pack_stats()]

def shard_names():
    # the tensors a TP=2 reader slices along dim 0 (the rest it reads whole): every one that splits evenly
    return [n for n, t in model.state_dict().items() if t.dim() >= 1 and t.shape[0] % 2 == 0]

def shard_crc(rank, count):
    import torch
    sd, rows = model.state_dict(), set(shard_names())
    return models.checksum({n: torch.chunk(t, count, 0)[rank] if n in rows else t for n, t in sd.items()})

def raw_source(nbytes):
    # the floor's source (gpuobj_dev.raw_nixl, as the demo's): the same bytes registered once, until closed
    global raw
    raw = raw_nixl.RawSource(nbytes, name="bench-raw-src")
    return dump_pickle(raw.offer())

def raw_source_close():
    global raw
    raw.close()
    raw = None
"""

READER_SETUP = r"""
import time
from gpuobj_dev import models, raw_nixl
held = None

def take(shared, crc):
    global held
    h = client.adopt(load_pickle(shared))
    t = time.monotonic()
    fetcher = client.agent.agent.fetcher
    hits = fetcher.preconnected_reads
    sd = client.fetch(h)
    fetched = time.monotonic()
    connected = fetcher.preconnected_reads > hits  # its source agent was connected to ahead (announced)
    ok = models.checksum(sd) == crc  # verified, outside the timed span (as on Ray's side and the floor)
    old, held = held, (h, sd)
    if old is not None:
        client.release(old[0])  # returns once the source took the release (it may free the version now)
    del old
    return [ok, fetched - t, fetched, connected]

def take_shard(shared, crc, rows, rank, count):
    # a TP rank's pull: its half of every splittable tensor, the rest whole; returns the bytes NIXL moved
    import gpuobj
    global held
    h = client.adopt(load_pickle(shared))
    reader = client.agent.agent.fetcher.reader
    wire = reader.read_bytes
    t = time.monotonic()
    sd = client.fetch(h, select=gpuobj.Shard(names=rows, dim=0, index=rank, count=count))
    rest = [n for n, _ in h.address.entries if n not in set(rows)]
    if rest:
        sd |= client.fetch(h, select=gpuobj.Shard(names=rest))
    fetched = time.monotonic()
    ok = models.checksum({n: sd[n] for n, _ in h.address.entries}) == crc  # outside the timed span
    old, held = held, (h, sd)
    if old is not None:
        client.release(old[0])
    del old
    return [ok, fetched - t, fetched, reader.read_bytes - wire]

def drop():
    global held
    if held is not None:
        held[0].release()
        held = None
    client.flush()

def raw_read(offer, reads):
    return raw_nixl.read_seconds(*load_pickle(offer), reads=reads)  # connected first; the bytes verified
"""


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------ gpuobj + raw NIXL side


def gpuobj_side(args: argparse.Namespace) -> dict:
    out: dict = {"load_start": load(), "rows": {}, "raw": {}, "errors": []}
    env = {
        # One user's processes on one node, as Ray's actors here, which use UCX's cma: the same
        # transport on every side (off by default across tenants, docs/security.md).
        "GPUOBJ_ALLOW_CMA": "true",
        "GPUOBJ_WRITE_WINDOW": str(args.window),
        # A reader keeps two versions' landing buffers registered and faulted in (docs/weight-sync.md).
        "GPUOBJ_LANDING_IDLE_BYTES": str(args.landing_idle_bytes),
    }
    with BenchCluster(env=env) as bench:
        operator = bench.operator

        def start(name: str):  # type: ignore[no-untyped-def]
            return bench.start(name)[0]

        trainer = start("trainer")
        trainer.run(TRAINER_SETUP)
        readers = {f"rollout-{i}": start(f"rollout-{i}") for i in range(max(args.readers))}
        incarnations = {}
        for name, r in readers.items():
            r.run(READER_SETUP)
            incarnations[name] = r.eval("client.incarnation")
        for size in args.sizes:
            nbytes, tensors = trainer.eval(f"build({size!r})", timeout=600)
            out["rows"][size] = {"bytes": nbytes, "tensors": tensors, "by_readers": {}}
            # raw NIXL: the same bytes, one READ of pre-registered memory, trainer -> the first reader
            offer = trainer.eval(f"raw_source({nbytes})", timeout=300)
            times = readers["rollout-0"].eval(f"raw_read({offer!r}, 10)", timeout=600)
            trainer.run("raw_source_close()")
            out["raw"][size] = {"seconds": times, "gbs": nbytes / median(times) / 1e9}
            # The trainer's pool keeps the earlier models' buffers: this model's peak is what it adds.
            pool_base = trainer.eval("client.pack_stats()")["bytes"]
            for count in args.readers:
                names = list(readers)[:count]
                try:
                    row = version_loop(args, trainer, readers, names, incarnations, nbytes, pool_base)
                except Exception as exc:  # report it with what was measured (e.g. a process killed for memory)
                    out["errors"].append(f"{size} x{count}: {type(exc).__name__}: {str(exc)[:300]}")
                    break
                out["rows"][size]["by_readers"][str(count)] = row
                print(
                    f"# gpuobj {size} x{count}: {row['median_ms']:.1f} ms, {row['gbs_per_reader']:.2f} GB/s",
                    file=sys.stderr,
                    flush=True,
                )
            if len(readers) >= 2 and not out["errors"]:
                try:
                    out["rows"][size]["sharded"] = sharded_loop(args, trainer, readers, incarnations, nbytes)
                except Exception as exc:
                    out["errors"].append(f"{size} sharded: {type(exc).__name__}: {str(exc)[:300]}")
        out["leaked_bytes_end"] = leaked_end(operator) if not out["errors"] else None
        out["load_end"] = load()
        return out


def version_loop(args, trainer, readers, names, incarnations, nbytes, pool_base: int = 0) -> dict:
    """--versions versions to `names`; per version: publish -> every reader holding it (checked after), counts."""
    targets = [[n, incarnations[n]] for n in names]
    totals, fetch_s, regs, steps, verified = [], [], [], [], True
    for version in range(1, args.versions + 1):
        t0, crc, shares, counts, step = trainer.eval(f"publish({version}, {targets!r})", timeout=600)
        regs.append(counts)
        steps.append(step)
        results: dict[str, list] = {}

        def take(name: str, shared: str, crc: int = crc, results: dict = results) -> None:
            results[name] = readers[name].eval(f"take({shared!r}, {crc})", timeout=600)

        threads = [threading.Thread(target=take, args=(n, s)) for n, s in zip(names, shares, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(results) != len(names):
            raise RuntimeError(f"version {version}: {len(names) - len(results)} reader(s) failed")
        verified = verified and all(r[0] for r in results.values())
        totals.append(max(r[2] for r in results.values()) - t0)
        fetch_s.extend(r[1] for r in results.values())
        step["fetch_s"] = [r[1] for r in results.values()]
        step["connected_ahead"] = [r[3] for r in results.values()]
        step["verified_s"] = max(r[2] for r in results.values()) - t0
    for n in names:
        readers[n].run("drop()")
    end, pool = trainer.eval("finish()")
    regs.append(end)
    # Per version after the second: from the third publish to the end of the run.
    later = max(1, len(regs) - 3)
    return {
        "median_ms": median(totals) * 1000,
        "publish_to_verified_ms": [x * 1000 for x in totals],
        "gbs_per_reader": nbytes / median(fetch_s) / 1e9,
        # on a version's path only; those made ahead in a spare (after the free before) apart
        "registrations_per_version_after_second": (regs[-1][0] - regs[2][0]) / later,
        "registrations_ahead_per_version_after_second": (regs[-1][2] - regs[2][2]) / later,
        # first fetches (after the second version) whose source NIXL agent the reader had connected to ahead
        "fetches_connected_ahead": sum(sum(st["connected_ahead"]) for st in steps[2:])
        / max(1, sum(len(st["connected_ahead"]) for st in steps[2:])),
        "deregistrations_per_version_after_second": (regs[-1][1] - regs[2][1]) / later,
        "registrations_total": regs[-1][0] - regs[0][0],
        "steps": steps,  # per version: put time, new buffer or reused, wait for a free, fetch times
        "pack_waits": pool["waits"],
        "trainer_peak_bytes": pool["bytes"] - pool_base,  # this model's pack buffers (the pool never shrinks)
        "trainer_peak_versions": (pool["bytes"] - pool_base) / nbytes,
        "bytes_verified": verified,
    }


def sharded_loop(args, trainer, readers, incarnations, nbytes) -> dict:
    """TP=2: two readers each pull half of every tensor that splits along dim 0 (the rest whole), per version."""
    names = list(readers)[:2]
    targets = [[n, incarnations[n]] for n in names]
    rows = trainer.eval("shard_names()")
    totals, fetch_s, moved, verified = [], [], [], True
    for version in range(1, args.versions + 1):
        t0, _, shares, _, _ = trainer.eval(f"publish({version}, {targets!r})", timeout=600)
        crcs = [trainer.eval(f"shard_crc({rank}, 2)", timeout=600) for rank in range(2)]
        results: dict[str, list] = {}

        def take(rank: int, shared: str, results: dict = results, crcs: list = crcs) -> None:
            name = names[rank]
            results[name] = readers[name].eval(
                f"take_shard({shared!r}, {crcs[rank]}, {rows!r}, {rank}, 2)", timeout=600
            )

        threads = [threading.Thread(target=take, args=(i, s)) for i, s in enumerate(shares)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(results) != 2:
            raise RuntimeError(f"sharded version {version}: a reader failed")
        verified = verified and all(r[0] for r in results.values())
        totals.append(max(r[2] for r in results.values()) - t0)
        fetch_s.extend(r[1] for r in results.values())
        moved.extend(r[3] for r in results.values())
    for n in names:
        readers[n].run("drop()")
    trainer.eval("finish()")
    return {
        "median_ms": median(totals) * 1000,
        "slowest_fetch_ms": max(fetch_s) * 1000,
        "bytes_moved_per_reader": median(moved),
        # bytes a half-shard reader moved / the model's bytes (0.5 plus half the unsplittable tensors' share)
        "sharded_bytes_ratio": median(moved) / nbytes,
        "bytes_verified": verified,
    }


def leaked_end(operator) -> float:
    """The operator's leaked bytes once everything is released (it counts after its settle time)."""
    deadline = time.monotonic() + 60
    value = operator.metric("gpuobj_leaked_bytes")
    while value and time.monotonic() < deadline:
        time.sleep(0.5)
        value = operator.metric("gpuobj_leaked_bytes")
    return value


# ------------------------------------------------------------------------------------------- Ray side


def ray_side(args: argparse.Namespace) -> dict:

    import ray

    from gpuobj_dev import models

    models.ensure_transformers()
    ray_init()
    out: dict = {"load_start": load(), "rows": {}, "errors": []}
    try:

        @ray.remote(num_cpus=0, enable_tensor_transport=True)
        class Trainer:
            def build(self, size: str) -> int:
                from gpuobj_dev import models

                self.models = models
                self.model = models.build(size)
                return 0

            def step(self, version: int) -> int:
                self.models.step(self.model, version)
                return self.models.checksum(self.model.state_dict())

            @ray.method(tensor_transport="nixl")
            def state(self):
                return self.model.state_dict()

        @ray.remote(num_cpus=0, enable_tensor_transport=True)
        class Rollout:
            def __init__(self) -> None:
                from gpuobj_dev import models

                models.ensure_transformers()
                self.models = models
                self.held = None

            def take(self, sd, crc: int) -> list:
                held = time.monotonic()  # the tensors are here; the check below is outside the timed span
                ok = self.models.checksum(sd) == crc
                self.held = sd  # keep this version until the next one (the previous one goes now)
                return [ok, held]

            def drop(self) -> None:
                self.held = None

        trainer = Trainer.remote()
        rollouts = [Rollout.remote() for _ in range(max(args.readers))]
        for size in args.sizes:
            ray.get(trainer.build.remote(size), timeout=600)
            row: dict = {"by_readers": {}}
            for count in args.readers:
                group = rollouts[:count]
                totals, verified = [], True
                try:
                    for version in range(1, args.versions + 1):
                        crc = ray.get(trainer.step.remote(version), timeout=600)
                        t0 = time.monotonic()
                        ref = trainer.state.remote()
                        answers = ray.get([r.take.remote(ref, crc) for r in group], timeout=600)
                        del ref  # the driver drops the version's ref
                        verified = verified and all(a[0] for a in answers)
                        totals.append(max(a[1] for a in answers) - t0)
                    ray.get([r.drop.remote() for r in group], timeout=120)
                except Exception as exc:  # report it; keep what was measured
                    out["errors"].append(f"{size} x{count}: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                row["by_readers"][str(count)] = {
                    "median_ms": median(totals) * 1000,
                    "publish_to_verified_ms": [x * 1000 for x in totals],
                    "bytes_verified": verified,
                }
                print(f"# ray {size} x{count}: {median(totals) * 1000:.1f} ms", file=sys.stderr, flush=True)
            out["rows"][size] = row
        out["load_end"] = load()
        return out
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------------- driver


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


def print_steps(ours: dict) -> None:
    """Where gpuobj's median goes, per row (medians over versions, ms): the trainer's put (pack, plus a
    registration when the buffer is fresh), the part of it spent waiting for an earlier version's free, the
    slowest reader's fetch, and the rest (shares, adopt, verify, hand-off round trips)."""
    print("gpuobj per step, median ms: put (of it: waiting for a free) | slowest fetch | rest; new buffers")
    for size, row in ours["rows"].items():
        for count, r in row["by_readers"].items():
            steps = r.get("steps") or []
            if not steps:
                continue
            put = median([st["put_s"] for st in steps]) * 1e3
            wait = median([st["waited_s"] for st in steps]) * 1e3
            fetch = median([max(st["fetch_s"]) for st in steps]) * 1e3
            rest = median([st["verified_s"] - st["put_s"] - max(st["fetch_s"]) for st in steps]) * 1e3
            fresh = sum(1 for st in steps if st["new_buffer"])
            ran_out = sum(1 for st in steps if st["wait_ran_out"])
            print(
                f"  {size:>6} x{count}: put {put:7.1f} (wait {wait:6.1f}) | fetch {fetch:7.1f} | rest {rest:7.1f}; "
                f"{fresh} new buffers, {ran_out} waits ran out, of {len(steps)} versions"
            )


def floor_ratios(ours: dict) -> dict[str, float]:
    """Per row, the median version against its floor (pack + one raw NIXL READ of the same bytes, this run):
    printed with its parts, medians over versions in ms; returns {row: ratio}.

    Pack is the trainer's put less its wait for an earlier version's free (printed apart): the copy and what
    the put does around it, not the control plane's pace, which a training step longer than this loop's hides."""
    print(
        "gpuobj vs the floor, median ms per version: pack (the trainer's put less its wait for a free) | wait |"
        " publish to announce (put and shares) | slowest fetch | raw READ | floor = pack + raw READ |"
        " publish to every reader holding it (verified after, untimed) | ratio"
    )
    ratios = {}
    for size, row in ours["rows"].items():
        raw = median(ours["raw"][size]["seconds"]) * 1e3
        for count, r in row["by_readers"].items():
            steps = r.get("steps") or []
            if not steps:
                continue
            pack = median([st["put_s"] - st["waited_s"] for st in steps]) * 1e3
            wait = median([st["waited_s"] for st in steps]) * 1e3
            announce = median([st["announce_s"] for st in steps]) * 1e3
            fetch = median([max(st["fetch_s"]) for st in steps]) * 1e3
            floor = pack + raw
            ratios[f"{size} x{count}"] = ratio = r["median_ms"] / floor
            print(
                f"  {size:>6} x{count} ({row['tensors']} tensors): pack {pack:7.2f} | wait {wait:7.2f} | "
                f"announce {announce:7.2f} | "
                f"fetch {fetch:7.2f} | raw {raw:7.2f} | floor {floor:7.2f} | total {r['median_ms']:7.2f} | "
                f"{ratio:5.2f}x"
            )
    return ratios


def summarize(ray: dict | str, ours: dict | str, args: argparse.Namespace) -> dict:
    """The table, and the figures --json writes."""
    print()
    for name, side in (("Ray RDT", ray), ("gpuobj", ours)):
        if isinstance(side, dict):
            print(f"{name}: load (1/5/15 min) {side['load_start']} at start, {side['load_end']} at end")
            for error in side.get("errors", []):
                print(f"  {name} failed: {error}")
        else:
            print(f"{name}: {side}")
    figures: dict = {"ray": ray, "gpuobj": ours, "args": vars(args)}
    if not isinstance(ours, dict):
        return figures
    head = (
        f"{'model':>6} | {'MB':>6} | {'tensors':>7} | {'readers':>7} | {'gpuobj ms':>9} | {'GB/s/reader':>11} | "
        f"{'raw GB/s':>8} | {'vs raw':>6} | {'Ray ms':>8} | {'vs Ray':>6} | {'reg/v':>5} | {'ahead/v':>7} | "
        f"{'conn':>4} | {'dereg/v':>7} | {'peak v':>6}"
    )
    print(head)
    print("-" * len(head))
    ratios, regs, peaks, verified = [], [], [], True
    for size, row in ours["rows"].items():
        raw = ours["raw"][size]["gbs"]
        for count, r in row["by_readers"].items():
            ray_row = ray["rows"].get(size, {}).get("by_readers", {}).get(count) if isinstance(ray, dict) else None
            ratio = ray_row["median_ms"] / r["median_ms"] if ray_row else None
            if ratio is not None:
                ratios.append(ratio)
                verified = verified and ray_row["bytes_verified"]
            regs.append(r["registrations_per_version_after_second"])
            peaks.append(r["trainer_peak_versions"])
            verified = verified and r["bytes_verified"]
            print(
                f"{size:>6} | {row['bytes'] / 1e6:6.0f} | {row['tensors']:7d} | {count:>7} | {r['median_ms']:9.1f} | "
                f"{r['gbs_per_reader']:11.2f} | {raw:8.2f} | {r['gbs_per_reader'] / raw:6.0%} | "
                + (f"{ray_row['median_ms']:8.1f} | {ratio:5.2f}x" if ray_row else f"{'-':>8} | {'-':>6}")
                + f" | {r['registrations_per_version_after_second']:5.2f} | "
                f"{r['registrations_ahead_per_version_after_second']:7.2f} | {r['fetches_connected_ahead']:4.0%} | "
                f"{r['deregistrations_per_version_after_second']:7.2f} | {r['trainer_peak_versions']:6.1f}"
            )
    print(
        "reg/v: registrations on a version's path (its put), after the second version; ahead/v: registered in"
        " a spare agent ahead of the put, off its path; conn: first fetches that found their source agent"
        " connected ahead"
    )
    print_steps(ours)
    floors = floor_ratios(ours)
    sharded = {size: row["sharded"] for size, row in ours["rows"].items() if "sharded" in row}
    for size, r in sharded.items():
        verified = verified and r["bytes_verified"]
        print(
            f"sharded {size} (TP=2, 2 readers each pulling half): {r['median_ms']:.1f} ms per version, "
            f"bytes moved per reader / full bytes {r['sharded_bytes_ratio']:.3f}, bytes verified {r['bytes_verified']}"
        )
    large = "large" if "large" in ours["rows"] else None
    one = ours["rows"][large]["by_readers"].get("1") if large else None
    figures.update(
        {
            "min_ratio_vs_ray": min(ratios) if ratios else None,
            "raw_ratio_one_reader_large": one["gbs_per_reader"] / ours["raw"][large]["gbs"] if one else None,
            "registrations_per_version_after_second": max(regs) if regs else None,
            "trainer_peak_versions": max(peaks) if peaks else None,
            "bytes_verified": verified,
            "leaked_bytes_end": ours.get("leaked_bytes_end"),
            "sharded_bytes_ratio": max((r["sharded_bytes_ratio"] for r in sharded.values()), default=None),
            # the worst row's median version over its floor (pack + one raw READ); the target is <= 1.3
            "floor_ratio_max": max(floors.values(), default=None),
            "floor_ratios": floors,
        }
    )
    print(
        "min ratio vs Ray {min_ratio_vs_ray}, one reader vs raw NIXL (large) {raw_ratio_one_reader_large}, "
        "registrations per version after the second {registrations_per_version_after_second}, trainer peak "
        "{trainer_peak_versions} versions, bytes verified {bytes_verified}, leaked bytes at the end "
        "{leaked_bytes_end}, worst ratio to the floor {floor_ratio_max}".format(**figures)
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="only the ~50 M-parameter model")
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["small", "large", "many"],
        choices=models.SIZES,
        help="models (gpuobj_dev.models): tiny, small, large (Qwen2 shapes); many (2,000 small tensors, ~5.6 MB)",
    )
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument(
        "--window",
        type=float,
        default=0.1,
        help="gpuobj's write-behind window, seconds: a version freed within it is never recorded and is freed "
        "locally at its last release; one that outlives it is freed by the operator (docs/write-behind.md)",
    )
    parser.add_argument(
        "--landing-idle-bytes", type=int, default=2 << 30, help="readers' idle landing memory kept registered"
    )
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray RDT side")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--settle", type=float, default=1.5, help="wait for the 1-minute load below this (0: don't)")
    parser.add_argument("--side", choices=["ray", "gpuobj"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small:
        args.sizes = ["small"]
    if args.side:
        result = ray_side(args) if args.side == "ray" else gpuobj_side(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    models.ensure_transformers()  # once, before either side starts (a cached folder afterwards)
    passthrough = [
        "--sizes", *args.sizes, "--readers", *map(str, args.readers), "--versions", str(args.versions),
        "--window", str(args.window), "--landing-idle-bytes", str(args.landing_idle_bytes),
    ]  # fmt: skip
    print(f"# {os.cpu_count()} CPUs, load {load()} before the run", flush=True)
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
    figures = summarize(ray, ours, args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if isinstance(ours, dict) else 1


if __name__ == "__main__":
    sys.exit(main())
