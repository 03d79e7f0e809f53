"""How long a claim may hold its object: its own spec.ttlSeconds, else its namespace's default ttl.

Why: a reader that hangs without a ttl keeps its claim, and the object it holds ``Releasing``, for as
long as its process lives. A platform team bounds that per namespace (``--namespace-claim-ttl
team-a=10m``, chart value ``claimTTL.namespaces``); the operator then treats a claim without a ttl
there as if it carried that one (same expiry, same requeue, Event ``Expired``). Also the age buckets
of ``gpuobj_claim_held_bytes``: how long the bytes a namespace's claims hold have been held.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuobj_operator.model import ClaimInfo

_DURATION = re.compile(r"^\s*(\d+)\s*([smh]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600}

# Upper bounds (seconds) and labels of gpuobj_claim_held_bytes{age}: read at a glance on a dashboard.
AGE_BUCKETS: tuple[tuple[float, str], ...] = ((600.0, "under_10m"), (3600.0, "10m_to_1h"), (float("inf"), "over_1h"))


def parse_duration(text: str) -> int:
    """`90`, `90s`, `10m`, `2h` -> seconds (a positive whole number)."""
    match = _DURATION.match(text)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"{text!r}: expected a positive duration such as 90s, 10m or 2h")
    return int(match.group(1)) * _UNIT[match.group(2)]


def parse_namespace_claim_ttl(text: str) -> tuple[str, int]:
    """`team-a=10m` -> ("team-a", 600), as the operator's `--namespace-claim-ttl` flag takes it."""
    namespace, sep, duration = text.partition("=")
    if not sep or not namespace.strip():
        raise ValueError(f"{text!r}: expected NAMESPACE=DURATION, e.g. team-a=10m")
    return namespace.strip(), parse_duration(duration)


@dataclass(frozen=True)
class ClaimTTLDefaults:
    """The default claim ttl (seconds) of each namespace a platform team named; others have none."""

    namespaces: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def effective(self, claim: ClaimInfo) -> int | None:
        """The ttl the operator enforces: the claim's own, else its namespace's default, else none."""
        return claim.ttl_seconds or self.namespaces.get(claim.namespace)


def age_bucket(created: dt.datetime | None, now: dt.datetime) -> str:
    """The age label of a claim created at ``created`` (unknown: the youngest, it was just seen)."""
    age = (now - created).total_seconds() if created else 0.0
    return next(label for bound, label in AGE_BUCKETS if age < bound)
