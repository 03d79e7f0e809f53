"""The registrations ledger: which memory regions each NIXL agent has registered, for whom.

Why it exists (NIXL 1.5.1 on UCX, measured): registering a region twice is accepted and
counted twice, a deregister list naming a region twice segfaults, a second deregister
raises NOT_FOUND, and a remote reader that loaded a region's key rejects a second,
different key for the same region (NIXL_ERR_NOT_ALLOWED). So the agent never asks NIXL
to register a region that agent already has, never deregisters what it does not hold,
and never registers a region again in an agent that deregistered it after a reader saw
its key. This ledger decides all of that in plain Python; its one caller, nixl_state.py (the
writer of placement), does the NIXL calls it prescribes.

The unit is a whole tensor storage (one allocation): tensors that share a storage share
one registration, reference-counted by owner (object id). A region is "exposed" once a
read ticket has handed its key to a reader; freeing an exposed region needs a fence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


class RegionKey(NamedTuple):
    """One registered allocation: NIXL memory type ("DRAM"/"VRAM"), device id, address, length."""

    mem: str
    dev: int
    addr: int
    nbytes: int


class LedgerError(RuntimeError):
    """The caller broke the ledger's protocol (a bug, never user input)."""


class RegionReused(LedgerError):
    """The region was registered and deregistered in this agent before; use a newer agent."""


@dataclass
class _Entry:
    owners: set[str] = field(default_factory=set)
    exposed: bool = False


@dataclass
class Released:
    """What releasing an owner from one agent left the caller to do."""

    deregister: list[RegionKey]
    exposed: bool  # some region that is no longer registered had been handed to a reader


class RegistrationLedger:
    """Regions per NIXL agent (generation id), their owners, and register/deregister counts."""

    def __init__(self) -> None:
        self._gens: dict[int, dict[RegionKey, _Entry]] = {}
        # Exposed regions an agent has deregistered: a reader may hold their old key, so never again there.
        self._once: dict[int, set[RegionKey]] = {}
        self._by_owner: dict[str, dict[int, set[RegionKey]]] = {}
        self.registrations = 0
        self.deregistrations = 0
        self.registered_bytes = 0

    # -- generations -------------------------------------------------------------------
    def add_generation(self, gid: int) -> None:
        if gid in self._gens:
            raise LedgerError(f"generation {gid} already in the ledger")
        self._gens[gid] = {}
        self._once[gid] = set()

    def drop_generation(self, gid: int) -> None:
        """Forget an agent that is being destroyed; it must hold nothing."""
        if self._gens.get(gid):
            raise LedgerError(f"generation {gid} still holds {len(self._gens[gid])} registrations")
        self._gens.pop(gid, None)
        self._once.pop(gid, None)

    def generations(self) -> list[int]:
        return list(self._gens)

    def count(self, gid: int) -> int:
        return len(self._gens.get(gid, ()))

    def total(self) -> int:
        return sum(len(regions) for regions in self._gens.values())

    # -- owners ------------------------------------------------------------------------
    def acquire(self, gid: int, keys: Iterable[RegionKey], owner: str) -> list[RegionKey]:
        """Record that `owner` uses `keys` in agent `gid`; return the keys the caller must register.

        Nothing is recorded if a key was exposed and deregistered in this agent before (RegionReused).
        If the NIXL call then fails, the caller undoes this with `rollback`.
        """
        regions = self._gens[gid]
        wanted = list(dict.fromkeys(keys))
        reused = [k for k in wanted if k in self._once[gid] and k not in regions]
        if reused:
            raise RegionReused(f"region {reused[0]} was registered in generation {gid} before")
        new: list[RegionKey] = []
        mine = self._by_owner.setdefault(owner, {}).setdefault(gid, set())
        for key in wanted:
            entry = regions.get(key)
            if entry is None:
                entry = regions[key] = _Entry()
                new.append(key)
            entry.owners.add(owner)
            mine.add(key)
        self.registrations += len(new)
        self.registered_bytes += sum(k.nbytes for k in new)
        return new

    def rollback(self, gid: int, new_keys: Iterable[RegionKey], owner: str) -> None:
        """Undo an `acquire` whose NIXL registration failed (those keys were never registered)."""
        regions = self._gens[gid]
        for key in new_keys:
            regions.pop(key, None)
            self.registrations -= 1
            self.registered_bytes -= key.nbytes
        owned = self._by_owner.get(owner, {})
        keys = owned.pop(gid, set())
        for key in keys:
            entry = regions.get(key)
            if entry is not None:
                entry.owners.discard(owner)
        if not owned:
            self._by_owner.pop(owner, None)

    def owner_generations(self, owner: str) -> list[int]:
        return list(self._by_owner.get(owner, {}))

    def keys_of(self, gid: int, owner: str) -> list[RegionKey]:
        return sorted(self._by_owner.get(owner, {}).get(gid, ()))

    def owners(self, gid: int) -> set[str]:
        return {o for entry in self._gens.get(gid, {}).values() for o in entry.owners}

    def release(self, gid: int, owner: str, *, park_exposed: bool = False, park_all: bool = False) -> Released:
        """Drop `owner` from agent `gid`; return the regions nobody uses any more (to deregister).

        ``park_exposed``: an exposed region nobody uses stays registered ("parked") until its agent is
        retired (the fence deregisters it, `parked`), instead of being deregistered now. A reader may
        hold its key, and NIXL refuses a second key for the same region, so deregistering it would
        force the next put of the same memory (a persistent tensor put again) into a newer agent.
        Parked, the same key serves the next put: no new registration, no rotation. A stale reader
        can reach the memory until the fence either way (deregistration fences nobody: fencing.py),
        and the quarantine keeps it from being released before then.

        ``park_all``: park every region nobody uses, exposed or not: pooled memory its owner reuses for the
        next object (a weight-sync pack buffer), whose next put then needs no registration."""
        keys = self._by_owner.get(owner, {}).pop(gid, set())
        if owner in self._by_owner and not self._by_owner[owner]:
            del self._by_owner[owner]
        regions = self._gens.get(gid, {})
        out: list[RegionKey] = []
        exposed = False
        for key in sorted(keys):
            entry = regions[key]
            entry.owners.discard(owner)
            if not entry.owners:
                exposed = exposed or entry.exposed
                if not (park_all or (park_exposed and entry.exposed)):
                    out.append(key)
        return Released(out, exposed)

    def parked(self, gid: int) -> list[RegionKey]:
        """Registered regions of agent `gid` that nobody uses: the fence deregisters them."""
        return sorted(k for k, e in self._gens.get(gid, {}).items() if not e.owners)

    def deregistered(self, gid: int, keys: Iterable[RegionKey]) -> None:
        """The caller deregistered `keys` from agent `gid` (each exactly once)."""
        regions = self._gens[gid]
        for key in keys:
            entry = regions.get(key)
            if entry is None or entry.owners:
                raise LedgerError(f"deregistering {key} from generation {gid}, which is not releasable")
            del regions[key]
            if entry.exposed:
                self._once[gid].add(key)
            self.deregistrations += 1
            self.registered_bytes -= key.nbytes

    # -- exposure ----------------------------------------------------------------------
    def expose(self, gid: int, keys: Iterable[RegionKey]) -> None:
        """A reader was handed these regions' keys: freeing them now needs a fence."""
        regions = self._gens[gid]
        for key in keys:
            regions[key].exposed = True

    def keys_in(self, gid: int) -> list[RegionKey]:
        return list(self._gens.get(gid, {}))

    def exposed(self, gid: int, key: RegionKey) -> bool:
        entry = self._gens.get(gid, {}).get(key)
        return bool(entry and entry.exposed)

    def balanced(self) -> bool:
        return self.registrations == self.deregistrations and self.total() == 0
