"""The NIXL state the store and the fencer share: generations in and out, deregistration, and the
requests the store makes of the fencer (rotate now, wait for a fence) with the fencer's answers.

No NIXL here (a generation's agent is a stand-in); tests/integration/agent/test_store.py runs the
same object with real NIXL agents, the store and the fencer.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuobj_agent.errors import TransportError
from gpuobj_agent.generations import Generation
from gpuobj_agent.metrics import AgentMetrics, Levels
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.objects import StoredObject
from gpuobj_agent.registrations import RegionKey


class StandInAgent:
    def __init__(self, fail: bool = False) -> None:
        self.registered: list[RegionKey] = []
        self.deregistered: list[RegionKey] = []
        self.fail = fail

    def register(self, keys: list[RegionKey]) -> None:
        self.registered.extend(keys)

    def deregister(self, keys: list[RegionKey]) -> None:
        if self.fail:
            raise TransportError("NIXL said no")
        self.deregistered.extend(keys)

    def partial_metadata(self, keys: list[RegionKey]) -> bytes:
        return b"md"

    def serialized_descriptors(self, spans: list[object]) -> bytes:
        return b"descs"


def stored(object_id: str, keys: list[RegionKey], gid: int, *, pooled: bool = False) -> StoredObject:
    """A recorded object as the store keeps it (no tensors: nothing here reads bytes)."""
    obj = StoredObject(object_id, [], [], [None] * len(keys), keys, sum(k.nbytes for k in keys), 0.0, 0.0, gid)
    obj.on_release = (lambda: None) if pooled else None
    return obj


def with_state(body) -> None:
    async def go() -> None:
        with ThreadPoolExecutor(1) as control:
            await body(NixlState("gpuobj.ns.pod.inc", control=control, metrics=AgentMetrics(Levels)))

    asyncio.run(go())


def add(nixl: NixlState, agent: object) -> Generation:
    gid, name = nixl.gens.new_name()
    gen = Generation(gid, name, agent, created_at=0.0)
    nixl.add_generation(gen)
    return gen


def test_a_generation_joins_everything_and_retires_only_once_it_holds_nothing() -> None:
    async def body(nixl: NixlState) -> None:
        agent = StandInAgent()
        gen = add(nixl, agent)
        key = RegionKey("DRAM", 0, 4096, 64)
        assert nixl.members[gen.gid] == set() and nixl.ledger.generations() == [gen.gid]
        async with nixl.lock:
            described = await nixl.register(gen, "o1", [key], [None])
            nixl.placed(gen.gid, "o1")
            assert agent.registered == [key] and described.metadata is not None
            assert [(gid, r.deregister) for gid, r in await nixl.release(stored("o1", [key], gen.gid))] == [
                (gen.gid, [key])
            ]
        assert agent.deregistered == [key] and nixl.ledger.balanced() and nixl.members[gen.gid] == set()
        async with nixl.lock:
            nixl.retire_generation(gen.gid)
        assert not nixl.gens.has(gen.gid) and gen.gid not in nixl.members and nixl.ledger.generations() == []

    with_state(body)


def test_a_failed_deregister_is_recorded_anyway_and_counted_as_an_error() -> None:
    async def body(nixl: NixlState) -> None:
        agent = StandInAgent()
        gen = add(nixl, agent)
        key = RegionKey("DRAM", 0, 8192, 64)
        async with nixl.lock:
            await nixl.register(gen, "o1", [key], [None])
            agent.fail = True
            await nixl.release_moved(gen.gid, ["o1"])  # the agent is destroyed anyway: never raise here
        assert nixl.ledger.balanced()
        assert b'gpuobj_agent_errors_total{kind="nixl_deregister"} 1.0' in nixl.metrics.render()

    with_state(body)


def test_rotate_now_returns_when_the_fencer_rotates_and_fails_when_it_stops() -> None:
    async def body(nixl: NixlState) -> None:
        waiting = asyncio.create_task(nixl.rotate_now(timeout=5))
        await asyncio.sleep(0)
        assert nixl.rotation_forced and nixl.wake.is_set()
        nixl.rotated()
        await waiting
        assert not nixl.rotation_forced
        waiting = asyncio.create_task(nixl.rotate_now(timeout=5))
        await asyncio.sleep(0)
        nixl.stopping()
        with pytest.raises(TransportError, match="agent stopping"):
            await waiting

    with_state(body)


def test_wait_retired_marks_the_generation_urgent_and_returns_once_it_is_fenced() -> None:
    async def body(nixl: NixlState) -> None:
        gen = add(nixl, StandInAgent())
        waiting = asyncio.create_task(nixl.wait_retired([gen.gid, 999], timeout=5))  # 999: already gone
        await asyncio.sleep(0)
        assert nixl.urgent(gen.gid) and nixl.wake.is_set()
        async with nixl.lock:
            nixl.retire_generation(gen.gid)
        nixl.retired(gen.gid)
        assert await waiting is True
        assert not nixl.urgent(gen.gid)
        other = add(nixl, StandInAgent())
        assert await nixl.wait_retired([other.gid], timeout=0.01) is False  # nobody fenced it in time

    with_state(body)


def test_a_private_generation_serves_one_pooled_region_and_is_retired_and_destroyed_with_its_parked_key() -> None:
    """A pooled region's own agent (store._put_pooled): in no lane, never sealed; retiring it deregisters
    the region it parks, forgets it as reusable, counts a pooled fence (not a rotation), then destroys it."""

    async def body(nixl: NixlState) -> None:
        destroyed: list[int] = []

        async def destroy(gen: Generation) -> None:
            destroyed.append(gen.gid)

        nixl.destroy = destroy
        young = add(nixl, StandInAgent())
        nixl.gens.activate(young.gid, 0.0)
        agent = StandInAgent()
        gid, name = nixl.gens.new_name()
        gen = Generation(gid, name, agent, created_at=0.0)
        nixl.add_private(gen)
        assert nixl.gens.active is young and nixl.gens.sealed() == [] and gen in nixl.gens.live()
        key = RegionKey("DRAM", 0, 1 << 20, 4096)
        async with nixl.lock:
            await nixl.register(gen, "v1", [key], [None])
            assert agent.registered == [key]
            [(_, released)] = await nixl.release(stored("v1", [key], gid, pooled=True))
            assert released.deregister == [] and not released.exposed  # nobody read it: parked for reuse
            nixl.park_pooled([key], gid)
            assert nixl.is_parked([key])
            adopted = await nixl.adopt_parked("v2", [key], [None])  # the next version: no registration
            assert adopted is not None and adopted[0] == gid and agent.registered == [key]
            assert not nixl.is_parked([key])
            nixl.ledger.expose(gid, [key])
            [(_, released)] = await nixl.release(stored("v2", [key], gid, pooled=True))
            assert released.exposed  # read: must be fenced
            retired = await nixl.retire_private(gid)
        assert agent.deregistered == [key] and not nixl.is_parked([key]) and not nixl.gens.has(gid)
        await nixl.destroy_retired(retired)
        assert destroyed == [gid]
        assert (nixl.gens.private_retired, nixl.gens.retired_count) == (1, 0)
        assert nixl.gens.active is young  # the lanes never saw it
        async with nixl.lock:
            nixl.gens.retire(young.gid, 0.0)
            nixl.ledger.drop_generation(young.gid)
        assert nixl.ledger.balanced()

    with_state(body)


def test_move_takes_what_the_target_may_hold_and_a_failed_registration_moves_nothing() -> None:
    """The fencer's migration, done by the placement: one bulk registration in the target; a region the
    target deregistered after a reader saw it stays behind (RegionReused); on a NIXL error nothing moves."""

    async def body(nixl: NixlState) -> None:
        old, target = add(nixl, StandInAgent()), add(nixl, StandInAgent())
        a, b, c = (RegionKey("DRAM", 0, addr, 64) for addr in (4096, 8192, 12288))
        objs = [stored("a", [a], old.gid), stored("b", [b], old.gid), stored("c", [c], old.gid)]
        async with nixl.lock:
            for obj in objs:
                await nixl.register(old, obj.object_id, obj.keys, [None])
                nixl.placed(old.gid, obj.object_id)
            await nixl.register(target, "seen", [b], [None])  # b was read in the target and freed there
            nixl.ledger.expose(target.gid, [b])
            await nixl.release_moved(target.gid, ["seen"])
            moved = await nixl.move(target, objs, limit=1)
            assert [o.object_id for o in moved] == ["a"] and target.agent.registered == [b, a]
            moved = await nixl.move(target, objs[1:], limit=10)
            assert [o.object_id for o in moved] == ["c"]  # b must wait for a newer agent
            assert (objs[0].gid, objs[1].gid, objs[2].gid) == (target.gid, old.gid, target.gid)
            assert nixl.members[old.gid] == {"b"} and nixl.members[target.gid] == {"a", "c"}
            assert objs[0].description is None  # described again on its next read
            target.agent.register = lambda keys: (_ for _ in ()).throw(TransportError("NIXL said no"))
            d = stored("d", [RegionKey("DRAM", 0, 16384, 64)], old.gid)
            await nixl.register(old, "d", d.keys, [None])
            nixl.placed(old.gid, "d")
            assert await nixl.move(target, [d], limit=10) == []
            assert d.gid == old.gid and nixl.ledger.owner_generations("d") == [old.gid]
        assert b'gpuobj_agent_errors_total{kind="nixl_register"} 1.0' in nixl.metrics.render()

    with_state(body)
