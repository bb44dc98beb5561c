"""Pass C, the chunk walk with outputs: ``segment_kernel`` and its launcher ``run_pass_c``.

One program = (segment s, head h) x BW columns of the fp32 state S [K, BW]; for each chunk j
of the segment (workspace of K1, bf16 dot operands, fp32 accumulation):
    U = INV fp16(beta (v - kd bf16(S)))
    o = qd bf16(S) + Mqk fp16(U)                          (o [C, BW], rows past the end masked)
    S <- diag(gt) S + kr^T bf16(U)
starting from h_in[s] (segmented, H0_SEG), the sequence's initial state (H0_SEQ) or zeros
(H0_NONE); the last segment of a sequence stores S as its final state (dense or paged).
Columns of S are independent, so the state is split over programs BW columns at a time.
Unsegmented, there is one segment per sequence and this is the whole recurrence.
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from .common import H0_NONE, H0_SEG, H0_SEQ, STEP_STAGES, STEP_WARPS, _initial_state, _segment, _state_offsets, \
    _walk_program
from .launch import D, StateRef, launch
from .plan import C, Plan


@triton.jit
def segment_kernel(
    seg_ptr, v_ptr, svb, svt, svh, svd, o_ptr, sob, sot, soh, sod,
    kd_ptr, qd_ptr, kr_ptr, gt_ptr, inv_ptr, mqk_ptr, wsb_ptr,
    h0_ptr, idx_ptr, has_ptr, shn, shh, shk, shv,
    fs_ptr, fidx_ptr, sfn, sfh, sfk, sfv,
    H, total_tiles,
    H0: tl.constexpr, PAGED: tl.constexpr, STORE_FINAL: tl.constexpr, FINAL_PAGED: tl.constexpr,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BW: tl.constexpr,
):
    """Pass C, one program = (segment s, head h) x BW state columns: walks the segment's chunks
    from its initial state S [K, BW], writing o and (last segment) the final state."""
    s, h, cols, kk, rows = _walk_program(H, C, K, BW)
    chunk_base, nch, n, is_last, b, t0, t_end = _segment(seg_ptr, s)
    if H0 == H0_SEG:
        S = _initial_state(h0_ptr, idx_ptr, has_ptr, s, h, shn, shh, shk, shv, kk, cols, H0, PAGED, K, BW)
    else:
        S = _initial_state(h0_ptr, idx_ptr, has_ptr, n, h, shn, shh, shk, shv, kk, cols, H0, PAGED, K, BW)

    tile_off = rows[:, None] * K + kk[None, :]
    sq_off = rows[:, None] * C + rows[None, :]
    for j in range(0, nch):
        ws = (h * total_tiles + chunk_base + j).to(tl.int64)
        kd = tl.load(kd_ptr + ws * (C * K) + tile_off)
        kr = tl.load(kr_ptr + ws * (C * K) + tile_off)
        inv = tl.load(inv_ptr + ws * (C * C) + sq_off)
        gt = tl.load(gt_ptr + ws * K + kk)
        beta = tl.load(wsb_ptr + ws * C + rows)
        tok = t0 + j * C + rows
        vmask = (tok < t_end)[:, None]
        v = tl.load(v_ptr + b * svb + tok[:, None].to(tl.int64) * svt + h * svh + cols[None, :] * svd,
                    mask=vmask, other=0.0).to(tl.float32)
        Sb = S.to(tl.bfloat16)
        u = beta[:, None] * (v - tl.dot(kd, Sb))  # mutant-anchor: walk-u
        U = tl.dot(inv, u.to(tl.float16))
        qd = tl.load(qd_ptr + ws * (C * K) + tile_off)
        mqk = tl.load(mqk_ptr + ws * (C * C) + sq_off)
        o = tl.dot(qd, Sb) + tl.dot(mqk, U.to(tl.float16))
        # mutant-anchor: walk-store-o
        tl.store(o_ptr + b * sob + tok[:, None].to(tl.int64) * sot + h * soh + cols[None, :] * sod,
                 o.to(o_ptr.dtype.element_ty), mask=vmask)
        S = S * gt[:, None] + tl.dot(tl.trans(kr), U.to(tl.bfloat16))  # mutant-anchor: walk-state-update

    if STORE_FINAL:
        if FINAL_PAGED:
            # mutant-anchor: walk-final-paged
            off = _state_offsets(tl.load(fidx_ptr + n), h, sfn, sfh, sfk, sfv, kk, cols)
        else:
            off = _state_offsets(n, h, sfn, sfh, sfk, sfv, kk, cols)  # mutant-anchor: walk-final-dense
        tl.store(fs_ptr + off, S, mask=(is_last != 0) & (off >= 0))  # mutant-anchor: walk-store-final


# ----------------------------------------------------------------------------------- launcher
def run_pass_c(ws: dict, v, o, plan: Plan, H: int, h_in=None, h0: Optional[StateRef] = None,
               final: Optional[StateRef] = None, bw: int = 32, warps: int = STEP_WARPS):
    """Pass C: outputs o (written in place) and, from each sequence's last segment, the final
    state into ``final``.  Starts each segment from h_in[s] (segmented) or from h0 (one segment
    per sequence)."""
    if h_in is not None:
        src, mode = StateRef(h_in, tuple(h_in.stride())), H0_SEG.value  # mutant-anchor: walk-h0-seg
    else:
        src, mode = h0, (H0_NONE.value if h0 is None else H0_SEQ.value)
    any_t = ws["ws_gt"] if ws["ws_gt"].numel() else plan.segs
    hs = src if src is not None else StateRef(any_t, (0, 0, 0, 0))
    fs = final if final is not None else StateRef(any_t, (0, 0, 0, 0))
    launch(segment_kernel, (plan.num_segs * H, D // bw),
        plan.segs, v, *v.stride(), o, *o.stride(),
        ws["ws_kd"], ws["ws_qd"], ws["ws_kr"], ws["ws_gt"], ws["ws_inv"], ws["ws_mqk"], ws["ws_beta"],
        hs.tensor, hs.indices if hs.paged else any_t, hs.has if hs.paged else any_t, *hs.strides,
        fs.tensor, fs.indices if fs.paged else any_t, *fs.strides,
        H, plan.total_tiles, no_tokens=plan.total_tiles == 0,
        H0=mode, PAGED=hs.paged, STORE_FINAL=final is not None, FINAL_PAGED=fs.paged,
        C=C, K=D, V=D, BW=bw, num_warps=warps, num_stages=STEP_STAGES)
    return o
