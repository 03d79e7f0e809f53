"""Put in one agent process, fetch in another: bytes equal for every size and dtype; frees are clean."""

from __future__ import annotations

import threading

import pytest

from gpuobj_agent.layouts import DTYPES, TensorLayout
from gpuobj_dev.testing.agent_workload import AgentProcess, workload_pair
from gpuobj_dev.testing.waits import wait_until

from .conftest import settle

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two workload processes for the whole module; each test leaves them holding nothing."""
    with workload_pair(("src", "dst"), tmp_path_factory.mktemp) as procs:
        yield procs


def put(proc: AgentProcess, oid: str, layouts: list[TensorLayout], seed: int) -> dict:
    return proc.test_put(oid, layouts, seed)


def fetch(dst: AgentProcess, src: AgentProcess, oid: str, **extra) -> tuple[int, dict]:
    return dst.test_fetch(src, oid, **extra)


def free(proc: AgentProcess, oid: str, **body) -> dict:
    status, result = proc.request("POST", f"/v1/objects/{oid}/free", body)
    assert status == 200, result
    return result


def clean(*procs: AgentProcess) -> None:
    for proc in procs:
        settle(proc.stats)


def sized(nbytes: int, dtype: str) -> TensorLayout:
    item = DTYPES[dtype].itemsize
    return TensorLayout((max(1, nbytes // item),), dtype, "cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool"])
@pytest.mark.parametrize("nbytes", [1, 4096, 1 << 20, 64 << 20], ids=["1B", "4KiB", "1MiB", "64MiB"])
def test_fetched_bytes_equal_the_put_bytes(pair, nbytes, dtype):
    src, dst = pair
    oid = f"o-{nbytes}-{dtype}"
    expected = put(src, oid, [sized(nbytes, dtype)], seed=nbytes)
    status, got = fetch(dst, src, oid)
    assert status == 200, got
    assert got["digest"] == expected["digest"] and got["bytes"] == expected["bytes"]
    assert free(src, oid)["freed"]
    clean(src, dst)


def test_a_256_mib_object_arrives_intact(pair):
    src, dst = pair
    expected = put(src, "o-256", [sized(256 << 20, "float32")], seed=256)
    status, got = fetch(dst, src, "o-256")
    assert status == 200 and got["digest"] == expected["digest"], got
    assert free(src, "o-256", waitFence=True)["fenced"]
    clean(src, dst)


def test_a_multi_tensor_object_arrives_intact(pair):
    src, dst = pair
    layouts = [
        TensorLayout((3, 5), "float32", "cpu"),
        TensorLayout((), "bfloat16", "cpu"),
        TensorLayout((0, 7), "int8", "cpu"),
        TensorLayout((1000,), "bool", "cpu"),
        TensorLayout((1 << 18,), "int64", "cpu"),
        TensorLayout((2, 2), "complex128", "cpu"),
    ]
    expected = put(src, "o-multi", layouts, seed=7)
    status, got = fetch(dst, src, "o-multi")
    assert status == 200 and got["digest"] == expected["digest"], got
    free(src, "o-multi")
    clean(src, dst)


def test_free_is_idempotent_over_http(pair):
    src, dst = pair
    put(src, "o-idem", [sized(4096, "int8")], seed=1)
    first = free(src, "o-idem", reason="out of scope")
    assert first["freed"] and first["bytes"] == 4096
    assert free(src, "o-idem") == {"freed": False, "reason": "unknown object"}
    assert free(src, "o-never") == {"freed": False, "reason": "unknown object"}
    clean(src, dst)


def test_a_fetch_after_free_fails_cleanly(pair):
    src, dst = pair
    put(src, "o-gone", [sized(1 << 20, "float32")], seed=2)
    assert fetch(dst, src, "o-gone")[0] == 200
    free(src, "o-gone")
    status, got = fetch(dst, src, "o-gone")
    assert status == 404 and got["kind"] == "ObjectGone" and "not found (freed or never existed)" in got["error"]
    clean(src, dst)


def test_a_free_during_an_in_flight_read_waits_then_frees(pair):
    src, dst = pair
    put(src, "o-busy", [sized(1 << 20, "float32")], seed=3)
    status, ticket = src.request("POST", "/v1/objects/o-busy/reads", {"reader": "test"})
    assert status == 200
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(free(src, "o-busy")))
    thread.start()
    wait_until(lambda: src.request("GET", "/v1/objects")[1]["objects"][0]["freeing"], "the free to wait")
    # while the free waits, the object is no longer readable and the read still counts
    assert fetch(dst, src, "o-busy")[0] == 404
    assert src.request("GET", "/v1/objects")[1]["objects"][0]["inflightReads"] == 1
    assert not result
    assert src.request("DELETE", f"/v1/reads/{ticket['readId']}")[1] == {"ended": True, "valid": True, "expired": False}
    thread.join(60)
    assert result["freed"] and result["waitedSeconds"] > 0
    assert src.request("DELETE", f"/v1/reads/{ticket['readId']}")[1] == {
        "ended": False,
        "valid": True,
        "expired": False,
    }  # idempotent
    clean(src, dst)


def test_a_fetch_from_a_vanished_source_fails_cleanly(pair, tmp_path):
    _, dst = pair
    with AgentProcess("doomed", workload=True, workdir=tmp_path) as doomed:
        put(doomed, "o-doomed", [sized(1 << 20, "float32")], seed=4)
        assert fetch(dst, doomed, "o-doomed")[0] == 200
        doomed.kill()  # the pod vanishes with the object in it
        status, got = fetch(dst, doomed, "o-doomed", timeout=30)
        assert status == 502 and got["kind"] == "SourceUnavailable", got
    clean(dst)
