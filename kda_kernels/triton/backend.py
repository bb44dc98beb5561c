"""TritonBackend: our FlashKDA forward behind the Backend protocol (kda_kernels/base.py).

Routes are the pinned names of routes.py (``unseg:BW=32``, ``seg:cps=4:A=fused:B=prefetch:BW=32``,
...); every one has recipe "flashkda".  A Problem is rounded to the kernel's dtypes (q, k, v
bf16; g bf16 or fp32; beta fp32 or bf16) and run on its own device (or on CUDA when it is
on the CPU and the interpreter is off).  A paged cache is copied (padding included) before
the kernels write it, so the Problem itself is never modified.

``run_pass(problem, route, pass_name, feed)`` runs one pass alone on oracle-fed inputs:

    "K1": feed unused                     -> ws_kd, ws_qd, ws_kr, ws_gt, ws_inv, ws_mqk, ws_beta
    "A":  feed ws_* (+ v from the Problem) -> A_seg [segs,H,K,K], b_seg [segs,H,K,V]
    "B":  feed A_seg, b_seg (+ S0)         -> h_in [segs,H,K,V]
    "C":  feed ws_* (+ h_in if segmented)  -> o [Ttot,H,V] packed, final_state [N,H,K,V] K-first
          (paged problems: written through the paged store into a copy of the cache, then read
          back from slot state_indices[n], so a slot slip shows in final_state)
Trace routes (kda_kernels.base.RunsTraces): ``TRACE_ROUTES`` run the prefill calls of a serving
trace through the paged path (``flashkda_forward(state_cache=, state_indices=, has_initial_state=)``):
the call becomes a paged Problem whose cache is the trace cache's V-first view
(kda_kernels.trace_support.paged_problem), ``run`` writes a copy of the whole buffer and every
element of it is copied back.  The paged store is fp32 [slots, H, 128, 128] with dense slots
(stride(0) may be padded): a trace with a K-first or bf16 cache is not applicable.

Feeds are float64 in the oracle's layouts (kda_ref.workspace / kda_ref.segments) and are
rounded to the workspace dtypes first; outputs come back in the kernel's dtypes.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import triton

# absolute: a mutant copy of this folder (verification/investigating/mutate.py) has only base.py beside it
from kda_kernels.trace_support import copy_back, paged_problem, problem_of_trace, trace_refusal
from kda_ref.problem import Problem
from . import forward as fw
from ..base import Outputs, Route, copy_with_padding, with_taps
from .routes import RouteError, RouteSpec, parse_route, route_names

PASSES = ("K1", "A", "B", "C")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


class TritonBackend:
    """``TritonBackend(taps=True)`` returns the workspace (ws_*) and, when segmented, A_seg,
    b_seg and h_in as ``Outputs.taps`` on every run; ``run(..., taps=True)`` asks for one run."""
    name = "triton"
    accepts_buffers = True      # run(..., buffers=GuardedBuffers): caller-owned buffers (verification.running.guards)

    def __init__(self, taps: bool = False):
        self.taps = bool(taps)

    def with_taps(self, taps: bool = True) -> "TritonBackend":
        """This backend with taps on every run (kda_kernels.base.ReturnsTaps)."""
        return with_taps(self, taps)

    def available(self) -> tuple[bool, str]:
        try:
            # lazy: a probe of what is installed (docs/design.md, Imports)
            import triton  # noqa: F401
        except ImportError as e:
            return False, f"triton is not importable: {e}"
        if torch.cuda.is_available():
            return True, f"CUDA device {torch.cuda.get_device_name(0)}"
        if _interpreting():
            return True, "TRITON_INTERPRET=1: Triton's CPU interpreter (slow; small problems only)"
        return False, "no CUDA device, and TRITON_INTERPRET is not 1"

    def version(self) -> str:
        return f"kda-verify triton flashkda (triton {triton.__version__})"

    def routes(self) -> list[Route]:
        return [self.route(n) for n in route_names()]

    def route(self, name: str) -> Route:
        spec = parse_route(name)
        flags = (("segmented", spec.segmented), ("cps", spec.cps), ("A", spec.pass_a if spec.segmented else None),
                 ("B", spec.pass_b if spec.segmented else None), ("BW", spec.bw), ("nw", spec.warps),
                 ("scan", spec.scan if spec.segmented else None))
        desc = ("one segment per sequence (pass C alone)" if not spec.segmented else
                f"segmented, {'heuristic cps' if spec.cps is None else f'{spec.cps} chunks per segment'}, "
                f"pass A {spec.pass_a}, pass B {spec.pass_b}")
        return Route(name=spec.name, recipe="flashkda", flags=flags, description=desc)

    def accepts(self, problem: Problem, route: Route) -> tuple[bool, str]:
        p = problem
        reasons = []
        if p.K != 128 or p.V != 128:
            reasons.append(f"K={p.K}, V={p.V} (FlashKDA needs K = V = 128)")
        if p.HV != p.H:
            reasons.append(f"GVA HV={p.HV} != H={p.H}")
        if p.gate != "lower_bound":
            reasons.append(f"gate={p.gate} (only lower_bound)")
        elif p.lower_bound is None or not (-5.5 <= float(p.lower_bound) < 0):
            reasons.append(f"lower_bound={p.lower_bound} outside [-5.5, 0) (pivot factors overflow)")
        if p.beta_kind != "sigmoid":
            reasons.append(f"beta_kind={p.beta_kind} (only sigmoid)")
        if not p.qk_l2norm:
            reasons.append("qk_l2norm off (the kernel always normalises)")
        try:
            parse_route(route.name)
        except RouteError as e:
            reasons.append(str(e))
        if reasons:
            return False, "not applicable: " + "; ".join(reasons)
        return True, ""

    # ------------------------------------------------------------------------------ traces
    TRACE_ROUTES = ("unseg:BW=32", "seg:A=fused:B=prefetch:BW=32", "seg:cps=1:A=fused:B=prefetch:BW=32",
                    "seg:cps=4:A=fused:B=prefetch:BW=32", "seg:A=fused:B=prefetch:BW=32:scan=bf16")

    def trace_routes(self) -> list[Route]:
        """The paged routes that run a trace's prefill calls (recipe flashkda, as on Problems)."""
        out = []
        for name in self.TRACE_ROUTES:
            r = self.route(name)
            out.append(Route(r.name, recipe=r.recipe, flags=(("groups", ("prefill",)),) + r.flags,
                             description=f"prefill: the paged FlashKDA forward, {r.description}"))
        return out

    def trace_accepts(self, trace, route: Route) -> tuple[bool, str]:
        ok, why = self.accepts(problem_of_trace(trace), route)
        if not ok:
            return ok, why
        why = trace_refusal(trace, "our FlashKDA's paged store", layouts=("vk",), dtypes=("float32",))
        return (False, why) if why else (True, "")

    def run_call(self, call, route) -> torch.Tensor:
        """A prefill PhaseCall through the paged forward; the cache written in place."""
        if call.group != "prefill":
            raise ValueError(f"call: our FlashKDA runs prefill calls, got a {call.group} call")
        out = self.run(paged_problem(call), route)
        copy_back(call, out.state_cache)
        return out.o

    # ------------------------------------------------------------------------------ helpers
    def _device(self, p: Problem) -> torch.device:
        if p.device.type == "cpu" and not _interpreting() and torch.cuda.is_available():
            return torch.device("cuda")
        return p.device

    def _spec(self, problem: Problem, route) -> RouteSpec:
        spec = parse_route(route.name if isinstance(route, Route) else route)
        if spec.segmented and spec.cps is None and "chunks_per_seg" in problem.meta:
            cps = int(problem.meta["chunks_per_seg"])
            spec = dataclasses.replace(spec, segmented=cps > 0, cps=cps if cps > 0 else None)
        return spec

    @staticmethod
    def _kernel_inputs(p: Problem, dev) -> dict:
        def bf16(t):
            return t.to(device=dev, dtype=torch.bfloat16) if t.dtype != torch.bfloat16 or t.device != dev else t

        def f32_or_bf16(t):
            if t.dtype in (torch.bfloat16, torch.float32) and t.device == dev:
                return t
            return t.to(device=dev, dtype=torch.bfloat16 if t.dtype == torch.bfloat16 else torch.float32)

        A_log = p.A_log if p.A_log is not None else torch.zeros(p.H)
        return dict(q=bf16(p.q), k=bf16(p.k), v=bf16(p.v), g=f32_or_bf16(p.g), beta=f32_or_bf16(p.beta),
                    A_log=A_log.to(device=dev, dtype=torch.float32),
                    dt_bias=None if p.dt_bias is None else p.dt_bias.reshape(-1).to(device=dev, dtype=torch.float32),
                    scale=p.scale_value, lower_bound=float(p.lower_bound))

    # ------------------------------------------------------------------------------ run
    def run(self, problem: Problem, route, taps: Optional[bool] = None, buffers=None) -> Outputs:
        """``buffers`` (verification.running.guards.GuardedBuffers): every buffer of the forward (o,
        final_state, workspace, segment tensors) comes from ``buffers.allocate`` and the paged
        cache is written in place when it is already on the kernel's device (else adopted there)."""
        p = problem
        taps = self.taps if taps is None else bool(taps)
        dev = self._device(p)
        spec = self._spec(p, route)
        kw = self._kernel_inputs(p, dev)
        cu = None if p.cu_seqlens is None else p.cu_seqlens.to(dev)
        state_kw = {}
        cache = None
        if p.paged:
            src = p.state_cache.to(dev) if p.state_cache.device != dev else p.state_cache
            if buffers is None:
                cache = copy_with_padding(src)
            else:
                cache = src if src is p.state_cache else buffers.adopt("state_cache", src)
            if cache.dtype != torch.float32:
                raise fw.FlashKDAError(f"state_cache: expected float32, got {cache.dtype}")
            state_kw = dict(state_cache=cache, state_indices=p.state_indices.to(dev),
                            has_initial_state=p.has_initial_state.to(dev))
        elif p.initial_state is not None:
            state_kw = dict(initial_state=p.initial_state.to(dev), state_layout=p.state_layout)
        else:
            state_kw = dict(state_layout=p.state_layout)
        with fw.use_allocator(None if buffers is None else buffers.allocate):
            res = fw.flashkda_forward(**kw, cu_seqlens=cu, output_final_state=p.output_final_state and not p.paged,
                                      route=spec, return_workspace=taps, **state_kw)
        back = p.device
        return Outputs(o=res.o.to(back), final_state=None if res.final_state is None else res.final_state.to(back),
                       state_cache=None if cache is None else cache.to(back),
                       taps={n: t.to(back) for n, t in res.taps.items()},
                       info={"route_ran": res.route, "segments": res.plan.num_segs,
                             "chunks_per_seg": res.plan.cps, "device": str(dev)})

    # ------------------------------------------------------------------------------ passes
    def debug_plan(self, problem: Problem, route) -> dict:
        """What ``verification.investigating.debug`` needs: chunk size, the resolved chunks per segment (None:
        unsegmented) and the passes this route runs."""
        p = problem
        spec = self._spec(p, route)
        dev = self._device(p)
        plan = fw.resolve_plan(spec, p.B, p.T, p.H, None if p.cu_seqlens is None else p.cu_seqlens.to(dev), dev)
        return dict(form="flashkda", chunk_size=fw.C, chunks_per_seg=plan.cps,
                    passes=["K1", "A", "B", "C"] if plan.segmented else ["K1", "C"])

    def run_pass(self, problem: Problem, route, pass_name: str, feed: Optional[dict] = None) -> dict:
        """One pass alone (see the module docstring); returns its outputs by the oracle's names."""
        if str(pass_name).upper() not in PASSES:
            raise ValueError(f"pass_name: expected one of {'|'.join(PASSES)}, got {pass_name!r}")
        pass_name = str(pass_name).upper()
        p = problem
        feed = feed or {}
        dev = self._device(p)
        spec = self._spec(p, route)
        kw = self._kernel_inputs(p, dev)
        H = p.H
        plan = fw.resolve_plan(spec, p.B, p.T, H, None if p.cu_seqlens is None else p.cu_seqlens.to(dev), dev)

        def need(*names):
            missing = [n for n in names if n not in feed]
            if missing:
                raise ValueError(f"feed: pass {pass_name} needs {', '.join(missing)}, got {sorted(feed)}")

        def ws_from_feed():
            need(*fw.WORKSPACE_DTYPES)
            return {n: feed[n].to(device=dev, dtype=dt).contiguous() for n, dt in fw.WORKSPACE_DTYPES.items()}

        def h0_ref():
            if p.paged:
                return fw.paged_state(p.state_cache.to(dev), p.state_indices.to(dev), p.has_initial_state.to(dev))
            if p.initial_state is not None:
                return fw.dense_state(p.initial_state.to(dev), p.state_layout)
            return None

        if pass_name == "K1":
            ws = fw.alloc_workspace(H, plan.total_tiles, dev)
            fw.run_k1(kw["q"], kw["k"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], kw["scale"],
                      kw["lower_bound"], plan, ws, inv=spec.inv, k1=spec.k1)
            return ws
        if pass_name in ("A", "B") and not plan.segmented:
            raise ValueError(f"route {spec.name!r}: pass {pass_name} needs a segmented route (seg:cps=N)")
        if pass_name == "A":
            A_seg, b_seg = fw.run_pass_a(ws_from_feed(), kw["v"], plan, H, spec.pass_a, spec.bw, spec.warps,
                                         spec.scan)
            return {"A_seg": A_seg, "b_seg": b_seg}
        if pass_name == "B":
            need("A_seg", "b_seg")
            A_seg = feed["A_seg"].to(device=dev, dtype=fw.A_SEG_DTYPE[spec.scan]).contiguous()
            b_seg = feed["b_seg"].to(device=dev, dtype=torch.float32).contiguous()
            return {"h_in": fw.run_pass_b(A_seg, b_seg, plan, H, h0_ref(), spec.pass_b == "prefetch", fw.SCAN_BW,
                                          spec.warps, spec.scan)}
        ws = ws_from_feed()
        o = torch.empty(p.B * p.T, H, p.V, dtype=torch.bfloat16, device=dev)
        o4 = o.view(p.B, p.T, H, p.V)
        if p.paged:     # the final states go through the paged store, into a copy of the cache
            cache = copy_with_padding(p.state_cache.to(dev))
            idx = p.state_indices.to(dev)
            final_ref = fw.paged_state(cache, idx, p.has_initial_state.to(dev))
        else:
            final = torch.empty(plan.N, H, p.K, p.V, dtype=torch.float32, device=dev)
            final_ref = fw.dense_state(final, "kv")
        if plan.segmented:
            need("h_in")
            h_in = feed["h_in"].to(device=dev, dtype=torch.float32).contiguous()
            fw.run_pass_c(ws, kw["v"], o4, plan, H, h_in=h_in, final=final_ref, bw=spec.bw, warps=spec.warps)
        else:
            fw.run_pass_c(ws, kw["v"], o4, plan, H, h0=h0_ref(), final=final_ref, bw=spec.bw, warps=spec.warps)
        if p.paged:     # slot state_indices[n] holds sequence n's final state, V-first: back to [N, H, K, V]
            final = cache[idx.long()].transpose(-1, -2)
        return {"o": o, "final_state": final}
