"""The agent control API's routes and shapes (gpuobj_contract.agent_api): both sides read the same code."""

from __future__ import annotations

import copy
import re

import pytest

from gpuobj_contract import agent_api as api
from gpuobj_contract.layouts import TensorLayout


def test_paths_percent_encode_their_parameters() -> None:
    assert api.FREE.path(id="o-1") == "/v1/objects/o-1/free"
    assert api.END_READ.path(read_id="a/b c") == "/v1/reads/a%2Fb%20c"
    assert api.FREE_STREAM.method == "POST" and api.FREE_STREAM.path(stream="s") == "/v1/streams/s/free"
    assert all(not r.template.startswith(api.PROTECTED_PREFIX) for r in api.OPEN_ROUTES)


@pytest.mark.parametrize("text", ["o-1\n", "", "a" * 129, "o 1", "o/1", None, 7])
def test_object_ids_are_matched_in_full(text: object) -> None:
    assert not api.is_object_id(text)


def test_valid_ids_and_stream_names() -> None:
    assert api.is_object_id("o-" + "f" * 32) and api.is_object_id("A.b_c-9")
    assert api.is_stream_name("acts-1") and not api.is_stream_name("Acts") and not api.is_stream_name("acts\n")


def test_free_shapes_round_trip_both_answers() -> None:
    assert api.FreeRequest().to_json() == {}
    assert api.FreeRequest(reason="Released", wait_fence=True).to_json() == {"waitFence": True, "reason": "Released"}
    freed = api.FreeAnswer(freed=True, bytes=4096, waited_seconds=0.5, fenced=False)
    assert api.FreeAnswer.from_json(freed.to_json()) == freed
    noop = api.FreeAnswer.from_json({"freed": False, "reason": "unknown object"})
    assert (noop.freed, noop.bytes, noop.reason) == (False, 0, "unknown object")


def test_inventory_parses_what_an_agent_sends_and_ignores_new_fields() -> None:
    data = {
        "pod": "src",
        "namespace": "ml",
        "podUID": "u1",
        "incarnation": "i1",
        "futureField": 1,
        "objects": [
            {
                "id": "o-1",
                "bytes": 64,
                "tensors": [{"shape": [4, 4], "dtype": "float32", "device": "cpu"}],
                "ageSeconds": 1.5,
                "inflightReads": 2,
                "stream": "s",
                "streamIndex": 3,
                "freeing": True,
            }
        ],
    }
    inv = api.Inventory.from_json(data)
    (item,) = inv.objects
    assert (inv.pod, inv.pod_uid, inv.incarnation) == ("src", "u1", "i1")
    assert item.tensors == (TensorLayout((4, 4), "float32", "cpu"),) and item.bytes == 64
    assert (item.inflight_reads, item.stream_index, item.freeing) == (2, 3, True)


def test_materialize_and_read_end_shapes() -> None:
    req = api.MaterializeRequest((TensorLayout((2,), "int8", "cpu"),), key="weights")
    assert req.to_json() == {"tensors": [{"shape": [2], "dtype": "int8", "device": "cpu"}], "key": "weights"}
    end = api.ReadEndAnswer.from_json({"ended": True, "valid": True, "expired": False})
    assert end.to_json() == {"ended": True, "valid": True, "expired": False}


def test_materialize_names_the_namespaces_it_shares_with_and_answers_the_holding_process() -> None:
    req = api.MaterializeRequest((TensorLayout((2,), "int8", "cpu"),), stream="s", stream_index=0, shared_with=("b",))
    assert req.to_json() == {
        "tensors": [{"shape": [2], "dtype": "int8", "device": "cpu"}],
        "stream": "s",
        "streamIndex": 0,
        "sharedWith": ["b"],
    }
    answer = api.MaterializeAnswer(created=True, id="o-1", bytes=2, incarnation="i-7")
    assert api.MaterializeAnswer.from_json({**answer.to_json(), "tensors": [], "createdAt": "x"}) == answer
    assert api.MaterializeAnswer.from_json({"created": False}).incarnation == ""  # an older agent: unknown


def _ticket(**overrides: object) -> dict:
    data = {
        "readId": "r-1",
        "nixlAgent": "src-g1",
        "agentMetadata": "bWQ=",
        "descriptors": "ZA==",
        "spans": [["DRAM", 0, 4096, 64], None],
        "tensors": [
            {"shape": [4, 4], "dtype": "float32", "device": "cpu"},
            {"shape": [0], "dtype": "int8", "device": "cpu"},
        ],
        "bytes": 64,
        "leaseSeconds": 2.5,
        "liveAgents": ["src-g1", "src-g2"],
        "incarnation": "i1",
        "futureField": True,
    }
    data.update(overrides)
    return data


def test_a_read_ticket_and_a_grant_parse_into_one_shape() -> None:
    ticket = api.ReadTicket.from_json(_ticket())
    assert ticket.read_id == "r-1" and ticket.lease_seconds == 2.5 and ticket.nixl_agent == "src-g1"
    assert ticket.spans == (api.ReadSpan("DRAM", 0, 4096, 64), None)
    assert ticket.tensors[0] == TensorLayout((4, 4), "float32", "cpu") and ticket.live_agents == ("src-g1", "src-g2")
    grant = _ticket(generation=3)
    del grant["readId"], grant["leaseSeconds"]
    parsed = api.ReadTicket.from_json(grant)
    assert (parsed.read_id, parsed.lease_seconds, parsed.generation) == ("", 0.0, 3)
    assert api.ReadRequest("pod-a").to_json() == {"reader": "pod-a"}
    assert api.ReadSpan.from_json(["VRAM", 1, 0, 8]).to_json() == ["VRAM", 1, 0, 8]


@pytest.mark.parametrize(
    "overrides",
    [
        {"spans": [["DRAM", 0, 4096, 65], None]},  # a span that does not cover its tensor exactly
        {"spans": [["DRAM", 0, 4096, 64]]},  # fewer spans than tensors
        {"spans": [["HBM", 0, 4096, 64], None]},
        {"spans": [["DRAM", 0, -1, 64], None]},
        {"spans": [["DRAM", True, 4096, 64], None]},
        {"nixlAgent": 7},
        {"tensors": [{"shape": [4, 4], "dtype": "float99"}, {"shape": [0], "dtype": "int8"}]},
        {"spans": None},
    ],
)
def test_a_malformed_read_ticket_is_a_value_error(overrides: dict) -> None:
    with pytest.raises(ValueError):
        api.ReadTicket.from_json(_ticket(**overrides))
    with pytest.raises(ValueError):
        api.ReadTicket.from_json([])


def test_a_memo_reuses_what_equal_lists_parsed_to_and_never_a_malformed_one() -> None:
    """A model's next version repeats its grant's lists: equal lists (new objects, as a pickled hand-off
    brings them) give what they parsed to before; a different or malformed list is parsed (and refused) anew."""
    memo = api.ParseMemo(size=2)
    first = api.ReadTicket.from_json(_ticket(), memo)
    again = api.ReadTicket.from_json(copy.deepcopy(_ticket()), memo)
    assert again == first and again.tensors is first.tensors and again.spans is first.spans
    moved = api.ReadTicket.from_json(_ticket(spans=[["DRAM", 0, 8192, 64], None]), memo)
    assert moved.spans == (api.ReadSpan("DRAM", 0, 8192, 64), None) and moved.tensors is first.tensors
    for _ in range(2):  # refused every time: nothing of it was remembered
        with pytest.raises(ValueError):
            api.ReadTicket.from_json(_ticket(spans=[["DRAM", 0, 4096, 65], None]), memo)
        with pytest.raises(ValueError):
            api.ReadTicket.from_json(_ticket(tensors=[{"shape": [-4], "dtype": "float32"}, {"shape": [0]}]), memo)
    api.ReadTicket.from_json(_ticket(spans=[["DRAM", 0, 1 << 20, 64], None]), memo)  # size 2: the oldest goes
    assert api.ReadTicket.from_json(_ticket(), memo).spans is not first.spans


def test_every_answer_the_agent_writes_reads_back_the_same() -> None:
    """The agent builds its answers from these shapes; the operator and the fetcher read them with the same."""
    layout = TensorLayout((2,), "int8", "cpu")
    ticket = api.ReadTicket(
        nixl_agent="src-g1",
        agent_metadata="bWQ=",
        spans=(api.ReadSpan("DRAM", 0, 4096, 2),),
        tensors=(layout,),
        nbytes=2,
        live_agents=("src-g1",),
        incarnation="i-1",
        read_id="r-1",
        lease_seconds=2.5,
        descriptors="ZA==",
    )
    assert api.ReadTicket.from_json(ticket.to_json()) == ticket
    grant = api.ReadTicket("src-g1", "", (None,), (TensorLayout((0,), "int8", "cpu"),), generation=3)
    assert "readId" not in grant.to_json() and "leaseSeconds" not in grant.to_json()
    assert api.ReadTicket.from_json(grant.to_json()) == grant
    assert "nextAgent" not in grant.to_json()  # only a pooled object's answer announces a spare
    announcing = api.ReadTicket(
        "src-g1", "", (None,), (layout,), generation=3, next_agent="src-g4", next_agent_metadata="Y29ubg=="
    )
    assert announcing.to_json()["nextAgent"] == "src-g4"
    assert api.ReadTicket.from_json(announcing.to_json()) == announcing
    with pytest.raises(ValueError, match="nextAgent"):
        api.ReadTicket.from_json({**announcing.to_json(), "nextAgentMetadata": 7})
    info = api.AgentInfo("p", "ns", "uid", "inc", "p-g1", ("p-g1",), "2026-01-01T00:00:00.000Z", "h:1")
    assert api.AgentInfo.from_json(info.to_json()) == info
    described = api.ObjectDescription("o-1", 2, (layout,), "t", "s", 0)
    assert api.ObjectDescription.from_json(described.to_json()) == described
    answer = api.MaterializeAnswer(True, "o-1", 2, "inc", described)
    assert answer.to_json()["createdAt"] == "t" and api.MaterializeAnswer.from_json(answer.to_json()).id == "o-1"
    assert api.ErrorAnswer.from_json(api.ErrorAnswer("no").to_json()) == api.ErrorAnswer("no")
    assert api.HealthAnswer.from_json(api.HealthAnswer("ready", "p-g1").to_json()).nixl_agent == "p-g1"
    assert api.HandoffReleaseAnswer().to_json() == {"released": True}
    item = api.InventoryItem("o-1", 2, 1.5, "s", 0, "k", 1, True, True, (layout,), "t", ("cpu",))
    page = api.Inventory("p", "ns", "uid", "inc", (item,), continue_token=api.inventory_token(item))
    assert api.Inventory.from_json(page.to_json()) == page
    assert api.inventory_order(item) == api.inventory_order(item.to_json()) == ("t", "o-1")


LAYOUT_JSON = {"shape": [2], "dtype": "int8", "device": "cpu"}


def test_every_request_the_operator_and_the_fetcher_send_reads_back_the_same() -> None:
    """The agent reads its request bodies with the shapes the operator and the fetcher write them with."""
    layout = TensorLayout((2,), "int8", "cpu")
    for req in (
        api.MaterializeRequest((layout,)),
        api.MaterializeRequest((layout,), key="weights", stream="acts", stream_index=3, shared_with=("b", "c")),
    ):
        assert api.MaterializeRequest.from_json(req.to_json()) == req
    for free in (api.FreeRequest(), api.FreeRequest(reason="Released", wait_fence=True)):
        assert api.FreeRequest.from_json(free.to_json()) == free
    assert api.ReadRequest.from_json(api.ReadRequest("pod-a").to_json()) == api.ReadRequest("pod-a")
    # An empty body is a free with no reason and a read by an unnamed reader.
    assert api.FreeRequest.from_json({}) == api.FreeRequest() and api.ReadRequest.from_json({}).reader == ""
    # A device is spelled one way ("cuda" is cuda:0), so the agent compares layouts as the operator sent them.
    gpu = api.MaterializeRequest.from_json({"tensors": [{"shape": [], "dtype": "bfloat16", "device": "cuda"}]})
    assert gpu.tensors == (TensorLayout((), "bfloat16", "cuda:0"),)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([LAYOUT_JSON], "JSON object"),
        (None, "JSON object"),
        ({}, "tensors"),
        ({"tensors": []}, "tensors"),
        ({"tensors": {"shape": [2]}}, "tensors"),
        ({"tensors": [{"shape": [-1], "dtype": "int8"}]}, "tensors[0].shape"),
        ({"tensors": [LAYOUT_JSON, {"shape": [1], "dtype": "float99"}]}, "tensors[1].dtype"),
        ({"tensors": [{"shape": [1], "dtype": "int8", "device": "tpu"}]}, "tensors[0].device"),
        ({"tensors": [LAYOUT_JSON], "colour": "red"}, "colour"),
        ({"tensors": [LAYOUT_JSON], "key": "bad key!"}, "key"),
        ({"tensors": [LAYOUT_JSON], "key": ""}, "key"),
        ({"tensors": [LAYOUT_JSON], "key": 7}, "key"),
        ({"tensors": [LAYOUT_JSON], "stream": "Bad_Stream", "streamIndex": 0}, "stream"),
        ({"tensors": [LAYOUT_JSON], "stream": "s", "streamIndex": "3"}, "streamIndex"),
        ({"tensors": [LAYOUT_JSON], "stream": "s", "streamIndex": True}, "streamIndex"),
        ({"tensors": [LAYOUT_JSON], "stream": "s", "streamIndex": -1}, "streamIndex"),  # the CRD's minimum is 0
        ({"tensors": [LAYOUT_JSON], "stream": "s", "streamIndex": 2.0}, "streamIndex"),
        ({"tensors": [LAYOUT_JSON], "stream": "s"}, "streamIndex"),  # spec.stream requires both
        ({"tensors": [LAYOUT_JSON], "streamIndex": 0}, "stream"),
        ({"tensors": [LAYOUT_JSON], "sharedWith": "ns-b"}, "sharedWith"),
        ({"tensors": [LAYOUT_JSON], "sharedWith": 0}, "sharedWith"),  # was read as "no namespaces"
        ({"tensors": [LAYOUT_JSON], "sharedWith": False}, "sharedWith"),
        ({"tensors": [LAYOUT_JSON], "sharedWith": ["Ns_B"]}, "sharedWith"),
        ({"tensors": [LAYOUT_JSON], "sharedWith": [["b"]]}, "sharedWith"),
        ({"tensors": [LAYOUT_JSON], "sharedWith": ["b", "b"]}, "sharedWith"),  # a set in the CRD
        ({"tensors": [LAYOUT_JSON], "sharedWith": [f"n{i}" for i in range(65)]}, "sharedWith"),
    ],
)
def test_a_bad_materialize_request_is_a_request_error_naming_its_field(body: object, field: str) -> None:
    with pytest.raises(api.RequestError, match=re.escape(field)):
        api.MaterializeRequest.from_json(body)


@pytest.mark.parametrize(
    ("shape", "body", "field"),
    [
        (api.FreeRequest, [], "JSON object"),
        (api.FreeRequest, {"waitFence": "yes"}, "waitFence"),
        (api.FreeRequest, {"waitFence": 1}, "waitFence"),
        (api.FreeRequest, {"waitfence": True}, "waitfence"),  # misspelt: refused, not ignored
        (api.FreeRequest, {"reason": 5}, "reason"),
        (api.FreeRequest, {"reason": "x" * (api.MAX_REASON + 1)}, "reason"),
        (api.ReadRequest, [1], "JSON object"),
        (api.ReadRequest, {"reader": 5}, "reader"),
        (api.ReadRequest, {"reader": "r" * (api.MAX_READER + 1)}, "reader"),
        (api.ReadRequest, {"reader": "r", "lease": 60}, "lease"),
    ],
)
def test_a_bad_free_or_read_request_is_a_request_error_naming_its_field(shape: type, body: object, field: str) -> None:
    with pytest.raises(api.RequestError, match=field):
        shape.from_json(body)


def test_request_errors_are_value_errors_and_name_the_allowed_fields() -> None:
    with pytest.raises(ValueError, match=r"allowed: \['reason', 'waitFence'\]"):
        api.FreeRequest.from_json({"colour": "red"})


def test_info_reads_the_told_write_rate_and_ignores_one_that_is_not_a_number() -> None:
    base = {"pod": "p", "namespace": "n", "podUID": "u", "incarnation": "i"}
    assert api.AgentInfo.from_json({**base, "writeRate": 0.25}).write_rate == 0.25
    for odd in (None, "fast", True, [1]):
        assert api.AgentInfo.from_json({**base, "writeRate": odd}).write_rate is None
    told = api.AgentInfo("p", "n", "u", "i", write_rate=2.0)
    assert api.AgentInfo.from_json(told.to_json()) == told
