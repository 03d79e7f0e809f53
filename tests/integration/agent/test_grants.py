"""Read grants: a reader with a grant reads with no request to the source; a stale grant is fenced.

A grant (store.grant) is what a hand-off carries: the object's spans and the NIXL partial
metadata of its own registration. After a free the source retires the NIXL agent that
exposed it before the memory goes, so a stale grant fails cleanly (never the source), and
the asynchronous path falls back to a ticket, which says the object is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gpuobj_agent.errors import AgentError, ObjectGone

from .conftest import TOKEN, settle

pytestmark = pytest.mark.nixl


def test_a_grant_reads_the_bytes_without_a_request_and_goes_stale_cleanly_after_the_free(make_runtime) -> None:
    src, dst = make_runtime("src"), make_runtime("dst")
    tensor = torch.arange(1 << 16, dtype=torch.float32)
    src.put("granted", [tensor])
    grant = asyncio.run(src.agrant("granted"))
    assert grant["incarnation"] == src.agent.incarnation and grant["bytes"] == tensor.nbytes
    tickets_before = src.stats()["inflightReads"]

    got = dst.fetch_granted_direct(src.endpoint, "granted", grant)
    assert torch.equal(got[0], tensor)
    got_async = asyncio.run(dst.afetch_granted(src.endpoint, "granted", grant, token=TOKEN))
    assert torch.equal(got_async[0], tensor)
    assert src.stats()["inflightReads"] == tickets_before == 0  # no ticket was taken
    del got, got_async

    result = src.free("granted", wait_fence=True, timeout=60)
    assert result["freed"] and result["fenced"], result  # the exposing NIXL agent is retired
    # Our reader has no NIXL progress thread: over cma its worker learns of the fence on its next
    # operation, so the first stale READ may still copy (fencing.py, Limits); from then on it fails
    # cleanly, and the source keeps serving. Our client never reads under a released claim anyway.
    with contextlib.suppress(AgentError):
        dst.fetch_granted_direct(src.endpoint, "granted", grant)
    with pytest.raises(AgentError):
        dst.fetch_granted_direct(src.endpoint, "granted", grant)
    assert src.stats()["objects"] == 0
    with pytest.raises(ObjectGone):
        asyncio.run(dst.afetch_granted(src.endpoint, "granted", grant, token=TOKEN))  # falls back to a ticket: gone
    # A failed READ whose handle NIXL would not release yet keeps its landing tensors in the
    # reader's graveyard until its next read reaps it: read something else, then let go.
    src.put("other", [torch.ones(16)])
    assert dst.fetch(src.endpoint, "other", token=TOKEN)[0].sum() == 16
    assert src.free("other")["freed"]
    gc.collect()  # the failed reads' tracebacks held their landing tensors
    settle(src.stats)
    settle(dst.stats)


def test_prepared_reads_land_correct_bytes_and_never_overwrite_a_tensor_still_held(make_runtime) -> None:
    """A small CPU grant read again re-posts a prepared READ into a bound landing buffer (fetch.py,
    `_GrantEntry`): many fetches, correct bytes every time; a tensor (or a view of one) still held
    keeps its buffer out of use; idle prepared reads are let go; stopping releases everything."""
    from gpuobj_agent.fetch import PREPARED_IDLE, PREPARED_SLOTS

    src, dst = make_runtime("src"), make_runtime("dst")
    parts = [torch.arange(1024, dtype=torch.int32), torch.empty(0, dtype=torch.int8), torch.rand(3, 5)]
    src.put("small", parts)
    grant = asyncio.run(src.agrant("small"))
    fetcher, pool = dst.agent.fetcher, dst.agent.pool
    assert fetcher is not None and pool is not None

    def fetch() -> list[torch.Tensor]:
        got = dst.fetch_granted_direct(src.endpoint, "small", grant)
        assert len(got) == 3 and all(torch.equal(g, p) for g, p in zip(got, parts, strict=True))
        return got

    fetch()
    assert fetcher.prepared_reads == 0  # a grant read once (a one-shot hand-off) binds nothing
    for _ in range(300):  # one prepared read, re-posted: no new landing buffer, no new registration
        fetch()
    assert fetcher.prepared_reads == 1 and pool.registrations == 1
    assert dst.stats()["landingBuffersInUse"] == 0  # nothing handed out is alive

    held = fetch()
    held[0].zero_()  # if a later fetch landed in this memory, the source's bytes would reappear
    view = held[2][1:]  # a view outlives the tensors it came from
    view.fill_(-1.0)
    del held[2]
    again = fetch()
    assert int(held[0].abs().sum()) == 0 and bool((view == -1.0).all())
    assert again[0].data_ptr() != held[0].data_ptr() and fetcher.prepared_reads == 2
    assert dst.stats()["landingBuffersInUse"] == 2
    keep = [fetch() for _ in range(PREPARED_SLOTS + 2)]  # slots all busy: further fetches carve
    assert fetcher.prepared_reads == PREPARED_SLOTS
    assert int(held[0].abs().sum()) == 0 and bool((view == -1.0).all())
    del held, view, again, keep
    fetch()  # a slot whose tensors all died is landed in again
    assert dst.stats()["landingBuffersInUse"] == 0

    def reader(seed: int) -> None:  # threads share the grant's slots: each keeps what it got intact
        mine = None
        for i in range(150):
            got = fetch()
            if mine is not None:
                assert torch.equal(mine[0], torch.full_like(mine[0], seed)), "a held tensor was overwritten"
            got[0].fill_(seed)
            mine = got if i % 3 else None

    with ThreadPoolExecutor(4) as threads:
        list(threads.map(reader, range(1, 5)))
    assert fetcher.prepared_reads <= PREPARED_SLOTS
    assert dst.stats()["landingBuffersInUse"] == 0

    pool.trim(now=time.monotonic() + PREPARED_IDLE + 1)  # idle prepared reads let their buffers go
    assert fetcher.prepared_reads == 0
    fetch()
    assert fetcher.prepared_reads == 1

    result = src.free("small", wait_fence=True, timeout=60)
    assert result["freed"] and result["fenced"], result
    assert fetcher.prepared_reads == 1  # it still names the retired NIXL agent: fenced all the same
    # (over cma the first READ after the fence may still copy; see the test above).
    with contextlib.suppress(AgentError):
        dst.fetch_granted_direct(src.endpoint, "small", grant)
    with pytest.raises(AgentError):
        dst.fetch_granted_direct(src.endpoint, "small", grant)
    src.put("other", [torch.ones(16)])  # reap a failed READ's handle, if NIXL kept one (see above)
    assert dst.fetch(src.endpoint, "other", token=TOKEN)[0].sum() == 16
    assert src.free("other")["freed"]
    gc.collect()
    settle(src.stats)
    settle(dst.stats)
    dst.stop()  # the prepared READ is released and its buffer deregistered before the reader agent goes
    assert fetcher.prepared_reads == 0 and pool.registrations == pool.deregistrations
    assert dst.agent.balanced(), dst.agent.stats()
