"""VRAM objects between two agent processes on one GPU: bytes, deregistration, replays, a killed reader.

Issue 33. The same scenarios as tests/integration/agent (test_transfers, test_stale_reader) with the
objects in CUDA memory, where UCX moves them with cuda_ipc and keeps registrations in its cache: a
deregistered region's remote key may stay valid while the memory is mapped, and a reader's CUDA IPC
mappings stay until it exits (ucx#11753). What must hold is the same as over CPU memory.
"""

from __future__ import annotations

import threading
import time

import pytest

from gpuobj_agent.layouts import TensorLayout
from gpuobj_dev.testing.agent_workload import AgentProcess, workload_pair
from gpuobj_dev.testing.waits import wait_until

from ..integration.agent.test_stale_reader import RawReader, raw_sha
from .conftest import DEVICE, registered_bytes, settle


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A source and a reader workload process for the module; each test leaves them holding nothing."""
    with workload_pair(("vram-src", "vram-dst"), tmp_path_factory.mktemp) as procs:
        yield procs


def put(proc: AgentProcess, oid: str, layouts: list[TensorLayout], seed: int) -> dict:
    return proc.test_put(oid, layouts, seed)


def fetch(dst: AgentProcess, src: AgentProcess, oid: str, **extra) -> tuple[int, dict]:
    return dst.test_fetch(src, oid, **extra)


def free(proc: AgentProcess, oid: str, **body) -> dict:
    status, result = proc.request("POST", f"/v1/objects/{oid}/free", body)
    assert status == 200, result
    return result


STATE_DICT = [  # a model-like state dict: several dtypes, a 0-d tensor, an empty one
    TensorLayout((512, 256), "bfloat16", DEVICE),
    TensorLayout((256,), "float32", DEVICE),
    TensorLayout((), "int64", DEVICE),
    TensorLayout((0, 8), "float16", DEVICE),
    TensorLayout((1024, 512), "bfloat16", DEVICE),
]


@pytest.mark.parametrize(
    "layouts",
    [[TensorLayout((1 << 22,), "float32", DEVICE)], [TensorLayout((3, 1 << 20), "bfloat16", DEVICE)], STATE_DICT],
    ids=["float32-16MiB", "bfloat16-6MiB", "state-dict"],
)
@pytest.mark.parametrize("into", [DEVICE, "cpu"], ids=["into-vram", "into-cpu"])
def test_a_vram_object_reaches_another_process_with_equal_bytes(pair, layouts, into):
    src, dst = pair
    oid = f"v-{len(layouts)}-{layouts[0].dtype}-{into.replace(':', '')}"
    expected = put(src, oid, layouts, seed=len(layouts))
    status, got = fetch(dst, src, oid, device=into)
    assert status == 200, got
    assert got["digest"] == expected["digest"] and got["bytes"] == expected["bytes"], (got, expected)
    assert free(src, oid, waitFence=True)["freed"]
    settle(src.stats)
    settle(dst.stats)


def test_the_free_deregisters_the_vram(pair, make_process):
    _, dst = pair
    src = make_process("vram-dereg", workload=True)  # a fresh source: its gauge starts at 0
    assert registered_bytes(src) == 0
    layout = TensorLayout((64 << 20,), "uint8", DEVICE)
    expected = put(src, "v-dereg", [layout], seed=5)
    assert registered_bytes(src) >= layout.nbytes
    status, got = fetch(dst, src, "v-dereg", device=DEVICE)
    assert status == 200 and got["digest"] == expected["digest"], got
    assert free(src, "v-dereg", waitFence=True)["fenced"]
    stats = settle(src.stats)  # registrations equal deregistrations, no region left in any NIXL agent
    assert stats["registeredRegions"] == 0
    wait_until(lambda: registered_bytes(src) == 0, "the registered-bytes gauge to return to 0")
    settle(dst.stats)


def test_a_replayed_grant_after_the_free_and_the_reuse_of_its_memory_never_reads_the_new_bytes(
    make_process, record_property
):
    """A raw NIXL reader keeps a VRAM object's metadata and descriptors and replays them while a later
    object of the same size is put into the memory the CUDA caching allocator hands back: every replay
    that reads returns the freed object's own bytes, never the later one's, until the fence ends them
    (with UCX's registration cache on, its default)."""
    src = make_process("vram-replay", workload=True)
    layout = TensorLayout((64 << 20,), "uint8", DEVICE)
    on_cpu = TensorLayout(layout.shape, layout.dtype, "cpu")  # the same seeded bytes
    old_sha, later_sha = raw_sha(on_cpu, 1), raw_sha(on_cpu, 2)
    put(src, "old", [layout], seed=1)
    reader = RawReader("vram-replay-reader", {}, "thread")
    try:
        status, ticket = src.request("POST", "/v1/objects/old/reads", {"reader": "raw"})
        assert status == 200, ticket
        assert reader.call(op="load", metadata=ticket["agentMetadata"])["ok"]
        replay = {"op": "read", "agent": ticket["nixlAgent"], "descriptors": ticket["descriptors"]}
        replay["nbytes"] = ticket["bytes"]
        assert reader.call(**replay) == {"ok": True, "sha256": old_sha}
        assert src.request("DELETE", f"/v1/reads/{ticket['readId']}")[1]["valid"]

        freed_at = time.monotonic()
        assert free(src, "old")["freed"]  # the operator's free at a release: no waitFence
        later: list[tuple[int, dict]] = []
        put_later = threading.Thread(
            target=lambda: later.append(
                src.request("POST", "/v1/test/put", {"id": "later", "tensors": [layout.to_json()], "seed": 2})
            )
        )
        put_later.start()
        reads = 0
        while True:
            got = reader.call(**replay)
            after = time.monotonic() - freed_at
            if not got["ok"]:
                assert "NIXL_ERR" in got["error"] or "transfer ended" in got["error"], got
                break
            assert got["sha256"] != later_sha, "a replay read the later object's bytes"
            assert got["sha256"] == old_sha, got
            reads += 1
            assert after < 60, f"the replay still read {after:.1f}s after the free: no fence"
        put_later.join(60)
        assert later and later[0][0] == 200, later
        print(f"\nvram fence bound: {reads} replays read the freed object's own bytes; refused {after:.3f}s after")
        record_property("vram_fence_bound_seconds", round(after, 3))
        assert src.alive()
        status, ticket = src.request("POST", "/v1/objects/later/reads", {"reader": "raw"})
        assert status == 200, ticket
        assert reader.call(op="load", metadata=ticket["agentMetadata"])["ok"]
        fresh = {"op": "read", "agent": ticket["nixlAgent"], "descriptors": ticket["descriptors"]}
        assert reader.call(**fresh, nbytes=ticket["bytes"]) == {"ok": True, "sha256": later_sha}
        src.request("DELETE", f"/v1/reads/{ticket['readId']}")
        assert free(src, "later", waitFence=True)["fenced"]
    finally:
        reader.close()
    settle(src.stats)


def test_a_reader_killed_mid_fetch_leaves_nothing_held_at_the_source(make_process):
    src = make_process("vram-kill-src", workload=True)
    doomed = make_process("vram-kill-dst", workload=True)
    layout = TensorLayout((1 << 30,), "uint8", DEVICE)  # 1 GiB: long enough to be killed in flight
    put(src, "big", [layout], seed=9)
    answers: list[tuple[int, object]] = []

    def reading() -> None:
        try:
            answers.append(fetch(doomed, src, "big", device=DEVICE))
        except OSError as exc:  # the reader died under its own request
            answers.append((0, str(exc)))

    thread = threading.Thread(target=reading)
    thread.start()
    wait_until(lambda: src.stats()["inflightReads"] > 0 or answers, "the read to start", 60)
    doomed.kill()  # the reader's pod vanishes, with or without its read done
    thread.join(60)
    assert free(src, "big")["freed"]
    # The dead reader's ticket ends with its lease (10 s plus the bytes at 256 MiB/s): then nothing is held.
    lease = 10 + layout.nbytes / (256 << 20)
    settle(src.stats, timeout=lease + 60)
    assert src.alive() and src.request("GET", "/readyz", auth=False)[0] == 200
