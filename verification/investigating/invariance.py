"""Invariances of a kernel route: properties that hold whatever the numbers are.

Each check is ``check(backend, route, problem, ...) -> InvarianceResult`` and runs the backend
on the Problem and on a transformed Problem, then compares the outputs:

| check | transformation | expected |
|---|---|---|
| ``determinism`` | the same call repeated | bitwise |
| ``varlen_slice`` | sequence n alone vs its slice of the varlen pack | bitwise (*) |
| ``batch_slice`` | sequence n alone vs its row of a batch (B > 1) | bitwise (*) |
| ``split_carry`` | tokens [0,P), then [P,T) from the prefix's final state, vs the whole | bitwise if P is a multiple of the chunk size and the route is unsegmented, else rel_l2 <= 5e-3 |
| ``paged_vs_dense`` | the same states as a paged cache and as a dense initial_state | bitwise |
| ``strided_vs_packed`` | q, k, v, g as bands of one fused projection vs contiguous copies | bitwise |
| ``causality`` | inputs at t >= P of every sequence replaced | o[t < P] bitwise unchanged (P a multiple of the chunk size) |
| ``head_permutation`` | heads permuted (q, k, v, g, beta, A_log, dt_bias, states) | o and states permuted, bitwise |

Why bitwise: in a chunked forward every tile belongs to one sequence and one head, the chunk
boundaries are fixed by each sequence's start, and no reduction crosses heads or sequences or
uses atomics; so each (sequence, head) runs the same instructions on the same bits whatever else
is in the launch.  A strided view and a paged slot are only addressing.  For causality, rows
before P never read rows at or after P when P is a chunk boundary (inside a chunk the diagonal
blocks are pivoted on a middle row, so a later row can change the rounding of an earlier one:
P must be a multiple of the route's chunk size, counted from each sequence's start).

(*) except a segmented route whose chunks per segment come from the occupancy heuristic: the
heuristic sees N and H, so the sequence alone may be cut into other segments; and a split whose
P is not a chunk boundary, or a segmented route, whose segment boundaries move.  Those compare
at rel_l2 <= 5e-3 (``SEGMENTATION_TOL``): the segmented-vs-unsegmented bound of our Triton
FlashKDA (A_seg and the scan's operands rounded to bf16; aiter uses the same bound), a
different rounding path, not a different result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kda_ref.problem import Problem
from verification.judging.baselines import recipe_chunk
from verification.running.run_cell import clone_keep_strides

SEGMENTATION_TOL = 5e-3
CAUSAL_ALIGN = 64          # a boundary of chunks of 16, 32 and 64 tokens
CHUNK_SIZES = {"flashkda": 32, "fla": 64, "moonshot": 16}


@dataclass
class InvarianceResult:
    name: str
    kind: str                      # "bitwise" | "tolerance"
    ok: bool
    diff: float                    # bitwise: elements that differ; tolerance: worst rel_l2
    tol: float                     # bitwise: 0; tolerance: the bound on rel_l2
    why: str = ""                  # why this kind (bitwise guaranteed, or the reason for a tolerance)
    details: dict = field(default_factory=dict)   # per tensor: differing elements / rel_l2, max_abs

    def __str__(self) -> str:
        what = f"{int(self.diff)} differing element(s)" if self.kind == "bitwise" else \
            f"rel_l2 {self.diff:.3g} (tolerance {self.tol:g})"
        return f"{self.name}: {'ok' if self.ok else 'FAILED'}, {self.kind}, {what}; {self.why}"


# ----------------------------------------------------------------------------------- compare
def _bits(t: torch.Tensor) -> torch.Tensor:
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(it)


def compare(name: str, pairs: dict, bitwise: bool, tol: float, why: str) -> InvarianceResult:
    """``pairs``: tensor name -> (got, expected).  Bitwise: every element's bit pattern equal
    (a NaN equals the same NaN); otherwise rel_l2 = ||got - exp|| / ||exp|| <= tol."""
    details, worst = {}, 0.0
    for tname, (a, b) in pairs.items():
        if a is None and b is None:
            continue
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            shape = lambda t: None if t is None else list(t.shape)  # noqa: E731
            details[tname] = {"error": f"shapes differ: {shape(a)} vs {shape(b)}"}
            worst = float("inf")
            continue
        b = b.to(a.device)
        ad, bd = a.double(), b.double()
        max_abs = float((ad - bd).abs().max()) if a.numel() else 0.0
        if bitwise:
            n = int((_bits(a) != _bits(b.to(a.dtype))).sum()) if a.dtype == b.dtype else a.numel()
            details[tname] = {"differing": n, "max_abs": max_abs}
            worst = max(worst, n)
        else:
            den = float(bd.norm())
            r = float((ad - bd).norm()) / den if den > 0 else float((ad - bd).norm())
            details[tname] = {"rel_l2": r, "max_abs": max_abs}
            worst = max(worst, r) if r == r else float("nan")
    ok = (worst == 0) if bitwise else (worst == worst and worst <= tol)
    return InvarianceResult(name, "bitwise" if bitwise else "tolerance", bool(ok), worst, 0.0 if bitwise else tol,
                            why, details)


# ----------------------------------------------------------------------------------- helpers
def _segmented(route) -> bool:
    flag = getattr(route, "flag", None)
    return bool(flag("segmented", False)) if flag else False


def _heuristic_segments(route) -> bool:
    flag = getattr(route, "flag", None)
    return bool(flag and flag("segmented", False) and flag("cps", None) is None)


def _run(backend, problem, route):
    return backend.run(problem, route)


def _final_of(p: Problem, out, n: int) -> Optional[torch.Tensor]:
    """The final state of sequence n as the backend returned it (slot of the cache when paged)."""
    if p.paged:
        return None if out.state_cache is None else out.state_cache[int(p.state_indices[n])]
    return None if out.final_state is None else out.final_state[n]


def _o_of(p: Problem, o: torch.Tensor, n: int) -> torch.Tensor:
    bos, eos = p.seq_bounds()[n]
    if p.cu_seqlens is not None:
        return o[:, bos:eos]
    return o[n:n + 1]


def sequence_alone(p: Problem, n: int) -> Problem:
    """Sequence n of ``p`` as a Problem of its own (B = 1, its tokens, its initial state)."""
    bos, eos = p.seq_bounds()[n]
    if p.cu_seqlens is not None:
        take = lambda t: t[:, bos:eos]  # noqa: E731
    else:
        take = lambda t: t[n:n + 1]     # noqa: E731
    ch = dict(q=take(p.q), k=take(p.k), v=take(p.v), g=take(p.g), beta=take(p.beta), cu_seqlens=None)
    if p.initial_state is not None:
        ch["initial_state"] = p.initial_state[n:n + 1]
    if p.paged:
        ch.update(state_indices=p.state_indices[n:n + 1], has_initial_state=p.has_initial_state[n:n + 1])
    return p.replace(**ch)


def to_dense_state(p: Problem) -> Problem:
    """A paged Problem with its states as a dense [N,HV,V,K] initial_state (layout vk; zeros where
    has_initial_state is false); a dense Problem is returned as it is."""
    if not p.paged:
        return p
    idx = p.state_indices.long()
    init = p.state_cache[idx].clone()
    init[~p.has_initial_state.to(init.device)] = 0
    return p.replace(initial_state=init.contiguous(), state_layout="vk", state_cache=None, state_indices=None,
                     has_initial_state=None, output_final_state=True)


def to_paged(p: Problem, pad: int = 8, seed: int = 0) -> Problem:
    """A dense Problem with its states in a paged cache of 2N+1 padded slots (unused slots NaN,
    padding NaN), slots permuted; the initial state (zeros when none) fills each sequence's slot."""
    if p.paged:
        return p
    N, HV, K, V = p.N, p.HV, p.K, p.V
    slots = 2 * N + 1
    buf = torch.full((slots, HV * V * K + pad), float("nan"), dtype=torch.float32, device=p.device)
    cache = buf[:, :HV * V * K].unflatten(-1, (HV, V, K))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(slots, generator=gen)[:N].to(torch.int32)
    has = torch.ones(N, dtype=torch.bool)
    for n in range(N):
        if p.initial_state is None:
            has[n] = False
        else:
            s = p.initial_state[n]
            cache[int(idx[n])] = (s.transpose(-1, -2) if p.state_layout == "kv" else s).float()
    return p.replace(initial_state=None, state_layout="paged", state_cache=cache, state_indices=idx.to(p.device),
                     has_initial_state=has.to(p.device), output_final_state=True)


def _states_vk(p: Problem, out) -> Optional[torch.Tensor]:
    """Final states [N,HV,V,K] from either a paged or a dense run."""
    if p.paged:
        return out.state_cache[p.state_indices.long()]
    if out.final_state is None:
        return None
    return out.final_state.transpose(-1, -2) if p.state_layout == "kv" else out.final_state


# ----------------------------------------------------------------------------------- checks
def determinism(backend, route, problem: Problem, repeats: int = 3) -> InvarianceResult:
    """``repeats`` calls on the same inputs give the same bits."""
    first = _run(backend, problem, route)
    worst = None
    for _ in range(repeats - 1):
        again = _run(backend, problem, route)
        r = compare("determinism", {k: (again.tensors().get(k), v) for k, v in first.tensors().items()}, True, 0.0,
                    "no atomics, no reduction whose order depends on scheduling")
        if worst is None or r.diff > worst.diff or not r.ok:
            worst = r
    return worst


def _slice(name: str, backend, route, problem: Problem, n: Optional[int]) -> InvarianceResult:
    full = _run(backend, problem, route)
    ns = range(problem.N) if n is None else [n]
    pairs = {}
    for i in ns:
        alone_p = sequence_alone(problem, i)
        alone = _run(backend, alone_p, route)
        pairs[f"o[seq {i}]"] = (alone.o, _o_of(problem, full.o, i))
        fa, ff = _final_of(alone_p, alone, 0), _final_of(problem, full, i)
        if fa is not None or ff is not None:
            pairs[f"final[seq {i}]"] = (fa, ff)
    bitwise = not _heuristic_segments(route)
    why = ("tiles never cross sequences: each sequence runs the same instructions alone" if bitwise else
           "heuristic chunks per segment depend on N: another segmentation, bf16 scan operands")
    return compare(name, pairs, bitwise, SEGMENTATION_TOL, why)


def varlen_slice(backend, route, problem: Problem, n: Optional[int] = None) -> InvarianceResult:
    """Each sequence (or sequence n) alone vs its slice of the varlen pack (``problem`` varlen)."""
    if problem.cu_seqlens is None:
        raise ValueError("problem: expected a varlen Problem (cu_seqlens), got B=%d without cu_seqlens" % problem.B)
    return _slice("varlen_slice", backend, route, problem, n)


def batch_slice(backend, route, problem: Problem, n: Optional[int] = None) -> InvarianceResult:
    """Each sequence (or sequence n) alone vs its row of a batch (``problem`` with B > 1)."""
    if problem.cu_seqlens is not None or problem.B < 2:
        raise ValueError(f"problem: expected a batch (B > 1, no cu_seqlens), got B={problem.B}"
                         f"{' with cu_seqlens' if problem.cu_seqlens is not None else ''}")
    return _slice("batch_slice", backend, route, problem, n)


def split_carry(backend, route, problem: Problem, split: int, chunk_size: Optional[int] = None) -> InvarianceResult:
    """The first sequence as a prefix [0, split) and its continuation [split, T) started from the
    prefix's final state, vs the whole sequence (o and final state)."""
    chunk_size = chunk_size or chunk_size_of(route)
    p = to_dense_state(sequence_alone(problem, 0))
    T = p.T
    if not 0 < split < T:
        raise ValueError(f"split: expected 0 < split < T={T}, got {split}")
    layout = p.state_layout
    whole = _run(backend, p.replace(output_final_state=True), route)
    part = lambda t, a, b: t[:, a:b]   # noqa: E731
    pre_p = p.replace(q=part(p.q, 0, split), k=part(p.k, 0, split), v=part(p.v, 0, split), g=part(p.g, 0, split),
                      beta=part(p.beta, 0, split), output_final_state=True)
    pre = _run(backend, pre_p, route)
    carry = pre.final_state
    post_p = p.replace(q=part(p.q, split, T), k=part(p.k, split, T), v=part(p.v, split, T), g=part(p.g, split, T),
                       beta=part(p.beta, split, T), initial_state=carry.to(p.device), state_layout=layout,
                       output_final_state=True)
    post = _run(backend, post_p, route)
    o_cat = torch.cat([pre.o, post.o], dim=1)
    bitwise = split % chunk_size == 0 and not _segmented(route)
    why = (f"split at a chunk boundary ({split} = {split // chunk_size} x {chunk_size}), unsegmented: the state "
           f"carried across the cut is the fp32 state the whole run carries" if bitwise else
           f"the cut ({split}) moves chunk or segment boundaries: another rounding path")
    return compare("split_carry", {"o": (o_cat, whole.o), "final_state": (post.final_state, whole.final_state)},
                   bitwise, SEGMENTATION_TOL, why)


def paged_vs_dense(backend, route, problem: Problem) -> InvarianceResult:
    """The same states through a paged cache and as a dense initial_state (layout vk)."""
    paged = problem if problem.paged else to_paged(problem)
    dense = to_dense_state(paged)
    a, b = _run(backend, paged, route), _run(backend, dense, route)
    return compare("paged_vs_dense", {"o": (a.o, b.o), "final_state": (_states_vk(paged, a), _states_vk(dense, b))},
                   True, 0.0, "a slot is only another address of the same [V,K] state")


def fused_projection(p: Problem) -> Problem:
    """q, k, v, g as bands of one [B,T,H*K + H*K + HV*V + HV*K] buffer (strided views), same values."""
    B, T = p.q.shape[:2]
    parts = [p.q, p.k, p.v, p.g]
    if len({t.dtype for t in parts}) != 1:
        raise ValueError(f"problem: expected q, k, v, g of one dtype for a fused projection, "
                         f"got {[str(t.dtype) for t in parts]}")
    proj = torch.cat([t.reshape(B, T, -1) for t in parts], dim=-1)
    views, o = [], 0
    for t in parts:
        w = t.shape[2] * t.shape[3]
        views.append(proj[..., o:o + w].unflatten(-1, tuple(t.shape[2:])))
        o += w
    return p.replace(q=views[0], k=views[1], v=views[2], g=views[3])


def strided_vs_packed(backend, route, problem: Problem) -> InvarianceResult:
    """q, k, v, g read in place from a fused projection vs contiguous copies."""
    strided = fused_projection(problem)
    packed = problem.replace(q=problem.q.contiguous(), k=problem.k.contiguous(), v=problem.v.contiguous(),
                             g=problem.g.contiguous())
    a, b = _run(backend, strided, route), _run(backend, packed, route)
    return compare("strided_vs_packed", {k: (a.tensors().get(k), v) for k, v in b.tensors().items()}, True, 0.0,
                   "strides are addressing only: the same bits are loaded")


def chunk_size_of(route) -> int:
    """The chunk size of a route's recipe (flashkda 32, fla 64, moonshot and moonshot-fwdsub 16, any
    other production recipe's own; 64 when unknown)."""
    recipe = getattr(route, "recipe", None)
    return CHUNK_SIZES.get(recipe) or recipe_chunk(recipe) or CAUSAL_ALIGN


def causality(backend, route, problem: Problem, prefix: Optional[int] = None, chunk_size: Optional[int] = None,
              seed: int = 0) -> InvarianceResult:
    """In every sequence, inputs (q, k, v, g, beta) at local positions t >= P replaced by other
    values: o at local t < P unchanged.  P (``prefix``) defaults to the largest multiple of the
    route's chunk size below the longest sequence (chunks start at each sequence's start)."""
    C = chunk_size or chunk_size_of(route)
    bounds = problem.seq_bounds()
    longest = max(e - b for b, e in bounds)
    P = prefix if prefix is not None else ((longest - 1) // C) * C
    if not 0 < P < longest:
        raise ValueError(f"prefix: expected 0 < P < {longest} (the longest sequence), got {P}")
    B, T = problem.q.shape[:2]
    late = torch.zeros(B * T, dtype=torch.bool)
    for b, e in bounds:
        late[b + P:e] = True
    gen = torch.Generator().manual_seed(seed)

    def changed(t, scale=1.0):
        flat = t.reshape(B * T, *t.shape[2:]).clone()
        mask = late.to(t.device)
        new = torch.randn((int(late.sum()), *flat.shape[1:]), generator=gen) * scale
        flat[mask] = new.to(device=t.device, dtype=t.dtype)
        return flat.reshape(t.shape)

    other = problem.replace(q=changed(problem.q), k=changed(problem.k), v=changed(problem.v),
                            g=changed(problem.g, 0.1), beta=changed(problem.beta))
    if problem.paged:
        other = other.replace(state_cache=clone_keep_strides(problem.state_cache))
    a, b = _run(backend, problem, route), _run(backend, other, route)
    early = ~late.to(a.o.device)
    oa, ob = a.o.reshape(B * T, *a.o.shape[2:])[early], b.o.reshape(B * T, *b.o.shape[2:])[early]
    bitwise = P % C == 0
    why = (f"P = {P} is a chunk boundary (C = {C}) of every sequence: rows before it never read later rows"
           if bitwise else f"P = {P} is inside a chunk (C = {C}): a later row can move an earlier row's pivot "
                           f"and rounding")
    return compare("causality", {f"o[t < {P}]": (ob, oa)}, bitwise, SEGMENTATION_TOL, why)


def head_permutation(backend, route, problem: Problem, seed: int = 0) -> InvarianceResult:
    """Heads permuted (q, k by H; v, g, beta, A_log, dt_bias, states by HV, consistently with GVA
    when HV = H): o and the final states come back permuted the same way."""
    p = problem
    if p.HV != p.H:
        raise ValueError(f"problem: expected HV == H for a head permutation, got H={p.H}, HV={p.HV}")
    perm = torch.randperm(p.H, generator=torch.Generator().manual_seed(seed))
    if p.H > 1 and bool((perm == torch.arange(p.H)).all()):
        perm = torch.roll(perm, 1)
    pd = perm.to(p.device)
    ch = dict(q=p.q[:, :, pd], k=p.k[:, :, pd], v=p.v[:, :, pd], g=p.g[:, :, pd], beta=p.beta[:, :, pd])
    if p.A_log is not None:
        ch["A_log"] = p.A_log[pd]
    if p.dt_bias is not None:
        ch["dt_bias"] = p.dt_bias.reshape(p.HV, -1)[pd].reshape(p.dt_bias.shape)
    if p.initial_state is not None:
        ch["initial_state"] = p.initial_state[:, pd]
    if p.paged:
        cache = clone_keep_strides(p.state_cache)
        cache[p.state_indices.long()] = p.state_cache[p.state_indices.long()][:, pd]
        ch["state_cache"] = cache
    q = p.replace(**ch)
    a, b = _run(backend, p, route), _run(backend, q, route)
    sa, sb = _states_vk(p, a), _states_vk(q, b)
    return compare("head_permutation", {"o": (b.o, a.o[:, :, pd]),
                                        "final_state": (sb, None if sa is None else sa[:, pd])},
                   True, 0.0, f"heads never meet: head perm {perm.tolist()} gives the same bits, permuted")


CHECKS = {f.__name__: f for f in (determinism, varlen_slice, batch_slice, split_carry, paged_vs_dense,
                                  strided_vs_packed, causality, head_permutation)}
