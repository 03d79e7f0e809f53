"""Run the real operator as a subprocess (tests, demo): started, waited for, stopped, checked."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

from gpuobj_dev.testing import agent_tls
from gpuobj_dev.testing.processes import terminate
from gpuobj_dev.testing.waits import wait_until


class OperatorProcess:
    """`gpuobj operator` in its own process, with its output captured for assertions and failures."""

    def __init__(
        self,
        kubeconfig: Path,
        token_file: Path,
        *,
        identity: str = "op-1",
        lease_namespace: str = "default",
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = [
            sys.executable,
            "-m",
            "gpuobj.cli",
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--token-file",
            str(token_file),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--identity",
            identity,
            "--lease-namespace",
            lease_namespace,
            # The dev control plane has no pod network: agents listen on loopback at the port the
            # pod's annotations name. Production operators never take a host from an annotation.
            "--allow-agent-host-annotation",
            # TLS to agents as the harness runs them (on by default, as the chart), unless extra_args say.
            *agent_tls.operator_args(extra_args or []),
        ]
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.identity = identity
        self.proc: subprocess.Popen[str] | None = None
        self.lines: deque[str] = deque(maxlen=5000)
        self.metrics_url: str | None = None
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None

    def start(self) -> OperatorProcess:
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        line = self.wait_for_line(r"metrics and probes on (http://\S+)", timeout=60)
        self.metrics_url = re.search(r"(http://\S+)", line).group(1)  # type: ignore[union-attr]
        return self

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip())
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, timeout: float) -> str:
        """Block until the operator printed a line matching ``pattern`` (or fail with its output)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if rx.search(line):
                        return line
                if self.proc and self.proc.poll() is not None and not (self._reader and self._reader.is_alive()):
                    raise AssertionError(
                        f"operator exited ({self.proc.returncode}) before {pattern!r}:\n{self.output()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"operator did not print {pattern!r} within {timeout}s:\n{self.output()}")
                self._cond.wait(timeout=min(left, 1.0))

    def wait_ready(self, timeout: float = 60) -> OperatorProcess:
        self.wait_for_line(r"synced and reconciling", timeout)
        return self

    def output(self) -> str:
        return "\n".join(list(self.lines)[-200:])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``; 0.0 when absent."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                    total += sample.value
        return total

    def wait_metric(self, name: str, labels: dict[str, str] | None, value: float, timeout: float = 30) -> None:
        """Wait until ``metric(name, labels) == value``.

        The operator counts a free once the finalizer is off, so a watcher can see the object
        gone a moment before the counter moves: wait for the figure instead of reading it once.
        """
        seen: list[float] = []

        def reached() -> bool:
            seen.append(self.metric(name, labels))
            return seen[-1] == value

        try:
            wait_until(reached, f"{name}{labels or ''} == {value}", timeout, 0.02)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {seen[-1]}") from None

    def kill(self) -> None:
        """SIGKILL: the crash case (no lease release, nothing flushed)."""
        if self.proc:
            terminate(self.proc, timeout=10, sig=signal.SIGKILL)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; returns the exit code."""
        if not self.proc:
            return 0
        if not terminate(self.proc, timeout):
            raise AssertionError(f"operator did not stop within {timeout}s:\n{self.output()}")
        if self._reader:
            self._reader.join(timeout=5)
        return self.proc.returncode
