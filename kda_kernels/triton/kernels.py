"""The Triton kernels of our FlashKDA forward: K1 (prepare), the chunk walks (pass A's maps,
pass C's outputs), and the segment scan (pass B).  Math: docs/design.md; design: docs/triton-flashkda.md.

K1, one program per (tile, head), C = 32 rows x D = 128 channels, all in fp32:
    q^, k^ = x / sqrt(sum x^2 + 1e-6)
    a      = lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))        (0 on tail rows)
    G_i    = log2(e) * sum_{s<=i} a_s,   G_last = G_{Lc-1}
    ws_kd  = k^ 2^G,  ws_qd = scale q^ 2^G,  ws_kr = k^ 2^(G_last - G),  ws_gt = 2^G_last
    pivots (C = 32, BC = 16): rows of 16-block b pivot on p_b = min(16b + 8, Lc-1) for the
    diagonal blocks, on p = min(16, Lc-1) for the off-diagonal block; with G~ = G - G_p:
        kp = bf16(k^ 2^G~), qp = bf16(scale q^ 2^G~), ki = bf16(k^ 2^-G~)
    L   = -beta_i (kp ki^T)_ij  for i > j   (selected with tl.where: the upper triangle may be inf)
    Mqk = (qp ki^T)_ij           for i >= j
    INV = (I - L)^-1 (a second launch, k1_inverse_kernel, from L stored fp32 as ws_L):
          the 16x16 diagonal blocks D by Neumann doubling
          (I+D)(I+D^2)(I+D^4)(I+D^8) = sum_{n<16} D^n, then one merge
          INV <- INV + INV (L_off INV), all fp32 dots: IEEE FMAs (INV_PREC = "ieee", the
          production recipe) or "bf16x6", six bf16 tensor-core products of 3-way bf16 splits,
          which carries the 24 significant bits of fp32 (the result is stored fp16 anyway).

Chunk step (fp32 state S [K, BW], bf16 dot operands, fp32 accumulation):
    U = INV fp16(beta (v - kd bf16(S)))
    o = qd bf16(S) + Mqk fp16(U)
    S <- diag(gt) S + kr^T bf16(U)
Pass C (segment_kernel) runs it from h_in with outputs.  Pass A (segment_map_kernel) runs it
from S = 0 with v (-> b_seg) and from S = I without v (u = -beta kd S, -> A_seg), on the
transposed state S^T [BW, K], so that its products have BW rows instead of C = 32.  Columns
of S are independent, so the state is split over programs BW columns at a time.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._interpreter_compat import install as _install_interpreter_compat

_install_interpreter_compat()

LOG2E = 1.4426950408889634

# pass-A modes of segment_map_kernel
MODE_B = 1        # b_seg: from 0, with v
MODE_A = 2        # A_seg: from I, without v
MODE_AB = 3       # both in one launch (K == V)

# initial-state sources
H0_NONE = 0       # zeros
H0_SEQ = 1        # dense / paged state of the segment's sequence
H0_SEG = 2        # h_in[s] of pass B


@triton.jit
def _split3(x):
    """x = hi + mid + lo in bf16 parts (24 significant bits: fp32's, bar the exponent range)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _dot_f32(a, b, PREC: tl.constexpr):
    """An fp32 product a @ b: IEEE FMAs (PREC = "ieee"), or (PREC = "bf16x6") the six bf16
    tensor-core products of 3-way splits whose terms reach 2^-24 relative, summed small first:
    a_lo b_hi + a_mid b_mid + a_hi b_lo + a_mid b_hi + a_hi b_mid + a_hi b_hi.  Spelled out here
    (not input_precision="bf16x6") so that Triton's interpreter runs the same arithmetic."""
    if PREC == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    else:
        ah, am, al = _split3(a)
        bh, bm, bl = _split3(b)
        acc = tl.dot(al, bh)
        acc = tl.dot(am, bm, acc)
        acc = tl.dot(ah, bl, acc)
        acc = tl.dot(am, bh, acc)
        acc = tl.dot(ah, bm, acc)
        return tl.dot(ah, bh, acc)


@triton.jit
def _k1_rows(q_ptr, k_ptr, g_ptr, beta_ptr, bias_ptr, b, t0, h, r0, Lc, rate, lower_bound,
             sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
             HAS_BIAS: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """Rows r0 .. r0+R-1 of a tile (the whole tile, or one half for k1=halves): l2-normalised
    q, k, the gate a (0 past Lc), beta (0 past Lc), the row indices and the row mask [R, 1]."""
    rows = r0 + tl.arange(0, R)
    cols = tl.arange(0, D)
    rmask = rows < Lc
    m2 = rmask[:, None]
    tok = (t0 + rows)[:, None]
    q = tl.load(q_ptr + b * sqb + tok * sqt + h * sqh + cols[None, :] * sqd, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * skb + tok * skt + h * skh + cols[None, :] * skd, mask=m2, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sgb + tok * sgt + h * sgh + cols[None, :] * sgd, mask=m2, other=0.0).to(tl.float32)
    braw = tl.load(beta_ptr + b * sbb + (t0 + rows) * sbt + h * sbh, mask=rmask, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None]    # one division per row, not per element
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]
    if HAS_BIAS:
        g = g + tl.load(bias_ptr + h * D + cols).to(tl.float32)[None, :]
    a = tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)
    beta = tl.where(rmask, tl.sigmoid(braw), 0.0)
    return q, k, a, beta, rows, m2


@triton.jit
def _tile(tile_ptr, tile):
    """Tile `tile` of the plan (4 int32 per tile): its batch row b and first token t0 (int64),
    and its valid rows Lc."""
    return (tl.load(tile_ptr + tile * 4).to(tl.int64), tl.load(tile_ptr + tile * 4 + 1).to(tl.int64),
            tl.load(tile_ptr + tile * 4 + 2))


@triton.jit
def k1_prepare_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, alog_ptr, bias_ptr, tile_ptr,
    kd_ptr, qd_ptr, kr_ptr, gt_ptr, l_ptr, mqk_ptr, wsb_ptr,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
    total_tiles, scale, lower_bound,
    HAS_BIAS: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BC: tl.constexpr,
):
    """K1 but the inverse: the workspace tiles, ws_mqk, ws_gt, ws_beta and L (fp32, ws_L), which
    k1_inverse_kernel turns into ws_inv."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b, t0, Lc = _tile(tile_ptr, tile)
    cols = tl.arange(0, D)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    q, k, a, beta, rows, _ = _k1_rows(q_ptr, k_ptr, g_ptr, beta_ptr, bias_ptr, b, t0, h, 0, Lc, rate, lower_bound,
                                      sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
                                      HAS_BIAS, C, D)
    # No row masks below: q and k are 0 past Lc, and every decay factor there is finite (a = 0
    # past Lc, so those rows' G is row Lc-1's), so the tail rows of every tile are 0 as they are.
    # (The selects cost 15% of this kernel's sm90 instructions: 4272 -> 3616.)
    G = tl.cumsum(a, 0) * 1.4426950408889634
    ri = rows[:, None]
    G_last = tl.sum(tl.where(ri == Lc - 1, G, 0.0), 0)

    ws = (h * total_tiles + tile).to(tl.int64)
    tile_off = ws * (C * D) + ri * D + cols[None, :]
    eG = tl.exp2(G)
    tl.store(kd_ptr + tile_off, (k * eG).to(tl.bfloat16))
    tl.store(qd_ptr + tile_off, ((scale * q) * eG).to(tl.bfloat16))
    tl.store(kr_ptr + tile_off, (k * tl.exp2(G_last[None, :] - G)).to(tl.bfloat16))
    tl.store(gt_ptr + ws * D + cols, tl.exp2(G_last))
    tl.store(wsb_ptr + ws * C + rows, beta)

    # Pivoted factors.  Diagonal 16-row blocks pivot on their middle row (b*16 + 8), so a factor
    # spans at most 8 rows of decay (2^{+-63.5} at lb = -5.5); the off-diagonal block (rows >= 16,
    # columns < 16) pivots on row 16, where a factor only reaches 2^{-127} in column 0, whose
    # entries are below 2^{-127} themselves.  One pivot for the whole chunk (row 16) would put the
    # factors of the first rows at 2^{+-127} (bf16 subnormals) and lose the diagonal of Mqk.
    cj = tl.arange(0, C)[None, :]
    same_block = (ri // BC) == (cj // BC)
    p0 = tl.minimum(BC // 2, Lc - 1)
    p1 = tl.minimum(BC + BC // 2, Lc - 1)
    G_p0 = tl.sum(tl.where(ri == p0, G, 0.0), 0)[None, :]
    G_p1 = tl.sum(tl.where(ri == p1, G, 0.0), 0)[None, :]
    Gd = G - tl.where(ri < BC, G_p0, G_p1)
    up = tl.exp2(Gd)
    kp = (k * up).to(tl.bfloat16)
    qp = ((scale * q) * up).to(tl.bfloat16)
    kiT = tl.trans((k * tl.exp2(-Gd)).to(tl.bfloat16))
    kk_diag = tl.dot(kp, kiT)
    qk_diag = tl.dot(qp, kiT)
    Go = G - tl.sum(tl.where(ri == tl.minimum(BC, Lc - 1), G, 0.0), 0)[None, :]
    up = tl.exp2(Go)
    kp = (k * up).to(tl.bfloat16)
    qp = ((scale * q) * up).to(tl.bfloat16)
    kiT = tl.trans((k * tl.exp2(-Go)).to(tl.bfloat16))
    kk = tl.where(same_block, kk_diag, tl.dot(kp, kiT))
    qk = tl.where(same_block, qk_diag, tl.dot(qp, kiT))
    L = tl.where(ri > cj, -beta[:, None] * kk, 0.0)
    mqk = tl.where(ri >= cj, qk, 0.0)
    sq_off = ws * (C * C) + ri * C + cj
    tl.store(mqk_ptr + sq_off, mqk.to(tl.float16))
    tl.store(l_ptr + sq_off, L)


@triton.jit
def k1_inverse_kernel(l_ptr, inv_ptr, C: tl.constexpr, BC: tl.constexpr, NUM_DOUBLING: tl.constexpr,
                      INV_PREC: tl.constexpr):
    """The second launch of K1, one program per (tile, head): ws_inv = (I - L)^-1 from ws_L.
    Launched on its own it needs far fewer registers than the rest of K1, so more programs share
    an SM (H200, 1x16384x12: K1 402 -> 371 us with bf16x6, the same workspace bit for bit)."""
    ri = tl.arange(0, C)[:, None]
    cj = tl.arange(0, C)[None, :]
    same_block = (ri // BC) == (cj // BC)
    sq_off = tl.program_id(0).to(tl.int64) * (C * C) + ri * C + cj
    L = tl.load(l_ptr + sq_off)
    inv = _neumann(tl.where(same_block, L, 0.0), NUM_DOUBLING, INV_PREC, C)   # both diagonal blocks at once
    L_off = tl.where(same_block, 0.0, L)
    inv = inv + _dot_f32(inv, _dot_f32(L_off, inv, INV_PREC), INV_PREC)
    tl.store(inv_ptr + sq_off, inv.to(tl.float16))


@triton.jit
def _row_of(G, rows, r):
    """Row r of G [BC, D] as a [1, D] vector (zeros when r is not among ``rows``)."""
    return tl.sum(tl.where(rows[:, None] == r, G, 0.0), 0)[None, :]


@triton.jit
def _pivoted(x, Gd, m2):
    """bf16(x 2^Gd) on valid rows, 0 elsewhere."""
    return tl.where(m2, x * tl.exp2(Gd), 0.0).to(tl.bfloat16)


@triton.jit
def _neumann(Lb, NUM_DOUBLING: tl.constexpr, INV_PREC: tl.constexpr, BC: tl.constexpr):
    """(I - Lb)^-1 of a strictly lower [BC, BC] matrix whose powers vanish from the 16th on (one
    16x16 block, or the tile's two diagonal blocks side by side):
    (I+D)(I+D^2)(I+D^4)(I+D^8) = sum_{n<16} D^n."""
    i = tl.arange(0, BC)
    inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0) + Lb
    P = _dot_f32(Lb, Lb, INV_PREC)
    for it in tl.static_range(NUM_DOUBLING):
        inv = inv + _dot_f32(inv, P, INV_PREC)
        if it + 1 < NUM_DOUBLING:
            P = _dot_f32(P, P, INV_PREC)
    return inv


@triton.jit
def k1_prepare_halves_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, alog_ptr, bias_ptr, tile_ptr,
    kd_ptr, qd_ptr, kr_ptr, gt_ptr, inv_ptr, mqk_ptr, wsb_ptr,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
    total_tiles, scale, lower_bound,
    HAS_BIAS: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BC: tl.constexpr,
    NUM_DOUBLING: tl.constexpr, INV_PREC: tl.constexpr,
):
    """K1 on the tile's two 16-row halves (route key k1=halves; C = 2*BC = 32): the same
    workspace as k1_prepare_kernel, but the pivoted products are formed block by block,
    kk_00, kk_11 (pivots on rows 8 and 24) and kk_10 (pivot on row 16), [16,128]x[128,16]
    each, instead of two full [32,128]x[128,32] products of which half is thrown away, and the
    inverse is X_b = (I - L_bb)^-1 by doubling on each 16x16 diagonal block, then
    X_10 = X_1 L_10 X_0 (the merge), instead of doubling the masked 32x32 matrix."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b, t0, Lc = _tile(tile_ptr, tile)
    rate_h = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    qt, kt, at, bt, rt, mt = _k1_rows(q_ptr, k_ptr, g_ptr, beta_ptr, bias_ptr, b, t0, h, 0, Lc, rate_h, lower_bound,
                                      sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
                                      HAS_BIAS, BC, D)
    qb, kb, ab, bb, rb, mb = _k1_rows(q_ptr, k_ptr, g_ptr, beta_ptr, bias_ptr, b, t0, h, BC, Lc, rate_h, lower_bound,
                                      sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
                                      HAS_BIAS, BC, D)
    Gt = tl.cumsum(at, 0) * 1.4426950408889634
    Gb = (tl.cumsum(ab, 0) + tl.sum(at, 0)[None, :]) * 1.4426950408889634
    G_last = _row_of(Gt, rt, Lc - 1) + _row_of(Gb, rb, Lc - 1)

    ws = (h * total_tiles + tile).to(tl.int64)
    cols = tl.arange(0, D)
    off_t = ws * (C * D) + rt[:, None] * D + cols[None, :]
    off_b = ws * (C * D) + rb[:, None] * D + cols[None, :]
    eGt = tl.exp2(Gt)
    eGb = tl.exp2(Gb)
    tl.store(kd_ptr + off_t, tl.where(mt, kt * eGt, 0.0).to(tl.bfloat16))
    tl.store(kd_ptr + off_b, tl.where(mb, kb * eGb, 0.0).to(tl.bfloat16))
    tl.store(qd_ptr + off_t, tl.where(mt, (scale * qt) * eGt, 0.0).to(tl.bfloat16))
    tl.store(qd_ptr + off_b, tl.where(mb, (scale * qb) * eGb, 0.0).to(tl.bfloat16))
    tl.store(kr_ptr + off_t, tl.where(mt, kt * tl.exp2(G_last - Gt), 0.0).to(tl.bfloat16))
    tl.store(kr_ptr + off_b, tl.where(mb, kb * tl.exp2(G_last - Gb), 0.0).to(tl.bfloat16))
    tl.store(gt_ptr + ws * D + cols[None, :], tl.exp2(G_last))
    tl.store(wsb_ptr + ws * C + rt, bt)
    tl.store(wsb_ptr + ws * C + rb, bb)

    # pivots as k1_prepare_kernel: rows 8 and 24 for the diagonal blocks, row 16 off the diagonal
    p0 = tl.minimum(BC // 2, Lc - 1)
    p1 = tl.minimum(BC + BC // 2, Lc - 1)
    po = tl.minimum(BC, Lc - 1)
    G_p0 = _row_of(Gt, rt, p0) + _row_of(Gb, rb, p0)
    G_p1 = _row_of(Gt, rt, p1) + _row_of(Gb, rb, p1)
    G_po = _row_of(Gt, rt, po) + _row_of(Gb, rb, po)
    sqt_ = scale * qt
    sqb_ = scale * qb
    kiT = tl.trans(_pivoted(kt, G_p0 - Gt, mt))
    kk00 = tl.dot(_pivoted(kt, Gt - G_p0, mt), kiT)
    qk00 = tl.dot(_pivoted(sqt_, Gt - G_p0, mt), kiT)
    kiT = tl.trans(_pivoted(kb, G_p1 - Gb, mb))
    kk11 = tl.dot(_pivoted(kb, Gb - G_p1, mb), kiT)
    qk11 = tl.dot(_pivoted(sqb_, Gb - G_p1, mb), kiT)
    kiT = tl.trans(_pivoted(kt, G_po - Gt, mt))
    kk10 = tl.dot(_pivoted(kb, Gb - G_po, mb), kiT)
    qk10 = tl.dot(_pivoted(sqb_, Gb - G_po, mb), kiT)

    i = tl.arange(0, BC)
    lower = i[:, None] > i[None, :]
    on_or_below = i[:, None] >= i[None, :]
    sq_off = ws * (C * C) + i[:, None] * C + i[None, :]
    tl.store(mqk_ptr + sq_off, tl.where(on_or_below, qk00, 0.0).to(tl.float16))
    tl.store(mqk_ptr + sq_off + BC, tl.zeros([BC, BC], dtype=tl.float16))
    tl.store(mqk_ptr + sq_off + BC * C, qk10.to(tl.float16))
    tl.store(mqk_ptr + sq_off + BC * C + BC, tl.where(on_or_below, qk11, 0.0).to(tl.float16))

    L00 = tl.where(lower, -bt[:, None] * kk00, 0.0)
    L11 = tl.where(lower, -bb[:, None] * kk11, 0.0)
    L10 = -bb[:, None] * kk10
    X0 = _neumann(L00, NUM_DOUBLING, INV_PREC, BC)
    X1 = _neumann(L11, NUM_DOUBLING, INV_PREC, BC)
    X10 = _dot_f32(X1, _dot_f32(L10, X0, INV_PREC), INV_PREC)
    tl.store(inv_ptr + sq_off, X0.to(tl.float16))
    tl.store(inv_ptr + sq_off + BC, tl.zeros([BC, BC], dtype=tl.float16))
    tl.store(inv_ptr + sq_off + BC * C, X10.to(tl.float16))
    tl.store(inv_ptr + sq_off + BC * C + BC, X1.to(tl.float16))


@triton.jit
def _state_offsets(row, h, sn, sh, sk, sv, kk, cols):
    """Offsets of the [K, BW] tile of state `row` in a K-first view with strides (sn, sh, sk, sv)."""
    return row.to(tl.int64) * sn + h * sh + kk[:, None].to(tl.int64) * sk + cols[None, :].to(tl.int64) * sv


@triton.jit
def _initial_state(h0_ptr, idx_ptr, has_ptr, row, h, sn, sh, sk, sv, kk, cols,
                   H0: tl.constexpr, PAGED: tl.constexpr, K: tl.constexpr, BW: tl.constexpr):
    """The fp32 initial state tile of `row` (a sequence, or a segment when H0 == H0_SEG).
    Paged: the slot state_indices[row] is read only when has_initial_state[row]."""
    if H0 == 0:
        S = tl.zeros([K, BW], dtype=tl.float32)
    elif PAGED:
        slot = tl.load(idx_ptr + row)
        has = tl.load(has_ptr + row) != 0
        off = _state_offsets(slot, h, sn, sh, sk, sv, kk, cols)
        S = tl.load(h0_ptr + off, mask=has & (off >= 0), other=0.0).to(tl.float32)
    else:
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
    if H0 == 2:
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
        u = beta[:, None] * (v - tl.dot(kd, Sb))
        U = tl.dot(inv, u.to(tl.float16))
        qd = tl.load(qd_ptr + ws * (C * K) + tile_off)
        mqk = tl.load(mqk_ptr + ws * (C * C) + sq_off)
        o = tl.dot(qd, Sb) + tl.dot(mqk, U.to(tl.float16))
        tl.store(o_ptr + b * sob + tok[:, None].to(tl.int64) * sot + h * soh + cols[None, :] * sod,
                 o.to(o_ptr.dtype.element_ty), mask=vmask)
        S = S * gt[:, None] + tl.dot(tl.trans(kr), U.to(tl.bfloat16))

    if STORE_FINAL:
        if FINAL_PAGED:
            off = _state_offsets(tl.load(fidx_ptr + n), h, sfn, sfh, sfk, sfv, kk, cols)
        else:
            off = _state_offsets(n, h, sfn, sfh, sfk, sfv, kk, cols)
        tl.store(fs_ptr + off, S, mask=(is_last != 0) & (off >= 0))


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
    if MODE == 2:
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
        if MODE == 2:
            u = -beta[None, :] * tl.dot(S.to(tl.bfloat16), kdT)
        else:
            tok = t0 + j * C + rows
            vT = tl.load(v_ptr + b * svb + tok[None, :].to(tl.int64) * svt + h * svh + cols[:, None] * svd,
                         mask=(tok < t_end)[None, :], other=0.0).to(tl.float32)
            u = beta[None, :] * (vT - tl.dot(S.to(tl.bfloat16), kdT))
        U = tl.dot(u.to(tl.float16), invT)
        S = S * gt[None, :] + tl.dot(U.to(tl.bfloat16), kr)
        if MODE == 3:
            uA = -beta[None, :] * tl.dot(SA.to(tl.bfloat16), kdT)
            UA = tl.dot(uA.to(tl.float16), invT)
            SA = SA * gt[None, :] + tl.dot(UA.to(tl.bfloat16), kr)

    a_off = (s * H + h).to(tl.int64) * K * K + kk[None, :] * K + cols[:, None]
    if MODE == 2:
        tl.store(aseg_ptr + a_off, S.to(aseg_ptr.dtype.element_ty))
    else:
        tl.store(bseg_ptr + (s * H + h).to(tl.int64) * K * V + kk[None, :] * V + cols[:, None], S)
        if MODE == 3:
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
    s0 = tl.load(seg_off_ptr + n)
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
        tl.store(hin_ptr + cur * K * V + v_tile, S)
        if PREFETCH:
            A = A_next
            bb = b_next
            nxt = ((s + 1) * H + h).to(tl.int64)
            live = (s + 1) < s1
            A_next = tl.load(aseg_ptr + nxt * K * K + a_tile, mask=live & (a_tile >= 0), other=0.0)
            b_next = tl.load(bseg_ptr + nxt * K * V + v_tile, mask=live & (v_tile >= 0), other=0.0)
        else:
            A = tl.load(aseg_ptr + cur * K * K + a_tile)
            bb = tl.load(bseg_ptr + cur * K * V + v_tile)
        if not SPLIT:
            S = tl.dot(A.to(tl.bfloat16), S.to(tl.bfloat16)) + bb
        else:
            hi = S.to(tl.bfloat16)
            lo = (S - hi.to(tl.float32)).to(tl.bfloat16)
            Af = A.to(tl.float32)
            Ahi = Af.to(tl.bfloat16)
            Alo = (Af - Ahi.to(tl.float32)).to(tl.bfloat16)
            S = tl.dot(Alo, hi, tl.dot(Ahi, lo, tl.dot(Ahi, hi, bb)))
