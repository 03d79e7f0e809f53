"""Generations, quarantine and the rotation policy: the fence's bookkeeping without NIXL."""

from __future__ import annotations

from gpuobj_agent.fencing import rotation_due
from gpuobj_agent.generations import TENURED, YOUNG, Generation, GenerationTable, GenState
from gpuobj_agent.quarantine import Quarantine


def test_activating_a_generation_seals_the_previous_one():
    table = GenerationTable("gpuobj.ns.pod.inc")

    def add() -> int:
        gid, name = table.new_name()
        assert name == f"gpuobj.ns.pod.inc.g{gid}"
        table.add(Generation(gid, name, agent=None, created_at=0.0))
        return gid

    first = add()
    assert table.activate(first, now=1.0) is None
    second = add()
    old = table.activate(second, now=2.0)
    assert old is not None and old.gid == first and old.state == GenState.SEALED and old.sealed_at == 2.0
    assert table.active.gid == second
    assert [g.gid for g in table.sealed()] == [first]
    table.retire(first, now=3.0)
    third = add()
    table.activate(third, now=4.0)
    assert table.live_names() == [f"gpuobj.ns.pod.inc.g{second}", f"gpuobj.ns.pod.inc.g{third}"]
    assert table.retired_count == 1 and len(table) == 2


def test_quarantined_memory_is_released_only_when_every_generation_that_exposed_it_retired():
    q = Quarantine()
    refs = [object()]
    q.add("o1", 100, refs, {1, 2}, now=5.0)
    q.add("o2", 50, [object()], {2}, now=6.0)
    assert q.bytes == 150 and q.oldest(2) == 5.0 and q.bytes_waiting_on(2) == 150
    assert q.generation_retired(1) == []  # o1 still waits on generation 2
    released = q.generation_retired(2)
    assert sorted(e.object_id for e in released) == ["o1", "o2"]
    assert q.bytes == 0 and q.count == 0


def test_rotation_is_due_after_the_fence_interval_or_at_once_above_the_high_water_mark():
    assert rotation_due(10.0, None, 0, 0.25, 1000) is None  # nothing freed that a reader saw: never rotate
    assert rotation_due(10.0, 10.0, 10, 0.25, 1000) == 0.25
    assert rotation_due(10.3, 10.0, 10, 0.25, 1000) == 0.0
    assert rotation_due(10.0, 10.0, 1000, 0.25, 1000) == 0.0


def test_a_few_freed_bytes_wait_the_small_interval_and_more_the_usual_one():
    # 2 s while under 16 units wait; 0.25 s once 16 or more do; at once from 1000.
    def due(now: float, waiting: int) -> float | None:
        return rotation_due(now, 10.0, waiting, 0.25, 1000, low_bytes=16, small_interval=2.0)

    assert due(10.0, 15) == 2.0 and due(11.0, 15) == 1.0 and due(12.5, 15) == 0.0
    assert due(10.0, 16) == 0.25 and due(10.3, 16) == 0.0
    assert due(10.0, 1000) == 0.0
    # A small interval shorter than the usual one never hurries a rotation.
    assert rotation_due(10.0, 10.0, 1, 0.25, 1000, low_bytes=16, small_interval=0.1) == 0.25


def test_young_and_tenured_lanes_each_have_their_own_active_generation():
    table = GenerationTable("b")
    gids = []
    for lane in (YOUNG, TENURED, YOUNG):
        gid, name = table.new_name()
        table.add(Generation(gid, name, agent=None, created_at=0.0))
        table.activate(gid, now=1.0, lane=lane)
        gids.append(gid)
    assert table.active.gid == gids[2] and table.active_in(TENURED).gid == gids[1]
    assert [g.gid for g in table.sealed()] == [gids[0]]
    table.retire(gids[1], now=2.0)
    assert table.active_in(TENURED) is None and table.active.gid == gids[2]
