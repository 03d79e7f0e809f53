"""`gpuobj demo`: what gpuobj does, end to end, on the embedded dev control plane, in a couple of minutes.

Everything is real: etcd, kube-apiserver and kube-controller-manager on loopback, the
operator, three workload pods (Pod objects whose status the demo sets, each a local
process running the client library with its embedded agent), NIXL moving the bytes, and
a Prometheus scraping it all. Then trouble on purpose: a holder pod is killed and an
orphan is left in an agent, and the operator cleans both up. Ctrl-C or an error leaves
no process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

from gpuobj_contract import metric_names as m
from gpuobj_dev.cluster import DEFAULT_STATE_DIR, DevCluster
from gpuobj_dev.testing import agent_http, agent_tls
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import OPERATOR_SA, WORKLOAD_SA, credentials, install_identities, operator_subject
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_dev.testing.workload import WorkloadProcess
from gpuobj_kube.client import NAMESPACES, NotFound
from gpuobj_kube.informer import wait_for

NAMESPACE = "gpuobj-demo"
MIB = 1 << 20
PODS = ("producer-0", "transform-0", "consumer-0")


def _gbps(fetch: dict) -> float:
    return fetch["bytes"] / fetch["seconds"] / 1e9


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.items = 8 if args.quick else 32
        self.item_kib = 256 if args.quick else 1024
        self.weights_mib = 8 if args.quick else 64
        self.orphan_mib = 4 if args.quick else 16
        self.leak_grace = 4 if args.quick else 10
        self.steps = 12
        self.policy_size = "small"  # the ~46 M-parameter Qwen2 (gpuobj_dev.models), in both runs
        self.policy_steps = 5
        self.step_no = 0
        self.stack = contextlib.ExitStack()
        self.workloads: dict[str, WorkloadProcess] = {}
        self.report: dict[str, Any] = {"objects": 0}
        self.phases: list[tuple[str, float, float]] = []  # (label, start, end) in unix seconds, for the plot
        self.scraped: dict[str, dict[str, str]] = {}  # agent endpoint -> its pod's labels, every pod started
        self.started = time.time()
        self.out = Path(args.out).resolve()

    # ------------------------------------------------------------ output

    @contextlib.contextmanager
    def step(self, text: str, phase: str | None = None):
        """A numbered step; with `phase`, its span is shaded and labelled in the plot."""
        self.step_no += 1
        t0, wall = time.monotonic(), time.time()
        print(f"[{self.step_no:2d}/{self.steps}] {text} ...", flush=True)
        yield
        if phase:
            self.phases.append((phase, wall, time.time()))
        print(f"        done in {time.monotonic() - t0:.1f}s", flush=True)

    def say(self, text: str) -> None:
        print(f"        {text}", flush=True)

    def show_objects(self, title: str) -> None:
        table = self.cluster.kubectl("get", "gpuobj", "-n", NAMESPACE).stdout.rstrip() or "(no gpuobj resources)"
        print(f"        $ kubectl get gpuobj -n {NAMESPACE}    # {title}")
        for line in table.splitlines():
            print(f"        {line}")

    # ------------------------------------------------------------ the run

    def run(self) -> int:
        with self.stack:
            self.bring_up()
            self.share_weights()
            self.pipeline()
            self.release_weights()
            self.weight_sync()
            self.kill_holder_pod()
            self.plant_orphan()
            self.check_dashboard()
            self.finish()
        ok = self.report.get("leaked_bytes_end") == 0 and self.report.get("wrong_items") == 0
        return 0 if ok and self.report.get("weight_sync_ok") else 1

    def bring_up(self) -> None:
        state_dir = Path(self.args.state_dir)
        with self.step("starting the control plane (etcd, kube-apiserver, kube-controller-manager)"):
            cluster = DevCluster(state_dir, tie_to_parent=not self.args.keep, log=self.say)
            already = cluster.running() is not None
            state = cluster.up()
            if not self.args.keep and not already:
                self.stack.callback(cluster.down, quiet=True)
            self.cluster = ClusterHandle(cluster, state)
            # Agents serve TLS (as the chart runs them): what looks at them reads the agent CA as admin.
            agent_http.use_agent_ca(agent_http.ca_from_secret(lambda *a: self.cluster.kubectl(*a).stdout))
        with self.step("installing the CRDs from crds/, a fresh namespace and the chart's ServiceAccounts and RBAC"):
            self.cluster.apply_crds()
            self._fresh_namespace()
            install_identities(self.cluster, NAMESPACE)
            # The operator and every pod run as their own ServiceAccounts with projected tokens, never as admin.
            self.identities = state_dir / "identities"
            self.operator_creds = credentials(self.cluster, NAMESPACE, OPERATOR_SA, self.identities / "operator")
            self.stack.callback(self.operator_creds.stop)
        tls = "TLS to every agent" if agent_tls.enabled() else "plain HTTP to agents"
        with self.step(f"starting the operator and three workload pods ({tls})"):
            op = OperatorProcess(
                self.operator_creds.kubeconfig,
                self.operator_creds.agent_token,
                identity="gpuobj-operator-demo",
                lease_namespace=NAMESPACE,
                extra_args=[
                    "--namespace",
                    NAMESPACE,
                    "--audit-interval",
                    "1",
                    "--leak-settle",
                    "1",
                    "--leak-grace",
                    str(self.leak_grace),
                    # A platform team's byte quota for the namespace, far above what the demo holds.
                    "--namespace-quota",
                    f"{NAMESPACE}=4Gi",
                ],
            )
            self.stack.callback(op.stop)
            self.operator = op.start().wait_ready()
            self.say(f"operator leading, metrics at {op.metrics_url}/metrics")
            with ThreadPoolExecutor(len(PODS)) as pool:
                for name, w in zip(PODS, pool.map(self._start_pod, PODS), strict=True):
                    self.workloads[name] = w
            self.say("pods: " + ", ".join(f"{n} (agent {w.endpoint})" for n, w in self.workloads.items()))
        with self.step("starting Prometheus, scraping the operator and the agents every second"):
            from gpuobj_dev.observability.scrape import AGENT_JOB, OPERATOR_JOB
            from gpuobj_dev.testing.prometheus import Prometheus

            self.operator_addr = self.operator.metrics_url.removeprefix("http://")  # type: ignore[union-attr]
            self.scraped = {w.endpoint: {"namespace": NAMESPACE, "pod": name} for name, w in self.workloads.items()}
            tls = frozenset({AGENT_JOB}) if agent_tls.enabled() else frozenset()
            self.prom = Prometheus(
                {OPERATOR_JOB: [self.operator_addr], AGENT_JOB: list(self.scraped)},
                target_labels=self.scraped,
                https_jobs=tls,
            )
            self.stack.callback(self.prom.stop)
            self.prom.start()
            self.prom.wait_targets_up(timeout=30)
            self.observed_from = time.time()
            self.say(f"Prometheus at {self.prom.url}")

    def _fresh_namespace(self) -> None:
        async def go() -> None:
            async with self.cluster.client() as kube:
                with contextlib.suppress(NotFound):
                    await kube.delete(NAMESPACES, NAMESPACE)
                    await wait_for(kube, NAMESPACES, NAMESPACE, None, lambda o: o is None, timeout=60)
                await kube.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})

        asyncio.run(go())

    def _start_pod(self, name: str) -> WorkloadProcess:
        from gpuobj_dev.testing.workload import free_port

        port = free_port()

        async def create() -> dict:
            async with self.cluster.client() as kube:
                return await create_agent_pod(kube, NAMESPACE, name, port=port, service_account=WORKLOAD_SA)

        pod = asyncio.run(create())
        creds = credentials(
            self.cluster, NAMESPACE, WORKLOAD_SA, self.identities / name, pod=(name, pod["metadata"]["uid"])
        )
        self.stack.callback(creds.stop)
        w = WorkloadProcess(
            pod_name=name,
            namespace=NAMESPACE,
            pod_uid=pod["metadata"]["uid"],
            port=port,
            token_file=creds.agent_token,
            kubeconfig=creds.kubeconfig,
            env={"GPUOBJ_OPERATOR_SERVICEACCOUNT": operator_subject(NAMESPACE)},
        )
        self.stack.callback(w.kill)
        return w.start()

    def _scrape(self, pods: dict[str, WorkloadProcess]) -> None:
        """Add pods started after Prometheus to its targets: the picture and summary cover every pod."""
        from gpuobj_dev.observability.scrape import AGENT_JOB, OPERATOR_JOB

        self.scraped |= {w.endpoint: {"namespace": NAMESPACE, "pod": name} for name, w in pods.items()}
        self.prom.set_targets({OPERATOR_JOB: [self.operator_addr], AGENT_JOB: list(self.scraped)}, self.scraped)
        self.prom.wait_targets_up(timeout=30)

    def share_weights(self) -> None:
        producer = self.workloads["producer-0"]
        text = f"producer-0 puts {self.weights_mib} MiB of weights and shares them with two readers"
        with self.step(text, phase="weights shared"):
            producer.run("from gpuobj_dev.demo import roles")
            producer.run(f"weights, checksum = roles.put_weights(client, {self.weights_mib})")
            self.report["objects"] += 1
            checksum = producer.eval("checksum")
            fetches = []
            for reader in ("transform-0", "consumer-0"):
                shared = producer.eval_pickle(f"client.share(weights, {reader!r})")
                w = self.workloads[reader]
                w.run(f"from gpuobj_dev.demo import roles; weights = client.adopt(load_pickle({shared!r}))")
                read = f"roles.read_weights(client, weights, {checksum!r})"
                # The first fetch from a source connects to its NIXL agent; the second is the steady state.
                fetches.append((w.eval(read), w.eval(read)))
            for reader, (first, again) in zip(("transform-0", "consumer-0"), fetches, strict=True):
                self.say(
                    f"{reader} fetched {first['bytes'] / MIB:.0f} MiB in {first['seconds'] * 1000:.1f} ms "
                    f"({_gbps(first):.2f} GB/s, connecting), again in {again['seconds'] * 1000:.1f} ms "
                    f"({_gbps(again):.2f} GB/s), checksums {'ok' if first['ok'] and again['ok'] else 'WRONG'}"
                )
            self.report["weights_fetch_gbps"] = max(_gbps(first) for first, _ in fetches)
            self.report["weights_fetch_again_gbps"] = max(_gbps(again) for _, again in fetches)
            self.report["weights_ok"] = all(f["ok"] for pair in fetches for f in pair)
            self._wait_state("weights", lambda o: o and (o.get("status") or {}).get("references") == 3)
            self.show_objects("the owner's reference plus two claims")

    def pipeline(self) -> None:
        n, kib = self.items, self.item_kib
        text = f"streaming {n} activations of {kib} KiB: producer-0 -> transform-0 (x*2+1) -> consumer-0"
        with self.step(text, phase="stream"):
            calls = {
                "producer-0": f"roles.produce(client, 'activations', {n}, {kib})",
                "transform-0": "roles.transform(client, 'activations', 'features')",
                "consumer-0": "roles.consume(client, 'features')",
            }
            with ThreadPoolExecutor(3) as pool:
                futures = {name: pool.submit(self.workloads[name].eval, expr, 300) for name, expr in calls.items()}
                # Once the producer is done, the items not yet consumed are visible in the API.
                futures_wait([futures["producer-0"]], timeout=300)
                if not all(f.done() for f in futures.values()):
                    self.show_objects("mid-stream: items not yet consumed are alive")
                results = {name: f.result(timeout=300) for name, f in futures.items()}
            consumed = results["consumer-0"]
            self.report["objects"] += 2 * n
            self.report["wrong_items"] = consumed["wrong"]
            rate = consumed["items"] / max(consumed["seconds"], 1e-9)
            self.say(
                f"consumer-0 read {consumed['items']} items in order ({rate:.0f} items/s), "
                f"{consumed['wrong']} wrong; every item was released once read"
            )
            for stream in ("activations", "features"):
                self.cluster.kubectl(
                    "delete", "gpuobjectstream", stream, "-n", NAMESPACE, "--wait=true", "--timeout=60s"
                )
            self.show_objects("streams consumed and deleted")

    def release_weights(self) -> None:
        with self.step("the readers release the weights, then the producer drops its own reference", phase="freed"):
            for reader in ("transform-0", "consumer-0"):
                self.workloads[reader].run("weights.release()")
            self._wait_state("weights", lambda o: (o.get("status") or {}).get("references") == 1)
            self.workloads["producer-0"].run("weights.release(); del weights")
            t0 = time.monotonic()
            self._wait_state("weights", lambda o: o is None)
            self.say(
                f"out of scope: freed on producer-0 and deregistered from NIXL; GPUObject gone "
                f"{(time.monotonic() - t0) * 1000:.0f} ms after the last release"
            )

    def weight_sync(self) -> None:
        """A trainer publishes a real model's weights each step; two rollouts compute with exactly them."""
        from gpuobj_dev.testing.workload import pickled, unpickled

        rollouts = ["rollout-0", "rollout-1"]
        steps = self.policy_steps
        text = f"weight sync: trainer-0 publishes a Qwen2 model {steps} times to rollout-0 and rollout-1"
        with self.step(text, phase="weight sync"):
            names = ["trainer-0", *rollouts]
            with ThreadPoolExecutor(len(names)) as pool:
                pods = dict(zip(names, pool.map(self._start_pod, names), strict=True))
            self._scrape(pods)
            setup = "from gpuobj_dev.demo import weight_sync as ws; scene = ws.{}(client, {!r})"
            with ThreadPoolExecutor(len(names)) as pool:  # each builds its model (transformers, random init)
                list(pool.map(lambda n: pods[n].run(setup.format("Rollout" if n in rollouts else "Trainer",
                                                                  self.policy_size), 600), names))  # fmt: skip
            trainer, ok = pods["trainer-0"], True
            # The floor: one raw NIXL READ of a version's bytes, trainer -> rollout-0, this machine, this run.
            offer = trainer.eval_pickle("scene.raw_offer()", 300)
            raw_s = statistics.median(pods["rollout-0"].eval(f"scene.raw_read(load_pickle({offer!r}))", 300))
            trainer.run("scene.raw_close()")
            versions = []
            for version in range(1, steps + 1):
                published = unpickled(trainer.eval_pickle(f"scene.publish({version}, {rollouts!r})", 300))
                self.report["objects"] += 1
                taken = {
                    name: pods[name].eval(f"scene.take(load_pickle({pickled(published['shares'][name])!r}))", 300)
                    for name in rollouts
                }
                same = all(t["logits"] == published["logits"] for t in taken.values())
                ok = ok and same
                pack = published["pack"]
                verdict = "equal to the trainer's, bit for bit" if same else "DIFFERENT from the trainer's"
                # A version's critical path: the trainer's put (pack + publish), then the slowest rollout's
                # fetch; the floor: the same put, then one raw READ of the same bytes.
                put_s, fetch_s = published["put_s"], max(t["fetch_s"] for t in taken.values())
                timing = {
                    "bytes": published["bytes"],
                    "put_s": put_s,
                    "slowest_fetch_s": fetch_s,
                    "floor_s": put_s + raw_s,
                }
                timing["floor_ratio"] = (put_s + fetch_s) / timing["floor_s"]
                versions.append(timing)
                self.say(
                    f"step {version}: {published['tensors']} tensors, {published['bytes'] / MIB:.0f} MiB in one "
                    f"object; rollout logits {verdict}; trainer pack buffers {pack['buffers']} "
                    f"(NIXL regions, reused {pack['reused']} times)"
                )
                self.say(
                    f"        put {put_s * 1000:.0f} ms + slowest fetch {fetch_s * 1000:.0f} ms = "
                    f"{(put_s + fetch_s) * 1000:.0f} ms; floor (put + raw NIXL READ {raw_s * 1000:.0f} ms) "
                    f"{timing['floor_s'] * 1000:.0f} ms: {timing['floor_ratio']:.2f}x the floor"
                )
                self.show_objects(f"after step {version}: the new version, and the previous one until it is freed")
            for name in names:
                pods[name].run("scene.finish()")
            self._wait_gone("policy-v", timeout=60)
            self.show_objects("every version freed")
            for name in names:
                pods[name].stop(timeout=60)

            async def delete() -> None:
                async with self.cluster.client() as kube:
                    for name in names:
                        await delete_pod(kube, NAMESPACE, name)

            asyncio.run(delete())
            self.report["weight_sync_ok"] = ok
            self.report["weight_sync_versions"] = versions
            self.report["weight_sync_raw_read_s"] = raw_s
            # From the second version on: the first pays the rollouts' connection to the trainer's agent.
            self.report["weight_sync_floor_ratio_median"] = statistics.median(v["floor_ratio"] for v in versions[1:])
            self.say(f"{steps} versions; every rollout's logits equal the trainer's: {ok}")

    def _wait_gone(self, prefix: str, timeout: float) -> None:
        """Until no GPUObject whose name starts with `prefix` is left."""
        from gpuobj_kube.client import GPUOBJECTS

        async def go() -> None:
            async with self.cluster.client() as kube:
                deadline = time.monotonic() + timeout
                while True:
                    items = (await kube.list(GPUOBJECTS, NAMESPACE))["items"]
                    if not any(o["metadata"]["name"].startswith(prefix) for o in items):
                        return
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"GPUObjects {prefix}* still there after {timeout}s")
                    await asyncio.sleep(0.2)

        asyncio.run(go())

    def kill_holder_pod(self) -> None:
        with self.step("trouble: a pod holding the last reference to a checkpoint dies", phase="holder dies"):
            producer, consumer = self.workloads["producer-0"], self.workloads["consumer-0"]
            producer.run("ckpt = client.put([torch.ones(1 << 20)], name='checkpoint')")
            self.report["objects"] += 1
            shared = producer.eval_pickle("client.share(ckpt, 'consumer-0')")
            consumer.run(f"ckpt = client.adopt(load_pickle({shared!r}))")
            # A checkpoint outlives the write-behind window: wait until the object and the claim are
            # recorded in the API (a short-lived object would never be written at all).
            producer.run("client.flush()")
            producer.run("ckpt.release()")
            self._wait_state("checkpoint", lambda o: ((o or {}).get("status") or {}).get("state") == "Releasing")
            self.show_objects("checkpoint held only by consumer-0's claim")
            consumer.kill()

            async def delete() -> None:
                async with self.cluster.client() as kube:
                    await delete_pod(kube, NAMESPACE, "consumer-0")

            asyncio.run(delete())
            self.say("consumer-0 deleted: kube-controller-manager garbage-collects its claim")
            self._wait_state("checkpoint", lambda o: o is None, timeout=60)
            self.show_objects("checkpoint freed on producer-0")

    def plant_orphan(self) -> None:
        from gpuobj_dev.observability import queries as q

        text = f"trouble: {self.orphan_mib} MiB left in producer-0's agent that nothing references"
        with self.step(text, phase="orphan reclaimed"):
            producer = self.workloads["producer-0"]
            producer.run(f"client.agent.put('o-demo-orphan', [torch.ones({self.orphan_mib} * (1 << 18))])")
            leaked = self.prom.wait_for_series(q.LEAKED_TOTAL, lambda r: r and float(r[0]["value"][1]) > 0, timeout=60)
            peak = float(leaked[0]["value"][1])
            self.report["leaked_bytes_peak"] = peak
            self.say(
                f"Prometheus: gpuobj_leaked_bytes = {peak / MIB:.0f} MiB on {NAMESPACE}/producer-0 "
                f"(reclaimed after the {self.leak_grace}s grace period)"
            )
            self.prom.wait_for_series(q.LEAKED_TOTAL, lambda r: r and float(r[0]["value"][1]) == 0, timeout=60)
            events = json.loads(
                self.cluster.kubectl(
                    "get", "events", "-n", NAMESPACE, "--field-selector", "reason=LeakReclaimed", "-o", "json"
                ).stdout
            )
            for event in events["items"]:
                self.say(f"Event {event['reason']} on pod/{event['involvedObject']['name']}: {event['message']}")
            self.say("leaked bytes back to 0")

    def check_dashboard(self) -> None:
        from gpuobj_dev.observability.dashboard import panel_queries
        from gpuobj_dev.observability.queries import for_prometheus

        with self.step("running every panel query of the leaked-bytes dashboard against Prometheus"):
            window = f"{int(time.time() - self.started) + 60}s"
            panels: dict[str, bool] = {}
            for title, expr in panel_queries():
                result = self.prom.query(for_prometheus(expr, rate_interval=window, range_=window))
                panels[f"{title}: {expr}"] = bool(result)
            self.report["panels"] = panels
            with_data = sum(panels.values())
            self.say(f"{with_data}/{len(panels)} panel queries returned data")
            for name, ok in panels.items():
                if not ok:
                    self.say(f"no data: {name}")

    def finish(self) -> None:
        from gpuobj_dev.observability import queries as q
        from gpuobj_dev.observability.plot import plot_bytes

        with self.step("summary and plot"):
            end = time.time()
            self.out.mkdir(parents=True, exist_ok=True)
            plot = plot_bytes(
                self.prom, self.observed_from, end, self.out / "gpuobj-demo-bytes.png", phases=self.phases
            )
            # Counters over the whole run: the weight-sync pods are gone by now, their last values count.
            window = f"{int(end - self.observed_from) + 10}s"
            moved = self.prom.query(f"sum(max_over_time({m.AGENT_TRANSFER_BYTES}[{window}]))")
            synced = self.prom.query(
                f'sum(max_over_time({m.AGENT_TRANSFER_BYTES}{{pod=~"trainer-.*|rollout-.*"}}[{window}]))'
            )
            p50 = self.prom.query(f"histogram_quantile(0.5, sum by (le) ({m.FREE_LATENCY}_bucket))")
            p99 = self.prom.query(f"histogram_quantile(0.99, sum by (le) ({m.FREE_LATENCY}_bucket))")
            frees = self.prom.query(f"sum({m.FREES})")
            leaked = self.prom.query(q.LEAKED_TOTAL)
            value = lambda r: float(r[0]["value"][1]) if r else 0.0  # noqa: E731
            self.report.update(
                bytes_moved=value(moved),
                bytes_moved_weight_sync=value(synced),
                frees=value(frees),
                free_latency_p50_ms=value(p50) * 1000,
                free_latency_p99_ms=value(p99) * 1000,
                leaked_bytes_end=value(leaked),
                plot=str(plot),
            )
        r = self.report
        print("\nsummary")
        print(f"  GPUObjects created      {r['objects']}")
        print(f"  frees acknowledged      {r['frees']:.0f}")
        print(f"  bytes moved by NIXL     {r['bytes_moved'] / MIB:.1f} MiB "
              f"(weight sync {r['bytes_moved_weight_sync'] / MIB:.1f} MiB), every pod scraped")  # fmt: skip
        print(f"  weights fetch           first {r['weights_fetch_gbps']:.2f} GB/s (connecting), "
              f"again {r['weights_fetch_again_gbps']:.2f} GB/s")  # fmt: skip
        print(f"  weight sync             {self.policy_steps} versions, rollout logits bit for bit: "
              f"{r.get('weight_sync_ok')}; median {r['weight_sync_floor_ratio_median']:.2f}x the floor "
              f"(put + raw NIXL READ) from version 2")  # fmt: skip
        print(f"  free latency            p50 {r['free_latency_p50_ms']:.1f} ms, p99 {r['free_latency_p99_ms']:.1f} ms")
        print(
            f"  leaked bytes            {r['leaked_bytes_end']:.0f}"
            f" (peak {r.get('leaked_bytes_peak', 0) / MIB:.0f} MiB, reclaimed)"
        )
        print(f"  dashboard panels        {sum(r['panels'].values())}/{len(r['panels'])} with data")
        print(f"  plot                    {r['plot']}")
        if self.args.report:
            Path(self.args.report).write_text(json.dumps(r, indent=2))
        if self.args.keep:
            print("\nthe control plane keeps running:")
            print(f'  eval "$(gpuobj-dev dev-cluster env --state-dir {self.args.state_dir})"')
            print(f"  kubectl get gpuobj,events -n {NAMESPACE}")
            print(f"  gpuobj-dev dev-cluster down --state-dir {self.args.state_dir}")

    def _wait_state(self, name: str, predicate, timeout: float = 30) -> None:
        from gpuobj_kube.client import GPUOBJECTS

        async def go() -> None:
            async with self.cluster.client() as kube:
                await wait_for(kube, GPUOBJECTS, name, NAMESPACE, predicate, timeout=timeout)

        asyncio.run(go())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuobj demo", description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true", help="leave the control plane running and print how to reach it")
    p.add_argument("--quick", action="store_true", help="smaller objects and a shorter leak grace period")
    p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="the dev control plane's state directory")
    p.add_argument("--out", default="out", help="where the plot is written")
    p.add_argument("--report", help="also write the summary as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
    try:
        return Demo(args).run()
    except KeyboardInterrupt:
        print("\ninterrupted: everything the demo started has been stopped", file=sys.stderr)
        return 130
    except Exception as exc:
        print(
            f"\ndemo failed: {type(exc).__name__}: {exc}\neverything the demo started has been stopped", file=sys.stderr
        )
        return 1
