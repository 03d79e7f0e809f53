"""Shards: several operators share one cluster by namespace, each acting on the namespaces of its shard.

Why by namespace: every fact a free depends on (the object, its claims, its source pod's agent) lives
in one namespace, so a namespace in exactly one shard, and a shard held by at most one replica (its
own Lease), means two replicas never act on one object. A namespace's shard goes through its bucket
(gpuobj_contract.shard_buckets: sha256, not Python's per-process salted hash(), so every replica and
every restart agree), and the same buckets make the shard's label selector: what the API server sends
a shard and what the shard acts on are one rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuobj_contract.names import LABEL_SHARD_BUCKET
from gpuobj_contract.shard_buckets import BUCKETS, bucket_of


def shard_of(namespace: str, count: int) -> int:
    """The shard (0 .. count-1) that acts on ``namespace``: the same in every process and release."""
    if not 1 <= count <= BUCKETS:
        raise ValueError(f"shard count must be in 1..{BUCKETS}, not {count}")
    return bucket_of(namespace) % count


@dataclass(frozen=True)
class Shard:
    """This replica's shard: ``index`` of ``count``. The default (0 of 1) owns every namespace."""

    count: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.count <= BUCKETS:
            raise ValueError(f"shard count must be in 1..{BUCKETS} (one bucket at least each), not {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be in 0..{self.count - 1} (count {self.count}), not {self.index}")

    def owns(self, namespace: str | None) -> bool:
        """Whether this replica acts on what lives in ``namespace`` (cluster-scoped: never sharded)."""
        return self.count == 1 or namespace is None or bucket_of(namespace) % self.count == self.index

    def buckets(self) -> tuple[int, ...]:
        """The buckets whose namespaces this shard owns."""
        return tuple(b for b in range(BUCKETS) if b % self.count == self.index)

    def selector(self) -> str | None:
        """The label selector of the objects labelled for this shard; None with one shard (it takes all)."""
        if self.count == 1:
            return None
        return f"{LABEL_SHARD_BUCKET} in ({','.join(map(str, self.buckets()))})"

    def lease_name(self, base: str) -> str:
        """The Lease the shard's replicas elect a leader on; one shard keeps the unsharded name (upgrades)."""
        return base if self.count == 1 else f"{base}-shard-{self.index}"


UNLABELLED_SELECTOR = f"!{LABEL_SHARD_BUCKET}"  # what no writer labelled (a user's kubectl apply): every shard
