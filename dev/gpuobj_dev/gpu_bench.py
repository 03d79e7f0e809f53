"""VRAM fetch throughput against a raw NIXL READ of the same bytes between the same two processes (issue 33).

A source workload process (gpuobj_dev.testing.agent_workload) holds CUDA objects; this process runs an
embedded agent and reads them into its own VRAM, alternating, for each size:
- raw NIXL: the source's descriptors loaded once, a VRAM destination registered once, one READ re-posted
  (no control plane: the ceiling, as bench/fetch_throughput.py measures it over CPU memory);
- fetch: `AgentRuntime.fetch(..., device="cuda:0")` (read ticket over HTTP, landing buffer, READ, ticket end).
Prints a table and, with --json, writes every figure (median seconds and GB/s, 1 GB = 1e9 B) to a file.

Usage: python -m gpuobj_dev.gpu_bench [--sizes 64MiB,256MiB,1GiB] [--reps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.layouts import TensorLayout
from gpuobj_agent.nixl_transport import NixlAgent
from gpuobj_agent.runtime import AgentRuntime
from gpuobj_dev.testing.agent_workload import AgentProcess
from gpuobj_dev.testing.issuer import OPERATOR, default_issuer

DEVICE = "cuda:0"  # --device cpu: a dry run of this script on CPU memory where no GPU is lent
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


class RawRead:
    """Raw NIXL into VRAM between the same two processes, holding a read ticket so the object stays put."""

    def __init__(self, src: AgentProcess, oid: str, nbytes: int, device: str) -> None:
        self.src = src
        status, self.ticket = src.request("POST", f"/v1/objects/{oid}/reads", {"reader": "gpu-bench-raw"})
        assert status == 200, self.ticket
        self.agent = NixlAgent(f"gpu-bench-raw-{oid}", progress_thread=False)
        self.impl = self.agent._a()
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.reg = self.impl.register_memory(self.dst)
        self.agent.load_remote(base64.b64decode(self.ticket["agentMetadata"]))
        remote = self.impl.deserialize_descs(base64.b64decode(self.ticket["descriptors"]))
        self.handle = self.impl.initialize_xfer(
            "READ", self.impl.get_xfer_descs(self.dst), remote, self.ticket["nixlAgent"]
        )

    def __call__(self) -> None:
        state = self.impl.transfer(self.handle)
        while state == "PROC":
            state = self.impl.check_xfer_state(self.handle)
        assert state == "DONE", state

    def close(self) -> None:
        self.handle.release()
        self.impl.deregister_memory(self.reg)
        self.src.request("DELETE", f"/v1/reads/{self.ticket['readId']}")
        self.agent.close()


def timed(fn: Any, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64MiB,256MiB,1GiB")
    parser.add_argument("--reps", type=int, default=20, help="reads per method and size (alternating)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--device", default=DEVICE, help="where both ends hold the bytes (cpu: a dry run)")
    args = parser.parse_args(argv)
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device visible to torch; nothing measured", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nixl").setLevel(logging.WARNING)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpuobj-gpu-bench-") as tmp:
        issuer = default_issuer()
        src = AgentProcess("gpu-bench-src", workload=True, workdir=tmp, issuer=issuer).start()
        token = issuer.token(f"{src.namespace}/default", pod=("gpu-bench-dst", "gpu-bench-dst-uid"))
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        rt = None
        try:
            config = AgentConfig(
                pod_name="gpu-bench-dst",
                namespace=src.namespace,
                host="127.0.0.1",
                port=0,
                token_file=str(token_file),
                issuer_url=issuer.url,
                operator_service_accounts=(OPERATOR,),
            )
            rt = AgentRuntime(config).start()
            for nbytes in sizes:
                oid = f"gpu-bench-{nbytes}"
                layout = TensorLayout((nbytes,), "uint8", args.device)
                status, body = src.request(
                    "POST", "/v1/test/put", {"id": oid, "tensors": [layout.to_json()], "seed": 1}
                )
                assert status == 200, body
                raw = RawRead(src, oid, nbytes, args.device)
                times: dict[str, list[float]] = {"raw": [], "fetch": []}
                try:

                    def fetch(o: str = oid) -> None:
                        assert rt is not None
                        got = rt.fetch(src.endpoint, o, device=args.device, token=token)
                        del got

                    raw()  # warm both paths: connections, metadata, a landing buffer
                    fetch()
                    for _ in range(args.reps):
                        times["raw"].append(timed(raw, cuda))
                        times["fetch"].append(timed(fetch, cuda))
                finally:
                    raw.close()
                src.request("POST", f"/v1/objects/{oid}/free", {"waitFence": True})
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append(
                    {
                        "bytes": nbytes,
                        "reps": args.reps,
                        "rawSeconds": med["raw"],
                        "fetchSeconds": med["fetch"],
                        "rawGBps": nbytes / med["raw"] / 1e9,
                        "fetchGBps": nbytes / med["fetch"] / 1e9,
                        "fetchOverRaw": med["raw"] / med["fetch"],
                    }
                )
                print(f"  measured {nbytes} B", file=sys.stderr, flush=True)
        finally:
            if rt is not None:
                rt.stop()
            src.stop()
            src.close()
    result = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (--device cpu)",
        "torch": torch.__version__,
        "ucxTls": os.environ.get("UCX_TLS", "default"),
        "load": os.getloadavg(),
        "rows": rows,
    }
    print(
        f"\nfetch vs raw NIXL READ, both into {args.device}, {result['gpu']}, "
        f"medians of {args.reps} (GB/s, 1 GB = 1e9 B)"
    )
    print(f"{'bytes':>12} | {'raw NIXL':>8} | {'fetch':>8} | {'fetch/raw':>9}")
    for row in rows:
        print(f"{row['bytes']:>12} | {row['rawGBps']:8.2f} | {row['fetchGBps']:8.2f} | {row['fetchOverRaw']:9.0%}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
