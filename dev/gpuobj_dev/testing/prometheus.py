"""A real Prometheus on loopback for tests and the demo: started, queried, waited on, stopped.

Why real: the dashboard's and alert rules' PromQL only proves anything when a real
Prometheus evaluates it over series it scraped from real exporters. The binary is the
pinned one built from the Go module proxy (gpuobj_dev.toolchain). The scrape config comes
from gpuobj_dev.observability.scrape, so the harness applies the same label policy
(``honor_labels`` on the operator job) as the chart's ServiceMonitor.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpuobj_dev import toolchain
from gpuobj_dev.observability.scrape import HONOR_LABELS_JOBS, scrape_config
from gpuobj_dev.testing.processes import terminate

# A vector or matrix result: [{"metric": {...}, "value": [ts, "v"]} | {"metric": {...}, "values": [[ts, "v"], ...]}].
Result = list[dict[str, Any]]


class PrometheusError(RuntimeError):
    """Prometheus did not start, answered an error, or a wait timed out; the message has its log."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to Prometheus if the test process dies first."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def sample_value(sample: Mapping[str, Any]) -> float:
    """The float value of one instant-vector sample."""
    return float(sample["value"][1])


class Prometheus:
    """One ``prometheus`` process scraping static targets every second, with its TSDB in a temp dir.

    Use as a context manager (or call ``start``/``stop``)::

        with Prometheus({"gpuobj-operator": [op_addr]}) as prom:
            prom.wait_for_series("gpuobj_operator_leader", lambda r: sample_value(r[0]) == 1, timeout=30)
    """

    def __init__(
        self,
        targets: Mapping[str, Sequence[str]] | None = None,
        *,
        target_labels: Mapping[str, Mapping[str, str]] | None = None,
        honor_labels_jobs: frozenset[str] = HONOR_LABELS_JOBS,
        https_jobs: frozenset[str] = frozenset(),
        rule_files: Sequence[Path] = (),
        scrape_interval: str = "1s",
        binary: Path | None = None,
    ) -> None:
        self.targets = {job: list(addrs) for job, addrs in (targets or {}).items()}
        self.target_labels = dict(target_labels or {})
        self.honor_labels_jobs = honor_labels_jobs
        self.https_jobs = https_jobs
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval = scrape_interval
        self.binary = binary
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._dir is not None, "not started"
        return self._dir / "prometheus.log"

    def config(self) -> dict:
        """The prometheus.yml this instance runs with."""
        cfg = scrape_config(
            self.targets,
            interval=self.scrape_interval,
            target_labels=self.target_labels,
            honor_labels_jobs=self.honor_labels_jobs,
            https_jobs=self.https_jobs,
        )
        if self.rule_files:
            cfg["rule_files"] = [str(p) for p in self.rule_files]
        return cfg

    def _write_config(self) -> Path:
        assert self._dir is not None
        path = self._dir / "prometheus.yml"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        tmp.replace(path)
        return path

    def start(self, timeout: float = 60) -> Prometheus:
        """Start Prometheus and wait until /-/ready answers; retries if its port was taken meanwhile."""
        binary = self.binary or toolchain.binary("prometheus")
        self._dir = Path(tempfile.mkdtemp(prefix="gpuobj-prometheus-"))
        config = self._write_config()
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            self.port = _free_port()
            args = [
                str(binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                # Hidden flag: the scrape manager applies discovered targets every 5s by default; tests
                # would wait that long for the first scrape after start and after set_targets.
                "--scrape.discovery-reload-interval=200ms",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, cwd=self._dir, preexec_fn=_die_with_parent
                )
            try:
                self._wait_ready(deadline)
                return self
            except PrometheusError:
                exited = self.proc.poll() is not None
                self._terminate()
                if not exited or "address already in use" not in self.log_path.read_text() or attempt == 2:
                    self._cleanup()
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited ({self.proc.returncode}) before ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready at {self.url}:\n{self.log_tail()}")
            time.sleep(0.1)

    def _terminate(self, timeout: float = 10) -> None:
        """SIGTERM, wait, SIGKILL on timeout: Prometheus flushes its head block on SIGTERM."""
        if self.proc is not None:
            terminate(self.proc, timeout)

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def stop(self, timeout: float = 10) -> None:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout``) and delete its storage."""
        self._terminate(timeout)
        self._cleanup()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Prometheus:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AssertionError):
            return "(no log)"

    # ------------------------------------------------------------ targets

    def set_targets(
        self, targets: Mapping[str, Sequence[str]], target_labels: Mapping[str, Mapping[str, str]] | None = None
    ) -> None:
        """Replace the scrape targets and reload (``/-/reload``): agents may start after Prometheus."""
        self.targets = {job: list(addrs) for job, addrs in targets.items()}
        if target_labels is not None:
            self.target_labels = dict(target_labels)
        self._write_config()
        self._request("/-/reload", method="POST")

    def targets_health(self) -> list[dict[str, Any]]:
        """Active targets: job, address (``scrapeUrl``), health (up/down/unknown) and the last error."""
        data = self._api("/api/v1/targets", {"state": "active"})
        return [
            {
                "job": t["labels"].get("job", t.get("scrapePool", "")),
                "instance": t["labels"].get("instance", ""),
                "scrape_url": t.get("scrapeUrl", ""),
                "health": t.get("health", "unknown"),
                "last_error": t.get("lastError", ""),
            }
            for t in data["activeTargets"]
        ]

    def wait_targets_up(self, timeout: float = 30) -> list[dict[str, Any]]:
        """Wait until every configured target has been scraped successfully at least once."""
        expected = sum(len(a) for a in self.targets.values())

        def all_up() -> list[dict[str, Any]] | None:
            health = self.targets_health()
            return health if len(health) == expected and all(t["health"] == "up" for t in health) else None

        return self._poll(all_up, timeout, lambda: f"targets not all up: {self.targets_health()}")

    # ------------------------------------------------------------ rules

    def rule_health(self) -> dict[str, str]:
        """Loaded rules by name (alert or record) -> health: "ok", "err" or "unknown" (not evaluated yet)."""
        groups = self._api("/api/v1/rules")["groups"]
        return {r["name"]: r.get("health", "unknown") for g in groups for r in g["rules"]}

    def wait_rules_evaluated(self, timeout: float = 30) -> dict[str, str]:
        """Wait until every loaded rule has been evaluated once; returns ``rule_health()``."""

        def evaluated() -> dict[str, str] | None:
            health = self.rule_health()
            return health if health and "unknown" not in health.values() else None

        return self._poll(evaluated, timeout, lambda: f"rules not all evaluated: {self.rule_health()}")

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing), each with labels, annotations, state and value."""
        return self._api("/api/v1/alerts")["alerts"]

    # ------------------------------------------------------------ queries

    def _request(self, path: str, params: Mapping[str, str] | None = None, method: str = "GET") -> bytes:
        url = f"{self.url}{path}"
        data = None
        if params and method == "GET":
            url += "?" + urllib.parse.urlencode(params)
        elif params:
            data = urllib.parse.urlencode(params).encode()
        req = urllib.request.Request(url, data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            raise PrometheusError(f"{method} {path} {dict(params or {})}: HTTP {exc.code}: {body}") from None

    def _api(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        # POST for queries: long PromQL stays out of the URL.
        body = json.loads(self._request(path, params, method="POST" if "query" in path else "GET"))
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params or {})}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> Result:
        """Instant query; returns the vector (a scalar result comes back as one label-less sample)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> Result:
        """Range query (unix seconds); returns the matrix."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return self._api("/api/v1/query_range", params)["result"]

    def wait_for_series(
        self, expr: str, predicate: Callable[[Result], bool] = bool, timeout: float = 30, interval: float = 0.2
    ) -> Result:
        """Poll an instant query until ``predicate(result)`` holds (default: any series); returns that result."""
        last: list[Result] = [[]]

        def check() -> Result | None:
            last[0] = self.query(expr)
            return last[0] if predicate(last[0]) else None

        return self._poll(
            check, timeout, lambda: f"{expr!r} never satisfied the predicate; last result {last[0]}", interval
        )

    def _poll(self, fn: Callable[[], Any], timeout: float, describe: Callable[[], str], interval: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                raise PrometheusError(f"prometheus is not running:\n{self.log_tail()}")
            value = fn()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                try:
                    detail = describe()
                except PrometheusError as exc:
                    detail = str(exc)
                raise PrometheusError(f"timed out after {timeout}s: {detail}\n{self.log_tail(10)}")
            time.sleep(interval)
