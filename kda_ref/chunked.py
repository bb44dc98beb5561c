"""The chunked forward from the workspace (float64), vectorised over sequences and heads.

One chunk step, per value head, from the incoming state S [K, W]:

    U  = ws_inv (β ⊙ (v - ws_kd S))          the deltas written by the chunk's tokens
    o  = ws_qd S + ws_mqk U                  the chunk's outputs
    S' = diag(ws_gt) S + ws_kr^T U

Sequences (or segments) are run side by side on a padded chunk grid: a padded slot leaves
S unchanged and writes no output.  Only the loop over chunk positions is sequential.
"""
from __future__ import annotations

from typing import Optional

import torch

from .preprocess import Prepared
from .workspace import Workspace, workspace_prepared


def chunk_step(S, kd, qd, kr, gt, inv, mqk, beta, v, compute_output: bool = True):
    """One chunk for a batch [HV, M]: S [HV,M,K,W], kd/qd/kr [HV,M,C,K], gt [HV,M,K],
    inv/mqk [HV,M,C,C], beta [HV,M,C], v [HV,M,C,W].  Returns (S', o or None, U)."""
    U = inv @ (beta[..., None] * (v - kd @ S))
    o = (qd @ S + mqk @ U) if compute_output else None
    S_new = gt[..., None] * S + kr.transpose(-1, -2) @ U
    return S_new, o, U


def run_chunk_grid(ws: Workspace, grid: torch.Tensor, S_init: torch.Tensor, v_prefix: int = 0,
                   use_v: bool = True, o_tiles: Optional[torch.Tensor] = None,
                   chunk_states: Optional[list] = None) -> torch.Tensor:
    """Run rows of tiles: ``grid [M, J]`` holds tile indices (-1 = padding), row m starting from
    ``S_init [HV, M, K, W]``.  The right-hand side of chunk j is ``[0 (v_prefix columns) | v]``
    (``use_v=False``: all zeros), which lets one run carry the affine map [A | b] of pass A.
    Outputs are written into ``o_tiles [HV, tiles, C, W]`` when given; ``chunk_states`` (a list)
    collects the state before each chunk position.  Returns the final S [HV, M, K, W]."""
    kd, qd, kr, gt = (ws.heads(n) for n in ("ws_kd", "ws_qd", "ws_kr", "ws_gt"))
    inv, mqk, beta, vt = ws.heads("ws_inv"), ws.heads("ws_mqk"), ws.heads("ws_beta"), ws.heads("v")
    S = S_init
    HV, M, K, W = S.shape
    grid_cpu = grid.cpu()                        # validity decided on the host: no device sync per step
    grid_dev = grid.to(S.device)
    for j in range(grid_cpu.shape[1]):
        if chunk_states is not None:
            chunk_states.append(S)
        valid_cpu = grid_cpu[:, j] >= 0
        all_valid = bool(valid_cpu.all())
        if not all_valid and not bool(valid_cpu.any()):
            continue
        ix = grid_dev[:, j].clamp(min=0)
        if use_v:
            v = vt[:, ix]
            if v_prefix:
                v = torch.cat([v.new_zeros(v.shape[:-1] + (v_prefix,)), v], dim=-1)
        else:
            v = S.new_zeros(HV, M, ws.C, W)
        S_new, o, _ = chunk_step(S, kd[:, ix], qd[:, ix], kr[:, ix], gt[:, ix], inv[:, ix], mqk[:, ix],
                                 beta[:, ix], v, compute_output=o_tiles is not None)
        if all_valid:
            S = S_new
            if o_tiles is not None:
                o_tiles[:, ix] = o
        else:
            valid = valid_cpu.to(S.device)
            S = torch.where(valid[None, :, None, None], S_new, S)
            if o_tiles is not None:
                o_tiles[:, grid_dev[:, j][valid]] = o[:, valid]
    return S


def chunked_from_workspace(pp: Prepared, ws: Workspace, return_chunk_states: bool = False):
    """(o [Ttot, HV, V], final state [N, HV, K, V] K-first[, states [N, NCmax+1, HV, K, V]]):
    every sequence's chunks in order from its initial state (unsegmented)."""
    grid = ws.grid.seq_grid()
    HV, V = ws.HV, pp.v.shape[-1]
    o_tiles = pp.v.new_zeros(HV, ws.tiles, ws.C, V)
    states = [] if return_chunk_states else None
    S = run_chunk_grid(ws, grid, pp.S0.transpose(0, 1), o_tiles=o_tiles, chunk_states=states)
    o = ws.grid.scatter(o_tiles)
    final = S.transpose(0, 1).contiguous()
    if not return_chunk_states:
        return o, final
    # state before chunk c of sequence n; past its last chunk a sequence's state stays final
    st = torch.stack(states + [S], dim=0).permute(2, 0, 1, 3, 4)        # [N, NCmax+1, HV, K, V]
    return o, final, st.contiguous()


def chunked(pp: Prepared, C: int = 64, inverse: str = "exact"):
    """(o, final state, workspace) of the chunked form at chunk size C."""
    ws = workspace_prepared(pp, C, inverse)
    o, final = chunked_from_workspace(pp, ws)
    return o, final, ws
