"""The pack plan's cache: a state dict laid out before (same names over the same memory and shapes) is not
checked and laid out again, and the plan it returns is the uncached one's with this call's tensors.

Pure logic over real torch tensors; tests/e2e/operator/test_weight_sync.py puts such state dicts for real."""

from __future__ import annotations

import torch

from gpuobj.client import state_dicts
from gpuobj.client.state_dicts import _plan, plan


def model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4))
    m[1].weight = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    return m


def same(a: state_dicts.PackPlan, b: state_dicts.PackPlan) -> bool:
    return (a.entries, a.offsets, a.nbytes, a.device, a.signature) == (
        b.entries,
        b.offsets,
        b.nbytes,
        b.device,
        b.signature,
    )


def test_a_state_dict_over_the_same_memory_reuses_its_layout_with_this_calls_tensors(monkeypatch) -> None:
    m = model()
    first = plan(m.state_dict())
    calls = []
    monkeypatch.setattr(state_dicts, "_plan", lambda sd: calls.append(sd) or _plan(sd))
    sd = m.state_dict()  # new tensor objects over the same storage
    again = plan(sd)
    assert calls == []  # laid out from the cache
    assert same(again, first) and same(again, _plan(sd))
    assert [id(t) for t in again.sources] == [id(t) for t in _plan(sd).sources]  # this call's tensors


def test_tied_names_stay_tied_through_the_cache() -> None:
    w = torch.randn(5, 2)
    sd = {"embed": w, "head": w, "bias": torch.zeros(3, dtype=torch.float64)}
    plan(sd)
    again = plan(dict(sd))
    assert len(again.sources) == 2
    assert dict(again.entries)["embed"] == dict(again.entries)["head"]
    assert again.sources[dict(again.entries)["embed"]] is w


def test_a_changed_shape_or_name_or_storage_is_laid_out_anew(monkeypatch) -> None:
    m = model()
    plan(m.state_dict())
    calls = []
    monkeypatch.setattr(state_dicts, "_plan", lambda sd: calls.append(sd) or _plan(sd))
    renamed = {f"x.{k}": v for k, v in m.state_dict().items()}
    plan(renamed)
    m[0].weight = torch.nn.Parameter(torch.zeros(3, 4))  # new storage, same shape
    plan(m.state_dict())
    m[0].weight = torch.nn.Parameter(torch.zeros(4, 3).t())  # same shape, another stride
    p = plan(m.state_dict())
    assert len(calls) == 3
    assert same(p, _plan(m.state_dict()))


def test_the_cache_keeps_no_tensor_alive() -> None:
    t = torch.ones(64)
    plan({"t": t})
    laid = list(state_dicts._plans.values())
    assert laid
    for entry in laid:  # positions and numbers only: a cached layout never keeps a model's memory
        assert not any(isinstance(x, torch.Tensor) for x in vars(entry).values())
    assert not any(isinstance(x, torch.Tensor) for key in state_dicts._plans for item in key for x in item)
