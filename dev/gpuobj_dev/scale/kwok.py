"""kwok out of cluster against the dev control plane: fake nodes, and pods on them Running with pod IPs.

Why kwok: it plays the kubelet of many nodes at a few MB each (node heartbeats, pod status, pod
deletion), so a 2-core machine holds a thousand pods. Pod IPs come from a CIDR of the run's own (the
fleet gives each pod its address, `Kwok.pod_ip`, and kwok reports it). That CIDR is made local on this
machine (`ip route add local <cidr> dev lo`), so the agent fleet can bind every pod's address on
loopback and the operator reaches each agent at `status.podIP`, the path it takes in production. The
route is removed on teardown; making it needs root.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
from pathlib import Path

import yaml

from gpuobj_dev import toolchain

# The real-node tests use 10.217.0.0/24 (the CNI bridge); the scale harness stays clear of it.
DEFAULT_CIDR = "10.218.0.0/16"
NODE_LABEL = "gpuobj.io/kwok-fleet"
# The fleet gives each pod its IP in this annotation, and kwok's stage reports it as status.podIP. kwok's
# own pool (v0.8) is made on first use with a Load, then a Store: two of its workers can each make one,
# and two pods then got the same first address (an agent's bind failed 'address already in use').
POD_IP_ANNOTATION = "kwok.gpuobj.io/pod-ip"


# kwok acts only through stages (v0.8 has none built in). Ours are the least a kubelet does for these
# pods: a node reports Ready; a pod bound to it gets Running, Ready and the IP its annotation names, once
# (a later status, e.g. a container restart the fleet reports, is left alone); a deleted pod is removed.
NODE_READY_TEMPLATE = """\
{{ $now := Now }}
conditions:
- type: Ready
  status: "True"
  reason: KubeletReady
  message: kwok node
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
addresses:
- type: InternalIP
  address: {{ NodeIP | Quote }}
- type: Hostname
  address: {{ .metadata.name | Quote }}
"""
POD_RUNNING_TEMPLATE = """\
{{ $now := Now }}
{{ $ip := index .metadata.annotations "@POD_IP_ANNOTATION@" }}
phase: Running
startTime: {{ $now | Quote }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ $ip | Quote }}
podIPs:
- ip: {{ $ip | Quote }}
conditions:
- type: Initialized
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
- type: ContainersReady
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
- type: Ready
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
""".replace("@POD_IP_ANNOTATION@", POD_IP_ANNOTATION)


def stages() -> list[dict]:
    """The kwok Stage objects of a run (written to kwok's --config)."""

    def stage(name: str, kind: str, expressions: list[dict], nxt: dict) -> dict:
        return {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Stage",
            "metadata": {"name": name},
            "spec": {
                "resourceRef": {"apiGroup": "v1", "kind": kind},
                "selector": {"matchExpressions": expressions},
                "next": nxt,
            },
        }

    ready = '.status.conditions.[] | select( .type == "Ready" ) | .status'
    return [
        stage(
            "gpuobj-node-ready",
            "Node",
            [{"key": ready, "operator": "NotIn", "values": ["True"]}],
            {"statusTemplate": NODE_READY_TEMPLATE},
        ),
        stage(
            "gpuobj-pod-running",
            "Pod",
            [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.podIP", "operator": "DoesNotExist"},
            ],
            {"statusTemplate": POD_RUNNING_TEMPLATE},
        ),
        stage(
            "gpuobj-pod-delete",
            "Pod",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
            {"delete": True},
        ),
    ]


class KwokError(RuntimeError):
    """kwok or its route could not be set up; the message says what to do."""


def can_route() -> str | None:
    """None when this process may add the local route, else why not (the scale tests skip with it)."""
    if os.geteuid() != 0:
        return "the kwok pod CIDR is made local with `ip route add local ... dev lo`, which needs root"
    if not Path("/sbin/ip").exists() and not Path("/usr/sbin/ip").exists() and not Path("/bin/ip").exists():
        return "iproute2 (`ip`) is not installed"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRoute:
    """`ip route add local <cidr> dev lo` for the lifetime of a run; every address in it binds on loopback."""

    def __init__(self, cidr: str) -> None:
        self.cidr = str(ipaddress.ip_network(cidr))
        self.added = False

    def add(self) -> None:
        why = can_route()
        if why:
            raise KwokError(why)
        proc = subprocess.run(
            ["ip", "route", "add", "local", self.cidr, "dev", "lo"], capture_output=True, text=True, timeout=10
        )
        if proc.returncode != 0:
            raise KwokError(
                f"ip route add local {self.cidr} dev lo failed: {proc.stderr.strip()} "
                "(another run may hold it: `ip route show table local` lists it; pick another --cidr)"
            )
        self.added = True

    def remove(self) -> None:
        if self.added:
            subprocess.run(
                ["ip", "route", "del", "local", self.cidr, "dev", "lo"], capture_output=True, text=True, timeout=10
            )
            self.added = False


class Kwok:
    """One kwok process managing the nodes labelled with this run's id, and the pods bound to them."""

    def __init__(
        self, kubeconfig: Path, log_dir: Path, *, run_id: str, cidrs: tuple[str, ...] = (DEFAULT_CIDR,)
    ) -> None:
        """`cidrs`: pod CIDRs to try in order; the first whose local route can be added is used (another
        run on the machine may hold one)."""
        self.kubeconfig = Path(kubeconfig)
        self.log_path = Path(log_dir) / "kwok.log"
        self.run_id = run_id
        self.cidrs = tuple(str(ipaddress.ip_network(c)) for c in cidrs)
        self.cidr = self.cidrs[0]
        self.route = LocalRoute(self.cidr)
        self.proc: subprocess.Popen | None = None

    def _take_route(self) -> None:
        errors = []
        for cidr in self.cidrs:
            route = LocalRoute(cidr)
            try:
                route.add()
            except KwokError as exc:
                errors.append(str(exc))
                continue
            self.cidr, self.route = cidr, route
            return
        raise KwokError("; ".join(errors))

    def node_ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        """Every node's IP: the first address of the run's CIDR (after `start`, which picks the CIDR)."""
        return ipaddress.ip_network(self.cidr).network_address + 1

    def pod_ip(self, n: int) -> str:
        """The `n`-th pod's address, the ones after the nodes' IP: unique by construction, never reused
        within the run."""
        network = ipaddress.ip_network(self.cidr)
        address = self.node_ip() + 1 + n
        if address >= network.broadcast_address:
            raise KwokError(f"pod CIDR {network} has no address left for pod {n}")
        return str(address)

    def node_body(self, name: str) -> dict:
        """A Node kwok takes over (by label); no taint, since pods are bound by spec.nodeName, not scheduled."""
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {NODE_LABEL: self.run_id, "type": "kwok", "kubernetes.io/hostname": name},
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "status": {
                "allocatable": {"cpu": "1000", "memory": "4Ti", "pods": "10000"},
                "capacity": {"cpu": "1000", "memory": "4Ti", "pods": "10000"},
            },
        }

    def start(self) -> None:
        binary = toolchain.ensure(["kwok"])["kwok"]
        self._take_route()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        config = self.log_path.parent / "kwok-stages.yaml"
        config.write_text(yaml.safe_dump_all(stages(), sort_keys=False))
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    str(binary),
                    f"--kubeconfig={self.kubeconfig}",
                    f"--config={config}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-label-selector={NODE_LABEL}={self.run_id}",
                    f"--cidr={self.cidr}",
                    f"--node-ip={self.node_ip()}",
                    f"--server-address=127.0.0.1:{_free_port()}",
                    "--node-lease-duration-seconds=40",
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.route.remove()
