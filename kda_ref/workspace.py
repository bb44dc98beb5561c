"""The FlashKDA workspace in float64 (the buffers kernel 1 writes), for chunk size C.

Per value head hv and tile (chunk) t with Lc valid rows, G_i = log2(e) * sum_{s<=i} a_s
(chunk-local, log2 units), G_last = G_{Lc-1}:

    ws_kd[i]  = k̂_i ⊙ 2^{G_i}                 ws_qd[i] = scale · q̂_i ⊙ 2^{G_i}
    ws_kr[i]  = k̂_i ⊙ 2^{G_last - G_i}        ws_gt    = 2^{G_last}
    L_ij      = -β_i Σ_d k̂_id k̂_jd 2^{G_id - G_jd}          (i > j, else 0)
    ws_mqk_ij = scale Σ_d q̂_id k̂_jd 2^{G_id - G_jd}         (i >= j, else 0)
    ws_inv    = (I - L)^{-1}                                  ws_beta[i] = β_i

Layout is the production one: head-major tiles, ``ws_idx = hv * tiles + tile``
(``ws_kd [HV*tiles, C, K]``, ``ws_gt [HV*tiles, K]``, ``ws_inv [HV*tiles, C, C]``, ...).
Tail rows (i >= Lc) of ws_kd, ws_qd, ws_kr, ws_mqk, ws_beta and L are zero; ws_inv is the
inverse of the full C x C matrix I - L, so its tail block is the identity (a kernel's tail
rows of INV are never used: compare rows < Lc).

The exponents pass through the pivot row p = min(C/2, Lc-1): with Ĝ = G - G_p,
``Σ_d (k̂_id 2^{Ĝ_id}) (k̂_jd 2^{-Ĝ_jd})`` so neither factor spans more than about half the
chunk's decay range.  Where even that would leave float64's range (|Ĝ| > 480 log2 units,
e.g. softplus gates with raw g near +40), that (head, tile) is evaluated pair by pair in
log space instead, ``2^{G_id - G_jd}`` with a non-positive exponent, which cannot overflow.

The inverse is available two ways: the exact triangular solve (``exact_inverse``) and the
production construction (``production_inverse``: 16-wide diagonal blocks by Neumann doubling,
then block merges), evaluated in float64 or float32.  ``inverse_report`` measures each
construction: the 1-norm condition number κ₁(I - L) = ||I - L||₁ ||(I - L)^{-1}||₁ and the
LAPACK DTRT01 residual ratio ||(I - L) X - I||₁ / (n ||I - L||₁ ||X||₁ eps) with n = C and
eps = 2^-53 for float64 evaluations, 2^-24 (unit roundoff of float32) for float32 ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .preprocess import F64, LOG2E, Prepared, prepare
from .problem import validate
from .tiles import TileGrid, tile_grid

PIVOT_SAFE_LOG2 = 480.0      # |Ĝ| above this: pairwise log-space evaluation of that (head, tile)
NEUMANN_BLOCK = 16           # diagonal block width of the production inverse
EPS64 = 2.0 ** -53
EPS32 = 2.0 ** -24
SUPPORTED_C = (16, 32, 64)


class BlockBuffers:
    """Float64 arrays reused from one block of work to the next: ``get(name, shape)`` returns the
    array kept under ``name`` viewed as ``shape`` when it holds as many elements (contents left as
    the last user wrote them), else a new one kept under that name.  Every block but the last of a
    streamed run has the same shapes, so its working arrays are allocated once, not once per block;
    and two temporaries whose lives do not overlap can share one array by taking the same name,
    whatever their shapes."""

    def __init__(self, device=None, dtype=F64):
        self.device, self.dtype, self.arrays, self.grids = device, dtype, {}, {}

    def get(self, name: str, shape) -> torch.Tensor:
        shape = tuple(shape)
        x = self.arrays.get(name)
        if x is None or x.numel() != math.prod(shape):
            x = self.arrays[name] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return x if x.shape == shape else x.view(shape)

    def bytes(self) -> int:
        """The bytes of every array kept."""
        return sum(x.numel() * x.element_size() for x in self.arrays.values())

    def clear(self) -> None:
        """Drop every array (before a block of other shapes, so the old and the new set are never
        held together)."""
        self.arrays, self.grids = {}, {}

    def tile_grid(self, bounds, C: int, Ttot: int) -> TileGrid:
        """``tiles.tile_grid(bounds, C, Ttot)`` on this device, kept for the next block of the same
        bounds (its index tensors are only read)."""
        key = (tuple(bounds), int(C), int(Ttot))
        if self.grids.get("key") != key:
            self.grids = {"key": key, "grid": tile_grid(bounds, C, Ttot, device=self.device)}
        return self.grids["grid"]


@dataclass
class Workspace:
    C: int
    HV: int
    grid: TileGrid
    ws_kd: torch.Tensor     # [HV*tiles, C, K]
    ws_qd: torch.Tensor     # [HV*tiles, C, K]   scale folded in
    ws_kr: torch.Tensor     # [HV*tiles, C, K]
    ws_gt: torch.Tensor     # [HV*tiles, K]
    ws_inv: torch.Tensor    # [HV*tiles, C, C]   (I - L)^{-1}, exact triangular solve
    ws_mqk: torch.Tensor    # [HV*tiles, C, C]   lower triangle incl. diagonal, scale folded in
    ws_beta: torch.Tensor   # [HV*tiles, C]      tail rows zero
    L: torch.Tensor         # [HV*tiles, C, C]   strictly lower, L_ij = -β_i (k̂_i ⊙ 2^{G_i})·(k̂_j ⊙ 2^{-G_j})
    v: torch.Tensor         # [HV*tiles, C, V]   the values in tile layout (tail rows zero)
    pivot: torch.Tensor     # [tiles] pivot row p = min(C/2, Lc-1)

    @property
    def tiles(self) -> int:
        return self.grid.tiles

    @property
    def ws_L(self) -> torch.Tensor:
        """L under the name of the buffer our Triton K1 stores it in between its two launches."""
        return self.L

    def heads(self, name: str) -> torch.Tensor:
        """A ws tensor viewed as [HV, tiles, ...] (no copy)."""
        x = getattr(self, name)
        return x.view((self.HV, self.tiles) + tuple(x.shape[1:]))

    def tensors(self) -> dict:
        return {n: getattr(self, n) for n in ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk",
                                               "ws_beta")}


def _heads_flat(x: torch.Tensor) -> torch.Tensor:
    """[HV, tiles, ...] -> [HV*tiles, ...]"""
    return x.reshape((-1,) + tuple(x.shape[2:]))


def decayed_gram_pairwise(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, include_diag: bool,
                          block_elems: int = 1 << 24) -> torch.Tensor:
    """M_ij = Σ_d x_id k_jd 2^{G_id - G_jd} for i > j (i >= j with include_diag), else 0.
    x, k, G [M, C, K] -> [M, C, C]; exponents taken pairwise (log space), blocked over M."""
    Mtot, C, K = x.shape
    out = x.new_zeros(Mtot, C, C)
    tri = torch.tril(torch.ones(C, C, dtype=torch.bool, device=x.device), 0 if include_diag else -1)
    step = max(1, block_elems // (C * C * K))
    for m0 in range(0, Mtot, step):
        m1 = min(Mtot, m0 + step)
        diff = G[m0:m1, :, None, :] - G[m0:m1, None, :, :]              # [m, C, C, K]
        e = torch.exp2(torch.where(tri[None, :, :, None], diff, torch.full_like(diff, -torch.inf)))
        out[m0:m1] = torch.einsum("mid,mjd,mijd->mij", x[m0:m1], k[m0:m1], e)
    return out


def _pivot_grams(q, k, G, pivot, valid, scale, buffers=None, all_valid=None, sq=None, kr_out=None):
    """(KK, QK, kr) with KK, QK [HV, tiles, C, C]: Σ_d k̂_i k̂_j 2^{G_i-G_j} and scale Σ_d q̂_i k̂_j
    2^{G_i-G_j}, through the pivot row; unmasked (callers take the triangles).  ``buffers`` (a
    BlockBuffers) holds the temporaries (in its arrays "scratch_a" and "scratch_b") and the
    results; ``all_valid`` (every row valid, known on the host) skips the row mask; ``sq`` is
    ``scale * q`` when the caller has it (it is overwritten).  ``kr_out`` (an array of k's shape):
    ws_kr = k̂_i 2^{G_last - G_i} is written there and returned, as (k̂_i 2^{-Ĝ_i}) 2^{G_last - G_p}
    from the factor the grams use when every (head, tile) is within the pivot's range, else
    directly; without ``kr_out`` kr is None."""
    HV, tiles, C, K = k.shape
    buf = buffers if buffers is not None else BlockBuffers(k.device)
    Gp = torch.gather(G, 2, pivot.view(1, tiles, 1, 1).expand(HV, tiles, 1, K))     # [HV,tiles,1,K]
    Gh = torch.sub(G, Gp, out=buf.get("scratch_a", G.shape))                        # Ĝ = G - G_p
    if not all_valid:
        Gh.masked_fill_(~valid[None, :, :, None], 0.0)
    span = torch.maximum(Gh.amax(dim=(2, 3)), Gh.amin(dim=(2, 3)).neg_())           # max |Ĝ|, [HV, tiles]
    safe = span <= PIVOT_SAFE_LOG2
    all_safe = bool(safe.all())
    Gs = Gh if all_safe else torch.where(safe[:, :, None, None], Gh, torch.zeros_like(Gh))
    up = torch.exp2(Gs, out=buf.get("scratch_b", G.shape))                          # 2^{Ĝ}
    ki = torch.div(k, up, out=buf.get("scratch_a", G.shape))                        # k 2^{-Ĝ} (over Ĝ)
    qp = (scale * q if sq is None else sq).mul_(up)                                  # scale q 2^{Ĝ}
    kp = up.mul_(k)                                                                  # k 2^{Ĝ}
    kiT = ki.transpose(-1, -2)
    KK = torch.matmul(kp, kiT, out=buf.get("pg_KK", (HV, tiles, C, C)))
    QK = torch.matmul(qp, kiT, out=buf.get("pg_QK", (HV, tiles, C, C)))
    if not all_safe:
        bad = ~safe
        KK[bad] = decayed_gram_pairwise(k[bad], k[bad], G[bad], include_diag=False)
        QK[bad] = decayed_gram_pairwise(scale * q[bad], k[bad], G[bad], include_diag=True)
    kr = None
    if kr_out is not None:
        G_last = G[:, :, -1:, :]
        kr = (torch.mul(ki, torch.exp2(G_last - Gp), out=kr_out) if all_safe
              else torch.sub(G_last, G, out=kr_out).exp2_().mul_(k))
    return KK, QK, kr


def exact_inverse(L: torch.Tensor, buffers=None) -> torch.Tensor:
    """(I - L)^{-1} of strictly lower-triangular L [..., C, C] by a triangular solve.
    ``buffers`` (a BlockBuffers): I - L and the result are kept there, the result column-major
    (a transposed view: the layout LAPACK solves in, so it is written in place, no copy)."""
    C = L.shape[-1]
    eye = torch.eye(C, dtype=L.dtype, device=L.device).expand_as(L)
    if buffers is None:
        return torch.linalg.solve_triangular(eye - L, eye, upper=False, unitriangular=True)
    A = torch.sub(eye, L, out=buffers.get("inv_A", L.shape))
    X = buffers.get("inv_X", L.shape).transpose(-1, -2)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True, out=X)


def production_inverse(L: torch.Tensor, dtype: torch.dtype = F64, block: int = NEUMANN_BLOCK) -> torch.Tensor:
    """(I - L)^{-1} as the production kernel builds it, every operation in ``dtype``:

        D = L on its block x block diagonal blocks;   INV = I + D;   P = D·D
        repeat log2(block) - 1 times:  INV <- INV + INV·P;  P <- P·P     (= Σ_{n<block} D^n, exact)
        for w = block, 2·block, ... < C:
            L_off = L inside each 2w-diagonal block but outside its two w-blocks
            INV <- INV + INV·(L_off·INV)

    On CUDA, float32 matmuls follow torch's float32 matmul precision (IEEE unless TF32 is enabled)."""
    C = L.shape[-1]
    Lw = L.to(dtype)
    r = torch.arange(C, device=L.device)
    eye = torch.eye(C, dtype=dtype, device=L.device)
    bw = min(block, C)
    same = (r[:, None] // bw) == (r[None, :] // bw)
    D = torch.where(same, Lw, torch.zeros((), dtype=dtype, device=L.device))
    INV = eye + D
    P = D @ D
    for _ in range(max(bw.bit_length() - 2, 0)):
        INV = INV + INV @ P
        P = P @ P
    w = bw
    while w < C:
        in2w = (r[:, None] // (2 * w)) == (r[None, :] // (2 * w))
        inw = (r[:, None] // w) == (r[None, :] // w)
        L_off = torch.where(in2w & ~inw, Lw, torch.zeros((), dtype=dtype, device=L.device))
        INV = INV + INV @ (L_off @ INV)
        w *= 2
    return INV


def norm1(x: torch.Tensor) -> torch.Tensor:
    """Matrix 1-norm (largest absolute column sum) over the last two dims."""
    return x.abs().sum(-2).amax(-1)


def residual_ratio(L: torch.Tensor, X: torch.Tensor, eps: float) -> torch.Tensor:
    """LAPACK DTRT01: ||(I - L) X - I||₁ / (n ||I - L||₁ ||X||₁ eps), n = C, evaluated in float64."""
    C = L.shape[-1]
    eye = torch.eye(C, dtype=F64, device=L.device)
    A = eye - L.to(F64)
    Xd = X.to(F64)
    R = A @ Xd - eye
    return norm1(R) / (C * norm1(A) * norm1(Xd) * eps)


def condition_number(L: torch.Tensor, inv: torch.Tensor = None) -> torch.Tensor:
    """κ₁(I - L) = ||I - L||₁ ||(I - L)^{-1}||₁ per matrix."""
    C = L.shape[-1]
    A = torch.eye(C, dtype=F64, device=L.device) - L.to(F64)
    return norm1(A) * norm1(exact_inverse(L) if inv is None else inv)


def inverse_report(ws: Workspace) -> dict:
    """Per (head, tile) [HV*tiles] float64: ``cond1`` κ₁(I - L); the DTRT01 residual ratios
    ``ratio_exact`` (triangular solve, eps 2^-53), ``ratio_prod64`` (production construction in
    float64, eps 2^-53) and ``ratio_prod32`` (production construction in float32, eps 2^-24)."""
    L = ws.L
    return {
        "cond1": condition_number(L, ws.ws_inv),
        "ratio_exact": residual_ratio(L, ws.ws_inv, EPS64),
        "ratio_prod64": residual_ratio(L, production_inverse(L, F64), EPS64),
        "ratio_prod32": residual_ratio(L, production_inverse(L, torch.float32), EPS32),
    }


def chunk_log2_cumsum_tiles(a_tiles: torch.Tensor) -> torch.Tensor:
    """G [HV, tiles, C, K] = log2(e) * cumsum over rows of a (tail rows have a = 0, so G stays G_last)."""
    return LOG2E * torch.cumsum(a_tiles, dim=2)


def _log2_cumsum_rows(a: torch.Tensor, buf: BlockBuffers) -> torch.Tensor:
    """``chunk_log2_cumsum_tiles(a)`` into ``buf``'s "ws_G" [HV, tiles, C, K].  The running sum
    along the rows is taken with the rows as the last (contiguous) dimension, where torch's CPU
    cumsum is vectorised: the same sums in the same order, so the same values."""
    HV, tiles, C, K = a.shape
    G = buf.get("ws_G", a.shape)
    if a.device.type != "cpu":
        return torch.cumsum(a, dim=2, out=G).mul_(LOG2E)
    at = buf.get("scratch_a", (HV, tiles, K, C))
    at.copy_(a.transpose(-1, -2))
    gt = at.cumsum_(dim=-1)
    return torch.mul(gt.transpose(-1, -2), LOG2E, out=G)


def workspace_prepared(pp: Prepared, C: int, inverse: str = "exact", buffers=None) -> Workspace:
    """The float64 workspace of prepared inputs for chunk size C (16, 32 or 64).
    ``inverse``: "exact" (triangular solve) or "production" (the kernel's construction in float64).
    ``buffers`` (a BlockBuffers): the workspace and its temporaries are written into its arrays,
    so the workspace lives until the next use of the same buffers.  Inputs already in head-major
    layout (``[Ttot, HV, .]`` views of ``[HV, Ttot, .]`` arrays) are tiled without a copy when
    every tile is full; the workspace never writes into them."""
    if C not in SUPPORTED_C:
        raise ValueError(f"chunk_size: expected one of {SUPPORTED_C}, got {C!r}")
    if inverse not in ("exact", "production"):
        raise ValueError(f"inverse: expected exact|production, got {inverse!r}")
    buf = buffers if buffers is not None else BlockBuffers(pp.k.device)
    Ttot, HV, K = pp.k.shape
    grid = buf.tile_grid(pp.bounds, C, Ttot)
    valid = None if grid.full else grid.row_mask                            # [tiles, C]; None: all rows
    q, k, v = grid.gather(pp.q), grid.gather(pp.k), grid.gather(pp.v)      # [HV, tiles, C, .]
    a = grid.gather(pp.a)
    beta = grid.gather(pp.beta)                                             # [HV, tiles, C]
    shp = k.shape
    G = _log2_cumsum_rows(a, buf)                                           # chunk_log2_cumsum_tiles
    G_last = G[:, :, -1:, :]                                                # tail a = 0 -> G_{Lc-1}
    # tail rows: q = k = 0 and G = G_last, so every product below is 0 there without a mask
    eG = torch.exp2(G, out=buf.get("scratch_b", shp))                      # scratch: dead after qd
    ws_kd = torch.mul(k, eG, out=buf.get("ws_kd", shp))
    sq = torch.mul(q, pp.scale, out=buf.get("ws_sq", shp))                 # scale q
    ws_qd = torch.mul(sq, eG, out=buf.get("ws_qd", shp))
    ws_gt = torch.exp2(G_last[:, :, 0, :])
    pivot = torch.clamp(grid.tile_len - 1, max=C // 2)
    KK, QK, ws_kr = _pivot_grams(q, k, G, pivot, valid, pp.scale, buffers=buf, all_valid=grid.full, sq=sq,
                                 kr_out=buf.get("ws_kr", shp))
    L = KK.tril_(-1).mul_(torch.neg(beta)[..., None])                      # -β_i KK_ij, i > j
    mqk = QK.tril_(0)
    L, mqk = _heads_flat(L), _heads_flat(mqk)
    inv = exact_inverse(L, buffers) if inverse == "exact" else production_inverse(L, F64)
    return Workspace(C=C, HV=HV, grid=grid, ws_kd=_heads_flat(ws_kd), ws_qd=_heads_flat(ws_qd),
                     ws_kr=_heads_flat(ws_kr), ws_gt=_heads_flat(ws_gt), ws_inv=inv, ws_mqk=mqk,
                     ws_beta=_heads_flat(beta), L=L, v=_heads_flat(v), pivot=pivot)


def workspace(problem, C: int = 64, inverse: str = "exact") -> Workspace:
    """The float64 workspace of a Problem (validated, preprocessed) for chunk size C."""
    return workspace_prepared(prepare(validate(problem)), C, inverse)
