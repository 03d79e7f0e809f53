"""The program the e2e workload pods run (passed as the example pod's `python -c` script).

It does what the example does (gpuobj.Client.connect with the embedded agent, identity from the
downward API) and then serves a small test-only HTTP API on the pod IP, port 9000, so the test on
the host can drive put / share / adopt / fetch / release between two pods and compare digests.
Only the test reaches it: the pods' bridge is private to the machine. Standard library, torch and
gpuobj only: this runs inside the agent image, which has no gpuobj_dev.
"""

import base64
import hashlib
import json
import os
import pickle
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

import gpuobj

env = os.environ
client = gpuobj.Client.connect(
    pod_name=env["GPUOBJ_POD_NAME"],
    namespace=env["GPUOBJ_POD_NAMESPACE"],
    pod_uid=env["GPUOBJ_POD_UID"],
    token_file=env["GPUOBJ_TOKEN_FILE"],
    port=8471,
)
refs: dict = {}


def tensors(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=gen), torch.randn(256, 256, generator=gen)]


def digest(ts: list) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def handle(op: str, args: dict) -> dict:
    if op == "put":
        data = tensors(args["seed"])
        refs[args["key"]] = client.put(data, name=args["name"])
        return {"digest": digest(data), "bytes": sum(t.numel() * t.element_size() for t in data)}
    if op == "share":
        shared = client.share(refs[args["key"]], args["pod"])
        return {"shared": base64.b64encode(pickle.dumps(shared)).decode()}
    if op == "adopt":
        refs[args["key"]] = client.adopt(pickle.loads(base64.b64decode(args["shared"])))
        return {}
    if op == "fetch":  # with the hand-off's grant; ticket=True: by address, a read ticket at the source's agent
        ref = refs[args["key"]]
        return {"digest": digest(client.fetch(ref.address if args.get("ticket") else ref))}
    if op == "release":
        client.release(refs.pop(args["key"]))
        return {}
    if op == "flush":  # the client writes GPUObjects and claims behind; the test looks at the API after this
        client.flush()
        return {}
    if op == "exit":  # the process dies as a crash would: no release, no goodbye
        os._exit(int(args.get("code", 1)))
    raise ValueError(f"unknown op {op!r}")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        try:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            answer, code = handle(self.path.strip("/"), body), 200
        except Exception as exc:
            answer, code = {"error": f"{type(exc).__name__}: {exc}"}, 500
        raw = json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, fmt: str, *args) -> None:
        print("driver:", fmt % args, file=sys.stderr, flush=True)


signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1: exit (and close the client) on SIGTERM
print("driver ready", flush=True)
HTTPServer((env["GPUOBJ_POD_IP"], 9000), Handler).serve_forever()
