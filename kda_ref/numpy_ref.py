"""The oracle in plain NumPy, one sequence and one head at a time (for reading, not speed).

It restates kda_ref's torch path line by line: preprocessing (docs/design.md, The math), the token
recurrence, one chunk's workspace with both inverses, and the chunked forward.  Tests hold
the torch path to it.
"""
from __future__ import annotations

import numpy as np

from .problem import Problem, validate

LOG2E = 1.4426950408889634
L2NORM_EPS = 1e-6


def _np(t):
    return None if t is None else t.detach().to("cpu").double().numpy()


def l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def prepare(p: Problem) -> dict:
    """Packed float64 arrays: q, k [Ttot,HV,K] (GVA-expanded), v [Ttot,HV,V], a [Ttot,HV,K]
    (natural-log decay), beta [Ttot,HV], S0 [N,HV,K,V] (K-first), scale, bounds."""
    validate(p)
    B, T, H, K, HV, V = p.B, p.T, p.H, p.K, p.HV, p.V
    Tt = B * T
    q, k = _np(p.q).reshape(Tt, H, K), _np(p.k).reshape(Tt, H, K)
    if p.qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = HV // H
    q, k = np.repeat(q, group, axis=1), np.repeat(k, group, axis=1)
    x = _np(p.g).reshape(Tt, HV, K)
    if p.gate != "pregated":
        if p.dt_bias is not None:
            x = x + _np(p.dt_bias).reshape(HV, K)
        rate = np.ones((HV, 1)) if p.A_log is None else np.exp(_np(p.A_log)).reshape(HV, 1)
        if p.gate == "lower_bound":
            x = p.lower_bound * sigmoid(rate * x)
        else:
            x = -rate * np.logaddexp(x, 0.0)
    b = _np(p.beta).reshape(Tt, HV)
    beta = {"sigmoid": sigmoid(b), "sigmoid2": 2 * sigmoid(b), "pregated": b}[p.beta_kind]
    N = p.N
    if p.paged:
        cache, idx, has = _np(p.state_cache), _np(p.state_indices).astype(int), _np(p.has_initial_state)
        S0 = np.zeros((N, HV, K, V))
        for n in range(N):
            if has[n]:
                S0[n] = np.swapaxes(cache[idx[n]], -1, -2)
    elif p.initial_state is None:
        S0 = np.zeros((N, HV, K, V))
    else:
        S0 = _np(p.initial_state)
        S0 = S0 if p.state_layout == "kv" else np.swapaxes(S0, -1, -2)
    return dict(q=q, k=k, v=_np(p.v).reshape(Tt, HV, V), a=x, beta=beta, S0=S0.copy(), scale=p.scale_value,
                bounds=p.seq_bounds())


def recurrence(pp: dict):
    """(o [Ttot,HV,V], final [N,HV,K,V]) by the token loop, per sequence and head."""
    o = np.zeros_like(pp["v"])
    final = pp["S0"].copy()
    for n, (bos, eos) in enumerate(pp["bounds"]):
        for h in range(o.shape[1]):
            S = pp["S0"][n, h].copy()
            for t in range(bos, eos):
                S = np.exp(pp["a"][t, h])[:, None] * S
                d = pp["beta"][t, h] * (pp["v"][t, h] - S.T @ pp["k"][t, h])
                S = S + np.outer(pp["k"][t, h], d)
                o[t, h] = pp["scale"] * S.T @ pp["q"][t, h]
            final[n, h] = S
    return o, final


def production_inverse(L, dtype=np.float64, block: int = 16):
    """(I - L)^{-1} by Neumann doubling on block x block diagonal blocks, then block merges."""
    C = L.shape[0]
    Lw = L.astype(dtype)
    bw = min(block, C)
    r = np.arange(C)
    D = np.where((r[:, None] // bw) == (r[None, :] // bw), Lw, 0).astype(dtype)
    INV = np.eye(C, dtype=dtype) + D
    P = D @ D
    for _ in range(max(bw.bit_length() - 2, 0)):
        INV = INV + INV @ P
        P = P @ P
    w = bw
    while w < C:
        off = ((r[:, None] // (2 * w)) == (r[None, :] // (2 * w))) & ((r[:, None] // w) != (r[None, :] // w))
        L_off = np.where(off, Lw, 0).astype(dtype)
        INV = INV + INV @ (L_off @ INV)
        w *= 2
    return INV


def chunk_workspace(q, k, v, a, beta, scale: float, C: int) -> dict:
    """One chunk of one head: q, k, a [Lc,K], v [Lc,V], beta [Lc] with Lc <= C rows.
    Returns kd, qd, kr [C,K], gt [K], L, mqk, inv (exact), inv_production [C,C], beta [C], pivot."""
    Lc, K = k.shape
    G = LOG2E * np.cumsum(a, axis=0)
    G_last = G[Lc - 1]
    pad = lambda x: np.concatenate([x, np.zeros((C - Lc,) + x.shape[1:])])  # noqa: E731
    kd, qd, kr = pad(k * 2.0 ** G), pad(scale * q * 2.0 ** G), pad(k * 2.0 ** (G_last - G))
    p = min(C // 2, Lc - 1)
    Gh = G - G[p]
    kp, ki, qp = k * 2.0 ** Gh, k * 2.0 ** -Gh, scale * q * 2.0 ** Gh
    L = np.zeros((C, C))
    mqk = np.zeros((C, C))
    for i in range(Lc):
        for j in range(i + 1):
            if j < i:
                L[i, j] = -beta[i] * kp[i] @ ki[j]
            mqk[i, j] = qp[i] @ ki[j]
    inv = np.linalg.solve(np.eye(C) - L, np.eye(C))
    return dict(kd=kd, qd=qd, kr=kr, gt=2.0 ** G_last, L=L, mqk=mqk, inv=inv,
                inv_production=production_inverse(L), beta=pad(beta), v=pad(v), pivot=p)


def chunked(pp: dict, C: int):
    """(o, final) of the chunked form: per sequence, head and chunk,
    U = inv (β ⊙ (v - kd S)); o = qd S + mqk U; S <- diag(gt) S + kr^T U."""
    o = np.zeros_like(pp["v"])
    final = pp["S0"].copy()
    for n, (bos, eos) in enumerate(pp["bounds"]):
        for h in range(o.shape[1]):
            S = pp["S0"][n, h].copy()
            for c0 in range(bos, eos, C):
                c1 = min(c0 + C, eos)
                w = chunk_workspace(pp["q"][c0:c1, h], pp["k"][c0:c1, h], pp["v"][c0:c1, h], pp["a"][c0:c1, h],
                                    pp["beta"][c0:c1, h], pp["scale"], C)
                U = w["inv"] @ (w["beta"][:, None] * (w["v"] - w["kd"] @ S))
                o[c0:c1, h] = (w["qd"] @ S + w["mqk"] @ U)[: c1 - c0]
                S = w["gt"][:, None] * S + w["kr"].T @ U
            final[n, h] = S
    return o, final
