"""The chunked forward from the workspace (float64), vectorised over sequences and heads.

One chunk step, per value head, from the incoming state S [K, W]:

    U  = ws_inv (β ⊙ (v - ws_kd S))          the deltas written by the chunk's tokens
    o  = ws_qd S + ws_mqk U                  the chunk's outputs
    S' = diag(ws_gt) S + ws_kr^T U

Sequences (or segments) are run side by side on a padded chunk grid: a padded slot leaves
S unchanged and writes no output.  Only the loop over chunk positions is sequential.

``streamed`` (truth()'s default) runs the same chunk steps block by block: the tiles of all
sequences, in order, cut into blocks of consecutive tiles; each block's inputs are cast to float64
and its workspace built on its own, and the float64 states [N, HV, K, V] are carried from block
to block.  The blocks of one run share one set of working arrays (``BlockBuffers``), so a block
allocates nothing that the previous one of the same shape had.  Memory: the inputs, o, the
states and one block's working set.
"""
from __future__ import annotations

from typing import Optional

import torch

from .budget import block_budget
from .preprocess import (F64, Prepared, beta_activation, expand_gva, gate_activation, initial_state_kfirst,
                         l2norm)
from .workspace import BlockBuffers, Workspace, workspace_prepared


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


def outputs_in_loop(device) -> bool:
    """Where a lone sequence's outputs o = qd S + mqk U are evaluated: in the sequential loop, each
    while its S and U are still in cache (the CPU, where the loop is bound by memory traffic), or
    after it, for all tiles in two batched products from the kept states and deltas (CUDA, where
    every operation of the loop is a kernel launch and fewer of them per step win)."""
    return torch.device(device).type == "cpu"


def _one_sequence_steps(S0, kd, qd, kr, gt, inv, mqk, beta, vt, buf, o_out=None, S_in=None, U_all=None):
    """The chunk steps of one sequence's consecutive tiles 0..n-1 of a block, per value head:

        w = β (v - kd S);   U = inv w;   S' = diag(gt) S + kr^T U;   o = qd S + mqk U

    With ``o_out [rows, HV, V]`` the outputs are taken in the loop (tile t covers rows
    ``[t C, t C + C)``; the last tile may be partial); otherwise ``S_in [HV, n, K, V]`` receives
    each tile's incoming state and ``U_all [HV, n, C, V]`` its deltas, for the outputs after the
    loop.  Returns the state after tile n-1 (an array of ``buf``).  The arithmetic of
    ``chunk_step``, each product fused with the sum it feeds (``baddbmm``), written into reused
    arrays."""
    HV, n, C, K = kd.shape
    V = vt.shape[-1]
    w = buf.get("step_w", (HV, C, V))
    if o_out is not None:                          # two state arrays in turn; one U, one o
        Sa, Sb = buf.get("step_state", (HV, K, V)), buf.get("step_state_next", (HV, K, V))
        states = [Sa if t % 2 == 0 else Sb for t in range(n + 1)]
        U_t = [buf.get("step_u", (HV, C, V))] * n
        o_t, qd_t, mqk_t = buf.get("step_o", (HV, C, V)), qd.unbind(1), mqk.unbind(1)
    else:                                          # every incoming state and U kept
        states = list(S_in.unbind(1)) + [buf.get("step_state", (HV, K, V))]
        U_t = U_all.unbind(1)
    states[0].copy_(S0)
    kd_t, kr_t, inv_t, v_t = kd.unbind(1), kr.transpose(-1, -2).unbind(1), inv.unbind(1), vt.unbind(1)
    beta_t, gt_t = beta[..., None].unbind(1), gt[..., None].unbind(1)
    for t in range(n):
        S, S_next, U = states[t], states[t + 1], U_t[t]
        torch.baddbmm(v_t[t], kd_t[t], S, alpha=-1, out=w)            # v - kd S
        w.mul_(beta_t[t])                                              # beta (v - kd S)
        torch.bmm(inv_t[t], w, out=U)                                  # U = inv (beta (v - kd S))
        if o_out is not None:
            torch.bmm(qd_t[t], S, out=o_t)                             # qd S
            o_t.baddbmm_(mqk_t[t], U)                                  # + mqk U
            rows = o_out[t * C:(t + 1) * C]
            rows.copy_(o_t[:, :rows.shape[0]].transpose(0, 1))
        torch.mul(gt_t[t], S, out=S_next)                              # diag(gt) S
        S_next.baddbmm_(kr_t[t], U)                                    # + kr^T U
    return states[n]


def chunked_deferred(pp: Prepared, ws: Workspace, buffers: Optional[BlockBuffers] = None,
                     o_out: Optional[torch.Tensor] = None):
    """(o [Ttot, HV, V], final state [N, HV, K, V] K-first): the chunk steps of
    ``chunked_from_workspace``, the sequential loop running only what the next state needs
    (``chunk_step`` without its output, on the rows whose sequence has a chunk at that position;
    a lone sequence's tiles as views, not gathered, its steps written into reused arrays).  The
    outputs ``o_c = ws_qd S_c + ws_mqk U_c`` of a lone sequence on the CPU are taken in the loop
    (``outputs_in_loop``); otherwise each chunk's incoming state S_c and deltas U_c are kept
    (extra memory S_c [HV, tiles, K, V] and U_c [HV, tiles, C, V], from ``buffers`` when given)
    and the outputs of all tiles taken at once after the loop.
    ``o_out [Ttot, HV, V]``: o is written there (and returned).  With ``buffers`` the returned
    state may be an array of ``buffers``: copy it out before the next block."""
    kd, qd, kr, gt = (ws.heads(n) for n in ("ws_kd", "ws_qd", "ws_kr", "ws_gt"))
    inv, mqk, beta, vt = ws.heads("ws_inv"), ws.heads("ws_mqk"), ws.heads("ws_beta"), ws.heads("v")
    HV, V, K = ws.HV, pp.v.shape[-1], pp.k.shape[-1]
    buf = buffers if buffers is not None else BlockBuffers(pp.v.device)
    M = ws.grid.N
    lone = M == 1 and ws.tiles > 0                 # one sequence: its tiles are 0..tiles-1, views only
    if lone and outputs_in_loop(pp.v.device):
        o = o_out if o_out is not None else pp.v.new_zeros(ws.grid.Ttot, HV, V)
        return o, _one_sequence_steps(pp.S0[0], kd, qd, kr, gt, inv, mqk, beta, vt, buf, o_out=o)[None]
    S_in = buf.get("S_in", (HV, ws.tiles, K, V))
    U_all = buf.get("U_all", (HV, ws.tiles, ws.C, V))
    if lone:
        S = _one_sequence_steps(pp.S0[0], kd, qd, kr, gt, inv, mqk, beta, vt, buf, S_in=S_in, U_all=U_all)[:, None]
        grid = None
    else:
        S = pp.S0.transpose(0, 1).contiguous()                         # [HV, N, K, V]
        grid = ws.grid.seq_grid().cpu()
    for j in range(grid.shape[1] if grid is not None else 0):
        col = grid[:, j]
        rows = torch.nonzero(col >= 0).flatten()
        if rows.numel() == 0:
            continue
        ix = col[rows].to(S.device)
        full = rows.numel() == M
        Sr = S if full else S[:, rows.to(S.device)]
        S_new, _, U = chunk_step(Sr, kd[:, ix], None, kr[:, ix], gt[:, ix], inv[:, ix], None, beta[:, ix],
                                 vt[:, ix], compute_output=False)
        S_in[:, ix] = Sr
        U_all[:, ix] = U
        if full:
            S = S_new
        else:
            S = S.clone()
            S[:, rows.to(S.device)] = S_new
    o_tiles = buf.get("o_tiles", (HV, ws.tiles, ws.C, V))
    torch.matmul(qd, S_in, out=o_tiles)
    o3 = o_tiles.view(-1, ws.C, V)
    o3.baddbmm_(mqk.reshape(-1, ws.C, ws.C), U_all.view(-1, ws.C, V))             # + mqk U
    if o_out is None:
        return ws.grid.scatter(o_tiles), S.transpose(0, 1)
    g = ws.grid
    if g.full:                                      # token tile * C + i is row i of tile `tile`
        o_out.view(g.tiles, g.C, HV, V).copy_(o_tiles.permute(1, 2, 0, 3))
    else:
        o_out.copy_(g.scatter(o_tiles))
    return o_out, S.transpose(0, 1)


def chunked(pp: Prepared, C: int = 64, inverse: str = "exact"):
    """(o, final state, workspace) of the chunked form at chunk size C."""
    ws = workspace_prepared(pp, C, inverse)
    o, final = chunked_from_workspace(pp, ws)
    return o, final, ws


# ----------------------------------------------------------------------------- streamed
# Bytes of float64 working set per (tile, value head) of one block (the arrays of its BlockBuffers):
# the float64 inputs q, k, g and the l2norm temporary (4 C x K) and v (C x V); the workspace fields
# ws_kd, ws_qd, ws_kr with G, scale q and the two scratch arrays (7 C x K); the grams, I - L and its
# inverse (4 C x C); and, where the outputs are taken after the loop (a block of several sequences,
# or any block on CUDA: ``outputs_in_loop``), each chunk's incoming state (K x V), its deltas and its
# outputs (2 C x V) for the batched outputs of chunked_deferred.
def block_bytes_per_tile_head(C: int, K: int, V: int) -> int:
    """Float64 bytes one (tile, value head) of a streamed block holds at its peak."""
    return 8 * (11 * C * K + 3 * C * V + 4 * C * C + K * V)


def default_block_bytes(device) -> int:
    """The working-set budget of one streamed block on ``device``: ``kda_ref.budget.block_budget``
    (the device's total memory x BLOCK_SHARE / the workers sharing it, capped)."""
    return block_budget(device)


def block_plan(bounds, C: int, tiles_per_block: int) -> list:
    """Cut the tiles of sequences ``bounds = [(bos, eos)]`` (chunk c of sequence n covers tokens
    ``[bos + c C, min(bos + (c+1) C, eos))``, tiles numbered sequence by sequence) into blocks of
    at most ``tiles_per_block`` consecutive tiles.  Each block is ``(tok0, tok1, parts)``: the
    packed token range it covers (contiguous) and ``parts = [(n, bos', eos')]``, the piece of
    each sequence n inside it, in block-local token indices.  A piece always starts at a chunk
    boundary of its sequence, so the block's chunks are the problem's chunks.  Empty sequences
    appear in no block.  Host integers only: nothing of size T is allocated."""
    tpb = max(1, int(tiles_per_block))
    blocks = []
    parts, room, tok0 = [], tpb, None
    for n, (bos, eos) in enumerate(bounds):
        nch = -(-(eos - bos) // C)
        c = 0
        while c < nch:
            take = min(room, nch - c)
            b0, b1 = bos + c * C, min(bos + (c + take) * C, eos)
            if tok0 is None:
                tok0 = b0
            parts.append((n, b0, b1))
            c += take
            room -= take
            if room == 0:
                blocks.append((tok0, b1, [(m, x0 - tok0, x1 - tok0) for m, x0, x1 in parts]))
                parts, room, tok0 = [], tpb, None
    if parts:
        tok1 = parts[-1][2]
        blocks.append((tok0, tok1, [(m, x0 - tok0, x1 - tok0) for m, x0, x1 in parts]))
    return blocks


def _f64_head_major(x: torch.Tensor, name: str, buffers: Optional[BlockBuffers]) -> torch.Tensor:
    """``x [n, h, ...]`` cast to float64, as a ``[n, h, ...]`` view of an ``[h, n, ...]`` array
    (head-major: the workspace's tile layout is then a view, not a copy), taken from ``buffers``
    under ``name`` when given."""
    shape = (x.shape[1], x.shape[0]) + tuple(x.shape[2:])
    out = buffers.get(name, shape) if buffers is not None else torch.empty(shape, dtype=F64, device=x.device)
    out = out.transpose(0, 1)
    out.copy_(x)
    return out


def prepare_tokens(p, t0: int, t1: int, S0: torch.Tensor, buffers: Optional[BlockBuffers] = None) -> Prepared:
    """The Prepared inputs of packed tokens ``[t0, t1)`` of Problem ``p``, cast to float64 here
    (the same per-token operations as ``kda_ref.preprocess.prepare``, on the slice only), laid
    out head-major (``[t1 - t0, HV, .]`` views of ``[HV, t1 - t0, .]`` arrays; the elementwise
    steps run in place on them); bounds are left empty for the caller and ``S0`` is passed
    through.  With ``buffers`` (``streamed`` passes its run's) the arrays are taken from them, so
    the result is valid until the next block is prepared into the same buffers; without, they are
    its own."""
    HV, Tt = p.HV, p.B * p.T
    q = _f64_head_major(p.q.reshape(Tt, p.H, p.K)[t0:t1], "in_q", buffers)
    k = _f64_head_major(p.k.reshape(Tt, p.H, p.K)[t0:t1], "in_k", buffers)
    if p.qk_l2norm:
        n, H, K = q.shape
        tmp = torch.empty_like(q) if buffers is None else buffers.get("in_sq", (H, n, K)).transpose(0, 1)
        q, k = l2norm(q, inplace=True, tmp=tmp), l2norm(k, inplace=True, tmp=tmp)
    q, k = expand_gva(q, HV), expand_gva(k, HV)
    a = gate_activation(_f64_head_major(p.g.reshape(Tt, HV, p.K)[t0:t1], "in_g", buffers), p.gate, p.A_log,
                        p.dt_bias, p.lower_bound, inplace=True)
    beta = beta_activation(_f64_head_major(p.beta.reshape(Tt, HV)[t0:t1], "in_beta", buffers), p.beta_kind)
    v = _f64_head_major(p.v.reshape(Tt, HV, p.V)[t0:t1], "in_v", buffers)
    return Prepared(q=q, k=k, v=v, a=a, beta=beta, scale=p.scale_value, bounds=[], S0=S0)


def streamed(p, C: int = 64, block_tokens: Optional[int] = None, block_bytes: Optional[int] = None):
    """(o [Ttot, HV, V], final state [N, HV, K, V] K-first) of a validated Problem by the chunked
    form, streamed: the tiles (chunks) of all sequences, in order, are cut into blocks of
    consecutive tiles (``block_plan``); each block's inputs are cast to float64 and preprocessed
    (``prepare_tokens``), its workspace is built and its chunk steps run from the float64 states
    carried over from the previous block, and its outputs are written into o.  Per block the
    arithmetic is that of ``chunked_from_workspace`` on the same chunks: the same formulas,
    evaluated in the same order (a lone sequence's steps fuse each product with the sum it
    feeds, ``baddbmm``), so the two agree to rounding.

    Block size: ``block_tokens`` (rounded down to whole chunks, at least one), else the largest
    number of tiles whose working set (``block_bytes_per_tile_head`` x HV) fits ``block_bytes``
    (default ``default_block_bytes``).  Peak memory: the inputs, o, the states [N, HV, K, V] and
    one block's working set."""
    HV, K, V, Tt = p.HV, p.K, p.V, p.B * p.T
    if block_tokens is not None:
        tpb = max(1, int(block_tokens) // C)
    else:
        budget = default_block_bytes(p.device) if block_bytes is None else int(block_bytes)
        tpb = max(1, budget // (HV * block_bytes_per_tile_head(C, K, V)))
    S = initial_state_kfirst(p).clone()                                     # [N, HV, K, V]
    # zeros: the tokens of no block (past a sequence's end) stay 0, and the pages of o are first
    # touched here by one parallel fill, not one chunk at a time by the steps' writes
    o = torch.zeros(Tt, HV, V, dtype=F64, device=p.device)
    buffers = BlockBuffers(p.device)
    shapes = None
    for t0, t1, parts in block_plan(p.seq_bounds(), C, tpb):
        block_shapes = (t1 - t0, [b1 - b0 for _, b0, b1 in parts])
        if block_shapes != shapes:                                   # new shapes: new arrays
            shapes = block_shapes
            buffers.clear()
        ns = [n for n, _, _ in parts]
        if ns == list(range(ns[0], ns[-1] + 1)):                     # consecutive: a view of S
            seqs = slice(ns[0], ns[-1] + 1)
        else:
            seqs = torch.tensor(ns, dtype=torch.long, device=p.device)
        pp = prepare_tokens(p, t0, t1, S[seqs], buffers)
        pp.bounds = [(b0, b1) for _, b0, b1 in parts]
        ws = workspace_prepared(pp, C, buffers=buffers)
        _, S_blk = chunked_deferred(pp, ws, buffers, o_out=o[t0:t1])
        S[seqs] = S_blk
        del pp, ws, S_blk
    return o, S
