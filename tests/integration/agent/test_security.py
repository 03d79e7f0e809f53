"""The agent as an attacker in a workload pod would probe it (issue 11), and a fuzzer of its HTTP API.

Each probe asserts the refusal (401/403/409/4xx) and that nothing changed: the object is still
there, no read is in flight. The fuzzer sends what hypothesis makes of methods, paths, headers
(including bytes that are not UTF-8) and bodies over a raw socket: every answer is a 4xx or a
harmless 200, never a 5xx, and the store is as before.
"""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuobj_agent.layouts import TensorLayout
from gpuobj_dev.testing.agent_workload import AgentProcess
from gpuobj_dev.testing.issuer import OPERATOR, TestIssuer

from .conftest import ISSUER, OPERATOR_TOKEN, TOKEN, settle
from .test_stale_reader import RawReader

pytestmark = pytest.mark.nixl

LAYOUT = {"shape": [4, 4], "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    proc = AgentProcess("sec", namespace="default", workdir=tmp_path_factory.mktemp("sec")).start()
    try:
        assert proc.request("PUT", "/v1/objects/kept", {"tensors": [LAYOUT]})[0] == 200
        yield proc
        assert proc.request("POST", "/v1/objects/kept/free", {})[1]["freed"]
        proc.stop()
    finally:
        proc.close()


def unchanged(agent: AgentProcess) -> None:
    status, inv = agent.request("GET", "/v1/objects")
    assert status == 200, inv
    assert [(o["id"], o["bytes"], o["inflightReads"]) for o in inv["objects"]] == [("kept", 64, 0)]


def bearer(token: str) -> str:
    return f"Bearer {token}"


# ------------------------------------------------------------------ the issue's probes, repeated


def test_a_workload_token_cannot_free_list_or_materialize(agent):
    """Probe 1: another pod's token (any namespace) on the control routes: 403, nothing changes."""
    for token in (TOKEN, ISSUER.token("other/default", pod=("intruder", "uid-x")), ISSUER.token("default/default")):
        for method, path, body in (
            ("GET", "/v1/objects", None),
            ("GET", "/v1/info", None),
            ("POST", "/v1/objects/kept/free", {}),
            ("PUT", "/v1/objects/big", {"tensors": [{"shape": [1 << 26], "dtype": "float32"}]}),
            ("POST", "/v1/streams/s/free", {}),
        ):
            status, answer = agent.request(method, path, body, auth=token)
            assert status == 403, (method, path, status, answer)
            assert "not the gpuobj operator" in answer["error"]
    unchanged(agent)


def test_a_token_of_another_issuer_or_audience_is_refused(agent):
    stranger = TestIssuer()  # never published: its keys are unknown to the agent
    stranger.kid = ISSUER.kid
    for token in (
        stranger.token(OPERATOR, issuer=ISSUER.url),
        ISSUER.token(OPERATOR, audience="https://kubernetes.default.svc.cluster.local"),
        ISSUER.token(OPERATOR, lifetime=-300),
    ):
        assert agent.request("POST", "/v1/objects/kept/free", {}, auth=token)[0] == 401
    unchanged(agent)


def test_a_reader_of_another_namespace_is_refused_before_anything_is_handed_out(agent):
    """Probe 1 again: a pod of namespace B reads an object of namespace A: 403, no ticket, no metadata."""
    outsider = ISSUER.token("b/default", pod=("thief", "uid-thief"))
    for object_id in ("kept", "does-not-exist"):  # the same answer whether or not the object exists
        status, answer = agent.request("POST", f"/v1/objects/{object_id}/reads", {}, auth=outsider)
        assert status == 403 and "may not read" in answer["error"], answer
        assert "metadata" not in answer
    # The operator is not a reader either: its token is not bound to a pod.
    assert agent.request("POST", "/v1/objects/kept/reads", {}, auth=OPERATOR_TOKEN)[0] == 403
    unchanged(agent)


def test_an_object_granted_to_a_namespace_is_readable_from_it_only(agent):
    granted = {"tensors": [LAYOUT], "sharedWith": ["b"]}
    assert agent.request("PUT", "/v1/objects/shared", granted)[0] == 200
    try:
        for ns, allowed in (("b", True), ("c", False)):
            token = ISSUER.token(f"{ns}/default", pod=("reader", f"uid-{ns}"))
            status, ticket = agent.request("POST", "/v1/objects/shared/reads", {}, auth=token)
            assert (status == 200) is allowed, (ns, status, ticket)
            if allowed:
                assert agent.request("DELETE", f"/v1/reads/{ticket['readId']}", auth=token)[1]["valid"]
        assert agent.request("PUT", "/v1/objects/x", {"tensors": [LAYOUT], "sharedWith": ["Bad_NS"]})[0] == 400
    finally:
        assert agent.request("POST", "/v1/objects/shared/free", {})[1]["freed"]
    unchanged(agent)


def test_the_operator_naming_another_pod_is_refused(agent):
    """Confused deputy: the operator means pod uid X; an agent serving another pod refuses (409), and does
    not say which pod it serves (a replayer would put that in the header)."""
    status, answer = agent.request("POST", "/v1/objects/kept/free", {}, headers={"Gpuobj-Pod-UID": "someone-else"})
    assert status == 409 and agent.pod_uid not in answer["error"], answer
    assert agent.request("GET", "/v1/objects", headers={"Gpuobj-Pod-UID": agent.pod_uid})[0] == 200
    unchanged(agent)


def test_the_operators_token_without_the_pod_it_means_is_refused_on_every_control_route(agent):
    """Issue 21: the operator's token, replayed at an agent with no Gpuobj-Pod-UID, got 200 on the inventory
    and `freed: true` on a free. The header is mandatory on control routes: 409, nothing changes, and a
    reader's request may name the pod too (a wrong one is refused the same way)."""
    for method, path, body in (("GET", "/v1/objects", b""), ("GET", "/v1/info", b""),
                               ("POST", "/v1/objects/kept/free", b"{}"), ("POST", "/v1/streams/s/free", b"{}"),
                               ("PUT", "/v1/objects/new", json.dumps({"tensors": [LAYOUT]}).encode())):  # fmt: skip
        head = f"{method} {path} HTTP/1.1\r\nAuthorization: Bearer {OPERATOR_TOKEN}\r\n".encode()
        status, data = raw_request(agent, head, body)
        assert status == 409 and b"Gpuobj-Pod-UID" in data and agent.pod_uid.encode() not in data, (path, data)
    status, answer = agent.request("POST", "/v1/objects/kept/reads", {}, headers={"Gpuobj-Pod-UID": "another"})
    assert status == 409, answer
    unchanged(agent)


def test_only_the_pod_that_took_a_read_ends_it(agent):
    """Issue 21: a pod of another namespace ended another pod's read (200; the contract says 403). Ending a
    read lets a waiting free proceed under a reader that still counts its bytes as valid."""
    status, ticket = agent.request("POST", "/v1/objects/kept/reads", {})
    assert status == 200, ticket
    read = f"/v1/reads/{ticket['readId']}"
    for stranger in (ISSUER.token("b/default", pod=("thief", "uid-thief")),
                     ISSUER.token("default/default", pod=("peer", "uid-peer"))):  # fmt: skip
        status, answer = agent.request("DELETE", read, auth=stranger)
        assert status == 403 and "another pod took it" in answer["error"], answer
    assert agent.request("GET", "/v1/objects")[1]["objects"][0]["inflightReads"] == 1
    assert agent.request("DELETE", read)[1] == {"ended": True, "valid": True, "expired": False}
    unchanged(agent)


def test_ids_are_matched_in_full(agent):
    """Probe: `re.match` with `$` let "kept\\n" through."""
    for path in ("/v1/objects/kept%0A/free", "/v1/objects/kept%0A", "/v1/streams/s%0A/free"):
        method = "GET" if path.endswith("%0A") else "POST"
        status, answer = agent.request(method, path, {} if method == "POST" else None)
        assert status == 400, (path, status, answer)
    unchanged(agent)


def test_a_non_utf8_authorization_header_is_a_401_not_a_500(agent):
    """Probe: `Authorization: Bearer \\xff\\xfe` was a 500."""
    for header in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer " + TOKEN.encode() + b"\x80"):
        meant = f"Gpuobj-Pod-UID: {agent.pod_uid}\r\n".encode()
        status, _ = raw_request(agent, b"GET /v1/objects HTTP/1.1\r\n" + meant + b"Authorization: " + header + b"\r\n")
        assert status == 401, header
    unchanged(agent)


# ------------------------------------------------------------------ fuzzing


def raw_request(agent: AgentProcess, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly these bytes (request line and headers, then the body); return (status, answer)."""
    host, port = agent.endpoint.rsplit(":", 1)
    message = head + f"Host: {agent.endpoint}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(message + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    line = data.split(b"\r\n", 1)[0].split()
    return (int(line[1]) if len(line) > 1 and line[1].isdigit() else 0), data


SEGMENTS = st.one_of(
    st.sampled_from(["v1", "objects", "reads", "free", "streams", "info", "kept", "..", ".", "%2F", "%00", "%0A"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/?#"), max_size=20).map(
        lambda s: "".join(c if c.isalnum() else f"%{ord(c) & 0xFF:02X}" for c in s)
    ),
)
PATHS = st.lists(SEGMENTS, min_size=1, max_size=5).map(lambda parts: "/v1/" + "/".join(parts))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
BODIES = st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=200))
AUTH = st.one_of(
    st.just(b"Bearer " + OPERATOR_TOKEN.encode()),
    st.just(b"Bearer " + TOKEN.encode()),
    st.binary(max_size=60).map(lambda b: b"Bearer " + b.replace(b"\r", b"").replace(b"\n", b"")),
    st.just(b""),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH", "HEAD"]), path=PATHS, auth=AUTH, body=BODIES)
def test_fuzzed_requests_never_get_a_5xx_and_change_nothing(agent, method, path, auth, body):
    if "kept" in path and method in ("POST", "DELETE") and auth.endswith(OPERATOR_TOKEN.encode()):
        return  # the operator freeing the object is not an attack
    head = f"{method} {path} HTTP/1.1\r\n".encode() + (b"Authorization: " + auth + b"\r\n" if auth else b"")
    status, data = raw_request(agent, head, body)
    assert 200 <= status < 500, (method, path, auth[:20], body[:60], data[:300])
    unchanged(agent)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JSON)
def test_fuzzed_materialize_bodies_are_refused_with_a_4xx(agent, body):
    status, answer = agent.request("PUT", "/v1/objects/fuzzed", raw=json.dumps(body).encode())
    assert 400 <= status < 500, (body, status, answer)
    unchanged(agent)


# ------------------------------------------------------------------ a reader reaches only its own bytes


@pytest.mark.parametrize("transport", ["default", "tcp"])
def test_a_reader_asking_for_bytes_just_outside_its_span_gets_nothing(make_process, transport):
    """Probe: a 4 KiB object that views a 1 MiB tensor; its reader asks for the bytes next to it.

    The agent registers exactly the object's bytes, and keeps UCX off cma (which no registration bounds),
    so on every transport gpuobj enables the read outside the span fails and the source is unharmed."""
    env = {"tcp": {"UCX_TLS": "tcp"}, "default": {"GPUOBJ_ALLOW_CMA": "true"}}[transport]
    src = make_process("src", workload=True, env=env)
    layout = TensorLayout((4096,), "uint8", "cpu")
    body = {"id": "view", "tensors": [layout.to_json()], "seed": 7, "within": {"bytes": 1 << 20, "offset": 64 << 10}}
    status, put = src.request("POST", "/v1/test/put", body)
    assert status == 200, put
    assert src.stats()["registeredRegions"] == 1
    reader = RawReader(f"outside-{transport}", {}, "thread")  # the reader allows every transport, cma included
    try:
        status, ticket = src.request("POST", "/v1/objects/view/reads", {})
        assert status == 200, ticket
        assert reader.call(op="load", metadata=ticket["agentMetadata"])["ok"]
        ((mem, dev, addr, nbytes),) = ticket["spans"]
        agent = ticket["nixlAgent"]
        inside = reader.call(op="read_span", agent=agent, mem=mem, dev=dev, addr=addr, nbytes=nbytes)
        assert inside["ok"], inside
        for where, start, length in (("after", addr + nbytes, 4096), ("before", addr - 4096, 4096),
                                     ("overlapping the end", addr + nbytes - 16, 32),
                                     ("the whole tensor", addr - (64 << 10), 1 << 20)):  # fmt: skip
            got = reader.call(op="read_span", agent=agent, mem=mem, dev=dev, addr=start, nbytes=length)
            assert not got["ok"], (where, got)
        assert src.alive() and src.request("GET", "/readyz", auth=False)[0] == 200
        assert src.request("DELETE", f"/v1/reads/{ticket['readId']}")[1]["ended"] in (True, False)
        assert src.request("POST", "/v1/objects/view/free", {"waitFence": True})[1]["freed"]
    finally:
        reader.close()
    settle(src.stats)


def test_a_pod_byte_quota_refuses_puts_and_declared_objects_beyond_it(make_process):
    """Probe: a declared object naming a pod made its agent allocate 256 MiB. With a quota, nothing is allocated."""
    src = make_process("quota", workload=True, env={"GPUOBJ_MAX_STORE_BYTES": str(64 << 10)})
    small = TensorLayout((32 << 10,), "uint8", "cpu").to_json()
    assert src.request("PUT", "/v1/objects/fits", {"tensors": [small]})[0] == 200
    big = {"shape": [1 << 26], "dtype": "float32", "device": "cpu"}
    status, answer = src.request("PUT", "/v1/objects/big", {"tensors": [big]})
    assert status == 507 and "quota" in answer["error"], answer
    status, answer = src.request("POST", "/v1/test/put", {"id": "put", "tensors": [small, small]})
    assert status >= 400 and "quota" in str(answer), answer
    assert [o["id"] for o in src.request("GET", "/v1/objects")[1]["objects"]] == ["fits"]
    assert src.request("POST", "/v1/objects/fits/free", {})[1]["freed"]
    settle(src.stats)
