"""``load_format="dummy"``: no checkpoint weights; parameters filled with small random values (vLLM's
dummy format: uniform in [-1e-3, 1e-3]), for profiling and tests of everything but the numbers."""
from __future__ import annotations

import torch
from torch import nn


def initialize_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> int:
    """Fill every floating parameter of ``model`` with U(low, high) (norm weights too, as vLLM does),
    reproducibly from ``seed``; returns the number of values written."""
    if hasattr(model, "materialize"):  # the transformers fallback is built on the meta device
        model.materialize()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32).mul_(high - low).add_(low))
                n += p.numel()
    return n
