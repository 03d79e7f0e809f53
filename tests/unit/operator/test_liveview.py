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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def walk(snaps: view.Snapshots, rows: list[view.LiveRow], limit: int, ns: str | None = "ns", user: str = "u") -> list:
    """Every page of one list, as kubectl pages: (object ids of each page)."""
    chunk, token = snaps.first(rows, limit, ns, user)
    pages = [[r.object_id for r in chunk]]
    while token:
        chunk, token = snaps.next(view.decode_continue(token), limit, ns, user)
        pages.append([r.object_id for r in chunk])
    return pages


def test_pages_walk_every_row_once_in_order() -> None:
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i:03}", i) for i in reversed(range(25)))), {})
    snaps = view.Snapshots()
    pages = walk(snaps, rows, 10)
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [o for p in pages for o in p] == sorted(f"o{i:03}" for i in range(25))
    assert len(snaps) == 1  # kept until its age: a retried last page is answered again


def test_a_list_that_fits_one_page_keeps_nothing() -> None:
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i}", i) for i in range(3))), {})
    snaps = view.Snapshots()
    assert walk(snaps, rows, 3) == [["o0", "o1", "o2"]] and walk(snaps, rows, 0) == [["o0", "o1", "o2"]]
    assert len(snaps) == 0


def test_later_pages_slice_the_first_pages_snapshot_not_the_rows_of_now() -> None:
    """Rows that come or go after the first page change no later page: the list is one snapshot, as a
    list pinned to a resourceVersion is; the next list sees them."""
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i}", i) for i in range(4))), {})
    snaps = view.Snapshots()
    first, token = snaps.first(rows, 2, "ns", "u")
    rows.clear()  # the source's rows may change under it
    rest, end = snaps.next(view.decode_continue(token), 2, "ns", "u")
    assert [r.object_id for r in first + rest] == ["o0", "o1", "o2", "o3"] and end == ""
    again, _ = snaps.next(view.decode_continue(token), 0, "ns", "u")  # the same token, asked again
    assert [r.object_id for r in again] == ["o2", "o3"]


def test_an_expired_snapshot_is_gone_not_a_wrong_page() -> None:
    clock = Clock()
    snaps = view.Snapshots(max_age=60, clock=clock)
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i}", i) for i in range(4))), {})
    _, token = snaps.first(rows, 1, "ns", "u")
    clock.now += 30
    _, token = snaps.next(view.decode_continue(token), 1, "ns", "u")  # age counts from the first page
    clock.now += 31
    with pytest.raises(view.Expired, match="start a new list"):
        snaps.next(view.decode_continue(token), 1, "ns", "u")
    assert len(snaps) == 0


def test_snapshots_are_bounded_the_oldest_pushed_out_first() -> None:
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i}", i) for i in range(10))), {})
    by_count = view.Snapshots(max_count=2)
    tokens = [by_count.first(rows, 1, "ns", "u")[1] for _ in range(3)]
    with pytest.raises(view.Expired):
        by_count.next(view.decode_continue(tokens[0]), 1, "ns", "u")
    assert [len(by_count.next(view.decode_continue(t), 1, "ns", "u")[0]) for t in tokens[1:]] == [1, 1]
    by_rows = view.Snapshots(max_rows=25)
    tokens = [by_rows.first(rows, 1, "ns", "u")[1] for _ in range(3)]  # 30 rows held would pass 25
    assert len(by_rows) == 2
    with pytest.raises(view.Expired):
        by_rows.next(view.decode_continue(tokens[0]), 1, "ns", "u")


@pytest.mark.parametrize(("ns", "user"), [("other", "u"), (None, "u"), ("ns", "someone-else")])
def test_a_token_is_refused_for_another_namespace_or_user(ns: str | None, user: str) -> None:
    """Its rows were read for the namespace and user of its first page, whatever the next SAR allows."""
    rows = view.rows_of(inventory(*(InventoryItem(f"o{i}", i) for i in range(4))), {})
    snaps = view.Snapshots()
    _, token = snaps.first(rows, 2, "ns", "u")
    with pytest.raises(view.BadRequest, match="another list"):
        snaps.next(view.decode_continue(token), 2, ns, user)


def test_a_token_after_a_restart_is_expired() -> None:
    token = view.encode_continue(view.Cursor("no-such-snapshot", ("ns", "p.o1")))
    with pytest.raises(view.Expired):
        view.Snapshots().next(view.decode_continue(token), 1, "ns", "u")


@pytest.mark.parametrize(
    "token",
    ["%%%", "bm90IGpzb24", view.encode_continue(view.Cursor("s", ("a", "b")))[:-3] + "AAA", "WyJhIiwgImIiXQ"],
)
def test_a_bad_continue_token_is_a_bad_request(token: str) -> None:
    with pytest.raises(view.BadRequest):
        view.decode_continue(token)


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
