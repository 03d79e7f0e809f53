"""The text patterns of gpuobj's names and ids: one home, the same strings as the CRD schemas' `pattern`s.

Why here: an object id, a stream name or a device is checked by the API server (the CRD schema), by
the agent (user input on its control API) and by the client before it sends anything. Each used to
carry its own copy, and the copies disagreed (a stream name the agent accepted, the API refused). A
unit test (tests/unit/contract/test_patterns.py) pins every pattern here to the `pattern` of each
CRD field that uses it, so the two cannot drift.

Matching is always `re.fullmatch`: with it, the `$` of a CRD pattern cannot let a trailing newline
through ("o-1\\n" is not an id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextPattern:
    """A CRD-style pattern (anchored with ^ and $) with the field's length bounds."""

    regex: str
    max_length: int
    min_length: int = 1
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.regex))

    def matches(self, text: object) -> bool:
        """True for a str within the length bounds that the pattern matches in full."""
        return (
            isinstance(text, str)
            and self.min_length <= len(text) <= self.max_length
            and self._compiled.fullmatch(text) is not None
        )


# A Kubernetes object name (DNS-1123 subdomain): pods, GPUObjects, claims, streams.
OBJECT_NAME = TextPattern(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", 253)
# A namespace name (DNS-1123 label): spec.sharedWith's items.
NAMESPACE = TextPattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", 63)
# The agent-side id of an object (spec.objectId); also read ids and claim names on the agent's routes.
OBJECT_ID = TextPattern(r"^[A-Za-z0-9._-]{1,128}$", 128)
# A hand-off claim's name on the agent's release route: the GPUObjectClaim's object name, which the client
# builds from the object's and the holder pod's names (up to 248 characters, more than an OBJECT_ID).
CLAIM_NAME = OBJECT_NAME
# A stream's name is its GPUObjectStream's object name (spec.stream.name of its items).
STREAM_NAME = OBJECT_NAME
# An agent process's incarnation (spec.source.incarnation, spec.holder.incarnation).
INCARNATION = TextPattern(r"^[A-Za-z0-9._-]*$", 64, min_length=0)
# Where a tensor lives: cpu, cuda or cuda:N.
DEVICE = TextPattern(r"^(cpu|cuda(:[0-9]{1,2})?)$", 7)
