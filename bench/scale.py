"""The operator at cluster scale: kwok nodes, a fleet of real agents at their pod IPs, one run, every scenario.

    make bench-scale                # 1,000 pods, 20 nodes, 100 objects per pod (10 of them shared): 100,000
    .venv/bin/python bench/scale.py --pods 100 --objects-per-pod 10 --shared-per-pod 2 --json out.json

On one control plane (etcd, kube-apiserver, kube-controller-manager) with the chart's API Priority and
Fairness objects (deploy/flowcontrol.yaml; --no-flowcontrol leaves them out) this starts kwok with --nodes
fake nodes and a pod CIDR made local on this machine, the operator as its own ServiceAccount with
the chart's roles (reaching agents at status.podIP), and the agent fleet (dev/gpuobj_dev/scale):
every fake pod's real agent control server and store at its pod IP, and the real client core with
the pod's own bound tokens, every client with the recording policy --record (GPUOBJ_RECORD, default
"shared"). The operator also serves the live view (live.gpuobj.io), asked directly as the API server's
front proxy would. Then, in order, on the same cluster:

  ramp          --pods pods Running, --objects-per-pod objects each that live through the run: first the
                private ones (kept by their producer, shared with no one), then --shared-per-pod handed
                off to the next pod (one claim held by another pod; the producer drops its own
                reference); the object writes of each phase, statuses included, per object of its class
  cold restart  the operator SIGKILLed, a fresh one: time to synced, to every agent audited, RSS, frees
  catch-up      until every status says what the operator concludes (its writes trail the ramp)
  live view     --live-view-samples new objects asked for by name until listed (lag p99), then every
                live object listed across namespaces, paged
  idle          --idle-seconds with nothing changing: operator API writes, liveness requests per pod
  dead holders  holders' processes restarted (new incarnation, restartCount + 1 in pod status), half
                dying again in their first second; p99 time until what they held is freed; pods deleted
  storm         10% of the pods deleted at once: time until every byte they referenced is freed,
                the API server's mutating p99 meanwhile
  churn         recorded (named) lifecycles at rising rates: the highest with mutating p99 <= 1 s (the rate
                fitted over every launch time), object writes each (gpuobj.io and Events: the Lease writes of
                kwok's nodes and the operator, made with nothing changing, are printed apart, with the idle
                phase's Lease baseline for the step's window)
  audit         agents holding 10, 1,000, 10,000 orphans: every inventory read whole, every orphan reclaimed
  end           wrong frees (freed while referenced, as the fleet knows) and leaked bytes

It prints a table (measured, the issue's target, their ratio, met or not) with the machine's load,
per-phase CPU of each process and the API server's mutating p99 in each phase (the breakdown behind a
miss; the worst phase is mutating_p99_s_max, the churn counted at the rate it reports, not at the step
past it) and writes every figure with --json. It exits 1 when a figure misses its target (or was not
measured), after the table that says which; --no-fail-on-miss exits 0 all the same (a run made for its
figures, not as a gate).
Needs root (the local route). Ctrl-C or an error tears everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuobj_dev.cluster import DevCluster  # noqa: E402
from gpuobj_dev.scale import apimetrics, scenarios  # noqa: E402
from gpuobj_dev.scale.harness import ScaleHarness  # noqa: E402
from gpuobj_dev.scale.kwok import DEFAULT_CIDR, can_route  # noqa: E402
from gpuobj_dev.testing.cluster import ClusterHandle  # noqa: E402
from gpuobj_dev.testing.identities import OPERATOR_SA  # noqa: E402

NAMESPACE = "gpuobj-scale"
WORKLOADS_LEVEL = "gpuobj-workloads"  # deploy/flowcontrol.yaml's priority level for every workload's gpuobj.io writes
KEYS = (
    "pods",
    "objects",
    "claims",
    "pods_running_s",
    "created_per_s",
    "restart_synced_s",
    "restart_audited_s",
    "operator_rss_mib",
    "idle_operator_writes_per_min",
    "liveness_requests_per_pod_s",
    "dead_holder_detect_p99_s",
    "storm_pods",
    "storm_clean_s",
    "storm_mutating_p99_s",
    "churn_per_s",
    "churn_mutating_p99_s",
    "writes_per_recorded_lifecycle",
    "wrong_frees",
    "leaked_bytes_end",
    "api_writes_per_private_object",
    "api_writes_per_shared_object",
    "live_view_lag_p99_s",
    "live_view_list_all_s",
    "mutating_p99_s_max",
    "mutating_sli_p99_s_max",  # printed, not judged: the same without APF queueing (apimetrics)
    "others_apf_wait_p99_s_max",  # printed, not judged: the wait of every priority level but the workloads'
    "fleet_write_budget",  # the run's configuration (--fleet-write-budget), not judged
)
# key -> (target, "le" when the figure must be at most the target, "ge" at least); the targets.
TARGETS = {
    "pods_running_s": (60.0, "le"),
    "restart_synced_s": (30.0, "le"),
    "restart_audited_s": (60.0, "le"),
    "operator_rss_mib": (1024.0, "le"),
    "idle_operator_writes_per_min": (0.0, "le"),
    "liveness_requests_per_pod_s": (0.05, "le"),
    "dead_holder_detect_p99_s": (5.0, "le"),
    "storm_clean_s": (60.0, "le"),
    "storm_mutating_p99_s": (1.0, "le"),
    "churn_per_s": (100.0, "ge"),
    "churn_mutating_p99_s": (1.0, "le"),
    "writes_per_recorded_lifecycle": (3.0, "le"),
    "wrong_frees": (0.0, "le"),
    "leaked_bytes_end": (0.0, "le"),
    "api_writes_per_private_object": (0.05, "le"),
    "api_writes_per_shared_object": (4.0, "le"),
    "live_view_lag_p99_s": (2.0, "le"),
    "live_view_list_all_s": (10.0, "le"),
    "mutating_p99_s_max": (1.0, "le"),
}


def install_flowcontrol(handle: ClusterHandle, queue_length: int | None = None, shares: int | None = None) -> None:
    """The API Priority and Fairness objects a chart install ships (deploy/flowcontrol.yaml, the chart's
    rendering), with the operator's subject made the bench's ServiceAccount: the fleet's gpuobj.io
    writes land in the workloads' priority level, queued by namespace, as in a real install."""
    import yaml

    docs = list(yaml.safe_load_all((REPO / "deploy" / "flowcontrol.yaml").read_text()))
    for doc in docs:
        for rule in (doc.get("spec") or {}).get("rules") or []:
            for subject in rule.get("subjects") or []:
                if subject.get("kind") == "ServiceAccount":
                    subject["serviceAccount"] = {"namespace": NAMESPACE, "name": OPERATOR_SA}
        queuing = ((doc.get("spec") or {}).get("limited") or {}).get("limitResponse", {}).get("queuing")
        if (
            queue_length
            and doc["kind"] == "PriorityLevelConfiguration"
            and doc["metadata"]["name"].endswith("-workloads")
        ):
            queuing["queueLengthLimit"] = queue_length
        if shares and doc["kind"] == "PriorityLevelConfiguration" and doc["metadata"]["name"].endswith("-workloads"):
            doc["spec"]["limited"]["nominalConcurrencyShares"] = shares
    handle.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def log(message: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')} load {load()}] {message}", flush=True)


class Phases:
    """CPU seconds of each process and the API server's mutating p99 per phase: where the time of a missed
    target went, and which scenario was the API server's worst."""

    def __init__(self, h: ScaleHarness) -> None:
        self.h = h
        self.rows: list[tuple[str, float, dict[str, float], str, float | None]] = []
        self.windows: dict[str, apimetrics.ApiSnapshot] = {}

    async def _scrape(self) -> apimetrics.ApiSnapshot | None:
        try:
            return await scenarios.scrape(self.h)
        except Exception as exc:  # a figure missing, not a run lost
            log(f"could not read the API server's metrics: {exc}")
            return None

    async def run(self, name: str, coro):
        before = await self._scrape()
        cpu0, t0 = self.h.cpu(), time.monotonic()
        log(f"{name} ...")
        try:
            return await coro
        finally:
            used = self.h.cpu_used(cpu0, self.h.cpu())
            wall = time.monotonic() - t0
            after = await self._scrape()
            window = after.minus(before) if before and after else None
            p99 = window.mutating_p99() if window else None
            if window:
                self.windows[name] = window
            self.rows.append((name, wall, used, load(), p99))

    def sli_p99_max(self) -> float | None:
        """The worst phase's mutating p99 without the time queued in APF (the SLO's SLI)."""
        return apimetrics.worst(w.mutating_sli_p99() for w in self.windows.values())

    def others_wait_p99_max(self) -> float | None:
        """The worst APF queue wait (p99) of every priority level but the workloads': whom the fleet slowed."""
        return apimetrics.worst(
            q
            for w in self.windows.values()
            for lv, (_, q) in w.apf_wait_p99_by_level().items()
            if lv != WORKLOADS_LEVEL
        )

    def mutating_p99_max(self, instead: dict[str, float | None]) -> float | None:
        """The worst phase's p99; a phase named in `instead` counts with that figure (the churn: the p99 of
        the rate it reports, since its last step runs until the API server misses the target, by design)."""
        return apimetrics.worst(instead[row[0]] if row[0] in instead else row[4] for row in self.rows)


def met(key: str, value) -> str:
    if key not in TARGETS:
        return ""
    if value is None:
        return "MISS (none)"
    target, how = TARGETS[key]
    return "met" if (value <= target if how == "le" else value >= target) else "MISS"


def misses(figures: dict) -> list[str]:
    """The judged keys whose figure misses its target or is missing: a non-empty list fails the run."""
    return [key for key in KEYS if key in TARGETS and met(key, figures.get(key)) != "met"]


def fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def print_table(figures: dict, phases: Phases, extra: dict) -> None:
    print()
    print(f"gpuobj at scale: {os.cpu_count()} CPUs, load {load()} (1/5/15 min, at the end of the run)")
    print(f"{'figure':>30} | {'measured':>10} | {'target':>8} | {'ratio':>6} | verdict")
    print("-" * 78)
    for key in KEYS:
        value = figures.get(key)
        target = TARGETS.get(key)
        ratio = ""
        if target and value is not None and target[0]:
            ratio = f"{value / target[0]:.2f}"
        print(f"{key:>30} | {fmt(value):>10} | {fmt(target[0]) if target else '':>8} | {ratio:>6} | {met(key, value)}")
    missed = misses(figures)
    judged = sum(1 for key in KEYS if key in TARGETS)
    print(f"targets: {judged - len(missed)} of {judged} met" + (f"; missed: {', '.join(missed)}" if missed else ""))
    print()
    for name, value in extra.items():
        print(f"{name:>30} | {value}")
    print()
    names = sorted({k for _, _, used, _, _ in phases.rows for k in used})
    print("CPU seconds per phase (the breakdown: who spent the machine) and the API server's mutating p99")
    head = f"{'phase':>15} | {'wall s':>7} | " + " | ".join(f"{n[:14]:>14}" for n in names)
    print(head + f" | {'mut. p99 s':>10} | load")
    for name, wall, used, ld, p99 in phases.rows:
        cpu = " | ".join(f"{used.get(n, 0.0):14.1f}" for n in names)
        print(f"{name:>15} | {wall:7.1f} | {cpu} | {fmt(p99):>10} | {ld}")
    print()
    print("mutating requests and their p99 by verb and resource, in each phase whose p99 passed 1 s")
    for name, _, _, _, p99 in phases.rows:
        if p99 is not None and p99 > 1.0 and name in phases.windows:
            by = list(phases.windows[name].mutating_p99_by_resource().items())[:10]
            print(f"{name:>15} | " + ", ".join(f"{r} {n:.0f} p99 {fmt(q)} s" for r, (n, q) in by))
    print()
    print(
        "where a phase's writes waited: mutating p99 as clients saw it | without APF queueing (the SLO's SLI) | "
        "APF queue wait p99 by priority level (requests)"
    )
    for name, _, _, _, p99 in phases.rows:
        w = phases.windows.get(name)
        if w is None:
            continue
        waits = ", ".join(f"{lv} {fmt(q)} s ({n:.0f})" for lv, (n, q) in list(w.apf_wait_p99_by_level().items())[:6])
        print(f"{name:>15} | {fmt(p99):>6} | {fmt(w.mutating_sli_p99()):>6} | {waits or 'none queued'}")


def pacing_line(budget: float, pacing: dict[str, float]) -> str:
    """What the fleet write budget did: the share each pod was told, and how long its writes waited for it."""
    if not budget:
        return "none (--fleet-write-budget 0): each pod backs off on its own"
    paced, told, share = pacing.get("paced_writes", 0), pacing.get("told", 0), pacing.get("rate_median", 0)
    waited = fmt(pacing.get("paced_s", 0) / max(1, paced))
    return (
        f"{budget:g} writes/s: {told:.0f} pods told, median share {share:.3g}/s; {paced:.0f} of"
        f" {pacing.get('sent', 0):.0f} writes waited for their slot, {waited} s each on average;"
        f" {pacing.get('elided_while_paced', 0):.0f} families taken back while they waited"
    )


async def run(args: argparse.Namespace, handle: ClusterHandle, folder: Path, figures: dict) -> None:
    """Every scenario in order; `figures` fills as they finish (a failure keeps what was measured)."""
    operator_args = [
        *("--audit-interval", str(args.audit_interval), "--leak-grace", str(args.leak_grace)),
        *("--fleet-write-budget", str(args.fleet_write_budget)),
    ]
    extra: dict = {"machine load at the start": f"{load()} (1/5/15 min; the table's head gives it at the end)"}
    figures["fleet_write_budget"] = args.fleet_write_budget
    churn_p99: float | None = None  # the churn counts in mutating_p99_s_max at the rate it reports
    async with ScaleHarness(
        handle,
        NAMESPACE,
        folder,
        nodes=args.nodes,
        cidrs=(args.cidr,),
        operator_args=operator_args,
        log=log,
        record=args.record,
        live_view=True,
    ) as h:
        phases = Phases(h)
        try:
            r = await phases.run(
                "ramp",
                scenarios.ramp(
                    h,
                    args.pods,
                    args.objects_per_pod,
                    log,
                    shared_per_pod=args.shared_per_pod,
                    settle_timeout=args.settle_timeout,
                ),
            )
            ramp_cpu = phases.rows[-1][2]
            figures.update(
                pods=r.pods,
                objects=r.objects,
                claims=r.claims,
                pods_running_s=r.pods_running_s,
                created_per_s=r.created_per_s,
                api_writes_per_private_object=r.api_writes_per_private_object,
                api_writes_per_shared_object=r.api_writes_per_shared_object,
            )
            extra["ramp"] = (
                f"{r.seconds:.0f} s (target 600): {r.private_objects} private objects put in {r.private_s:.1f} s,"
                f" {r.shared_objects} shared in {r.shared_s:.1f} s (policy {args.record}), statuses settled"
                f" {fmt(r.statuses_settled_s)} s after their writes landed; fleet RSS {r.fleet_rss_mib[0]:.0f} MiB with"
                f" the agents up, {r.fleet_rss_mib[1]:.0f} MiB with every object put"
            )
            extra["fleet write budget"] = pacing_line(args.fleet_write_budget, r.pacing)
            extra["shared writes refused"] = (
                f"{fmt(r.shared_refused_per_object)} per shared object answered non-2xx (429, 409, 5xx, time-out)"
            )
            extra["shared writes by answer"] = (
                ", ".join(f"{k} {v:.3f}" for k, v in list(r.shared_writes_by_answer.items())[:14]) or "none"
            )
            for label, by in (("private", r.private_writes_by_resource), ("shared", r.shared_writes_by_resource)):
                extra[f"object writes per {label} object"] = (
                    ", ".join(f"{k} {v:.3f}" for k, v in list(by.items())[:8]) or "none"
                )
            extra["ramp API writes per object"] = f"{r.api_writes_per_object:.2f} (every client): " + ", ".join(
                f"{k} {v:.2f}" for k, v in list(r.writes_by_resource.items())[:8]
            )
            extra["ramp operator CPU per object"] = f"{1e3 * ramp_cpu.get('operator', 0) / max(1, r.objects):.2f} ms"
            extra["ramp API server CPU per object"] = (
                f"{1e3 * ramp_cpu.get('kube-apiserver', 0) / max(1, r.objects):.2f} ms"
            )
            extra["ramp etcd CPU per object"] = f"{1e3 * ramp_cpu.get('etcd', 0) / max(1, r.objects):.2f} ms"
            rs = await phases.run("cold restart", scenarios.cold_restart(h, log))
            figures.update(restart_synced_s=rs.synced_s, restart_audited_s=rs.audited_s, operator_rss_mib=rs.rss_mib)
            extra["restart frees (must be 0)"] = f"{rs.frees} seen by the fleet, {rs.operator_frees:.0f} counted"
            caught_up = await phases.run("status catch-up", scenarios.statuses_settled(h, args.settle_timeout, log))
            extra["status writes caught up"] = f"{caught_up:.1f} s after the cold restart's audit"
            lv = await phases.run("live view", scenarios.live_view(h, args.live_view_samples, log))
            figures.update(live_view_lag_p99_s=lv.lag_p99_s, live_view_list_all_s=lv.list_all_s)
            extra["live view"] = (
                f"{lv.listed} listed of {lv.expected} held, in {lv.pages} pages; lag median "
                f"{fmt(lv.lag_median_s)} s over {lv.samples} samples, {lv.unseen} not listed in 30 s; one GET by"
                f" name took {fmt(lv.get_median_s)} s median, {fmt(lv.get_p99_s)} s p99; the list began past"
                " the view's 1 s cache (its first page read every agent)"
            )
            idle = await phases.run("idle", scenarios.idle(h, args.idle_seconds, log))
            figures.update(
                idle_operator_writes_per_min=idle.operator_writes_per_min,
                liveness_requests_per_pod_s=idle.liveness_per_pod_s,
            )
            extra["idle lease writes per min"] = f"{idle.lease_writes_per_min:.1f} (operator lease and kwok's nodes)"
            extra["idle all API writes per min"] = f"{idle.all_writes_per_min:.1f}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in list(idle.writes_by_resource.items())[:8]
            )
            extra["idle operator CPU"] = f"{100 * idle.operator_cpu_s / idle.seconds:.1f}% of a core"
            dead_count = max(2, round(len(h.fleet.alive()) * args.dead_fraction))  # type: ignore[union-attr]
            d = await phases.run("dead holders", scenarios.dead_holders(h, dead_count, log))
            figures["dead_holder_detect_p99_s"] = d.detect_p99_s
            extra["dead holders"] = (
                f"{d.pods} processes, {d.claims} claims, median {fmt(d.detect_median_s)} s, "
                f"early deaths p99 {fmt(d.early_p99_s)} s, {d.undetected} not freed in time"
            )
            s = await phases.run("storm", scenarios.storm(h, 0.10, log))
            figures.update(storm_pods=s.pods, storm_clean_s=s.clean_s, storm_mutating_p99_s=s.mutating_p99_s)
            extra["storm"] = f"{s.referenced} objects referenced by the deleted pods, {s.unfreed} not freed in time"
            c = await phases.run("churn", scenarios.churn(h, args.churn_rates, args.churn_seconds, 0.5, log))
            best = c.best()
            churn_p99 = best.mutating_p99_s if best else (c.steps[0].mutating_p99_s if c.steps else None)
            figures.update(
                churn_per_s=best.achieved_per_s if best else None,
                churn_mutating_p99_s=best.mutating_p99_s if best else None,
                writes_per_recorded_lifecycle=best.writes_per_lifecycle
                if best
                else (c.steps[0].writes_per_lifecycle if c.steps else None),
            )
            for step in c.steps:
                # Not a lifecycle's writes: Leases (kwok's nodes, the operator's), written with nothing changing;
                # the idle phase measured them, and this step's window would hold as many.
                baseline = idle.lease_writes_per_min * step.seconds / 60
                extra[f"churn at {step.target_per_s:g}/s"] = (
                    f"achieved {step.achieved_per_s:.2f}/s (launched {step.launched_per_s:.2f}/s, landed"
                    f" {step.landed_per_s:.2f}/s; launcher late {step.late_p99_s * 1e3:.0f} ms p99,"
                    f" {step.late_max_s * 1e3:.0f} ms max), p99 {fmt(step.mutating_p99_s)} s,"
                    f" {step.writes_per_lifecycle:.3f} object writes each, {step.unfreed} unfreed; not counted:"
                    f" {step.other_writes:.0f} other writes in its {step.seconds:.0f} s (idle Lease baseline"
                    f" {baseline:.0f}); per lifecycle, every write: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in list(step.writes_by_resource.items())[:8])
                    + (f"; {pacing_line(args.fleet_write_budget, step.pacing)}" if args.fleet_write_budget else "")
                )
            audits = await phases.run("audit", scenarios.audit_at_size(h, args.audit_sizes, args.audit_timeout, log))
            for a in audits:
                extra[f"audit at {a.objects} objects"] = f"{a.reclaimed}/{a.objects} orphans reclaimed" + (
                    f" in {a.seconds:.1f}s" if a.seconds is not None else " (not all in time)"
                )
            leaked = await phases.run("end", scenarios.settle_leaks(h, args.settle_seconds))
            figures.update(wrong_frees=h.fleet.wrong_frees, leaked_bytes_end=leaked)  # type: ignore[union-attr]
            extra["wrong-freed bytes"] = str(h.fleet.wrong_free_bytes)  # type: ignore[union-attr]
        finally:
            instead = {"churn": churn_p99} if churn_p99 is not None else {}
            figures["mutating_p99_s_max"] = phases.mutating_p99_max(instead)
            figures["mutating_sli_p99_s_max"] = phases.sli_p99_max()
            figures["others_apf_wait_p99_s_max"] = phases.others_wait_p99_max()
            extra["mutating p99 without APF queueing"] = (
                f"{fmt(figures['mutating_sli_p99_s_max'])} s, worst phase (apiserver_request_sli_duration_seconds, "
                "what the API-call latency SLO is measured on)"
            )
            extra["APF wait of every other level"] = (
                f"{fmt(figures['others_apf_wait_p99_s_max'])} s p99, worst phase (levels but {WORKLOADS_LEVEL})"
            )
            print_table(figures, phases, extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=1000)
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--objects-per-pod", type=int, default=100, help="objects each pod puts, shared ones included")
    p.add_argument(
        "--shared-per-pod", type=int, default=10, help="of those, handed off to the next pod (held by its claim)"
    )
    p.add_argument(
        "--record", choices=("all", "shared"), default="shared", help="the fleet's recording policy (GPUOBJ_RECORD)"
    )
    p.add_argument("--live-view-samples", type=int, default=50, help="objects whose live-view lag is measured")
    p.add_argument("--idle-seconds", type=float, default=300.0)
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=3600.0,
        help="longest wait for every status: in the ramp (its shared-write figure) and before the idle window",
    )
    p.add_argument("--dead-fraction", type=float, default=0.02, help="share of pods whose process restarts")
    p.add_argument("--churn-rates", type=float, nargs="+", default=[25, 50, 100, 150, 200, 400])
    p.add_argument("--churn-seconds", type=float, default=10.0, help="length of each churn step")
    p.add_argument("--audit-sizes", type=int, nargs="+", default=[10, 1000, 10000])
    p.add_argument("--audit-timeout", type=float, default=180.0)
    p.add_argument(
        "--fleet-write-budget",
        type=float,
        default=100.0,
        help="the operator's --fleet-write-budget: API writes a second the fleet's pods share (0: none, each pod "
        "backs off on its own); 100 is about what the chart's workloads APF level (10 shares) passes on this "
        "2-core dev control plane (docs/scale.md, 'A budget the fleet shares')",
    )
    p.add_argument("--audit-interval", type=float, default=10.0, help="the operator's --audit-interval")
    p.add_argument("--leak-grace", type=float, default=30.0, help="the operator's --leak-grace")
    p.add_argument("--settle-seconds", type=float, default=60.0, help="longest wait for leaks to clear at the end")
    p.add_argument("--cidr", default=DEFAULT_CIDR, help="kwok's pod CIDR, made local on this machine")
    p.add_argument("--json", help="write every figure here")
    p.add_argument(
        "--apf-queue-length",
        type=int,
        help="the workloads' priority level's queueLengthLimit instead of deploy/flowcontrol.yaml's (to compare)",
    )
    p.add_argument(
        "--apf-workload-shares",
        type=int,
        help="the workloads' priority level's nominalConcurrencyShares instead of deploy/flowcontrol.yaml's",
    )
    p.add_argument(
        "--no-flowcontrol",
        action="store_true",
        help="leave out the chart's APF objects (deploy/flowcontrol.yaml): the fleet in the cluster's own levels",
    )
    p.add_argument(
        "--no-fail-on-miss",
        action="store_true",
        help="exit 0 even when a figure misses its target (by default such a run exits 1)",
    )
    args = p.parse_args(argv)
    if why := can_route():
        print(f"bench/scale.py: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    folder = Path(tempfile.mkdtemp(prefix="gpuobj-scale-"))
    figures: dict = {}
    cluster = DevCluster(folder / "cluster", tie_to_parent=True, log=log)
    try:
        handle = ClusterHandle(cluster, cluster.up())
        handle.apply_crds()
        if not args.no_flowcontrol:
            install_flowcontrol(handle, args.apf_queue_length, args.apf_workload_shares)
        asyncio.run(run(args, handle, folder, figures))
    except KeyboardInterrupt:
        log("interrupted: tearing everything down")
        return 130
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps({key: figures.get(key) for key in KEYS}, indent=2))
            log(f"figures written to {args.json}")
        cluster.down(quiet=True)
        log(f"control plane down; kwok's log is under {folder}")
    if missed := misses(figures):
        why = " (exit 0: --no-fail-on-miss)" if args.no_fail_on_miss else ""
        log(f"{len(missed)} target(s) missed: {', '.join(missed)}{why}")
        return 0 if args.no_fail_on_miss else 1
    log("every target met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
