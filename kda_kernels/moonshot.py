"""Adapter: Moonshot's CUTLASS FlashKDA (``flash_kda.fwd``, SM90+), judged with the
``moonshot`` recipe (C = 16, fp16-accumulated inverse stored bf16, bf16 state between chunks).

Call (``flash_kda/__init__.py``)::

    flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                  initial_state=None, final_state=None, cu_seqlens=None)

writes ``out`` and ``final_state`` in place.  Its contract, as the wrapper and
``csrc/flash_kda.cpp`` state it:

    q, k, v, g [B, T, H, D] bf16, contiguous, D = K = V = 128 (no GVA: v, g match q's shape)
    beta [B, T, H] bf16 logits (sigmoid in the kernel); out [B, T, H, D] bf16
    A_log [H] fp32, dt_bias [H, D] fp32 (2-D); gate a = lower_bound * sigmoid(exp(A_log) (g + dt_bias))
    lower_bound: documented in [-5, 0], not checked
    initial_state / final_state: None, or [N, H, V, K] (V-first) bf16 or fp32, contiguous, one dtype
    cu_seqlens [N+1] int64 with B = 1 (varlen); else N = B independent sequences
    q, k l2-normalized in the kernel (eps 1e-6 inside the sqrt)

The kernel computes with a bf16 state whatever the state dtype: an fp32 initial state is
rounded to bf16 on load, and an fp32 final state is the bf16 state widened.  It dispatches
on (HasStateIn, HasStateOut, StateFP32, IsVarlen); the route that ran records those four.

Builds: FlashKDA replaced its fp16 Neumann-series inverse by an 8x8 fp32 forward substitution
in commit 7afb9f45 (FlashKDA issue #34), so a route's recipe is the build's: ``moonshot-fwdsub``
when the installed flash_kda's local version names ``fwdsub``, ``moonshot`` (the Neumann
inverse) otherwise.  tools/build_flash_kda.sh writes that word from the source it builds
(``0.0.1+1ce47ea.neumann``, ``0.0.1+<commit>.fwdsub``); ``version()`` reports the distribution
beside the module that imported, so two builds side by side (PYTHONPATH) are told apart.

Routes: ``cutlass:state=fp32`` and ``cutlass:state=bf16`` pass the states in that dtype
(in and out).  What the adapter converts, and nothing else: a K-first ("kv") problem state is
transposed to V-first (and the final state back); the state goes to the route's dtype; A_log,
dt_bias (reshaped [H, K]; zeros where the problem has none) go to fp32 and cu_seqlens to int64,
all exact; fp32 beta logits are rounded to bf16 (the kernel takes bf16 only), which the
route's info lists.  q, k, v, g must come as contiguous bf16: a production caller (fla's
FlashKDA dispatch) passes them as they come, and flash_kda raises on anything else, so such
problems are "not applicable" with the kernel's own words.  So is a problem without tokens
(B*T = 0): flash_kda.fwd does not raise there, it aborts the process (cute's TMA descriptor
assertion).
"""
from __future__ import annotations

import importlib.metadata as md
import os
import sys
from typing import Optional

import torch

from kda_ref.problem import Problem
from .base import Outputs, Route

D = 128
LB_RANGE = (-5.0, 0.0)          # the lower_bound range flash_kda documents (and does not check)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INVERSE_RECIPES = {"fwdsub": "moonshot-fwdsub", "neumann": "moonshot"}   # build label word -> emulator recipe
DEFAULT_RECIPE = "moonshot"     # a build whose label names no inverse (e.g. installed without tools/build_flash_kda.sh)
BUILD_HINT = ("build it from source for SM90 (CUDA >= 12.9): tools/vendor_flash_kda.sh then "
              "tools/build_flash_kda.sh SRC (docs/backends.md)")


def _dname(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dt, str(dt).replace("torch.", ""))


def state_dtype(route: Route) -> torch.dtype:
    return STATE_DTYPES[route.flag("state_dtype", "fp32")]


def call_arguments(p: Problem, route: Optional[Route] = None) -> dict:
    """The keyword arguments of flash_kda.fwd for problem ``p`` on ``route`` (default: fp32 states)."""
    return _arguments(p, route)[0]


def conversions(p: Problem, route: Optional[Route] = None) -> list[str]:
    """What call_arguments converts beyond exact widenings: layouts, the state dtype, beta."""
    return _arguments(p, route)[1]


def _arguments(p: Problem, route: Optional[Route]) -> tuple[dict, list]:
    N, H = p.N, p.H
    bf, f32 = torch.bfloat16, torch.float32
    sdt = state_dtype(route) if route is not None else f32
    conv = []
    beta = p.beta
    if beta.dtype != bf:
        conv.append(f"beta {_dname(beta.dtype)} logits -> bf16")
        beta = beta.to(bf)
    dt_bias = (torch.zeros(H, p.K, dtype=f32, device=p.device) if p.dt_bias is None
               else p.dt_bias.reshape(H, p.K).to(f32))
    kw = dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=beta, scale=p.scale_value,
              out=torch.empty(p.v.shape, dtype=bf, device=p.device), A_log=p.A_log.to(f32),
              dt_bias=dt_bias, lower_bound=float(p.lower_bound))
    if p.initial_state is not None:
        s = p.initial_state
        if p.state_layout == "kv":
            s = s.transpose(-1, -2)
            conv.append("initial_state K-first -> V-first")
        if s.dtype != sdt:
            conv.append(f"initial_state {_dname(s.dtype)} -> {_dname(sdt)}")
        kw["initial_state"] = s.to(sdt).contiguous()
    if p.output_final_state:
        kw["final_state"] = torch.empty(N, H, p.V, p.K, dtype=sdt, device=p.device)
        if p.state_layout == "kv":
            conv.append("final_state V-first -> K-first")
    if p.cu_seqlens is not None:
        cu = p.cu_seqlens.to(device=p.device)
        if cu.dtype != torch.int64:
            conv.append(f"cu_seqlens {str(cu.dtype).replace('torch.', '')} -> int64")
        kw["cu_seqlens"] = cu.to(torch.int64)
    return kw, conv


def dispatch(kw: dict) -> str:
    """The kernel instance flash_kda.fwd launches for these arguments (csrc/flash_kda.cpp)."""
    si, so = kw.get("initial_state"), kw.get("final_state")
    fp32 = any(s is not None and s.dtype == torch.float32 for s in (si, so))
    return (f"launch_fwd<HasStateIn={si is not None}, HasStateOut={so is not None}, StateFP32={fp32}, "
            f"IsVarlen={kw.get('cu_seqlens') is not None}>")


class MoonshotBackend:
    name = "moonshot"

    def __init__(self):
        self._fwd, self._why = None, None

    def _load(self):
        if self._fwd is None and self._why is None:
            try:
                # lazy: optional dependency (docs/design.md, Imports)
                import flash_kda
                self._fwd = flash_kda.fwd
            except Exception as e:  # noqa: BLE001 - any import failure is the reason it cannot run
                self._why = f"Moonshot's flash_kda is not importable ({type(e).__name__}: {e}); {BUILD_HINT}"
        return self._fwd

    def available(self) -> tuple[bool, str]:
        if self._load() is None:
            return False, self._why
        if not torch.cuda.is_available():
            return False, "flash_kda needs an NVIDIA GPU of SM90 or newer; torch sees no CUDA device"
        cap = torch.cuda.get_device_capability()
        if cap[0] < 9:
            return False, f"flash_kda needs an NVIDIA GPU of SM90 or newer, got SM{cap[0]}{cap[1]}"
        return True, ""

    def _dist_version(self) -> Optional[str]:
        """The version of the flash_kda distribution installed beside the module that imports
        (a --target directory or site-packages), None when there is none."""
        mod = sys.modules.get("flash_kda")
        if mod is None:
            try:
                # lazy: optional dependency (docs/design.md, Imports)
                import flash_kda as mod  # noqa: F811
            except Exception:  # noqa: BLE001
                return None
        where = os.path.dirname(os.path.dirname(os.path.abspath(getattr(mod, "__file__", None) or "")))
        for d in md.distributions(path=[where]):
            if (d.metadata["Name"] or "").replace("-", "_").lower() == "flash_kda":
                return d.version
        return None

    def recipe(self) -> str:
        """The emulator recipe of the installed build: its local version's inverse word
        (INVERSE_RECIPES), else DEFAULT_RECIPE."""
        local = (self._dist_version() or "").partition("+")[2].lower()
        hits = [r for w, r in INVERSE_RECIPES.items() if w in local]
        return hits[0] if len(hits) == 1 else DEFAULT_RECIPE

    def version(self) -> str:
        v = self._dist_version()
        if v is None:
            return "flash_kda not installed"
        where = getattr(sys.modules.get("flash_kda"), "__file__", "") or ""
        return f"flash_kda {v} (recipe {self.recipe()}{', ' + where if where else ''})"

    def routes(self) -> list[Route]:
        recipe = self.recipe()
        inv = ("fp16 Neumann inverse" if recipe == "moonshot" else "8x8 fp32 forward-substitution inverse")
        return [Route(f"cutlass:state={n}", recipe=recipe, flags=(("state_dtype", n),),
                      description=f"flash_kda.fwd with {n} initial/final states (computes with a bf16 state; "
                                  f"this build: {inv})")
                for n in STATE_DTYPES]

    def accepts(self, p: Problem, route: Route) -> tuple[bool, str]:
        if p.B * p.T == 0:
            return False, ("not applicable: flash_kda.fwd aborts the process on a problem without tokens (a failed "
                           f"assertion in cute's make_tma_copy_desc, SIGABRT; no exception), got B={p.B} T={p.T}")
        if p.K != D or p.V != D:
            return False, (f"not applicable: flash_kda supports only K = V = 128 (it checks 'currently only supports "
                           f"D == 128', one D for q and v), got K={p.K} V={p.V}")
        if p.HV != p.H:
            return False, (f"not applicable: flash_kda has no GVA (it checks 'v must match q shape'), "
                           f"got H={p.H} HV={p.HV}")
        if p.gate != "lower_bound" or p.A_log is None:
            return False, (f"not applicable: flash_kda has only the gate lower_bound * sigmoid(exp(A_log) (g + dt_bias)) "
                           f"with A_log [H], got gate={p.gate}{'' if p.A_log is not None else ' without A_log'}")
        if p.beta_kind != "sigmoid":
            return False, f"not applicable: flash_kda applies sigmoid to beta logits in the kernel, got beta={p.beta_kind}"
        if not p.qk_l2norm:
            return False, "not applicable: flash_kda always l2-normalizes q and k in the kernel, got qk_l2norm off"
        if p.paged:
            return False, "not applicable: flash_kda has no paged state cache (dense [N, H, V, K] states only)"
        for name in ("q", "k", "v", "g"):
            t = getattr(p, name)
            if t.dtype != torch.bfloat16:
                return False, f"not applicable: flash_kda takes bf16 {name} only (it checks '{name} must be bfloat16'), got {_dname(t.dtype)}"
        strided = [n for n in ("q", "k", "v", "g", "beta") if not getattr(p, n).is_contiguous()
                   and (n != "beta" or p.beta.dtype == torch.bfloat16)]
        for name, t in (("A_log", p.A_log), ("dt_bias", p.dt_bias)):
            if t is not None and t.dtype == torch.float32 and not t.is_contiguous():
                strided.append(name)
        if strided:
            t = getattr(p, strided[0])
            return False, (f"not applicable: flash_kda.fwd raises RuntimeError 'all tensors must be contiguous' on strided "
                           f"inputs, got {', '.join(strided)} strided ({strided[0]} {list(t.shape)} strides "
                           f"{list(t.stride())}); fla's FlashKDA dispatch passes them as they come")
        return True, ""

    def out_of_contract(self, p: Problem, route: Route) -> Optional[str]:
        """The documented-but-unchecked range: lower_bound in [-5, 0]."""
        lb = p.lower_bound
        if lb is not None and not LB_RANGE[0] <= lb <= LB_RANGE[1]:
            return (f"lower_bound {lb:g} outside the [-5, 0] flash_kda documents; flash_kda.fwd does not check it")
        return None

    def run(self, p: Problem, route: Route) -> Outputs:
        fwd = self._load()
        if fwd is None:
            raise RuntimeError(self._why)
        kw, conv = _arguments(p, route)
        with torch.inference_mode():
            fwd(**kw)
        fs = kw.get("final_state")
        if fs is not None and p.state_layout == "kv":
            fs = fs.transpose(-1, -2).contiguous()
        info = {"route_ran": f"flash_kda.fwd {dispatch(kw)}", "converted": conv}
        return Outputs(o=kw["out"], final_state=fs, info=info)
