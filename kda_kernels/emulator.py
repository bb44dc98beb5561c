"""Emulator baselines: the chunked KDA algorithm in torch with a route's precision recipe.

A recipe says which tensors a production kernel stores in which dtype.  The emulator
computes every product in float64 and rounds explicitly at the recipe's storage points
(``bf16``, ``fp16``, ``fp32``, or ``tf32`` = fp32 with a 10-bit mantissa), so it gives
the same bits on any device.  A dot product "with bf16 operands and fp32 accumulation" is
``fp32(bf16(a) @ bf16(b))`` (products exact in float64, one rounding at the end).

Per chunk of C rows (G_i = log2(e) * chunk-local cumsum of the decay a, fp32):

    kd_i = k_i 2^{G_i}      qd_i = scale q_i 2^{G_i}      kr_i = k_i 2^{G_last - G_i}
    gt   = 2^{G_last}       L_ij = -beta_i sum_d k_id k_jd 2^{G_id - G_jd}   (i > j)
    Mqk_ij = scale sum_d q_id k_jd 2^{G_id - G_jd}   (i >= j)        INV = (I - L)^{-1}
    pair products go through anchored factors  k_i 2^{G_i - A} . k_j 2^{A - G_j}
    (A: the pivot row G_p, p = min(C/2, Lc-1), for flashkda; the middle / first row of each
    16-row block for fla), each factor rounded to the tile dtype; moonshot's products are dots
    of its stored tiles instead (below).

Recipes (docs/tolerances.md, Baselines):

    flashkda  C=32, pivot; kd/qd/kr bf16; INV built in fp32 (16-wide Neumann doubling, one
              block merge) and stored fp16; Mqk fp16; fp32 state; per chunk
                  Sb = bf16(S); tmp = kd.Sb; u = beta(v - tmp); U = INV.fp16(u)
                  o = qd.Sb + Mqk.fp16(U);  S <- S*gt + kr^T.bf16(U)
    fla       C=64, 16-row anchored factors (tf32; the safe_gate anchors of fla 0.5.2: middle
              row of a diagonal block, first row of the later block off the diagonal),
              diagonal blocks by exact substitution,
              block merges with tf32 operands; q, k (after l2norm), Akk, Aqk, w, u, kg, v_new
              stored in the input dtype; fp32 state; per chunk
                  v_new = in(u - w.in(S)); o = scale qg.in(S) + Aqk.v_new; S <- S*gt + kg^T.v_new
    moonshot  C=16, no pivot; beta logits bf16 (flash_kda takes bf16 logits, sigmoid inside);
              q, k bf16; tiles kd, qd, ki = k bf16(2^-G), kr stored bf16, and L = fp16(fp16(kd.ki)
              fp16(beta)), Mqk = bf16(qd.ki) dots of those stored tiles (fp32 accumulation);
              INV by fp16 doubling (fp16 accumulation), stored bf16; the state is bf16 between
              chunks; per chunk
                  tmp = bf16(kd.S); v' = bf16(bf16(v - tmp) bf16(beta)); U = bf16(INV.v')
                  o = qd.S + Mqk.U;  S <- bf16(S*gt + kr^T.U)
    moonshot-fwdsub  flash_kda from commit 7afb9f45 on (FlashKDA issue #34): moonshot with L kept
              fp32 (L = fp32(fp32(kd.ki) beta), the raw fp32 accumulator, masked and scaled in fp32)
              and INV by 8x8 fp32 forward substitution plus a bf16 block merge (``_fwdsub8``),
              stored bf16; everything else as moonshot
    aiter-gfx1250, aiter-gfx950
              ROCm/aiter's Gluon chunk_kda (form "aiter", C=64; the section "aiter chunk_kda" below
              cites each rounding point by file, commit and line): the prepare kernel's fp32
              l2norm / gate / beta, 16-token bands anchored at their start (bf16 factors, fp32
              WMMA products), (I - N)^-1 by fp32 doubling on the diagonal blocks and fp32 block
              substitution, A = bf16(X diag(beta)), qg / w / u / kg / aqk in the input dtype,
              decay 2^G_last fp32; the walk per chunk
                  Sb = bf16(S); v_new = bf16(u - w.Sb); S <- (S*gt + kg_0^T v_0) + kg_1^T v_1
                  o = (scale qg.Sb + aqk.v_new) by token halves
              gfx950 also walks long sequences in G groups (pass 1 / scan / pass 2: transfer
              matrices in the input dtype, each group's entry state through a bf16 operand).

The steps a recipe does not parametrize (how rows are laid into chunk tiles and which are
valid, the Mqk mask, the inverse construction, the state update) are the fields of ``Hooks``;
every recipe and every baseline runs the defaults (``DEFAULT_HOOKS``).  Callers that need the
same algorithm with one step replaced pass their own ``Hooks`` to ``emulate``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from kda_ref.chunked import prepare_tokens
from kda_ref.norm import gated_rmsnorm
from kda_ref.preprocess import F64, LOG2E, beta_activation, expand_gva, initial_state_kfirst
from kda_ref.problem import Problem, validate
from .base import Outputs, Route, with_taps

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TF32 = "tf32"
INPUT = "input"            # the dtype of the problem's q (fla stores intermediates in it)


@dataclass(frozen=True)
class Recipe:
    """Where a kernel rounds: every field is a storage or operand dtype (BF16, FP16, FP32,
    TF32, INPUT = the problem's q dtype, or F64 = no rounding)."""
    name: str
    chunk: int
    form: str                 # chunk step: "flashkda" | "moonshot" | "fla"
    anchor: str               # pair-product anchors: "pivot" | "start" | "block16"
    qk_dtype: object          # l2-normed q, k
    factor_dtype: object      # anchored factors of the L / Mqk products
    tile_dtype: object        # kd, qd, kr (fla: qg, kg, w, u, v_new)
    inverse: str              # "doubling" (Neumann, 16-wide blocks, merges) | "substitution" (fla) | "fwdsub8"
    inv_build_dtype: object   # what every product of the inverse construction is rounded to
    inv_dtype: object         # INV as stored
    mqk_dtype: object         # Mqk (fla: Aqk) as stored
    state_dtype: object       # the state between chunks
    operand_dtype: object     # the state as a dot operand (flashkda: bf16(S); fla: the input dtype)
    u_dtype: object           # u = beta (v - kd S) as the operand of INV (moonshot: also tmp, v')
    U_mqk_dtype: object       # U as the operand of Mqk
    U_kr_dtype: object        # U as the operand of kr^T
    acc_dtype: object = FP32  # accumulators, gates, decays
    description: str = ""
    beta_raw_dtype: object = F64  # the raw beta (logits) as the kernel reads it, before its activation
    # aiter chunk_kda (form "aiter") only:
    prep: str = "f64"             # l2norm, gate, beta: "f64" = the float64 preprocessing rounded to qk_dtype /
                                  # acc_dtype; "gfx1250" / "gfx950": the prepare kernel's fp32 formulas on the raw
                                  # inputs (aiter_token_inputs)
    inv_beta_dtype: object = F64  # A_inv diag(beta) as the operand of w and u
    walk_groups: object = 1       # the walk's chunk groups: 1, a number, or "auto" (gfx950's host rule)
    transfer_dtype: object = F64  # gfx950: a group's transfer matrix M_g as stored
    scan_operand_dtype: object = F64  # gfx950: the entry state as the scan's operand
    paged_store_empty: bool = True    # a paged zero-length sequence still writes its slot
    fused_norm: bool = False          # the kernel fuses the gated RMSNorm of o (fused_output_norm)


def exact_recipe(recipe: "Recipe") -> "Recipe":
    """The same algorithm with no rounding at all: it must reproduce the float64 oracle."""
    dt = {f: F64 for f in ("qk_dtype", "factor_dtype", "tile_dtype", "inv_build_dtype", "inv_dtype", "mqk_dtype",
                          "state_dtype", "operand_dtype", "u_dtype", "U_mqk_dtype", "U_kr_dtype", "acc_dtype",
                          "beta_raw_dtype", "inv_beta_dtype", "transfer_dtype", "scan_operand_dtype")}
    return replace(recipe, name=recipe.name + "-exact", prep="f64", **dt)


@dataclass(frozen=True)
class WideRange:
    """A storage format's rounding without its range (``rnd``): to fp32, then to ``bits``
    significant bits (the implicit one included) with fp32's exponent range, so a value fp16
    would flush or overflow keeps its significand; inside ``dtype``'s normal range the same
    bits as torch's own conversion (which also goes through fp32)."""
    dtype: object
    bits: int


def in_range_recipe(recipe: "Recipe", problem: Problem) -> "Recipe":
    """``recipe`` on ``problem`` with every fp16 storage point (the input dtype's too, when the
    problem's q is fp16) rounded to fp16's 11-bit significand with fp32's exponent range
    (``WideRange``): the recipe's precision without fp16's range (normal from 6.1e-5 to 65504),
    what it errs wherever the problem keeps its fp16 values normal.  bf16, tf32 and fp32 keep
    their rounding (their range is fp32's)."""
    fields = {}
    for f in recipe.__dataclass_fields__:
        if f.endswith("_dtype"):
            d = _op_dtype(recipe, problem) if f == "operand_dtype" else _dtype(getattr(recipe, f), problem)
            fields[f] = WideRange(FP16, 11) if d == FP16 else d
    return replace(recipe, name=recipe.name + "-in-range", **fields)


RECIPES: dict[str, Recipe] = {
    "flashkda": Recipe("flashkda", 32, "flashkda", "pivot", FP32, BF16, BF16, "doubling", FP32, FP16, FP16, FP32,
                       BF16, FP16, FP16, BF16, FP32,
                       "aiter FlashKDA: C=32, pivoted bf16 tiles, fp16 inverse and Mqk built in fp32, "
                       "fp32 state with bf16 dot operands"),
    "fla": Recipe("fla", 64, "fla", "block16", INPUT, TF32, INPUT, "substitution", FP32, INPUT, INPUT, FP32,
                  INPUT, INPUT, INPUT, INPUT, FP32,
                  "fla chunk_kda: C=64, intermediates in the input dtype, tf32 dots, fp32 state"),
    "moonshot": Recipe("moonshot", 16, "moonshot", "start", BF16, BF16, BF16, "doubling", FP16, BF16, BF16, BF16,
                       BF16, BF16, BF16, BF16, FP32,
                       "Moonshot CUTLASS FlashKDA: C=16, no pivot, fp16-accumulated inverse stored bf16, "
                       "bf16 state, bf16 beta logits", beta_raw_dtype=BF16),
    # flash_kda at 7afb9f45 (csrc/smxx/utils.cuh:167-368, csrc/smxx/fwd_kernel1.cuh:478-511 there):
    # L = k_decayed.k_inv^T stored as the raw fp32 accumulator (mma_m16n16_bf16bf16fp32_1warp), masked
    # and scaled by sigmoid(beta) in fp32; inverse_fwdsub8 below; INV stored bf16 as before
    "moonshot-fwdsub": Recipe("moonshot-fwdsub", 16, "moonshot", "start", BF16, BF16, BF16, "fwdsub8", FP32, BF16,
                              BF16, BF16, BF16, BF16, BF16, BF16, FP32,
                              "Moonshot CUTLASS FlashKDA from 7afb9f45: C=16, no pivot, fp32 L, 8x8 fp32 forward "
                              "substitution with a bf16 block merge, stored bf16, bf16 state, bf16 beta logits",
                              beta_raw_dtype=BF16),
    # ROCm/aiter chunk_kda, Gluon prepare + walk (docs/backends.md gives every rounding point with
    # its file, commit and line; the form "aiter" below cites them where it rounds)
    "aiter-gfx1250": Recipe("aiter-gfx1250", 64, "aiter", "band16", FP32, BF16, INPUT, "aiter", FP32, FP32, INPUT,
                            FP32, BF16, BF16, BF16, BF16, FP32,
                            "aiter chunk_kda Gluon gfx1250: C=64, 16-token bands, bf16 WMMA factors, fp32-WMMA "
                            "inverse, bf16 A_inv diag(beta), workspace in the input dtype, fp32 state with a bf16 "
                            "operand", prep="gfx1250", inv_beta_dtype=BF16, fused_norm=True),
    "aiter-gfx950": Recipe("aiter-gfx950", 64, "aiter", "band16", FP32, BF16, INPUT, "aiter", FP32, FP32, INPUT,
                           FP32, BF16, BF16, BF16, BF16, FP32,
                           "aiter chunk_kda Gluon gfx950: the gfx1250 numerics (MFMA), and the grouped walk of "
                           "long sequences (pass 1 / scan / pass 2: transfer matrices in the input dtype, entry "
                           "states through a bf16 operand)", prep="gfx950", inv_beta_dtype=BF16,
                           walk_groups="auto", transfer_dtype=INPUT, scan_operand_dtype=BF16,
                           paged_store_empty=False, fused_norm=True),
}
# Recipes of references, not of production kernels: a route may name one as its baseline, but they
# take no part in a cap lift or a degenerate-baseline fallback (verification.judging.baselines iterates
# RECIPES only).  fp32: the eager fp32 references (kda_kernels/references.py: fla's naive_*_kda,
# transformers' Kimi Linear functions), every product and storage IEEE fp32, o in the input dtype.
REFERENCE_RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", 64, "fla", "block16", FP32, FP32, FP32, "substitution", FP32, FP32, FP32, FP32,
                   FP32, FP32, FP32, FP32, FP32,
                   "eager fp32 references (fla naive, transformers): C=64, everything fp32, o in the input dtype"),
}
# cuDNN frontend 1.32.0's sm90 KDA engine kda_hopper_cuda (cudnn/linear_attention/hopper/cuda_kernels/
# kda_fused_sm90.cu; docs/backends.md, "cuDNN frontend", cites each rounding point by line): C=16, gate
# cumsum and decays fp32 (:625-672), kd = bf16(k 2^G) and q' = bf16(q 2^G scale) (:675-681), the
# inverse factor bf16(beta k 2^-G) (:682), L = kd.(beta k 2^-G)^T fp32 (:724-738), (I + L)^-1 by a
# 16-row fp32 forward substitution stored bf16 (:785-806), bf16(Tinv.kd) / bf16(Tinv.v) (:808-847),
# U = bf16(Tinv.v - Tinv.kd bf16(S)) (:903-952), o = q'.bf16(S) + bf16(Mqk diag(beta)).U written bf16
# (:744-752, :964-1001), the state fp32 in registers with bf16 MMA operands (:925, :955-970).  The
# moonshot form with the fp32 state and an exact (substitution) inverse is the nearest the emulator's
# forms express; it does not fold beta into the bf16 factor, forms U as INV.bf16(v - kd S) instead of
# the two stored products, and does not model the kernel's seed truncation (a sequence cut into P
# pieces, each piece after the first started from zero at a chunk where the gates have decayed any
# earlier state below 2^-20, :484-545).  Held out of RECIPES (no cap lift, no fallback) until an H200
# run calibrates it.
REFERENCE_RECIPES["cudnn-sm90"] = Recipe(
    "cudnn-sm90", 16, "moonshot", "start", BF16, BF16, BF16, "substitution", FP32, BF16, BF16, FP32,
    BF16, BF16, BF16, BF16, FP32,
    "cuDNN FE kda_hopper_cuda (sm90, NVRTC): C=16, no pivot, bf16 tiles, 16-row fp32 forward-substitution "
    "inverse stored bf16, bf16 Mqk, fp32 state with bf16 dot operands (the moonshot form's nearest: beta "
    "folded into a factor and the seed truncation not modelled)")

# the recipe of aiter's chunk_kda Gluon route on each GPU architecture (its host dispatches on it)
CHUNK_KDA_GLUON_RECIPES = {"gfx1250": "aiter-gfx1250", "gfx950": "aiter-gfx950"}


def chunk_kda_gluon_recipe(arch: str) -> str:
    """The emulator recipe that is the baseline of aiter's chunk_kda Gluon kernels on ``arch``
    (gfx1250 | gfx950); any other arch runs chunk_kda's Triton fallback (the flashkda recipe)."""
    return CHUNK_KDA_GLUON_RECIPES.get(arch, "flashkda")


# ----------------------------------------------------------------------------- rounding
def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to tf32 (fp32 with a 10-bit mantissa, round to nearest even), as float64."""
    xf = x.to(FP32).contiguous()
    bits = xf.view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    out = torch.where(torch.isfinite(xf), rounded.view(FP32), xf)
    return out.to(F64)


def rnd(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (float64) rounded to ``dtype`` and back to float64."""
    if dtype is None or dtype == F64:
        return x
    if dtype == TF32:
        return round_tf32(x)
    if isinstance(dtype, WideRange):
        m, e = torch.frexp(x.to(FP32).to(F64))
        return torch.ldexp(torch.round(m * 2.0 ** dtype.bits) / 2.0 ** dtype.bits, e)
    return x.to(dtype).to(F64)


def mm(a: torch.Tensor, b: torch.Tensor, acc=FP32) -> torch.Tensor:
    """A dot of already-rounded operands with one rounding of the sum to ``acc`` (fp32)."""
    return rnd(a @ b, acc)


# ------------------------------------------------------------------------- the chunk grid
def zero_tail_tiles(x: torch.Tensor, bounds, NC: int, C: int) -> torch.Tensor:
    """Packed [Ttot, HV, D] -> [N, NC, HV, C, D]; rows past a sequence's end are zero."""
    N = len(bounds)
    out = x.new_zeros((N, NC * C) + tuple(x.shape[1:]))
    for n, (bos, eos) in enumerate(bounds):
        out[n, : eos - bos] = x[bos:eos]
    return out.reshape((N, NC, C) + tuple(x.shape[1:])).movedim(3, 2)


def valid_rows(lens: torch.Tensor, C: int) -> torch.Tensor:
    """[N, NC] rows per chunk -> [N, NC, 1, C]: whether row r of a chunk holds a token (r < lens)."""
    return torch.arange(C, device=lens.device)[None, None, None, :] < lens[:, :, None, None]


# ------------------------------------------------------------------- anchored pair products
def _anchors(G: torch.Tensor, lens: torch.Tensor, recipe: Recipe):
    """Anchors [.., NB, K] for rows of each block: (diagonal-block anchor, off-block anchor)."""
    C = G.shape[-2]
    if recipe.anchor == "start":
        z = torch.zeros_like(G[..., :1, :])
        return z, z, C
    if recipe.anchor == "pivot":
        p = torch.clamp(torch.minimum(torch.full_like(lens, C // 2), lens - 1), min=0)     # [N, NC]
        idx = p[:, :, None, None, None].expand(-1, -1, G.shape[2], 1, G.shape[-1])
        a = torch.gather(G, 3, idx)
        return a, a, C
    BS = 16
    NB = C // BS
    starts = torch.arange(NB, device=G.device) * BS
    mid = torch.minimum(starts[None, None, :] + BS // 2, (lens - 1).clamp(min=0)[:, :, None])   # [N, NC, NB]
    first = torch.minimum(starts[None, None, :], (lens - 1).clamp(min=0)[:, :, None])
    def pick(rows):
        idx = rows[:, :, None, :, None].expand(-1, -1, G.shape[2], -1, G.shape[-1])
        return torch.gather(G, 3, idx)
    return pick(mid), pick(first), BS


def _pair_products(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, lens, recipe: Recipe) -> torch.Tensor:
    """P_ij = sum_d x_id k_jd 2^{G_id - G_jd} through anchored, rounded factors: [.., C, C]."""
    ad, ao, BS = _anchors(G, lens, recipe)
    C = G.shape[-2]
    NB = C // BS
    sh = G.shape[:-2]
    blk = torch.arange(C, device=G.device) // BS
    out = None
    for anchor, use in ((ad, "diag"), (ao, "off")):
        a_rows = anchor.repeat_interleave(BS, dim=-2)                                   # [.., C, K]
        left = rnd(x * torch.exp2(G - a_rows), recipe.factor_dtype)                     # rows i
        right = rnd(k[..., None, :, :] * torch.exp2(anchor[..., :, None, :] - G[..., None, :, :]),
                    recipe.factor_dtype)                                                # [.., NB, C(j), K]
        right = torch.nan_to_num(right, nan=0.0)
        prod = left.reshape(sh + (NB, BS, -1)) @ right.transpose(-1, -2)                # [.., NB, BS, C]
        prod = prod.reshape(sh + (C, C))
        same = blk[:, None] == blk[None, :]
        sel = same if use == "diag" else ~same
        out = torch.where(sel, prod, out if out is not None else torch.zeros_like(prod))
        if NB == 1:
            break
    return rnd(out, recipe.acc_dtype)


# -------------------------------------------------------------------------- the inverse
def _eye(C, ref):
    return torch.eye(C, dtype=F64, device=ref.device)


def _doubling(L: torch.Tensor, acc) -> torch.Tensor:
    """(I - D)^{-1} for D = L restricted to its 16-wide diagonal blocks, by Neumann doubling:
    (I + D)(I + D^2)(I + D^4)(I + D^8) = sum_{n<16} D^n, each product rounded to ``acc``;
    then block merges INV <- INV + INV (L_off INV) for widths 16, 32, ..."""
    C = L.shape[-1]
    blk = torch.arange(C, device=L.device)
    BS = min(16, C)
    D = torch.where((blk[:, None] // BS) == (blk[None, :] // BS), L, torch.zeros_like(L))
    inv = rnd(_eye(C, L) + D, acc)
    P = rnd(D @ D, acc)
    for _ in range(max(BS.bit_length() - 2, 0)):
        inv = rnd(inv + rnd(inv @ P, acc), acc)
        P = rnd(P @ P, acc)
    w = BS
    while w < C:
        rb, cb = blk[:, None] // w, blk[None, :] // w
        off = ((rb // 2) == (cb // 2)) & (rb != cb)
        L_off = torch.where(off, L, torch.zeros_like(L))
        inv = rnd(inv + rnd(inv @ rnd(L_off @ inv, acc), acc), acc)
        w *= 2
    return inv


def _substitution(L: torch.Tensor, op, acc) -> torch.Tensor:
    """fla's Akk: 16-wide diagonal blocks of (I - L)^{-1} exactly (fp32), then block forward
    substitution X_rc = X_rr sum_{c<=m<r} L_rm X_mc with ``op``-rounded operands."""
    C = L.shape[-1]
    BS = 16
    NB = C // BS
    M = _eye(C, L) - L
    X = torch.zeros_like(L)
    for b in range(NB):
        s = slice(b * BS, (b + 1) * BS)
        Xd = torch.linalg.solve_triangular(M[..., s, s], _eye(BS, L).expand_as(M[..., s, s]), upper=False,
                                           unitriangular=True)
        X[..., s, s] = rnd(Xd, acc)
    for r in range(1, NB):
        rs = slice(r * BS, (r + 1) * BS)
        for c in range(r - 1, -1, -1):
            cs = slice(c * BS, (c + 1) * BS)
            part = 0
            for m in range(c, r):
                ms = slice(m * BS, (m + 1) * BS)
                part = part + mm(rnd(L[..., rs, ms], op), rnd(X[..., ms, cs], op), acc)
            X[..., rs, cs] = mm(rnd(X[..., rs, rs], op), rnd(part, op), acc)
    return X


def inverse_fwdsub8(L: torch.Tensor, build=FP32, merge=BF16) -> torch.Tensor:
    """flash_kda's inverse from 7afb9f45 (inv_fwd_subst_fused_1warp, csrc/smxx/utils.cuh:194-368
    there) of X = I - L [.., 16, 16] (L fp32, strictly lower; the kernel's seed is -L):

        X = [A 0; C B]; A^-1, B^-1 by row elimination in fp32, one rounding per FMA: for s = 0..6 and
            every row i > s, r = -X_is; Y_ip <- fp32(r Y_sp + Y_ip) (p < s); Y_is <- r
        P = bf16(blockdiag(A^-1, B^-1)); M = [0 0; bf16(C) 0]
        dc = fp32(P.M); o = fp32(bf16(-dc).P); INV = P + bf16(o) (disjoint blocks: exact)

    (fp32 = ``build``, bf16 = ``merge``: the recipe's inv_build_dtype and inv_dtype.)  Returns INV
    (``merge`` values, float64 tensor).  No power of L is formed, unlike the moonshot recipe's doubling."""
    C = L.shape[-1]
    if C != 16:
        raise ValueError(f"inverse_fwdsub8: expected 16x16 chunks, got {C}x{C}")
    X = rnd(-L, build)                                                   # the kernel's seed, fp32
    Y = torch.zeros_like(X)
    for b in (0, 8):
        blk = X[..., b:b + 8, b:b + 8]
        inv = torch.where(torch.eye(8, dtype=torch.bool, device=L.device), torch.ones_like(blk), blk).clone()
        for s_ in range(7):
            r = -inv[..., s_ + 1:, s_:s_ + 1]                                # rows i > s: -X_is
            if s_:
                inv[..., s_ + 1:, :s_] = rnd(r * inv[..., s_:s_ + 1, :s_] + inv[..., s_ + 1:, :s_], build)
            inv[..., s_ + 1:, s_:s_ + 1] = r
        Y[..., b:b + 8, b:b + 8] = torch.tril(inv)
    P = rnd(Y, merge)
    M = torch.zeros_like(X)
    M[..., 8:, :8] = rnd(X[..., 8:, :8], merge)
    dc = mm(P, M, build)
    o = mm(rnd(-dc, merge), P, build)
    return P + rnd(o, merge)


def build_inverse(L: torch.Tensor, recipe: Recipe, op) -> torch.Tensor:
    """INV = (I - L)^{-1} [.., C, C] as the recipe builds it (``op``: fla's operand dtype)."""
    if recipe.inverse == "fwdsub8":
        return inverse_fwdsub8(L, recipe.inv_build_dtype, recipe.inv_dtype)
    if recipe.inverse == "doubling":
        return _doubling(rnd(L, recipe.inv_build_dtype), recipe.inv_build_dtype)
    if recipe.inverse == "aiter":
        return aiter_inverse(L, recipe.inv_build_dtype)
    return _substitution(L, op, recipe.inv_build_dtype)


def mqk_mask(C: int, device) -> torch.Tensor:
    """[C, C] bool: the entries of Mqk that exist, i >= j (token i sees its own update)."""
    i = torch.arange(C, device=device)
    return i[:, None] >= i[None, :]


def decay_then_update(S: torch.Tensor, gt: torch.Tensor, upd: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """The state carried to the next chunk: S <- S * gt + upd, stored in the recipe's state dtype."""
    return rnd(S * gt + upd, recipe.state_dtype)


@dataclass(frozen=True)
class Hooks:
    """The replaceable steps of the emulation; each default is what every recipe computes.

    tiles(x, bounds, NC, C)          packed rows [Ttot, HV, D] -> chunk tiles [N, NC, HV, C, D]
    valid(lens, C)                   rows per chunk [N, NC] -> [N, NC, 1, C] bool, rows holding a token
    mqk_mask(C, device)              [C, C] bool, the entries of Mqk that exist
    build_inverse(L, recipe, op)     INV = (I - L)^{-1} as the recipe stores it before its final rounding
    state_update(S, gt, upd, recipe) the next chunk's state from S, the chunk decay gt [.., K, 1] and
                                     upd = kr^T U (the form "aiter" rounds its update in two token
                                     halves, ``aiter_state_update``, and does not call this hook)"""
    tiles: Callable = zero_tail_tiles
    valid: Callable = valid_rows
    mqk_mask: Callable = mqk_mask
    build_inverse: Callable = build_inverse
    state_update: Callable = decay_then_update


DEFAULT_HOOKS = Hooks()


# ------------------------------------------------------------- aiter chunk_kda (form "aiter")
# ROCm/aiter's Gluon chunk_kda: a prepare kernel writes the walk's workspace (qg, w, u, kg_t, aqk
# in the input dtype, decay fp32), a walk kernel carries the fp32 state across the chunks.  The
# sources modelled, and the short names the comments below cite them by (line numbers are those
# of these commits):
#   P1250  aiter/ops/triton/_gluon_kernels/gfx1250/attention/chunk_kda/prepare.py @ 13cdcede35
#   W1250  aiter/ops/triton/_gluon_kernels/gfx1250/attention/chunk_kda/walk.py    @ 13cdcede35
#   P950   aiter/ops/triton/_gluon_kernels/gfx950/attention/chunk_kda/prepare.py  @ 9c25252d1d
#   W950   aiter/ops/triton/_gluon_kernels/gfx950/attention/chunk_kda/walk.py     @ 4d306a447a
#   HOST   aiter/ops/triton/attention/chunk_kda.py                                @ 4d306a447a
# Both prepares compute the same products in the same order (P950 line = P1250 line unless named);
# they differ in the gate and beta formulas only.  Modelling conventions: every fp32 operation is
# one rounding of its exact result; a WMMA / MFMA call is one rounding of (its accumulator input +
# the exact dot), although the hardware splits K into 32-wide (bf16) or 4-wide (fp32) instructions
# with an fp32 rounding between them (2^-24 relative, below the bf16 operand roundings by 2^16).
AITER_BAND = 16        # P1250:61 BC = 16: "2^-lc stays finite over 16 tokens"


def aiter_gfx950_groups(N: int, HV: int, NT: int, sms: int = 256) -> int:
    """G, the chunk groups of gfx950's walk: W950 _get_config (lines 13-33) with the tuned config
    (the fork yhl-amd/aiter @ 22f2e2dc, configs/gfx950/gluon/attention/chunk_kda/DEFAULT.json:
    BV 64, split_programs_per_cu 1, split_min_group_chunks 4, split_max_groups 32,
    split_min_chunks 24, split_min_groups 4) and ``sms`` compute units (MI355X: 256).  NT is the
    batch's chunk count, so G depends on the whole batch: cps = NT // N chunks per sequence,
    G = min(sms // (2 N HV), cps // 4, 32), 1 when cps < 24 or G < 4, at most cps."""
    cps = NT // max(N, 1)
    programs = max(N * HV * (128 // 64), 1)
    g = min(1 * sms // programs, cps // 4, 32)
    G = 1 if (cps < 24 or g < 4) else g
    return max(1, min(G, cps))


def walk_group_bounds(nc: int, G: int) -> list:
    """[(c_lo, c_hi)] of the G groups of a sequence of nc chunks (W950, chunk_kda_walk_kernel:
    base = nc // G, rmd = nc - base G, c_lo = g base + min(max(g - 1, 0), rmd), c_hi = c_lo + base
    + [1 <= g <= rmd]): group 0 has base chunks, groups 1..rmd one more."""
    base, rmd = divmod(nc, G)
    out = []
    for g in range(G):
        lo = g * base + min(max(g - 1, 0), rmd)
        out.append((lo, lo + base + (1 if 1 <= g <= rmd else 0)))
    return out


def _f32(x) -> torch.Tensor:
    return torch.as_tensor(x).to(FP32)


def aiter_token_inputs(problem: Problem, pieces: list, pp, recipe: Recipe):
    """(q, k, gk, beta) of the packed rows of ``pieces`` [n, HV, .] float64, as the prepare kernel
    holds them in fp32: gk the per-token gate in log2 units.  With ``recipe.prep`` "gfx1250" /
    "gfx950" (and an fp32 recipe) from the raw inputs by the kernel's fp32 formulas:

        l2norm   x * rsqrt(sum x^2 + 1e-6)                                  P1250:186, 209
        gk       gfx1250  lb log2(e)/2 (1 + tanh(z a' + a' dt)), a' = exp(A_log)/2   P1250:157-168
                 gfx950   lb log2(e) / (1 + 2^(z c1 + c0)), c1 = -log2(e) exp(A_log), c0 = c1 dt
                                                                            P950:122-124, 158-165
        beta     gfx1250  1/2 + tanh(b/2)/2 (common/utils.py sigmoid)       P1250:226
                 gfx950   1 / (1 + 2^(-log2(e) b))                          P950:234-241

    each operation one fp32 rounding (torch float32 arithmetic).  Otherwise (prep "f64", an exact
    recipe, or inputs the kernel does not take: another gate or beta kind, no l2norm) the float64
    preprocessing ``pp`` rounded to qk_dtype / acc_dtype."""
    acc = recipe.acc_dtype
    q, k = rnd(pp.q, recipe.qk_dtype), rnd(pp.k, recipe.qk_dtype)
    gk = rnd(LOG2E * rnd(pp.a, acc), acc)
    beta = rnd(pp.beta, acc)
    if recipe.prep == "f64" or acc != FP32:
        return q, k, gk, beta
    Tt, HV = problem.B * problem.T, problem.HV

    def raw(x, shape):
        return torch.cat([x.reshape(shape)[t0:t1] for t0, t1 in pieces if t1 > t0]).to(FP32)

    gfx950 = recipe.prep == "gfx950"
    if problem.qk_l2norm:
        def l2(x):
            return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _f32(1e-6))
        q = expand_gva(l2(raw(problem.q, (Tt, problem.H, problem.K))), HV).to(F64)
        k = expand_gva(l2(raw(problem.k, (Tt, problem.H, problem.K))), HV).to(F64)
    if problem.gate == "lower_bound":
        z = raw(problem.g, (Tt, HV, problem.K))
        A_log = _f32(problem.A_log if problem.A_log is not None else torch.zeros(HV)).reshape(HV, 1)
        dt = _f32(problem.dt_bias if problem.dt_bias is not None else torch.zeros(HV, problem.K)).reshape(HV, -1)
        lb = _f32(float(problem.lower_bound))
        if gfx950:
            c1 = torch.exp(A_log) * _f32(-LOG2E)
            c0 = c1 * dt
            g32 = (lb * _f32(LOG2E)) * (_f32(1.0) / (_f32(1.0) + torch.exp2(z * c1 + c0)))
        else:
            a_exp = _f32(0.5) * torch.exp(A_log)
            g32 = (lb * _f32(0.7213475204444817)) * (_f32(1.0) + torch.tanh(z * a_exp + a_exp * dt))
        gk = g32.to(F64)
    if problem.beta_kind == "sigmoid":
        b = raw(problem.beta, (Tt, HV))
        if gfx950:
            b32 = _f32(1.0) / (_f32(1.0) + torch.exp2(b * _f32(-LOG2E)))
        else:
            b32 = _f32(0.5) + _f32(0.5) * torch.tanh(_f32(0.5) * b)
        beta = b32.to(F64)
    return q, k, gk, beta


def _scan_rows(x: torch.Tensor, dim: int, acc) -> torch.Tensor:
    """Inclusive running sum along ``dim``, each step rounded to ``acc`` (tl.cumsum in fp32)."""
    out = x.clone()
    n = x.shape[dim]
    for i in range(1, n):
        cur = out.narrow(dim, i, 1)
        cur.copy_(rnd(out.narrow(dim, i - 1, 1) + cur, acc))
    return out


def aiter_inverse(L: torch.Tensor, acc) -> torch.Tensor:
    """X = (I - L)^{-1} [.., C, C] for a strictly lower L (the kernel's N = -beta Akk) as the
    prepare builds it in fp32 WMMA / MFMA (AF/BF operands are fp32, instr_shape [16, 16, 4]):

      diagonal 16x16 blocks D_b:  P = D D; X = D + I; then three times X <- X + X P, P <- P P
                                  (not after the last): (I + D)(I + D^2)(I + D^4)(I + D^8)
                                  P1250:273-291 (P950:282-300)
      off-diagonal blocks:        X_{b,b-d} = X_bb (sum_{s=1..d} N_{b,b-s} X_{b-s,b-d}), the sum
                                  accumulated in s order (each WMMA adds into the running fp32
                                  accumulator), d = 1, 2, 3
                                  P1250:303-318 (P950:309-323)

    each product, sum and accumulation rounded to ``acc``."""
    C = L.shape[-1]
    BS = AITER_BAND
    NB = C // BS
    sh = L.shape[:-2]
    blk = L.reshape(sh + (NB, BS, NB, BS)).transpose(-3, -2)          # [.., NB(row), NB(col), BS, BS]
    D = torch.stack([blk[..., b, b, :, :] for b in range(NB)], dim=-3)  # [.., NB, BS, BS]
    eye = torch.eye(BS, dtype=F64, device=L.device)
    P = rnd(D @ D, acc)
    x = rnd(D + eye, acc)
    for i in range(3):
        x = rnd(x + rnd(x @ P, acc), acc)
        if i < 2:
            P = rnd(P @ P, acc)
    X = torch.zeros_like(blk)
    for b in range(NB):
        X[..., b, b, :, :] = x[..., b, :, :]
    for d in range(1, NB):
        for b in range(d, NB):
            a = torch.zeros_like(eye.expand(sh + (BS, BS)))
            for s in range(1, d + 1):
                a = rnd(a + blk[..., b, b - s, :, :] @ X[..., b - s, b - d, :, :], acc)
            X[..., b, b - d, :, :] = rnd(x[..., b, :, :] @ a, acc)
    return X.transpose(-3, -2).reshape(sh + (C, C))


def aiter_chunk_work(q, k, v, gk, beta, valid, scale, recipe: Recipe, problem: Problem, hooks: "Hooks"):
    """The prepare kernel on one group of chunk tiles ([.., C, D], C = 64, rows past a sequence's
    end zero): its workspace as float64 values.  With G the in-chunk cumsum of gk, cut into four
    16-token bands b (lc: the inclusive cumsum within the band, e_b: the exclusive cumsum of the
    band totals, so G = e_b + lc):

      lc = cumsum_band(gk), tot_b = sum_band(gk), G_last = sum_b tot_b, e = cumsum(tot) - tot
                                                                       P1250:170-174 (P950:167-175)
      decay = 2^G_last (fp32)                                          P1250:175 (P950:170)
      bridge[J, b] = 2^min(e_b - e_J, 0) (fp32)                        P1250:183
      ki = bf16(k 2^-lc)    kn = bf16(k 2^lc)    kb = bf16(k 2^lc 2^e)  P1250:188, 205, 207 (P950:200, 205, 208)
      qn = bf16(q (2^lc scale))                                         P1250:211 (P950:213)
      qg = in(q 2^lc 2^e)   kg = in(k 2^((G_last - e) - lc))            P1250:213, 190/199 (P950:216, 190)
      per column band J:  b_J = bf16(ki_J bridge[J, b]) for each row band b
                          Akk = fp32(kn . b_J), Aqk = fp32(qn . b_J)    P1250:254-256 (P950:260-262)
      aqk = in(Aqk masked i >= j)                                       P1250:259 (P950:265)
      N = fp32(-beta_i Akk) for i > j                                   P1250:262 (P950:271)
      X = (I - N)^{-1} (``aiter_inverse``), A = bf16(X diag(beta))      P1250:336 (P950:332)
      w = in(fp32(A . kb)),  u = in(fp32(A . v))                        P1250:345-356 (P950:344-361)

    (in = the input dtype: HOST allocates qg, w, u, kg_t, aqk with q.dtype).  The pair products
    thus anchor each row band at its own start (k_i 2^lc_i) and each column band at 2^-lc_j, bridged
    by 2^(e_b - e_J): every bf16 factor is within 2^(16 |gk|max) of k, which is why the host asserts
    lower_bound >= -5.5 (HOST chunk_kda_prepare)."""
    C, BS = recipe.chunk, AITER_BAND
    NB = C // BS
    acc, f = recipe.acc_dtype, recipe.factor_dtype
    tile = _dtype(recipe.tile_dtype, problem)
    sh = q.shape[:-2]
    K = q.shape[-1]

    def band(x):
        return x.reshape(sh + (NB, BS, x.shape[-1]))

    gb = band(gk)
    lc = _scan_rows(gb, -2, acc)                                   # [.., NB, BS, K]
    tot = rnd(gb.sum(-2), acc)                                     # [.., NB, K]
    g_last = rnd(tot.sum(-2), acc)                                 # [.., K]
    e = rnd(_scan_rows(tot, -2, acc) - tot, acc)                   # [.., NB, K]
    decay = rnd(torch.exp2(g_last), acc)
    kB, qB = band(k), band(q)
    el = rnd(torch.exp2(lc), acc)
    ee = rnd(torch.exp2(e), acc)[..., None, :]                     # [.., NB, 1, K]
    ki = rnd(rnd(kB * rnd(torch.exp2(-lc), acc), acc), f)
    kel = rnd(kB * el, acc)
    kn = rnd(kel, f)
    kb = rnd(rnd(kel * ee, acc), f)
    scale_a = rnd(torch.tensor(scale, dtype=F64, device=q.device), acc)      # a constexpr fp32 scale
    qn = rnd(rnd(qB * rnd(el * scale_a, acc), acc), f)
    qg = rnd(rnd(rnd(qB * el, acc) * ee, acc), tile)
    kg = rnd(rnd(kB * rnd(torch.exp2(rnd(rnd(g_last[..., None, None, :] - e[..., None, :], acc) - lc, acc)), acc),
                 acc), tile)
    bridge = rnd(torch.exp2(torch.clamp(e[..., :, None, :] - e[..., None, :, :], max=0.0)), acc)   # [.., b, J, K]
    Pk = torch.zeros(sh + (C, C), dtype=F64, device=q.device)
    Pq = torch.zeros_like(Pk)
    for J in range(NB):
        bj = rnd(rnd(ki[..., J:J + 1, :, :] * bridge[..., :, J, None, :], acc), f)   # [.., NB(b), BS(j), K]
        cols = slice(J * BS, (J + 1) * BS)
        Pk[..., cols] = rnd(kn @ bj.transpose(-1, -2), acc).reshape(sh + (C, BS))
        Pq[..., cols] = rnd(qn @ bj.transpose(-1, -2), acc).reshape(sh + (C, BS))
    i = torch.arange(C, device=q.device)
    strict, incl = i[:, None] > i[None, :], hooks.mqk_mask(C, q.device)
    zero = torch.zeros((), dtype=F64, device=q.device)
    mqk = rnd(torch.where(incl, Pq, zero), _dtype(recipe.mqk_dtype, problem))
    L = torch.where(strict, rnd(-beta[..., :, None] * Pk, acc), zero)
    X = hooks.build_inverse(L, recipe, None)
    A = rnd(rnd(X * beta[..., None, :], acc), recipe.inv_beta_dtype)
    vm = valid[..., None]
    kb = kb.reshape(sh + (C, K))
    out = {"gt": decay, "inv": rnd(X, _dtype(recipe.inv_dtype, problem)), "mqk": mqk, "beta": beta, "valid": valid,
           "qg": torch.where(vm, qg.reshape(sh + (C, K)), zero), "kg": torch.where(vm, kg.reshape(sh + (C, K)), zero),
           "w": torch.where(vm, rnd(mm(A, kb, acc), tile), zero), "u": torch.where(vm, rnd(mm(A, v, acc), tile), zero)}
    return out


def aiter_state_update(S: torch.Tensor, gt: torch.Tensor, kg: torch.Tensor, v_new: torch.Tensor,
                       recipe: Recipe) -> torch.Tensor:
    """The walk's state update, in two token halves into the fp32 accumulator:
    S <- fp32(fp32(fp32(S gt) + kg_0^T v_0) + kg_1^T v_1)   W1250:126-129 (W950:139-148)."""
    acc = recipe.acc_dtype
    h = kg.shape[-2] // 2
    S1 = rnd(rnd(S * gt, acc) + kg[..., :h, :].transpose(-1, -2) @ v_new[..., :h, :], acc)
    return rnd(rnd(S1 + kg[..., h:, :].transpose(-1, -2) @ v_new[..., h:, :], acc), recipe.state_dtype)


def aiter_carry(S, ch, recipe: Recipe, problem: Problem):
    """One chunk of the walk: Sb = bf16(S) (W1250:116, W950:114), v_new = bf16(fp32(u - fp32(w Sb)))
    (W1250:118-124, W950:124-137), then ``aiter_state_update``.  Returns (S, (Sb, v_new))."""
    acc = recipe.acc_dtype
    vm = ch["valid"][..., None]
    zero = torch.zeros((), dtype=F64, device=S.device)
    Sb = rnd(S, recipe.operand_dtype)
    v_new = torch.where(vm, rnd(rnd(ch["u"] - mm(ch["w"], Sb, acc), acc), recipe.u_dtype), zero)
    return aiter_state_update(S, ch["gt"][..., :, None], ch["kg"], rnd(v_new, recipe.U_kr_dtype), recipe), (Sb, v_new)


def aiter_outputs(w, Sb, v_new, recipe: Recipe, scale: float) -> torch.Tensor:
    """o of the walk: y = fp32(qg Sb) (W1250:122-123, W950:131), then by token half
    o_0 = fp32(fp32(y_0 scale) + aqk_00 v_0), o_1 = fp32(fp32(fp32(y_1 scale) + aqk_10 v_0) + aqk_11 v_1)
    (W1250:132-138, W950:150-159; gfx950's single 64-row o adds aqk_01 v_1 = 0 to o_0), stored in
    the output dtype (W1250:139-140, W950:267)."""
    acc = recipe.acc_dtype
    C = w["qg"].shape[-2]
    h = C // 2
    scale_a = rnd(torch.tensor(scale, dtype=F64, device=Sb.device), acc)
    ys = rnd(mm(w["qg"], Sb, acc) * scale_a, acc)
    a = w["mqk"]
    v = rnd(v_new, recipe.U_mqk_dtype)
    o0 = rnd(ys[..., :h, :] + a[..., :h, :h] @ v[..., :h, :], acc)
    o1 = rnd(rnd(ys[..., h:, :] + a[..., h:, :h] @ v[..., :h, :], acc) + a[..., h:, h:] @ v[..., h:, :], acc)
    return torch.cat([o0, o1], dim=-2)


class GroupedWalk:
    """gfx950's walk of long sequences in G chunk groups (W950 chunk_kda_walk_kernel PASS 1 / 2 and
    chunk_kda_scan_kernel; HOST _walk_gfx950), applied around the chunk-by-chunk walk of ``emulate``:

      pass 1, group 0:       the ordinary walk from S0; its end state is the entry of group 1
      pass 1, 1 <= g <= G-2: B_g = the walk of the group from 0, and the transfer T_g = the walk
                             of the group from the identity with u = 0 (``u_keep`` 0: the
                             programs whose state rows start as ``S = where(ck == krow, 1, 0)``);
                             B_g stored fp32, T_g stored in the input dtype (``S.to(mg_ptr...)``)
      scan:                  entry_{g+1} = fp32(T_g bf16(entry_g) + B_g) (``_scan_step``:
                             ``s_x.store(S.to(gl.bfloat16))``, ``mfma(s_x.load(A_OP), c, b)``)
      pass 2:                every group walks again from its entry state and writes o; the
                             group holding the last chunk writes the final state

    (K-first here: the kernel's state rows are columns, so T_g is the transpose of its M_g.)
    In the emulation, pass 2 of a group and pass 1's B/T of the same group run side by side, and
    at the end of group g (1 <= g <= G-2, more chunks following) the walked state is replaced
    by the scan's entry_{g+1}.  G = 1 and G = 2 are the ordinary walk, bit for bit."""

    def __init__(self, recipe: Recipe, chunks_of: list, HV: int):
        N = len(chunks_of)
        G = recipe.walk_groups
        if G == "auto":
            G = aiter_gfx950_groups(N, HV, sum(chunks_of))
        self.G = int(G)
        self.recipe = recipe
        self.bounds = [walk_group_bounds(nc, self.G) if nc else [] for nc in chunks_of]
        self.chunks_of = chunks_of
        self.aug = {}       # sequence -> [HV, K, V + K]: pass 1's (B | T) of its current group
        self.entry = {}     # sequence -> [HV, K, V]: the entry state of its current group

    @property
    def active(self) -> bool:
        return self.G > 2

    def _group(self, n: int, c: int):
        for g, (lo, hi) in enumerate(self.bounds[n]):
            if lo <= c < hi:
                return g, lo, hi
        raise AssertionError((n, c))

    def before(self, c: int, act: list, S: torch.Tensor) -> None:
        """At chunk position ``c``: a sequence entering a pass-1 group (1 <= g <= G-2) keeps its
        entry state and starts B = 0, T = I."""
        for row, n in enumerate(act):
            g, lo, _ = self._group(n, c)
            if lo == c and 1 <= g <= self.G - 2:
                HV, K, V = S.shape[1], S.shape[2], S.shape[3]
                self.entry[n] = S[row].clone()
                eye = torch.eye(K, dtype=S.dtype, device=S.device).expand(HV, K, K)
                self.aug[n] = torch.cat([torch.zeros_like(S[row]), eye], dim=-1)

    def after(self, c: int, act: list, S: torch.Tensor, ch: dict, problem: Problem, carry) -> torch.Tensor:
        """After chunk ``c`` ran on S (rows ``act``): pass 1 steps (B | T) on the same chunk, and a
        group that ends here with chunks after it hands the scan's entry state to the next."""
        rows = [row for row, n in enumerate(act) if n in self.aug]
        if not rows:
            return S
        idx = torch.tensor(rows, device=S.device)
        sub = {key: val[idx] for key, val in ch.items()}
        K = S.shape[2]
        sub["u"] = torch.cat([sub["u"], sub["u"].new_zeros(sub["u"].shape[:-1] + (K,))], dim=-1)
        aug = torch.stack([self.aug[act[r]] for r in rows])
        aug, _ = carry(aug, sub, self.recipe, problem)
        rc = self.recipe
        acc = rc.acc_dtype
        V = S.shape[3]
        for i, row in enumerate(rows):
            n = act[row]
            self.aug[n] = aug[i]
            g, _, hi = self._group(n, c)
            if c + 1 == hi:
                B, T = aug[i][..., :V], aug[i][..., V:]
                if hi < self.chunks_of[n]:
                    S[row] = rnd(rnd(rnd(T, _dtype(rc.transfer_dtype, problem))
                                     @ rnd(self.entry[n], rc.scan_operand_dtype) + B, acc), rc.state_dtype)
                del self.aug[n], self.entry[n]
        return S


# ------------------------------------------------------------------------------ emulate
def _dtype(d, problem: Problem):
    return problem.q.dtype if d == INPUT else d


def _op_dtype(recipe: Recipe, problem: Problem):
    """fla's dot operand dtype: the input dtype, or tf32 for fp32 inputs (NVIDIA's default)."""
    if recipe.operand_dtype != INPUT:
        return recipe.operand_dtype
    return TF32 if problem.q.dtype == FP32 else problem.q.dtype


def _chunk_work(q, k, v, a, beta, valid, lens, scale, recipe: Recipe, problem: Problem, hooks: Hooks):
    """K1 of one group of chunks: tiles, INV, Mqk (and fla's w, u); every tensor float64."""
    C = recipe.chunk
    qkd = _dtype(recipe.qk_dtype, problem)
    tile = _dtype(recipe.tile_dtype, problem)
    q, k = rnd(q, qkd), rnd(k, qkd)
    acc = recipe.acc_dtype
    G = rnd(LOG2E * torch.cumsum(a, dim=-2), acc)                     # [N,g,HV,C,K]
    G_last = G[..., C - 1:C, :]
    gt = rnd(torch.exp2(G_last), acc)
    e = rnd(torch.exp2(G), acc)
    er = rnd(torch.exp2(G_last - G), acc)
    vm = valid[..., None]
    zero = torch.zeros((), dtype=F64, device=q.device)
    if recipe.form == "moonshot":
        # every factor rounded as flash_kda's K1 stores it: kd = bf16(k bf16(2^G)),
        # qd = bf16(bf16(q bf16(2^G)) bf16(scale)), ki = bf16(k bf16(2^-G)), kr = bf16(ki bf16(2^G_last));
        # L and Mqk are dots of those stored tiles (fp32 accumulation), not of separately rounded factors
        fd = recipe.factor_dtype
        ebf = rnd(torch.exp2(G), fd)
        kd = torch.where(vm, rnd(k * ebf, tile), zero)
        qd = torch.where(vm, rnd(rnd(q * ebf, tile) * rnd(torch.tensor(scale, dtype=F64, device=q.device), fd), tile),
                         zero)
        ki = torch.where(vm, rnd(k * rnd(torch.exp2(-G), fd), tile), zero)
        kr = torch.where(vm, rnd(ki * rnd(gt, fd), tile), zero)
        Pk = mm(kd, ki.transpose(-1, -2), acc)
        Pq = mm(qd, ki.transpose(-1, -2), acc)
    else:
        Pk = _pair_products(k, k, G, lens, recipe)
        Pq = _pair_products(scale * q, k, G, lens, recipe)
    i = torch.arange(C, device=q.device)
    strict, incl = i[:, None] > i[None, :], hooks.mqk_mask(C, q.device)
    if recipe.form == "moonshot":
        # flash_kda stores kd.ki^T in fp16 and scales it there by fp16(beta): L = -fp16(fp16(Pk) fp16(beta))
        ib = recipe.inv_build_dtype
        L = torch.where(strict, -rnd(rnd(Pk, ib) * rnd(beta[..., :, None], ib), ib), zero)
    else:
        L = torch.where(strict, -beta[..., :, None] * Pk, zero)
    L = rnd(L, acc)
    op = _op_dtype(recipe, problem)
    inv = hooks.build_inverse(L, recipe, op)
    inv_dtype = _dtype(recipe.inv_dtype, problem)
    inv = rnd(inv, inv_dtype)
    mqk = rnd(torch.where(incl, Pq, zero), _dtype(recipe.mqk_dtype, problem))
    out = {"gt": gt[..., 0, :], "inv": inv, "mqk": mqk, "beta": beta, "v": v, "valid": valid}
    if recipe.form in ("flashkda", "moonshot"):
        if recipe.form == "moonshot":
            out["kd"], out["qd"], out["kr"] = kd, qd, kr
        else:
            out["kd"] = torch.where(vm, rnd(k * e, tile), zero)
            out["qd"] = torch.where(vm, rnd(scale * q * e, tile), zero)
            out["kr"] = torch.where(vm, rnd(k * er, tile), zero)
    else:
        out["qg"] = torch.where(vm, rnd(q * e, tile), zero)
        out["kg"] = torch.where(vm, rnd(k * er, tile), zero)
        bk = torch.where(vm, rnd(beta[..., None] * k * e, tile), zero)
        bv = torch.where(vm, rnd(beta[..., None] * v, tile), zero)
        out["w"] = rnd(mm(rnd(inv, op), rnd(bk, op), acc), tile)
        out["u"] = rnd(mm(rnd(inv, op), rnd(bv, op), acc), tile)
    return out


def _group_size(N, NC, HV, C, K) -> int:
    """Chunk positions per group: one [N, g, HV, C, max(K, C)] float64 array stays within 128 MiB."""
    per_chunk = max(N * HV * C * max(K, C) * 8, 1)
    return max(1, min(NC, (1 << 27) // per_chunk))


def _group_pieces(bounds, c0: int, c1: int, C: int) -> list:
    """The packed token range [t0, t1) of chunk positions [c0, c1) of each sequence
    ``(bos, eos)``: [bos + c0 C, min(bos + c1 C, eos)), empty where the sequence is shorter."""
    return [(min(bos + c0 * C, eos), min(bos + c1 * C, eos)) for bos, eos in bounds]


def _group_inputs(problem: Problem, pieces: list):
    """The prepared float64 inputs of a group's ``pieces`` (``_group_pieces``), packed
    (``kda_ref.chunked.prepare_tokens`` on each non-empty piece, concatenated), and the pieces'
    bounds in that packing."""
    prepared = [prepare_tokens(problem, t0, t1, None) for t0, t1 in pieces if t1 > t0]
    sub_bounds, pos = [], 0
    for t0, t1 in pieces:
        sub_bounds.append((pos, pos + t1 - t0))
        pos += t1 - t0
    if len(prepared) == 1:
        return prepared[0], sub_bounds
    cat = {n: torch.cat([getattr(x, n) for x in prepared]) for n in ("q", "k", "v", "a", "beta")}
    return replace(prepared[0], **cat), sub_bounds


def emulate(problem: Problem, recipe="flashkda", keep_f64: bool = False, taps: bool = False, *,
            hooks: Hooks = DEFAULT_HOOKS) -> Outputs:
    """Run the chunked algorithm with ``recipe``'s precision (a name of RECIPES or a Recipe) and
    the steps of ``hooks`` (DEFAULT_HOOKS: the recipe's own).  Outputs are in the Problem's
    layouts: o in v's dtype, the final state (or the written cache) in fp32; with ``keep_f64``
    every output stays float64 (for self-tests of the algorithm).  With ``taps`` the stored
    inverse comes back as ``taps["ws_inv"]`` in the oracle's layout: head-major tiles
    [HV*tiles, C, C] (kda_ref.workspace), in the dtype the recipe stores it in.

    Streamed over groups of chunk positions (``_group_size``): each group's inputs are cast to
    float64 and preprocessed on their own (``_group_inputs``), so memory is the inputs, o in its
    output dtype, the states and one group's working set, at any T.  ``hooks.tiles`` lays out
    one group's pieces (chunk positions [c0, c1) of each sequence still running at c0, packed):
    a group ends where a sequence does and holds only the sequences running through it, so a
    varlen pack of one long sequence and many short ones costs the long one's chunks, not N
    times them."""
    validate(problem)
    if isinstance(recipe, str):
        known = {**RECIPES, **REFERENCE_RECIPES}
        if recipe not in known:
            raise ValueError(f"recipe: expected one of {', '.join(known)}, got {recipe!r}")
        recipe = known[recipe]
    C = recipe.chunk
    bounds = problem.seq_bounds()
    Ttot, HV, K, V, N = problem.B * problem.T, problem.HV, problem.K, problem.V, problem.N
    lens_list = [e - b for b, e in bounds]
    chunks_of = [-(-n // C) for n in lens_list]                 # chunks per sequence
    NC = max(chunks_of + [0])
    dev = problem.device
    seq_len = torch.tensor(lens_list, device=dev, dtype=torch.int64)
    lens = (seq_len[:, None] - torch.arange(NC, device=dev)[None, :] * C).clamp(0, C)   # [N, NC]
    valid = hooks.valid(lens, C).expand(N, NC, HV, C)
    S = rnd(initial_state_kfirst(problem), recipe.state_dtype)
    out_dt, state_dt = (F64, F64) if keep_f64 else (problem.v.dtype, FP32)
    o = torch.zeros(Ttot, HV, V, dtype=out_dt, device=dev)
    inv_all = torch.zeros(N, NC, HV, C, C, dtype=FP32, device=dev) if taps else None
    walker = GroupedWalk(recipe, chunks_of, HV) if recipe.walk_groups != 1 else None
    walker = walker if walker is not None and walker.active else None
    c0 = 0
    while c0 < NC:
        act = [n for n in range(N) if chunks_of[n] > c0]        # the sequences still running at c0
        sel = slice(None) if len(act) == N else torch.tensor(act, device=dev)
        ng = min(_group_size(len(act), NC - c0, HV, C, K), min(chunks_of[n] for n in act) - c0)
        sl = slice(c0, c0 + ng)
        c0 += ng
        pieces = _group_pieces([bounds[n] for n in act], sl.start, sl.stop, C)
        pp, sub = _group_inputs(problem, pieces)
        if recipe.form == "aiter":     # the prepare kernel's own l2norm, gate and beta (aiter_token_inputs)
            q_p, k_p, a_p, beta_p = aiter_token_inputs(problem, pieces, pp, recipe)
        else:
            beta_act = pp.beta
            if recipe.beta_raw_dtype not in (None, F64):   # the kernel takes the raw beta in this dtype only
                raw = problem.beta.reshape(Ttot, HV)
                braw = rnd(torch.cat([raw[t0:t1] for t0, t1 in pieces]).to(F64), recipe.beta_raw_dtype)
                beta_act = beta_activation(braw, problem.beta_kind)
            q_p, k_p, a_p, beta_p = pp.q, pp.k, rnd(pp.a, recipe.acc_dtype), rnd(beta_act, recipe.acc_dtype)
            del beta_act
        qt = hooks.tiles(q_p, sub, ng, C)
        kt = hooks.tiles(k_p, sub, ng, C)
        vt = hooks.tiles(pp.v, sub, ng, C)
        at = hooks.tiles(a_p, sub, ng, C)
        bt = hooks.tiles(beta_p[..., None], sub, ng, C)[..., 0]
        del pp, q_p, k_p, a_p, beta_p
        if recipe.form == "aiter":     # at: the per-token gate in log2 units
            w = aiter_chunk_work(qt, kt, vt, at, bt, valid[sel, sl], problem.scale_value, recipe, problem, hooks)
        else:
            w = _chunk_work(qt, kt, vt, at, bt, valid[sel, sl], lens[sel, sl], problem.scale_value, recipe, problem,
                            hooks)
        del qt, kt, vt, at, bt
        if recipe.acc_dtype != F64:   # what the chunk steps read is held at fp32 (stored values are exact there)
            w = {key: rnd(val, FP32) if val.is_floating_point() else val for key, val in w.items()}
        if taps:
            inv_all[sel, sl] = w["inv"].to(FP32)
        Sg = S[sel]
        Sb_all = S.new_empty(len(act), ng, HV, K, V)     # per chunk position: what its output needs
        X_all = S.new_empty(len(act), ng, HV, C, V)      # (U, or fla's v_new)
        for j in range(ng):
            ch = {key: val[:, j] for key, val in w.items()}
            if walker is not None:
                walker.before(sl.start + j, act, Sg)
            Sg, (Sb, X) = _carry(Sg, ch, recipe, problem, hooks)
            if walker is not None:
                Sg = walker.after(sl.start + j, act, Sg, ch, problem, aiter_carry)
            Sb_all[:, j], X_all[:, j] = Sb, X
        S[sel] = Sg
        o_t = _outputs(w, Sb_all, X_all, recipe, problem, problem.scale_value)
        del w, Sb_all, X_all, Sg
        rows = o_t.movedim(2, 3).reshape(len(act), ng * C, HV, V)
        for n, (t0, t1) in enumerate(pieces):
            if t1 > t0:
                o[t0:t1] = rows[n, : t1 - t0]
        del o_t, rows
    o = o.reshape(problem.B, problem.T, HV, V)
    if problem.fused_norm:
        o = fused_output_norm(o, problem, recipe, keep_f64)
    final = S.to(state_dt)
    unwritten = [] if recipe.paged_store_empty else [n for n in range(N) if lens_list[n] == 0]
    out = _finish(problem, o, final, recipe.name, unwritten)
    if taps:
        inv_dt = _dtype(recipe.inv_dtype, problem)
        out.taps["ws_inv"] = _head_major_tiles(inv_all, lens).to(inv_dt if not keep_f64 else F64)
    return out


def fused_output_norm(o: torch.Tensor, problem: Problem, recipe: Recipe, keep_f64: bool = False) -> torch.Tensor:
    """The gated RMSNorm epilogue of aiter's Gluon walk on o [B, T, HV, V] as stored (o already in
    its output dtype): to fp32, ``of * (rsqrt(sum(of^2) / V + eps) * w)``, times the gate's sigmoid
    ``0.5 + 0.5 tanh(x / 2)`` (common/utils.py), every step fp32, rounded once to o's dtype
    (gfx1250 walk.py _store_o, "gated RMSNorm on the bf16-rounded output"; gfx950 walk.py _store_o,
    the same formulas; docs/backends.md cites the lines).  With ``keep_f64``: the float64 norm
    (kda_ref.norm).  A recipe whose kernel fuses no norm (``Recipe.fused_norm`` false) raises."""
    if not recipe.fused_norm:
        raise ValueError(f"recipe: {recipe.name} has no fused output norm, but the problem asks for one (out_gate)")
    if keep_f64:
        return gated_rmsnorm(o, problem.out_gate, problem.norm_weight, problem.norm_eps)
    of = o.to(FP32)
    w = problem.norm_weight.to(device=o.device, dtype=FP32)
    gate = problem.out_gate.to(device=o.device, dtype=FP32)
    eps = torch.tensor(problem.norm_eps, dtype=FP32)
    of = of * (torch.rsqrt((of * of).sum(-1, keepdim=True) / o.shape[-1] + eps) * w)
    return (of * (0.5 + 0.5 * torch.tanh(0.5 * gate))).to(o.dtype)


def _head_major_tiles(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[N, NC, HV, ...] -> [HV*tiles, ...]: the chunks that exist (sequence-major, then chunk),
    head-major as in the production workspace (ws_idx = hv * tiles + tile)."""
    keep = (lens > 0).reshape(-1)
    flat = x.reshape((-1,) + tuple(x.shape[2:]))[keep]          # [tiles, HV, ...]
    return flat.transpose(0, 1).reshape((-1,) + tuple(x.shape[3:]))


def _carry(S, ch, recipe: Recipe, problem: Problem, hooks: Hooks):
    """One chunk of the sequential recurrence for every sequence and head at once: (the next
    state, what the chunk's output needs besides its tiles: (Sb, U) for flashkda and moonshot,
    (Sb, v_new) for fla; ``_outputs`` computes o from them)."""
    vm = ch["valid"][..., None]
    zero = torch.zeros((), dtype=F64, device=S.device)
    gt = ch["gt"][..., :, None]                                     # [N,HV,K,1]
    acc = recipe.acc_dtype
    if recipe.form == "aiter":
        return aiter_carry(S, ch, recipe, problem)
    if recipe.form == "fla":
        op = _op_dtype(recipe, problem)
        tile = _dtype(recipe.tile_dtype, problem)
        Sb = rnd(S, op)
        v_new = torch.where(vm, rnd(ch["u"] - mm(rnd(ch["w"], op), Sb, acc), tile), zero)
        S_new = hooks.state_update(S, gt, mm(rnd(ch["kg"], op).transpose(-1, -2), rnd(v_new, op), acc), recipe)
        return S_new, (Sb, v_new)
    beta = ch["beta"][..., None]
    Sb = rnd(S, recipe.operand_dtype)
    if recipe.form == "moonshot":
        ud = recipe.u_dtype
        tmp = rnd(mm(ch["kd"], Sb, acc), ud)
        u = rnd(rnd(ch["v"] - tmp, ud) * rnd(beta, ud), ud)
        U = rnd(mm(ch["inv"], torch.where(vm, u, zero), acc), recipe.U_mqk_dtype)
    else:
        tmp = mm(ch["kd"], Sb, acc)
        u = torch.where(vm, rnd(beta * (ch["v"] - tmp), acc), zero)
        U = mm(ch["inv"], rnd(u, recipe.u_dtype), acc)
    upd = mm(ch["kr"].transpose(-1, -2), rnd(U, recipe.U_kr_dtype), acc)
    return hooks.state_update(S, gt, upd, recipe), (Sb, U)


def _outputs(w, Sb, X, recipe: Recipe, problem: Problem, scale: float):
    """o of chunks from their tiles ``w`` and what ``_carry`` kept for them (Sb and U, or Sb and
    v_new), for any leading shape (one chunk position, or a group of them at once):

        flashkda, moonshot:  o = acc(qd.Sb + Mqk.U_mqk(U))
        fla:                 o = acc(acc(scale qg.op(Sb)) + Aqk.op(v_new))"""
    acc = recipe.acc_dtype
    if recipe.form == "aiter":
        return aiter_outputs(w, Sb, X, recipe, scale)
    if recipe.form == "fla":
        op = _op_dtype(recipe, problem)
        return rnd(rnd(scale * mm(rnd(w["qg"], op), Sb, acc), acc) + mm(rnd(w["mqk"], op), rnd(X, op), acc), acc)
    return rnd(mm(w["qd"], Sb, acc) + mm(w["mqk"], rnd(X, recipe.U_mqk_dtype), acc), acc)


def _finish(problem: Problem, o: torch.Tensor, final_kfirst: torch.Tensor, recipe: str,
            unwritten: list = ()) -> Outputs:
    """Outputs in the Problem's layouts; a paged cache gets every sequence's final state in its
    slot except the sequences in ``unwritten`` (gfx950's walk stores a slot only from the group
    holding a sequence's last chunk, so a zero-length sequence leaves its slot as it was: W950
    ``do_store = last & (slot1 >= 0) & (slot1 < num_slots)`` with ``last = (c_hi == nc) & (ncg > 0)``)."""
    info = {"route_ran": recipe}
    if problem.paged:
        cache = problem.state_cache.detach().clone().to(final_kfirst.dtype)
        keep = [n for n in range(final_kfirst.shape[0]) if n not in set(unwritten)]
        idx = problem.state_indices.long()[keep]
        cache[idx] = final_kfirst[keep].transpose(-1, -2).to(cache.device)
        return Outputs(o=o, state_cache=cache, info=info)
    if not problem.output_final_state:
        return Outputs(o=o, info=info)
    fs = final_kfirst if problem.state_layout == "kv" else final_kfirst.transpose(-1, -2)
    return Outputs(o=o, final_state=fs.contiguous(), info=info)


# ------------------------------------------------------------------------------ backends
class EmulatorBackend:
    """The emulator as a Backend: one route per recipe (route.recipe = that recipe)."""

    def __init__(self, taps: bool = False):
        self.taps = bool(taps)
        self.name = "emulator"

    def with_taps(self, taps: bool = True) -> "EmulatorBackend":
        """This backend with the ws_inv tap on every run (kda_kernels.base.ReturnsTaps)."""
        return with_taps(self, taps)

    def available(self):
        return True, ""

    def version(self) -> str:
        return "kda-verify emulator 1 (float64 with explicit rounding)"

    def routes(self) -> list[Route]:
        return [Route(name=r.name, recipe=r.name, description=r.description,
                      flags=(("recipe", r.name),) + ((("fused_norm", True),) if r.fused_norm else ()))
                for r in RECIPES.values()]

    def accepts(self, problem: Problem, route: Route):
        """Every valid Problem, except what a recipe's kernel documents it cannot take: Moonshot
        documents lower_bound in [-5, 0]; the flashkda pivot factors overflow for |lb| >= 5.55;
        aiter's chunk_kda host asserts lower_bound >= -5.5."""
        lb = problem.lower_bound if problem.gate == "lower_bound" else None
        recipe = route.recipe
        if recipe.startswith("moonshot") and lb is not None and lb < -5.0:
            return False, f"not applicable: the moonshot recipe documents lower_bound in [-5, 0], got {lb:g}"
        if recipe == "flashkda" and lb is not None and lb <= -5.55:
            return False, f"not applicable: flashkda pivot factors 2^(23.08*|lb|) overflow for lb <= -5.55, got {lb:g}"
        if recipe in CHUNK_KDA_GLUON_RECIPES.values() and lb is not None and lb < -5.5:
            return False, (f"not applicable: aiter's chunk_kda asserts -5.5 <= lower_bound < 0 (its 16-token "
                           f"bands' 2^-lc overflow fp32 beyond), got {lb:g}")
        return True, ""

    def run(self, problem: Problem, route: Route) -> Outputs:
        return emulate(problem, route.recipe, taps=self.taps)

    # ----- serving traces (kda_kernels.base.RunsTraces)
    def trace_routes(self) -> list[Route]:
        """One route per recipe of a kernel that runs trace calls, named by the recipe (the trace
        runner looks a kernel route's baseline up by its recipe's name): the chunk recipes of the
        paged-cache routes run the prefill group, the decode recipes their decode kernels' groups."""
        out = [Route(name=r, recipe=r, flags=(("groups", ("prefill",)), ("recipe", r)),
                     description=f"prefill chunks as the {r} recipe runs a paged Problem"
                                 + ("" if r in PAGED_CACHE_KERNELS else " (states gathered from the cache and "
                                    "scattered back in its dtype and layout, as an engine does around chunk_kda)"))
               for r in PREFILL_TRACE_RECIPES]
        out += [Route(name=r.name, recipe=r.name, flags=(("groups", r.groups), ("recipe", r.name)),
                      description=r.description) for r in DECODE_RECIPES.values()]
        return out

    def trace_accepts(self, trace, route: Route) -> tuple[bool, str]:
        """What the recipe's kernel refuses, in its own terms (``_trace_refusal``); a prefill recipe
        also what ``accepts`` refuses of the trace's model options."""
        if route.recipe not in PREFILL_TRACE_RECIPES and route.recipe not in DECODE_RECIPES:
            return False, f"not applicable: {route.name!r} is not a trace route of the emulator"
        why = _trace_refusal(trace, route.recipe)
        if why:
            return False, why
        if route.recipe in PREFILL_TRACE_RECIPES:
            return self.accepts(trace.problem_view(), route)
        return True, ""

    def run_call(self, call, route: Route) -> torch.Tensor:
        """Run one PhaseCall of a group the route runs: the cache written in place, o [1, T, HV, V]."""
        groups = route.flag("groups", ())
        if call.group not in groups:
            raise ValueError(f"call: expected a {'/'.join(groups)} call for route {route.name}, got {call.describe()}")
        if route.recipe in PREFILL_TRACE_RECIPES:
            return run_prefill_call(call, route.recipe)
        return run_decode_call(call, route.recipe)


# ------------------------------------------------------------------ serving traces (RunsTraces)
# A trace step is split into kernel calls by kda_kernels.trace_calls (PhaseCall: the rows of one
# group, packed, and the whole flat cache buffer).  The emulator runs
#   prefill: the chunk recipes of the routes that take a paged cache (PREFILL_TRACE_RECIPES), the
#            PhaseCall run as the recipe runs a paged Problem: the initial state read from slot
#            state_indices[n] (in the cache's dtype) when has_initial_state[n], the final state
#            written there in the cache's dtype and layout;
#   decode / spec: the recurrent decode kernels' recipes (DECODE_RECIPES), token by token, rounding
#            where those kernels' sources round (docs/backends.md, "Decode recipes", cites them).
# The steps a control replaces (which column a row reads, loading and storing a slot, which slot
# a table entry reaches) are the fields of ``TraceHooks``; every baseline runs the defaults.
PREFILL_TRACE_RECIPES = ("flashkda", "aiter-gfx1250", "aiter-gfx950", "fla")
# the prefill kernels that take the paged cache themselves (fp32 [slots, H, V, K] only); fla's
# chunk_kda takes dense states, which the engine gathers from the cache (fp32, the cache's layout)
# and scatters back rounded to the cache's dtype: any cache dtype and layout
PAGED_CACHE_KERNELS = {"flashkda": "FlashKDA (kda_kernels/triton/forward.py, aiter flash_kda_fwd)",
                       "aiter-gfx1250": "aiter's chunk_kda", "aiter-gfx950": "aiter's chunk_kda"}


@dataclass(frozen=True)
class DecodeRecipe:
    """Where a recurrent decode kernel rounds.  ``kernel`` names whose per-token formulas run
    ("fla" | "gfx1250" | "gfx950", ``_decode_inputs`` / ``_decode_token``); ``arith`` is the dtype
    of every register operation (FP32; F64 = the exact variant, which must reproduce
    kda_ref.recurrence.token_step); ``layouts`` / ``cache_dtypes`` what the kernel takes;
    ``groups`` the trace groups it runs; ``pad_guard``: the kernel has aiter's pad_slot_guard
    (slots <= 0 mark padding rows: neither read nor written, o = 0), which a caller passes under
    the NULL-block convention (pad=null0) only: under pad=minus1 slot 0 is a live slot."""
    name: str
    kernel: str
    arith: object
    layouts: tuple
    cache_dtypes: tuple
    groups: tuple
    pad_guard: bool
    description: str = ""


DECODE_RECIPES: dict[str, DecodeRecipe] = {
    "fla-recurrent": DecodeRecipe(
        "fla-recurrent", "fla", FP32, ("vk", "kv"), ("float32", "bfloat16"), ("decode", "spec"), False,
        "fla fused_recurrent_kda_fwd (fla-core 0.6.0): state loaded from the cache to fp32, fp32 per-token "
        "update, o in v's dtype, each token's state stored in the cache's dtype"),
    "aiter-decode-gfx1250": DecodeRecipe(
        "aiter-decode-gfx1250", "gfx1250", FP32, ("vk", "kv"), ("float32",), ("decode", "spec"), True,
        "aiter Gluon packed decode on gfx1250: fp32 states (V-first or K-first), tanh-form gate, o after "
        "the write, per-token checkpoints, pad_slot_guard"),
    "aiter-decode-gfx950": DecodeRecipe(
        "aiter-decode-gfx950", "gfx950", FP32, ("vk",), ("float32",), ("decode",), True,
        "aiter Gluon packed decode on gfx950: fp32 V-first states, K = V = 128, o = S^T q + err (k.q) "
        "from the pre-write state, no speculative decoding, pad_slot_guard"),
}


def exact_decode_recipe(recipe: DecodeRecipe) -> DecodeRecipe:
    """The same kernel formulas with no rounding: must reproduce kda_ref.recurrence.token_step."""
    return replace(recipe, name=recipe.name + "-exact", arith=F64)


def slot_region(call, slot: int) -> Optional[torch.Tensor]:
    """The [HV, ., .] elements a kernel addresses as slot ``slot`` of the flat buffer: offset +
    slot * slot_stride, whatever the slot (-1 is one slot stride before slot 0, in the guard rows
    when they are that long), as a strided view; None where that lies outside the buffer."""
    c = call.spec
    _, a, b = c.slot_shape
    start = c.offset + slot * c.stride
    if start < 0 or start + c.slot_numel > call.cache.numel():
        return None
    return call.cache.as_strided(c.slot_shape, (a * b, b, 1), call.cache.storage_offset() + start)


def load_slot(call, n: int, slot: int) -> torch.Tensor:
    """Slot ``slot`` of the call's cache (``slot_region``) as K-first float64 [HV, K, V] (exact: the
    cache's dtype widened)."""
    return call.spec.to_kfirst(slot_region(call, slot)).to(F64)


def store_slot(call, n: int, slot: int, S: torch.Tensor) -> None:
    """Write the K-first state S [HV, K, V] to slot ``slot`` (``slot_region``) in the cache's layout,
    rounded once to the cache's dtype (S holds fp32 values: the same bits as the kernels' fp32 ->
    dtype store)."""
    region = slot_region(call, slot)
    region.copy_(call.spec.to_layout(S).to(region.dtype))


def read_column(call, n: int) -> int:
    """The table column row n reads: num_accepted_tokens[n] - 1 on a spec call, else 0."""
    if call.group == "spec":
        return int(call.num_accepted_tokens[n]) - 1
    return 0


def kernel_slot(call, n: int, slot: int, guard: bool) -> Optional[int]:
    """The slot a table entry reaches, None where nothing is read or written: a padding entry the
    kernel skips (``guard``: aiter's pad_slot_guard, slots <= 0).  Without a guard the entry is
    the address it makes (fla: a padding row's -1 is one slot stride before slot 0, the NULL block
    0 is slot 0); where that lies outside the buffer the kernel would touch memory that is not the
    cache's, which is not modelled: None too (the row's o stays 0).  ``trace_accepts`` refuses
    such traces; a baseline run on one (the serving runner runs the baseline of a kernel that took
    the trace, e.g. a negative control) keeps its live rows exact."""
    if guard and slot <= 0:
        return None
    if slot_region(call, slot) is None:
        return None
    return slot


@dataclass(frozen=True)
class TraceHooks:
    """The replaceable steps of a trace call; each default is what every recipe does.

    read_column(call, n) -> int           the table column row n reads (spec: num_accepted - 1)
    load(call, n, slot) -> S              slot content, K-first float64 [HV, K, V]
    store(call, n, slot, S)               write a K-first state to a slot (cache dtype and layout)
    slot(call, n, slot, guard) -> slot    the slot a table entry reaches, None for a skipped pad"""
    read_column: Callable = read_column
    load: Callable = load_slot
    store: Callable = store_slot
    slot: Callable = kernel_slot


DEFAULT_TRACE_HOOKS = TraceHooks()


def _call_problem(call, initial: torch.Tensor) -> Problem:
    """The prefill call as a dense varlen Problem starting from ``initial`` (K-first [N, HV, K, V];
    float32 holds any fp32 or bf16 slot exactly)."""
    m = call.model
    return Problem(q=call.q, k=call.k, v=call.v, g=call.g, beta=call.beta, A_log=m["A_log"], dt_bias=m["dt_bias"],
                   scale=m["scale"], lower_bound=m["lower_bound"], gate=m["gate"], beta_kind=m["beta_kind"],
                   qk_l2norm=m["qk_l2norm"], cu_seqlens=call.cu_seqlens.to(torch.int64),
                   initial_state=initial.to(torch.float32), state_layout="kv", output_final_state=True)


def run_prefill_call(call, recipe="flashkda", hooks: TraceHooks = DEFAULT_TRACE_HOOKS) -> torch.Tensor:
    """A prefill PhaseCall as ``recipe`` (a chunk recipe) runs a paged Problem: row n starts from
    slot state_indices[n] (``hooks.load``) when has_initial_state[n], else from zero; its final
    state goes to that slot (``hooks.store``), except where the recipe leaves a zero-length row's
    slot alone (``paged_store_empty``) or the slot lies outside [0, slots) (the chunk kernels mask
    the paged load and store with a non-negative offset: kda_kernels/triton/common.py,
    _initial_state, and walk.py, the final store).  Returns o [1, T, HV, V] in v's dtype."""
    rec = recipe if isinstance(recipe, Recipe) else {**RECIPES, **REFERENCE_RECIPES}[recipe]
    N = call.batch
    spec = call.spec
    lens = (call.cu_seqlens[1:] - call.cu_seqlens[:-1]).tolist()
    table = call.state_indices.tolist()
    init = torch.zeros(N, spec.HV, spec.K, spec.V, dtype=F64, device=call.q.device)
    for n in range(N):
        if bool(call.has_initial_state[n]) and 0 <= table[n] < spec.slots:
            init[n] = hooks.load(call, n, table[n])
    out = emulate(_call_problem(call, init), rec)
    for n in range(N):
        if not 0 <= table[n] < spec.slots or (lens[n] == 0 and not rec.paged_store_empty):
            continue
        hooks.store(call, n, table[n], out.final_state[n].to(F64))
    return out.o


# ----- the decode kernels' per-token arithmetic
def _sigmoid_tanh(x, r):
    """aiter's Gluon sigmoid, 0.5 + 0.5 tanh(0.5 x) (_gluon_kernels/common/utils.py:35-36)."""
    return r(0.5 + r(0.5 * r(torch.tanh(r(0.5 * x)))))


def _decode_inputs(call, recipe: DecodeRecipe):
    """The per-token operands of every token of the call, as the kernel forms them in registers:
    q, k [T, HV, K] (normalised, q scaled; gfx950 also qk [T, HV] = scale q^.k^), decay [T, HV, K]
    (exp of the log-decay), v [T, HV, V], beta [T, HV]; float64 arrays holding ``arith`` values."""
    r = (lambda x: rnd(x, recipe.arith))
    m = call.model
    K, HV = call.q.shape[3], call.v.shape[2]
    q = expand_gva(r(call.q[0].to(F64)), HV)      # every kernel loads its inputs .to(fp32)
    k = expand_gva(r(call.k[0].to(F64)), HV)
    v = r(call.v[0].to(F64))
    g = r(call.g[0].to(F64))
    b = r(call.beta[0].to(F64))
    scale = r(torch.tensor(K ** -0.5 if m["scale"] is None else float(m["scale"]), dtype=F64))
    lb = None if m["lower_bound"] is None else r(torch.tensor(float(m["lower_bound"]), dtype=F64))
    A = None if m["A_log"] is None else r(m["A_log"].to(F64).reshape(HV, 1))
    dt = None if m["dt_bias"] is None else r(m["dt_bias"].to(F64).reshape(HV, K))
    gate, kind = m["gate"], recipe.kernel
    qk = None

    def sq(x):                                   # one fp32 sum of squares per row (the dot model)
        return r((x * x).sum(-1, keepdim=True))

    if kind == "fla":                            # fused_recurrent.py:156-159
        if m["qk_l2norm"]:
            q = r(q / r(torch.sqrt(r(sq(q) + 1e-6))))
            k = r(k / r(torch.sqrt(r(sq(k) + 1e-6))))
        q = r(q * scale)
    elif kind == "gfx1250":                      # gfx1250 kda_decode.py:262-266
        if m["qk_l2norm"]:
            q = r(q * r(r(torch.rsqrt(r(sq(q) + 1e-6))) * scale))
            k = r(k * r(torch.rsqrt(r(sq(k) + 1e-6))))
        else:
            q = r(q * scale)
    else:                                        # gfx950 kda_decode.py:345-354
        qk = r((q * k).sum(-1))
        if m["qk_l2norm"]:
            rq = r(r(torch.rsqrt(r(sq(q) + 1e-6))) * scale)
            rk = r(torch.rsqrt(r(sq(k) + 1e-6)))
            q, k = r(q * rq), r(k * rk)
            qk = r(qk * r(rq * rk)[..., 0])
        else:
            q, qk = r(q * scale), r(qk * scale)
    # the gate: the decay exp(a) as the kernel computes it
    ea = None if A is None else r(torch.exp(A))
    if gate == "pregated":
        decay = r(torch.exp(g))
    elif kind == "fla":                          # fused_recurrent.py:162-179
        x = r(g + dt) if dt is not None else g
        if gate == "lower_bound":
            gk = r(lb * r(torch.sigmoid(r((ea if ea is not None else 1.0) * x))))
        else:                                    # without A_log: b_A = 1.0, -exp(1.0) softplus(g)
            e1 = ea if ea is not None else r(torch.exp(torch.ones((), dtype=F64)))
            gk = r(-e1 * r(torch.nn.functional.softplus(x, threshold=20.0)))
        decay = r(torch.exp(gk))
    elif kind == "gfx1250":                      # gfx1250 kda_decode.py:467-481, 268-281
        if gate == "lower_bound":
            ah = r(0.5 * ea)
            th = r(torch.tanh(r(g * ah + r(ah * dt)) if dt is not None else r(g * ah)))
            c = r(lb * 0.7213475204444817)
            decay = r(torch.exp2(r(th * c + c)))
        else:
            x = r(g + dt) if dt is not None else g
            decay = r(torch.exp2(r(r(-ea * 1.4426950408889634) * r(torch.nn.functional.softplus(x, threshold=20.0)))))
    else:                                        # gfx950 kda_decode.py:222-234, 56-64
        x = r(g + dt) if dt is not None else g
        if gate == "lower_bound":
            sg = _sigmoid_tanh(r(ea * x), r)
            decay = r(torch.exp2(r(r(lb * 1.4426950408889634) * sg)))
        else:
            decay = r(torch.exp2(r(r(-ea * 1.4426950408889634) * r(torch.nn.functional.softplus(x, threshold=20.0)))))
    # beta
    bk = m["beta_kind"]
    if bk != "pregated":
        s = r(torch.sigmoid(b)) if kind == "fla" else _sigmoid_tanh(b, r)
        b = r(2.0 * s) if bk == "sigmoid2" else s
    return q, k, v, decay, b, qk


def _decode_token(S, q, k, v, decay, beta, qk, recipe: DecodeRecipe):
    """One token, every head: S K-first [HV, K, V] -> (S', o [HV, V]) as the kernel's registers
    hold them (``arith``); a dot is one rounding of the exact sum, a multiply-add one rounding.

        fla, gfx1250:  S = S diag(decay); e = beta (v - S^T k); S += k e^T; o = S^T q
        gfx950:        S = S diag(decay); e = beta (v - S^T k); o = S^T q + e (k.q); S += k e^T"""
    r = (lambda x: rnd(x, recipe.arith))
    S = r(S * decay[..., :, None])                                   # decay
    sk = r((S * k[..., :, None]).sum(-2))                            # S^T k
    e = r(r(v - sk) * beta[..., None])                               # beta (v - S^T k)
    if recipe.kernel == "gfx950":
        sq = r((S * q[..., :, None]).sum(-2))                        # S^T q, pre-write
        o = r(sq + e * qk[..., None])
        S = r(S + k[..., :, None] * e[..., None, :])
        return S, o
    S = r(S + k[..., :, None] * e[..., None, :])                     # write (a multiply-add)
    o = r((S * q[..., :, None]).sum(-2))                             # S^T q, post-write
    return S, o


def run_decode_call(call, recipe="fla-recurrent", hooks: TraceHooks = DEFAULT_TRACE_HOOKS) -> torch.Tensor:
    """A decode or spec PhaseCall as the recurrent kernel runs it: each row reads slot
    table[n, read_column] (``hooks.load``; fla and aiter read whenever a state buffer is given),
    runs its tokens, and after token t writes the state to table[n, t] (spec; a decode row to its
    one slot) in the cache's dtype (``hooks.store``).  Padding entries: as ``hooks.slot`` resolves
    them (aiter's pad_slot_guard, passed under pad=null0: a row whose read slot is <= 0 is skipped
    with o = 0, a token whose write slot is <= 0 is not stored; without it the entry is the address
    it makes).  Returns o [1, T, HV, V] in v's dtype."""
    rec = recipe if isinstance(recipe, DecodeRecipe) else DECODE_RECIPES[recipe]
    guard = rec.pad_guard and call.spec.pad == "null0"      # pad_slot_guard=True under the NULL block only
    q, k, v, decay, beta, qk = _decode_inputs(call, rec)
    T, HV, V = call.tokens, call.v.shape[2], call.v.shape[3]
    o = torch.zeros(T, HV, V, dtype=F64, device=call.q.device)
    cu = call.cu_seqlens.tolist()
    table = call.state_indices.reshape(call.batch, -1).tolist()
    for n in range(call.batch):
        t0, t1 = cu[n], cu[n + 1]
        if t1 == t0:                       # fla: "if T == 0 and IS_CONTINUOUS_BATCHING: return"
            continue
        col = hooks.read_column(call, n)
        src = hooks.slot(call, n, table[n][col], guard)
        if src is None:                    # a padding row: o = 0, nothing read or written
            continue
        S = hooks.load(call, n, src)
        for t in range(t1 - t0):
            i = t0 + t
            S, o[i] = _decode_token(S, q[i], k[i], v[i], decay[i], beta[i], None if qk is None else qk[i], rec)
            dst = hooks.slot(call, n, table[n][t if call.group == "spec" else 0], guard)
            if dst is not None:
                hooks.store(call, n, dst, S)
    return o.to(call.v.dtype)[None]


def _trace_refusal(trace, recipe: str, padding: bool = True) -> Optional[str]:
    """Why the kernel of ``recipe`` (a trace route's) cannot run ``trace``'s calls, in its own
    terms, or None; ``padding`` false leaves out what the kernel does with padding rows (the
    negative controls that write them run anyway)."""
    c = trace.cache
    if recipe in PREFILL_TRACE_RECIPES:
        who = PAGED_CACHE_KERNELS.get(recipe)
        if who is None:                  # fla: the engine's gather / scatter around chunk_kda
            return None
        if c.dtype != "float32":
            return f"not applicable: {who} takes an fp32 paged state_cache, the trace's is {c.dtype}"
        if c.layout != "vk":
            return f"not applicable: {who} takes a V-first [slots, H, V, K] state_cache, the trace's is K-first (kv)"
        return None
    rec = DECODE_RECIPES[recipe]
    if c.dtype not in rec.cache_dtypes:
        return (f"not applicable: {recipe}'s kernel takes fp32 states only (aiter kda.py:266 asserts "
                f"initial_state.dtype == float32), the trace's cache is {c.dtype}")
    if c.layout not in rec.layouts:
        return (f"not applicable: {recipe}'s kernel keeps the state V-first [V, K] only (gfx950 kda_decode.py:146), "
                f"the trace's cache is K-first (kv)")
    if rec.kernel == "gfx950" and not (trace.K == trace.V == 128):
        return (f"not applicable: the gfx950 decode kernel needs K == V == BV, its tuned BV is 128 (kda_decode.py:147, "
                f"configs/gfx950-KDA_DECODE-DEFAULT.json), got K={trace.K} V={trace.V}")
    if rec.kernel == "gfx1250" and (trace.V % 32 or trace.K & (trace.K - 1)):
        return (f"not applicable: the gfx1250 decode kernel tiles V by BV = 32 (configs/gfx1250-KDA_DECODE-DEFAULT.json, "
                f"kda.py:242) over a power-of-two K, got K={trace.K} V={trace.V}")
    if rec.kernel != "fla" and trace.gate != "pregated" and trace.A_log is None:
        return "not applicable: aiter's decode computes the gate in the kernel from A_log (kda.py:216), the trace has none"
    if not padding:
        return None
    pads = (trace.row_phase == -1) & (trace.row_len > 0)
    if rec.pad_guard and c.pad == "minus1" and bool(pads.any()):
        return ("not applicable: aiter's pad_slot_guard takes slots <= 0 for padding (kda.py:142, kda_decode.py:452), "
                "which under pad=minus1 would skip the live slot 0 as well, and without it index -1 addresses one "
                f"slot stride before slot 0; this trace has {int(pads.sum())} padding rows with tokens under pad=minus1")
    if not rec.pad_guard and c.pad == "minus1" and c.offset < c.stride and bool(pads.any()):
        return (f"not applicable: fla's fused_recurrent_kda_fwd has no pad-slot guard (it skips only 0-token rows, "
                f"fused_recurrent.py:99-100): a padding row's -1 reads and writes the {c.slot_numel} elements one slot "
                f"stride ({c.stride}) before slot 0, outside this cache's buffer (guard {c.offset} elements); this trace "
                f"has {int(pads.sum())} padding rows with tokens")
    return None
