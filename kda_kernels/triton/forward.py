"""Host side of our Triton FlashKDA forward: check the inputs, resolve the plan, allocate the
outputs, and run K1 then passes A, B and C (or K1 and pass C alone when unsegmented).

    flashkda_forward(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, ...) -> ForwardResult

Each pass's kernel lives beside its launcher: K1 in k1.py (``run_k1``), pass A and pass B in
scan.py (``run_pass_a``, ``run_pass_b``), pass C in walk.py (``run_pass_c``); every pass is also
callable alone, so the per-pass debugger can feed it oracle inputs.  The names are re-exported
here.  q, k, v, g, beta and ``out`` may be any strided views (their strides are passed to the
kernels; nothing is packed).  Launches go through launch.launch under the current launch
context (launch.launch_context: recording, the target's platform, the buffer allocator).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from . import kernels  # noqa: F401  (the kernels are built when this module is imported)
from .common import STEP_STAGES, STEP_WARPS  # noqa: F401
from .k1 import (BC, K1_INV_WARPS, K1_WARPS, NUM_DOUBLING, WORKSPACE_DTYPES,  # noqa: F401
                 WORKSPACE_TILE_SHAPES, alloc_workspace, run_k1)
from .launch import (D, FlashKDAError, LaunchContext, StateRef, current_context, dense_state,  # noqa: F401
                     launch_context, paged_state, use_allocator)
from .launch import empty
from .launch import fail as _fail
from .plan import C, Plan, bounds_of, choose_chunks_per_seg, get_plan, num_sms
from .routes import RouteSpec, parse_route
from .scan import A_SEG_DTYPE, SCAN_BW, SCAN_WARPS, SPLIT_SCAN_WARPS, run_pass_a, run_pass_b, scan_warps  # noqa: F401
from .walk import run_pass_c


@dataclass
class ForwardResult:
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    plan: Plan
    route: str                      # what actually ran (the heuristic resolved)
    taps: dict = field(default_factory=dict)


def _check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens):
    if q.dim() != 4:
        _fail(f"q: expected [B,T,H,128], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    if K != D:
        _fail(f"q: expected K == {D}, got K={K}")
    for name, t, want in (("k", k, (B, T, H, D)), ("v", v, (B, T, H, D)), ("g", g, (B, T, H, D)),
                          ("beta", beta, (B, T, H))):
        if tuple(t.shape) != want:
            _fail(f"{name}: expected shape {list(want)}, got {list(t.shape)}")
        if t.device != q.device:
            _fail(f"{name}: expected device {q.device}, got {t.device}")
    if A_log is None or tuple(A_log.shape) != (H,):
        _fail(f"A_log: expected [{H}], got {None if A_log is None else list(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != H * D:
        _fail(f"dt_bias: expected {H * D} elements ([H*128] or [H,128]), got {list(dt_bias.shape)}")
    if not (-5.5 <= float(lower_bound) < 0):
        _fail(f"lower_bound: expected a value in [-5.5, 0) (the pivot factors overflow below), got {lower_bound}")
    if cu_seqlens is not None and B != 1:
        _fail(f"cu_seqlens: expected B == 1 with varlen, got B={B}")


def resolve_plan(route: RouteSpec, B: int, T: int, H: int, cu_seqlens, device) -> Plan:
    """The plan (tiles of C = 32 tokens, segments) of a route on a problem: unsegmented, the
    route's cps, or the occupancy heuristic's choice (plan.choose_chunks_per_seg)."""
    bounds = bounds_of(B, T, cu_seqlens)
    cps = None
    if route.segmented:
        cps = route.cps
        if cps is None:
            nmax = max([-(-(e - s) // C) for _, s, e in bounds] + [0])
            cps = choose_chunks_per_seg(nmax, len(bounds), H, D, route.bw, num_sms(device))
    return get_plan(bounds, cps, device)


def ran_name(route: RouteSpec, plan: Plan) -> str:
    """The route that ran: the heuristic's choice of cps (or of no segments) filled in."""
    return replace(route, segmented=plan.segmented, cps=plan.cps).name


# ----------------------------------------------------------------------------------- forward
def flashkda_forward(q, k, v, g, beta, A_log, dt_bias=None, scale: Optional[float] = None,
                     lower_bound: float = -5.0, *, cu_seqlens=None, initial_state=None, state_layout: str = "kv",
                     state_cache=None, state_indices=None, has_initial_state=None,
                     output_final_state: bool = True, out=None, route="seg",
                     return_workspace: bool = False) -> ForwardResult:
    """FlashKDA forward (lower-bound gate, sigmoid beta, in-kernel l2norm; K = V = 128, HV = H).

    Inputs: q, k, v, g [B, T, H, 128] (any strides); beta [B, T, H] (logits); A_log [H];
    dt_bias [H*128] or [H, 128] or None; lower_bound in [-5.5, 0); scale (default 128^-0.5);
    cu_seqlens int [N+1] (varlen, B == 1; else N = B); initial_state fp32 [N, H, K, V] (kv) or
    [N, H, V, K] (vk); or a paged cache state_cache fp32 [slots, H, V, K] with state_indices [N]
    and has_initial_state [N].  Per head h and token t, with q^, k^ l2-normalised and
    a_t = lb * sigmoid(exp(A_log[h]) * (g_t + dt_bias[h])), beta_t = sigmoid(beta logits):
        S <- diag(exp(a_t)) S;   S <- S + beta_t k^_t (v_t - S^T k^_t)^T;   o_t = scale S^T q^_t
    (the token recurrence of kda_ref.recurrence, state S [K, V] fp32), computed chunk-wise:
    K1, then passes A, B, C (see the modules' docstrings).

    Returns o (v's dtype, or ``out`` written in place) and the final state fp32 in
    ``state_layout`` ([N,H,K,V] kv / [N,H,V,K] vk); with a paged cache the final state of
    sequence n is written to ``state_cache[state_indices[n]]`` and final_state is None."""
    spec = parse_route(route) if isinstance(route, str) else route
    _check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens)
    B, T, H, _ = q.shape
    dev = q.device
    scale = D ** -0.5 if scale is None else float(scale)
    plan = resolve_plan(spec, B, T, H, cu_seqlens, dev)
    N = plan.N

    if out is not None:
        if tuple(out.shape) != tuple(v.shape) or out.device != dev:
            _fail(f"out: expected shape {list(v.shape)} on {dev}, got {list(out.shape)} on {out.device}")
        o = out
    else:
        o = empty("o", v.shape, v.dtype, dev)

    if state_cache is not None:
        if state_cache.dim() != 4 or tuple(state_cache.shape[1:]) != (H, D, D) or state_cache.dtype != torch.float32:
            _fail(f"state_cache: expected fp32 [slots,{H},128,128] (V-first), got {state_cache.dtype} "
                  f"{list(state_cache.shape)}")
        if state_cache.stride()[1:] != (D * D, D, 1) or state_cache.stride(0) < H * D * D:
            _fail(f"state_cache: expected dense slots, strides (>= {H * D * D}, {D * D}, {D}, 1), "
                  f"got {tuple(state_cache.stride())}")
        if state_indices is None or state_indices.numel() != N or has_initial_state is None \
                or has_initial_state.numel() != N:
            _fail(f"state_indices/has_initial_state: expected {N} entries each with a state_cache")
        h0 = paged_state(state_cache, state_indices, has_initial_state)
        final, final_state = h0, None
    else:
        h0 = None
        if initial_state is not None:
            want = (N, H, D, D)
            if tuple(initial_state.shape) != want:
                _fail(f"initial_state: expected {list(want)}, got {list(initial_state.shape)}")
            h0 = dense_state(initial_state, state_layout)
        final_state, final = None, None
        if output_final_state:
            final_state = empty("final_state", (N, H, D, D), torch.float32, dev)
            final = dense_state(final_state, state_layout)

    ws = run_k1(q, k, g, beta, A_log, dt_bias, scale, lower_bound, plan, alloc_workspace(H, plan.total_tiles, dev),
                inv=spec.inv, k1=spec.k1)
    taps = {}
    if plan.segmented:
        A_seg, b_seg = run_pass_a(ws, v, plan, H, spec.pass_a, spec.bw, spec.warps, spec.scan)
        h_in = run_pass_b(A_seg, b_seg, plan, H, h0, spec.pass_b == "prefetch", SCAN_BW, spec.warps, spec.scan)
        run_pass_c(ws, v, o, plan, H, h_in=h_in, final=final, bw=spec.bw, warps=spec.warps)
        if return_workspace:
            taps.update(A_seg=A_seg, b_seg=b_seg, h_in=h_in)
    else:
        run_pass_c(ws, v, o, plan, H, h0=h0, final=final, bw=spec.bw, warps=spec.warps)
    if return_workspace:
        taps.update(ws)
    return ForwardResult(o=o, final_state=final_state, plan=plan, route=ran_name(spec, plan), taps=taps)
