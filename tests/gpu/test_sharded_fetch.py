"""Sharded pulls over VRAM: each TP rank reads its half of every tensor of a CUDA state dict, along dim 0 and
dim 1, into VRAM, as one READ request of half the bytes (tests/integration/agent/test_sharded_fetch.py over
host memory)."""

from __future__ import annotations

import pytest
import torch

from gpuobj.client.shards import Shard, pieces
from gpuobj.client.state_dicts import plan, unpack
from gpuobj_agent.layouts import layout_of

from ..integration.agent.conftest import TOKEN
from ..integration.agent.test_sharded_fetch import TP, model
from ..integration.agent.test_weight_sync import Publisher
from .conftest import DEVICE, synchronize


@pytest.mark.parametrize("dim", [0, 1])
def test_each_tp_rank_reads_its_half_into_vram_as_one_read_of_half_the_bytes(make_runtime, dim):
    src, dst = make_runtime("src"), make_runtime("dst")
    pub = Publisher(src)
    sd = {name: t.to(DEVICE) for name, t in model(dim).items()}
    sd["lm_head.weight"] = sd["embed.weight"]  # tied again on the device
    pub.publish("v1", sd)
    stored = [layout_of(t) for t in plan(sd).sources]
    full = sum({id(t): t.nbytes for t in sd.values()}.values())
    reader = dst.agent.fetcher.reader
    for rank in range(TP):
        select, named = pieces(stored, pub.entries["v1"], Shard(dim=dim, index=rank, count=TP))
        requests, wire = reader.read_requests, reader.read_bytes
        got = unpack(tuple(named), dst.fetch(src.endpoint, "v1", device=DEVICE, token=TOKEN, select=select))
        synchronize()
        assert reader.read_requests - requests == 1 and reader.read_bytes - wire == full // TP
        for name, t in sd.items():
            assert got[name].device == torch.device(DEVICE), name
            assert torch.equal(got[name], torch.chunk(t, TP, dim)[rank]), name
