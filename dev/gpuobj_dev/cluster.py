"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

Why: gpuobj's correctness rests on real API semantics (status subresources, finalizers,
resourceVersion conflicts, watches, schema validation, ownerReference garbage
collection, RBAC). There is no kubelet and no scheduler: Pods are API objects whose
status a test or the demo sets, each pointing at a local agent process.

The same code backs `gpuobj-dev dev-cluster up|down|status|env` and the pytest fixture.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gpuobj_dev import toolchain
from gpuobj_dev.pki import DevPKI

DEFAULT_STATE_DIR = toolchain.CACHE_ROOT / "dev-cluster"
SERVICE_CIDR = "10.96.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
FRONT_PROXY_CN = "front-proxy-client"  # the only client the requestheader CA vouches for as a proxy
CONTROLLERS = "garbagecollector,namespace,serviceaccount,serviceaccount-token"
# With a node: Deployments become pods, pods get their namespace's kube-root-ca.crt ConfigMap, and the
# node lifecycle controller lifts the not-ready taint the kubelet registers with.
NODE_CONTROLLERS = "deployment,replicaset,root-ca-cert-publisher,podgc,nodelifecycle"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager")


class DevClusterError(RuntimeError):
    """The control plane could not be started; the message names the log to read."""


@dataclass
class ClusterState:
    """What `up` started, persisted so `down`, `status` and `env` find it from another process."""

    state_dir: str
    etcd_client_port: int = 0
    etcd_peer_port: int = 0
    apiserver_port: int = 0
    kcm_port: int = 0
    pids: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0
    node: bool = False

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together, so the kernel cannot hand one out twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pid_is_ours(pid: int, marker: str) -> bool:
    """Only signal processes whose command line names our state dir: pids get reused."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def _die_with_parent() -> None:
    """preexec_fn: have the kernel kill the child when the process that started it dies."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class DevCluster:
    """Start, inspect and stop one loopback control plane whose state lives in ``state_dir``."""

    def __init__(
        self, state_dir: Path = DEFAULT_STATE_DIR, *, tie_to_parent: bool = False, log=print, node: bool = False
    ) -> None:
        self.state_dir = Path(state_dir)
        self.with_node = node
        # Dockerfile targets built and loaded into the node (the pause image always is).
        self.node_targets: tuple[str, ...] = ("operator", "agent")
        self.tie_to_parent = tie_to_parent
        self.log = log
        self.pki = DevPKI(self.state_dir / "pki")
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.logs = self.state_dir / "logs"
        self._state_file = self.state_dir / "state.json"

    # ------------------------------------------------------------ state

    def load_state(self) -> ClusterState | None:
        try:
            return ClusterState(**json.loads(self._state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _save_state(self, state: ClusterState) -> None:
        self._state_file.write_text(json.dumps(asdict(state), indent=2))

    def running(self) -> ClusterState | None:
        """The recorded state when every component is alive and the API server is ready."""
        state = self.load_state()
        if not state or set(state.pids) != set(COMPONENTS):
            return None
        if not all(_pid_alive(p) for p in state.pids.values()):
            return None
        return state if self._get(state, "/readyz", timeout=3) == (200, "ok") else None

    # ------------------------------------------------------------ up

    def up(self, timeout: float = 120.0, attempts: int = 3) -> ClusterState:
        """Start the control plane; harmless when it already runs.

        Ports are picked free just before use, yet another process on the machine can take one
        in between: a component that dies of "address already in use" is retried on new ports.
        """
        existing = self.running()
        if existing:
            self.log(f"dev cluster already up at {existing.server}")
            return existing
        for attempt in range(1, attempts + 1):
            try:
                return self._up_once(timeout)
            except DevClusterError as exc:
                if attempt == attempts or "address already in use" not in str(exc):
                    raise
                self.log(f"a port was taken meanwhile; starting again ({str(exc).splitlines()[0]})")
        raise AssertionError("unreachable")

    def _up_once(self, timeout: float) -> ClusterState:
        if self.state_dir.exists():
            self.down(quiet=True)
        binaries = toolchain.ensure(["etcd", "kubernetes"])
        started = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        etcd_client, etcd_peer, apiserver, kcm = _free_ports(4)
        state = ClusterState(
            state_dir=str(self.state_dir),
            etcd_client_port=etcd_client,
            etcd_peer_port=etcd_peer,
            apiserver_port=apiserver,
            kcm_port=kcm,
            started_at=time.time(),
            node=self.with_node,
        )
        self._write_pki_and_kubeconfigs(state)
        try:
            self._start_etcd(state, binaries["etcd"])
            self._wait(lambda: self._etcd_healthy(state), "etcd", timeout, "etcd")
            self._start_apiserver(state, binaries["kube-apiserver"])
            self._wait(
                lambda: self._get(state, "/readyz") == (200, "ok"), "kube-apiserver /readyz", timeout, "kube-apiserver"
            )
            self._start_kcm(state, binaries["kube-controller-manager"])
            self._wait(
                lambda: self._kcm_healthy(state), "kube-controller-manager /healthz", timeout, "kube-controller-manager"
            )
            # Pods need the namespace's default ServiceAccount, which the serviceaccount controller makes.
            self._wait(
                lambda: self._get(state, "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
                "default ServiceAccount",
                timeout,
                "kube-controller-manager",
            )
            if self.with_node:
                self._node_up(state, timeout)
        except BaseException:
            self.down(quiet=True)
            raise
        self.log(f"dev cluster up in {time.monotonic() - started:.1f}s at {state.server}")
        return state

    def _write_pki_and_kubeconfigs(self, state: ClusterState) -> None:
        self.pki.create()
        self.pki.issue(
            "apiserver",
            "kube-apiserver",
            server_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            server_ips=("127.0.0.1", "10.96.0.1"),
        )
        admin = self.pki.issue("admin", "gpuobj-dev-admin", org="system:masters")
        kcm = self.pki.issue("kube-controller-manager", "system:kube-controller-manager")
        self._write_kubeconfig(self.kubeconfig, state, admin.cert, admin.key, "gpuobj-dev-admin")
        self._write_kubeconfig(self.state_dir / "kcm.kubeconfig", state, kcm.cert, kcm.key, "kube-controller-manager")

    def _write_kubeconfig(self, path: Path, state: ClusterState, cert: Path, key: Path, user: str) -> None:
        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "gpuobj-dev",
                    "cluster": {"server": state.server, "certificate-authority-data": b64(self.pki.ca.cert)},
                }
            ],
            "users": [{"name": user, "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
            "contexts": [
                {"name": "gpuobj-dev", "context": {"cluster": "gpuobj-dev", "user": user, "namespace": "default"}}
            ],
            "current-context": "gpuobj-dev",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)

    def _spawn(self, state: ClusterState, name: str, argv: list[str]) -> None:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.state_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.tie_to_parent else None,
            )
        state.pids[name] = proc.pid
        self._save_state(state)

    def _start_etcd(self, state: ClusterState, etcd: Path) -> None:
        peer = f"http://127.0.0.1:{state.etcd_peer_port}"
        client = f"http://127.0.0.1:{state.etcd_client_port}"
        self._spawn(
            state,
            "etcd",
            [
                str(etcd),
                "--name",
                "gpuobj-dev",
                "--data-dir",
                str(self.state_dir / "etcd"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"gpuobj-dev={peer}",
                "--listen-metrics-urls",
                "",
                # A loopback dev store: durability across power loss is not worth the fsync latency.
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )

    def _start_apiserver(self, state: ClusterState, binary: Path) -> None:
        pki = self.pki.root
        self._spawn(
            state,
            "kube-apiserver",
            [
                str(binary),
                f"--etcd-servers=http://127.0.0.1:{state.etcd_client_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={state.apiserver_port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--authorization-mode=RBAC",
                "--anonymous-auth=false",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--event-ttl=1h",
                *self._kubelet_client_flags(state),
                *self._aggregator_flags(),
                "--v=1",
            ],
        )

    def _aggregator_flags(self) -> list[str]:
        """Aggregated APIs (the live view, docs/live-view.md): the API server proxies to them as
        front-proxy-client, naming the user in X-Remote-* headers the extension server trusts through the
        requestheader CA it reads from kube-system/extension-apiserver-authentication. Routing goes to the
        Service's endpoint IPs: there is no kube-proxy here to make a ClusterIP reachable."""
        proxy = self.pki.issue("front-proxy-client", FRONT_PROXY_CN)
        return [
            f"--requestheader-client-ca-file={self.pki.ca.cert}",
            f"--requestheader-allowed-names={FRONT_PROXY_CN}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={proxy.cert}",
            f"--proxy-client-key-file={proxy.key}",
            "--enable-aggregator-routing=true",
        ]

    def _kubelet_client_flags(self, state: ClusterState) -> list[str]:
        """With a node: how the API server reaches the kubelet (logs, exec) by its InternalIP, as a CA-signed client."""
        if not state.node:
            return []
        client = self.pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", org="system:masters")
        return [
            f"--kubelet-client-certificate={client.cert}",
            f"--kubelet-client-key={client.key}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    def _start_kcm(self, state: ClusterState, binary: Path) -> None:
        pki = self.pki.root
        kubeconfig = self.state_dir / "kcm.kubeconfig"
        self._spawn(
            state,
            "kube-controller-manager",
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
                "--bind-address=127.0.0.1",
                f"--secure-port={state.kcm_port}",
                f"--controllers={CONTROLLERS + (',' + NODE_CONTROLLERS if state.node else '')}",
                # Each controller acts as its own ServiceAccount, as in kubeadm clusters: RBAC is real.
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--leader-elect=false",
                "--concurrent-gc-syncs=20",
                "--v=1",
            ],
        )

    def node(self):
        from gpuobj_dev.node import Node

        return Node(self.state_dir, log=self.log, preexec=_die_with_parent if self.tie_to_parent else None)

    def _node_up(self, state: ClusterState, timeout: float) -> None:
        node = self.node()
        t0 = time.monotonic()
        node.up(self, state, timeout=timeout, ports=_free_ports(3), targets=self.node_targets)
        node.wait_ready(self, timeout)
        self.log(f"node ready in {time.monotonic() - t0:.1f}s")

    def _wait(self, ready, what: str, timeout: float, component: str) -> None:
        deadline = time.monotonic() + timeout
        state = self.load_state()
        while time.monotonic() < deadline:
            if ready():
                return
            pid = state.pids.get(component) if state else None
            if pid and not _pid_alive(pid):
                log = self.logs / (component + ".log")
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else ""
                raise DevClusterError(f"{component} exited while waiting for {what}; see {log}\n{tail}")
            time.sleep(0.1)
        raise DevClusterError(
            f"timed out after {timeout:.0f}s waiting for {what}; see {self.logs / (component + '.log')}"
        )

    # ------------------------------------------------------------ probes

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        ctx.load_cert_chain(str(self.pki.root / "admin.crt"), str(self.pki.root / "admin.key"))
        return ctx

    def _get(self, state: ClusterState, path: str, timeout: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(state.server + path, context=self._ssl_context(), timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""
        except (OSError, ssl.SSLError):
            return 0, ""

    def _etcd_healthy(self, state: ClusterState) -> bool:
        try:
            url = f"http://127.0.0.1:{state.etcd_client_port}/health"
            with urllib.request.urlopen(url, timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _kcm_healthy(self, state: ClusterState) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # kcm serves a self-signed certificate of its own
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{state.kcm_port}/healthz", context=ctx, timeout=2) as r:
                return r.status == 200
        except (OSError, ssl.SSLError):
            return False

    # ------------------------------------------------------------ down

    def down(self, *, quiet: bool = False, timeout: float = 15.0) -> None:
        """Stop every process `up` started (reverse order) and remove the state."""
        state = self.load_state()
        if (state and state.node) or (self.state_dir / "node").is_dir():
            forced = self.node().down()
            if forced and not quiet:
                self.log(f"removed leftovers of the node: {', '.join(forced)}")
        if state:
            marker = str(self.state_dir)
            # One at a time, in reverse: kube-apiserver shuts down promptly only while etcd still answers.
            for name in reversed(COMPONENTS):
                pid = state.pids.get(name)
                if not pid or not _pid_alive(pid) or not _pid_is_ours(pid, marker):
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while _pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _pid_alive(pid) and _pid_is_ours(pid, marker):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        if self.state_dir.exists():
            subprocess.call(["rm", "-rf", str(self.state_dir)])
        if not quiet:
            self.log("dev cluster down" if state else "dev cluster was not running")

    # ------------------------------------------------------------ outages (chaos tests)

    def stop_component(self, name: str, timeout: float = 15.0) -> None:
        """Stop one component, as an outage would; ``start_component`` brings it back (same ports, same data).

        Call both from the thread that started the cluster: with ``tie_to_parent`` a component dies with
        the thread that spawned it."""
        state = self.load_state()
        if state is None or name not in COMPONENTS:
            raise DevClusterError(f"no running dev cluster component {name!r}")
        pid = state.pids.get(name)
        if not pid or not _pid_alive(pid) or not _pid_is_ours(pid, str(self.state_dir)):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _pid_alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def start_component(self, name: str, timeout: float = 60.0) -> None:
        """Start a component stopped by ``stop_component`` and wait until the API server is ready again."""
        state = self.load_state()
        if state is None:
            raise DevClusterError("no dev cluster state")
        binaries = toolchain.ensure(["etcd", "kubernetes"])
        if name == "etcd":
            self._start_etcd(state, binaries["etcd"])
            self._wait(lambda: self._etcd_healthy(state), "etcd", timeout, "etcd")
        elif name == "kube-apiserver":
            self._start_apiserver(state, binaries["kube-apiserver"])
        elif name == "kube-controller-manager":
            self._start_kcm(state, binaries["kube-controller-manager"])
        else:
            raise DevClusterError(f"unknown component {name!r}")
        self._wait(lambda: self._get(state, "/readyz") == (200, "ok"), "kube-apiserver /readyz", timeout, name)

    # ------------------------------------------------------------ env

    def env(self) -> dict[str, str]:
        """Environment a shell needs to use this cluster with kubectl and helm."""
        path = os.pathsep.join([*toolchain.bin_path_entries(), os.environ.get("PATH", "")])
        # kubectl's discovery cache per cluster: loopback ports are reused by later clusters.
        return {"KUBECONFIG": str(self.kubeconfig), "PATH": path, "KUBECACHEDIR": str(self.state_dir / "kube-cache")}

    def status_lines(self) -> list[str]:
        state = self.load_state()
        if not state:
            return [f"dev cluster: not running (state dir {self.state_dir})"]
        ready = self._get(state, "/readyz")
        lines = [f"dev cluster: {state.server} readyz={ready[1] or ready[0]}"]
        for name in COMPONENTS:
            pid = state.pids.get(name)
            alive = "running" if pid and _pid_alive(pid) else "stopped"
            lines.append(f"  {name:24} pid {pid}  {alive}  log {self.logs / (name + '.log')}")
        node_state = self.node().load() if state.node else None
        for name, pid in (node_state.pids if node_state else {}).items():
            alive = "running" if _pid_alive(pid) else "stopped"
            lines.append(f"  {name:24} pid {pid}  {alive}  log {self.logs / (name + '.log')}")
        lines.append(f"  kubeconfig {self.kubeconfig}")
        return lines
