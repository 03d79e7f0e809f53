"""`coalesce`: a READ's (remote, local) descriptor pairs merged only where both sides touch.

Pure (no NIXL): what merges is what one descriptor may cover; the integration tests read real bytes
through merged descriptors (a state dict's pack buffer into a landing buffer)."""

from __future__ import annotations

from gpuobj_agent.nixl_transport import Span, coalesce


def _pairs(remote: list[tuple[int, int]], local: list[tuple[int, int]], mem: str = "DRAM") -> list[tuple[Span, Span]]:
    return [(Span(mem, 0, ra, n), Span("DRAM", 0, la, n)) for (ra, n), (la, _) in zip(remote, local, strict=True)]


def test_runs_that_touch_on_both_sides_become_one_descriptor() -> None:
    pairs = _pairs([(1000, 64), (1064, 128), (1192, 64)], [(5000, 64), (5064, 128), (5192, 64)])
    assert coalesce(pairs) == [(Span("DRAM", 0, 1000, 256), Span("DRAM", 0, 5000, 256))]


def test_a_gap_on_either_side_or_another_memory_keeps_the_pairs_apart() -> None:
    remote_gap = _pairs([(1000, 64), (1128, 64)], [(5000, 64), (5064, 64)])
    local_gap = _pairs([(1000, 64), (1064, 64)], [(5000, 64), (5128, 64)])
    backwards = _pairs([(1064, 64), (1000, 64)], [(5000, 64), (5064, 64)])
    assert coalesce(remote_gap) == remote_gap
    assert coalesce(local_gap) == local_gap
    assert coalesce(backwards) == backwards
    mixed = [*_pairs([(1000, 64)], [(5000, 64)]), *_pairs([(1064, 64)], [(5064, 64)], mem="VRAM")]
    assert coalesce(mixed) == mixed
    other_gpu = [
        (Span("VRAM", 0, 1000, 64), Span("DRAM", 0, 5000, 64)),
        (Span("VRAM", 1, 1064, 64), Span("DRAM", 0, 5064, 64)),
    ]
    assert coalesce(other_gpu) == other_gpu


def test_bytes_are_kept_and_runs_merge_independently() -> None:
    pairs = _pairs([(0, 8), (8, 8), (100, 4), (104, 4)], [(50, 8), (58, 8), (66, 4), (70, 4)])
    merged = coalesce(pairs)
    assert merged == [
        (Span("DRAM", 0, 0, 16), Span("DRAM", 0, 50, 16)),
        (Span("DRAM", 0, 100, 8), Span("DRAM", 0, 66, 8)),
    ]
    assert sum(r.nbytes for r, _ in merged) == sum(r.nbytes for r, _ in pairs)
    assert coalesce([]) == []
