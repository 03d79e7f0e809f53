"""A seeded chaos run: object lifecycles with one fault each, at a random point, then checks after quiescence.

Why a harness of its own: the scenario tests show one fault at a time at a chosen moment; this
drives many lifecycles (put -> borrow + fetch -> owner release -> reader release) against the real
control plane, operator and agent processes, with faults at random points chosen from a seed, and
says per fault whether everything was cleaned and how long it took. The seed alone reproduces
the schedule (the timing of real processes still varies).

Faults: SIGKILL, container restart (the process dies, the Pod object stays), SIGSTOP and pod
deletion of a lifecycle's reader or source; SIGKILL and SIGSTOP of the operator (restarted when
it exits, as a Deployment would); a kube-apiserver restart and an etcd restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_dev.testing.waits import wait_until
from gpuobj_dev.testing.workload import WorkloadProcess, free_port
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
)
# After which step the fault strikes: 1 put, 2 borrow + fetch, 3 owner's release (4, the reader's release, ends it).
POINTS = (1, 2, 3)
OUTAGE_SECONDS = 4.0  # API server or etcd down, a process stopped: longer than the operator's 3 s lease
ELEMENTS = 1 << 16  # 256 KiB per object
CLEAN_TIMEOUT = 90.0


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
        return cls(seed, lifecycles, [(k, rng.choice(POINTS)) for k in kinds])


class OperatorSupervisor:
    """The operator, restarted whenever it exits (what its Deployment does after a lost lease)."""

    def __init__(self, make: Callable[[], OperatorProcess]) -> None:
        self._make = make
        self.current = make().start()
        self.restarts = 0
        self.exits: list[int] = []

    def ensure(self) -> OperatorProcess:
        proc = self.current.proc
        if proc is not None and proc.poll() is not None:
            self.exits.append(proc.returncode)
            self.current = self._make().start()
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
                "lost": op.metric("gpuobj_lost_objects_total"),
                "dropped": op.metric("gpuobj_claims_dropped_total", {"holder": "process"}),
            }
        except OSError:
            return None

    def stop(self) -> int:
        self.ensure()
        return self.current.stop()


class Chaos:
    def __init__(
        self, cluster: ClusterHandle, namespace: str, token_file: Path, make_operator: Callable[[], OperatorProcess]
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.token_file = token_file
        self.operator = OperatorSupervisor(make_operator)
        self.processes: list[WorkloadProcess] = []
        self.pool: dict[str, WorkloadProcess | None] = {}  # role ("src", "rd") -> its current process
        self._pods_made = 0
        self.log: list[str] = []

    # ------------------------------------------------------------ pods

    def _kube(self, fn):
        async def go():
            async with self.cluster.client() as kube:
                return await fn(kube)

        return asyncio.run(go())

    def _process(self, name: str, uid: str, port: int) -> WorkloadProcess:
        w = WorkloadProcess(
            pod_name=name,
            namespace=self.namespace,
            pod_uid=uid,
            port=port,
            token_file=self.token_file,
            kubeconfig=self.cluster.kubeconfig,
        )
        self.processes.append(w)
        return w

    def start_pods(self, *names: str) -> dict[str, WorkloadProcess]:
        """Create the Pod objects, then start their processes side by side (each imports torch and NIXL)."""
        made = {n: self._process(n, self._pod(n, port := free_port())["metadata"]["uid"], port) for n in names}
        errors: list[BaseException] = []

        def start(w: WorkloadProcess) -> None:
            try:
                w.start()
            except BaseException as exc:  # reported below, in the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(w,)) for w in made.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return made

    def _pod(self, name: str, port: int) -> dict:
        return self._kube(lambda k: create_agent_pod(k, self.namespace, name, port=port))

    def restart(self, w: WorkloadProcess) -> WorkloadProcess:
        """A container restart: the process dies, the pod (uid, address) stays, a new process starts."""
        w.kill()
        new = self._process(w.env["GPUOBJ_POD_NAME"], w.env["GPUOBJ_POD_UID"], int(w.env["GPUOBJ_AGENT_PORT"]))
        return new.start()

    def delete_pod(self, w: WorkloadProcess) -> None:
        w.kill()
        self._kube(lambda k: delete_pod(k, self.namespace, w.env["GPUOBJ_POD_NAME"]))

    def close(self) -> None:
        for w in self.processes:
            if w.proc and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
                try:
                    w.stop(timeout=30)
                except AssertionError:
                    w.kill()

    # ------------------------------------------------------------ API views

    def api_records(self, object_name: str | None = None) -> tuple[list[dict], list[dict]]:
        objects = self._kube(lambda k: k.list(GPUOBJECTS, self.namespace))["items"]
        claims = self._kube(lambda k: k.list(CLAIMS, self.namespace))["items"]
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
        before = self.operator.counters()
        pid_before = self.operator.pid
        last = time.monotonic()

        def step(n: int) -> None:
            nonlocal last
            if n == 1 or (n in (2, 4) and alive["reader"]) or (n == 3 and alive["src"]):
                last = time.monotonic()  # a step that runs (and may drop a reference) starts the clock again
            if n == 1:
                src.run(f"ref = client.put([torch.full(({ELEMENTS},), {float(index)})], name={name!r})")
                address.append(src.eval_pickle("ref.address"))
            elif n == 2 and alive["reader"]:
                reader.run(f"h = client.borrow(load_pickle({address[0]!r}))")
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
            return not alive["src"] or self.holds(src) == []  # and nothing else of it either

        try:
            wait_until(cleaned, f"lifecycle {index} ({fault}) cleaned", timeout=CLEAN_TIMEOUT, interval=0.05)
            out.cleaned = True
            out.seconds = time.monotonic() - last
        except AssertionError as exc:
            out.note = str(exc)
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
                # A put during the outage fails cleanly: the error reaches the caller, the bytes are freed.
                src.run(
                    "try:\n"
                    "    client.put([torch.ones(4)], name='during-outage')\n"
                    "    outage_put = 'recorded?'\n"
                    "except Exception as e:\n"
                    "    outage_put = type(e).__name__",
                    timeout=90,
                )
                out.note = f"put during outage: {src.eval('outage_put')}"
            time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - started)))
            self.cluster.cluster.start_component(component)
            struck = time.monotonic()
        return struck

    def _check_counters(self, fault: str, point: int, before, pid_before) -> str:
        """The operator's counters moved by exactly what this lifecycle's fault implies."""
        if before is None or self.operator.pid != pid_before or fault in ("apiserver-restart", "etcd-restart"):
            return "skipped (operator restarted)" if self.operator.pid != pid_before else "skipped"
        source_fault = fault in ("source-kill", "source-restart", "source-pod-delete")
        held_by_reader = point >= 2
        expected = {
            "freed": 0 if source_fault else 1,
            "source-lost": 1 if source_fault else 0,
            "lost": 1 if source_fault else 0,
            "dropped": 1 if fault in ("reader-kill", "reader-restart") and held_by_reader else 0,
        }
        if fault == "reader-pod-delete":
            del expected["dropped"]  # the garbage collector and the operator's probe race for that claim
        seen: dict[str, float] = {}

        def exact() -> bool:
            after = self.operator.counters()
            if after is None:
                return False
            seen.update({k: after[k] - before[k] for k in expected})
            return all(seen[k] == v for k, v in expected.items())

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
