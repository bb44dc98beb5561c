"""Adapters: the eager PyTorch KDA references users compare their kernels against.

``fla-naive``: fla-core's ``fla/ops/kda/naive.py`` (fla-core 0.6.0)

    naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)
    naive_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size=64)

``transformers``: the Kimi Linear model's functions in
``transformers/models/kimi_linear/modeling_kimi_linear.py`` (transformers 5.17)

    recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel)
    chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state,
                               output_final_state, use_qk_l2norm_in_kernel)

Their contract, as their code reads: q, k [B, T, H, K]; v [B, T, HV, V] (fla: HV % H == 0, q and
k repeated per value head; transformers: HV == H, it repeats nothing); g [B, T, HV, K] the
natural-log decay and beta [B, T, HV] activated (the caller applies the gate and the sigmoid);
initial_state [B, HV, K, V] K-first; no varlen, no paged cache.  Every input is cast to fp32 and
everything is computed in fp32 (torch einsum / matmul, IEEE on CUDA with torch's default
allow_tf32 = False); o is cast back to v's dtype (fla) or q's dtype (transformers), the final
state stays fp32.  Token loop (recurrent) or WY chunks of 64 with a row recursion for
(I + A)^{-1} (chunk).  fla's naive_chunk_kda asserts T % 64 == 0; transformers' pads T itself.
The scale: fla takes it (default K^-0.5); transformers fixes it to K^-0.5.  l2norm: fla's
functions take q, k as given (the caller normalizes); transformers normalizes with
``use_qk_l2norm_in_kernel`` (x / sqrt(sum x^2 + 1e-6), fla's formula).

transformers decorates both functions with ``use_kernel_func_from_hub_with_fallback``: where fla is
importable, calling them runs fla's Triton ``chunk_kda`` / ``fused_recurrent_kda`` instead.  The
adapter calls the torch function itself (``__wrapped__``), and ``route_ran`` says so.

What the adapter does for the caller, all in fp32 as the libraries' callers do (fla's
``naive_kda_gate`` / ``naive_kda_lowerbound_gate`` and transformers' ``KimiLinearForgetGate``
compute the gate in fp32): the gate (lower_bound: lb sigmoid(exp(A_log) (g + dt_bias)); softplus:
-exp(A_log) softplus(g + dt_bias), threshold 20; pregated: g), the beta activation (sigmoid,
2 sigmoid, or as given), fla's l2norm for fla-naive; a varlen or batched problem is split into one
call per sequence (exact: the sequences are independent), an empty sequence is not called (its
state passes through); naive_chunk_kda's sequences are zero-padded to a multiple of 64 (exact:
a padded token has k = v = beta = 0 and g = 0, so it changes neither earlier outputs nor the state);
K-first / V-first states are transposed.  Refused in their own terms: GVA for transformers, the
scale for transformers when it is not K^-0.5, paged caches.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from kda_ref.problem import Problem
from .base import Outputs, Route

F32 = torch.float32
CHUNK = 64
RECIPE = "fp32"       # the emulator recipe of an fp32 computation whose o is rounded to the input dtype


def prologue(p: Problem, l2norm: bool, b0: int, b1: int) -> dict:
    """The caller's fp32 preprocessing: q, k (l2-normalized when ``l2norm`` and the problem asks),
    the log decay g and the activated beta, packed [Ttot, H|HV, D] fp32; v as given (its dtype is
    the dtype fla's naive functions return o in), for the tokens [b0, b1) of the packed axis.  One
    sequence at a time: torch's CPU kernels round a vectorized element and a loop-tail element of
    exp / sigmoid differently, so a sequence's bits would otherwise depend on where it sits in a batch."""
    Tt = p.B * p.T
    q = p.q.reshape(Tt, p.H, p.K)[b0:b1].to(F32)
    k = p.k.reshape(Tt, p.H, p.K)[b0:b1].to(F32)
    if l2norm and p.qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = p.g.reshape(Tt, p.HV, p.K)[b0:b1].to(F32)
    if p.gate != "pregated":
        if p.dt_bias is not None:
            g = g + p.dt_bias.to(F32).reshape(p.HV, p.K)
        A = torch.exp(p.A_log.to(F32)).reshape(p.HV, 1) if p.A_log is not None else None
        if p.gate == "lower_bound":
            g = float(p.lower_bound) * torch.sigmoid(g if A is None else A * g)
        else:
            g = -A * F.softplus(g, beta=1.0, threshold=20.0)
    b = p.beta.reshape(Tt, p.HV)[b0:b1].to(F32)
    b = {"sigmoid": torch.sigmoid(b), "sigmoid2": 2.0 * torch.sigmoid(b), "pregated": b}[p.beta_kind]
    return dict(q=q, k=k, v=p.v.reshape(Tt, p.HV, p.V)[b0:b1], g=g, beta=b)


def start_states(p: Problem) -> Optional[torch.Tensor]:
    """The initial states K-first [N, HV, K, V] fp32 (None where the problem has none)."""
    if p.initial_state is None:
        return None
    s = p.initial_state.to(F32)
    return s if p.state_layout == "kv" else s.transpose(-1, -2)


class _Reference:
    """One eager reference: ``_fns()`` gives {route: callable(q, k, v, g, beta, scale, S0, out_dtype)
    -> (o [1, T, HV, V], S [1, HV, K, V] fp32)} for one sequence."""
    name = ""
    library = ""
    ROUTES: dict = {}

    def __init__(self):
        self._fn, self._why = None, None

    def _load(self):
        if self._fn is None and self._why is None:
            try:
                self._fn = self._import()
            except Exception as e:  # noqa: BLE001 - any import failure is the reason it cannot run
                self._why = f"{self.library} is not importable ({type(e).__name__}: {e})"
        return self._fn

    def available(self) -> tuple[bool, str]:
        self._load()
        return (False, self._why) if self._why else (True, "")

    def routes(self) -> list[Route]:
        return [Route(n, recipe=RECIPE, flags=(("form", n.split(":")[1]),), description=d)
                for n, d in self.ROUTES.items()]

    def _refuse(self, p: Problem, route: Route) -> Optional[str]:
        return None

    def accepts(self, p: Problem, route: Route) -> tuple[bool, str]:
        if p.paged:
            return False, (f"not applicable: {self.library}'s KDA references have no paged state cache "
                           "(dense [B, HV, K, V] states only)")
        if p.HV % p.H:
            return False, f"not applicable: the value heads must be a multiple of the key heads, got H={p.H} HV={p.HV}"
        why = self._refuse(p, route)
        return (False, why) if why else (True, "")

    def run(self, p: Problem, route: Route) -> Outputs:
        fns = self._load()
        if fns is None:
            raise RuntimeError(self._why)
        form = route.flag("form")
        S0 = start_states(p)
        bounds = p.seq_bounds()
        o = torch.zeros(p.B * p.T, p.HV, p.V, dtype=self.out_dtype(p), device=p.device)
        finals, conv = [], []
        if len(bounds) > 1:
            conv.append(f"{len(bounds)} sequences: one call each")
        for n, (b0, b1) in enumerate(bounds):
            s0 = None if S0 is None else S0[n:n + 1].contiguous()
            if b1 == b0:
                finals.append(torch.zeros(1, p.HV, p.K, p.V, dtype=F32, device=p.device) if s0 is None else s0)
                conv.append(f"sequence {n} empty: not called, its state passes through")
                continue
            seq = {name: t[None] for name, t in prologue(p, self.l2norm_outside, b0, b1).items()}
            on, Sn, pad = fns[form](seq, p.scale_value, s0, self.out_dtype(p))
            if pad:
                conv.append(f"sequence {n} zero-padded {b1 - b0} -> {b1 - b0 + pad}")
            o[b0:b1] = on[0, :b1 - b0]
            finals.append(Sn)
        fs = None
        if p.output_final_state:
            fs = torch.cat(finals, 0)
            fs = fs if p.state_layout == "kv" else fs.transpose(-1, -2)
            fs = fs.contiguous()
        info = {"route_ran": self.ran(form), "converted": conv}
        return Outputs(o=o.reshape(p.B, p.T, p.HV, p.V), final_state=fs, info=info)


class FlaNaiveBackend(_Reference):
    """fla-core's naive_recurrent_kda / naive_chunk_kda (see the module docstring)."""
    name = "fla-naive"
    library = "fla-core (fla.ops.kda.naive)"
    l2norm_outside = True
    ROUTES = {"naive:recurrent": "fla naive_recurrent_kda: fp32 token loop",
              "naive:chunk": "fla naive_chunk_kda: fp32 WY chunks of 64, (I + A)^-1 by row recursion"}

    def _import(self):
        # lazy: optional dependency (docs/design.md, Imports)
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

        def recurrent(x, scale, s0, _out):
            o, S = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale,
                                       initial_state=s0, output_final_state=True)
            return o, S, 0

        def chunk(x, scale, s0, _out):
            T = x["q"].shape[1]
            pad = -T % CHUNK
            if pad:
                x = {n: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for n, t in x.items()}
            o, S = naive_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=s0,
                                   output_final_state=True, chunk_size=CHUNK)
            return o, S, pad
        return {"recurrent": recurrent, "chunk": chunk}

    def out_dtype(self, p: Problem) -> torch.dtype:
        return p.v.dtype                      # naive_*: o.to(v.dtype)

    def ran(self, form: str) -> str:
        return f"fla.ops.kda.naive.naive_{form}_kda (fp32)"

    def version(self) -> str:
        try:
            # lazy: optional dependency (docs/design.md, Imports)
            import fla
            return f"fla-core {fla.__version__} (fla.ops.kda.naive)"
        except Exception:  # noqa: BLE001
            return "fla-core not installed"


class TransformersBackend(_Reference):
    """transformers' Kimi Linear recurrent_/chunk_kimi_delta_attention, the torch path."""
    name = "transformers"
    library = "transformers (models.kimi_linear)"
    l2norm_outside = False
    ROUTES = {"torch:recurrent": "transformers recurrent_kimi_delta_attention, torch path: fp32 token loop",
              "torch:chunk": "transformers chunk_kimi_delta_attention, torch path: fp32 WY chunks of 64 (pads T)"}

    def _import(self):
        # lazy: optional dependency (docs/design.md, Imports)
        from transformers.models.kimi_linear import modeling_kimi_linear as m
        rec = getattr(m.recurrent_kimi_delta_attention, "__wrapped__", m.recurrent_kimi_delta_attention)
        chk = getattr(m.chunk_kimi_delta_attention, "__wrapped__", m.chunk_kimi_delta_attention)

        def call(fn, x, s0, out, **kw):
            q = x["q"].to(out)   # the model passes q, k, v in its dtype (q: raw here, exact); fp32 inside
            o, S = fn(q, x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=s0, output_final_state=True,
                      use_qk_l2norm_in_kernel=self._l2, **kw)
            return o, S, 0

        return {"recurrent": lambda x, scale, s0, out: call(rec, x, s0, out),
                "chunk": lambda x, scale, s0, out: call(chk, x, s0, out, chunk_size=CHUNK)}

    def run(self, p: Problem, route: Route) -> Outputs:
        self._l2 = bool(p.qk_l2norm)
        return super().run(p, route)

    def _refuse(self, p: Problem, route: Route) -> Optional[str]:
        if p.HV != p.H:
            return (f"not applicable: transformers' Kimi Linear KDA takes one head count for q, k and v (it reads "
                    f"the heads from key and repeats nothing), got H={p.H} HV={p.HV}")
        if not math.isclose(p.scale_value, p.K ** -0.5, rel_tol=1e-12):
            return (f"not applicable: transformers' Kimi Linear KDA fixes the scale to K^-0.5 = {p.K ** -0.5:.6g}, "
                    f"got {p.scale_value:.6g}")
        return None

    def out_dtype(self, p: Problem) -> torch.dtype:
        return p.q.dtype                      # core_attn_out.to(query's dtype)

    def ran(self, form: str) -> str:
        return (f"transformers.models.kimi_linear.{form}_kimi_delta_attention, torch path (__wrapped__: the hub "
                f"kernel / fla fallback of its decorator bypassed; fp32)")

    def version(self) -> str:
        try:
            # lazy: optional dependency (docs/design.md, Imports)
            import transformers
            return f"transformers {transformers.__version__} (models.kimi_linear, torch path)"
        except Exception:  # noqa: BLE001
            return "transformers not installed"
