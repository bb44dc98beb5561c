"""The flash-linear-attention (fla) chunked form and its intermediates, in float64.

Chunk size BT in {32, 64}; chunks aligned to each sequence start; γ_i = Σ_{s<=i} a_s
(chunk-local, natural log), γ_last = γ at the chunk's last valid row.  Per value head:

    g_cumsum  = γ · log2(e)                                              [B,T,HV,K]
    Aqk[i,j]  = scale Σ_d q_id k_jd exp(γ_id - γ_jd)      (j <= i)        [B,T,HV,BT]
    L'[i,j]   = β_i Σ_d k_id k_jd exp(γ_id - γ_jd)        (j < i, row β)
    Akk       = (I + L')^{-1}                                              [B,T,HV,BT]
    w         = Akk (β ⊙ k ⊙ exp(γ))                                       [B,T,HV,K]
    u         = Akk (β ⊙ v)                                                [B,T,HV,V]
    kg        = k ⊙ exp(γ_last - γ)                                        [B,T,HV,K]
    h[c]      = S_c, the state at the start of chunk c (K-first)          [B,NT,HV,K,V]
    v_new     = u - w S_c                                                  [B,T,HV,V]
    S_{c+1}   = diag(exp(γ_last)) S_c + kg^T v_new
    o_i       = scale (q_i ⊙ exp(γ_i))^T S_c + Σ_{j<=i} Aqk[i,j] v_new_j

Column j of Aqk/Akk is the position j within the row's chunk.  With varlen (B = 1) NT is the
total number of chunks of all sequences, in order.  The exponents are taken pair by pair
(every exponent used is <= 0 for decaying gates), independently of the workspace's pivot form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .preprocess import F64, LOG2E, Prepared
from .tiles import tile_grid
from .workspace import decayed_gram_pairwise

FLA_CHUNK_SIZES = (32, 64)


@dataclass
class FlaForm:
    BT: int
    g_cumsum: torch.Tensor   # [Ttot, HV, K]
    Aqk: torch.Tensor        # [Ttot, HV, BT]
    Akk: torch.Tensor        # [Ttot, HV, BT]
    w: torch.Tensor          # [Ttot, HV, K]
    u: torch.Tensor          # [Ttot, HV, V]
    kg: torch.Tensor         # [Ttot, HV, K]
    v_new: torch.Tensor      # [Ttot, HV, V]
    h: torch.Tensor          # [NT, HV, K, V]
    o: torch.Tensor          # [Ttot, HV, V]
    final_state: torch.Tensor  # [N, HV, K, V]

    def tensors(self, B: int, T: int) -> dict:
        """The intermediates in fla's layouts ([B,T,HV,.] and h [B,NT,HV,K,V])."""
        out = {n: getattr(self, n).reshape((B, T) + tuple(getattr(self, n).shape[1:]))
               for n in ("g_cumsum", "Aqk", "Akk", "w", "u", "kg", "v_new")}
        out["h"] = self.h.reshape((B, -1) + tuple(self.h.shape[1:]))
        return out


def fla_form(pp: Prepared, BT: int = 64) -> FlaForm:
    """Every fla intermediate and the o / final state they give, for chunk size BT (32 or 64)."""
    if BT not in FLA_CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {FLA_CHUNK_SIZES} (fla), got {BT!r}")
    Ttot, HV, K = pp.k.shape
    V = pp.v.shape[-1]
    grid = tile_grid(pp.bounds, BT, Ttot, device=pp.k.device)
    tiles = grid.tiles
    valid = grid.row_mask[None, :, :, None]                                   # [1, tiles, C, 1]
    q, k, v, a = (grid.gather(x) for x in (pp.q, pp.k, pp.v, pp.a))          # [HV, tiles, C, .]
    beta = grid.gather(pp.beta)[..., None]                                     # [HV, tiles, C, 1]
    gam = torch.cumsum(a, dim=2)
    gam_last = gam[:, :, -1:, :]                                               # tail a = 0
    flat = lambda x: x.reshape((HV * tiles,) + tuple(x.shape[2:]))            # noqa: E731
    G = flat(gam * LOG2E)                                                     # 2^{G_i - G_j} = e^{γ_i - γ_j}
    Aqk = decayed_gram_pairwise(flat(pp.scale * q), flat(k), G, include_diag=True).view(HV, tiles, BT, BT)
    Lp = beta * decayed_gram_pairwise(flat(k), flat(k), G, include_diag=False).view(HV, tiles, BT, BT)
    eye = torch.eye(BT, dtype=F64, device=k.device).expand_as(Lp)
    Akk = torch.linalg.solve_triangular(eye + Lp, eye, upper=False, unitriangular=True)
    Akk = Akk * valid * valid.transpose(-1, -2)                                # tail rows/columns zero
    w = Akk @ (beta * k * torch.exp(gam))
    u = Akk @ (beta * v)
    kg = k * torch.exp(torch.where(valid, gam_last - gam, torch.zeros_like(gam))) * valid
    qg = pp.scale * q * torch.exp(gam)
    decay = torch.exp(gam_last[:, :, 0, :])                                    # [HV, tiles, K]
    h = torch.zeros(tiles, HV, K, V, dtype=F64, device=k.device)
    v_new = torch.zeros(HV, tiles, BT, V, dtype=F64, device=k.device)
    o = torch.zeros_like(v_new)
    sg = grid.seq_grid()
    S = pp.S0.transpose(0, 1).clone()                                          # [HV, N, K, V]
    for c in range(sg.shape[1]):
        idx = sg[:, c]
        live = torch.nonzero(idx >= 0).flatten()
        t = idx[live]
        Sc = S[:, live]
        h[t] = Sc.transpose(0, 1)
        vn = u[:, t] - w[:, t] @ Sc
        v_new[:, t] = vn
        o[:, t] = qg[:, t] @ Sc + Aqk[:, t] @ vn
        S[:, live] = decay[:, t, :, None] * Sc + kg[:, t].transpose(-1, -2) @ vn
    tok = lambda x: grid.scatter(x)                                            # noqa: E731
    return FlaForm(BT=BT, g_cumsum=tok(gam * LOG2E), Aqk=tok(Aqk), Akk=tok(Akk), w=tok(w), u=tok(u), kg=tok(kg),
                   v_new=tok(v_new), h=h, o=tok(o), final_state=S.transpose(0, 1).contiguous())
