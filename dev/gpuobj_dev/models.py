"""Real model architectures for weight-sync tests, the demo scene and bench/weight_sync.py: built by
`transformers` from a config with random initialisation (no download is possible, none is needed).

Why a cached folder rather than a pin in the shared virtualenv: transformers is a dev/bench-only
dependency (never in a shipped image), and the shared environment is keyed by a hash of its pins,
so adding one would make every checkout build a new multi-GB environment. Like Ray for the
benchmarks (the Makefile's RAY_DIR), it is installed once with pip into
``~/.cache/gpuobj/models/transformers-<version>/`` and *appended* to sys.path, so the pinned
packages (numpy, torch) always win over the copies pip puts next to it. The version is the
``models`` extra in pyproject.toml (one source of truth).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CACHE_ROOT = Path(os.environ.get("GPUOBJ_CACHE", Path.home() / ".cache" / "gpuobj"))

# name -> Qwen2 config: "small" ~46 M parameters (~93 MB in bfloat16, for CI and the demo), "large"
# Qwen2-0.5B's own shape (~494 M parameters, ~988 MB in bfloat16, 290 tensors). Both tie the output
# layer to the embeddings, as Qwen2-0.5B does.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "large": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


# name -> (tensors, rows, columns): a synthetic model of many small parameters, each (rows, columns + 8 * (i % 4))
# in bfloat16: "many" has 2,000 (a 405B Llama-style model has 1,137; an object holds at most 2,048,
# gpuobj_contract.layouts.MAX_TENSORS), ~5.6 MB, so per-tensor costs show and the bytes do not hide them.
SYNTHETIC: dict[str, tuple[int, int, int]] = {"many": (2000, 32, 32)}
SIZES = [*CONFIGS, *SYNTHETIC]


def transformers_requirement() -> str:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [req] = [r for r in extras["models"] if r.startswith("transformers")]
    return req


def transformers_dir() -> Path:
    return CACHE_ROOT / "models" / transformers_requirement().replace("==", "-")


def ensure_transformers() -> None:
    """Make `import transformers` work: install it into its cached folder once, then append that folder."""
    folder = transformers_dir()
    if not (folder / ".complete").exists():
        print(f"gpuobj: installing {transformers_requirement()} into {folder} (once; a dev/bench dependency)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(folder), transformers_requirement()],
            check=True,
        )
        (folder / ".complete").touch()
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # after site-packages: the pinned numpy/torch win


def build(size: str = "small", *, seed: int = 0, dtype: str = "bfloat16") -> Any:
    """A Qwen2 causal LM of the named size, randomly initialised (same seed, same weights), in eval mode;
    a SYNTHETIC size is a module of that many parameters named like a transformer's layers."""
    import torch

    if size in SYNTHETIC:
        count, rows, cols = SYNTHETIC[size]
        torch.manual_seed(seed)
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList()
        for layer in range(0, count, 10):
            block = torch.nn.Module()
            for i in range(layer, min(count, layer + 10)):
                weight = torch.randn(rows, cols + 8 * (i % 4)).to(getattr(torch, dtype))
                block.register_parameter(f"p{i - layer}", torch.nn.Parameter(weight, requires_grad=False))
            model.layers.append(block)
        return model.eval()
    ensure_transformers()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**CONFIGS[size], max_position_embeddings=2048)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    return model.eval()


def fixed_input(model: Any, length: int = 16) -> Any:
    """The same token ids on every side: what a rollout's forward pass compares."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, model.config.vocab_size, (1, length), generator=gen)


def checksum(state_dict: Any, stride: int = 4099) -> int:
    """A checksum of a state dict's bytes, the same on every side: names, shapes, dtypes, and every
    `stride`-th byte plus each tensor's first and last 64 bytes (cheap enough per version at 1 GB)."""
    import torch

    crc = 0
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        crc = zlib.crc32(f"{name}{tuple(t.shape)}{t.dtype}".encode(), crc)
        raw = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if raw.device.type != "cpu":
            raw = raw.cpu()
        crc = zlib.crc32(raw[:64].numpy().tobytes(), crc)
        crc = zlib.crc32(raw[-64:].numpy().tobytes(), crc)
        crc = zlib.crc32(raw[::stride].contiguous().numpy().tobytes(), crc)
    return crc


def step(model: Any, version: int) -> None:
    """One "training step": every weight changes (in place, deterministically per version)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * ((version % 7) + 1))
