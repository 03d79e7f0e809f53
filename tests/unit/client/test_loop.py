"""The bridge into the process's one loop (gpuobj.client.loop) when that loop is someone else's (the agent's).

Logic only, on a plain thread running a loop; tests/integration/agent/test_one_loop.py runs the client on
the real embedded agent's loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from gpuobj.client.loop import LoopBridge, cancel_tasks


@pytest.fixture
def foreign() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop another thread runs, as the embedded agent's is."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_calls_from_a_workload_thread_and_from_another_loop_run_on_the_bridged_loop(
    foreign: asyncio.AbstractEventLoop,
) -> None:
    bridge = LoopBridge(foreign)

    async def where() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert bridge.running and not bridge.in_loop()
    assert bridge.call(where(), timeout=5) is foreign
    assert asyncio.run(bridge.acall(where(), timeout=5)) is foreign  # an asyncio workload's loop is not blocked


def test_on_the_loop_a_sync_call_is_refused_and_an_async_one_is_a_plain_await(
    foreign: asyncio.AbstractEventLoop,
) -> None:
    bridge = LoopBridge(foreign)

    async def inside() -> tuple[bool, int]:
        async def seven() -> int:
            return 7

        with pytest.raises(RuntimeError, match="use the async"):
            bridge.call(seven(), timeout=5)  # would wait on the loop it blocks
        return bridge.in_loop(), await bridge.acall(seven(), timeout=5)

    assert bridge.call(inside(), timeout=5) == (True, 7)


def test_cancel_tasks_ends_only_the_tasks_given_and_waits_with_a_bound(foreign: asyncio.AbstractEventLoop) -> None:
    bridge = LoopBridge(foreign)

    async def scenario() -> tuple[bool, bool]:
        ours = asyncio.create_task(asyncio.Event().wait())
        theirs = asyncio.create_task(asyncio.Event().wait())  # the agent's: not the core's to cancel
        await asyncio.sleep(0)
        await cancel_tasks([ours], timeout=5)
        done = ours.cancelled(), theirs.done()
        theirs.cancel()
        return done

    assert bridge.call(scenario(), timeout=10) == (True, False)
