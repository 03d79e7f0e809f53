"""The scale scenarios of one run, each measured on the same cluster: ramp, cold restart, idle, dead
holders, storm, recorded churn, audit at size, and the final tally (docs/scale.md).

Why functions over the harness: the benchmark runs them all at full size and prints their figures;
the e2e test runs the same code small and asserts what each must do (nothing freed by a restart,
everything a storm should free freed and nothing else, liveness within its budget). Every wait is
bounded and says what it waited for when it runs out.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuobj_contract import names
from gpuobj_dev.scale import apimetrics
from gpuobj_dev.scale.fleet import OBJECT_BYTES, FleetPod, Key
from gpuobj_dev.scale.harness import ScaleHarness, rss_mib
from gpuobj_kube.client import CLAIMS, GPUOBJECTS
from gpuobj_operator.free_path import is_marker

Progress = Callable[[str], None]
OPERATOR_GROUPS = frozenset({"gpuobj.io"})
OPERATOR_RESOURCES = frozenset({"events", "pods"})


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def scrape(h: ScaleHarness) -> apimetrics.ApiSnapshot:
    return await asyncio.to_thread(apimetrics.scrape, h.handle)


async def wait_freed(h: ScaleHarness, keys: list[Key], timeout: float, what: str, progress: Progress | None = None):
    """Until none of `keys` is held by a live agent any more; returns the keys still held at the deadline."""
    assert h.fleet is not None
    deadline = time.monotonic() + timeout
    last = 0.0
    while True:
        left = h.fleet.unfreed(keys)
        if not left:
            return []
        now = time.monotonic()
        if now > deadline:
            return left
        if progress and now - last > 10:
            progress(f"{what}: {len(keys) - len(left)}/{len(keys)} freed")
            last = now
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------- ramp


@dataclass
class Ramp:
    pods: int
    objects: int
    claims: int
    pods_running_s: float
    created_per_s: float
    api_writes_per_object: float
    writes_by_resource: dict[str, float] = field(default_factory=dict)  # per object
    private_objects: int = 0
    shared_objects: int = 0
    api_writes_per_private_object: float | None = None  # object writes (apimetrics.object_writes) per object
    api_writes_per_shared_object: float | None = None
    private_writes_by_resource: dict[str, float] = field(default_factory=dict)  # per private object
    shared_writes_by_resource: dict[str, float] = field(default_factory=dict)  # per shared object
    shared_refused_per_object: float | None = None  # of api_writes_per_shared_object: answered non-2xx
    statuses_settled_s: float | None = None  # after the shared objects' writes landed
    seconds: float = 0.0  # pods created to every status settled
    private_s: float = 0.0  # the private puts
    shared_s: float = 0.0  # the shared puts, until their writes landed
    fleet_rss_mib: tuple[float, float] = (0.0, 0.0)  # the fleet process, agents up / every object put
    shared_writes_by_answer: dict[str, float] = field(default_factory=dict)  # per shared object, "VERB res code"
    pacing: dict[str, float] = field(default_factory=dict)  # the fleet write budget's pacing (Fleet.pacing)


async def ramp(
    h: ScaleHarness,
    pods: int,
    objects_per_pod: int,
    progress: Progress,
    *,
    shared_per_pod: int | None = None,
    settle_timeout: float | None = None,
) -> Ramp:
    """`pods` pods on the kwok nodes, each putting `objects_per_pod` objects that live through the run:
    `shared_per_pod` of them (all when None) handed off to the next pod, which holds them by its claim
    (the producer drops its own reference), the rest kept by their producer and shared with no one.

    The two classes go in two phases, the private puts first, and each phase is charged the object writes
    (gpuobj.io resources and Events, every client) the API server counted from its start until its writes
    landed; with `settle_timeout` the shared phase also waits for every status the operator will write, so
    its figure includes them. A private object's late write would land in the shared phase: the private
    figure cannot hide one."""
    fleet = h.fleet
    assert fleet is not None
    shared_n = objects_per_pod if shared_per_pod is None else max(0, min(shared_per_pod, objects_per_pod))
    private_n = objects_per_pod - shared_n
    t0 = time.monotonic()
    made = await fleet.create_pods(pods)
    await fleet.wait_running(
        made, timeout=max(120.0, pods * 0.5), progress=lambda n, of: progress(f"pods Running {n}/{of}")
    )
    running_s = time.monotonic() - t0
    progress(f"{pods} pods Running with pod IPs in {running_s:.1f}s; starting their agents")
    await fleet.start_agents(made, progress=lambda n, of: progress(f"agents up {n}/{of}") if n % 100 == 0 else None)
    total = pods * objects_per_pod
    done = 0
    sem = asyncio.Semaphore(64)

    async def private(pod: FleetPod) -> None:
        nonlocal done
        async with sem:
            for _ in range(private_n):
                await fleet.put(pod)
                done += 1

    async def shared(i: int, pod: FleetPod) -> None:
        nonlocal done
        holder = made[(i + 1) % len(made)]
        async with sem:
            for k in range(shared_n):
                # Unnamed under the policy "shared", so the object is private until this share makes it shared.
                await fleet.put_shared(pod, holder, None if fleet.record == "shared" else f"{pod.name}-{k}")
                done += 1

    async def report() -> None:
        while True:
            await asyncio.sleep(15)
            pending = sum(p.core.wb.pending_writes for p in made if p.core is not None and p.core.wb is not None)
            progress(f"put {done}/{total} ({private_n} private, {shared_n} shared a pod), {pending} writes queued")

    flush_timeout = max(600.0, total * 0.05)
    rss0 = rss_mib(os.getpid())
    before = await scrape(h)
    t1 = time.monotonic()
    reporter = asyncio.create_task(report())
    try:
        if private_n:
            await asyncio.gather(*(private(p) for p in made))
            await fleet.flush(timeout=flush_timeout)
        private_s = time.monotonic() - t1
        middle = await scrape(h)
        t2 = time.monotonic()
        if shared_n:
            await asyncio.gather(*(shared(i, p) for i, p in enumerate(made)))
            progress("waiting for the write-behind queues to land")
            await fleet.flush(timeout=flush_timeout)
    finally:
        reporter.cancel()
    elapsed = time.monotonic() - t1
    shared_s = time.monotonic() - t2
    settled = await statuses_settled(h, settle_timeout, progress) if settle_timeout and shared_n else None
    after = await scrape(h)
    claims = sum(len(p.claims) for p in made)
    window, private_w, shared_w = after.minus(before), middle.minus(before), after.minus(middle)
    n_private, n_shared = pods * private_n, pods * shared_n
    return Ramp(
        pods,
        total,
        claims,
        running_s,
        total / elapsed,
        window.writes() / max(1, total),
        {k: v / max(1, total) for k, v in window.writes_by_resource().items()},
        n_private,
        n_shared,
        apimetrics.per_object(private_w.object_writes(), n_private),
        apimetrics.per_object(shared_w.object_writes(), n_shared),
        {k: v / max(1, n_private) for k, v in private_w.object_writes_by_resource().items()},
        {k: v / max(1, n_shared) for k, v in shared_w.object_writes_by_resource().items()},
        apimetrics.per_object(shared_w.object_writes_refused(), n_shared),
        settled,
        time.monotonic() - t0,
        private_s,
        shared_s,
        (rss0, rss_mib(os.getpid())),
        {k: v / max(1, n_shared) for k, v in shared_w.object_writes_by_answer().items()},
        fleet.pacing(),
    )


# ---------------------------------------------------------------- live view


@dataclass
class LiveView:
    samples: int
    lag_p99_s: float | None
    lag_median_s: float | None
    unseen: int  # samples not listed within the timeout
    list_all_s: float
    listed: int
    expected: int  # objects the fleet's live agents hold as the list starts
    pages: int
    get_median_s: float | None = None  # one GET by name (the breakdown of the lag: the view's own time)
    get_p99_s: float | None = None


LIST_AFTER_S = 1.5  # longer than the live view's CACHE_SECONDS (1 s)


async def live_view(
    h: ScaleHarness, samples: int, progress: Progress, *, batch: int = 10, timeout: float = 30.0
) -> LiveView:
    """How soon a put is listed, and how long listing every live object takes (docs/live-view.md).

    Lag: `samples` new private objects, `batch` at a time on pods spread over the fleet; one reader asks for
    each not yet seen by name (`kubectl get liveobjects NAME`), one request at a time, as one user polling
    would, until the view has it; lag = from just before its put to the answer that listed it. (Ten readers
    at once measured their own load: each request reads the namespace's agents once their answers are
    older than the view's 1 s cache.) List: every live object across namespaces, page after page, against what the
    fleet's agents hold (the samples included), begun once every agent's cached answer is stale, so the time
    includes one read of every agent. The samples are released at the end (private: no write)."""
    from gpuobj_dev.scale.liveview import LiveViewClient, object_name

    fleet = h.fleet
    assert fleet is not None and h.live_view is not None
    alive = fleet.alive()
    step = max(1, len(alive) // max(1, samples))
    chosen = [alive[(i * step) % len(alive)] for i in range(samples)]
    lags: list[float] = []
    unseen = 0
    put: list[tuple[FleetPod, str]] = []
    gets: list[float] = []
    async with LiveViewClient(h.live_view) as view:

        async def sample(pod: FleetPod) -> tuple[str, float]:
            t0 = time.monotonic()
            ref = await fleet.put(pod)
            put.append((pod, ref.address.object_id))
            return object_name(pod.name, ref.address.object_id), t0

        try:
            for i in range(0, len(chosen), batch):
                waiting = dict(await asyncio.gather(*(sample(p) for p in chosen[i : i + batch])))
                while waiting:
                    for name, t0 in list(waiting.items()):
                        asked = time.monotonic()
                        listed_now = await view.has(h.namespace, name)
                        gets.append(time.monotonic() - asked)
                        if listed_now:
                            lags.append(time.monotonic() - t0)
                            del waiting[name]
                        elif time.monotonic() - t0 > timeout:
                            unseen += 1
                            del waiting[name]
                    await asyncio.sleep(0.05)
            progress(f"live view: {len(lags)}/{len(chosen)} samples listed, p99 {_fmt(p99(lags))} s")
            # The samples stay until everything is listed: nothing the view may still cache has gone.
            expected = len(fleet.held())
            # A list as a reader who did not just ask makes it: past the view's 1 s per-pod cache, so its
            # first page reads every agent (without this wait the gets above may have left them cached).
            await asyncio.sleep(LIST_AFTER_S)
            listed, pages, seconds = await view.list_all()
        finally:
            for pod, object_id in put:
                if pod.alive and object_id in pod.owned:
                    await fleet.release_owner(pod, object_id)
    progress(f"live view: listed {listed} objects ({expected} held) in {pages} pages, {seconds:.2f}s")
    return LiveView(
        len(chosen),
        p99(lags),
        statistics.median(lags) if lags else None,
        unseen,
        seconds,
        listed,
        expected,
        pages,
        statistics.median(gets) if gets else None,
        p99(gets),
    )


# ---------------------------------------------------------------- cold restart


@dataclass
class Restart:
    synced_s: float
    audited_s: float | None
    rss_mib: float
    frees: int
    operator_frees: float


async def cold_restart(h: ScaleHarness, progress: Progress, timeout: float = 600) -> Restart:
    """SIGKILL the operator, start a fresh one: time to synced, to every agent audited; frees (must be 0)."""
    fleet = h.fleet
    assert fleet is not None
    frees_before = fleet.frees
    await h.kill_operator()
    t0 = time.monotonic()
    op = h.new_operator()
    h.operator = op
    await asyncio.to_thread(op.start)
    await asyncio.to_thread(op.wait_for_line, r"synced:", timeout)
    synced = time.monotonic() - t0
    progress(f"restart: synced in {synced:.1f}s; waiting for every agent to be audited")
    pods = len(fleet.alive())
    audited: float | None = None
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        ok = await asyncio.to_thread(op.metric, "gpuobj_audit_runs_total", {"result": "ok"})
        if ok >= pods:
            audited = time.monotonic() - t0
            break
        await asyncio.sleep(0.5)
    rss = rss_mib(op.proc.pid)  # type: ignore[union-attr]
    operator_frees = await asyncio.to_thread(op.metric, "gpuobj_frees_total")
    return Restart(synced, audited, rss, fleet.frees - frees_before, operator_frees)


# ---------------------------------------------------------------- idle


@dataclass
class Idle:
    seconds: float
    operator_writes_per_min: float
    lease_writes_per_min: float
    all_writes_per_min: float
    liveness_per_pod_s: float
    info_requests: int
    operator_cpu_s: float
    writes_by_resource: dict[str, float] = field(default_factory=dict)  # per minute


async def statuses_settled(h: ScaleHarness, timeout: float, progress: Progress | None = None) -> float:
    """Until every status says what the operator will conclude (objects Ready, or Releasing once their
    owner let go, with their claim counts; claims Bound); returns the seconds it took. Idle means nothing
    left to do: the operator's status writes trail the ramp by as long as the API server needs for them."""
    t0 = time.monotonic()
    last = t0
    async with h.handle.client() as kube:
        while True:
            objects = (await kube.list(GPUOBJECTS, h.namespace))["items"]
            claims = [c for c in (await kube.list(CLAIMS, h.namespace))["items"] if not is_marker(c)]
            per_object = Counter(c["spec"]["objectName"] for c in claims)
            pending = [
                o["metadata"]["name"]
                for o in objects
                if (o.get("status") or {}).get("state")
                != (names.STATE_RELEASING if o["metadata"].get("deletionTimestamp") else names.STATE_READY)
                or (o.get("status") or {}).get("claims") != per_object[o["metadata"]["name"]]
            ] + [c["metadata"]["name"] for c in claims if (c.get("status") or {}).get("state") != "Bound"]
            now = time.monotonic()
            if not pending:
                return now - t0
            if now - t0 > timeout:
                first = next((o for o in objects if o["metadata"]["name"] == pending[0]), {})
                raise AssertionError(
                    f"{len(pending)} statuses not written in {timeout:g}s, e.g. {pending[:5]}; {pending[0]}:"
                    f" {first.get('status')}, {per_object[pending[0]]} claims name it"
                )
            if progress is not None and now - last >= 20:
                progress(f"statuses not yet written: {len(pending)} of {len(objects) + len(claims)}")
                last = now
            await asyncio.sleep(0.5 if len(objects) < 5000 else 5.0)


async def idle(h: ScaleHarness, seconds: float, progress: Progress) -> Idle:
    """Nothing changes for `seconds`: what the operator writes, and how often it probes each agent."""
    fleet = h.fleet
    assert fleet is not None
    before, info0, cpu0 = await scrape(h), fleet.info_requests, h.cpu()
    t0 = time.monotonic()
    while (left := seconds - (time.monotonic() - t0)) > 0:
        await asyncio.sleep(min(30.0, left))
        progress(f"idle {time.monotonic() - t0:.0f}/{seconds:.0f}s")
    elapsed = time.monotonic() - t0
    window = (await scrape(h)).minus(before)
    info = fleet.info_requests - info0
    used = h.cpu_used(cpu0, h.cpu())
    minutes = elapsed / 60
    return Idle(
        elapsed,
        window.writes(groups=OPERATOR_GROUPS, resources=OPERATOR_RESOURCES) / minutes,
        window.writes(resources=frozenset({"leases"})) / minutes,
        window.writes() / minutes,
        info / max(1, len(fleet.alive())) / elapsed,
        info,
        used.get("operator", 0.0),
        {k: v / minutes for k, v in window.writes_by_resource().items()},
    )


async def count_info(h: ScaleHarness, seconds: float) -> tuple[int, int]:
    """(/v1/info requests the fleet's agents answered over `seconds`, live pods)."""
    assert h.fleet is not None
    n0 = h.fleet.info_requests
    await asyncio.sleep(seconds)
    return h.fleet.info_requests - n0, len(h.fleet.alive())


# ---------------------------------------------------------------- dead holders


@dataclass
class DeadHolders:
    pods: int
    claims: int
    detect_p99_s: float | None
    detect_median_s: float | None
    undetected: int
    early_p99_s: float | None


async def dead_holders(h: ScaleHarness, count: int, progress: Progress, timeout: float = 180) -> DeadHolders:
    """Restart `count` holders' processes (new incarnation, restartCount + 1): time until what only their
    old processes held is freed at the source. Half of them die again within their first second, holding a
    claim made for the new process. Then their pods are deleted."""
    fleet = h.fleet
    assert fleet is not None
    alive = fleet.alive()
    step = max(1, len(alive) // max(1, count))
    victims = alive[::step][:count]
    victim_names = {p.name for p in victims}
    died_at: dict[Key, float] = {}
    for died, dropped in await asyncio.gather(*(fleet.restart(p) for p in victims)):
        for key in dropped:
            if key[0] not in victim_names:  # the source lives on (its own process did not restart)
                died_at[key] = died
    progress(f"dead holders: {len(victims)} processes restarted, {len(died_at)} claims to drop")
    early_at: dict[Key, float] = {}
    donors = [p for p in fleet.alive() if p.name not in victim_names]
    early = victims[: max(1, len(victims) // 2)]
    if donors:
        for i, pod in enumerate(early):
            donor = donors[i % len(donors)]
            key = await fleet.put_shared(donor, pod, f"{donor.name}-early-{pod.name}-{pod.restarts}")
            await fleet.flush([donor])
            died, _ = await fleet.restart(pod)
            early_at[key] = died
    keys = list(died_at) + list(early_at)
    left = await wait_freed(h, keys, timeout, "dead holders", progress)
    latencies = [fleet.freed_at[k] - t for k, t in died_at.items() if k in fleet.freed_at and fleet.freed_at[k] >= t]
    early_lat = [fleet.freed_at[k] - t for k, t in early_at.items() if k in fleet.freed_at and fleet.freed_at[k] >= t]
    await fleet.delete(victims)
    return DeadHolders(
        len(victims),
        len(keys),
        p99(latencies + early_lat),
        statistics.median(latencies) if latencies else None,
        len(left),
        p99(early_lat),
    )


# ---------------------------------------------------------------- storm


@dataclass
class Storm:
    pods: int
    referenced: int
    clean_s: float | None
    unfreed: int
    mutating_p99_s: float | None
    wrong_frees: int


async def storm(h: ScaleHarness, fraction: float, progress: Progress, timeout: float = 300) -> Storm:
    """Delete `fraction` of the pods at once; time until every byte they held or referenced is freed."""
    fleet = h.fleet
    assert fleet is not None
    alive = fleet.alive()
    count = max(1, round(len(alive) * fraction))
    step = max(1, len(alive) // count)
    victims = alive[1::step][:count]
    names_ = {p.name for p in victims}
    wrong0 = fleet.wrong_frees
    before = await scrape(h)
    t0 = time.monotonic()
    _, dropped = await fleet.delete(victims)
    keys = [k for k in dropped if k[0] not in names_]
    left = await wait_freed(h, keys, timeout, "storm", progress)
    clean = None if left else time.monotonic() - t0
    window = (await scrape(h)).minus(before)
    return Storm(len(victims), len(keys), clean, len(left), window.mutating_p99(), fleet.wrong_frees - wrong0)


# ---------------------------------------------------------------- recorded churn


@dataclass
class ChurnStep:
    target_per_s: float
    # Lifecycles per second the cluster took: the lesser of the launch rate and the landed rate. Why both:
    # a write-behind's put returns before its writes land, and under a fleet write budget they wait for
    # their slots, so launches alone would count lifecycles the API server has not seen yet.
    achieved_per_s: float
    lifecycles: int
    mutating_p99_s: float | None
    writes_per_lifecycle: float  # object writes (apimetrics.object_writes): no Lease, node or pod write
    unfreed: int
    writes_by_resource: dict[str, float] = field(default_factory=dict)  # per lifecycle, every write
    seconds: float = 0.0  # the step's window, first launch to every object freed
    other_writes: float = 0.0  # the window's writes that are not object writes (Leases: kwok's, the operator's)
    late_max_s: float = 0.0  # the launcher's worst lateness against its schedule
    late_p99_s: float = 0.0
    pacing: dict[str, float] = field(default_factory=dict)  # this step's pacing by the fleet write budget
    launched_per_s: float = 0.0  # lifecycles begun per second: the slope fitted over every launch time
    landed_per_s: float = 0.0  # lifecycles / (first launch to every write landed, less each one's hold)


@dataclass
class Churn:
    steps: list[ChurnStep] = field(default_factory=list)

    def best(self) -> ChurnStep | None:
        good = [s for s in self.steps if s.mutating_p99_s is not None and s.mutating_p99_s <= 1.0 and not s.unfreed]
        return max(good, key=lambda s: s.achieved_per_s) if good else None


async def churn(h: ScaleHarness, rates: list[float], step_seconds: float, hold: float, progress: Progress) -> Churn:
    """Recorded lifecycles (a named put, held `hold` s and until its record landed, released) at rising
    rates."""
    fleet = h.fleet
    assert fleet is not None
    out = Churn()
    # The storm's tail (the garbage collector's claim deletes, Lost statuses) is not a lifecycle's writes.
    await quiet(h, progress)
    for rate in rates:
        pods = fleet.alive()
        keys: list[Key] = []
        tasks: set[asyncio.Task] = set()
        before = await scrape(h)
        paced_before = fleet.pacing()

        async def lifecycle(pod: FleetPod, i: int, keys: list[Key] = keys, rate: float = rate) -> None:
            # Named, so recorded under either policy: an unnamed object nobody shares is private under
            # "shared" and makes no write at all, which is not the lifecycle this step measures.
            ref = await fleet.put(pod, f"churn-{rate:g}-{i}")
            keys.append((pod.name, ref.address.object_id))
            await asyncio.sleep(hold)
            # Released once recorded: under a fleet write budget the create may still wait for its slot, and
            # a release then would take it back unwritten (docs/write-behind.md), not a recorded lifecycle.
            await fleet.recorded(pod, ref, 60.0)
            await fleet.release_owner(pod, ref.address.object_id)

        t0 = time.monotonic()
        n = int(rate * step_seconds)
        starts: list[float] = []
        for i in range(n):
            due = t0 + i / rate
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            starts.append(time.monotonic() - t0)
            task = asyncio.create_task(lifecycle(pods[i % len(pods)], i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=120)
        await fleet.flush(pods, timeout=300)
        landed = n / max(step_seconds, time.monotonic() - t0 - hold)
        launched = launch_rate(starts)
        left = await wait_freed(h, keys, 120, f"churn {rate:g}/s", progress)
        window = (await scrape(h)).minus(before)
        late = sorted(max(0.0, at - i / rate) for i, at in enumerate(starts))
        step = ChurnStep(
            rate,
            min(launched, landed),
            n,
            window.mutating_p99(),
            window.object_writes() / max(1, n),
            len(left),
            {k: v / max(1, n) for k, v in window.writes_by_resource().items()},
            time.monotonic() - t0,
            window.writes() - window.object_writes(),
            late[-1] if late else 0.0,
            late[min(len(late) - 1, int(0.99 * len(late)))] if late else 0.0,
            {k: v if k in ("told", "rate_median") else v - paced_before[k] for k, v in fleet.pacing().items()},
            launched,
            landed,
        )
        out.steps.append(step)
        progress(
            f"churn {rate:g}/s: achieved {step.achieved_per_s:.0f}/s, mutating p99 "
            f"{_fmt(step.mutating_p99_s)} s, {step.writes_per_lifecycle:.2f} writes/lifecycle, {len(left)} unfreed"
        )
        if step.mutating_p99_s is None or step.mutating_p99_s > 1.0 or step.achieved_per_s < 0.8 * rate or left:
            break
    return out


async def quiet(h: ScaleHarness, progress: Progress, window: float = 3.0, timeout: float = 180.0) -> float:
    """Until a `window` passes with no object write (apimetrics.object_writes), at most `timeout`: an earlier
    phase's tail out of the next phase's count. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        before = await scrape(h)
        await asyncio.sleep(window)
        if (await scrape(h)).minus(before).object_writes() == 0:
            break
    waited = time.monotonic() - t0
    progress(f"object writes quiet after {waited:.0f}s")
    return waited


def launch_rate(starts: list[float]) -> float:
    """Lifecycles begun per second: 1 / the least-squares slope of launch time over launch index.

    Why not n / (last launch - first): the launcher keeps an absolute schedule (launch i due at i / rate),
    so a late wake-up does not delay the launches after it, and that quotient is set by the last launch
    alone: 1,000 launches at 100/s whose last woke 14 ms late read 99.96/s, whose last was on time 100.1/s.
    The fitted slope weighs every launch; a launcher that fell behind for good still shows it."""
    n = len(starts)
    if n < 2:
        return 0.0
    mean_i, mean_t = (n - 1) / 2, sum(starts) / n
    cov = sum((i - mean_i) * (t - mean_t) for i, t in enumerate(starts))
    var = sum((i - mean_i) ** 2 for i in range(n))
    return var / cov if cov > 0 else float("inf")


# ---------------------------------------------------------------- audit at size


@dataclass
class AuditSize:
    objects: int
    reclaimed: int
    seconds: float | None


async def audit_at_size(h: ScaleHarness, sizes: list[int], timeout: float, progress: Progress) -> list[AuditSize]:
    """Agents holding `sizes` objects nothing records: the audit must read each inventory whole and
    reclaim every orphan."""
    fleet = h.fleet
    assert fleet is not None
    pods = fleet.alive()[: len(sizes)]
    import torch

    planted: list[tuple[int, list[Key]]] = []
    t0 = time.monotonic()
    for size, pod in zip(sizes, pods, strict=False):
        keys = []
        for i in range(size):
            object_id = f"orphan-{size}-{i}"
            await pod.agent.aput(object_id, [torch.zeros(OBJECT_BYTES, dtype=torch.uint8)])  # type: ignore[union-attr]
            keys.append((pod.name, object_id))
        planted.append((size, keys))
    results = []
    for size, keys in planted:
        left = await wait_freed(h, keys, max(1.0, timeout - (time.monotonic() - t0)), f"audit {size}", progress)
        done = time.monotonic() - t0
        results.append(AuditSize(size, len(keys) - len(left), None if left else done))
        progress(f"audit at {size} objects: {len(keys) - len(left)}/{size} reclaimed")
    return results


async def settle_leaks(h: ScaleHarness, timeout: float) -> int:
    """Leaked bytes once the operator had `timeout` seconds to reclaim them (0 as soon as it is 0)."""
    assert h.fleet is not None
    deadline = time.monotonic() + timeout
    while True:
        leaked = h.fleet.leaked_bytes()
        if not leaked or time.monotonic() > deadline:
            return leaked
        await asyncio.sleep(1.0)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
