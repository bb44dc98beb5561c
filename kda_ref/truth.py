"""Truth: the float64 outputs of a Problem, in the Problem's own layouts.

    o            [B, T, HV, V]
    final_state  [N, HV, K, V] (kv) or [N, HV, V, K] (vk); None unless output_final_state
    state_cache  [slots, HV, V, K] after the paged write-back (paged problems only)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .paged import paged_write
from .problem import Problem, validate


@dataclass
class Truth:
    o: torch.Tensor
    final_state: Optional[torch.Tensor] = None
    state_cache: Optional[torch.Tensor] = None
    extras: dict = field(default_factory=dict)  # workspace / segment tensors on request

    def tensors(self) -> dict:
        out = {"o": self.o}
        if self.final_state is not None:
            out["final_state"] = self.final_state
        if self.state_cache is not None:
            out["state_cache"] = self.state_cache
        out.update(self.extras)
        return out


def finish(p: Problem, o_packed: torch.Tensor, final_kfirst: torch.Tensor) -> Truth:
    """Put packed o [Ttot,HV,V] and K-first final states into the Problem's layouts."""
    o = o_packed.reshape(p.B, p.T, p.HV, p.V)
    if p.paged:
        return Truth(o=o, state_cache=paged_write(p.state_cache, p.state_indices, final_kfirst))
    if not p.output_final_state:
        return Truth(o=o)
    fs = final_kfirst if p.state_layout == "kv" else final_kfirst.transpose(-1, -2).contiguous()
    return Truth(o=o, final_state=fs)


def truth(p: Problem, method: str = "recurrence") -> Truth:
    """The float64 truth of a Problem (validated first)."""
    validate(p)
    if method == "recurrence":
        from .recurrence import recurrence
        r = recurrence(p)
        return finish(p, r.o, r.final_state)
    raise ValueError(f"method: expected recurrence, got {method!r}")
