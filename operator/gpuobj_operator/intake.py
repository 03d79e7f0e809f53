"""Event intake: the initial sync and every watch event, parsed and applied to the ledger; the keys whose
decision may have changed go to the work queue. Nothing here decides or writes.

Why apart from the executors: this runs on the event loop for every event of four watches (the
GPUObject, stream, pod and claims informers of gpuobj_kube.informer), so it must stay cheap (the
ledger's indexes) and never wait; the workers (reconciler.py) take it from there.

With several operators (shards.py) this is the one gate: what lives in another shard's namespaces
never enters the ledger, so nothing downstream (frees, status writes, the audit, the liveness probes)
ever sees it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuobj_contract import names
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, KubeClient, Resource
from gpuobj_kube.informer import identity
from gpuobj_operator.expectations import Expectations
from gpuobj_operator.free_path import is_marker
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.model import Key, PodInfo, parse_claim, parse_object, parse_pod, parse_stream
from gpuobj_operator.prober import Prober
from gpuobj_operator.settings import Settings

log = logging.getLogger("gpuobj.operator")

WorkItem = tuple[str, Key]
LABEL_AGENT_SELECTOR = f"{names.LABEL_AGENT}=true"
SYNC_PAGE = 500  # items per page of the sync's lists


class Intake:
    def __init__(
        self,
        ledger: Ledger,
        kube: KubeClient,
        expected: Expectations,
        prober: Prober,
        settings: Settings,
        enqueue: Callable[..., None],
        enqueue_all: Callable[[], None],
    ) -> None:
        self.ledger = ledger
        self.kube = kube
        self.expected = expected
        self.prober = prober
        self.settings = settings
        self.enqueue = enqueue
        self.enqueue_all = enqueue_all
        # kind -> (resourceVersion, identities) of the sync's lists: where each informer takes over
        self.listed: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        self.owns = settings.shard.owns

    def mine(self, raw: Mapping[str, Any]) -> bool:
        """Whether an object of the API belongs to this operator's shard (shards.py)."""
        return self.owns(raw["metadata"].get("namespace"))

    async def sync(self) -> None:
        """List every kind once before any decision: a free decided on a partial view could be wrong.
        Page by page (SYNC_PAGE items), each applied and dropped before the next: the operator never
        holds a whole list's bodies, whose peak would stay in its RSS (docs/scale.md)."""
        now = time.monotonic()

        def pod(raw: Mapping[str, Any]) -> None:
            info = self.parse_pod(raw)
            self.ledger.liveness.observe_container(info.key, info.uid, info.agent_container)
            self.ledger.upsert_pod(info)

        def claim(raw: Mapping[str, Any]) -> None:
            if not is_marker(raw):
                self.ledger.upsert_claim(parse_claim(raw), now)

        # Where every watch takes over: from these lists, so nothing after them is missed ("synced" means
        # each informer listed once: these are their lists). Only identities are kept, never bodies.
        self.listed = {
            "streams": await self._list(STREAMS, lambda raw: self.ledger.upsert_stream(parse_stream(raw))),
            "claims": await self._list(CLAIMS, claim),
            "pods": await self._list(PODS, pod, LABEL_AGENT_SELECTOR),
            "objects": await self._list(GPUOBJECTS, lambda raw: self.ledger.upsert_object(parse_object(raw), now)),
        }
        self.ledger.synced = True
        self.enqueue_all()
        log.info(
            "synced: %d objects, %d claims, %d streams, %d agent pods",
            len(self.ledger.objects),
            len(self.ledger.claims),
            len(self.ledger.streams),
            len(self.ledger.pods),
        )

    async def _list(
        self, res: Resource, apply: Callable[[dict[str, Any]], object], label_selector: str | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """One kind's list, applied page by page; its resourceVersion and the identities it listed."""
        version, kept = "", []
        async for page in self.kube.list_pages(
            res, self.settings.namespace, label_selector=label_selector, limit=SYNC_PAGE
        ):
            for raw in page.get("items", []):
                if self.mine(raw):  # another shard's: its informer still tracks it, the ledger never holds it
                    apply(raw)
                kept.append(keep(raw))
            version = page["metadata"]["resourceVersion"]
        return version, kept

    # ------------------------------------------------------------ event intake (from the informers)

    def on_object(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if not self.mine(raw):
            return
        if event_type == "DELETED":
            # A relist's deletion carries only the identity (informer.identity): go by the ledger's record.
            key, uid = _identity(raw)
            self.expected.object_gone(uid, key)
            current = self.ledger.objects.get(key)
            if current is not None and current.uid == uid:
                self.enqueue(self.ledger.remove_object(current))
            return
        info = parse_object(raw)
        now = time.monotonic()
        # A deletion (the owner's reference went) is the free lane: ahead of status work.
        self.enqueue(self.ledger.upsert_object(info, now), urgent=info.deleting)

    def on_claim(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if is_marker(raw) or not self.mine(raw):
            return  # its event moves the claims watermark (the informer does that); nothing to decide
        info = parse_claim(raw)
        now = time.monotonic()
        if event_type == "DELETED":
            self.expected.claim_gone(info.key)
        gone = event_type == "DELETED" or info.deleting
        self.enqueue(
            self.ledger.remove_claim(info, now) if event_type == "DELETED" else self.ledger.upsert_claim(info, now),
            urgent=gone,  # a reference went: most likely a free, ahead of status work
        )
        if not gone and self.ledger.needs_scope(info) and self.ledger.holder_incarnation(info) is None:
            self.prober.probe_soon((info.namespace, info.holder_pod))  # type: ignore[arg-type]

    def on_stream(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if not self.mine(raw):
            return
        if event_type == "DELETED":
            key, uid = _identity(raw)
            current = self.ledger.streams.get(key)
            if current is not None and current.uid == uid:
                self.enqueue(self.ledger.remove_stream(current))
            return
        self.enqueue(self.ledger.upsert_stream(parse_stream(raw)))

    def parse_pod(self, raw: Mapping[str, Any]) -> PodInfo:
        return parse_pod(raw, allow_host_annotation=self.settings.allow_agent_host_annotation)

    def on_pod(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if not self.mine(raw):
            return
        info = self.parse_pod(raw)
        if event_type == "DELETED":
            self.ledger.liveness.forget(info.key)
            self.prober.forget(info.key)
        elif self.ledger.liveness.observe_container(info.key, info.uid, info.agent_container):
            # The kubelet reports a restart: the ended run's records go by its times (liveness.py); for
            # the rest, ask the agent now which process lives instead of at the next backstop probe.
            self.prober.probe_soon(info.key)
        self.enqueue(self.ledger.remove_pod(info) if event_type == "DELETED" else self.ledger.upsert_pod(info))


def keep(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What an informer remembers of an object to report its deletion: its identity (a claim's
    objectName too, which tells the progress marker apart)."""
    return identity(raw, ("objectName",))


def _identity(raw: Mapping[str, Any]) -> tuple[tuple[str, str], str]:
    """(namespace, name) and uid: all that a deletion is sure to carry."""
    meta = raw["metadata"]
    return (meta["namespace"], meta["name"]), meta["uid"]
