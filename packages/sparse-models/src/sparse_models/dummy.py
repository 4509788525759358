"""Random weights for benchmarks: no files read, same values for the same seed."""

from __future__ import annotations

import torch
from torch import nn

from sparse_models.layers.norm import RMSNorm

DUMMY_STD = 0.02


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place: norms with 1, everything else with N(0, 0.02).

    Values are drawn straight into each parameter on its device and in its dtype (no host tensor,
    no fp32 copy), so an 8B model fills in well under a second on a GPU. The same seed gives the
    same weights on the same device type; CPU and CUDA generators differ. A tensor-parallel slice
    (a parameter with a ``logical_shape`` other than its own) is drawn at the full logical shape and
    cut by its loader, so every rank count gives the same logical model.
    """
    norm_params = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():  # a fixed order; tied parameters appear once
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        logical = getattr(param, "logical_shape", None)
        if logical is None or tuple(logical) == tuple(param.shape):
            param.normal_(0.0, DUMMY_STD, generator=gen)
            continue
        full = torch.empty(logical, dtype=param.dtype, device=param.device).normal_(0.0, DUMMY_STD, generator=gen)
        param.weight_loader(param, full)
