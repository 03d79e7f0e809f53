"""List-then-watch of one resource, handled strictly in order, with a server-side label selector.

Why not kopf for pods: kopf filters labels on the client, so it would stream every
pod of the cluster to the operator. Agent pods carry `gpuobj.io/agent=true`, and the
API server can filter on that.

Why not kopf for claims: kopf hands each event to a per-object worker, so when it has
seen version N nothing says the events before N were handled. Here the handler runs
for each event in the order the watch delivers them (resourceVersion order), and only
then does ``watermark`` move: everything up to it is in the ledger. A free needs no
request when that has passed the version it decided on (claimcheck.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp

from gpuobj_kube.client import ApiError, Gone, KubeClient, Resource
from gpuobj_operator.claimcheck import Watermark

log = logging.getLogger("gpuobj.operator.informer")

Handler = Callable[[str | None, dict], None]


class Informer:
    def __init__(
        self,
        kube: KubeClient,
        resource: Resource,
        handler: Handler,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        watch_timeout: int = 240,
        retry_delay: float = 1.0,
    ) -> None:
        self.kube = kube
        self.resource = resource
        self.handler = handler
        self.namespace = namespace
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self._known: dict[tuple[str, str], dict] = {}
        self._task: asyncio.Task | None = None
        self.watermark = Watermark()

    def seed(self, objs: Iterable[dict]) -> None:
        """What the handler already knows from an earlier list (the operator's sync): the first list
        then reports whichever of them went meanwhile as DELETED, instead of leaving them known forever."""
        for obj in objs:
            self._known[(obj["metadata"].get("namespace", ""), obj["metadata"]["name"])] = obj

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"informer-{self.resource.plural}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _relist(self) -> str:
        listed = await self.kube.list(self.resource, self.namespace, label_selector=self.label_selector)
        seen = {}
        for obj in listed["items"]:
            key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
            seen[key] = obj
            self.handler(None, obj)
        for key, obj in self._known.items():
            if key not in seen:  # deleted while we were not watching
                self.handler("DELETED", obj)
        self._known = seen
        self.watermark.observe(listed["metadata"]["resourceVersion"])
        return listed["metadata"]["resourceVersion"]

    async def _run(self) -> None:
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self._relist()
                async for kind, obj in self.kube.watch(
                    self.resource,
                    self.namespace,
                    resource_version=rv,
                    label_selector=self.label_selector,
                    timeout_seconds=self.watch_timeout,
                ):
                    if kind != "BOOKMARK":
                        self.handler(kind, obj)
                        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
                        if kind == "DELETED":
                            self._known.pop(key, None)
                        else:
                            self._known[key] = obj
                    # Only once handled: a handler that fails makes us list again (below), never skip.
                    rv = obj["metadata"].get("resourceVersion", rv)
                    self.watermark.observe(rv)
            except Gone:
                rv = None
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                log.info("watch of %s interrupted: %s", self.resource.plural, exc)
                await asyncio.sleep(self.retry_delay)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watch of %s failed", self.resource.plural)
                rv = None  # an event may not have been applied: list again rather than skip it
                await asyncio.sleep(self.retry_delay)
