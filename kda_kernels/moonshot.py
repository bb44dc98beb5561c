"""Adapter: Moonshot's CUTLASS FlashKDA (``flash_kda.fwd``, SM90+), judged with the
``moonshot`` recipe (C = 16, bf16 inverse, bf16 state between chunks).

Call: ``flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
initial_state=None, final_state=None, cu_seqlens=None)``; writes ``out`` and
``final_state`` in place.  It wants bf16 q/k/v/g/beta/out, A_log fp32 [H], dt_bias fp32
[H, 128] (2-D), V-first states [N, H, V, K] in bf16 or fp32 (both of one dtype),
int64 cu_seqlens, K = V = 128, no GVA.  A K-first problem state is transposed for it and
the final state transposed back, so the harness compares like with like.
"""
from __future__ import annotations

import torch

from kda_ref.problem import Problem

from .base import Outputs, Route


def call_arguments(p: Problem) -> dict:
    N, H = p.N, p.H
    bf = torch.bfloat16
    kw = dict(q=p.q.to(bf), k=p.k.to(bf), v=p.v.to(bf), g=p.g.to(bf), beta=p.beta.to(bf), scale=p.scale_value,
              out=torch.empty(p.v.shape, dtype=bf, device=p.device), A_log=p.A_log.to(torch.float32),
              dt_bias=(torch.zeros(H, p.K, device=p.device) if p.dt_bias is None
                       else p.dt_bias.reshape(H, p.K)).to(torch.float32),
              lower_bound=float(p.lower_bound))
    if p.initial_state is not None:
        s = p.initial_state.to(torch.float32)
        kw["initial_state"] = (s if p.state_layout == "vk" else s.transpose(-1, -2)).contiguous()
    if p.output_final_state:
        kw["final_state"] = torch.empty(N, H, p.V, p.K, dtype=torch.float32, device=p.device)
    if p.cu_seqlens is not None:
        kw["cu_seqlens"] = p.cu_seqlens.to(device=p.device, dtype=torch.int64)
    return kw


class MoonshotBackend:
    name = "moonshot"

    def __init__(self):
        self._fwd, self._why = None, None

    def _load(self):
        if self._fwd is None and self._why is None:
            try:
                import flash_kda
                self._fwd = flash_kda.fwd
            except Exception as e:
                self._why = (f"Moonshot's flash_kda is not importable ({type(e).__name__}: {e}); it is built from "
                             f"source for SM90+ with CUDA >= 12.9")
        return self._fwd

    def available(self) -> tuple[bool, str]:
        if self._load() is None:
            return False, self._why
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
            return False, "flash_kda needs an NVIDIA GPU of SM90 or newer"
        return True, ""

    def version(self) -> str:
        try:
            import flash_kda
            return f"flash_kda {getattr(flash_kda, '__version__', '?')}"
        except Exception:
            return "not installed"

    def routes(self) -> list[Route]:
        return [Route("cutlass", recipe="moonshot", description="flash_kda.fwd (C=16, bf16 state)")]

    def accepts(self, p: Problem, route: Route) -> tuple[bool, str]:
        if p.K != 128 or p.V != 128 or p.HV != p.H:
            return False, f"not applicable: flash_kda needs K = V = 128 and no GVA, got K={p.K} V={p.V} H={p.H} HV={p.HV}"
        if p.gate != "lower_bound" or p.A_log is None or p.beta_kind != "sigmoid" or not p.qk_l2norm:
            return False, "not applicable: flash_kda has only the lower_bound gate with A_log, beta sigmoid and qk l2norm"
        if p.paged:
            return False, "not applicable: flash_kda has no paged state cache"
        return True, ""

    def run(self, p: Problem, route: Route) -> Outputs:
        fwd = self._load()
        if fwd is None:
            raise RuntimeError(self._why)
        kw = call_arguments(p)
        with torch.inference_mode():
            fwd(**kw)
        fs = kw.get("final_state")
        if fs is not None and p.state_layout == "kv":
            fs = fs.transpose(-1, -2).contiguous()
        return Outputs(o=kw["out"], final_state=fs, info={"route_ran": "flash_kda.fwd"})
