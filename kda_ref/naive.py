"""Read me first: KDA, one token at a time, for one sequence and one head, in float64.

This is the definition every kernel and every other form of the oracle must agree with
(``recurrence.py`` is the same loop vectorised over sequences and heads; ``truth`` picks the
fastest exact form).  Names in brackets are what the chunked form (``workspace.py``,
``chunked.py``) and the kernels call the same quantity.

Per token t, with the state S in R^{K x V} (K-first; a kernel may store it V-first):

    a_t = lb * sigmoid(exp(A_log) * (g_t + dt_bias))   natural-log decay per key channel, in [lb, 0)
                                                       [cumulated in log2 within a chunk: G]
    S  <- diag(exp(a_t)) S                             decay first          [ws_gt = 2^{G_last} per chunk]
    d   = beta_t * (v_t - S^T k_t)                      delta rule residual  [U = ws_inv (beta (v - ws_kd S))]
    S  <- S + k_t d^T                                  rank-1 write          [S' = diag(gt) S + ws_kr^T U]
    o_t = scale * S^T q_t                              read after the write  [o = ws_qd S + ws_mqk U]

q and k are L2-normalised first (eps inside the sqrt), beta = sigmoid(beta_raw), scale = K^-1/2
unless given.  A chunk of C tokens folds the loop into matrices: the decays of the tokens before
row i inside the chunk become 2^{G_i} factors on q and k, and the delta-rule interaction of the
chunk's rows with each other is the unit lower-triangular (I - L)^{-1} [ws_inv], with
L_ij = -beta_i k_i . (2^{G_i - G_j} k_j) for i > j.
"""
from __future__ import annotations

import math

import numpy as np


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6) along the last axis."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def lower_bound_gate(g: np.ndarray, A_log: float, dt_bias: np.ndarray, lb: float) -> np.ndarray:
    """a = lb * sigmoid(exp(A_log) * (g + dt_bias)), per token and key channel: [T, K]."""
    return lb / (1.0 + np.exp(-math.exp(A_log) * (g + dt_bias)))


def kda_one_head(q, k, v, g, beta_raw, A_log, dt_bias, lb, S0=None, scale=None):
    """One sequence, one head.  q, k, g: [T, K]; v: [T, V]; beta_raw: [T]; A_log: scalar;
    dt_bias: [K]; S0: [K, V] or None.  Returns (o [T, V], final state [K, V]), float64."""
    q, k, v, g = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g))
    T, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    q, k = l2norm(q), l2norm(k)
    beta = 1.0 / (1.0 + np.exp(-np.asarray(beta_raw, dtype=np.float64)))
    a = lower_bound_gate(g, A_log, np.asarray(dt_bias, dtype=np.float64), lb)
    S = np.zeros((K, v.shape[1])) if S0 is None else np.array(S0, dtype=np.float64)
    o = np.zeros_like(v)
    for t in range(T):
        S = np.exp(a[t])[:, None] * S                  # decay
        d = beta[t] * (v[t] - S.T @ k[t])              # residual of what S predicts for k_t
        S = S + np.outer(k[t], d)                      # write
        o[t] = scale * (S.T @ q[t])                    # read
    return o, S
