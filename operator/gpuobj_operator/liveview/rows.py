"""What the live view shows, built from agents' inventories: rows, a kubectl Table, a list, pages.

Pure: no I/O, so each rule (state, holders, paging) is unit-tested. The source of truth is the agent's
inventory (what the process holds now), joined with the ledger's GPUObjects for the recorded name and
the claims that hold it; nothing here is stored in etcd."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
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


def encode_continue(after: tuple[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(after)).encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[str, str]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise BadRequest(f"continue token {token[:40]!r} is not one this view gave out") from None
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, str) for x in raw)):
        raise BadRequest(f"continue token {token[:40]!r} is not one this view gave out")
    return (raw[0], raw[1])


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


def page(rows: Iterable[LiveRow], limit: int, token: str | None) -> tuple[list[LiveRow], str]:
    """Rows in (namespace, name) order after the token's key, at most `limit`; the next token or "".
    A key, not an offset: objects that come and go between pages move no other row across a page edge."""
    after = decode_continue(token) if token else None
    ordered = sorted((r for r in rows if after is None or r.key > after), key=lambda r: r.key)
    if limit and len(ordered) > limit:
        return ordered[:limit], encode_continue(ordered[limit - 1].key)
    return ordered, ""


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
