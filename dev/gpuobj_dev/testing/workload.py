"""A workload pod's process for tests and the demo: the client library with its embedded agent.

Why a real process: a source pod's bytes must live in another address space than the
reader's for NIXL to move them for real, and teardown without deserialization (docs/design.md: at interpreter exit)
can only be shown by a process that exits.

The process connects a gpuobj.Client (``client``), then serves a tiny request loop on
stdin: the test sends Python statements (``run``) or expressions (``eval``) to execute
in the workload, with ``client``, ``torch`` and ``gpuobj`` in scope; results come back
as JSON (or as base64 pickles with ``eval_pickle``, e.g. a SharedRef to hand to another
workload). The workload's own code is the library's real code, in a real process.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gpuobj_dev.testing import agent_http, agent_tls
from gpuobj_dev.testing.processes import terminate

BOOTSTRAP = r"""
import base64, json, os, pickle, sys, traceback
import torch
import gpuobj

def load_pickle(text):
    return pickle.loads(base64.b64decode(text))

def dump_pickle(value):
    return base64.b64encode(pickle.dumps(value)).decode()

def reply(**values):
    sys.__stdout__.write("@@" + json.dumps(values) + "\n")
    sys.__stdout__.flush()

client = gpuobj.Client.connect(
    pod_name=os.environ["GPUOBJ_POD_NAME"], namespace=os.environ["GPUOBJ_POD_NAMESPACE"],
    pod_uid=os.environ["GPUOBJ_POD_UID"], token_file=os.environ["GPUOBJ_TOKEN_FILE"],
    host="127.0.0.1", port=int(os.environ["GPUOBJ_AGENT_PORT"]),
    kubeconfig=os.environ["KUBECONFIG"],
)
scope = {"client": client, "torch": torch, "gpuobj": gpuobj, "load_pickle": load_pickle, "dump_pickle": dump_pickle}
reply(ready=True, endpoint=client.agent.endpoint)
for line in sys.stdin:
    request = json.loads(line)
    try:
        if request["mode"] == "run":
            exec(request["code"], scope)
            reply(ok=True, value=None)
        else:
            value = eval(request["code"], scope)
            reply(ok=True, value=dump_pickle(value) if request["mode"] == "eval_pickle" else value)
    except BaseException as exc:
        reply(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    if request.get("exit"):
        break
"""


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
_RANDOM = random.Random()


def _below_ephemeral() -> range:
    """Ports the kernel never hands out for a bind to port 0 or an outgoing connection: below
    ip_local_port_range. An agent binds its port only once its certificate is issued (a second or so with
    TLS), and any process's ephemeral port taken from the kernel's range could land on it meanwhile."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, max(10001, low))


def free_port() -> int:
    """A free loopback port not handed out before by this process, outside the kernel's ephemeral range:
    a closed probe socket's port can come back from the kernel at once, to anyone, before the agent it was
    meant for has bound it."""
    ports = _below_ephemeral()
    with _HANDED_OUT_LOCK:
        for _ in range(1000):
            port = _RANDOM.choice(ports)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1} after 1000 tries")


def pickled(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def unpickled(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


class WorkloadError(AssertionError):
    """Code sent to a workload raised; the message carries the workload's traceback."""


class WorkloadProcess:
    def __init__(
        self,
        *,
        pod_name: str,
        namespace: str,
        pod_uid: str,
        port: int,
        token_file: Path,
        kubeconfig: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.source = BOOTSTRAP
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "GPUOBJ_POD_NAME": pod_name,
            "GPUOBJ_POD_NAMESPACE": namespace,
            "GPUOBJ_POD_UID": pod_uid,
            "GPUOBJ_AGENT_PORT": str(port),
            "GPUOBJ_TOKEN_FILE": str(token_file),
            "KUBECONFIG": str(kubeconfig),
            **agent_tls.workload_env(),  # the harness default (TLS on, as the chart); `env` may say otherwise
            **(env or {}),
        }
        self.proc: subprocess.Popen[str] | None = None
        self._values: queue.Queue[dict] = queue.Queue()
        self.log: list[str] = []

    def start(self, ready_timeout: float = 60) -> WorkloadProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.source],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", timeout=ready_timeout)
        agent_http.register(self.endpoint, self.env["GPUOBJ_POD_UID"], tls=agent_tls.serves_tls(self.env))
        return self

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.env['GPUOBJ_AGENT_PORT']}"

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._values.put(json.loads(line[2:]))
            else:
                self.log.append(line.rstrip())
        self._values.put({"__exit__": True})

    def _next(self, timeout: float) -> dict:
        try:
            values = self._values.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"workload did not answer within {timeout}s:\n{self.output()}") from None
        if values.get("__exit__"):
            self._values.put(values)
            raise AssertionError(f"workload exited ({self.proc.wait() if self.proc else None}):\n{self.output()}")
        return values

    def expect(self, key: str, timeout: float = 60) -> Any:
        while True:
            values = self._next(timeout)
            if key in values:
                return values[key]

    def _request(self, mode: str, code: str, timeout: float, exit: bool = False) -> Any:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(json.dumps({"mode": mode, "code": code, "exit": exit}) + "\n")
        self.proc.stdin.flush()
        answer = self._next(timeout)
        if not answer.get("ok"):
            raise WorkloadError(f"in workload: {answer.get('error')}\n{answer.get('trace', '')}")
        return answer.get("value")

    def run(self, code: str, timeout: float = 60) -> None:
        """Execute statements in the workload."""
        self._request("run", code, timeout)

    def eval(self, expr: str, timeout: float = 60) -> Any:
        """Evaluate an expression in the workload; its value must be JSON-able."""
        return self._request("eval", expr, timeout)

    def eval_pickle(self, expr: str, timeout: float = 60) -> str:
        """Evaluate and return the value pickled (base64), to pass to another workload."""
        return self._request("eval_pickle", expr, timeout)

    def output(self) -> str:
        return "\n".join(self.log[-100:])

    def wait(self, timeout: float = 60) -> int:
        assert self.proc
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"workload did not exit within {timeout}s:\n{self.output()}") from None

    def stop(self, timeout: float = 60) -> int:
        """Ask it to finish (closes stdin: wait_command() returns 'exit'), then wait."""
        if self.proc and self.proc.poll() is None and self.proc.stdin:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc:
            terminate(self.proc, timeout=10, sig=signal.SIGKILL)
