"""K1 (prepare), one program per (tile, head): the kernels and their launcher ``run_k1``.

A tile is C = 32 rows (tokens) of one sequence x D = 128 channels; everything is fp32:
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

Workspace, per (tile, head) ws = h * total_tiles + tile (WORKSPACE_TILE_SHAPES):
    ws_kd, ws_qd, ws_kr [C, D] bf16;  ws_gt [D] fp32;  ws_inv, ws_mqk [C, C] fp16;  ws_beta [C] fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import D, empty, fail, launch
from .plan import C, Plan
from .routes import K1_CHOICES

BC = 16          # diagonal block of the inverse
NUM_DOUBLING = BC.bit_length() - 2  # mutant-anchor: k1-num-doubling
K1_WARPS = 4
K1_INV_WARPS = {"bf16x6": 2, "ieee": 4}     # k1_inverse_kernel, by INV_PREC (docs/triton-flashkda.md)

WORKSPACE_DTYPES = {"ws_kd": torch.bfloat16, "ws_qd": torch.bfloat16, "ws_kr": torch.bfloat16,
                    "ws_gt": torch.float32, "ws_inv": torch.float16, "ws_mqk": torch.float16,
                    "ws_beta": torch.float32}
WORKSPACE_TILE_SHAPES = {"ws_kd": (C, D), "ws_qd": (C, D), "ws_kr": (C, D), "ws_gt": (D,),   # per (tile, head)
                         "ws_inv": (C, C), "ws_mqk": (C, C), "ws_beta": (C,)}


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
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]  # mutant-anchor: k1-l2norm-k
    if HAS_BIAS:
        g = g + tl.load(bias_ptr + h * D + cols).to(tl.float32)[None, :]
    a = tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)  # mutant-anchor: k1-gate
    beta = tl.where(rmask, tl.sigmoid(braw), 0.0)  # mutant-anchor: k1-beta
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
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))  # mutant-anchor: k1-rate
    q, k, a, beta, rows, _ = _k1_rows(q_ptr, k_ptr, g_ptr, beta_ptr, bias_ptr, b, t0, h, 0, Lc, rate, lower_bound,
                                      sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sgd, sbb, sbt, sbh,
                                      HAS_BIAS, C, D)
    # No row masks below: q and k are 0 past Lc, and every decay factor there is finite (a = 0
    # past Lc, so those rows' G is row Lc-1's), so the tail rows of every tile are 0 as they are.
    G = tl.cumsum(a, 0) * 1.4426950408889634  # mutant-anchor: k1-cumsum
    ri = rows[:, None]
    G_last = tl.sum(tl.where(ri == Lc - 1, G, 0.0), 0)  # mutant-anchor: k1-g-last

    ws = (h * total_tiles + tile).to(tl.int64)
    tile_off = ws * (C * D) + ri * D + cols[None, :]
    eG = tl.exp2(G)
    tl.store(kd_ptr + tile_off, (k * eG).to(tl.bfloat16))
    tl.store(qd_ptr + tile_off, ((scale * q) * eG).to(tl.bfloat16))  # mutant-anchor: k1-store-qd
    tl.store(kr_ptr + tile_off, (k * tl.exp2(G_last[None, :] - G)).to(tl.bfloat16))  # mutant-anchor: k1-store-kr
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
    G_p0 = tl.sum(tl.where(ri == p0, G, 0.0), 0)[None, :]  # mutant-anchor: k1-pivot-p0
    G_p1 = tl.sum(tl.where(ri == p1, G, 0.0), 0)[None, :]
    Gd = G - tl.where(ri < BC, G_p0, G_p1)  # mutant-anchor: k1-pivot-select
    up = tl.exp2(Gd)
    kp = (k * up).to(tl.bfloat16)
    qp = ((scale * q) * up).to(tl.bfloat16)  # mutant-anchor: k1-qp-diag
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
    L = tl.where(ri > cj, -beta[:, None] * kk, 0.0)  # mutant-anchor: k1-L
    mqk = tl.where(ri >= cj, qk, 0.0)  # mutant-anchor: k1-mqk
    sq_off = ws * (C * C) + ri * C + cj
    tl.store(mqk_ptr + sq_off, mqk.to(tl.float16))
    tl.store(l_ptr + sq_off, L)


@triton.jit
def k1_inverse_kernel(l_ptr, inv_ptr, C: tl.constexpr, BC: tl.constexpr, NUM_DOUBLING: tl.constexpr,
                      INV_PREC: tl.constexpr):
    """The second launch of K1, one program per (tile, head): ws_inv = (I - L)^-1 from ws_L.
    Launched on its own it needs far fewer registers than the rest of K1, so more programs share
    an SM (docs/triton-flashkda.md); the workspace is the same bit for bit."""
    ri = tl.arange(0, C)[:, None]
    cj = tl.arange(0, C)[None, :]
    same_block = (ri // BC) == (cj // BC)
    sq_off = tl.program_id(0).to(tl.int64) * (C * C) + ri * C + cj
    L = tl.load(l_ptr + sq_off)  # mutant-anchor: k1-load-L
    inv = _neumann(tl.where(same_block, L, 0.0), NUM_DOUBLING, INV_PREC, C)   # both diagonal blocks at once
    L_off = tl.where(same_block, 0.0, L)
    inv = inv + _dot_f32(inv, _dot_f32(L_off, inv, INV_PREC), INV_PREC)  # mutant-anchor: k1-merge
    tl.store(inv_ptr + sq_off, inv.to(tl.float16))  # mutant-anchor: k1-store-inv


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
    Gb = (tl.cumsum(ab, 0) + tl.sum(at, 0)[None, :]) * 1.4426950408889634  # mutant-anchor: halves-Gb
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
    kk10 = tl.dot(_pivoted(kb, Gb - G_po, mb), kiT)  # mutant-anchor: halves-kk10
    qk10 = tl.dot(_pivoted(sqb_, Gb - G_po, mb), kiT)

    i = tl.arange(0, BC)
    lower = i[:, None] > i[None, :]
    on_or_below = i[:, None] >= i[None, :]
    sq_off = ws * (C * C) + i[:, None] * C + i[None, :]
    tl.store(mqk_ptr + sq_off, tl.where(on_or_below, qk00, 0.0).to(tl.float16))
    tl.store(mqk_ptr + sq_off + BC, tl.zeros([BC, BC], dtype=tl.float16))
    tl.store(mqk_ptr + sq_off + BC * C, qk10.to(tl.float16))  # mutant-anchor: halves-store-mqk10
    tl.store(mqk_ptr + sq_off + BC * C + BC, tl.where(on_or_below, qk11, 0.0).to(tl.float16))

    L00 = tl.where(lower, -bt[:, None] * kk00, 0.0)
    L11 = tl.where(lower, -bb[:, None] * kk11, 0.0)
    L10 = -bb[:, None] * kk10  # mutant-anchor: halves-L10
    X0 = _neumann(L00, NUM_DOUBLING, INV_PREC, BC)
    X1 = _neumann(L11, NUM_DOUBLING, INV_PREC, BC)
    X10 = _dot_f32(X1, _dot_f32(L10, X0, INV_PREC), INV_PREC)  # mutant-anchor: halves-X10
    tl.store(inv_ptr + sq_off, X0.to(tl.float16))
    tl.store(inv_ptr + sq_off + BC, tl.zeros([BC, BC], dtype=tl.float16))
    tl.store(inv_ptr + sq_off + BC * C, X10.to(tl.float16))
    tl.store(inv_ptr + sq_off + BC * C + BC, X1.to(tl.float16))


# ----------------------------------------------------------------------------------- launcher
def alloc_workspace(H: int, tiles: int, device) -> dict:
    """The seven workspace buffers, [H*tiles, *WORKSPACE_TILE_SHAPES[name]] each."""
    return {n: empty(n, (H * tiles, *s), WORKSPACE_DTYPES[n], device) for n, s in WORKSPACE_TILE_SHAPES.items()}


def run_k1(q, k, g, beta, A_log, dt_bias, scale: float, lower_bound: float, plan: Plan, ws: dict,
           inv: str = "ieee", k1: str = "tile") -> dict:
    """K1 over every (tile, head): fills the workspace dict in place and returns it.  ``inv``:
    the inverse's fp32 products, "ieee" (FMAs) or "bf16x6" (tensor cores, fp32's 24 bits);
    ``k1``: "tile" (k1_prepare_kernel, then k1_inverse_kernel from L, which it adds to the dict
    as ws_L, fp32 [H*tiles, C, C]) or "halves" (k1_prepare_halves_kernel, one launch, same workspace)."""
    H = q.shape[2]
    if plan.total_tiles == 0:
        return ws
    bias = dt_bias.reshape(-1) if dt_bias is not None else A_log
    if k1 not in K1_CHOICES:
        fail(f"k1: expected {'|'.join(K1_CHOICES)}, got {k1!r}")
    inputs = (q, k, g, beta, A_log, bias, plan.tiles)
    scalars = (*q.stride(), *k.stride(), *g.stride(), *beta.stride(), plan.total_tiles, float(scale),
               float(lower_bound))
    if k1 == "halves":
        launch(k1_prepare_halves_kernel, (plan.total_tiles, H), *inputs,
            ws["ws_kd"], ws["ws_qd"], ws["ws_kr"], ws["ws_gt"], ws["ws_inv"], ws["ws_mqk"], ws["ws_beta"], *scalars,
            HAS_BIAS=dt_bias is not None, C=C, D=D, BC=BC, NUM_DOUBLING=NUM_DOUBLING, INV_PREC=inv,
            num_warps=K1_WARPS)
        return ws
    ws["ws_L"] = empty("ws_L", (H * plan.total_tiles, C, C), torch.float32, q.device)
    launch(k1_prepare_kernel, (plan.total_tiles, H), *inputs,
        ws["ws_kd"], ws["ws_qd"], ws["ws_kr"], ws["ws_gt"], ws["ws_L"], ws["ws_mqk"], ws["ws_beta"], *scalars,
        HAS_BIAS=dt_bias is not None, C=C, D=D, BC=BC, num_warps=K1_WARPS)
    launch(k1_inverse_kernel, (H * plan.total_tiles,), ws["ws_L"], ws["ws_inv"],
        C=C, BC=BC, NUM_DOUBLING=NUM_DOUBLING, INV_PREC=inv, num_warps=K1_INV_WARPS[inv])
    return ws
