"""A raw NIXL READ of pre-registered memory between two processes: the floor a fetch is compared with.

Why: "how fast is gpuobj" only means something next to the wire itself on the same machine in the
same run. A source registers a buffer once; a reader in another process registers its landing
buffer once, loads the source's metadata once and times READs of the same bytes: no object, no
grant, no agent, no pack. The demo's weight-sync step and the benchmarks quote their per-version
times against pack + one such READ.
"""

from __future__ import annotations

import time

import torch

from gpuobj_agent.nixl_transport import NixlAgent, Span, region_of


class RawSource:
    """The source side: `nbytes` of ones registered with a NIXL agent of its own, until `close`."""

    def __init__(self, nbytes: int, name: str = "raw-floor-src") -> None:
        self.agent = NixlAgent(name)
        self.buffer = torch.ones(nbytes, dtype=torch.uint8)
        key = region_of(self.buffer)
        assert key is not None, "a raw source needs at least one byte"
        self.key = key
        self.agent.register([self.key])

    def offer(self) -> tuple[bytes, Span]:
        """What a reader needs: the agent's metadata for the region and the span to read."""
        span = Span.of(self.buffer)
        assert span is not None
        return self.agent.partial_metadata([self.key]), span

    def close(self) -> None:
        self.agent.deregister([self.key])
        self.agent.close()


def read_seconds(metadata: bytes, span: Span, reads: int, timeout: float = 120.0) -> list[float]:
    """Time `reads` READs of `span` into a pre-registered buffer (connection made before the first).

    Verifies the bytes arrived (the source holds ones), so a floor is never a transfer that did nothing.
    """
    agent = NixlAgent("raw-floor-dst")
    dst = torch.zeros(span.nbytes, dtype=torch.uint8)
    key = region_of(dst)
    assert key is not None
    agent.register([key])
    try:
        name = agent.load_remote(metadata)
        agent.read(name, [span], [dst], deadline=time.monotonic() + timeout, registered=True)  # connects
        times = []
        for _ in range(reads):
            dst.zero_()
            started = time.monotonic()
            agent.read(name, [span], [dst], deadline=time.monotonic() + timeout, registered=True)
            times.append(time.monotonic() - started)
        if not bool(dst[:: max(1, span.nbytes // 4096)].eq(1).all()):
            raise AssertionError("raw NIXL READ: the bytes read are not the source's")
        return times
    finally:
        agent.deregister([key])
        agent.close()
