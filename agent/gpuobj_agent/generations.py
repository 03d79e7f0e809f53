"""Generations of NIXL agents: which agent takes new registrations, which are draining.

Why: destroying a NIXL agent is the only fence NIXL 1.5.1 offers against a reader that
still holds an old key (see fencing.py), so the pod's NIXL agent is replaced over time.
Exactly one generation is ACTIVE (new registrations go there); SEALED generations take
none, their live objects are moved to the active one, and once nothing is registered in
them and no ticket reads from them they are RETIRED (agent destroyed).

A PRIVATE generation serves one pooled region only (a weight-sync pack buffer, pooled.py): it never
takes other registrations, is never sealed or drained, and is retired by the free of the version in
it when a reader was handed its key, before the buffer is reused. Plain Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class GenState(enum.StrEnum):
    ACTIVE = "active"
    SEALED = "sealed"
    RETIRED = "retired"


YOUNG = "young"
TENURED = "tenured"
LANES = (YOUNG, TENURED)
PRIVATE = "private"  # one pooled region's own agent: in no lane, never active for other registrations


@dataclass
class Generation:
    gid: int
    name: str
    agent: Any  # the NixlAgent (opaque here so unit tests need no NIXL)
    created_at: float
    lane: str = YOUNG
    state: GenState = GenState.SEALED
    sealed_at: float | None = None
    retired_at: float | None = None
    migrated: set[str] = field(default_factory=set)  # objects moved out, whose registration here drains
    # A private spare's connection info alone (base64 NIXL partial metadata naming no region), announced to
    # readers before a version is registered in it (reads.py): set when the spare is made.
    announce: str | None = None


class GenerationTable:
    """All generations not yet retired, by id; names are `<base>.g<gid>`."""

    def __init__(self, base_name: str) -> None:
        self.base_name = base_name
        self._gens: dict[int, Generation] = {}
        self._next = 1
        self.active_gids: dict[str, int] = {}
        self.retired_count = 0  # lane agents retired: rotations
        self.private_retired = 0  # private agents retired: pooled regions fenced before their reuse

    def new_name(self) -> tuple[int, str]:
        gid = self._next
        self._next += 1
        return gid, f"{self.base_name}.g{gid}"

    def add(self, gen: Generation) -> None:
        self._gens[gen.gid] = gen

    def activate(self, gid: int, now: float, lane: str = YOUNG) -> Generation | None:
        """Make `gid` the active generation of `lane`; return the one it replaces (now sealed)."""
        old = self.active_in(lane)
        if old is not None:
            old.state = GenState.SEALED
            old.sealed_at = now
        gen = self._gens[gid]
        gen.state = GenState.ACTIVE
        gen.lane = lane
        self.active_gids[lane] = gid
        return old

    def add_private(self, gen: Generation) -> None:
        """A generation of its own for one pooled region: serving, in no lane, never sealed."""
        gen.lane = PRIVATE
        gen.state = GenState.ACTIVE
        self._gens[gen.gid] = gen

    def active_in(self, lane: str) -> Generation | None:
        gid = self.active_gids.get(lane)
        return self._gens.get(gid) if gid is not None else None

    @property
    def active(self) -> Generation | None:
        """The young lane's active generation: where new objects are registered."""
        return self.active_in(YOUNG)

    def get(self, gid: int) -> Generation:
        return self._gens[gid]

    def has(self, gid: int) -> bool:
        return gid in self._gens

    def sealed(self) -> list[Generation]:
        return [g for g in self._gens.values() if g.state == GenState.SEALED]

    def live(self) -> list[Generation]:
        return [g for g in self._gens.values() if g.state != GenState.RETIRED]

    def live_names(self) -> list[str]:
        return [g.name for g in self.live()]

    def retire(self, gid: int, now: float) -> Generation:
        gen = self._gens.pop(gid)
        gen.state = GenState.RETIRED
        gen.retired_at = now
        if gen.lane == PRIVATE:
            self.private_retired += 1
        else:
            self.retired_count += 1
        for lane, active in list(self.active_gids.items()):
            if active == gid:
                del self.active_gids[lane]
        return gen

    def __len__(self) -> int:
        return len(self._gens)
