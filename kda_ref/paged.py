"""The paged state cache: read and write (float64 oracle).

    state_cache [slots, HV, V, K] (V-first), state_indices [N], has_initial_state [N]
    read:  S0[n] = state_cache[state_indices[n]]^T   if has_initial_state[n] else 0   (K-first out)
    write: state_cache[state_indices[n]] = S_final[n]^T; every other slot unchanged.
A slot whose has_initial_state is false is never read: whatever it holds (NaN included)
cannot reach the result.
"""
from __future__ import annotations

import torch

F64 = torch.float64


def paged_read(state_cache: torch.Tensor, state_indices: torch.Tensor,
               has_initial_state: torch.Tensor) -> torch.Tensor:
    """K-first float64 initial states [N, HV, K, V] gathered from the cache."""
    N = state_indices.numel()
    _, HV, V, K = state_cache.shape
    out = torch.zeros(N, HV, K, V, dtype=F64, device=state_cache.device)
    idx = state_indices.long().to(state_cache.device)
    read = has_initial_state.to(state_cache.device).bool()
    if bool(read.any()):
        out[read] = state_cache[idx[read]].to(F64).transpose(-1, -2)
    return out


def paged_write(state_cache: torch.Tensor, state_indices: torch.Tensor,
                final_state_kfirst: torch.Tensor) -> torch.Tensor:
    """A float64 copy of the cache with each sequence's final state written to its slot."""
    out = state_cache.to(F64).clone()
    idx = state_indices.long().to(state_cache.device)
    out[idx] = final_state_kfirst.to(F64).transpose(-1, -2)
    return out
