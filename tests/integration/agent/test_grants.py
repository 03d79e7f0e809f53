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
