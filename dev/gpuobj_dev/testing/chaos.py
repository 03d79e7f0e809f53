"""A seeded chaos run: object lifecycles with one fault each, at a random point, then checks after quiescence.

Why a harness of its own: the scenario tests show one fault at a time at a chosen moment; this
drives many lifecycles (put -> borrow + fetch -> owner release -> reader release) against the real
control plane, operator and agent processes, with faults at random points chosen from a seed, and
says per fault whether everything was cleaned and how long it took. The seed alone reproduces
the schedule (the timing of real processes still varies).

Faults: SIGKILL, container restart (the process dies, the Pod object stays), SIGSTOP and pod
deletion of a lifecycle's reader or source; SIGKILL and SIGSTOP of the operator (restarted when
it exits, as a Deployment would); a kube-apiserver restart and an etcd restart; and the owner's and
the reader's releases made while the API server is down (the client's write-behind must land them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_dev.testing.workload import WorkloadProcess
from gpuobj_kube.client import CLAIMS, GPUOBJECTS

FAULTS = (
    "none",
    "reader-kill",
    "reader-restart",
    "reader-pod-delete",
    "source-kill",
    "source-restart",
    "source-pod-delete",
    "source-stop",
    "operator-kill",
    "operator-stop",
    "apiserver-restart",
    "etcd-restart",
    "releases-in-outage",
)
# After which step the fault strikes: 1 put, 2 borrow + fetch, 3 owner's release (4, the reader's release, ends it).
POINTS = (1, 2, 3)
OUTAGE_SECONDS = 4.0  # API server or etcd down, a process stopped: longer than the operator's 3 s lease
ELEMENTS = 1 << 16  # 256 KiB per object
CLEAN_TIMEOUT = 90.0
OUTAGES = ("apiserver-restart", "etcd-restart", "releases-in-outage")
FLUSH = "if hasattr(client, 'flush'): client.flush()"  # wait until queued API writes landed


@dataclass
class Outcome:
    index: int
    fault: str
    point: int
    cleaned: bool = False
    seconds: float | None = None  # from the last fault or release to everything cleaned
    fetch: str = ""
    counters: str = ""  # "exact", "skipped (operator restarted)", or what differed
    note: str = ""


@dataclass
class Schedule:
    seed: int
    lifecycles: int
    plan: list[tuple[str, int]] = field(default_factory=list)

    @classmethod
    def make(cls, seed: int, lifecycles: int) -> Schedule:
        """Every fault kind once (when there is room), the rest drawn at random; points drawn at random."""
        rng = random.Random(seed)
        kinds = list(FAULTS)
        rng.shuffle(kinds)
        kinds = kinds[:lifecycles] + [rng.choice(FAULTS) for _ in range(lifecycles - len(kinds))]
        plan = [(k, rng.choice(POINTS)) for k in kinds]
        # Releases in an outage need something to release after the fault: the reader's claim exists.
        return cls(seed, lifecycles, [(k, max(p, 2) if k == "releases-in-outage" else p) for k, p in plan])


class OperatorSupervisor:
    """The operator, restarted whenever it exits (what its Deployment does after a lost lease)."""

    def __init__(self, make: Callable[[], OperatorProcess]) -> None:
        self._make = make
        self.current = make()
        self.restarts = 0
        self.exits: list[int] = []

    def ensure(self) -> OperatorProcess:
        proc = self.current.proc
        if proc is not None and proc.poll() is not None:
            self.exits.append(proc.returncode)
            self.current = self._make()
            self.restarts += 1
        return self.current

    @property
    def pid(self) -> int | None:
        return self.current.proc.pid if self.current.proc else None

    def signal(self, sig: int) -> None:
        if self.current.proc and self.current.proc.poll() is None:
            os.kill(self.current.proc.pid, sig)

    def counters(self) -> dict[str, float] | None:
        try:
            op = self.ensure()
            return {
                "freed": op.metric("gpuobj_frees_total", {"result": "freed"}),
                "source-lost": op.metric("gpuobj_frees_total", {"result": "source-lost"}),
                "agent-gone": op.metric("gpuobj_frees_total", {"result": "agent-gone"}),
                "lost": op.metric("gpuobj_lost_objects_total"),
                "dropped": op.metric("gpuobj_claims_dropped_total", {"holder": "process"}),
            }
        except OSError:
            return None

    def stop(self) -> int:
        self.ensure()
        return self.current.stop()


class PodSet(Protocol):
    """Workload pods as the tests make them (tests/e2e/operator/conftest.py ``Pods``): a Pod object plus a
    process running the client library, as the identity the tests run workloads as."""

    workloads: dict[str, WorkloadProcess]

    def workload(self, name: str) -> WorkloadProcess: ...

    def restart_process(self, name: str) -> WorkloadProcess: ...

    def delete_pod(self, name: str, kill_process: bool = True) -> None: ...


class Chaos:
    def __init__(
        self,
        cluster: ClusterHandle,
        namespace: str,
        token_file: Path,
        pods: PodSet,
        make_operator: Callable[[], OperatorProcess],
    ) -> None:
        """``token_file``: what the operator presents to agents (to read inventories as it does);
        ``make_operator``: starts an operator process (the supervisor calls it again when one exits)."""
        self.cluster = cluster
        self.namespace = namespace
        self.token_file = token_file
        self.pods = pods
        self.operator = OperatorSupervisor(make_operator)
        self.pool: dict[str, WorkloadProcess | None] = {}  # role ("src", "rd") -> its current process
        self._pods_made = 0

    # ------------------------------------------------------------ pods

    def _kube(self, fn):
        async def go():
            async with self.cluster.client() as kube:
                return await fn(kube)

        return asyncio.run(go())

    def start_pods(self, *names: str) -> dict[str, WorkloadProcess]:
        return {n: self.pods.workload(n) for n in names}

    def restart(self, w: WorkloadProcess) -> WorkloadProcess:
        """A container restart: the process dies, the pod (uid, address) stays, a new process starts."""
        return self.pods.restart_process(w.env["GPUOBJ_POD_NAME"])

    def delete_pod(self, w: WorkloadProcess) -> None:
        self.pods.delete_pod(w.env["GPUOBJ_POD_NAME"])

    def resume_all(self) -> None:
        """SIGCONT whatever a failed run left stopped, so the fixtures can stop it."""
        for w in self.pods.workloads.values():
            if w.proc and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
        self.operator.signal(signal.SIGCONT)

    # ------------------------------------------------------------ API views

    def api_records(self, object_name: str | None = None) -> tuple[list[dict], list[dict]]:
        objects = self._kube(lambda k: k.list(GPUOBJECTS, self.namespace))["items"]
        claims = user_claims(self._kube(lambda k: k.list(CLAIMS, self.namespace))["items"])
        if object_name is not None:
            objects = [o for o in objects if o["metadata"]["name"] == object_name]
            claims = [c for c in claims if c["spec"]["objectName"] == object_name]
        return objects, claims

    def holds(self, w: WorkloadProcess) -> list[dict]:
        return agent_http.inventory(w.endpoint, self.token_file)["objects"]

    # ------------------------------------------------------------ one lifecycle

    def _members(self) -> tuple[WorkloadProcess, WorkloadProcess]:
        """This lifecycle's source and reader: the same pods as before while they live. A killed process
        is restarted in its pod (what the kubelet does), a deleted pod is replaced by a new one."""
        for role, w in list(self.pool.items()):
            if w is not None and w.proc is not None and w.proc.poll() is not None:
                self.pool[role] = self.restart(w)
        missing = [role for role in ("src", "rd") if self.pool.get(role) is None]
        if missing:
            self._pods_made += 1
            made = self.start_pods(*(f"{role}-{self._pods_made}" for role in missing))
            for role in missing:
                self.pool[role] = made[f"{role}-{self._pods_made}"]
        return self.pool["src"], self.pool["rd"]  # type: ignore[return-value]

    def lifecycle(self, index: int, fault: str, point: int) -> Outcome:
        out = Outcome(index, fault, point)
        src, reader = self._members()
        name = f"obj-{index}"
        alive = {"src": True, "reader": True}  # the process that holds the handles still runs
        address: list[str] = []
        object_id: list[str] = []
        before = self.operator.counters()
        pid_before = self.operator.pid
        last = time.monotonic()

        def step(n: int) -> None:
            nonlocal last
            if n == 1 or (n in (2, 4) and alive["reader"]) or (n == 3 and alive["src"]):
                last = time.monotonic()  # a step that runs (and may drop a reference) starts the clock again
            if n == 1:
                # Recorded before anything else happens (a write-behind client may hold the create back:
                # an object never recorded never involves the operator, and this suite tests the operator).
                src.run(f"ref = client.put([torch.full(({ELEMENTS},), {float(index)})], name={name!r})\n{FLUSH}")
                address.append(src.eval_pickle("ref.address"))
                object_id.append(src.eval("ref.address.object_id"))
            elif n == 2 and alive["reader"]:
                reader.run(f"h = client.borrow(load_pickle({address[0]!r}))\n{FLUSH}")
                reader.run(
                    "try:\n"
                    f"    fetched = 'ok' if bool((client.fetch(h)[0] == {float(index)}).all()) else 'WRONG BYTES'\n"
                    "except gpuobj.GpuObjError as e:\n"
                    "    fetched = type(e).__name__",
                    timeout=90,
                )
                out.fetch = reader.eval("fetched")
            elif n == 3 and alive["src"]:
                src.run("ref.release()")
            elif n == 4 and alive["reader"]:
                reader.run("h.release()")

        for n in range(1, point + 1):
            step(n)
        if fault == "releases-in-outage":
            # The API server is down while the owner and the reader release: the client's write-behind
            # queue must keep retrying until the deletes land (durable releases).
            self.cluster.cluster.stop_component("kube-apiserver")
            started = time.monotonic()
            for n in range(point + 1, 5):
                step(n)
            time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - started)))
            self.cluster.cluster.start_component("kube-apiserver")
            last = time.monotonic()
        else:
            last = self._inject(fault, src, reader, alive, out) or last
            for n in range(point + 1, 5):
                step(n)
        if fault in ("operator-kill",):
            self.operator.ensure()  # the Deployment brings it back after the steps ran without it

        def cleaned() -> bool:
            self.operator.ensure()
            objects, claims = self.api_records(name)
            if objects or claims:
                return False
            # Its bytes are gone from the source (what else a store holds is checked after quiescence).
            return not alive["src"] or all(o["id"] not in object_id for o in self.holds(src))

        try:
            wait_until(cleaned, f"lifecycle {index} ({fault}) cleaned", timeout=CLEAN_TIMEOUT, interval=0.05)
            out.cleaned = True
            out.seconds = time.monotonic() - last
        except AssertionError as exc:
            out.note = str(exc)
        if fault == "apiserver-restart" and alive["src"] and out.cleaned:
            # What became of the put made during the outage: its create lands once the API server is back,
            # even through the 403s a just-restarted API server answers (write-behind FORBIDDEN_GRACE).
            # Released and gone within this lifecycle (whose counters are not checked: an outage), so that
            # its free counts in no other lifecycle and nothing of it is left at quiescence.
            src.run(
                "if outage_ref is not None:\n"
                "    try:\n"
                "        client.flush(30)\n"
                "    except Exception as e:\n"
                "        outage_put += f', flush: {type(e).__name__}'\n"
                "    fate = outage_ref.failed\n"
                "    outage_put += ', then recorded' if fate is None else f', then refused: {fate}'\n"
                "    outage_ref.release()\n"
                "    client.flush(30)\n",
                timeout=90,
            )
            out.note = f"put during outage: {src.eval('outage_put')}"
            wait_until(
                lambda: self.api_records("during-outage") == ([], []), "the outage put freed", CLEAN_TIMEOUT, 0.05
            )
        out.counters = self._check_counters(fault, point, before, pid_before)
        return out

    def _inject(
        self,
        fault: str,
        src: WorkloadProcess,
        reader: WorkloadProcess,
        alive: dict[str, bool],
        out: Outcome,
    ) -> float | None:
        """Strike; returns when the fault took effect (a kill) or ended (a stop, an outage)."""
        if fault == "none":
            return None
        struck = time.monotonic()
        if fault.startswith(("reader-", "source-")):
            role = "reader" if fault.startswith("reader-") else "src"
            w = reader if role == "reader" else src
            action = fault.split("-", 1)[1]
            if action == "kill":
                struck = time.monotonic()
                w.kill()
                alive[role] = False
            elif action == "restart":
                struck = time.monotonic()
                self.pool["src" if role == "src" else "rd"] = self.restart(w)
                alive[role] = False
            elif action == "pod-delete":
                struck = time.monotonic()
                self.delete_pod(w)
                self.pool["src" if role == "src" else "rd"] = None
                alive[role] = False
            elif action == "stop":
                assert w.proc is not None
                os.kill(w.proc.pid, signal.SIGSTOP)
                time.sleep(OUTAGE_SECONDS)  # the fault is its duration
                os.kill(w.proc.pid, signal.SIGCONT)
                struck = time.monotonic()
        elif fault == "operator-kill":
            self.operator.current.kill()
        elif fault == "operator-stop":
            self.operator.signal(signal.SIGSTOP)
            time.sleep(OUTAGE_SECONDS)
            self.operator.signal(signal.SIGCONT)
            struck = time.monotonic()
        elif fault in ("apiserver-restart", "etcd-restart"):
            component = "kube-apiserver" if fault == "apiserver-restart" else "etcd"
            self.cluster.cluster.stop_component(component)
            started = time.monotonic()
            if fault == "apiserver-restart":
                # A put during the outage fails cleanly (the error reaches the caller, the bytes are freed),
                # or a write-behind client accepts it; either way nothing of it may be left in the end.
                src.run(
                    "try:\n"
                    "    outage_ref = client.put([torch.ones(4)], name='during-outage')\n"
                    "    outage_put = 'accepted (write-behind)'\n"
                    "except Exception as e:\n"
                    "    outage_ref, outage_put = None, type(e).__name__",
                    timeout=90,
                )
                out.note = f"put during outage: {src.eval('outage_put')}"
            time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - started)))
            self.cluster.cluster.start_component(component)
            struck = time.monotonic()
        return struck

    def _check_counters(self, fault: str, point: int, before, pid_before) -> str:
        """The operator's counters moved by exactly what this lifecycle's fault implies."""
        if before is None or self.operator.pid != pid_before or fault in OUTAGES:
            return "skipped (operator restarted)" if self.operator.pid != pid_before else "skipped"
        source_fault = fault in ("source-kill", "source-restart", "source-pod-delete")
        dropped = 1 if fault in ("reader-kill", "reader-restart") and point >= 2 else 0
        if source_fault:
            # One end without a free: Lost then released (the probes were first), or a free that found
            # nothing listening (the last release was first). Never a free that freed, never both.
            expected = "freed 0, source-lost + agent-gone 1, lost = source-lost, dropped 0"

            def holds(d: dict[str, float]) -> bool:
                return (
                    d["freed"] == 0
                    and d["source-lost"] + d["agent-gone"] == 1
                    and d["lost"] == d["source-lost"]
                    and d["dropped"] == 0
                )
        else:
            expected = f"freed 1, source-lost 0, agent-gone 0, lost 0, dropped {dropped}"

            def holds(d: dict[str, float]) -> bool:
                exact = d["freed"] == 1 and d["source-lost"] == d["agent-gone"] == d["lost"] == 0
                # For a deleted reader pod, the garbage collector and the probes race for the claim.
                return exact and (fault == "reader-pod-delete" or d["dropped"] == dropped)

        seen: dict[str, float] = {}

        def exact() -> bool:
            after = self.operator.counters()
            if after is None:
                return False
            seen.update({k: after[k] - before[k] for k in after})
            return holds(seen)

        try:
            wait_until(exact, "operator counters", timeout=15, interval=0.1)
            return "exact"
        except AssertionError:
            return f"expected {expected}, saw {seen}"


def fetch_as_expected(o: Outcome) -> bool:
    """A reader reads the right bytes, or is told the source is gone in the words a deleted pod gets."""
    if o.point >= 2:
        return o.fetch == "ok"  # read before the fault
    if o.fault.startswith("reader-"):
        return o.fetch == ""  # the reader died before it read
    if o.fault.startswith("source-") and o.fault != "source-stop":
        return o.fetch in ("ObjectLostError", "ObjectNotFoundError")
    return o.fetch == "ok"


def table(outcomes: list[Outcome]) -> str:
    """Faults x outcome, then time to clean per fault kind."""
    lines = [f"{'#':>3} {'fault':18} {'pt':>2} {'cleaned':8} {'s':>6}  {'fetch':22} counters / note"]
    for o in outcomes:
        secs = f"{o.seconds:6.2f}" if o.seconds is not None else "     -"
        extra = o.counters + (f"; {o.note}" if o.note else "")
        lines.append(f"{o.index:>3} {o.fault:18} {o.point:>2} {o.cleaned!s:8} {secs}  {o.fetch or '-':22} {extra}")
    lines.append("")
    lines.append(f"{'fault':18} {'n':>2} {'cleaned':>7} {'clean s (median / max)':>24}")
    for kind in FAULTS:
        got = [o for o in outcomes if o.fault == kind]
        if not got:
            continue
        times = [o.seconds for o in got if o.seconds is not None]
        spread = f"{statistics.median(times):.2f} / {max(times):.2f}" if times else "-"
        lines.append(f"{kind:18} {len(got):>2} {sum(o.cleaned for o in got):>7} {spread:>24}")
    return "\n".join(lines)
