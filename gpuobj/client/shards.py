"""Sharded pulls: which bytes of an object a reader needs, as (offset, length) runs per tensor.

Why: a tensor-parallel reader needs 1/tp of each weight, and a reader of part of a model only some
names; reading the whole region and slicing moves tp times the bytes. `pieces` turns a selection
into plain data the agent reads as ONE NIXL transfer (one descriptor per run, into tensors of the
sliced shapes), so the bytes moved are exactly the bytes selected. A slice along dim 0 of a packed
(contiguous) tensor is one run; along dim d > 0 it is prod(shape[:d]) runs of
(shape[d] / count) * prod(shape[d+1:]) elements; runs that touch are merged. Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gpuobj.client.errors import InvalidRequestError
from gpuobj_contract.layouts import TensorLayout

# What the agent reads for one output tensor: (index of the stored tensor, output shape,
# runs of (byte offset within the stored tensor, byte length), in the output's order).
Piece = tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class Shard:
    """What to fetch of an object: `names` (a state dict's; None: all), and of each tensor the
    `index`-th of `count` equal slices along `dim` (None: whole tensors). Uneven division is refused
    (torch.chunk would hand ranks different sizes); a tensor with fewer dimensions than `dim`+1
    (a bias or a norm's weight under a column slice) is refused too: select it by names apart."""

    names: Collection[str] | None = None
    dim: int | None = None
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.names, str):
            raise InvalidRequestError("Shard(names=...) takes a collection of names, not one string")
        if self.names is not None:
            object.__setattr__(self, "names", tuple(self.names))
        if not isinstance(self.count, int) or self.count < 1:
            raise InvalidRequestError(f"Shard(count={self.count!r}): count must be an int >= 1")
        if not isinstance(self.index, int) or not 0 <= self.index < self.count:
            raise InvalidRequestError(f"Shard(index={self.index!r}): index must be in [0, count={self.count})")
        if self.dim is not None and (not isinstance(self.dim, int) or self.dim < 0):
            raise InvalidRequestError(f"Shard(dim={self.dim!r}): dim must be an int >= 0 or None")


def _runs(layout: TensorLayout, shard: Shard, name: str) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """The sliced shape and the byte runs of one stored (contiguous) tensor."""
    size = layout.itemsize
    if shard.dim is None or shard.count == 1:
        return layout.shape, [(0, layout.nbytes)] if layout.nbytes else []
    d = shard.dim
    if d >= len(layout.shape):
        raise InvalidRequestError(
            f"fetch: cannot slice {name!r} (shape {list(layout.shape)}) along dim {d}: it has "
            f"{len(layout.shape)} dimension(s); select it apart by names"
        )
    extent = layout.shape[d]
    if extent % shard.count:
        raise InvalidRequestError(
            f"fetch: {name!r} (shape {list(layout.shape)}) does not split evenly into {shard.count} "
            f"along dim {d} ({extent} % {shard.count} != 0)"
        )
    part = extent // shard.count
    shape = (*layout.shape[:d], part, *layout.shape[d + 1 :])
    inner = math.prod(layout.shape[d + 1 :]) * size  # bytes of one step along d
    run = part * inner
    first = shard.index * run
    runs: list[tuple[int, int]] = []
    for outer in range(math.prod(layout.shape[:d])):
        off = outer * extent * inner + first
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)  # touching runs: one descriptor
        elif run:
            runs.append((off, run))
    return shape, runs


def pieces(
    layouts: Sequence[TensorLayout], entries: Sequence[tuple[str, int]], shard: Shard
) -> tuple[list[Piece], list[tuple[str, int]]]:
    """What to read for `shard`, and the (name, output index) entries of the result.

    A list object (no entries) names its tensors "0", "1", ...; tied names share one output."""
    named = list(entries) if entries else [(str(i), i) for i in range(len(layouts))]
    if shard.names is not None:
        known = {n for n, _ in named}
        missing = sorted(set(shard.names) - known)
        if missing:
            shown = ", ".join(repr(n) for n in missing[:10]) + (
                f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            )
            raise InvalidRequestError(f"fetch: the object has no tensor named {shown}")
        wanted = set(shard.names)
        named = [(n, i) for n, i in named if n in wanted]
    out: list[Piece] = []
    index_of: dict[int, int] = {}
    result: list[tuple[str, int]] = []
    for name, stored in named:
        if stored not in index_of:
            shape, runs = _runs(layouts[stored], shard, name)
            index_of[stored] = len(out)
            out.append((stored, shape, tuple(runs)))
        result.append((name, index_of[stored]))
    return out, result


def selected_bytes(piece_list: Sequence[Piece]) -> int:
    """The bytes a selection moves (what the reader's transfer counter adds)."""
    return sum(n for _, _, runs in piece_list for _, n in runs)
