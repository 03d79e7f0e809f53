"""Landing buffers: fetched CPU tensors live in registered, reused, bounded buffers."""

from __future__ import annotations

import gc

import pytest

from gpuobj_agent.buffers import LandingPool
from gpuobj_agent.layouts import TensorLayout, layout_of
from gpuobj_agent.nixl_transport import NixlAgent

pytestmark = pytest.mark.nixl


@pytest.fixture
def agent():
    a = NixlAgent("landing-test", progress_thread=False)
    yield a
    a.close()


def test_a_buffer_returns_to_the_pool_when_the_last_view_dies_and_is_reused(agent):
    pool = LandingPool(agent, max_idle_bytes=1 << 30)
    layouts = [
        TensorLayout((3, 5), "float32", "cpu"),
        TensorLayout((), "bfloat16", "cpu"),
        TensorLayout((0,), "int8", "cpu"),
        TensorLayout((100,), "bool", "cpu"),
    ]
    tensors, buf = pool.carve(layouts)
    assert [layout_of(t) for t in tensors] == layouts
    assert all(t.data_ptr() % 64 == 0 for t in tensors if t.numel())
    keep = tensors[0][1:]  # a view outlives the fetched tensors
    del tensors
    gc.collect()
    assert pool.in_use == 1
    del keep
    gc.collect()
    assert pool.in_use == 0 and pool.idle_bytes == buf.capacity
    again, buf2 = pool.carve(layouts)
    assert buf2 is buf and pool.registrations == 1  # reused: no new registration, no page faults
    del again
    pool.close()
    assert pool.registrations == pool.deregistrations == 1


def test_idle_buffers_are_bounded_and_trimmed(agent):
    pool = LandingPool(agent, max_idle_bytes=3 << 20, idle_seconds=0.0)
    held = [pool.carve([TensorLayout((1 << 20,), "uint8", "cpu")])[0] for _ in range(5)]
    assert pool.registrations == 5
    del held
    gc.collect()
    assert pool.idle_bytes <= 3 << 20 and pool.deregistrations == 2  # the oldest beyond the bound went
    assert pool.trim() == 3 and pool.idle_bytes == 0
    pool.close()
    assert pool.registrations == pool.deregistrations


def test_closing_deregisters_buffers_still_in_use_and_their_tensors_stay_valid(agent):
    pool = LandingPool(agent)
    [t], _ = pool.carve([TensorLayout((1024,), "int32", "cpu")])
    t.fill_(7)
    pool.close()
    assert pool.registrations == pool.deregistrations == 1
    assert int(t.sum()) == 7 * 1024  # numpy still owns the memory
    del t
    gc.collect()
    assert pool.in_use == 0


def test_a_bound_buffer_hands_out_new_tensors_and_is_busy_while_any_of_them_lives(agent):
    pool = LandingPool(agent, max_idle_bytes=1 << 30)
    layouts = [TensorLayout((4, 4), "float32", "cpu"), TensorLayout((0,), "int8", "cpu")]
    bound = pool.bind(layouts)
    assert not bound.busy() and pool.in_use == 0  # bound, but nothing handed out is alive
    first = bound.hand_out()
    assert [layout_of(t) for t in first] == layouts and first[0] is not bound.tensors[0]
    assert first[0].data_ptr() == bound.tensors[0].data_ptr()  # the same landing memory
    assert bound.busy() and pool.in_use == 1
    view = first[0][1:]
    del first
    assert bound.busy()  # a view keeps it busy
    arr = view.numpy()
    del view
    assert bound.busy()  # so does a numpy array over one
    del arr
    assert not bound.busy() and pool.in_use == 0

    held = bound.hand_out()
    pool.unbind(bound)  # its prepared read is gone, but its tensors live: not back in the pool yet
    assert pool.idle_bytes == 0 and pool.in_use == 1
    del held
    pool.trim(now=0.0)  # a reclaim pass (trims nothing idle this early)
    assert pool.idle_bytes == bound.buf.capacity and pool.in_use == 0
    pool.close()
    assert pool.registrations == pool.deregistrations == 1
