"""An mpmath evaluation of KDA (preprocessing and token recurrence) at ``dps`` decimal digits.

Plain loops, for small problems only: it is the check on the float64 oracle's arithmetic.
The inputs are taken exactly (every float64 is an exact mpf) and the whole computation,
l2norm, beta, gate and the recurrence of kda_ref.recurrence, runs in mpmath:

    S <- diag(exp(a_t)) S;   d = β_t (v_t - S^T k_t);   S <- S + k_t d^T;   o_t = scale S^T q_t
"""
from __future__ import annotations

import mpmath
import torch

from .preprocess import L2NORM_EPS, initial_state_kfirst
from .problem import Problem, validate

F64 = torch.float64


def _mp(t: torch.Tensor):
    return [mpmath.mpf(float(x)) for x in t.detach().to("cpu", F64).reshape(-1).tolist()]


def _l2norm(x, mp):
    s = mp.sqrt(mp.fsum(xi * xi for xi in x) + mp.mpf(L2NORM_EPS))
    return [xi / s for xi in x]


def _beta(b, kind, mp):
    if kind == "sigmoid":
        return 1 / (1 + mp.exp(-b))
    if kind == "sigmoid2":
        return 2 / (1 + mp.exp(-b))
    return b


def _gate(x, kind, rate, lb, mp):
    if kind == "pregated":
        return x
    if kind == "lower_bound":
        return mp.mpf(lb) / (1 + mp.exp(-rate * x))
    return -rate * mp.log1p(mp.exp(x))       # softplus


def mp_recurrence(p: Problem, dps: int = 40):
    """(o [B,T,HV,V], final state [N,HV,K,V] K-first) as float64 tensors rounded from a ``dps``-digit
    evaluation of the whole forward."""
    validate(p)
    with mpmath.workdps(dps):
        return _run(p, mpmath.mp)


def _run(p: Problem, mp):
    B, T, H, K, HV, V = p.B, p.T, p.H, p.K, p.HV, p.V
    Tt = B * T
    q, k, v, g, beta = (_mp(x) for x in (p.q, p.k, p.v, p.g, p.beta))
    A_log = _mp(p.A_log) if p.A_log is not None else None
    dt = _mp(p.dt_bias) if p.dt_bias is not None else None
    scale = mp.mpf(p.scale_value)
    lb = p.lower_bound
    group = HV // H
    S0 = _mp(initial_state_kfirst(p))                       # exact: a gather / transpose of the inputs
    o = [mp.mpf(0)] * (Tt * HV * V)
    final = [mp.mpf(0)] * (p.N * HV * K * V)
    for n, (bos, eos) in enumerate(p.seq_bounds()):
        for hv in range(HV):
            h = hv // group
            rate = mp.mpf(1) if A_log is None else mp.exp(A_log[hv])
            S = [[S0[((n * HV + hv) * K + i) * V + j] for j in range(V)] for i in range(K)]
            for t in range(bos, eos):
                qt = q[(t * H + h) * K:(t * H + h + 1) * K]
                kt = k[(t * H + h) * K:(t * H + h + 1) * K]
                if p.qk_l2norm:
                    qt, kt = _l2norm(qt, mp), _l2norm(kt, mp)
                vt = v[(t * HV + hv) * V:(t * HV + hv + 1) * V]
                gt = g[(t * HV + hv) * K:(t * HV + hv + 1) * K]
                x = [gt[i] + (dt[hv * K + i] if dt is not None else 0) for i in range(K)] \
                    if p.gate != "pregated" else gt
                a = [_gate(xi, p.gate, rate, lb, mp) for xi in x]
                bt = _beta(beta[t * HV + hv], p.beta_kind, mp)
                S = [[mp.exp(a[i]) * S[i][j] for j in range(V)] for i in range(K)]
                d = [bt * (vt[j] - mp.fsum(S[i][j] * kt[i] for i in range(K))) for j in range(V)]
                S = [[S[i][j] + kt[i] * d[j] for j in range(V)] for i in range(K)]
                for j in range(V):
                    o[(t * HV + hv) * V + j] = scale * mp.fsum(S[i][j] * qt[i] for i in range(K))
            for i in range(K):
                for j in range(V):
                    final[((n * HV + hv) * K + i) * V + j] = S[i][j]
    to = lambda xs, shape: torch.tensor([float(x) for x in xs], dtype=F64).reshape(shape)  # noqa: E731
    return to(o, (B, T, HV, V)), to(final, (p.N, HV, K, V))
