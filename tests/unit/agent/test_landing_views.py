"""`buffers.views`: the tensors a landing buffer hands out are exactly the slices they replaced.

Pure torch (no NIXL): every layout gets a contiguous tensor of its shape and dtype over its own bytes of
the one buffer, at its offset; an empty layout gets a tensor of its own. The integration tests
(tests/integration/agent) read real bytes into them."""

from __future__ import annotations

import torch

from gpuobj_agent.buffers import LandingPool, views
from gpuobj_agent.layouts import TensorLayout


def test_views_are_the_slices_at_their_offsets() -> None:
    layouts = [
        TensorLayout((3, 5), "bfloat16", "cpu"),
        TensorLayout((7,), "float32", "cpu"),
        TensorLayout((0, 4), "float16", "cpu"),
        TensorLayout((2, 3, 4), "int8", "cpu"),
        TensorLayout((), "float64", "cpu"),
        TensorLayout((4, 1), "bfloat16", "cpu"),
    ]
    offsets, total = LandingPool.plan(layouts)
    whole = torch.arange(total, dtype=torch.int64).to(torch.uint8)
    got = views(whole, layouts, offsets)
    for la, off, t in zip(layouts, offsets, got, strict=True):
        assert tuple(t.shape) == la.shape and str(t.dtype) == f"torch.{la.dtype}"
        assert t.is_contiguous()
        if la.nbytes == 0:
            continue
        expected = whole[off : off + la.nbytes].view(t.dtype).view(la.shape)
        assert t.data_ptr() == expected.data_ptr()
        assert torch.equal(t.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
        assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # a view, not a copy
    whole.fill_(0)
    assert all(float(t.abs().sum()) == 0 for t in got)  # writes to the buffer show through
