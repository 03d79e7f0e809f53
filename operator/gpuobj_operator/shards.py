"""Shards: several operators share one cluster by namespace, each acting on the namespaces of its shard.

Why by namespace: every fact a free depends on (the object, its claims, its source pod's agent) lives
in one namespace, so a namespace in exactly one shard, and a shard held by at most one replica (its
own Lease), means two replicas never act on one object. The hash is sha256, not Python's hash(): that
one is salted per process, and every replica (and every restart) must agree on where a namespace goes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def shard_of(namespace: str, count: int) -> int:
    """The shard (0 .. count-1) that acts on ``namespace``: the same in every process and release."""
    if count < 1:
        raise ValueError(f"shard count must be at least 1, not {count}")
    digest = hashlib.sha256(namespace.encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


@dataclass(frozen=True)
class Shard:
    """This replica's shard: ``index`` of ``count``. The default (0 of 1) owns every namespace."""

    count: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be in 0..{self.count - 1} (count {self.count}), not {self.index}")

    def owns(self, namespace: str | None) -> bool:
        """Whether this replica acts on what lives in ``namespace`` (cluster-scoped: never sharded)."""
        return self.count == 1 or namespace is None or shard_of(namespace, self.count) == self.index

    def lease_name(self, base: str) -> str:
        """The Lease the shard's replicas elect a leader on; one shard keeps the unsharded name (upgrades)."""
        return base if self.count == 1 else f"{base}-shard-{self.index}"
