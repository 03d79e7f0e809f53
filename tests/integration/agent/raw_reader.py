"""A raw NIXL reader in its own process: what a stale reader outside gpuobj looks like.

It speaks JSON lines on stdin/stdout: `load` remote metadata, `read` descriptors it was
given (NIXL's own serialized form, from a read ticket) and report the bytes' sha256 or
the NIXL error. It keeps whatever metadata it loaded, forever: that is the point.
`python raw_reader.py NAME thread|none`: with NIXL's default progress thread, or with
none (then its worker progresses only while it polls its own transfers). Its first answer,
unasked, says it is ready.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time

import torch
from nixl._api import nixl_agent, nixl_agent_config


def main() -> None:
    progress = sys.argv[2] == "thread"
    agent = nixl_agent(sys.argv[1], nixl_agent_config(enable_prog_thread=progress, backends=["UCX"]))
    # Say so once up: starting (torch, NIXL, UCX) takes seconds on a loaded machine, and a test must not
    # take a read ticket, whose lease then runs, before this process can use it.
    sys.stdout.write("@@" + json.dumps({"ok": True, "ready": sys.argv[1]}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "load":
                name = agent.add_remote_agent(base64.b64decode(cmd["metadata"]))
                out = {"ok": True, "agent": name.decode() if isinstance(name, bytes) else name}
            elif cmd["op"] == "read":
                out = read(agent, cmd)
            elif cmd["op"] == "read_span":  # any address the reader likes, as an attacker would ask
                cmd["descriptors"] = base64.b64encode(
                    agent.get_serialized_descs(
                        agent.get_xfer_descs([(cmd["addr"], cmd["nbytes"], cmd["dev"])], cmd["mem"])
                    )
                ).decode()
                out = read(agent, cmd)
            else:
                out = {"ok": False, "error": f"unknown op {cmd['op']}"}
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write("@@" + json.dumps(out) + "\n")
        sys.stdout.flush()


def read(agent, cmd) -> dict:
    buf = torch.zeros(cmd["nbytes"], dtype=torch.uint8)
    reg = agent.register_memory(buf)
    try:
        remote = agent.deserialize_descs(base64.b64decode(cmd["descriptors"]))
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(buf), remote, cmd["agent"])
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + 20
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
        finally:
            handle.release()
        if state != "DONE":
            return {"ok": False, "error": f"transfer ended in {state}"}
        return {"ok": True, "sha256": hashlib.sha256(buf.numpy().tobytes()).hexdigest()}
    finally:
        agent.deregister_memory(reg)


if __name__ == "__main__":
    main()
