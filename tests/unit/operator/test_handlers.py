"""Every watch handler of the operator runs on the event loop: the handlers feed the ledger and the work
queue, which only the loop may touch (a burst of releases once raced the workers from kopf's thread pool:
"Set changed size during iteration"). The operator's watches are gpuobj_kube informers, which call their
handler in their own task, and kopf (which runs a plain handler in a thread) is not part of it at all."""

from __future__ import annotations

import subprocess
import sys


def test_the_operator_imports_no_watch_framework_that_runs_handlers_in_threads() -> None:
    # A fresh interpreter: whether importing the operator's entry point pulls kopf in.
    code = "import sys, gpuobj_operator.main; print('kopf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_every_watch_of_the_operator_is_an_informer_with_plain_handlers() -> None:
    # The handlers the operator gives its informers (term.py, signer.py): plain functions, on the loop.
    import inspect

    from gpuobj_operator.intake import Intake
    from gpuobj_operator.signer import Signer

    handlers = [Intake.on_object, Intake.on_claim, Intake.on_stream, Intake.on_pod, Signer._on_csr]
    assert [h.__name__ for h in handlers if inspect.iscoroutinefunction(h)] == []


def test_a_terms_stop_steps_run_to_their_end() -> None:
    # A term's wind-down once cancelled each stop step before it ran: the old term's informers and
    # workers went on acting beside the next term's (each free logged once per term ever led).
    import asyncio

    from gpuobj_operator.term import run_within

    ran: list[str] = []

    async def step() -> None:
        await asyncio.sleep(0)
        ran.append("stopped")

    async def hangs() -> None:
        await asyncio.Event().wait()

    async def go() -> tuple[bool, bool]:
        return await run_within(step(), 1.0), await run_within(hangs(), 0.05)

    assert asyncio.run(go()) == (True, False) and ran == ["stopped"]
