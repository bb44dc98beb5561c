"""JIT helpers shared by the chunk walks (passes A and C) and the scan (pass B): the plan's
segment records, the program's coordinates, state tiles and their initial values.

A state stack is addressed K-first: element (row, h, k, v) at ``row*sn + h*sh + k*sk + v*sv``
(launch.StateRef); a program holds the [K, BW] tile of columns ``cols`` of one state.
"""
from __future__ import annotations

import triton
import triton.language as tl

# initial-state sources (constexpr H0 of segment_kernel and scan_kernel)
H0_NONE = tl.constexpr(0)       # zeros
H0_SEQ = tl.constexpr(1)        # dense / paged state of the segment's sequence
H0_SEG = tl.constexpr(2)        # h_in[s] of pass B

STEP_WARPS = 4       # warps of a chunk-walk program (passes A and C)
STEP_STAGES = 3      # software-pipelined workspace loads of the chunk walk (docs/triton-flashkda.md)


@triton.jit
def _state_offsets(row, h, sn, sh, sk, sv, kk, cols):
    """Offsets of the [K, BW] tile of state `row` in a K-first view with strides (sn, sh, sk, sv)."""
    return row.to(tl.int64) * sn + h * sh + kk[:, None].to(tl.int64) * sk + cols[None, :].to(tl.int64) * sv


@triton.jit
def _initial_state(h0_ptr, idx_ptr, has_ptr, row, h, sn, sh, sk, sv, kk, cols,
                   H0: tl.constexpr, PAGED: tl.constexpr, K: tl.constexpr, BW: tl.constexpr):
    """The fp32 initial state tile [K, BW] of `row` (a sequence, or a segment when H0 == H0_SEG):
    zeros for H0_NONE.  Paged: the slot state_indices[row] is read only when has_initial_state[row]."""
    if H0 == H0_NONE:
        S = tl.zeros([K, BW], dtype=tl.float32)
    elif PAGED:
        slot = tl.load(idx_ptr + row)  # mutant-anchor: h0-paged-slot
        has = tl.load(has_ptr + row) != 0
        off = _state_offsets(slot, h, sn, sh, sk, sv, kk, cols)
        S = tl.load(h0_ptr + off, mask=has & (off >= 0), other=0.0).to(tl.float32)  # mutant-anchor: h0-paged-load
    else:
        # mutant-anchor: h0-dense-load
        S = tl.load(h0_ptr + _state_offsets(row, h, sn, sh, sk, sv, kk, cols)).to(tl.float32)
    return S


@triton.jit
def _segment(seg_ptr, s):
    """Segment s of the plan (8 int32 per segment): its first chunk (tile index), chunk count,
    sequence n, is-last flag, batch row b (int64), first token and end token."""
    return (tl.load(seg_ptr + s * 8), tl.load(seg_ptr + s * 8 + 1), tl.load(seg_ptr + s * 8 + 2),
            tl.load(seg_ptr + s * 8 + 3), tl.load(seg_ptr + s * 8 + 4).to(tl.int64),
            tl.load(seg_ptr + s * 8 + 5), tl.load(seg_ptr + s * 8 + 6))


@triton.jit
def _walk_program(H, C: tl.constexpr, K: tl.constexpr, BW: tl.constexpr):
    """This chunk-walk program's segment s and head h (axis 0 = s * H + h), its BW state columns
    (axis 1), and the index vectors kk = 0..K-1 and rows = 0..C-1."""
    pid = tl.program_id(0)
    return pid // H, pid % H, tl.program_id(1) * BW + tl.arange(0, BW), tl.arange(0, K), tl.arange(0, C)
