"""The CUDA suite: real agent processes and real NIXL over VRAM (UCX cuda_ipc on one GPU).

Every test here is marked `cuda` and skipped, with the reason, where torch sees no CUDA device, so
`make test` on a CPU machine collects and skips them. On a GPU machine `dev/gpu_check.sh` runs them
with `--confcutdir=tests/gpu`: the root tests/conftest.py (the cluster fixtures, which import the
kubernetes package the GPU image lacks) is not loaded, and nothing here needs a cluster.
"""

from __future__ import annotations

import os

import pytest
import torch

from ..integration.agent.conftest import make_process, make_runtime, settle, token_file  # noqa: F401 - fixtures

# GPUOBJ_GPU_TESTS_DEVICE=cpu runs the suite on CPU memory: a dry run of the tests' own logic on a machine
# without a GPU (it proves nothing about VRAM); dev/gpu_check.sh never sets it.
DEVICE = os.environ.get("GPUOBJ_GPU_TESTS_DEVICE", "cuda:0")


def cuda_missing() -> str | None:
    """Why the suite cannot run here, or None when it can."""
    if DEVICE == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_missing()
    for item in items:
        if item.path.is_relative_to(config.rootpath / "tests" / "gpu"):
            item.add_marker(pytest.mark.cuda)
            item.add_marker(pytest.mark.nixl)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def registered_bytes(proc) -> float:
    """The agent's registered-bytes gauge, read from its /metrics as Prometheus would."""
    from gpuobj_contract import metric_names as mn

    status, text = proc.request("GET", "/metrics")
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith(mn.AGENT_NIXL_REGISTERED_BYTES) and not line.startswith("#"):
            return float(line.split()[-1])
    raise AssertionError(f"{mn.AGENT_NIXL_REGISTERED_BYTES} missing from /metrics:\n{text}")


def synchronize() -> None:
    """Wait for the GPU's queued work (a no-op in a CPU dry run)."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()
