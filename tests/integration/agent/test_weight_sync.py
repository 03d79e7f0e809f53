"""Weight sync at the agent: a state dict packed into one region, versions reusing their pack buffers,
a version a reader saw fenced (its NIXL agent destroyed) before its buffer takes the next one, a version
nobody read reused with no new NIXL registration; real NIXL between two agents in this process (the client
and operator side is tests/e2e/operator/test_weight_sync.py, the raw replay test_stale_reader.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from gpuobj.client.errors import InvalidTensorError
from gpuobj.client.state_dicts import PackPool, plan, unpack

from .conftest import TOKEN, settle, wait_until

pytestmark = pytest.mark.nixl


def state_dict(version: int) -> dict[str, torch.Tensor]:
    """A model-like state dict: many tensors, several dtypes, a 0-d one, an empty one, a tied pair."""
    gen = torch.Generator().manual_seed(version)
    embed = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    sd = {"embed.weight": embed}
    for layer in range(12):
        sd[f"layers.{layer}.w"] = torch.randn(32, 48, generator=gen).to(torch.bfloat16)
        sd[f"layers.{layer}.norm"] = torch.randn(32, generator=gen)
        sd[f"layers.{layer}.steps"] = torch.tensor(version * 100 + layer, dtype=torch.int64)
    sd["mask"] = torch.arange(7) % 2 == 0
    sd["empty"] = torch.empty(0, 3, dtype=torch.float16)
    sd["lm_head.weight"] = embed  # tied to the embeddings
    return sd


class Publisher:
    """What the client does for put(state_dict): plan, take a pooled pack, fill it, put it with a callback."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self.pool = PackPool()
        self.entries = {}

    def publish(self, object_id: str, sd: dict[str, torch.Tensor]) -> None:
        p = plan(sd)
        pack = self.pool.take(p)
        pack.fill(p)
        self.rt.put(object_id, pack.views, on_release=self.pool.returner(pack))
        self.entries[object_id] = p.entries


def registrations(rt) -> int:
    """NIXL registrations on a put's path: all of them but those made ahead, in a spare, once none is under way."""
    stats = wait_until(lambda: (s := rt.stats())["registeringAhead"] == 0 and s, "the registration ahead", 30)
    return stats["registrations"] - stats["registrationsAhead"]


def wait_ahead(rt) -> dict:
    """Until the background work after a free is done: the region registered ahead, a private spare ready."""
    return wait_until(
        lambda: (s := rt.stats())["registeringAhead"] == 0 and s["privateSpares"] >= 1 and s,
        "the registration ahead and a private spare",
        30,
    )


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_only_pool_parked(stats: dict, buffers: int) -> None:
    """Nothing held but `buffers` pool regions parked registered for their next version (deregistered at stop):
    in their own NIXL agent when nobody read their last version, else, that agent destroyed at the free (the
    fence), in a spare agent no reader has a key of (registered ahead)."""
    assert stats["objects"] == 0 and stats["storeBytes"] == 0, stats
    assert stats["inflightReads"] == 0 and stats["quarantinedBytes"] == 0, stats
    assert stats["registeredRegions"] == buffers, stats
    assert stats["registrations"] - stats["deregistrations"] == buffers, stats


def test_a_state_dict_is_one_region_and_comes_back_with_its_names_dtypes_bytes_and_ties(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    sd = state_dict(1)
    before = registrations(src)
    pub.publish("v1", sd)
    assert registrations(src) == before + 1  # 39 tensors, one registration
    got = unpack(pub.entries["v1"], dst.fetch(src.endpoint, "v1", token=TOKEN))
    assert list(got) == list(sd)
    for name, t in sd.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(raw(got[name]), raw(t)), name
    assert got["lm_head.weight"] is got["embed.weight"]  # tied: stored once, restored tied
    del got
    gc.collect()
    freed = src.free("v1")
    assert freed["freed"] and freed["fenced"], freed  # a reader saw it: its agent is gone before the reuse
    stats = wait_ahead(src)
    assert stats["pooledFences"] == 1 and stats["registrationsAhead"] == 1  # the buffer, in a spare, for v2
    assert_only_pool_parked(stats, 1)
    settle(dst.stats)


def test_overlapping_views_and_mixed_devices_and_non_tensors_are_refused_clearly():
    base = torch.zeros(10)
    with pytest.raises(InvalidTensorError, match="overlapping"):
        plan({"a": base[:6], "b": base[4:]})
    with pytest.raises(InvalidTensorError, match=r"not a torch\.Tensor"):
        plan({"a": base, "b": 3})
    with pytest.raises(InvalidTensorError, match="empty"):
        plan({})
    assert len(plan({"a": base[:5], "b": base[5:]}).sources) == 2  # disjoint views of one storage: fine


def test_a_version_nobody_read_is_reused_with_no_registration_and_a_read_one_is_fenced_before_its_reuse(
    make_runtime,
):
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    start = registrations(src)
    pub.publish("v1", state_dict(1))
    pub.publish("v2", state_dict(2))
    assert registrations(src) == start + 2  # one region each, each in a NIXL agent of its own
    lagging = unpack(pub.entries["v1"], dst.fetch(src.endpoint, "v1", token=TOKEN))  # a reader still on v1
    agents = src.stats()["generations"]
    assert src.free("v2")["freed"]  # nobody read it: its region stays parked in its agent
    assert src.stats()["pooledFences"] == 0 and src.stats()["generations"] == agents
    pub.publish("v3", state_dict(3))  # into v2's buffer, where nobody read: no registration
    assert registrations(src) == start + 2
    for version in range(3, 9):  # v1 is held; each version takes the buffer its predecessor left
        if version > 3:
            pub.publish(f"v{version}", state_dict(version))
        fetched = unpack(pub.entries[f"v{version}"], dst.fetch(src.endpoint, f"v{version}", token=TOKEN))
        assert torch.equal(fetched["layers.3.w"], state_dict(version)["layers.3.w"])
        del fetched
        freed = src.free(f"v{version}")
        assert freed["freed"] and freed["fenced"], freed  # read: fenced within the free, before the reuse
    stats = wait_ahead(src)
    # v3-v8 fenced at their free; after each, the buffer was registered ahead in a spare agent, where the next
    # version was put: v4-v8 registered nothing on their put's path
    assert registrations(src) == start + 2 and stats["pooledFences"] == 6 and stats["registrationsAhead"] == 6
    assert pub.pool.stats()["buffers"] == 2 and pub.pool.stats()["reused"] == 6
    assert stats["rotations"] == 0 and stats["quarantinedBytes"] == 0  # no lane rotation, nothing quarantined
    # The lagging reader's v1 was never overwritten: it is still whole, and still readable at the source.
    assert torch.equal(lagging["layers.11.steps"], torch.tensor(111))
    again = unpack(pub.entries["v1"], dst.fetch(src.endpoint, "v1", token=TOKEN))
    assert all(torch.equal(raw(again[n]), raw(t)) for n, t in state_dict(1).items())
    del lagging, again
    gc.collect()
    assert src.free("v1")["freed"]
    assert pub.pool.stats()["busyBytes"] == 0
    assert_only_pool_parked(wait_ahead(src), 2)  # both buffers, each in a spare agent for its next version
    settle(dst.stats)


def test_a_readers_first_fetch_of_a_version_finds_its_agent_connected_and_the_put_registers_nothing(make_runtime):
    """Issue 31 (item 1): a read version's grant announces the spare agent the next version goes to; the reader
    connects to it after its read, and the source registers the buffer there after the free before the next put.
    So from the third version on the put registers nothing and the reader's first fetch finds its agent
    connected; the versions' bytes are right and nothing is left behind."""
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    start = registrations(src)
    granted = {}
    for version in range(1, 7):
        pub.publish(f"v{version}", state_dict(version))
        wait_ahead(src)  # a step of training: the spares are ready again (made in 20-150 ms)
        grant = asyncio.run(src.agrant(f"v{version}"))
        granted[version] = grant
        if version > 1:
            assert grant["nixlAgent"] == granted[version - 1]["nextAgent"], "the version went to the announced agent"
        before = dst.stats()["preconnectedReads"]
        got = unpack(pub.entries[f"v{version}"], dst.fetch_granted_direct(src.endpoint, f"v{version}", grant))
        assert torch.equal(raw(got["layers.5.w"]), raw(state_dict(version)["layers.5.w"]))
        del got
        gc.collect()
        if version > 1:  # v2 (a fresh buffer) and every later one went to the spare announced with the last
            assert dst.stats()["preconnectedReads"] == before + 1
        wait_until(lambda v=version: dst.stats()["connectedAhead"] >= v, "connected to the announced spare", 30)
        if version > 1:
            freed = src.free(f"v{version - 1}")  # the version before: its buffer takes the next one
            assert freed["freed"] and freed["fenced"], freed
    assert registrations(src) == start + 2  # the two buffers' first registrations only
    # v1-v5's buffers, each in the spare after their free: v3-v6 were put there, the last waits for v7
    assert wait_ahead(src)["registrationsAhead"] == 5
    assert src.free("v6")["freed"]
    assert pub.pool.stats()["busyBytes"] == 0
    assert_only_pool_parked(wait_ahead(src), 2)
    settle(dst.stats)


def test_a_reader_forgets_each_retired_version_agent_so_its_loaded_remote_agents_stay_bounded(make_runtime):
    """Issue 31: the fence retires one source NIXL agent per read version; a reader reading with grants in the
    calling thread (the client's weight-sync path) kept every one of them loaded in its NIXL agent, one more
    per version, forever. A new grant lists the source's live agents: the reader forgets those it no longer
    lists. Over many versions at most the current version's agent, the one before (its retirement not yet
    heard of) and the announced spare stay loaded, as NIXL itself reports them."""
    src, dst = make_runtime("src"), make_runtime("dst")
    reader = dst.agent.fetcher.reader
    pub = Publisher(src)
    seen: list[str] = []
    for version in range(1, 13):
        pub.publish(f"v{version}", state_dict(version))
        wait_ahead(src)
        grant = asyncio.run(src.agrant(f"v{version}"))
        seen += [n for n in (grant["nixlAgent"], grant.get("nextAgent")) if n and n not in seen]
        got = unpack(pub.entries[f"v{version}"], dst.fetch_granted_direct(src.endpoint, f"v{version}", grant))
        assert torch.equal(raw(got["layers.5.w"]), raw(state_dict(version)["layers.5.w"]))
        del got
        gc.collect()
        wait_until(lambda v=version: dst.stats()["connectedAhead"] >= v, "connected to the announced spare", 30)
        if version > 1:
            assert src.free(f"v{version - 1}")["freed"]
        loaded = [n for n in seen if reader._a().check_remote_metadata(n)]
        assert len(loaded) <= 3, f"version {version}: {len(loaded)} source agents still loaded: {loaded}"
    assert len(seen) >= 12
    assert dst.stats()["cachedRemoteAgents"] <= 2
    assert src.free("v12")["freed"]
    assert_only_pool_parked(wait_ahead(src), 2)
    settle(dst.stats)


def test_a_state_dict_at_the_tensor_limit_round_trips_in_one_region(make_runtime):
    """A model with as many parameters as an object may hold (2,048: more than a 405B Llama-style model's
    1,137) is one region and one read; every tensor comes back with its name and bytes."""
    from gpuobj_contract.layouts import MAX_TENSORS

    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    gen = torch.Generator().manual_seed(7)
    sd = {f"model.layers.{i // 8}.p{i % 8}": torch.randn(3 + i % 5, generator=gen) for i in range(MAX_TENSORS)}
    before = registrations(src)
    pub.publish("big", sd)
    assert registrations(src) == before + 1
    got = unpack(pub.entries["big"], dst.fetch(src.endpoint, "big", token=TOKEN))
    assert list(got) == list(sd) and len(got) == MAX_TENSORS
    assert all(torch.equal(got[name], t) for name, t in sd.items())
    del got
    gc.collect()
    assert src.free("big")["freed"]
    settle(dst.stats)


def test_a_state_dict_laid_end_to_end_on_both_sides_is_read_as_one_descriptor(make_runtime):
    """The pack buffer lays tensors end to end, and a landing buffer does too when each is a multiple of
    64 bytes (most of a transformer's): the READ is one descriptor for all of them, not one a tensor,
    and every tensor still comes back with its bytes."""
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    gen = torch.Generator().manual_seed(11)
    sd = {f"model.layers.{i}.w": torch.randn(16, 4 + i % 3, generator=gen) for i in range(300)}  # 256-448 bytes
    pub.publish("sd", sd)
    reader = dst.agent.fetcher.reader
    posted, descriptors = reader.read_requests, reader.read_descriptors
    got = unpack(pub.entries["sd"], dst.fetch(src.endpoint, "sd", token=TOKEN))
    assert (reader.read_requests - posted, reader.read_descriptors - descriptors) == (1, 1)
    assert list(got) == list(sd) and all(torch.equal(got[name], t) for name, t in sd.items())
    del got
    gc.collect()
    assert src.free("sd")["freed"]
    settle(dst.stats)
