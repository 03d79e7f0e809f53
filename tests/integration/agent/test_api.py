"""The control API of a standalone `gpuobj agent` process: authentication and bad input everywhere."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

from gpuobj_contract import agent_api as api
from gpuobj_contract import metric_names, names
from gpuobj_dev.testing.agent_workload import AgentProcess

from .conftest import TOKEN, settle

pytestmark = pytest.mark.nixl

LAYOUT = {"shape": [4, 4], "dtype": "float32", "device": "cpu"}
ENDPOINTS = [
    ("GET", "/v1/info", None),
    ("GET", "/v1/objects", None),
    ("GET", "/v1/objects/kept", None),
    ("PUT", "/v1/objects/new", {"tensors": [LAYOUT]}),
    ("POST", "/v1/objects/kept/reads", {"reader": "x"}),
    ("DELETE", "/v1/reads/r-0123", None),
    ("POST", "/v1/objects/kept/free", {}),
    ("POST", "/v1/streams/s/free", {}),
]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    proc = AgentProcess("api", workdir=tmp_path_factory.mktemp("api")).start()
    try:
        yield proc
        proc.stop()
    finally:
        proc.close()


def objects(agent: AgentProcess) -> list[str]:
    return [o["id"] for o in agent.request("GET", "/v1/objects")[1]["objects"]]


@pytest.mark.parametrize("auth", [False, "wrong-token", "", "Basic " + TOKEN], ids=["none", "wrong", "empty", "basic"])
def test_every_v1_endpoint_needs_the_token_and_a_refused_request_changes_nothing(agent, auth):
    assert agent.request("PUT", "/v1/objects/kept", {"tensors": [LAYOUT]})[0] == 200
    for method, path, body in ENDPOINTS:
        if isinstance(auth, str) and auth.startswith("Basic "):
            status, answer = _raw_auth(agent, method, path, body, auth)
        else:
            status, answer = agent.request(method, path, body, auth=auth)
        assert status == 401, (method, path, status, answer)
        assert isinstance(answer, dict) and "token" in answer["error"]
    assert objects(agent) == ["kept"]  # nothing created, nothing freed, no read started
    assert agent.request("GET", "/v1/objects")[1]["objects"][0]["inflightReads"] == 0
    assert agent.request("POST", "/v1/objects/kept/free", {})[1]["freed"]
    settle(lambda: _stats(agent))


def _raw_auth(agent, method, path, body, header):
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": header, "Gpuobj-Pod-UID": agent.pod_uid}  # meant for this pod: only the token is wrong
    req = urllib.request.Request(agent.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _stats(agent: AgentProcess) -> dict:
    """The standalone agent has no test routes: derive the counts from the API and /metrics."""
    inventory = agent.request("GET", "/v1/objects")[1]["objects"]
    metrics = agent.request("GET", "/metrics", auth=False)[1]
    values = {}
    for line in metrics.splitlines():
        if line.startswith("gpuobj_agent_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    reg = values['gpuobj_agent_nixl_registrations_total{op="register"}']
    dereg = values['gpuobj_agent_nixl_registrations_total{op="deregister"}']
    return {
        "objects": len(inventory),
        "storeBytes": sum(o["bytes"] for o in inventory),
        "registrations": reg,
        "deregistrations": dereg,
        "registeredRegions": int(values["gpuobj_agent_nixl_registered_bytes"] > 0),
        "readerRegistrations": 0,
        "readerDeregistrations": 0,
        "inflightReads": int(values["gpuobj_agent_inflight_reads"]),
        "quarantinedBytes": int(values["gpuobj_agent_quarantined_bytes"]),
    }


BAD = [
    ("PUT", "/v1/objects/x", None, 400),
    ("PUT", "/v1/objects/x", b"not json", 400),
    ("PUT", "/v1/objects/x", b"\xff\xfe{", 400),
    ("PUT", "/v1/objects/x", b"[" * 100000 + b"]" * 100000, 400),
    ("PUT", "/v1/objects/x", [], 400),
    ("PUT", "/v1/objects/x", {"tensors": []}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [{"shape": [-1], "dtype": "float32"}]}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [{"shape": [10**30], "dtype": "float32"}]}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [{"shape": [2**20, 2**20, 2**10], "dtype": "float32"}]}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [{"shape": [1], "dtype": "float32", "device": "cuda:7"}]}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "colour": "red"}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "streamIndex": "3"}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "stream": "bad stream"}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "key": "bad key!"}, 400),
    # The GPUObject schema's rules (agent_api.MaterializeRequest.from_json): these were stored before.
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "stream": "s", "streamIndex": -1}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "stream": "s"}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "streamIndex": 0}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "sharedWith": 0}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "sharedWith": ["b", "b"]}, 400),
    ("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "key": "not-published"}, 404),
    ("PUT", "/v1/objects/" + "x" * 129, {"tensors": [LAYOUT]}, 400),
    ("PUT", "/v1/objects/a%20b", {"tensors": [LAYOUT]}, 400),
    ("PUT", "/v1/objects/x", b"x" * (2 << 20), 413),
    ("GET", "/v1/objects/nope", None, 404),
    ("GET", "/v1/objects/bad%21", None, 400),
    ("POST", "/v1/objects/nope/reads", {}, 404),
    ("POST", "/v1/objects/nope/reads", [1], 400),
    ("POST", "/v1/objects/nope/reads", {"reader": 5}, 400),
    ("DELETE", "/v1/reads/bad%21id", None, 400),
    ("POST", "/v1/objects/nope/free", {"waitFence": "yes"}, 400),
    ("POST", "/v1/objects/nope/free", {"reason": 5}, 400),
    ("POST", "/v1/objects/nope/free", b"{", 400),
    ("POST", "/v1/streams/bad%21/free", {}, 400),
    ("POST", "/v1/streams/s/free", {"x": 1}, 400),
    ("GET", "/v1/nothing-here", None, 404),
    ("DELETE", "/v1/objects", None, 405),
    ("GET", "/nothing-here", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD, ids=[f"{m} {p[:40]} {s}" for m, p, _, s in BAD])
def test_bad_input_gets_a_4xx_with_a_message_and_never_a_500(agent, method, path, body, status):
    raw = body if isinstance(body, bytes) else None
    got, answer = agent.request(
        method, path, None if raw is not None else body, raw=raw, auth=not path.startswith("/nothing")
    )
    assert got == status, (got, answer)
    assert isinstance(answer, dict) and isinstance(answer.get("error"), str) and answer["error"]
    assert objects(agent) == []


def test_unknown_objects_and_reads_follow_the_contract(agent):
    status, answer = agent.request("POST", "/v1/objects/ghost/reads", {"reader": "r"})
    assert status == 404 and answer == {"error": "object ghost not found (freed or never existed)"}
    assert agent.request("DELETE", "/v1/reads/r-unknown")[1] == {"ended": False, "valid": False, "expired": False}
    assert agent.request("POST", "/v1/objects/ghost/free", {})[1] == {"freed": False, "reason": "unknown object"}


def test_declared_objects_are_idempotent_and_conflicts_are_409(agent):
    status, first = agent.request("PUT", "/v1/objects/decl", {"tensors": [LAYOUT], "stream": "s", "streamIndex": 0})
    assert status == 200 and first["created"] and first["bytes"] == 64 and first["streamIndex"] == 0
    status, again = agent.request("PUT", "/v1/objects/decl", {"tensors": [LAYOUT]})
    assert status == 200 and not again["created"]
    other = {**LAYOUT, "shape": [5]}
    assert agent.request("PUT", "/v1/objects/decl", {"tensors": [other]})[0] == 409
    assert agent.request("GET", "/v1/objects/decl")[1]["tensors"] == [LAYOUT]
    assert agent.request("POST", "/v1/streams/s/free", {})[1] == {"freed": ["decl"], "bytes": 64}
    assert objects(agent) == []


def test_health_readiness_and_metrics_are_open(agent):
    assert agent.request("GET", "/healthz", auth=False) == (200, {"status": "ok"})
    status, ready = agent.request("GET", "/readyz", auth=False)
    assert status == 200 and ready["nixlAgent"].startswith("gpuobj.default.api.")
    status, text = agent.request("GET", "/metrics", auth=False)
    assert status == 200
    for name in (
        metric_names.AGENT_STORE_BYTES,
        metric_names.AGENT_STORE_OBJECTS,
        metric_names.AGENT_NIXL_REGISTERED_BYTES,
        metric_names.AGENT_NIXL_REGISTRATIONS,
        metric_names.AGENT_TRANSFER_BYTES,
        metric_names.AGENT_TRANSFER_SECONDS,
        metric_names.AGENT_FREES,
        metric_names.AGENT_FREE_WAIT_SECONDS,
        metric_names.AGENT_INFLIGHT_READS,
        metric_names.AGENT_QUARANTINED_BYTES,
        metric_names.AGENT_NIXL_GENERATIONS,
    ):
        assert f"# TYPE {name} " in text or f"# TYPE {name.removesuffix('_total')} " in text, name
    info = agent.request("GET", "/v1/info")[1]
    assert {"pod", "namespace", "podUID", "incarnation", "nixlAgent", "startedAt"} <= set(info)
    assert info["pod"] == "api" and info["podUID"] == agent.pod_uid


def test_sigterm_with_objects_that_readers_saw_exits_cleanly_and_balanced(make_process, make_runtime):
    proc = make_process("sigterm")
    reader = make_runtime("reader")
    for i in range(5):
        assert proc.request("PUT", f"/v1/objects/o{i}", {"tensors": [LAYOUT]})[0] == 200
    for i in range(3):
        assert reader.fetch(proc.endpoint, f"o{i}", token=TOKEN)[0].shape == (4, 4)
    assert proc.stop() == 0  # exit 0 only if every registration was undone
    assert "5 NIXL registrations, 5 deregistrations" in proc.output()
    settle(reader.stats)


def test_info_and_every_inventory_page_read_back_through_the_contracts_shapes(agent):
    """The agent writes these answers from gpuobj_contract.agent_api's shapes; they parse with the same."""
    ids = ["page-a", "page-b", "page-c"]
    for object_id in ids:
        assert agent.request("PUT", f"/v1/objects/{object_id}", {"tensors": [LAYOUT]})[0] == 200
    info = api.AgentInfo.from_json(agent.request("GET", "/v1/info")[1])
    assert (info.pod_uid, info.nixl_agent in info.nixl_agents) == (agent.pod_uid, True)
    first = api.Inventory.from_json(agent.request("GET", "/v1/objects?limit=2")[1])
    assert len(first.objects) == 2 and first.continue_token and first.incarnation == info.incarnation
    after = quote(first.continue_token, safe="")
    rest = api.Inventory.from_json(agent.request("GET", f"/v1/objects?limit=2&continue={after}")[1])
    assert not rest.continue_token
    paged = [o.id for o in first.objects + rest.objects]
    assert len(paged) == len(set(paged)) and set(ids) <= set(paged)  # each object on exactly one page
    assert all(o.created_at and o.devices == ("cpu",) and o.tensors for o in first.objects + rest.objects)
    for object_id in ids:
        assert agent.request("POST", f"/v1/objects/{object_id}/free", {})[1]["freed"]
    settle(lambda: _stats(agent))


def test_the_operators_probe_tells_the_write_rate_and_a_bad_one_changes_nothing(agent):
    """The operator's probe carries the pod's share of the fleet's write budget (docs/write-behind.md);
    INFO answers what the agent was last told. A probe without the header leaves it as it was."""
    told = {names.HEADER_WRITE_RATE: "2.5"}
    status, info = agent.request("GET", "/v1/info", headers=told)
    assert status == 200 and info["writeRate"] == 2.5
    assert agent.request("GET", "/v1/info")[1]["writeRate"] == 2.5
    for bad in ("fast", "-1", "nan", "inf", "1e9"):
        status, answer = agent.request("GET", "/v1/info", headers={names.HEADER_WRITE_RATE: bad})
        assert status == 400 and names.HEADER_WRITE_RATE in answer["error"], (bad, answer)
    assert agent.request("GET", "/v1/info")[1]["writeRate"] == 2.5
    status, answer = agent.request("GET", "/v1/info", headers=told, auth=agent.reader_token)
    assert status == 403, answer  # a reader's token opens the read routes only
    assert agent.request("GET", "/v1/info", headers={names.HEADER_WRITE_RATE: "0"})[1]["writeRate"] is None
