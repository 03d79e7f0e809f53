"""Event intake: the initial sync and every watch event, parsed and applied to the ledger; the keys whose
decision may have changed go to the work queue. Nothing here decides or writes.

Why apart from the executors: this runs on the event loop for every event of four informers (objects,
streams, claims, agent pods: gpuobj_kube.informer, each seeded from the sync's own list), so it must
stay cheap (the ledger's indexes) and never wait; the workers (reconciler.py) take it from there.

A deletion goes by identity (namespace, name, uid) against the ledger's own record: an informer that
listed again reports what went meanwhile with nothing more than that.

With several operators (shards.py) this is the one gate: what lives in another shard's namespaces
never enters the ledger, so nothing downstream (frees, status writes, the audit, the liveness probes)
ever sees it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuobj_contract import names
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, KubeClient
from gpuobj_kube.informer import identity_of
from gpuobj_operator.expectations import Expectations
from gpuobj_operator.free_path import is_marker
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.model import Key, PodInfo, parse_claim, parse_object, parse_pod, parse_stream
from gpuobj_operator.prober import Prober
from gpuobj_operator.settings import Settings

log = logging.getLogger("gpuobj.operator")

WorkItem = tuple[str, Key]
LABEL_AGENT_SELECTOR = f"{names.LABEL_AGENT}=true"


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
        # plural -> (resourceVersion, identities) of the sync's lists: where each informer takes over
        self.listed: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        self.owns = settings.shard.owns

    def mine(self, raw: Mapping[str, Any]) -> bool:
        """Whether an object of the API belongs to this operator's shard (shards.py)."""
        return self.owns(raw["metadata"].get("namespace"))

    async def sync(self) -> None:
        """List every kind once before any decision: a free decided on a partial view could be wrong."""
        now = time.monotonic()
        ns = self.settings.namespace
        streams = await self.kube.list(STREAMS, ns)
        claims = await self.kube.list(CLAIMS, ns)
        pods = await self.kube.list(PODS, ns, label_selector=LABEL_AGENT_SELECTOR)
        objects = await self.kube.list(GPUOBJECTS, ns)
        mine = self.mine
        for s in filter(mine, streams["items"]):
            self.ledger.upsert_stream(parse_stream(s))
        for c in filter(mine, claims["items"]):
            if not is_marker(c):
                self.ledger.upsert_claim(parse_claim(c), now)
        for p in filter(mine, pods["items"]):
            pod = self.parse_pod(p)
            self.ledger.liveness.observe_container(pod.key, pod.uid, pod.agent_container, now)
            self.ledger.upsert_pod(pod)
        for o in filter(mine, objects["items"]):
            self.ledger.upsert_object(parse_object(o), now)
        self.ledger.synced = True
        # Where the informers take over: from these lists, so nothing after them is missed (a pod
        # deleted since arrives as DELETED).
        self.listed = {
            res.plural: (listed["metadata"]["resourceVersion"], [identity_of(o) for o in listed["items"]])
            for res, listed in ((STREAMS, streams), (CLAIMS, claims), (PODS, pods), (GPUOBJECTS, objects))
        }
        self.enqueue_all()
        log.info(
            "synced: %d objects, %d claims, %d streams, %d agent pods",
            len(self.ledger.objects),
            len(self.ledger.claims),
            len(self.ledger.streams),
            len(self.ledger.pods),
        )

    # ------------------------------------------------------------ event intake (from the informers)

    def on_object(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if not self.mine(raw):
            return
        if event_type == "DELETED":
            key, uid = _identity(raw)
            current = self.ledger.objects.get(key)
            self.expected.object_gone(uid, key)
            if current is not None and current.uid == uid:
                self.enqueue(self.ledger.remove_object(current))
            return
        info = parse_object(raw)
        # A deletion (the owner's reference went) is the free lane: ahead of status work.
        self.enqueue(self.ledger.upsert_object(info, time.monotonic()), urgent=info.deleting)

    def on_claim(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if is_marker(raw) or not self.mine(raw):
            return  # its event moves the claims watermark (the informer does that); nothing to decide
        now = time.monotonic()
        if event_type == "DELETED":
            key, uid = _identity(raw)
            current = self.ledger.claims.get(key)
            self.expected.claim_gone(key)
            if current is not None and current.uid == uid:
                # A reference went: most likely a free, ahead of status work.
                self.enqueue(self.ledger.remove_claim(current, now), urgent=True)
            return
        info = parse_claim(raw)
        self.enqueue(self.ledger.upsert_claim(info, now), urgent=info.deleting)
        if not info.deleting and self.ledger.needs_scope(info) and self.ledger.holder_incarnation(info) is None:
            self.prober.probe_soon((info.namespace, info.holder_pod))  # type: ignore[arg-type]
        elif not info.deleting and info.holder_pod and info.holder_incarnation:
            # A claim for a process other than the one last seen alive in its pod: a process that died
            # since (a probe that began before this claim was learned cannot prove that one dead, see
            # liveness.incarnation_dead), or one not probed yet. Ask now, not at the next backstop round.
            state = self.ledger.liveness.agents.get((info.namespace, info.holder_pod))
            if state is not None and state.incarnation != info.holder_incarnation:
                self.prober.probe_soon((info.namespace, info.holder_pod))

    def on_stream(self, event_type: str | None, raw: Mapping[str, Any]) -> None:
        if not self.mine(raw):
            return
        if event_type == "DELETED":
            key, uid = _identity(raw)
            current = self.ledger.streams.get(key)
            self.expected.stream_gone(key)
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
        elif self.ledger.liveness.observe_container(info.key, info.uid, info.agent_container, time.monotonic()):
            # The kubelet reports a restart: the ended run's records go by its times (liveness.py); for
            # the rest, ask the agent now which process lives instead of at the next backstop probe.
            self.prober.probe_soon(info.key)
        if event_type != "DELETED":
            if info.endpoint and not info.terminated and not _had_agent(self.ledger.pods.get(info.key), info.uid):
                self.prober.new_agent(info.key)  # its share of the fleet's write budget, before it writes
            self.enqueue(self.ledger.upsert_pod(info))
            return
        info.deleted_at = dt.datetime.now(dt.UTC)
        dirty = self.ledger.remove_pod(info, time.monotonic())
        # Its claims ended with it (Ledger.claim_ended): the objects they held are decided in the free
        # lane now; the claims themselves are the garbage collector's to delete.
        self.enqueue((item for item in dirty if item[0] == "object"), urgent=True)
        self.enqueue(item for item in dirty if item[0] != "object")


def _had_agent(known: PodInfo | None, uid: str) -> bool:
    """Whether the ledger already held this pod (this uid) with an agent address to probe."""
    return known is not None and known.uid == uid and bool(known.endpoint) and not known.terminated


def _identity(raw: Mapping[str, Any]) -> tuple[Key, str]:
    """(namespace, name) and uid: all a DELETED after a relist carries (gpuobj_kube.informer)."""
    meta = raw["metadata"]
    return (meta["namespace"], meta["name"]), meta["uid"]
