"""What the kernel adapters share to run serving-trace calls (kda_kernels.base.RunsTraces).

A trace call (kda_kernels.trace_calls.PhaseCall) hands a kernel one group of a step's rows and
the whole flat cache buffer; the kernel writes the cache in place.  Three ways a kernel takes it:

- a paged kernel that takes the V-first [slots, HV, V, K] view itself (our Triton FlashKDA,
  aiter's flash_kda_fwd and chunk_kda): ``paged_problem`` makes the call a paged Problem whose
  ``state_cache`` is that view, the backend's own ``run`` checks and launches it on a private copy
  of the buffer (as it runs every paged Problem), and ``copy_back`` puts the copy's whole buffer
  back, so every element the kernel wrote, inside the slots or not, lands in the caller's buffer;
- a dense-state chunk kernel (fla's chunk_kda): the engine gathers the rows' initial states
  (zero where ``has_initial_state`` is false), runs the kernel, and scatters the final states
  back (``gather_states`` / ``scatter_states``): that gather and scatter are the engine's code
  (vLLM's), not the kernel's;
- a recurrent kernel with slot indices (fla's fused_recurrent_kda_fwd, aiter's
  fused_recurrent_kda): the view and the indices go in as they are.

``trace_refusal`` is the one check of a trace's cache against what a kernel's cache takes.
"""
from __future__ import annotations

from typing import Optional

import torch

from kda_ref.problem import Problem
from kda_ref.trace import PAD


def has_padding_rows(trace) -> bool:
    """Whether any step of ``trace`` has a padding row (a CUDA-graph-padded batch)."""
    return bool((trace.row_phase == PAD).any())


def trace_refusal(trace, owner: str, layouts=("vk", "kv"), dtypes=("float32", "bfloat16")) -> Optional[str]:
    """Why ``owner``'s kernel cannot take ``trace``'s cache (its layout or dtype), or None."""
    c = trace.cache
    if c.layout not in layouts:
        shape = "[slots, HV, V, K] (V-first, layout vk)" if layouts == ("vk",) else "/".join(layouts)
        return f"not applicable: {owner} takes a {shape} state cache, this trace's cache is layout {c.layout}"
    if c.dtype not in dtypes:
        return f"not applicable: {owner}'s state cache is {'/'.join(dtypes)}, this trace's cache is {c.dtype}"
    return None


def problem_of_trace(trace) -> Problem:
    """Every token of ``trace`` as one dense Problem without a state (``Trace.problem_view``): what
    a backend's ``accepts`` checks the model options and sizes on."""
    return trace.problem_view()


def paged_problem(call) -> Problem:
    """A prefill PhaseCall as a paged Problem: tokens [1, T, ...], cu_seqlens, and the cache's
    V-first [slots, HV, V, K] view as ``state_cache`` with the call's ``state_indices`` [N] and
    ``has_initial_state`` [N] (only for a cache of layout vk)."""
    if call.spec.layout != "vk":
        raise ValueError(f"cache.layout: expected vk for a paged kernel, got {call.spec.layout!r}")
    m = call.model
    return Problem(q=call.q, k=call.k, v=call.v, g=call.g, beta=call.beta, A_log=m.get("A_log"),
                   dt_bias=m.get("dt_bias"), scale=m.get("scale"), lower_bound=m.get("lower_bound"),
                   gate=m.get("gate", "lower_bound"), beta_kind=m.get("beta_kind", "sigmoid"),
                   qk_l2norm=bool(m.get("qk_l2norm", True)), cu_seqlens=call.cu_seqlens, state_layout="paged",
                   state_cache=call.slots_view(), state_indices=call.state_indices,
                   has_initial_state=call.has_initial_state.bool(), output_final_state=False,
                   meta={"trace_call": call.describe()})


def copy_back(call, state_cache: torch.Tensor) -> None:
    """Write into ``call.cache`` the part of ``state_cache``'s storage that ``call.cache`` covers
    (``state_cache``: a kernel's output over a private copy of the call's whole buffer, made by
    kda_kernels.base.copy_with_padding, so its storage mirrors the caller's element for element)."""
    buf = call.cache
    src = state_cache.new_empty(0).set_(state_cache.untyped_storage(), buf.storage_offset(), buf.shape, buf.stride())
    if src.data_ptr() == buf.data_ptr():
        return                      # the kernel wrote the caller's buffer itself
    buf.copy_(src.to(buf.device))


def gather_states(call, dtype=torch.float32) -> torch.Tensor:
    """The engine's gather before a dense-state chunk kernel: the initial state of each row
    [N, HV, a, b] in the cache's layout (a copy in ``dtype``), zero where ``has_initial_state`` is
    false (vLLM zeroes those slots; here only the copy is zeroed, the slot is written after)."""
    view = call.slots_view()
    init = view[call.state_indices.long()].to(dtype)
    init[~call.has_initial_state.bool()] = 0
    return init.contiguous()


def scatter_states(call, final: torch.Tensor) -> None:
    """The engine's scatter after a dense-state chunk kernel: row n's final state [HV, a, b]
    (the cache's layout) to slot ``state_indices[n]``, rounded to the cache's dtype."""
    view = call.slots_view()
    view[call.state_indices.long()] = final.to(view.dtype)
