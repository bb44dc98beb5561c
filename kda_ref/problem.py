"""The Problem: the inputs and options of one KDA forward, and their validation.

Shapes, with HV value heads sharing H query/key heads (GVA, HV % H == 0):

    q, k   [B, T, H, K]          v    [B, T, HV, V]
    g      [B, T, HV, K]         beta [B, T, HV]
    A_log  [HV]                  dt_bias [HV*K] or [HV, K]
    cu_seqlens [N+1] (varlen, B == 1)
    initial_state [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk")
    state_cache [slots, HV, V, K] + state_indices int [N] + has_initial_state bool [N] ("paged")
    out_gate [B, T, HV, V] + norm_weight [V] + norm_eps > 0   (optional: a fused output norm)

Every float tensor (q k v g beta A_log dt_bias initial_state state_cache out_gate norm_weight) is float16,
bfloat16, float32 or float64 on any device; the oracle converts to float64 itself.  With
``gate=pregated`` g is the natural-log decay itself, so g <= 0 (a decay exp(g) <= 1).
With ``out_gate`` (and then ``norm_weight``) the forward's output is the gated RMSNorm of
the attention output, ``kda_ref.norm.gated_rmsnorm(o, out_gate, norm_weight, norm_eps)`` (a kernel
that fuses it, aiter's chunk_kda); without, o itself.
``validate`` raises :class:`ProblemError` with a one-line message naming the argument,
what was expected and what came.  A problem with B*T = 0 is valid but empty (``is_empty``,
``empty_reason``): it has no token whose output could be verified.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

GATE_KINDS = ("lower_bound", "softplus", "pregated")
BETA_KINDS = ("sigmoid", "sigmoid2", "pregated")
STATE_LAYOUTS = ("kv", "vk", "paged")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT_NAMES = "float16, bfloat16, float32 or float64"


class ProblemError(ValueError):
    """Bad input to a Problem: the message names the argument, the expectation and what came."""


def shape_of(t: Optional[torch.Tensor]) -> str:
    """A tensor as messages show it, its shape then its dtype: ``[1, 64, 2, 16] bfloat16``."""
    return "None" if t is None else f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    lower_bound: Optional[float] = None
    gate: str = "lower_bound"
    beta_kind: str = "sigmoid"
    qk_l2norm: bool = True
    cu_seqlens: Optional[torch.Tensor] = None
    initial_state: Optional[torch.Tensor] = None
    state_layout: str = "kv"
    state_cache: Optional[torch.Tensor] = None
    state_indices: Optional[torch.Tensor] = None
    has_initial_state: Optional[torch.Tensor] = None
    output_final_state: bool = True
    meta: dict = field(default_factory=dict)  # free-form provenance (case name, seed, ...)
    out_gate: Optional[torch.Tensor] = None      # [B, T, HV, V]: the fused output norm's gate (logits)
    norm_weight: Optional[torch.Tensor] = None   # [V]: its weight
    norm_eps: float = 1e-5                       # its eps (inside the rsqrt)

    @property
    def fused_norm(self) -> bool:
        """True when the output is the gated RMSNorm of o (out_gate given)."""
        return self.out_gate is not None

    # ----- derived sizes -------------------------------------------------------------
    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def H(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def HV(self) -> int:
        return self.v.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def N(self) -> int:
        return self.B if self.cu_seqlens is None else int(self.cu_seqlens.numel()) - 1

    @property
    def paged(self) -> bool:
        return self.state_layout == "paged"

    @property
    def scale_value(self) -> float:
        return float(self.K ** -0.5) if self.scale is None else float(self.scale)

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_empty(self) -> bool:
        """True when the problem holds no token (B*T = 0): there is no output to verify."""
        return self.B * self.T == 0

    def empty_reason(self) -> Optional[str]:
        """One line saying why an empty problem has nothing to verify; None when it has tokens."""
        if not self.is_empty:
            return None
        return (f"an empty problem (B={self.B}, T={self.T}: no tokens) has nothing to verify; "
                f"expected B >= 1 and T >= 1")

    def seq_bounds(self) -> list[tuple[int, int]]:
        """(bos, eos) of every sequence in the packed token axis of length B*T."""
        if self.cu_seqlens is None:
            return [(b * self.T, (b + 1) * self.T) for b in range(self.B)]
        cu = [int(x) for x in self.cu_seqlens.tolist()]
        return list(zip(cu[:-1], cu[1:]))

    def replace(self, **changes) -> "Problem":
        return dataclasses.replace(self, **changes)

    def to(self, device=None, dtype_map=None) -> "Problem":
        """A copy with every tensor moved to ``device``; float tensors optionally re-typed
        through ``dtype_map`` (a dict field name -> dtype)."""
        changes = {}
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if isinstance(val, torch.Tensor):
                dt = (dtype_map or {}).get(f.name)
                changes[f.name] = val.to(device=device or val.device, dtype=dt or val.dtype)
        return self.replace(**changes)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def describe(self) -> str:
        lens = [e - b for b, e in self.seq_bounds()]
        lb = "none" if self.lower_bound is None else f"{self.lower_bound:g}"
        return (f"B={self.B} T={self.T} H={self.H} HV={self.HV} K={self.K} V={self.V} N={self.N} "
                f"lens={lens if len(lens) <= 8 else str(lens[:8])[:-1] + ', ...]'} gate={self.gate} lb={lb} "
                f"beta={self.beta_kind} l2norm={self.qk_l2norm} state={self.state_layout}"
                f"{'' if self.initial_state is not None or self.paged else '(none)'}"
                f"{f' norm=gated-rms(eps={self.norm_eps:g})' if self.fused_norm else ''}")


def _req(cond: bool, msg: str):
    if not cond:
        raise ProblemError(msg)


def _float_tensor(name: str, t) -> None:
    """A float tensor in one of FLOAT_DTYPES (float8 and integer tensors are refused)."""
    _req(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _req(t.dtype in FLOAT_DTYPES, f"{name}: expected a {FLOAT_NAMES} tensor, got {shape_of(t)}")


def _finite(name: str, t: Optional[torch.Tensor]):
    """Raise unless every element of float tensor ``t`` is finite.  A finite ``t.sum()`` proves it
    (a NaN or an infinity anywhere makes the sum NaN or infinite); only a sum that is not finite
    (a bad element, or finite values whose sum overflows) takes the elementwise check."""
    if t is None or not t.is_floating_point():
        return
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ProblemError(f"{name}: expected finite values, got {int(bad.sum())} NaN/Inf "
                           f"(first at index {idx})")


def _dt_bias_K(dt: Optional[torch.Tensor], HV: int) -> Optional[int]:
    """The K a dt_bias of shape [HV, K] or [HV*K] implies; None when its shape implies none."""
    if dt is None or HV < 1:
        return None
    if dt.dim() == 2 and dt.shape[0] == HV:
        return int(dt.shape[1])
    if dt.dim() == 1 and dt.numel() % HV == 0:
        return dt.numel() // HV
    return None


def _check_K(p: Problem, HV: int) -> None:
    """q, k, g (and dt_bias where its shape implies a K) must agree on K.  When they do not,
    the tensors outside the majority are named: ``q: K = 64, but k, g have K = 128``."""
    ks = {"q": int(p.q.shape[3]), "k": int(p.k.shape[3]), "g": int(p.g.shape[3])}
    dk = _dt_bias_K(p.dt_bias, HV)
    if dk is not None:
        ks["dt_bias"] = dk
    if len(set(ks.values())) == 1:
        return
    votes: dict[int, list[str]] = {}
    for n, k in ks.items():
        votes.setdefault(k, []).append(n)
    top = max(len(v) for v in votes.values())
    leaders = [k for k, v in votes.items() if len(v) == top]
    def said(n: str, k: int) -> str:       # dt_bias's K is read from its shape: say which
        return f"{n}: K = {k}" + (f" ({shape_of(p.dt_bias)} with HV={HV})" if n == "dt_bias" else "")

    if len(leaders) == 1:
        K = leaders[0]
        odd = ", ".join(said(n, k) for n, k in ks.items() if k != K)
        raise ProblemError(f"{odd}, but {', '.join(votes[K])} have K = {K}")
    raise ProblemError(f"{', '.join(ks)}: expected one K across them, got "
                       + ", ".join(f"{n} K = {k}" for n, k in ks.items()))


def validate(p: Problem) -> Problem:
    """Check every argument of a Problem; raise ProblemError naming the first bad one."""
    for name in ("q", "k", "v", "g", "beta"):
        _float_tensor(name, getattr(p, name))
    for name in ("A_log", "dt_bias", "initial_state", "state_cache", "out_gate", "norm_weight"):
        if getattr(p, name) is not None:
            _float_tensor(name, getattr(p, name))
    for name, dims in (("q", "[B,T,H,K]"), ("k", "[B,T,H,K]"), ("v", "[B,T,HV,V]"), ("g", "[B,T,HV,K]")):
        _req(getattr(p, name).dim() == 4, f"{name}: expected 4 dims {dims}, got {shape_of(getattr(p, name))}")
    B, T, H, _ = p.q.shape
    _req(H >= 1, f"q: expected H >= 1 query/key heads, got H=0 in {shape_of(p.q)}")
    HV, V = p.v.shape[2], p.v.shape[3]
    _check_K(p, HV)
    K = p.q.shape[3]
    _req(p.k.shape == p.q.shape, f"k: expected the shape of q {list(p.q.shape)}, got {shape_of(p.k)}")
    _req(tuple(p.v.shape[:2]) == (B, T), f"v: expected [B={B},T={T},HV,V], got {shape_of(p.v)}")
    _req(HV >= 1, f"v: expected HV >= 1 value heads, got HV=0 in {shape_of(p.v)}")
    _req(HV % H == 0, f"v: expected HV a multiple of H={H} (GVA), got HV={HV}")
    _req(K >= 1 and V >= 1, f"q/v: expected K >= 1 and V >= 1, got K={K} V={V}")
    _req(tuple(p.g.shape) == (B, T, HV, K), f"g: expected [{B},{T},{HV},{K}] ([B,T,HV,K]), got {shape_of(p.g)}")
    _req(tuple(p.beta.shape) == (B, T, HV), f"beta: expected [{B},{T},{HV}], got {shape_of(p.beta)}")
    _req(p.gate in GATE_KINDS, f"gate: expected one of {'|'.join(GATE_KINDS)}, got {p.gate!r}")
    _req(p.beta_kind in BETA_KINDS, f"beta_kind: expected one of {'|'.join(BETA_KINDS)}, got {p.beta_kind!r}")
    _req(p.state_layout in STATE_LAYOUTS,
         f"state_layout: expected one of {'|'.join(STATE_LAYOUTS)}, got {p.state_layout!r}")
    if p.A_log is not None:
        _req(tuple(p.A_log.shape) == (HV,), f"A_log: expected [{HV}] (one per value head), got {shape_of(p.A_log)}")
    if p.dt_bias is not None:
        transposed = (tuple(p.dt_bias.shape) == (K, HV) and K != HV)
        _req(tuple(p.dt_bias.shape) in ((HV * K,), (HV, K)),
             f"dt_bias: expected [{HV * K}] (HV*K) or [{HV},{K}] (HV,K), got {shape_of(p.dt_bias)}"
             + (" ([K,HV] is not accepted: pass dt_bias.T)" if transposed else ""))
    if p.gate == "lower_bound":
        _req(p.lower_bound is not None, "lower_bound: expected a number < 0 for gate=lower_bound, got none")
        _req(isinstance(p.lower_bound, (int, float)) and math.isfinite(p.lower_bound) and p.lower_bound < 0,
             f"lower_bound: expected a finite number < 0, got {p.lower_bound!r}")
    if p.gate == "softplus":
        _req(p.A_log is not None, "A_log: expected [HV] for gate=softplus, got None")
    if p.scale is not None:
        _req(math.isfinite(float(p.scale)) and float(p.scale) > 0, f"scale: expected a number > 0, got {p.scale!r}")
    # varlen
    if p.cu_seqlens is not None:
        cu = p.cu_seqlens
        _req(isinstance(cu, torch.Tensor) and not cu.is_floating_point() and not cu.is_complex()
             and cu.dtype != torch.bool and cu.dim() == 1 and cu.numel() >= 2,
             f"cu_seqlens: expected an integer tensor [N+1] with N >= 1, got {shape_of(cu)}")
        _req(B == 1, f"cu_seqlens: expected B == 1 with varlen, got B={B}")
        c = [int(x) for x in cu.tolist()]
        _req(c[0] == 0, f"cu_seqlens: expected to start at 0, got {c[0]}")
        bad = [i for i in range(1, len(c)) if c[i] < c[i - 1]]
        if bad:
            raise ProblemError(f"cu_seqlens: expected non-decreasing, got {c[bad[0] - 1]} then {c[bad[0]]} at index {bad[0]}")
        _req(c[-1] == T, f"cu_seqlens: expected to end at T={T}, got {c[-1]}")
    N = p.N
    # states
    if p.state_layout in ("kv", "vk"):
        _req(p.state_cache is None and p.state_indices is None and p.has_initial_state is None,
             f"state_cache: expected None unless state_layout=paged, got state_layout={p.state_layout!r}")
        if p.initial_state is not None:
            want = (N, HV, K, V) if p.state_layout == "kv" else (N, HV, V, K)
            _req(tuple(p.initial_state.shape) == want,
                 f"initial_state: expected {list(want)} ([N,HV,{'K,V' if p.state_layout == 'kv' else 'V,K'}] "
                 f"for layout {p.state_layout}), got {shape_of(p.initial_state)}")
    else:
        _req(p.initial_state is None, "initial_state: expected None with state_layout=paged (the cache holds it), got a tensor")
        sc = p.state_cache
        _req(sc is not None and sc.dim() == 4 and tuple(sc.shape[1:]) == (HV, V, K),
             f"state_cache: expected [slots,{HV},{V},{K}] (V-first), got {shape_of(sc)}")
        si, hs = p.state_indices, p.has_initial_state
        _req(si is not None and not si.is_floating_point() and si.dtype != torch.bool and tuple(si.shape) == (N,),
             f"state_indices: expected an integer tensor [{N}], got {shape_of(si)}")
        _req(hs is not None and hs.dtype == torch.bool and tuple(hs.shape) == (N,),
             f"has_initial_state: expected a bool tensor [{N}], got {shape_of(hs)}")
        idx = [int(x) for x in si.tolist()]
        out = [i for i in idx if not 0 <= i < sc.shape[0]]
        _req(not out, f"state_indices: expected values in [0, {sc.shape[0]}) (slots), got {out[:1]}")
        dup = sorted({i for i in idx if idx.count(i) > 1})
        _req(not dup, f"state_indices: expected distinct slots, got slot {dup[:1]} used twice")
    # the fused output norm: both tensors or neither, eps > 0
    if p.out_gate is not None or p.norm_weight is not None:
        _req(p.out_gate is not None, f"out_gate: expected [{B},{T},{HV},{V}] with norm_weight given, got None")
        _req(p.norm_weight is not None, f"norm_weight: expected [{V}] with out_gate given, got None")
        _req(tuple(p.out_gate.shape) == (B, T, HV, V),
             f"out_gate: expected [{B},{T},{HV},{V}] ([B,T,HV,V], like v), got {shape_of(p.out_gate)}")
        _req(tuple(p.norm_weight.shape) == (V,), f"norm_weight: expected [{V}] (V), got {shape_of(p.norm_weight)}")
        _req(isinstance(p.norm_eps, (int, float)) and not isinstance(p.norm_eps, bool)
             and math.isfinite(p.norm_eps) and p.norm_eps > 0,
             f"norm_eps: expected a finite number > 0, got {p.norm_eps!r}")
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "out_gate", "norm_weight"):
        _finite(name, getattr(p, name))
    if p.gate == "pregated":
        pos = p.g > 0
        if bool(pos.any()):
            idx = tuple(int(i) for i in pos.nonzero()[0].tolist())
            raise ProblemError(f"g: expected a log-decay <= 0 with gate=pregated (a decay exp(g) <= 1), got "
                               f"{int(pos.sum())} values > 0 (max {float(p.g.max()):.3g}, first at index {idx})")
    if p.paged:
        for n, (slot, reads) in enumerate(zip(p.state_indices.tolist(), p.has_initial_state.tolist())):
            bad = int((~torch.isfinite(p.state_cache[slot])).sum()) if reads else 0
            _req(bad == 0, f"state_cache: expected finite values in slot {slot} (read by sequence {n}: "
                           f"has_initial_state is true), got {bad} NaN/Inf")
    return p
