"""A put beyond the object's tensor-count limit is refused before a byte is copied or registered.

plan() and tensor_list() run before the pack is filled and before the agent sees the tensors, so
refusing there means nothing was copied; the limit is the contract's, which the CRD carries
(tests/unit/contract/test_contract_layouts.py pins them equal).
"""

from __future__ import annotations

import pytest
import torch

from gpuobj.client.core import tensor_list
from gpuobj.client.errors import GpuObjError, InvalidTensorError
from gpuobj.client.state_dicts import plan
from gpuobj_contract.layouts import MAX_TENSORS


def test_a_state_dict_beyond_the_limit_is_refused_naming_it() -> None:
    base = torch.zeros(MAX_TENSORS + 1)
    too_many = {f"layer.{i}": base[i : i + 1] for i in range(MAX_TENSORS + 1)}
    with pytest.raises(InvalidTensorError, match=f"at most {MAX_TENSORS}"):
        plan(too_many)
    assert len(plan(dict(list(too_many.items())[:MAX_TENSORS])).sources) == MAX_TENSORS


def test_tied_tensors_count_once() -> None:
    shared = torch.zeros(4)
    assert len(plan({f"tied.{i}": shared for i in range(MAX_TENSORS + 1)}).sources) == 1


def test_a_tensor_list_beyond_the_limit_is_refused_naming_it() -> None:
    with pytest.raises(GpuObjError, match=f"at most {MAX_TENSORS}"):
        tensor_list([torch.zeros(1)] * (MAX_TENSORS + 1), what="put")
    assert len(tensor_list([torch.zeros(1)] * MAX_TENSORS, what="put")) == MAX_TENSORS
