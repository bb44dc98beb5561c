"""Truth: the float64 outputs of a Problem, in the Problem's own layouts.

    o            [B, T, HV, V]  (with a fused output norm: its gated RMSNorm, kda_ref.norm)
    final_state  [N, HV, K, V] (kv) or [N, HV, V, K] (vk); None unless output_final_state
    state_cache  [slots, HV, V, K] after the paged write-back (paged problems only)
    extras       ws_*, ws_pivot, ws_cond1, A_seg, b_seg, h_in, seg_desc, seq_seg_off (workspace=True)

By default the outputs come from the chunked form at C = 64, streamed (``kda_ref.chunked.streamed``):
each sequence is walked in blocks of chunks with its float64 state carried between blocks, the
inputs cast to float64 one block at a time, so memory is the inputs, o, the states and one block's
working set.  Per chunk it evaluates the formulas of the whole-problem chunked form
(``method="chunked"``, which holds every chunk's workspace at once), some products fused with the
sums they feed, so the two agree to rounding; the selfcheck holds both to the token recurrence
(the definition) to 1e-12 relative.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .chunked import chunked_from_workspace, streamed
from .fla_form import fla_form
from .norm import gated_rmsnorm
from .paged import paged_write
from .preprocess import prepare
from .problem import Problem, validate
from .recurrence import recurrence_prepared
from .segments import segmented
from .workspace import condition_number, workspace_prepared


def output_tensors(o, final_state=None, state_cache=None) -> dict:
    """The outputs of one forward by name: o, and final_state or state_cache where present."""
    out = {"o": o}
    if final_state is not None:
        out["final_state"] = final_state
    if state_cache is not None:
        out["state_cache"] = state_cache
    return out


@dataclass
class Truth:
    o: torch.Tensor
    final_state: Optional[torch.Tensor] = None
    state_cache: Optional[torch.Tensor] = None
    extras: dict = field(default_factory=dict)  # workspace / segment tensors on request

    def tensors(self) -> dict:
        out = output_tensors(self.o, self.final_state, self.state_cache)
        out.update(self.extras)
        return out


def finish(p: Problem, o_packed: torch.Tensor, final_kfirst: torch.Tensor) -> Truth:
    """Put packed o [Ttot,HV,V] and K-first final states into the Problem's layouts; with a fused
    output norm (``p.out_gate``) o is its float64 gated RMSNorm (``kda_ref.norm.gated_rmsnorm``:
    the one place the oracle applies it, so every method's truth carries it)."""
    o = o_packed.reshape(p.B, p.T, p.HV, p.V)
    if p.fused_norm:
        o = gated_rmsnorm(o, p.out_gate, p.norm_weight, p.norm_eps)
    if p.paged:
        return Truth(o=o, state_cache=paged_write(p.state_cache, p.state_indices, final_kfirst))
    if not p.output_final_state:
        return Truth(o=o)
    fs = final_kfirst if p.state_layout == "kv" else final_kfirst.transpose(-1, -2).contiguous()
    return Truth(o=o, final_state=fs)


METHODS = ("streamed", "chunked", "segmented", "recurrence", "fla")


def truth(p: Problem, method: str = "streamed", chunk_size: int = 64, chunks_per_seg: Optional[int] = None,
          workspace: bool = False, block_tokens: Optional[int] = None, block_bytes: Optional[int] = None) -> Truth:
    """The float64 truth of a Problem (validated first).

    method: "streamed" (default; the chunked form block by block, see ``kda_ref.chunked.streamed``;
    ``block_tokens`` or ``block_bytes`` size the blocks, default ``kda_ref.budget.block_budget``:
    a share of the device's total memory divided by the workers sharing it),
    "chunked" (the workspace of the whole problem and the chunk steps, one segment per sequence),
    "segmented" (passes A, B, C with ``chunks_per_seg``), "recurrence" (the token recurrence,
    the definition) or "fla" (fla's chunked form, chunk_size 32 or 64).
    workspace=True also returns, in ``Truth.extras``, the ws_* buffers at ``chunk_size`` (production
    layout), ``ws_pivot`` [tiles], ``ws_cond1`` [HV*tiles] (κ₁(I - L)), and the segment tensors of
    ``chunks_per_seg`` (None: one segment per sequence): ``A_seg``, ``b_seg``, ``h_in``,
    ``seg_desc`` [6, segs] int32 and ``seq_seg_off`` [N+1] int32."""
    validate(p)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {'|'.join(METHODS)}, got {method!r}")
    extras: dict = {}
    if method == "streamed" and not workspace:
        o, final = streamed(p, chunk_size, block_tokens=block_tokens, block_bytes=block_bytes)
        return finish(p, o, final)
    pp = prepare(p)
    ws = seg = None
    if method in ("streamed", "chunked", "segmented") or workspace:
        ws = workspace_prepared(pp, chunk_size)
    if method == "segmented" or workspace:
        seg = segmented(pp, ws, chunks_per_seg)
    if method == "recurrence":
        r = recurrence_prepared(pp)
        o, final = r.o, r.final_state
    elif method in ("streamed", "chunked"):   # workspace=True: the whole workspace is built anyway
        o, final = chunked_from_workspace(pp, ws)
    elif method == "segmented":
        o, final = seg.o, seg.final_state
    else:
        f = fla_form(pp, chunk_size)
        o, final = f.o, f.final_state
    if workspace:
        extras.update(ws.tensors())
        extras["ws_pivot"] = ws.pivot.to(torch.int32)
        extras["ws_cond1"] = condition_number(ws.L, ws.ws_inv)
        extras.update(seg.tensors())
    t = finish(p, o, final)
    t.extras = extras
    return t
