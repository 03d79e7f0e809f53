"""Weight sync on CUDA: a trainer's state dict packed into one VRAM region, fetched into VRAM by a rollout
agent, loaded into the rollout's model; the rollout's logits equal the trainer's bit for bit, version after
version, each version reusing its pack buffer (tests/integration/agent/test_weight_sync.py over VRAM).

The model is a small decoder built from torch layers only (embeddings tied to the output layer, attention,
MLP, norms, bfloat16): the GPU image has no `transformers` and nothing can be installed there from the
network, so gpuobj_dev.models (Qwen2 from transformers) cannot be built on it.
"""

from __future__ import annotations

import gc
import time

import torch
from torch import nn

from gpuobj.client.state_dicts import unpack

from ..integration.agent.conftest import TOKEN
from ..integration.agent.test_weight_sync import Publisher
from .conftest import DEVICE, settle, synchronize

VERSIONS = 5


class TinyDecoder(nn.Module):
    """Two pre-norm transformer blocks over a 512-token vocabulary; the output layer tied to the embeddings."""

    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def model(seed: int) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder().to(DEVICE, torch.bfloat16).eval()


def logits(m: TinyDecoder) -> torch.Tensor:
    ids = torch.arange(64, device=DEVICE).reshape(2, 32) * 7 % 512
    with torch.no_grad():
        out = m(ids)
    synchronize()
    return out


def test_rollout_logits_equal_the_trainers_bit_for_bit_version_after_version(make_runtime, record_property):
    trainer_agent, rollout_agent = make_runtime("trainer"), make_runtime("rollout")
    trainer, rollout = model(1), model(2)  # different weights until the first sync
    pub = Publisher(trainer_agent)
    per_version = []
    for version in range(1, VERSIONS + 1):
        with torch.no_grad():  # a training step's worth of change
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        oid = f"policy-v{version}"
        started = time.perf_counter()
        pub.publish(oid, trainer.state_dict())
        got = unpack(pub.entries[oid], rollout_agent.fetch(trainer_agent.endpoint, oid, device=DEVICE, token=TOKEN))
        rollout.load_state_dict(got)
        synchronize()
        per_version.append(time.perf_counter() - started)
        assert all(t.device == torch.device(DEVICE) for t in got.values())
        assert got["head.weight"] is got["embed.weight"]  # tied: stored once, restored tied
        a, b = logits(trainer), logits(rollout)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"version {version}: logits differ"
        del got
        gc.collect()
        assert trainer_agent.free(oid)["freed"]
    nbytes = sum(t.nbytes for t in trainer.state_dict().values())
    device = torch.cuda.get_device_name(0) if DEVICE != "cpu" else "cpu"
    print(f"\nweight sync on {device}: {nbytes} B per version, seconds {per_version}")
    record_property("weight_sync_bytes", nbytes)
    record_property("weight_sync_seconds_per_version", [round(s, 4) for s in per_version])
    assert pub.pool.stats()["reused"] == VERSIONS - 1  # each version took the buffer the one before left
    settle(rollout_agent.stats)
