"""Sharded pulls over real NIXL between two agents in this process: each tensor-parallel rank reads its
slice of every tensor (along dim 0 and along dim 1) as one READ request of exactly those bytes, and gets
torch.chunk(source, tp, dim)[rank]; by names, only the named tensors. The pure span computation is
tests/unit/client/test_shards.py; the client's fetch(select=...) against an API server is
tests/e2e/operator/test_weight_sync.py."""

from __future__ import annotations

import pytest
import torch

from gpuobj.client.shards import Shard, pieces, selected_bytes
from gpuobj.client.state_dicts import plan, unpack
from gpuobj_agent.layouts import layout_of

from .conftest import TOKEN
from .test_weight_sync import Publisher

pytestmark = pytest.mark.nixl

TP = 2


def model(seed: int) -> dict[str, torch.Tensor]:
    """Every tensor splits evenly in two along dims 0 and 1; several dtypes, a tied pair."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    sd = {"embed.weight": embed}
    for layer in range(4):
        sd[f"layers.{layer}.qkv"] = torch.randn(96, 32, generator=gen)
        sd[f"layers.{layer}.out"] = torch.randn(32, 48, generator=gen).to(torch.float16)
        sd[f"layers.{layer}.conv"] = torch.randint(-100, 100, (4, 6, 3), generator=gen, dtype=torch.int32)
    sd["lm_head.weight"] = embed
    return sd


def in_bytes(rt) -> float:
    return rt.agent.metrics.transfer_bytes.labels(direction="in")._value.get()


@pytest.mark.parametrize("dim", [0, 1])
def test_each_tp_rank_reads_its_half_of_every_tensor_as_one_read_of_half_the_bytes(make_runtime, dim):
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    sd = model(dim)
    pub.publish("v1", sd)
    entries = pub.entries["v1"]
    distinct = {id(t): t for t in sd.values()}
    full = sum(t.nbytes for t in distinct.values())
    stored = [layout_of(t) for t in plan(sd).sources]  # what the client's address carries (spec.tensors)
    reader = dst.agent.fetcher.reader
    moved = 0
    for rank in range(TP):
        select, named = pieces(stored, entries, Shard(dim=dim, index=rank, count=TP))
        requests, wire, counted = reader.read_requests, reader.read_bytes, in_bytes(dst)
        got = unpack(tuple(named), dst.fetch(src.endpoint, "v1", token=TOKEN, select=select))
        assert reader.read_requests - requests == 1  # every run of every tensor in one NIXL request
        assert reader.read_bytes - wire == selected_bytes(select) == full // TP
        assert in_bytes(dst) - counted == full // TP
        moved += reader.read_bytes - wire
        assert list(got) == list(sd)
        for name, t in sd.items():
            want = torch.chunk(t, TP, dim)[rank]
            assert got[name].shape == want.shape and got[name].dtype == t.dtype, name
            assert torch.equal(got[name], want), name
        assert got["lm_head.weight"] is got["embed.weight"]  # tied: read once
    assert moved == full


def test_a_reader_of_some_names_moves_only_their_bytes(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    sd = model(7)
    pub.publish("v1", sd)
    stored = [layout_of(t) for t in plan(sd).sources]
    wanted = ["layers.1.qkv", "layers.3.out"]
    select, named = pieces(stored, pub.entries["v1"], Shard(names=wanted, dim=1, index=1, count=TP))
    wire = dst.agent.fetcher.reader.read_bytes
    got = unpack(tuple(named), dst.fetch(src.endpoint, "v1", token=TOKEN, select=select))
    assert dst.agent.fetcher.reader.read_bytes - wire == (sd[wanted[0]].nbytes + sd[wanted[1]].nbytes) // TP
    assert sorted(got) == sorted(wanted)
    for name in wanted:
        assert torch.equal(got[name], torch.chunk(sd[name], TP, 1)[1])
