"""Test helpers other suites reuse: agent processes, a scriptable workload, deterministic data.

`AgentProcess` starts a real agent subprocess on a free port with a token file and a pod
identity, waits for /readyz, and on `stop()` sends SIGTERM and checks that it exited 0
(which the agent does only when its NIXL registrations balanced). With `workload=True`
the process is a stand-in workload: an embedded agent plus test-only routes under
`/v1/test/` (token required) to put seeded tensors, fetch from another agent and report
counts, so multi-process scenarios can be driven over HTTP.

Run `python -m gpuobj_dev.testing.agent_workload workload --pod-name ... --port 0 --token-file ...` to
start such a workload by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gpuobj_agent.layouts import TensorLayout, allocate, layout_of, torch_dtype
from gpuobj_contract import names
from gpuobj_dev.testing.issuer import OPERATOR, TestIssuer, default_issuer

LISTENING = "gpuobj agent listening on http://"


# -- deterministic data ------------------------------------------------------------------
def make_tensors(layouts: Sequence[TensorLayout], seed: int, device: str | None = None) -> list[torch.Tensor]:
    """Tensors whose bytes depend only on (layouts, seed): both ends can compute what to expect."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layout in layouts:
        raw = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen)
        if layout.dtype == "bool":
            raw &= 1
        t = raw.view(torch_dtype(layout)).reshape(layout.shape) if layout.nbytes else allocate(layout, device="cpu")
        out.append(t.to(device or layout.device))
    return out


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over layouts and raw bytes."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(json.dumps(layout_of(t).to_json()).encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- the agent subprocess ----------------------------------------------------------------
class AgentProcess:
    """A standalone agent (or a stand-in workload) in a subprocess, for tests."""

    def __init__(
        self,
        pod_name: str,
        *,
        namespace: str = "default",
        pod_uid: str | None = None,
        token: str | None = None,
        reader_token: str | None = None,
        issuer: TestIssuer | None = None,
        workload: bool = False,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        workdir: str | Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.pod_name = pod_name
        self.namespace = namespace
        self.pod_uid = pod_uid or secrets.token_hex(8)
        self.issuer = issuer or default_issuer()
        # What the operator presents (control routes), and this pod's own token (its reads elsewhere).
        self.token = token or self.issuer.token(OPERATOR)
        self.reader_token = reader_token or self.issuer.token(f"{namespace}/default", pod=(pod_name, self.pod_uid))
        self.workload = workload
        self.env = dict(env or {})
        self.args = list(args)
        self.host = host
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix=f"gpuobj-agent-{pod_name}-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.token_file = self.workdir / f"{pod_name}.token"
        self.log_file = self.workdir / f"{pod_name}.log"
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.exit_code: int | None = None
        self._killed = False

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def headers(self) -> dict[str, str]:
        """What the operator sends: its token, and the pod uid the request is meant for (mandatory)."""
        return {"Authorization": f"Bearer {self.token}", names.HEADER_POD_UID: self.pod_uid}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        mod = (
            ["-m", "gpuobj_dev.testing.agent_workload", "workload"] if self.workload else ["-m", "gpuobj.cli", "agent"]
        )
        return [
            sys.executable,
            *mod,
            "--pod-name",
            self.pod_name,
            "--pod-namespace",
            self.namespace,
            "--pod-uid",
            self.pod_uid,
            "--host",
            self.host,
            "--port",
            "0",
            "--token-file",
            str(self.token_file),
            "--issuer-url",
            self.issuer.url,
            "--operator-serviceaccount",
            OPERATOR,
            *self.args,
        ]

    def start(self, timeout: float = 120.0) -> AgentProcess:
        """Spawn, wait for the "listening" line and for /readyz 200; raise with the log on failure."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(self.reader_token + "\n")
        self.token_file.chmod(0o600)
        env = {**os.environ, **self.env}
        log = open(self.log_file, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not self.endpoint:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.pod_name} exited with {self.proc.returncode}:\n{self.output()}")
            for line in self.output().splitlines():
                if line.startswith(LISTENING):
                    self.endpoint = line[len(LISTENING) :].split()[0]
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"agent {self.pod_name} did not start in {timeout:g}s:\n{self.output()}")
            if not self.endpoint:
                time.sleep(0.05)
        while True:
            status, _ = self.request("GET", "/readyz", auth=False)
            if status == 200:
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"agent {self.pod_name} not ready in {timeout:g}s:\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        auth: bool | str = True,
        timeout: float = 60.0,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One HTTP request; returns (status, parsed JSON or text). `auth` may be a token string."""
        headers = dict(headers or {})
        if auth is True:  # the operator on control routes; this pod's own token on read routes
            reading = (method == "POST" and path.endswith("/reads")) or (method == "DELETE" and "/v1/reads/" in path)
            auth = self.reader_token if reading else self.token
        if auth:
            headers["Authorization"] = f"Bearer {auth}"
        headers.setdefault(names.HEADER_POD_UID, self.pod_uid)  # meant for this pod, as the operator says
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def stats(self) -> dict[str, Any]:
        status, body = self.request("GET", "/v1/test/stats")
        assert status == 200, body
        return body

    def test_put(self, oid: str, layouts: Sequence[TensorLayout], seed: int) -> dict[str, Any]:
        """Put seeded tensors of these layouts (the workload's test route); asserts it was taken."""
        body = {"id": oid, "tensors": [la.to_json() for la in layouts], "seed": seed}
        status, answer = self.request("POST", "/v1/test/put", body)
        assert status == 200, answer
        return answer

    def test_fetch(self, src: AgentProcess, oid: str, **extra: Any) -> tuple[int, Any]:
        """Fetch `oid` from `src` into this process with its reader token (the workload's test route)."""
        body = {"endpoint": src.endpoint, "id": oid, "token": self.reader_token, **extra}
        return self.request("POST", "/v1/test/fetch", body)

    def stop(self, timeout: float = 60.0, *, check: bool = True) -> int:
        """SIGTERM and wait; with `check`, raise unless it exited 0 (registrations balanced)."""
        if self.proc is None:
            return 0
        if self._killed:
            return self.proc.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                message = f"agent {self.pod_name} ignored SIGTERM for {timeout:g}s:\n{self.output()}"
                raise AssertionError(message) from None
        self.exit_code = self.proc.returncode
        if check and self.exit_code != 0:
            raise AssertionError(f"agent {self.pod_name} exited with {self.exit_code}:\n{self.output()}")
        return self.exit_code

    def kill(self) -> None:
        """SIGKILL (a pod that vanishes); a later `stop` does not check the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self._killed = True
            self.proc.kill()
            self.proc.wait(30)
        if self.proc is not None:
            self.exit_code = self.proc.returncode

    def close(self) -> None:
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.stop()
        finally:
            self.close()


# -- the stand-in workload -----------------------------------------------------------------
def own_token(agent: Any) -> str | None:
    """The pod's own projected token (re-read: it rotates), presented when it reads elsewhere."""
    path = agent.config.token_file
    return Path(path).read_text().strip() if path else None


def workload_routes(app: Any) -> None:
    """Test-only routes: put seeded tensors, fetch from another agent, report counts."""
    from aiohttp import web

    from gpuobj_agent.errors import AgentError, BadRequest, ObjectGone
    from gpuobj_agent.layouts import parse_layouts
    from gpuobj_agent.server import AGENT_KEY

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            raise BadRequest("body is not JSON") from None
        if not isinstance(data, dict):
            raise BadRequest("body must be an object")
        return data

    async def put(request: web.Request) -> web.Response:
        agent = request.app[AGENT_KEY]
        data = await body(request)
        layouts = parse_layouts(data.get("tensors"))
        tensors = make_tensors(layouts, int(data.get("seed", 0)))
        if data.get("within"):  # the object is a view into a larger, seeded uint8 tensor (at "offset")
            within = data["within"]
            [base] = make_tensors([TensorLayout((int(within["bytes"]),), "uint8", "cpu")], int(data.get("seed", 0)))
            start = int(within["offset"])
            tensors = [base[start : start + layouts[0].nbytes]]
        obj = await agent.store.put(
            data["id"], tensors, stream=data.get("stream"), stream_index=data.get("streamIndex")
        )
        return web.json_response({"id": obj.object_id, "bytes": obj.nbytes, "digest": digest(tensors)})

    async def fetch(request: web.Request) -> web.Response:
        agent = request.app[AGENT_KEY]
        data = await body(request)
        wait = float(data.get("waitSeconds", 0))
        deadline = time.monotonic() + wait
        pause = 0.001
        while True:
            try:
                tensors = await agent.fetcher.fetch(
                    data["endpoint"],
                    data["id"],
                    device=data.get("device", "cpu"),
                    token=data.get("token") or own_token(agent),
                    timeout=data.get("timeout"),
                )
                break
            except ObjectGone as exc:
                if time.monotonic() + pause > deadline:
                    return web.json_response({"error": str(exc), "kind": type(exc).__name__}, status=404)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
            except AgentError as exc:
                return web.json_response({"error": str(exc), "kind": type(exc).__name__}, status=502)
        out: dict[str, Any] = {"digest": digest(tensors), "bytes": sum(t.nbytes for t in tensors)}
        if data.get("putAs"):
            obj = await agent.store.put(data["putAs"], tensors)
            out["put"] = {"id": obj.object_id, "bytes": obj.nbytes}
        return web.json_response(out)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(request.app[AGENT_KEY].stats())

    app.router.add_post("/v1/test/put", put)
    app.router.add_post("/v1/test/fetch", fetch)
    app.router.add_get("/v1/test/stats", stats)


def main(argv: list[str] | None = None) -> int:
    import logging

    from gpuobj_agent.main import build_parser, config_from_args, serve

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "workload":
        print("usage: python -m gpuobj_dev.testing.agent_workload workload [gpuobj agent options]", file=sys.stderr)
        return 2
    args = build_parser("python -m gpuobj_dev.testing.agent_workload workload").parse_args(argv[1:])
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return asyncio.run(serve(config_from_args(args), extra_routes=workload_routes))


if __name__ == "__main__":
    sys.exit(main())


@contextlib.contextmanager
def workload_pair(names: Sequence[str], workdir: Callable[[str], Path]) -> Iterator[list[AgentProcess]]:
    """Workload processes that live for a test module: stopped (registrations balanced) on the way out,
    killed and cleaned up whatever happened."""
    procs: list[AgentProcess] = []
    try:
        for name in names:
            procs.append(AgentProcess(name, workload=True, workdir=workdir(name)).start())
        yield procs
        for proc in procs:
            proc.stop()
    finally:
        for proc in procs:
            proc.close()
