"""List-then-watch of one resource, handled strictly in order: the one informer of the project.

Every watch of the operator (GPUObjects, streams, claims, agent pods, CSRs) and of the client's stream
reader is one of these (docs/operator-watches.md says why not kopf's). The handler runs on the event
loop, in the informer's own task, for each event in the order the watch delivers them (resourceVersion
order), and only then is ``on_progress`` told: everything up to it was applied (the operator's claims
watermark, claimcheck.py). A coroutine handler is refused: it would never run.

What the informer remembers of each object is only what ``identity`` keeps (namespace, name, uid by
default: a few hundred bytes per object, whatever the object's size), so a DELETED reported after a
relist carries that and nothing more: a handler deletes by identity, from its own record.

Seeded from an earlier list (``seed``: what the caller listed and at which version), it watches from
that version, so nothing that happened after that list is missed (client-go's list-then-watch: a pod
deleted between the caller's list and this informer's start arrives as DELETED). A 410 lists again and
reports what went meanwhile as DELETED. Any other error is retried with backoff; one that persists for
``give_up_after`` seconds ends the informer with that error (InformerFailed), so the caller sees the
real cause (a 403 from missing RBAC, say), never a silent stall.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from gpuobj_kube.client import ApiError, Gone, KubeClient, NotFound, Resource

log = logging.getLogger("gpuobj.informer")

JSON = dict[str, Any]
Handler = Callable[[str | None, JSON], None]
ObjectKey = tuple[str, str]


class InformerFailed(Exception):
    """A watch failed for longer than the informer retries; ``__cause__`` is the last real error."""


def _key(obj: JSON) -> ObjectKey:
    return (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def backoff_delay(backoff: tuple[float, float], failures: int) -> float:
    """Seconds before the next try after ``failures`` errors in a row: doubling from the first, capped."""
    first, cap = backoff
    return min(cap, first * 2.0 ** (failures - 1))


def identity_of(obj: JSON) -> JSON:
    """What an informer keeps of an object to report its deletion: namespace, name and uid."""
    meta = obj["metadata"]
    return {"metadata": {k: meta[k] for k in ("namespace", "name", "uid") if k in meta}}


class Informer:
    def __init__(
        self,
        kube: KubeClient,
        resource: Resource,
        handler: Handler,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        on_progress: Callable[[str], None] | None = None,
        identity: Callable[[JSON], JSON] = identity_of,
        watch_timeout: int = 240,
        backoff: tuple[float, float] = (0.25, 5.0),
        give_up_after: float = 60.0,
    ) -> None:
        if inspect.iscoroutinefunction(handler):
            raise TypeError(f"the handler of the {resource.plural} informer must be a plain function, not a coroutine")
        self.kube = kube
        self.resource = resource
        self.handler = handler
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.identity = identity
        self.on_progress = on_progress or (lambda rv: None)
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.give_up_after = give_up_after
        self._known: dict[ObjectKey, JSON] = {}
        self._resume_at: str | None = None
        self._task: asyncio.Task[None] | None = None
        self.failing_since: float | None = None  # monotonic start of the current run of errors
        self._handler_failing = False  # the current run includes a failure past the transport (a handler's)
        self.last_error: BaseException | None = None
        self._failures = 0  # errors in the current run
        self.errors = 0  # every error other than 410 so far (each retried), for observability

    def seed(self, objs: Iterable[JSON], resource_version: str | None = None) -> None:
        """What the handler already knows from an earlier list (the caller's sync), listed at
        ``resource_version``: the informer watches from there (no list of its own), or, without a
        version, lists first and reports whichever of them went meanwhile as DELETED."""
        for obj in objs:
            self._known[_key(obj)] = self.identity(obj)
        self._resume_at = resource_version

    def knows(self, obj: JSON) -> bool:
        """Whether this informer's last word on ``obj`` (same name, same uid) is that it exists: an object
        seen here is alive even while another watch, whose selection it just left, reports it DELETED."""
        known = self._known.get(_key(obj))
        return known is not None and known["metadata"].get("uid") == obj["metadata"].get("uid")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Done only when the informer failed (InformerFailed) or was stopped."""
        return self._task

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"informer-{self.resource.plural}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, InformerFailed):
                pass
            self._task = None

    async def _relist(self) -> str:
        listed = await self.kube.list(
            self.resource, self.namespace, label_selector=self.label_selector, field_selector=self.field_selector
        )
        seen: dict[ObjectKey, JSON] = {}
        for obj in listed["items"]:
            seen[_key(obj)] = self.identity(obj)
            self.handler(None, obj)
        for key, obj in self._known.items():
            if key not in seen:  # deleted while we were not watching
                self.handler("DELETED", obj)
        self._known = seen
        rv = str(listed["metadata"]["resourceVersion"])
        self.on_progress(rv)
        return rv

    def _failed(self, exc: BaseException) -> float:
        """Note one more error in a row; the delay before the next try (InformerFailed once it persists)."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since, self._failures = now, 0
        self._failures += 1
        self.errors += 1
        self.last_error = exc
        if now - self.failing_since >= self.give_up_after:
            raise InformerFailed(
                f"watch of {self.resource.plural} failing for {now - self.failing_since:.0f}s: {exc}"
            ) from exc
        return backoff_delay(self.backoff, self._failures)

    def _recovered(self) -> None:
        if self.failing_since is not None:
            log.info("watch of %s works again", self.resource.plural)
        self.failing_since, self.last_error = None, None
        self._handler_failing = False

    async def _run(self) -> None:
        rv = self._resume_at
        if rv is not None:
            self.on_progress(rv)
        while True:
            try:
                if rv is None:
                    rv = await self._relist()
                    # A relist that works ends a run of transport errors; not one of handler errors: the relist
                    # would reset it each time and an event the handler cannot take would loop unseen forever.
                    if not self._handler_failing:
                        self._recovered()
                async for kind, obj in self.kube.watch(
                    self.resource,
                    self.namespace,
                    resource_version=rv,
                    label_selector=self.label_selector,
                    field_selector=self.field_selector,
                    timeout_seconds=self.watch_timeout,
                ):
                    if kind != "BOOKMARK":
                        self.handler(kind, obj)
                        if kind == "DELETED":
                            self._known.pop(_key(obj), None)
                        else:
                            self._known[_key(obj)] = self.identity(obj)
                    # Only once handled: a handler that fails makes us list again (below), never skip.
                    rv = obj["metadata"].get("resourceVersion", rv)
                    self.on_progress(rv)
                    self._recovered()  # the watch made progress: the failure run ends here, not at a relist
                self._recovered()  # the stream ended cleanly (the server's timeout): the watch works
            except Gone:
                rv = None  # too old: list again (what went meanwhile is reported DELETED)
            except asyncio.CancelledError:
                raise
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                delay = self._failed(exc)
                log.info("watch of %s interrupted: %s; again in %.2fs", self.resource.plural, exc, delay)
                await asyncio.sleep(delay)
            except Exception as exc:
                self._handler_failing = True
                delay = self._failed(exc)
                log.exception("watch of %s failed", self.resource.plural)
                rv = None  # an event may not have been applied: list again rather than skip it
                await asyncio.sleep(delay)


def _passing(exc: BaseException) -> bool:
    """An error that may pass by itself: the API server restarting, overloaded or cut off."""
    if isinstance(exc, (OSError, TimeoutError, aiohttp.ClientError)):
        return True  # ApiTimeout included: no answer within the request's deadline
    return isinstance(exc, ApiError) and (exc.status >= 500 or exc.status == 429)


async def wait_for(
    client: KubeClient,
    res: Resource,
    name: str,
    namespace: str | None,
    predicate: Callable[[JSON | None], bool],
    *,
    timeout: float,
    backoff: tuple[float, float] = (0.1, 2.0),
) -> JSON | None:
    """Wait until ``predicate(obj)`` holds for one object (obj is None once deleted), by watching it.

    Why not an Informer: one object, by name, with a GET and a watch (the verbs an agent has on its CSR;
    an informer lists, which needs ``list``). The same rules otherwise: 410 reads again at once; an
    error that may pass (5xx, 429, a refused or cut connection) is retried with backoff until the
    deadline and, if it lasts until then, raised as itself rather than as a bare timeout; any other
    (a 403: missing RBAC) is raised at once. Returns the object (None when the predicate accepted its
    absence). Raises TimeoutError when the deadline passes with the API server answering.
    """
    failing: list[BaseException] = []  # the current run of errors, if any

    async def _wait() -> JSON | None:
        while True:
            try:
                try:
                    obj = await client.get(res, name, namespace)
                except NotFound:
                    obj = None
                failing.clear()
                if predicate(obj):
                    return obj
                rv = obj["metadata"]["resourceVersion"] if obj else None
                async for kind, event_obj in client.watch(
                    res, namespace, resource_version=rv, field_selector=f"metadata.name={name}", timeout_seconds=60
                ):
                    if kind == "BOOKMARK":
                        continue
                    current = None if kind == "DELETED" else event_obj
                    if predicate(current):
                        return current
            except Gone:
                continue
            except Exception as exc:
                if not _passing(exc):
                    raise
                failing.append(exc)
                await asyncio.sleep(backoff_delay(backoff, len(failing)))

    try:
        return await asyncio.wait_for(_wait(), timeout)
    except TimeoutError:
        if failing:
            raise failing[-1] from None
        raise
