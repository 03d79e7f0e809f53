"""Shard buckets: the label that lets each operator shard watch only its own namespaces' objects.

Why a label: a client-side filter still makes every shard receive, decode and drop every other shard's
events. The API server can select by label but not by a hash of the namespace, so every GPUObject,
claim and stream carries ``gpuobj.io/shard-bucket``: a bucket (0 .. BUCKETS-1) derived from its
namespace alone, the same in every process and release (sha256, never Python's salted ``hash()``).
A shard of ``count`` owns the buckets ``b`` with ``b % count == index`` and watches them with one
``in (...)`` selector, so the shard count is at most BUCKETS. Writers set the label; the operator
corrects a missing or wrong one (docs/scale.md, Several operators).
"""

from __future__ import annotations

import hashlib

from gpuobj_contract.names import LABEL_SHARD_BUCKET

BUCKETS = 256  # the most shards one cluster can have; a power of two, so shard_of(ns, 2**k) never moved


def bucket_of(namespace: str) -> int:
    """The bucket of everything in ``namespace``. For a shard count that divides BUCKETS this picks the
    same shard as the first releases' ``sha256 % count`` (the low byte of the same 64-bit prefix)."""
    digest = hashlib.sha256(namespace.encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def bucket_labels(namespace: str) -> dict[str, str]:
    """The label a writer puts on a GPUObject, claim or stream it creates in ``namespace``."""
    return {LABEL_SHARD_BUCKET: str(bucket_of(namespace))}
