"""A workload pod's process for tests and the demo: the client library with its embedded agent.

Why a real process: a source pod's bytes must live in another address space than the
reader's for NIXL to move them for real, and seed 004 (teardown at interpreter exit)
can only be shown by a process that exits.

The process runs a snippet with ``client`` (a connected gpuobj.Client), ``torch``,
``emit(**values)`` (report JSON-able values to the test) and ``wait_command()`` (block
until the test sends a command line, returning it) in scope. Values that are not JSON
(handles, SharedRefs) are passed as base64 pickles with ``emit_pickle(name, value)``.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

BOOTSTRAP = """
import base64, json, pickle, sys, os
import torch
import gpuobj

def emit(**values):
    print("@@" + json.dumps(values), flush=True)

def emit_pickle(name, value):
    emit(**{name: base64.b64encode(pickle.dumps(value)).decode()})

def load_pickle(text):
    return pickle.loads(base64.b64decode(text))

def wait_command():
    line = sys.stdin.readline()
    return line.strip() if line else "exit"

client = gpuobj.Client.connect(
    pod_name=os.environ["GPUOBJ_POD_NAME"], namespace=os.environ["GPUOBJ_POD_NAMESPACE"],
    pod_uid=os.environ["GPUOBJ_POD_UID"], token_file=os.environ["GPUOBJ_TOKEN_FILE"],
    host="127.0.0.1", port=int(os.environ["GPUOBJ_AGENT_PORT"]), advertise_host="127.0.0.1",
    kubeconfig=os.environ["KUBECONFIG"],
)
emit(ready=True, endpoint=client.agent.endpoint)
"""


def pickled(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def unpickled(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


class WorkloadProcess:
    def __init__(
        self,
        script: str,
        *,
        pod_name: str,
        namespace: str,
        pod_uid: str,
        port: int,
        token_file: Path,
        kubeconfig: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.source = BOOTSTRAP + "\n" + textwrap.dedent(script)
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "GPUOBJ_POD_NAME": pod_name,
            "GPUOBJ_POD_NAMESPACE": namespace,
            "GPUOBJ_POD_UID": pod_uid,
            "GPUOBJ_AGENT_PORT": str(port),
            "GPUOBJ_TOKEN_FILE": str(token_file),
            "KUBECONFIG": str(kubeconfig),
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
        return self

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._values.put(json.loads(line[2:]))
            else:
                self.log.append(line.rstrip())
        self._values.put({"__exit__": True})

    def expect(self, key: str, timeout: float = 60) -> Any:
        """The next value the workload emitted under ``key`` (fails with its output if it died)."""
        while True:
            try:
                values = self._values.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"workload did not emit {key!r} within {timeout}s:\n{self.output()}") from None
            if values.get("__exit__"):
                self._values.put(values)
                raise AssertionError(f"workload exited ({self.proc.wait()}) before emitting {key!r}:\n{self.output()}")
            if key in values:
                return values[key]

    def send(self, command: str) -> None:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

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
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
