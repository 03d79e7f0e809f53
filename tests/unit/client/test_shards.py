"""Sharded pulls, the pure part: which byte runs of each stored tensor a Shard selects (gpuobj.client.shards).
The reads themselves, over real NIXL, are tests/integration/agent/test_sharded_fetch.py."""

from __future__ import annotations

import pytest

from gpuobj.client.errors import GpuObjError, InvalidRequestError
from gpuobj.client.shards import Shard, pieces, selected_bytes
from gpuobj_contract.layouts import TensorLayout


def lay(*shape: int, dtype: str = "float32") -> TensorLayout:
    return TensorLayout(tuple(shape), dtype, "cpu")


LAYOUTS = (lay(4, 6), lay(6), lay(2, 4, 3, dtype="bfloat16"))
ENTRIES = (("w", 0), ("bias", 1), ("conv", 2), ("w_tied", 0))


def test_no_slice_selects_whole_tensors_by_name_and_tied_names_share_one_read():
    got, named = pieces(LAYOUTS, ENTRIES, Shard(names=["w", "w_tied", "conv"]))
    assert got == [(0, (4, 6), ((0, 96),)), (2, (2, 4, 3), ((0, 48),))]
    assert named == [("w", 0), ("conv", 1), ("w_tied", 0)]
    assert selected_bytes(got) == 96 + 48


def test_dim_0_is_one_run_per_tensor():
    got, _ = pieces(LAYOUTS, ENTRIES, Shard(names=["w", "bias"], dim=0, index=1, count=2))
    assert got == [(0, (2, 6), ((48, 48),)), (1, (3,), ((12, 12),))]


def test_dim_1_is_one_strided_run_per_row():
    got, _ = pieces(LAYOUTS, ENTRIES, Shard(names=["w"], dim=1, index=1, count=3))
    # rows of 6 floats (24 bytes); rank 1 of 3 takes columns 2..3: bytes 8..15 of each row
    assert got == [(0, (4, 2), ((8, 8), (32, 8), (56, 8), (80, 8)))]
    assert selected_bytes(got) == 96 // 3


def test_a_middle_dim_counts_rows_over_the_leading_dims_and_keeps_the_trailing_ones():
    got, _ = pieces(LAYOUTS, ENTRIES, Shard(names=["conv"], dim=1, index=0, count=2))
    # shape (2, 4, 3) bf16: 2 outer steps, each 4*3*2 = 24 bytes; rank 0 takes the first 12 of each
    assert got == [(2, (2, 2, 3), ((0, 12), (24, 12)))]


def test_touching_runs_merge_into_one():
    # a slice along a dim whose leading dims are all 1 is contiguous: one descriptor, not one per row
    got, _ = pieces((lay(1, 1, 8, 2),), (("x", 0),), Shard(dim=2, index=1, count=2))
    assert got == [(0, (1, 1, 4, 2), ((32, 32),))]
    # count=1 reads whole tensors
    got, _ = pieces((lay(3, 8),), (("x", 0),), Shard(dim=1, count=1))
    assert got == [(0, (3, 8), ((0, 96),))]


def test_a_list_object_names_its_tensors_by_position():
    got, named = pieces((lay(4), lay(2, 2)), (), Shard(names=["1"], dim=0, index=0, count=2))
    assert got == [(1, (1, 2), ((0, 8),))] and named == [("1", 0)]


def test_unknown_names_uneven_splits_and_too_few_dims_are_refused_naming_what():
    with pytest.raises(InvalidRequestError, match=r"no tensor named 'nope', 'zzz'"):
        pieces(LAYOUTS, ENTRIES, Shard(names=["w", "zzz", "nope"]))
    with pytest.raises(InvalidRequestError, match=r"'w' \(shape \[4, 6\]\) does not split evenly into 4 along dim 1"):
        pieces(LAYOUTS, ENTRIES, Shard(names=["w"], dim=1, count=4))
    with pytest.raises(InvalidRequestError, match=r"cannot slice 'bias' \(shape \[6\]\) along dim 1"):
        pieces(LAYOUTS, ENTRIES, Shard(dim=1, count=2))
    for bad in (
        dict(count=0),
        dict(index=2, count=2),
        dict(index=-1, count=2),
        dict(dim=-1),
        dict(names="w"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            Shard(**bad)
        assert isinstance(info.value, GpuObjError)


def test_empty_tensors_select_no_bytes():
    got, _ = pieces((lay(0, 4),), (("e", 0),), Shard(dim=1, index=1, count=2))
    assert got == [(0, (0, 2), ())] and selected_bytes(got) == 0


def test_the_client_refuses_a_selection_that_is_not_a_shard_or_has_no_layouts_to_select_from():
    from gpuobj.client.handles import ObjectAddress
    from gpuobj.client.reads import select_pieces

    bare = ObjectAddress("ns", "policy", "uid", "obj", "trainer", "10.0.0.1:8000")
    with pytest.raises(InvalidRequestError, match="no tensor layouts"):
        select_pieces(bare, Shard())
    with pytest.raises(InvalidRequestError, match=r"must be a gpuobj\.Shard"):
        select_pieces(bare, {"dim": 0})  # type: ignore[arg-type]
    full = ObjectAddress("ns", "policy", "uid", "obj", "trainer", "10.0.0.1:8000", LAYOUTS, ENTRIES)
    got, named = select_pieces(full, Shard(names=["w"], dim=0, index=1, count=2))
    assert got == [(0, (2, 6), ((48, 48),))] and named == (("w", 0),)
