"""TLS cost side by side: the same agent requests over HTTP and HTTPS, in the same run.

Two standalone agents (`gpuobj agent`, the real server and token checks), one plain (GPUOBJ_AGENT_TLS=off)
and one serving a certificate of a local agent CA (GPUOBJ_AGENT_TLS=files: the same SSLContext code as a
certificate from the operator's signer). The client is aiohttp as in the operator and the agents' fetcher,
verifying the pod uid name (`<uid>.pod.gpuobj.io`). Requests: GET /v1/info (operator token) and a read
ticket (POST /v1/objects/{id}/reads, then DELETE /v1/reads/{id}; a pod-bound reader token), each with a
kept-alive connection and with a new connection per request (the handshake). The modes alternate in short
bursts so load from other processes hits them alike. Prints p50/p99 in ms per request and the load.

    .venv/bin/python bench/agent_tls.py [--requests 400] [--burst 20]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import re
import secrets
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gpuobj_agent.tls import client_context, make_request
from gpuobj_contract import agent_tls, names
from gpuobj_dev.testing.issuer import OPERATOR, default_issuer
from gpuobj_operator.agent_ca import CertificateAuthority, ClientCertificate, parse_request

NAMESPACE = "bench"
LISTENING = re.compile(r"gpuobj agent listening on (https?)://(\S+)")


def issue_files(ca: CertificateAuthority, folder: Path, pod: str, uid: str) -> None:
    """What the signer would issue pod `pod`: its key, the leaf and CA, the CA (as tls.key, tls.crt, ca.crt)."""
    key_pem, csr_pem = make_request(NAMESPACE, pod, uid, ("127.0.0.1",))
    leaf = ca.issue(
        parse_request(csr_pem).public_key,
        common_name=f"{NAMESPACE}/{pod}",
        dns_names=(agent_tls.pod_dns_name(uid),),
        ips=("127.0.0.1",),
        uris=(agent_tls.pod_uri(NAMESPACE, pod, uid),),
        lifetime=dt.timedelta(hours=1),
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tls.key").write_bytes(key_pem)
    (folder / "tls.crt").write_bytes(leaf + ca.cert_pem)
    (folder / "ca.crt").write_bytes(ca.cert_pem)


def start_agent(pod: str, uid: str, issuer_url: str, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "gpuobj.cli", "agent", "--pod-name", pod, "--pod-namespace", NAMESPACE,
           "--pod-uid", uid, "--host", "127.0.0.1", "--port", "0", "--issuer-url", issuer_url,
           "--operator-serviceaccount", OPERATOR, "--log-level", "WARNING"]  # fmt: skip
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"agent {pod} exited {proc.returncode}:\n{log.read_text()}")
        match = LISTENING.search(log.read_text())
        if match:
            return proc, match.group(2)
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"agent {pod} did not start in 120 s:\n{log.read_text()}")


class Target:
    """One agent, and how to call it: over TLS as the operator (its client certificate) or as a reader pod."""

    def __init__(self, name: str, endpoint: str, uid: str, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None) -> None:
        self.name, self.endpoint, self.uid = name, endpoint, uid
        self.base = f"{'https' if tls else 'http'}://{endpoint}"
        host = agent_tls.pod_dns_name(uid)
        self.as_operator = {"ssl": tls[0], "server_hostname": host} if tls else {}
        self.as_reader = {"ssl": tls[1], "server_hostname": host} if tls else {}


async def one(session: aiohttp.ClientSession, t: Target, kind: str, op: str, reader: str) -> float:
    started = time.perf_counter()
    if kind == "info":
        async with session.get(f"{t.base}/v1/info", headers={**op_headers(op, t)}, **t.as_operator) as r:
            assert r.status == 200, await r.text()
            await r.read()
    else:
        headers = {"Authorization": f"Bearer {reader}", names.HEADER_POD_UID: t.uid}
        async with session.post(f"{t.base}/v1/objects/bench-obj/reads", json={}, headers=headers, **t.as_reader) as r:
            assert r.status == 200, await r.text()
            read_id = (await r.json())["readId"]
        async with session.delete(f"{t.base}/v1/reads/{read_id}", headers=headers, **t.as_reader) as r:
            assert r.status == 200, await r.text()
    return (time.perf_counter() - started) * 1000


def op_headers(op: str, t: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {op}", names.HEADER_POD_UID: t.uid}


async def run(args: argparse.Namespace, targets: list[Target], op: str, reader: str) -> dict[tuple, list[float]]:
    results: dict[tuple, list[float]] = {}
    kept = {t.name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for t in targets}
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        for t in targets:  # materialize the object read below (operator route), and warm the connections
            body = {"tensors": [{"shape": [256], "dtype": "float32", "device": "cpu"}]}
            async with kept[t.name].put(
                f"{t.base}/v1/objects/bench-obj", json=body, headers=op_headers(op, t), **t.as_operator
            ) as r:
                assert r.status == 200, await r.text()
            for kind in ("info", "ticket"):
                for _ in range(5):
                    await one(kept[t.name], t, kind, op, reader)
        done = 0
        while done < args.requests:
            for t in targets:
                for kind in ("info", "ticket"):
                    for conn, session in (("keep-alive", kept[t.name]), ("new connection", fresh)):
                        bucket = results.setdefault((kind, conn, t.name), [])
                        for _ in range(args.burst):
                            bucket.append(await one(session, t, kind, op, reader))
            done += args.burst
    finally:
        for s in (*kept.values(), fresh):
            await s.close()
    return results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=400, help="requests per (request, connection, scheme)")
    p.add_argument("--burst", type=int, default=20)
    args = p.parse_args()
    issuer = default_issuer()
    work = Path(tempfile.mkdtemp(prefix="gpuobj-bench-tls-"))
    uid_plain, uid_tls = (f"{secrets.token_hex(4)}-0000-4000-8000-{secrets.token_hex(6)}" for _ in range(2))
    ca = CertificateAuthority.generate()
    issue_files(ca, work / "tls", "agent-tls", uid_tls)
    reader_uid = "11111111-2222-4333-8444-555555555555"
    issue_files(ca, work / "reader", "bench-reader", reader_uid)
    base = {"GPUOBJ_REVOCATION_FAIL_CLOSED_SECONDS": "0"}
    procs = []
    try:
        plain, plain_ep = start_agent("agent-plain", uid_plain, issuer.url, {**base, "GPUOBJ_AGENT_TLS": "off"},
                                      work / "plain.log")  # fmt: skip
        procs.append(plain)
        tls, tls_ep = start_agent("agent-tls", uid_tls, issuer.url, {**base, "GPUOBJ_AGENT_TLS": "files",
                                  "GPUOBJ_AGENT_TLS_DIR": str(work / "tls")}, work / "tls.log")  # fmt: skip
        procs.append(tls)
        # mTLS as in the cluster: the operator's client certificate names its ServiceAccount, a reader's its pod.
        op_ctx = ClientCertificate(ca, agent_tls.service_account_uri(*OPERATOR.split("/")), folder=work).context
        reader_ctx = client_context(ca.cert_pem, (str(work / "reader" / "tls.crt"), str(work / "reader" / "tls.key")))
        targets = [Target("http", plain_ep, uid_plain, None), Target("https", tls_ep, uid_tls, (op_ctx, reader_ctx))]
        op = issuer.token(OPERATOR)
        reader = issuer.token(f"{NAMESPACE}/default", pod=("bench-reader", reader_uid))
        load_before = os.getloadavg()
        results = asyncio.run(run(args, targets, op, reader))
        load_after = os.getloadavg()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"agent TLS cost, {args.requests} requests each, alternating bursts of {args.burst}; ms per request")
    print(f"{'request':<34} {'connection':<15} {'http p50':>9} {'p99':>7} {'https p50':>10} {'p99':>7} {'+p50':>7}")
    for kind, label in (("info", "GET /v1/info"), ("ticket", "read ticket (POST reads + DELETE)")):
        for conn in ("keep-alive", "new connection"):
            h, s = results[(kind, conn, "http")], results[(kind, conn, "https")]
            print(
                f"{label:<34} {conn:<15} {pct(h, 0.5):9.2f} {pct(h, 0.99):7.2f} {pct(s, 0.5):10.2f} "
                f"{pct(s, 0.99):7.2f} {statistics.median(s) - statistics.median(h):+7.2f}"
            )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
