"""Every watch handler of the operator runs on the event loop: the handlers feed the ledger and the work
queue, which only the loop may touch (kopf once ran plain-function handlers in its thread pool, and a
burst of releases raced the workers: "Set changed size during iteration"). The operator's watches are
all gpuobj_kube.informer's, which calls its handler in its own task; kopf, whose thread pool that was,
is not loaded at all."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS
from gpuobj_kube.informer import Informer


class OneEventKube:
    """Lists nothing, then delivers one ADDED event per watch, then stays quiet."""

    async def list(self, res, namespace=None, **_):
        return {"items": [], "metadata": {"resourceVersion": "1"}}

    async def watch(self, res, namespace=None, **_):
        yield "ADDED", {"metadata": {"namespace": "ml", "name": res.plural, "uid": "u", "resourceVersion": "2"}}
        await asyncio.Event().wait()


def test_every_kind_the_operator_watches_is_handled_on_the_event_loop_thread() -> None:
    seen: dict[str, tuple[int, bool]] = {}

    async def go() -> None:
        loop_thread = threading.get_ident()
        done = asyncio.Event()

        def handler(kind: str | None, obj: dict) -> None:
            try:
                asyncio.get_running_loop()  # raises in a worker thread
                on_loop = True
            except RuntimeError:
                on_loop = False
            seen[obj["metadata"]["name"]] = (threading.get_ident(), on_loop)
            if len(seen) == 4:
                done.set()

        informers = [Informer(OneEventKube(), res, handler) for res in (GPUOBJECTS, STREAMS, PODS, CLAIMS)]  # type: ignore[arg-type]
        for informer in informers:
            informer.start()
        async with asyncio.timeout(10):
            await done.wait()
        for informer in informers:
            await informer.stop()
        assert {ident for ident, _ in seen.values()} == {loop_thread}

    asyncio.run(go())
    assert all(on_loop for _, on_loop in seen.values()), seen


def test_the_operator_loads_no_kopf() -> None:
    # A kopf handler registered again (on.event, on.create ...) would bring its thread pool back.
    code = "import sys, gpuobj_operator.main, gpuobj_operator.reconciler; print('kopf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
