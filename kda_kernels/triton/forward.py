"""Host side of our Triton FlashKDA forward: allocate the workspace, launch K1, passes A/B/C.

    flashkda_forward(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, ...) -> ForwardResult

Every pass is also callable alone (``run_k1``, ``run_pass_a``, ``run_pass_b``, ``run_pass_c``)
so the per-pass debugger can feed it oracle inputs.  q, k, v, g, beta and ``out`` may be any
strided views (their strides are passed to the kernels; nothing is packed).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from . import kernels as kn
from .plan import C, Plan, bounds_of, choose_chunks_per_seg, get_plan, num_sms
from .routes import K1_CHOICES, RouteSpec, parse_route

D = 128          # K == V == 128
BC = 16          # diagonal block of the inverse
NUM_DOUBLING = BC.bit_length() - 2
K1_WARPS = 4
K1_INV_WARPS = {"bf16x6": 2,     # k1_inverse_kernel (H200, 1x16384x12: 371 us for K1 with 2 warps, 414 with 4;
                "ieee": 4}       # IEEE: 435 with 4, 438 with 2, and 2 spill on sm90)
STEP_WARPS = 4
STEP_STAGES = 3      # software-pipelined workspace loads of the chunk walk (H200: 3 beat 2 by 7-30% on pass C
                     # and matched it on pass A; 4 lost on the segmented and batched shapes)
SCAN_WARPS = 4
SCAN_BW = 16             # state columns per scan program, whatever the route's BW: the scan is one
                         # dependent [K,K] x [K,BW] product per segment, so narrower programs finish
                         # each step sooner (H200, 1x16384x12, cps 4..64: 10-20% faster than BW=32)
SPLIT_SCAN_WARPS = 8     # CUDA: the split scan holds an fp32 [128,128] A_seg tile (prefetched: two)
_TARGET_IS_HIP: Optional[bool] = None    # None: this torch's platform; isa.py sets it per target


def scan_warps(warps: int, scan: str) -> int:
    """Warps of the scan kernel.  The split scan needs 8 warps of 32 on NVIDIA (4 spill on sm90);
    on AMD 4 wave64 warps already hold it in 512 VGPRs + AGPRs (8 spill on gfx950)."""
    hip = torch.version.hip is not None if _TARGET_IS_HIP is None else _TARGET_IS_HIP
    return max(warps, SPLIT_SCAN_WARPS) if scan == "split" and not hip else warps

WORKSPACE_DTYPES = {"ws_kd": torch.bfloat16, "ws_qd": torch.bfloat16, "ws_kr": torch.bfloat16,
                    "ws_gt": torch.float32, "ws_inv": torch.float16, "ws_mqk": torch.float16,
                    "ws_beta": torch.float32}
WORKSPACE_TILE_SHAPES = {"ws_kd": (C, D), "ws_qd": (C, D), "ws_kr": (C, D), "ws_gt": (D,),   # per (tile, head)
                         "ws_inv": (C, C), "ws_mqk": (C, C), "ws_beta": (C,)}
A_SEG_DTYPE = {"split": torch.float32, "bf16": torch.bfloat16}     # by the route's scan precision


_RECORDER: Optional[list] = None     # when a list: launches are recorded there, not run (isa.py)
_ALLOCATOR = None    # when set: allocator(name, shape, dtype, device) makes every buffer (verification.guards)


def _empty(name: str, shape, dtype, device) -> torch.Tensor:
    """A new buffer named ``name`` (o, final_state, ws_*, A_seg, b_seg, h_in): torch.empty, or the
    installed allocator's (see ``use_allocator``)."""
    if _ALLOCATOR is not None:
        return _ALLOCATOR(name, tuple(shape), dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


class use_allocator:
    """``with use_allocator(fn):`` every buffer the forward allocates comes from ``fn(name, shape,
    dtype, device)`` (guard-banded buffers, say); the previous allocator is restored on exit."""

    def __init__(self, fn):
        self.fn, self.prev = fn, None

    def __enter__(self):
        global _ALLOCATOR
        self.prev, _ALLOCATOR = _ALLOCATOR, self.fn
        return self

    def __exit__(self, *exc):
        global _ALLOCATOR
        _ALLOCATOR = self.prev
        return False


def _launch(kernel, grid, *args, no_tokens: bool = False, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)``, or record it when a recorder is installed.
    With ``no_tokens`` (a forward without a single chunk) empty tensors are passed as a 1-element
    stand-in: their storage may be a null pointer, which the launcher rejects, and the kernels
    never touch them."""
    if no_tokens:
        args = tuple(_non_null(a) for a in args)
    if _RECORDER is not None:
        _RECORDER.append((kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


def _non_null(a):
    if isinstance(a, torch.Tensor) and a.numel() == 0:
        return torch.zeros(1, dtype=a.dtype, device=a.device)
    return a


class FlashKDAError(ValueError):
    """Bad input to the Triton FlashKDA forward; one line naming the argument."""


@dataclass
class StateRef:
    """A K-first view of a stack of states: element (row, h, k, v) at
    ``row*sn + h*sh + k*sk + v*sv``; paged: row = state_indices[n], read only if has[n]."""
    tensor: torch.Tensor
    strides: tuple
    indices: Optional[torch.Tensor] = None
    has: Optional[torch.Tensor] = None

    @property
    def paged(self) -> bool:
        return self.indices is not None


def dense_state(t: torch.Tensor, layout: str) -> StateRef:
    sn, sh, sa, sb = t.stride()
    return StateRef(t, (sn, sh, sa, sb) if layout == "kv" else (sn, sh, sb, sa))


def paged_state(cache: torch.Tensor, indices: torch.Tensor, has: torch.Tensor) -> StateRef:
    sn, sh, sv, sk = cache.stride()
    return StateRef(cache, (sn, sh, sk, sv), indices, has)


@dataclass
class ForwardResult:
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    plan: Plan
    route: str                      # what actually ran (the heuristic resolved)
    taps: dict = field(default_factory=dict)


def _fail(msg: str):
    raise FlashKDAError(msg)


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


# ----------------------------------------------------------------------------------- passes
def alloc_workspace(H: int, tiles: int, device) -> dict:
    """The seven workspace buffers, [H*tiles, *WORKSPACE_TILE_SHAPES[name]] each."""
    return {n: _empty(n, (H * tiles, *s), WORKSPACE_DTYPES[n], device) for n, s in WORKSPACE_TILE_SHAPES.items()}


def run_k1(q, k, g, beta, A_log, dt_bias, scale: float, lower_bound: float, plan: Plan, ws: dict,
           inv: str = "ieee", k1: str = "tile") -> dict:
    """K1 over every (tile, head): fills the workspace dict in place and returns it.  ``inv``:
    the inverse's fp32 products, "ieee" (FMAs) or "bf16x6" (tensor cores, fp32's 24 bits);
    ``k1``: "tile" (k1_prepare_kernel, then k1_inverse_kernel from L, which it adds to the dict
    as ws_L, fp32 [H*tiles, C, C]) or "halves" (k1_prepare_halves_kernel, one launch, same workspace)."""
    H = q.shape[2]
    if plan.total_tiles == 0:
        return ws
    bias = dt_bias.reshape(-1) if dt_bias is not None else A_log
    if k1 not in K1_CHOICES:
        _fail(f"k1: expected {'|'.join(K1_CHOICES)}, got {k1!r}")
    inputs = (q, k, g, beta, A_log, bias, plan.tiles)
    scalars = (*q.stride(), *k.stride(), *g.stride(), *beta.stride(), plan.total_tiles, float(scale),
               float(lower_bound))
    if k1 == "halves":
        _launch(kn.k1_prepare_halves_kernel, (plan.total_tiles, H), *inputs,
            ws["ws_kd"], ws["ws_qd"], ws["ws_kr"], ws["ws_gt"], ws["ws_inv"], ws["ws_mqk"], ws["ws_beta"], *scalars,
            HAS_BIAS=dt_bias is not None, C=C, D=D, BC=BC, NUM_DOUBLING=NUM_DOUBLING, INV_PREC=inv,
            num_warps=K1_WARPS)
        return ws
    ws["ws_L"] = _empty("ws_L", (H * plan.total_tiles, C, C), torch.float32, q.device)
    _launch(kn.k1_prepare_kernel, (plan.total_tiles, H), *inputs,
        ws["ws_kd"], ws["ws_qd"], ws["ws_kr"], ws["ws_gt"], ws["ws_L"], ws["ws_mqk"], ws["ws_beta"], *scalars,
        HAS_BIAS=dt_bias is not None, C=C, D=D, BC=BC, num_warps=K1_WARPS)
    _launch(kn.k1_inverse_kernel, (H * plan.total_tiles,), ws["ws_L"], ws["ws_inv"],
        C=C, BC=BC, NUM_DOUBLING=NUM_DOUBLING, INV_PREC=inv, num_warps=K1_INV_WARPS[inv])
    return ws


def _walk_maps(plan, ws, H, mode, v=None, A_seg=None, b_seg=None, bw=32, warps=STEP_WARPS):
    """Launch segment_map_kernel (pass A) in ``mode`` (kernels.MODE_B / MODE_A / MODE_AB)."""
    any_t = ws["ws_gt"] if ws["ws_gt"].numel() else plan.segs
    _launch(kn.segment_map_kernel, (plan.num_segs * H, D // bw),
        plan.segs, v if v is not None else any_t, *(v.stride() if v is not None else (0, 0, 0, 0)),
        ws["ws_kd"], ws["ws_kr"], ws["ws_gt"], ws["ws_inv"], ws["ws_beta"],
        A_seg if A_seg is not None else any_t, b_seg if b_seg is not None else any_t,
        H, plan.total_tiles, no_tokens=plan.total_tiles == 0,
        MODE=mode, C=C, K=D, V=D, BW=bw, num_warps=warps, num_stages=STEP_STAGES)


def run_pass_a(ws: dict, v, plan: Plan, H: int, variant: str = "fused", bw: int = 32, warps: int = STEP_WARPS,
               scan: str = "split"):
    """Pass A: (A_seg [segs,H,K,K] fp32 for the split scan / bf16, b_seg fp32 [segs,H,K,V])."""
    dev = ws["ws_gt"].device
    A_seg = _empty("A_seg", (plan.num_segs, H, D, D), A_SEG_DTYPE[scan], dev)
    b_seg = _empty("b_seg", (plan.num_segs, H, D, D), torch.float32, dev)
    if variant == "fused":
        _walk_maps(plan, ws, H, kn.MODE_AB, v=v, A_seg=A_seg, b_seg=b_seg, bw=bw, warps=warps)
    elif variant == "two":
        _walk_maps(plan, ws, H, kn.MODE_B, v=v, b_seg=b_seg, bw=bw, warps=warps)
        _walk_maps(plan, ws, H, kn.MODE_A, A_seg=A_seg, bw=bw, warps=warps)
    else:
        _fail(f"pass A variant: expected two|fused, got {variant!r}")
    return A_seg, b_seg


def run_pass_b(A_seg, b_seg, plan: Plan, H: int, h0: Optional[StateRef], prefetch: bool = True, bw: int = SCAN_BW,
               warps: int = SCAN_WARPS, scan: str = "split"):
    """Pass B: h_in fp32 [segs,H,K,V], the true incoming state of every segment (``scan``:
    "split" = three-MMA hi/lo products of an fp32 A_seg, "bf16" = one bf16 MMA)."""
    A_seg = A_seg.to(A_SEG_DTYPE[scan])
    h_in = _empty("h_in", (plan.num_segs, H, D, D), torch.float32, b_seg.device)
    hs = h0 if h0 is not None else StateRef(b_seg, (0, 0, 0, 0))
    _launch(kn.scan_kernel, (plan.N * H, D // bw),
        plan.seg_off, A_seg, b_seg, h_in,
        hs.tensor, hs.indices if hs.paged else b_seg, hs.has if hs.paged else b_seg, *hs.strides,
        H, no_tokens=plan.total_tiles == 0, H0=kn.H0_NONE if h0 is None else kn.H0_SEQ, PAGED=hs.paged,
        PREFETCH=bool(prefetch), SPLIT=scan == "split",
        K=D, V=D, BW=bw, num_warps=scan_warps(warps, scan))
    return h_in


def run_pass_c(ws: dict, v, o, plan: Plan, H: int, h_in=None, h0: Optional[StateRef] = None,
               final: Optional[StateRef] = None, bw: int = 32, warps: int = STEP_WARPS):
    """Pass C: outputs o (written in place) and, from each sequence's last segment, the final
    state into ``final``.  Starts each segment from h_in[s] (segmented) or from h0 (one segment
    per sequence)."""
    if h_in is not None:
        src, mode = StateRef(h_in, tuple(h_in.stride())), kn.H0_SEG
    else:
        src, mode = h0, (kn.H0_NONE if h0 is None else kn.H0_SEQ)
    any_t = ws["ws_gt"] if ws["ws_gt"].numel() else plan.segs
    hs = src if src is not None else StateRef(any_t, (0, 0, 0, 0))
    fs = final if final is not None else StateRef(any_t, (0, 0, 0, 0))
    _launch(kn.segment_kernel, (plan.num_segs * H, D // bw),
        plan.segs, v, *v.stride(), o, *o.stride(),
        ws["ws_kd"], ws["ws_qd"], ws["ws_kr"], ws["ws_gt"], ws["ws_inv"], ws["ws_mqk"], ws["ws_beta"],
        hs.tensor, hs.indices if hs.paged else any_t, hs.has if hs.paged else any_t, *hs.strides,
        fs.tensor, fs.indices if fs.paged else any_t, *fs.strides,
        H, plan.total_tiles, no_tokens=plan.total_tiles == 0,
        H0=mode, PAGED=hs.paged, STORE_FINAL=final is not None, FINAL_PAGED=fs.paged,
        C=C, K=D, V=D, BW=bw, num_warps=warps, num_stages=STEP_STAGES)
    return o


# ----------------------------------------------------------------------------------- forward
def flashkda_forward(q, k, v, g, beta, A_log, dt_bias=None, scale: Optional[float] = None,
                     lower_bound: float = -5.0, *, cu_seqlens=None, initial_state=None, state_layout: str = "kv",
                     state_cache=None, state_indices=None, has_initial_state=None,
                     output_final_state: bool = True, out=None, route="seg",
                     return_workspace: bool = False) -> ForwardResult:
    """FlashKDA forward (lower-bound gate, sigmoid beta, in-kernel l2norm; K = V = 128, HV = H).

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
        o = _empty("o", v.shape, v.dtype, dev)

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
            final_state = _empty("final_state", (N, H, D, D), torch.float32, dev)
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
