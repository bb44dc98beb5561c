"""The gated RMSNorm some kernels fuse into KDA's output (float64 oracle).

aiter's chunk_kda with ``out_gate`` and ``norm_weight`` writes, per token t and head h,

    y[t, h, :] = o[t, h, :] / sqrt(mean_j o[t, h, j]^2 + eps) * weight * sigmoid(gate[t, h, :])

o [..., V] the attention output, gate like o, weight [V], eps > 0 (aiter's default 1e-5).  This
is the same formula in float64 on the float64 truth of o, so a kernel that fuses the norm is
judged against the norm of the true o.  A Problem with ``out_gate`` / ``norm_weight`` / ``norm_eps``
asks for it; ``kda_ref.truth.finish`` applies it to the truth of every method.  aiter's Gluon walk
computes it in fp32 on o already rounded to its output dtype (docs/backends.md, "fused output norm").
"""
from __future__ import annotations

import torch

F64 = torch.float64


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """o [..., V], gate like o, weight [V] -> float64 [..., V] (module docstring); a mismatched
    shape or eps <= 0 raises ValueError naming the argument."""
    if tuple(gate.shape) != tuple(o.shape):
        raise ValueError(f"gate: expected the shape of o {list(o.shape)}, got {list(gate.shape)}")
    if tuple(weight.shape) != (o.shape[-1],):
        raise ValueError(f"weight: expected [{o.shape[-1]}] (o's last dimension), got {list(weight.shape)}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps}")
    x = o.to(F64)
    w, gt = weight.to(device=x.device, dtype=F64), gate.to(device=x.device, dtype=F64)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w * torch.sigmoid(gt)
