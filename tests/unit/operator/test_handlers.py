"""kopf's handlers are coroutines: kopf runs a plain function in its thread pool, and the handlers feed the
ledger and the work queue, which only the event loop may touch (a burst of releases once raced the
workers: "Set changed size during iteration")."""

from __future__ import annotations

import inspect

import kopf
from kopf._core.intents.registries import GenericRegistry

from gpuobj_operator.main import build_registry


def _all_handlers(registry: kopf.OperatorRegistry) -> list:
    # Every kind of handler kopf keeps (activities, events, changes, daemons, webhooks...): a new kind is checked too.
    kinds = [r for r in vars(registry).values() if isinstance(r, GenericRegistry)]
    assert len(kinds) >= 5, f"kopf's registry changed shape: {sorted(vars(registry))}"
    return [h for kind in kinds for h in kind.get_all_handlers()]


def test_every_kopf_handler_of_the_operator_runs_on_the_event_loop() -> None:
    handlers = _all_handlers(build_registry(reconciler=None, config=None))  # type: ignore[arg-type]
    ids = sorted(str(h.id) for h in handlers)
    assert any("on_object" in i for i in ids) and any("on_stream" in i for i in ids), ids
    threaded = [str(h.id) for h in handlers if not inspect.iscoroutinefunction(h.fn)]
    assert threaded == [], f"sync handlers run in kopf's thread pool: {threaded}"


def test_the_check_sees_a_sync_handler() -> None:
    registry = build_registry(reconciler=None, config=None)  # type: ignore[arg-type]

    @kopf.on.event("gpuobj.io", "v1alpha1", "gpuobjects", registry=registry)
    def sync_handler(**_):  # what the operator must never register
        pass

    threaded = [h for h in _all_handlers(registry) if not inspect.iscoroutinefunction(h.fn)]
    assert [h.fn for h in threaded] == [sync_handler]
