"""A real Kubernetes node on this machine: containerd + runc, CNI bridge, kubelet, next to the dev control plane.

Why: the chart's Deployment, its probes, securityContext, in-cluster credentials, projected
ServiceAccount tokens and downward-API values only mean something when a kubelet runs the pods.
This machine has no Docker engine (no kind), but it has what a node is made of: root, network
namespaces, cgroups, Debian's runc/crun and CNI plugins; containerd 2.x, kubelet, kube-scheduler
and crictl are built from the Go module proxy (gpuobj_dev.toolchain).

Network: one bridge (``gpuobj0``, 10.217.0.0/24) that pods attach to with veths; pods route only
the bridge's subnet and the service CIDR. The only Service pods need is ``kubernetes`` (10.96.0.1:443):
one DNAT rule (in our own nat chain, matched on the bridge) sends it to the loopback API server, with
``route_localnet`` on the bridge alone. A FORWARD rule drops whatever pods send off the bridge, so no
packet leaves the machine. There is no kube-proxy and no cluster DNS.

``down`` removes everything ``up`` made: pod sandboxes through CRI (CNI DEL removes veths and IPs),
the kubelet, scheduler and containerd processes, leftover shims, mounts under the node's directories,
network namespaces, veths, the bridge, the iptables chains, the cgroups under ``gpuobj-node`` and the
ip_forward value it found. Images stay in containerd's store under ``~/.cache/gpuobj/node/`` (a cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpuobj_dev import hostpkgs, images, toolchain

NODE_NAME = "gpuobj-dev-node"
BRIDGE = "gpuobj0"
POD_SUBNET = "10.217.0.0/24"
GATEWAY = "10.217.0.1"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service (first address of cluster.SERVICE_CIDR)
CGROUP_PARENT = "gpuobj-node"
RUN_DIR = Path("/run/gpuobj-node")
CACHE_DIR = toolchain.CACHE_ROOT / "node"
CONTAINERD_ROOT = CACHE_DIR / "containerd"  # images persist across up/down: loading a 5 GB image is slow
NAT_CHAIN = "GPUOBJ-NODE-DNAT"
FWD_CHAIN = "GPUOBJ-NODE-FWD"
HOST_PACKAGES = ("runc", "crun", "containernetworking-plugins", "iptables", "iproute2", "mount")
HOST_COMMANDS = ("/usr/sbin/runc", "/usr/bin/crun", "/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "iptables", "ip")
NODE_PROCESSES = ("containerd", "kube-scheduler", "kubelet")


class NodeError(RuntimeError):
    """The node could not be started or torn down; the message names the log or the command."""


def unavailable_reason() -> str | None:
    """Why this host cannot run a node (the tests skip with this), or None when it can."""
    if os.geteuid() != 0:
        return "the dev node needs root (network namespaces, mounts, cgroups, iptables)"
    if not Path("/sys/fs/cgroup").is_dir() or not os.access("/sys/fs/cgroup", os.W_OK):
        return "the dev node needs a writable /sys/fs/cgroup"
    if not shutil.which("apt-get") and hostpkgs.missing(HOST_COMMANDS):
        return f"the dev node needs {list(HOST_PACKAGES)} and there is no apt-get to install them"
    return None


def run(cmd: list[str], *, check: bool = True, input: str | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


# ---------------------------------------------------------------- pure config (unit-tested)


def containerd_config(root: Path, state: Path, sock: Path, cni_conf_dir: Path) -> str:
    """containerd 2.x config (version 3): CRI with runc (default) and crun, our CNI dir, the local pause image."""
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{images.PAUSE_IMAGE}"

[{runtime}]
  enable_selinux = false
  netns_mounts_under_state_dir = true
  # Lowering oom_score_adj (the sandbox's -998) needs CAP_SYS_RESOURCE, which some sandboxes lack:
  # runc then fails with "can't get final child's PID from pipe: EOF". Clamp to containerd's own.
  restrict_oom_score_adj = true
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = "{state}/runc"
        SystemdCgroup = false
    [{runtime}.containerd.runtimes.crun]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.crun.options]
        BinaryName = "/usr/bin/crun"
        Root = "{state}/crun"
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni_conf_dir}"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_conflist(ipam_dir: Path) -> dict:
    """Bridge + host-local: pods on gpuobj0; routes only to the bridge subnet (implicit) and the service IP."""
    return {
        "cniVersion": "1.0.0",
        "name": "gpuobj-dev",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                    "routes": [{"dst": f"{SERVICE_IP}/32"}],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


def kubelet_config(*, sock: Path, port: int, healthz_port: int, ca: Path, pod_logs: Path) -> dict:
    """KubeletConfiguration: cgroupfs under /gpuobj-node, cgroup v1 allowed, no image GC (images cannot be pulled)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": GATEWAY,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{sock}",
        "imageServiceEndpoint": f"unix://{sock}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_PARENT}",
        "cgroupsPerQOS": True,
        # This machine has cgroups v1 (hybrid); Kubernetes 1.35+ refuses it unless told otherwise.
        "failCgroupV1": False,
        "failSwapOn": False,
        # Images are built here and cannot be pulled again: never garbage-collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "podLogsDir": str(pod_logs),
        "resolvConf": "",
        "serializeImagePulls": False,
        "registerNode": True,
        "maxPods": 32,
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "shutdownGracePeriod": "0s",
        "localStorageCapacityIsolation": True,
        "protectKernelDefaults": False,
        "makeIPTablesUtilChains": False,
    }


def iptables_rules(apiserver_port: int) -> list[tuple[str, list[str]]]:
    """(table, rule) pairs `up` adds to its own chains; `down` deletes the chains (and the jumps to them)."""
    return [
        (
            "nat",
            [
                *("-A", NAT_CHAIN, "-i", BRIDGE, "-d", f"{SERVICE_IP}/32", "-p", "tcp", "--dport", "443"),
                *("-j", "DNAT", "--to-destination", f"127.0.0.1:{apiserver_port}"),
            ],
        ),
        ("filter", ["-A", FWD_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP"]),
        ("filter", ["-A", FWD_CHAIN, "-o", BRIDGE, "!", "-i", BRIDGE, "-j", "DROP"]),
    ]


JUMPS = (("nat", "PREROUTING", NAT_CHAIN), ("filter", "FORWARD", FWD_CHAIN))


def cgroup_dirs() -> list[Path]:
    """Where our cgroup parent lives: every mounted v1 hierarchy, plus the unified (v2) one."""
    dirs = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype = post.split()[0] if post else ""
        if fstype in ("cgroup", "cgroup2"):
            dirs.append(Path(pre.split()[4]) / CGROUP_PARENT)
    return dirs


def mounts_under(*roots: Path) -> list[str]:
    """Mount points below any of `roots`, deepest first (the order to unmount them in)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(str(r) + "/") for r in roots):
            found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


# ---------------------------------------------------------------- the node


@dataclass
class NodeState:
    pids: dict[str, int]
    kubelet_port: int
    kubelet_healthz_port: int
    scheduler_port: int
    apiserver_port: int
    ip_forward: str
    sock: str


class Node:
    """Start and stop the node processes for one DevCluster (whose state dir holds logs and config)."""

    def __init__(self, state_dir: Path, *, log=print, preexec=None) -> None:
        self.dir = Path(state_dir) / "node"
        self.logs = Path(state_dir) / "logs"
        self.log = log
        # The cluster's die-with-parent hook (tests): a killed pytest takes the kubelet and containerd along.
        self._preexec = preexec
        self.sock = RUN_DIR / "containerd.sock"
        self.state_file = self.dir / "node.json"
        self.kubelet_root = self.dir / "kubelet"
        self.cni_conf_dir = self.dir / "cni"
        self.pod_logs = self.dir / "pods"

    # ------------------------------------------------------------ helpers

    def load(self) -> NodeState | None:
        try:
            return NodeState(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _save(self, state: NodeState) -> None:
        self.state_file.write_text(json.dumps(state.__dict__, indent=2))

    def crictl(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        crictl = toolchain.binary("crictl")
        return run(
            [str(crictl), "--runtime-endpoint", f"unix://{self.sock}", "--timeout", "30s", *args],
            check=check,
            timeout=timeout,
        )

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        ctr = toolchain.binary("ctr")
        return run(
            [str(ctr), "--address", str(self.sock), "--namespace", "k8s.io", *args], check=check, timeout=timeout
        )

    @staticmethod
    def ensure_host() -> None:
        hostpkgs.ensure(HOST_PACKAGES, commands=HOST_COMMANDS)
        toolchain.ensure(["kubernetes", *toolchain.NODE_TOOLS])

    # ------------------------------------------------------------ up

    def up(
        self, cluster, cluster_state, *, timeout: float = 120.0, ports: list[int], targets=("operator", "agent")
    ) -> NodeState:
        """Images, bridge, iptables, containerd, kube-scheduler, kubelet (then `wait_ready`)."""
        # One node per machine (one bridge, one containerd store): a second `up` fails before touching anything.
        if run(["ip", "link", "show", BRIDGE], check=False).strip():
            raise NodeError(f"bridge {BRIDGE} exists: another dev node runs here, or a leftover (`dev-cluster down`)")
        self.ensure_host()
        images.ensure(targets)
        for d in (self.dir, self.kubelet_root, self.cni_conf_dir, self.pod_logs, CONTAINERD_ROOT):
            d.mkdir(parents=True, exist_ok=True)
        kubelet_port, healthz_port, scheduler_port = ports
        state = NodeState(
            pids={},
            kubelet_port=kubelet_port,
            kubelet_healthz_port=healthz_port,
            scheduler_port=scheduler_port,
            apiserver_port=cluster_state.apiserver_port,
            ip_forward=Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
            sock=str(self.sock),
        )
        self._save(state)
        self._network_up(state)
        wanted = [images.PAUSE_IMAGE, *(images.TARGETS[t] for t in targets)]
        self._drop_stale_store(wanted)
        self._start_containerd(state, timeout)
        self.load_images(wanted)
        self._write_node_credentials(cluster, cluster_state)
        self._start_scheduler(cluster, state)
        self._start_kubelet(cluster, state)
        return state

    def _network_up(self, state: NodeState) -> None:
        if run(["ip", "link", "show", BRIDGE], check=False).strip():
            raise NodeError(
                f"bridge {BRIDGE} exists already: another dev node, or a leftover (`gpuobj-dev dev-cluster down`)"
            )
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        # Pods reach the API server on 10.96.0.1:443, DNATed to loopback: allowed on this bridge only.
        Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").write_text("1")
        for table, parent, chain in JUMPS:
            run(["iptables", "-t", table, "-N", chain])
            run(["iptables", "-t", table, "-I", parent, "-j", chain, "-m", "comment", "--comment", "gpuobj dev node"])
        for table, rule in iptables_rules(state.apiserver_port):
            run(["iptables", "-t", table, *rule])
        (self.cni_conf_dir / "10-gpuobj.conflist").write_text(json.dumps(cni_conflist(RUN_DIR / "ipam"), indent=2))

    def _spawn(self, state: NodeState, name: str, argv: list[str], env: dict | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as logf:
            proc = subprocess.Popen(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.dir,
                start_new_session=True,
                env=env or os.environ.copy(),
                preexec_fn=self._preexec,
            )
        state.pids[name] = proc.pid
        self._save(state)

    def _wait(self, ready, what: str, timeout: float, state: NodeState, component: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            pid = state.pids.get(component)
            if pid and not _alive(pid):
                raise NodeError(f"{component} exited while waiting for {what}:\n{self.log_tail(component)}")
            time.sleep(0.2)
        raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.log_tail(component)}")

    def log_tail(self, component: str, lines: int = 25) -> str:
        path = self.logs / f"{component}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []
        return f"({path})\n" + "\n".join(text)

    def _start_containerd(self, state: NodeState, timeout: float) -> None:
        bins = toolchain.ensure(["containerd"])
        config = self.dir / "containerd.toml"
        config.write_text(containerd_config(CONTAINERD_ROOT, RUN_DIR / "containerd", self.sock, self.cni_conf_dir))
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(bins["containerd"].parent), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        self._spawn(state, "containerd", [str(bins["containerd"]), "--config", str(config), "--log-level", "info"], env)
        self._wait(
            lambda: self.crictl("info", check=False, timeout=10).strip().startswith("{"),
            "containerd CRI",
            timeout,
            state,
            "containerd",
        )

    @staticmethod
    def _marker(name: str) -> Path:
        return CACHE_DIR / "loaded" / name.replace("/", "_")

    def _drop_stale_store(self, names: list[str]) -> None:
        """A fresh containerd store when any image changed since it was loaded: containerd (stopped between
        runs) leaves the old 6 GB agent snapshots on disk, so replacing images in place grows without bound."""
        current = {n: images.podman("image", "inspect", "--format", "{{.Digest}}", n).strip() for n in names}
        if all(self._marker(n).is_file() and self._marker(n).read_text() == d for n, d in current.items()):
            return
        if mounts_under(CONTAINERD_ROOT):
            raise NodeError(f"{CONTAINERD_ROOT} still has mounts: another dev node runs, or `dev-cluster down` it")
        shutil.rmtree(CONTAINERD_ROOT, ignore_errors=True)
        shutil.rmtree(CACHE_DIR / "loaded", ignore_errors=True)
        CONTAINERD_ROOT.mkdir(parents=True)

    def load_images(self, names: list[str]) -> None:
        """Import the locally built images into containerd's k8s.io namespace (skipped when already there)."""
        present = self.ctr("images", "ls", "-q", timeout=60).split()
        for name in names:
            podman_id = images.podman("image", "inspect", "--format", "{{.Digest}}", name).strip()
            marker = self._marker(name)
            if name in present and marker.is_file() and marker.read_text() == podman_id:
                continue
            started = time.monotonic()
            if name in present:  # the old build goes first, so its layers are collected before the new land
                self.ctr("images", "rm", "--sync", name, check=False)
            # Streamed (podman save | ctr import -): no multi-GB archive on disk in between.
            save = subprocess.Popen(
                ["podman", "save", "--format", "docker-archive", name],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=images.container_env(),
            )
            ctr = toolchain.binary("ctr")
            # Unpacked into a snapshot, the layer blobs are garbage: do not keep the image twice.
            load_cmd = [str(ctr), "--address", str(self.sock), "--namespace", "k8s.io", "images", "import"]
            load = subprocess.run(
                [*load_cmd, "--local", "--discard-unpacked-layers", "-"],
                stdin=save.stdout,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            assert save.stdout is not None
            save.stdout.close()
            save_err = save.stderr.read().decode() if save.stderr else ""
            if save.wait() != 0 or load.returncode != 0:
                raise NodeError(f"loading {name} into containerd failed: {save_err} {load.stderr}")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(podman_id)
            self.log(f"node: loaded {name} into containerd in {time.monotonic() - started:.0f}s")

    def _write_node_credentials(self, cluster, cluster_state) -> None:
        pki = cluster.pki
        kubelet = pki.issue("kubelet", f"system:node:{NODE_NAME}", org="system:nodes")
        sched = pki.issue("kube-scheduler", "system:kube-scheduler")
        cluster._write_kubeconfig(self.dir / "kubelet.kubeconfig", cluster_state, kubelet.cert, kubelet.key, "kubelet")
        cluster._write_kubeconfig(
            self.dir / "scheduler.kubeconfig", cluster_state, sched.cert, sched.key, "system:kube-scheduler"
        )
        # Without the Node authorizer, RBAC grants kubelets the system:node role through the system:nodes group.
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "gpuobj-dev:nodes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        }
        kubectl = toolchain.binary("kubectl")
        run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "apply", "-f", "-"], input=json.dumps(binding))

    def _start_scheduler(self, cluster, state: NodeState) -> None:
        kubeconfig = self.dir / "scheduler.kubeconfig"
        self._spawn(
            state,
            "kube-scheduler",
            [
                str(toolchain.binary("kube-scheduler")),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
                "--bind-address=127.0.0.1",
                f"--secure-port={state.scheduler_port}",
                "--leader-elect=false",
                "--v=1",
            ],
        )

    def _start_kubelet(self, cluster, state: NodeState) -> None:
        config = self.dir / "kubelet.yaml"
        config.write_text(
            json.dumps(
                kubelet_config(
                    sock=self.sock,
                    port=state.kubelet_port,
                    healthz_port=state.kubelet_healthz_port,
                    ca=cluster.pki.ca.cert,
                    pod_logs=self.pod_logs,
                ),
                indent=2,
            )
        )
        for d in cgroup_dirs():
            d.mkdir(exist_ok=True)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(["/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        self._spawn(
            state,
            "kubelet",
            [
                str(toolchain.binary("kubelet")),
                f"--config={config}",
                f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
                f"--root-dir={self.kubelet_root}",
                f"--cert-dir={self.dir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={GATEWAY}",
                "--v=1",
            ],
            env,
        )

    def wait_ready(self, cluster, timeout: float) -> None:
        """Until the Node reports Ready (CNI configured, runtime up)."""
        kubectl = toolchain.binary("kubectl")
        state = self.load()
        assert state is not None

        def ready() -> bool:
            out = run(
                [
                    str(kubectl),
                    "--kubeconfig",
                    str(cluster.kubeconfig),
                    "get",
                    "node",
                    NODE_NAME,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                ],
                check=False,
                timeout=20,
            )
            return out.strip() == "True"

        self._wait(ready, f"node {NODE_NAME} Ready", timeout, state, "kubelet")

    # ------------------------------------------------------------ down

    def down(self, *, timeout: float = 30.0) -> list[str]:
        """Remove everything `up` made; returns what it found left over and removed by force (for the log)."""
        state = self.load()
        forced: list[str] = []
        if state is None:  # `up` stopped before it made anything (or this is not our node): touch nothing
            if self.dir.is_dir() and not mounts_under(self.dir):
                shutil.rmtree(self.dir, ignore_errors=True)
            return forced
        pids = state.pids
        # 1. The kubelet first, so it does not restart what we stop; then sandboxes through CRI (CNI DEL).
        _stop(pids.get("kubelet"), timeout)
        _stop(pids.get("kube-scheduler"), timeout)
        if pids.get("containerd") and _alive(pids["containerd"]):
            for pod in self.crictl("pods", "-q", check=False).split():
                self.crictl("stopp", pod, check=False)
                self.crictl("rmp", "--force", pod, check=False)
        _stop(pids.get("containerd"), timeout)
        # 2. Shims whose containerd is gone (they carry our socket path on their command line).
        for pid in _pids_with(str(self.sock)):
            forced.append(f"process {pid}")
            _stop(pid, 5)
        # 3. Mounts: network namespaces, pod volumes (tokens), container rootfs.
        for point in mounts_under(RUN_DIR, self.dir, CONTAINERD_ROOT):
            if point != str(self.kubelet_root):  # the kubelet bind-mounts its own root dir: expected
                forced.append(f"mount {point}")
            subprocess.run(["umount", "--lazy", point], capture_output=True)
        # 4. Links: veths on our bridge, then the bridge.
        for link in _links_on_bridge():
            forced.append(f"veth {link}")
            run(["ip", "link", "del", link], check=False)
        if run(["ip", "link", "show", BRIDGE], check=False).strip():
            run(["ip", "link", "del", BRIDGE], check=False)
        # 5. iptables: the jumps, then our chains.
        for table, parent, chain in JUMPS:
            while (
                subprocess.run(
                    [
                        "iptables",
                        "-t",
                        table,
                        "-D",
                        parent,
                        "-j",
                        chain,
                        "-m",
                        "comment",
                        "--comment",
                        "gpuobj dev node",
                    ],
                    capture_output=True,
                ).returncode
                == 0
            ):
                pass
            subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True)
            subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(state.ip_forward)
        # 6. cgroups: leaves first.
        for root in cgroup_dirs():
            if root.is_dir():
                for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    root.rmdir()
        shutil.rmtree(RUN_DIR, ignore_errors=True)
        if not mounts_under(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
        return forced

    def leftovers(self) -> list[str]:
        """What of the node still exists on this machine (empty after a clean `down`)."""
        left = [f"process {p}" for p in _pids_with(str(self.sock))]
        left += [f"mount {m}" for m in mounts_under(RUN_DIR, self.dir, CONTAINERD_ROOT)]
        if run(["ip", "link", "show", BRIDGE], check=False).strip():
            left.append(f"bridge {BRIDGE}")
        left += [f"veth {v}" for v in _links_on_bridge()]
        for table, _, chain in JUMPS:
            if subprocess.run(["iptables", "-t", table, "-S", chain], capture_output=True).returncode == 0:
                left.append(f"iptables {table} {chain}")
        left += [f"cgroup {d}" for d in cgroup_dirs() if d.exists()]
        for netns in Path("/run/netns").glob("cni-*") if Path("/run/netns").is_dir() else []:
            left.append(f"netns {netns}")
        return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _stop(pid: int | None, timeout: float) -> None:
    if not pid or not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _pids_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return [p for p in found if p != os.getpid()]


def _links_on_bridge() -> list[str]:
    out = run(["ip", "-o", "link", "show", "master", BRIDGE], check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def main(argv: list[str] | None = None) -> int:
    """`make test` prepares the node's host packages and Go-built parts (containerd, crictl) as a step of its
    own, before pytest: on a fresh machine their first build takes ~15 min at load, which would otherwise be
    spent inside the first real-node test's time limit."""
    parser = argparse.ArgumentParser(prog="python -m gpuobj_dev.node", description=main.__doc__)
    parser.add_argument("action", choices=["prepare"], help="install and build what a node needs; start nothing")
    parser.add_argument(
        "--when-possible", action="store_true", help="on a host that cannot run a node, say why and succeed"
    )
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"gpuobj node: not prepared ({reason}); the real-node tests skip with that reason")
        return 0 if args.when_possible else 1
    started = time.monotonic()
    try:
        Node.ensure_host()
    except (hostpkgs.HostPackageError, toolchain.ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"gpuobj node: host packages, containerd and crictl ready in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
