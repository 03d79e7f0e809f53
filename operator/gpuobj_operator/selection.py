"""What a shard's operator is sent of GPUObjects and streams: its own buckets, selected by the API server.

Why: with a client-side filter every shard receives, decodes and drops every other shard's events; at
100,000 objects that is most of a shard's watch traffic. Writers label what they create with its
namespace's bucket (gpuobj_contract.shard_buckets), and a shard of several watches two selections:

- ``gpuobj.io/shard-bucket in (its buckets)``: what it acts on, and nothing of the other shards';
- ``!gpuobj.io/shard-bucket``: what no writer labelled (a user's ``kubectl apply``): every shard sees
  these, acts on those of its namespaces at once and patches the label in, so they move to the first.

A label with the wrong bucket (a workload may write anything) lands in another shard's first watch: that
shard does not own the namespace, so it never acts on it, and patches the right bucket in, and the owner
receives the object as ADDED. Nothing is invisible for longer than one patch.

A move is not a deletion. An object that leaves a watch's selection arrives there as DELETED (the API
server sends its previous state), so a DELETED is passed on at once only when it is surely one: from the
shard's own watch, carrying the deletionTimestamp every real deletion of a GPUObject or stream has (both
are created with the free finalizer, and the operator adds it where missing). Any other (from the
unlabelled watch, or without a deletionTimestamp, or an identity a relist reported) is passed on only
once a GET finds the object gone; one seen alive in the other watch is dropped at once. Both are rare
(unlabelled objects, relists), so the usual event costs what it did: one dict lookup and one hash.

One limit: a user who changes the label of an existing object makes its shard's watch report it
DELETED; the ledger forgets it until the receiving shard patches the label back (one write later).
Deleting the object was already in that user's power; the docs say to leave the label alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from gpuobj_contract.names import LABEL_SHARD_BUCKET
from gpuobj_contract.shard_buckets import bucket_of
from gpuobj_kube.client import ApiError, KubeClient, NotFound, Resource
from gpuobj_kube.informer import JSON, Handler, Informer, backoff_delay
from gpuobj_operator.shards import UNLABELLED_SELECTOR, Shard

log = logging.getLogger("gpuobj.operator")


class Selection:
    """The informers of one resource for this shard, feeding one handler (the intake's)."""

    def __init__(
        self,
        kube: KubeClient,
        resource: Resource,
        handler: Handler,
        shard: Shard,
        *,
        confirm_backoff: tuple[float, float] = (0.25, 5.0),
        counted: Callable[[str], Callable[[], None]] = lambda selection: lambda: None,
        **watch: Any,
    ) -> None:
        """``counted(selection)``: what to call on each event of that watch ("all", "shard", "unlabelled")."""
        self.kube = kube
        self.resource = resource
        self.handler = handler
        self.shard = shard
        self.confirm_backoff = confirm_backoff
        self._tasks: set[asyncio.Task[None]] = set()
        self._relabelling: set[str] = set()  # uids whose label patch is in flight: one write each
        self.relabelled = 0  # label patches that landed (observability, tests)
        selector = shard.selector()
        if selector is None:  # one shard: every object, as before shards had labels
            self.mine = Informer(kube, resource, _counting(counted("all"), handler), **watch)
            self.unlabelled: Informer | None = None
        else:
            on_mine, on_unlabelled = (
                _counting(counted("shard"), self._on_mine),
                _counting(counted("unlabelled"), self._on_unlabelled),
            )
            self.mine = Informer(kube, resource, on_mine, label_selector=selector, **watch)
            self.unlabelled = Informer(kube, resource, on_unlabelled, label_selector=UNLABELLED_SELECTOR, **watch)

    @property
    def informers(self) -> list[Informer]:
        return [self.mine] if self.unlabelled is None else [self.mine, self.unlabelled]

    def seed(self, version: str, identities: list[JSON]) -> None:
        """Take over from the sync's list (``identities`` at ``version``, every namespace when sharded:
        the sync lists without a selector). With one shard the informer watches from there. Sharded,
        each selection lists itself once: the shard's own watch starts knowing the sync's objects of its
        namespaces, so one gone since (or unlabelled: the other watch) comes as a DELETED to confirm."""
        if self.unlabelled is None:
            self.mine.seed(identities, version)
            return
        self.mine.seed([i for i in identities if self.shard.owns(i["metadata"].get("namespace"))], None)

    def start(self) -> None:
        for informer in self.informers:
            informer.start()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for informer in self.informers:
            await informer.stop()

    # ------------------------------------------------------------ events (on the loop: O(1) each)

    def _on_mine(self, kind: str | None, obj: JSON) -> None:
        meta = obj["metadata"]
        if not self.shard.owns(meta.get("namespace")):
            if kind != "DELETED":
                self._relabel(obj)  # a wrong bucket: send it to the shard that owns its namespace
            return
        if kind == "DELETED" and not meta.get("deletionTimestamp"):
            # Left the selection (a relabel; a relist's bare identity of an object still unlabelled), or gone.
            if self.unlabelled is None or not self.unlabelled.knows(obj):
                self._confirm(obj)
            return
        self.handler(kind, obj)

    def _on_unlabelled(self, kind: str | None, obj: JSON) -> None:
        if not self.shard.owns(obj["metadata"].get("namespace")):
            return  # its owner labels it
        if kind == "DELETED":
            if not self.mine.knows(obj):  # seen in the shard's own watch already: moved, alive
                self._confirm(obj)
            return
        self.handler(kind, obj)
        self._relabel(obj)

    # ------------------------------------------------------------ the two kinds of I/O it starts

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _relabel(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        uid = meta.get("uid")
        if not uid or uid in self._relabelling:
            return
        self._relabelling.add(uid)
        self._spawn(self._patch_label(meta["namespace"], meta["name"], uid))

    async def _patch_label(self, namespace: str, name: str, uid: str) -> None:
        # The uid in the patch: a new object of the same name is never relabelled by mistake (422).
        body = {"metadata": {"uid": uid, "labels": {LABEL_SHARD_BUCKET: str(bucket_of(namespace))}}}
        try:
            await self.kube.patch(self.resource, name, body, namespace)
            self.relabelled += 1
            log.info("labelled %s %s/%s for its shard", self.resource.plural, namespace, name)
        except NotFound:
            pass  # gone: its DELETED says so
        except ApiError as exc:
            # Not fatal: the next event of the object tries again. A 403 is the chart's RBAC to fix.
            log.warning("could not label %s %s/%s for its shard: %s", self.resource.plural, namespace, name, exc)
        finally:
            self._relabelling.discard(uid)

    def _confirm(self, obj: JSON) -> None:
        self._spawn(self._confirm_gone(obj))

    async def _confirm_gone(self, obj: JSON) -> None:
        """Pass the DELETED on once a read finds no object of that uid; an alive one moved (dropped)."""
        meta = obj["metadata"]
        failures = 0
        while True:
            try:
                current = await self.kube.get(self.resource, meta["name"], meta["namespace"])
            except NotFound:
                current = None
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                failures += 1  # a deletion must not be lost to a passing error: read again
                log.info("confirming the deletion of %s/%s: %s", meta["namespace"], meta["name"], exc)
                await asyncio.sleep(backoff_delay(self.confirm_backoff, failures))
                continue
            break
        if current is not None and current["metadata"].get("uid") == meta.get("uid"):
            return  # alive: it moved between selections, and the watch it moved to has it or will
        self.handler("DELETED", obj)


def _counting(count: Callable[[], None], handler: Handler) -> Handler:
    def counted(kind: str | None, obj: JSON) -> None:
        count()
        handler(kind, obj)

    return counted
