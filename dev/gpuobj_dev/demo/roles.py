"""What each demo pod does, as ordinary client-library code (runs inside the pod's process).

The three pods form a small pipeline that ML platform teams will recognise: a producer
streams activations to a stage that transforms each and passes it on to a consumer,
while a weights object is shared with two readers (the transformer and the consumer).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def put_weights(client: Any, mib: int, name: str = "weights") -> tuple[Any, float]:
    """A weights tensor of ``mib`` MiB; returns the owner's handle and the checksum readers verify."""
    weights = torch.arange(mib * (1 << 18), dtype=torch.float32).remainder_(977.0)
    return client.put([weights], name=name, labels={"app": "gpuobj-demo"}), float(weights.sum())


def read_weights(client: Any, handle: Any, expected_sum: float) -> dict:
    """Fetch the shared weights with NIXL and verify them; report size and speed."""
    started = time.perf_counter()
    (weights,) = client.fetch(handle)
    seconds = time.perf_counter() - started
    ok = abs(float(weights.sum()) - expected_sum) < 1e-3 * max(1.0, abs(expected_sum))
    return {"bytes": weights.numel() * weights.element_size(), "seconds": seconds, "ok": ok}


def produce(client: Any, stream: str, items: int, kib: int) -> dict:
    """Emit ``items`` activations of ``kib`` KiB each, in order, then mark the end of the stream."""
    writer = client.stream_writer(stream)
    started = time.perf_counter()
    for i in range(items):
        writer.emit([torch.full((kib * 256,), float(i), dtype=torch.float32)])
    writer.close()
    return {"items": items, "seconds": time.perf_counter() - started}


def transform(client: Any, source: str, target: str) -> dict:
    """Read each item, transform it (x * 2 + 1) and pass it on; every input item is released once read."""
    writer = client.stream_writer(target)
    count, moved, started = 0, 0, time.perf_counter()
    for (item,) in client.read_stream(source):
        writer.emit([item * 2 + 1])
        count += 1
        moved += item.numel() * item.element_size()
    writer.close()
    return {"items": count, "bytes": moved, "seconds": time.perf_counter() - started}


def consume(client: Any, stream: str) -> dict:
    """Read the transformed items in order and check each one (item i holds 2i + 1 everywhere)."""
    count, moved, wrong, started = 0, 0, 0, time.perf_counter()
    for i, (item,) in enumerate(client.read_stream(stream)):
        if not bool((item == 2 * i + 1).all()):
            wrong += 1
        count += 1
        moved += item.numel() * item.element_size()
    return {"items": count, "bytes": moved, "wrong": wrong, "seconds": time.perf_counter() - started}
