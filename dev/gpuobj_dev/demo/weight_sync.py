"""The demo's weight-sync scene, as ordinary client-library code (runs inside the pods' processes).

A trainer pod publishes a real model's weights (a Qwen2 architecture built by transformers from a
config, randomly initialised) after every training step; two rollout pods fetch each version, load
it into their own copy of the architecture (initialised with another seed, so every weight they use
came over NIXL), run a forward pass on a fixed input and report a checksum of their logits, which
must equal the trainer's bit for bit. The pattern is docs/weight-sync.md: one GPUObject per
version, a claim per rollout, the trainer's own reference dropped once the next version is out,
each rollout releasing the version before once it holds the new one. Each side also times its part
(the trainer's put, each rollout's fetch) and offers a raw NIXL READ of the same bytes, the floor the
demo prints each version's time against.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuobj_dev import models, raw_nixl


def logits_checksum(model: Any) -> int:
    """A checksum of every byte of the model's logits on the fixed input."""
    with torch.no_grad():
        logits = model(models.fixed_input(model)).logits
    return models.checksum({"logits": logits}, stride=1)


class Trainer:
    """The trainer pod: a model, one training step per version, and its reference to the latest version."""

    def __init__(self, client: Any, size: str) -> None:
        self.client = client
        self.model = models.build(size, seed=0)
        self.current: Any = None
        self.raw: raw_nixl.RawSource | None = None

    def publish(self, version: int, rollouts: list[str]) -> dict:
        """Step, put the state dict (one object), share it with each rollout, drop our previous version."""
        from gpuobj.client.state_dicts import plan

        models.step(self.model, version)
        sd = self.model.state_dict()
        started = time.perf_counter()
        ref = self.client.put(sd, name=f"policy-v{version}", labels={"app": "gpuobj-demo"})
        put_s = time.perf_counter() - started
        shares = {name: self.client.share(ref, name) for name in rollouts}
        self.client.flush()  # recorded now, so `kubectl get gpuobj` shows it (write-behind elides brief objects)
        old, self.current = self.current, ref
        if old is not None:
            old.release()
        return {
            "shares": shares,
            "logits": logits_checksum(self.model),
            "bytes": plan(sd).nbytes,
            "tensors": len(sd),
            "pack": self.client.pack_stats(),
            "put_s": put_s,
        }

    def raw_offer(self) -> tuple[bytes, Any]:
        """A raw NIXL source of as many bytes as one version (the floor's READ), until `finish`."""
        from gpuobj.client.state_dicts import plan

        self.raw = raw_nixl.RawSource(plan(self.model.state_dict()).nbytes, name="demo-raw-src")
        return self.raw.offer()

    def raw_close(self) -> None:
        if self.raw is not None:
            self.raw.close()
            self.raw = None

    def finish(self) -> None:
        if self.current is not None:
            self.current.release()
            self.current = None
        self.raw_close()
        self.client.flush()


class Rollout:
    """A rollout pod: its own copy of the architecture, fed only with the weights it fetches."""

    def __init__(self, client: Any, size: str) -> None:
        self.client = client
        self.model = models.build(size, seed=1)  # other weights: what it computes with must come from the trainer
        self.held: Any = None

    def take(self, shared: Any) -> dict:
        """Adopt the claim on the new version, fetch it, load it, release the version before.

        Returns the logits' checksum and the fetch's seconds (NIXL READ included, the load excluded).
        """
        handle = self.client.adopt(shared)
        started = time.perf_counter()
        sd = self.client.fetch(handle)
        fetch_s = time.perf_counter() - started
        self.model.load_state_dict(sd)
        old, self.held = self.held, handle
        if old is not None:
            old.release()
        return {"logits": logits_checksum(self.model), "fetch_s": fetch_s}

    def raw_read(self, offer: tuple[bytes, Any], reads: int = 3) -> list[float]:
        """Seconds of `reads` raw NIXL READs of the trainer's raw source (the floor's read)."""
        return raw_nixl.read_seconds(*offer, reads=reads)

    def finish(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None
        self.client.flush()
