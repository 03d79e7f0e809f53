"""What the live view shows, built from agents' inventories: rows, a kubectl Table, a list, pages over a snapshot.

Pure: no I/O, so each rule (state, holders, paging) is unit-tested. The source of truth is the agent's
inventory (what the process holds now), joined with the ledger's GPUObjects for the recorded name and
the claims that hold it; nothing here is stored in etcd."""

from __future__ import annotations

import base64
import binascii
import bisect
import datetime as dt
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuobj_contract.agent_api import Inventory

GROUP = "live.gpuobj.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "liveobjects"
KIND = "LiveGPUObject"
SHORT_NAMES = ("lgo",)
MAX_LIMIT = 5000  # one page at most; kubectl asks for 500
# A paged list's rows are kept this long from its first page (100,000 rows at 5,000 a page take ~1 s; kubectl's
# 500 a page through the aggregator, 200 pages, well under this), at most SNAPSHOTS_MAX lists and
# SNAPSHOT_ROWS_MAX rows at once: a snapshot holds the rows the per-pod cache made (shared while both hold
# them), so four lists of every one of 100,000 objects, ~0.5 KiB a row once the cache has moved on.
SNAPSHOT_SECONDS = 60.0
SNAPSHOTS_MAX = 16
SNAPSHOT_ROWS_MAX = 400_000

COLUMNS = (
    ("Name", "string", "The pod and the object id the agent gave it"),
    ("Pod", "string", "The pod whose process holds the bytes"),
    ("Bytes", "integer", "GPU memory the object holds"),
    ("Holders", "integer", "The owner process plus the claims that hold it"),
    ("State", "string", "recorded, pending (write-behind queued), unrecorded or releasing"),
    ("Recorded", "string", "The GPUObject that records it, if any"),
    ("Age", "string", "Since the put"),
)


class BadRequest(ValueError):
    """A request the view refuses (a malformed continue token, a bad limit): answered 400."""


@dataclass(frozen=True)
class Recorded:
    """What the ledger knows of one object id of a pod: its GPUObject and how many hold it."""

    name: str
    holders: int


@dataclass(frozen=True)
class LiveRow:
    namespace: str
    name: str
    pod: str
    pod_uid: str
    object_id: str
    bytes: int
    holders: int
    state: str
    recorded_name: str
    age_seconds: float
    created_at: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def object_name(pod: str, object_id: str) -> str:
    """One name per live object in its namespace: the pod's name is unique there, the id within the pod."""
    return f"{pod}.{object_id}"


def rows_of(inventory: Inventory, recorded: Mapping[str, Recorded]) -> list[LiveRow]:
    """One row per inventory item. `recorded` maps the pod's object ids to their GPUObjects (ledger)."""
    out = []
    for item in inventory.objects:
        rec = recorded.get(item.id)
        if item.freeing:
            state = "releasing"
        elif rec is not None:
            state = "recorded"
        elif item.record_pending:
            state = "pending"
        else:
            state = "unrecorded"
        out.append(
            LiveRow(
                namespace=inventory.namespace,
                name=object_name(inventory.pod, item.id),
                pod=inventory.pod,
                pod_uid=inventory.pod_uid,
                object_id=item.id,
                bytes=item.bytes,
                holders=rec.holders if rec is not None else 1,
                state=state,
                recorded_name=rec.name if rec is not None else "",
                age_seconds=item.age_seconds,
                created_at=item.created_at,
            )
        )
    return out


@dataclass(frozen=True)
class Cursor:
    """What a continue token carries: the snapshot its list reads and the last key the client has."""

    snapshot: str
    after: tuple[str, str]


def encode_continue(cursor: Cursor) -> str:
    raw = {"s": cursor.snapshot, "a": list(cursor.after)}
    return base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=")


def decode_continue(token: str) -> Cursor:
    bad = BadRequest(f"continue token {token[:40]!r} is not one this view gave out")
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(raw, dict) or not isinstance(raw.get("s"), str):
        raise bad
    after = raw.get("a")
    if not (isinstance(after, list) and len(after) == 2 and all(isinstance(x, str) for x in after)):
        raise bad
    return Cursor(raw["s"], (after[0], after[1]))


def parse_limit(text: str | None) -> int:
    """0 means no limit (as the API server reads it); above MAX_LIMIT is cut to it."""
    if not text:
        return 0
    try:
        limit = int(text)
    except ValueError:
        raise BadRequest(f"limit {text[:20]!r} is not a number") from None
    if limit < 0:
        raise BadRequest(f"limit {limit} is negative")
    return min(limit, MAX_LIMIT)


class Expired(Exception):
    """A continue token whose snapshot is gone (too old, pushed out, or the operator restarted): answered
    410 Expired, as the API server answers a token whose resourceVersion was compacted."""


@dataclass
class Snapshot:
    """One list's rows in (namespace, name) order, as its first page saw them; later pages slice it."""

    id: str
    namespace: str | None  # None: across namespaces
    user: str
    made_at: float
    rows: list[LiveRow]


class Snapshots:
    """The lists being paged: the first page sorts its scope's rows once and keeps them here under an id the
    continue token carries, so every later page costs O(log n + page), not a new fan-out and sort of every
    row. Bounded (count and rows held, the oldest pushed out first) and kept `max_age` seconds from the
    first page, as the API server pins a list's resourceVersion until compaction. A token is honoured only
    for the scope and user it was given to: its rows were read for that scope, whatever the next SAR says."""

    def __init__(
        self,
        *,
        max_age: float = SNAPSHOT_SECONDS,
        max_count: int = SNAPSHOTS_MAX,
        max_rows: int = SNAPSHOT_ROWS_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_age, self.max_count, self.max_rows, self.clock = max_age, max_count, max_rows, clock
        self._held: OrderedDict[str, Snapshot] = OrderedDict()  # oldest first
        self._rows = 0

    def __len__(self) -> int:
        return len(self._held)

    def _drop(self, snapshot_id: str) -> None:
        self._rows -= len(self._held.pop(snapshot_id).rows)

    def _expire(self) -> None:
        now = self.clock()
        while self._held and now - next(iter(self._held.values())).made_at > self.max_age:
            self._drop(next(iter(self._held)))

    def first(self, rows: Iterable[LiveRow], limit: int, namespace: str | None, user: str) -> tuple[list[LiveRow], str]:
        """The first page of a list; a snapshot is kept only when there is a next page."""
        ordered = sorted(rows, key=lambda r: r.key)
        if not limit or len(ordered) <= limit:
            return ordered, ""
        self._expire()
        snap = Snapshot(secrets.token_urlsafe(12), namespace, user, self.clock(), ordered)
        self._held[snap.id] = snap
        self._rows += len(ordered)
        while len(self._held) > 1 and (len(self._held) > self.max_count or self._rows > self.max_rows):
            self._drop(next(iter(self._held)))
        return ordered[:limit], encode_continue(Cursor(snap.id, ordered[limit - 1].key))

    def next(self, cursor: Cursor, limit: int, namespace: str | None, user: str) -> tuple[list[LiveRow], str]:
        """The page after the cursor's key in its snapshot. Expired when the snapshot is gone; BadRequest
        when it was made for another scope or user."""
        self._expire()
        snap = self._held.get(cursor.snapshot)
        if snap is None:
            raise Expired(
                f"the list this continue token belongs to was kept {self.max_age:g} s and is gone (too old, too "
                "many lists at once, or the operator restarted): start a new list without the continue parameter"
            )
        if snap.namespace != namespace or snap.user != user:
            raise BadRequest("this continue token was given for another list (another namespace or user)")
        start = bisect.bisect_right(snap.rows, cursor.after, key=lambda r: r.key)
        chunk = snap.rows[start : start + limit] if limit else snap.rows[start:]
        if start + len(chunk) >= len(snap.rows):
            return chunk, ""
        return chunk, encode_continue(Cursor(snap.id, chunk[-1].key))


def human_age(seconds: float) -> str:
    """As kubectl prints ages: 45s, 12m, 3h, 2d."""
    s = max(int(seconds), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= 2 * size or (unit == "m" and s >= size):
            return f"{s // size}{unit}"
    return f"{s}s"


def _metadata(row: LiveRow, now: dt.datetime) -> dict[str, Any]:
    created = now - dt.timedelta(seconds=row.age_seconds)
    return {
        "name": row.name,
        "namespace": row.namespace,
        "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def to_object(row: LiveRow, now: dt.datetime) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": _metadata(row, now),
        "status": {
            "pod": row.pod,
            "podUID": row.pod_uid,
            "objectID": row.object_id,
            "bytes": row.bytes,
            "holders": row.holders,
            "state": row.state,
            "recordedName": row.recorded_name or None,
            "ageSeconds": row.age_seconds,
        },
    }


def to_list(rows: Sequence[LiveRow], next_token: str, now: dt.datetime) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": f"{KIND}List",
        "metadata": {"continue": next_token} if next_token else {},
        "items": [to_object(r, now) for r in rows],
    }


def to_table(rows: Sequence[LiveRow], next_token: str, now: dt.datetime) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table: what `kubectl get` prints, without a client-side printer for this kind."""
    return {
        "apiVersion": "meta.k8s.io/v1",
        "kind": "Table",
        "metadata": {"continue": next_token} if next_token else {},
        "columnDefinitions": [
            {"name": n, "type": t, "format": "name" if n == "Name" else "", "description": d, "priority": 0}
            for n, t, d in COLUMNS
        ],
        "rows": [
            {
                "cells": [r.name, r.pod, r.bytes, r.holders, r.state, r.recorded_name, human_age(r.age_seconds)],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": _metadata(r, now),
                },
            }
            for r in rows
        ],
    }


def wants_table(accept: str) -> bool:
    """kubectl asks `application/json;as=Table;v=v1;g=meta.k8s.io,application/json`: the Table comes first."""
    for part in accept.split(","):
        params = {p.strip().split("=", 1)[0]: p.strip().split("=", 1)[-1] for p in part.split(";")[1:] if "=" in p}
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") in ("v1", "v1beta1"):
            return True
    return False


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A metav1 Status, as kubectl prints it ("Error from server (Forbidden): ...")."""
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def discovery() -> dict[str, Any]:
    """The APIResourceList kubectl's discovery reads for live.gpuobj.io/v1alpha1."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": API_VERSION,
        "resources": [
            {
                "name": PLURAL,
                "singularName": "liveobject",
                "namespaced": True,
                "kind": KIND,
                "verbs": ["get", "list"],
                "shortNames": list(SHORT_NAMES),
                # Deliberately in no category: `kubectl get gpuobj` lists the recorded kinds and must
                # keep working while the operator is down or after the APIService is removed.
            }
        ],
    }
