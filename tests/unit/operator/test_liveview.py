"""The live view's pure parts: rows from an inventory, states, pages, the kubectl Table, requestheader auth."""

from __future__ import annotations

import datetime as dt

import pytest
from multidict import CIMultiDict

from gpuobj_contract.agent_api import Inventory, InventoryItem
from gpuobj_operator.liveview import rows as view
from gpuobj_operator.liveview.server import RequestHeaderConfig, Unauthorized, authenticate

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def inventory(*items: InventoryItem, pod: str = "p", namespace: str = "ns") -> Inventory:
    return Inventory(pod=pod, namespace=namespace, pod_uid="uid-" + pod, incarnation="i", objects=items)


def test_states_and_holders_come_from_inventory_and_ledger() -> None:
    inv = inventory(
        InventoryItem("a", 10, age_seconds=0.05),
        InventoryItem("b", 20, record_pending=True),
        InventoryItem("c", 30),
        InventoryItem("d", 40, freeing=True),
    )
    rows = {r.object_id: r for r in view.rows_of(inv, {"c": view.Recorded("obj-c", 3), "d": view.Recorded("x", 1)})}
    assert [rows[k].state for k in "abcd"] == ["unrecorded", "pending", "recorded", "releasing"]
    assert (rows["c"].holders, rows["c"].recorded_name) == (3, "obj-c")
    assert (rows["a"].holders, rows["a"].recorded_name) == (1, "")
    assert rows["a"].name == "p.a" and rows["a"].pod == "p" and rows["a"].bytes == 10


def test_pages_walk_every_row_once_in_order() -> None:
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i:03}", i) for i in range(25))), {})
    seen, token, pages = [], "", 0
    while True:
        chunk, token = view.page(rows, 10, token or None)
        seen += [r.object_id for r in chunk]
        pages += 1
        if not token:
            break
    assert pages == 3 and seen == sorted(f"o{i:03}" for i in range(25))


def test_a_page_after_rows_went_away_goes_on_from_its_key() -> None:
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i}", i) for i in range(4))), {})
    first, token = view.page(rows, 2, None)
    rest, end = view.page([r for r in rows if r.object_id != "o0"], 2, token)
    assert [r.object_id for r in first + rest] == ["o0", "o1", "o2", "o3"] and end == ""


@pytest.mark.parametrize("token", ["%%%", "bm90IGpzb24", view.encode_continue(("a", "b"))[:-3] + "AAA"])
def test_a_bad_continue_token_is_a_bad_request(token: str) -> None:
    with pytest.raises(view.BadRequest):
        view.page([], 1, token)


@pytest.mark.parametrize(("text", "limit"), [(None, 0), ("", 0), ("7", 7), ("999999", view.MAX_LIMIT)])
def test_limits(text: str | None, limit: int) -> None:
    assert view.parse_limit(text) == limit


@pytest.mark.parametrize("text", ["-1", "x"])
def test_bad_limits(text: str) -> None:
    with pytest.raises(view.BadRequest):
        view.parse_limit(text)


def test_kubectl_gets_a_table_with_the_columns_and_the_continue_token() -> None:
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,"
    accept += "application/json"
    assert view.wants_table(accept) and not view.wants_table("application/json")
    rows = view.rows_of(inventory(InventoryItem("a", 10, age_seconds=125)), {})
    table = view.to_table(rows, "tok", NOW)
    assert table["kind"] == "Table" and table["metadata"] == {"continue": "tok"}
    assert [c["name"] for c in table["columnDefinitions"]][:6] == [
        "Name",
        "Pod",
        "Bytes",
        "Holders",
        "State",
        "Recorded",
    ]
    assert table["rows"][0]["cells"] == ["p.a", "p", 10, 1, "unrecorded", "", "2m"]
    assert table["rows"][0]["object"]["metadata"]["namespace"] == "ns"
    listed = view.to_list(rows, "", NOW)
    assert listed["items"][0]["status"]["bytes"] == 10 and listed["metadata"] == {}


@pytest.mark.parametrize(("seconds", "text"), [(5, "5s"), (61, "1m"), (7199, "119m"), (7200, "2h"), (3 * 86400, "3d")])
def test_ages_print_as_kubectl_does(seconds: float, text: str) -> None:
    assert view.human_age(seconds) == text


CONFIG = RequestHeaderConfig(client_ca="pem", allowed_names=("front-proxy-client",))
PEER = {"subject": ((("commonName", "front-proxy-client"),),)}


def test_the_front_proxy_names_the_user_and_groups() -> None:
    headers = CIMultiDict([("X-Remote-User", "alice"), ("X-Remote-Group", "dev"), ("X-Remote-Group", "all")])
    assert authenticate(CONFIG, PEER, headers).groups == ("dev", "all")


@pytest.mark.parametrize(
    ("peer", "headers"),
    [
        (None, {"X-Remote-User": "alice"}),  # no client certificate: anyone could set the header
        ({"subject": ((("commonName", "someone-else"),),)}, {"X-Remote-User": "alice"}),
        (PEER, {}),
    ],
)
def test_requests_not_from_the_front_proxy_are_refused(peer: dict | None, headers: dict) -> None:
    with pytest.raises(Unauthorized):
        authenticate(CONFIG, peer, CIMultiDict(headers))


def test_the_configmap_gives_the_requestheader_settings() -> None:
    config = RequestHeaderConfig.from_configmap(
        {
            "requestheader-client-ca-file": "PEM",
            "requestheader-allowed-names": '["front-proxy-client"]',
            "requestheader-username-headers": '["X-Remote-User"]',
            "requestheader-group-headers": '["X-Remote-Group"]',
        }
    )
    assert config.allowed_names == ("front-proxy-client",) and config.client_ca == "PEM"
    with pytest.raises(ValueError, match="requestheader-client-ca-file"):
        RequestHeaderConfig.from_configmap({"client-ca-file": "PEM"})


def test_discovery_keeps_the_view_out_of_the_gpuobj_category() -> None:
    """`kubectl get gpuobj` expands the category: the view in it would fail that command whenever the
    operator is down or a cached discovery outlives a removed APIService (kubernetes#83332)."""
    (resource,) = view.discovery()["resources"]
    assert resource["name"] == "liveobjects"
    assert resource["shortNames"] == ["lgo"]
    assert "categories" not in resource
