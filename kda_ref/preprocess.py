"""Preprocessing in float64 (torch path): l2norm, beta kinds, gate kinds, GVA expansion,
the chunk-local log2 cumsum, and the packing of sequences.

    l2norm(x)   = x / sqrt(sum_d x_d^2 + 1e-6)                       (eps inside the sqrt)
    beta        = sigmoid(b) | 2*sigmoid(b) | b                       (sigmoid | sigmoid2 | pregated)
    a (nat-log decay per token and key channel):
        lower_bound: lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h,:]))  (A_log None -> rate 1)
        softplus:    -exp(A_log[h]) * softplus(g + dt_bias[h,:])
        pregated:    g
    G_i = log2(e) * sum_{s <= i, s in the same chunk} a_s              (chunk-local, log2 units)

Everything is float64 on the device of the inputs.  Tokens are packed ``[Ttot, HV, .]``
(``Ttot = B*T``); sequence n covers ``[bos_n, eos_n)`` of that axis.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import paged_read
from .problem import GATE_KINDS, Problem

F64 = torch.float64
LOG2E = 1.4426950408889634
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, inplace: bool = False, tmp: torch.Tensor = None) -> torch.Tensor:
    """x / sqrt(sum(x^2, last dim) + 1e-6), in float64.  ``inplace`` (x already float64): the
    quotient is written into x; ``tmp``, an array of x's shape for x^2."""
    x = x.to(F64)
    sq = x * x if tmp is None else torch.mul(x, x, out=tmp)
    den = torch.sqrt(sq.sum(-1, keepdim=True) + L2NORM_EPS)
    return x.div_(den) if inplace else x / den


def beta_activation(beta_raw: torch.Tensor, kind: str) -> torch.Tensor:
    b = beta_raw.to(F64)
    if kind == "sigmoid":
        return torch.sigmoid(b)
    if kind == "sigmoid2":
        return 2.0 * torch.sigmoid(b)
    if kind == "pregated":
        return b
    raise ValueError(f"beta_kind: expected sigmoid|sigmoid2|pregated, got {kind!r}")


def gate_activation(g: torch.Tensor, kind: str, A_log=None, dt_bias=None, lower_bound=None,
                    inplace: bool = False) -> torch.Tensor:
    """Natural-log decay a [..., HV, K] from the raw gate g [..., HV, K].  ``inplace`` (g already
    float64): every step is written into g, which is returned (the same operations)."""
    if kind not in GATE_KINDS:
        raise ValueError(f"gate: expected lower_bound|softplus|pregated, got {kind!r}")
    x = g.to(F64)
    if kind == "pregated":
        return x
    HV, K = x.shape[-2], x.shape[-1]
    if x is g and not inplace:             # g was float64 already: never write into the caller's tensor
        x = x.clone()
    if dt_bias is not None:
        x.add_(dt_bias.to(F64).reshape(HV, K))
    if kind == "lower_bound":
        if A_log is not None:
            x.mul_(torch.exp(A_log.to(F64)).reshape(HV, 1))
        return x.sigmoid_().mul_(float(lower_bound))
    # softplus(x) = log(1 + e^x), stable for any x in float64
    torch.logaddexp(x, torch.zeros((), dtype=F64, device=x.device), out=x)
    return x.mul_(-torch.exp(A_log.to(F64)).reshape(HV, 1))


def expand_gva(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[..., H, D] -> [..., HV, D]: value head hv uses query/key head hv // (HV/H)."""
    H = x.shape[-2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=-2)


@dataclass
class Prepared:
    """Float64 packed inputs after preprocessing (value-head indexed)."""
    q: torch.Tensor      # [Ttot, HV, K]  (l2-normed if the problem says so)
    k: torch.Tensor      # [Ttot, HV, K]
    v: torch.Tensor      # [Ttot, HV, V]
    a: torch.Tensor      # [Ttot, HV, K]  natural-log decay
    beta: torch.Tensor   # [Ttot, HV]
    scale: float
    bounds: list         # [(bos, eos)] per sequence
    S0: torch.Tensor     # [N, HV, K, V] initial state, K-first (zeros where none)


def initial_state_kfirst(p: Problem) -> torch.Tensor:
    """The initial state of every sequence, K-first [N,HV,K,V] float64 (the paged read included)."""
    N, HV, K, V = p.N, p.HV, p.K, p.V
    if p.paged:
        return paged_read(p.state_cache, p.state_indices, p.has_initial_state)
    if p.initial_state is None:
        return torch.zeros(N, HV, K, V, dtype=F64, device=p.device)
    s = p.initial_state.to(device=p.device, dtype=F64)
    return s if p.state_layout == "kv" else s.transpose(-1, -2).contiguous()


def prepare(p: Problem) -> Prepared:
    """Apply the problem's preprocessing kinds; pack [B,T] into one token axis."""
    HV = p.HV
    Tt = p.B * p.T
    q = p.q.reshape(Tt, p.H, p.K).to(F64)
    k = p.k.reshape(Tt, p.H, p.K).to(F64)
    if p.qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = expand_gva(q, HV), expand_gva(k, HV)
    a = gate_activation(p.g.reshape(Tt, HV, p.K), p.gate, p.A_log, p.dt_bias, p.lower_bound)
    beta = beta_activation(p.beta.reshape(Tt, HV), p.beta_kind)
    v = p.v.reshape(Tt, HV, p.V).to(F64)
    return Prepared(q=q, k=k, v=v, a=a, beta=beta, scale=p.scale_value, bounds=p.seq_bounds(),
                    S0=initial_state_kfirst(p))


def chunk_log2_cumsum(a: torch.Tensor, bounds, C: int) -> torch.Tensor:
    """G [Ttot, HV, K]: log2(e) * cumsum of a within each chunk of C tokens, chunks aligned to
    each sequence start (the last chunk of a sequence may be partial)."""
    G = torch.zeros_like(a, dtype=F64)
    for bos, eos in bounds:
        for c0 in range(bos, eos, C):
            c1 = min(c0 + C, eos)
            G[c0:c1] = LOG2E * torch.cumsum(a[c0:c1].to(F64), dim=0)
    return G


def pad_sequences(x: torch.Tensor, bounds, length: int) -> torch.Tensor:
    """Packed [Ttot, ...] -> padded [N, length, ...] (zeros past each sequence's end)."""
    out = x.new_zeros((len(bounds), length) + tuple(x.shape[1:]))
    for n, (bos, eos) in enumerate(bounds):
        out[n, : eos - bos] = x[bos:eos]
    return out


def unpad_sequences(x: torch.Tensor, bounds, Ttot: int) -> torch.Tensor:
    """Padded [N, L, ...] -> packed [Ttot, ...]."""
    out = x.new_zeros((Ttot,) + tuple(x.shape[2:]))
    for n, (bos, eos) in enumerate(bounds):
        out[bos:eos] = x[n, : eos - bos]
    return out
