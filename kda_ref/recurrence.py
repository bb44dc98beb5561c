"""The token recurrence, the definition of KDA (float64, torch path).

Per sequence and value head, state S in R^{K x V}, tokens in order:

    S  <- diag(exp(a_t)) S
    d   = beta_t * (v_t - S^T k_t)
    S  <- S + k_t d^T
    o_t = scale * S^T q_t                 (output after the update)

Vectorised over sequences and heads: sequences are padded to the longest one with
identity tokens (k = 0, a = 0 leave S unchanged), so one loop over token positions
serves every sequence at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .preprocess import Prepared, pad_sequences, prepare, unpad_sequences
from .problem import Problem


def token_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None):
    """One token of the recurrence, float64, over any leading dims ``...`` (sequences, heads):
    S [..., K, V] K-first, q k decay [..., K] (decay = exp(a)), v [..., V], beta [...].

        S' = diag(decay) S;   d = beta (v - S'^T k);   S' += k d^T;   o = scale S'^T q

    Returns (S' [..., K, V], o [..., V]).  S' is a new array, or ``out`` (an array of S's shape,
    S itself for an update in place) when given.  Four passes over the state (the scaling, S'^T k,
    the rank-1 update in place, S'^T q) and no temporaries of its size: a long decode trace is
    bound by them."""
    Sn = torch.mul(S, decay[..., None], out=out)                      # diag(exp a) S
    d = (v - (k[..., None, :] @ Sn)[..., 0, :]).mul_(beta[..., None])  # beta (v - S^T k)
    Sn.addcmul_(k[..., :, None], d[..., None, :])                      # + k d^T
    o = (q[..., None, :] @ Sn)[..., 0, :].mul_(scale)                  # scale S^T q
    return Sn, o


def token_step_host(S: torch.Tensor, q: np.ndarray, k: np.ndarray, kcol: torch.Tensor, v: np.ndarray,
                    decay: torch.Tensor, beta: np.ndarray, scale: float, out: torch.Tensor, out_np: np.ndarray,
                    o: np.ndarray, d: torch.Tensor, d_np: np.ndarray) -> None:
    """``token_step``'s four passes on a CPU float64 state [HV, K, V], op for op, with the two
    state-vector products done by numpy (its stacked gemv took 12 us at HV = 8, K = V = 128, torch's
    [HV, 1, K] @ [HV, K, V] 28 us) and every input given in the shape its op takes, so a decode
    step allocates nothing:

        S'  = diag(decay) S        (torch, into ``out``; ``out`` may be S)
        d   = (v - k S') * beta    (numpy gemv k [HV, 1, K] @ S' [HV, K, V], into ``d``)
        S' += k d^T                (torch addcmul_, k as ``kcol`` [HV, K, 1])
        o   = (q S') * scale       (numpy gemv into ``o`` [HV, V])

    ``out_np`` / ``d_np``: numpy views of ``out`` / the scratch ``d`` [HV, 1, V]; q, k:
    [HV, 1, K] float64; v: [HV, 1, V]; beta: [HV, 1, 1]; decay: torch [HV, K, 1].  Equal to
    token_step to rounding (the products' summation order is the BLAS's)."""
    torch.mul(S, decay, out=out)
    np.matmul(k, out_np, out=d_np)
    np.subtract(v, d_np, out=d_np)
    d_np *= beta
    out.addcmul_(kcol, d)
    np.matmul(q, out_np, out=o[:, None, :])
    o *= scale


@dataclass
class RecurrenceResult:
    o: torch.Tensor                       # [Ttot, HV, V] float64, packed
    final_state: torch.Tensor             # [N, HV, K, V] K-first
    chunk_states: Optional[torch.Tensor]  # [N, NCmax+1, HV, K, V]: state at every chunk boundary


def recurrence_prepared(pp: Prepared, chunk_size: Optional[int] = None) -> RecurrenceResult:
    bounds = pp.bounds
    Ttot = pp.q.shape[0]
    L = max([e - b for b, e in bounds] + [0])
    q, k, v = (pad_sequences(x, bounds, L) for x in (pp.q, pp.k, pp.v))
    a, beta = pad_sequences(pp.a, bounds, L), pad_sequences(pp.beta, bounds, L)
    decay = torch.exp(a)
    S = pp.S0.clone()
    o = torch.zeros_like(v)
    states = None
    if chunk_size:
        nc = -(-L // chunk_size)
        states = S.new_zeros((S.shape[0], nc + 1) + tuple(S.shape[1:]))
        states[:, 0] = S
    for t in range(L):
        S, o[:, t] = token_step(S, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], pp.scale)
        if chunk_size and ((t + 1) % chunk_size == 0 or t + 1 == L):
            states[:, -(-(t + 1) // chunk_size)] = S  # past a sequence's end S stays its final state
    return RecurrenceResult(o=unpad_sequences(o, bounds, Ttot), final_state=S, chunk_states=states)


def recurrence(p: Problem, chunk_size: Optional[int] = None) -> RecurrenceResult:
    """Run the definition on a Problem; with ``chunk_size`` also return the state at every
    chunk boundary (index c = state before chunk c; the last = final state)."""
    return recurrence_prepared(prepare(p), chunk_size)
