"""The segment passes: pass A (``segment_map_kernel``, the maps of each segment) and pass B
(``scan_kernel``, the scan over segments), with their launchers ``run_pass_a`` / ``run_pass_b``.

A segment of ``cps`` chunks maps its incoming state to its outgoing one affinely,
S_out = A_seg S_in + b_seg (A_seg [K, K], b_seg [K, V], fp32).  Pass A walks each segment's
chunks (the chunk step of pass C, walk.py) from S = 0 with v (-> b_seg, MODE_B) and from S = I
without v (u = -beta kd S, -> A_seg, MODE_A), or both in one launch (MODE_AB), on the
transposed state S^T [BW, K], so that its products have BW rows instead of C = 32.  Pass B then
gives every segment its true incoming state h_in[s], sequence by sequence, and pass C runs each
segment from it.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import H0_NONE, H0_SEQ, STEP_STAGES, STEP_WARPS, _initial_state, _segment, _walk_program
from .launch import D, StateRef, current_context, empty, fail, launch
from .plan import C, Plan

# pass-A modes (constexpr MODE of segment_map_kernel)
MODE_B = tl.constexpr(1)        # b_seg: from 0, with v
MODE_A = tl.constexpr(2)        # A_seg: from I, without v
MODE_AB = tl.constexpr(3)       # both in one launch (K == V)

SCAN_WARPS = 4
SCAN_BW = 16             # state columns per scan program, whatever the route's BW: the scan is one
                         # dependent [K,K] x [K,BW] product per segment, so narrower programs finish
                         # each step sooner (docs/triton-flashkda.md)
SPLIT_SCAN_WARPS = 8     # CUDA: the split scan holds an fp32 [128,128] A_seg tile (prefetched: two)
A_SEG_DTYPE = {"split": torch.float32, "bf16": torch.bfloat16}     # by the route's scan precision


def scan_warps(warps: int, scan: str) -> int:
    """Warps of the scan kernel.  The split scan needs 8 warps of 32 on NVIDIA (4 spill on sm90);
    on AMD 4 wave64 warps already hold it in 512 VGPRs + AGPRs (8 spill on gfx950).  The target
    is the launch context's (launch.current_context().hip)."""
    return max(warps, SPLIT_SCAN_WARPS) if scan == "split" and not current_context().hip else warps


@triton.jit
def segment_map_kernel(
    seg_ptr, v_ptr, svb, svt, svh, svd,
    kd_ptr, kr_ptr, gt_ptr, inv_ptr, wsb_ptr,
    aseg_ptr, bseg_ptr,
    H, total_tiles,
    MODE: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BW: tl.constexpr,
):
    """Pass A, one program = (segment s, head h) x BW columns of the segment's map: the chunk step
    from S = 0 with v (MODE_B -> b_seg), from S = I without v (MODE_A -> A_seg), or both (MODE_AB).
    The state is held transposed, S^T [BW, K], so that every product has BW rows (M = BW: wgmma
    on sm90 at BW = 64, where the [K, BW] form of pass C gives M = C = 32):
        u^T = beta (v^T - bf16(S^T) kd^T),  U^T = fp16(u^T) INV^T,  S^T <- S^T diag(gt) + bf16(U^T) kr
    the same products as segment_kernel's, transposed (bitwise the same results on the H200)."""
    s, h, cols, kk, rows = _walk_program(H, C, K, BW)
    chunk_base, nch, _, _, b, t0, t_end = _segment(seg_ptr, s)
    eye = tl.where(cols[:, None] == kk[None, :], 1.0, 0.0)
    if MODE == MODE_A:
        S = eye                                       # A part alone
    else:
        S = tl.zeros([BW, K], dtype=tl.float32)       # b part
        SA = eye                                      # A part (MODE_AB)

    tile_off = rows[:, None] * K + kk[None, :]
    sq_off = rows[:, None] * C + rows[None, :]
    for j in range(0, nch):
        ws = (h * total_tiles + chunk_base + j).to(tl.int64)
        kdT = tl.trans(tl.load(kd_ptr + ws * (C * K) + tile_off))
        kr = tl.load(kr_ptr + ws * (C * K) + tile_off)
        invT = tl.trans(tl.load(inv_ptr + ws * (C * C) + sq_off))
        gt = tl.load(gt_ptr + ws * K + kk)
        beta = tl.load(wsb_ptr + ws * C + rows)
        if MODE == MODE_A:
            u = -beta[None, :] * tl.dot(S.to(tl.bfloat16), kdT)  # mutant-anchor: maps-u-A-only
        else:
            tok = t0 + j * C + rows
            vT = tl.load(v_ptr + b * svb + tok[None, :].to(tl.int64) * svt + h * svh + cols[:, None] * svd,
                         mask=(tok < t_end)[None, :], other=0.0).to(tl.float32)
            u = beta[None, :] * (vT - tl.dot(S.to(tl.bfloat16), kdT))
        U = tl.dot(u.to(tl.float16), invT)
        S = S * gt[None, :] + tl.dot(U.to(tl.bfloat16), kr)
        if MODE == MODE_AB:
            uA = -beta[None, :] * tl.dot(SA.to(tl.bfloat16), kdT)  # mutant-anchor: maps-uA
            UA = tl.dot(uA.to(tl.float16), invT)
            SA = SA * gt[None, :] + tl.dot(UA.to(tl.bfloat16), kr)  # mutant-anchor: maps-SA-update

    a_off = (s * H + h).to(tl.int64) * K * K + kk[None, :] * K + cols[:, None]  # mutant-anchor: maps-a-off
    if MODE == MODE_A:
        tl.store(aseg_ptr + a_off, S.to(aseg_ptr.dtype.element_ty))
    else:
        # mutant-anchor: maps-store-b
        tl.store(bseg_ptr + (s * H + h).to(tl.int64) * K * V + kk[None, :] * V + cols[:, None], S)
        if MODE == MODE_AB:
            tl.store(aseg_ptr + a_off, SA.to(aseg_ptr.dtype.element_ty))


@triton.jit
def scan_kernel(
    seg_off_ptr, aseg_ptr, bseg_ptr, hin_ptr,
    h0_ptr, idx_ptr, has_ptr, shn, shh, shk, shv,
    H,
    H0: tl.constexpr, PAGED: tl.constexpr, PREFETCH: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BW: tl.constexpr, SPLIT: tl.constexpr,
):
    """Pass B, one program = (sequence n, head h) x BW columns:
    h = h0;  for each segment s of n in order: h_in[s] = h;  h <- A_seg[s] h + b_seg[s], with
    SPLIT = False: bf16(A_seg) bf16(h) (one bf16 MMA; A_seg stored bf16, the production recipe);
    SPLIT = True:  A_seg stored fp32, A = A_hi + A_lo and h = h_hi + h_lo in bf16 parts,
                   A h ~ A_hi h_hi + A_hi h_lo + A_lo h_hi (three bf16 MMAs, ~16 significant bits),
                   which keeps the scan's rounding below the chunk steps' own."""
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    kk = tl.arange(0, K)
    S = _initial_state(h0_ptr, idx_ptr, has_ptr, n, h, shn, shh, shk, shv, kk, cols, H0, PAGED, K, BW)
    s0 = tl.load(seg_off_ptr + n)  # mutant-anchor: scan-s0
    s1 = tl.load(seg_off_ptr + n + 1)
    a_tile = kk[:, None] * K + kk[None, :]
    v_tile = kk[:, None] * V + cols[None, :]
    if PREFETCH:
        first = (s0 * H + h).to(tl.int64)
        live = s0 < s1
        A_next = tl.load(aseg_ptr + first * K * K + a_tile, mask=live & (a_tile >= 0), other=0.0)
        b_next = tl.load(bseg_ptr + first * K * V + v_tile, mask=live & (v_tile >= 0), other=0.0)
    for s in range(s0, s1):
        cur = (s * H + h).to(tl.int64)
        tl.store(hin_ptr + cur * K * V + v_tile, S)  # mutant-anchor: scan-store-h-in
        if PREFETCH:
            A = A_next
            bb = b_next
            nxt = ((s + 1) * H + h).to(tl.int64)  # mutant-anchor: scan-next
            live = (s + 1) < s1
            A_next = tl.load(aseg_ptr + nxt * K * K + a_tile, mask=live & (a_tile >= 0), other=0.0)
            b_next = tl.load(bseg_ptr + nxt * K * V + v_tile, mask=live & (v_tile >= 0), other=0.0)
        else:
            A = tl.load(aseg_ptr + cur * K * K + a_tile)
            bb = tl.load(bseg_ptr + cur * K * V + v_tile)  # mutant-anchor: scan-load-b-plain
        if not SPLIT:  # mutant-anchor: scan-update
            S = tl.dot(A.to(tl.bfloat16), S.to(tl.bfloat16)) + bb
        else:
            hi = S.to(tl.bfloat16)
            lo = (S - hi.to(tl.float32)).to(tl.bfloat16)
            Af = A.to(tl.float32)
            Ahi = Af.to(tl.bfloat16)
            Alo = (Af - Ahi.to(tl.float32)).to(tl.bfloat16)
            S = tl.dot(Alo, hi, tl.dot(Ahi, lo, tl.dot(Ahi, hi, bb)))  # mutant-anchor: scan-split-update


# ----------------------------------------------------------------------------------- launchers
def _walk_maps(plan, ws, H, mode, v=None, A_seg=None, b_seg=None, bw=32, warps=STEP_WARPS):
    """Launch segment_map_kernel (pass A) in ``mode`` (MODE_B / MODE_A / MODE_AB)."""
    any_t = ws["ws_gt"] if ws["ws_gt"].numel() else plan.segs
    launch(segment_map_kernel, (plan.num_segs * H, D // bw),
        plan.segs, v if v is not None else any_t, *(v.stride() if v is not None else (0, 0, 0, 0)),
        ws["ws_kd"], ws["ws_kr"], ws["ws_gt"], ws["ws_inv"], ws["ws_beta"],
        A_seg if A_seg is not None else any_t, b_seg if b_seg is not None else any_t,
        H, plan.total_tiles, no_tokens=plan.total_tiles == 0,
        MODE=mode.value, C=C, K=D, V=D, BW=bw, num_warps=warps, num_stages=STEP_STAGES)


def run_pass_a(ws: dict, v, plan: Plan, H: int, variant: str = "fused", bw: int = 32, warps: int = STEP_WARPS,
               scan: str = "split"):
    """Pass A: (A_seg [segs,H,K,K] fp32 for the split scan / bf16, b_seg fp32 [segs,H,K,V])."""
    dev = ws["ws_gt"].device
    A_seg = empty("A_seg", (plan.num_segs, H, D, D), A_SEG_DTYPE[scan], dev)
    b_seg = empty("b_seg", (plan.num_segs, H, D, D), torch.float32, dev)
    if variant == "fused":
        _walk_maps(plan, ws, H, MODE_AB, v=v, A_seg=A_seg, b_seg=b_seg, bw=bw, warps=warps)
    elif variant == "two":
        _walk_maps(plan, ws, H, MODE_B, v=v, b_seg=b_seg, bw=bw, warps=warps)
        _walk_maps(plan, ws, H, MODE_A, A_seg=A_seg, bw=bw, warps=warps)
    else:
        fail(f"pass A variant: expected two|fused, got {variant!r}")
    return A_seg, b_seg


def run_pass_b(A_seg, b_seg, plan: Plan, H: int, h0: Optional[StateRef], prefetch: bool = True, bw: int = SCAN_BW,
               warps: int = SCAN_WARPS, scan: str = "split"):
    """Pass B: h_in fp32 [segs,H,K,V], the true incoming state of every segment (``scan``:
    "split" = three-MMA hi/lo products of an fp32 A_seg, "bf16" = one bf16 MMA)."""
    A_seg = A_seg.to(A_SEG_DTYPE[scan])
    h_in = empty("h_in", (plan.num_segs, H, D, D), torch.float32, b_seg.device)
    hs = h0 if h0 is not None else StateRef(b_seg, (0, 0, 0, 0))
    launch(scan_kernel, (plan.N * H, D // bw),
        plan.seg_off, A_seg, b_seg, h_in,
        hs.tensor, hs.indices if hs.paged else b_seg, hs.has if hs.paged else b_seg, *hs.strides,
        H, no_tokens=plan.total_tiles == 0, H0=H0_NONE.value if h0 is None else H0_SEQ.value, PAGED=hs.paged,
        PREFETCH=bool(prefetch), SPLIT=scan == "split",
        K=D, V=D, BW=bw, num_warps=scan_warps(warps, scan))
    return h_in
