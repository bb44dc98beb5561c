"""Adapter: flash-linear-attention's KDA (fla-core 0.6.0 API), Triton path.

Routes (all forward, inference mode, ``FLA_FLASH_KDA=0`` so fla's own Triton kernels run
and not the CUTLASS FlashKDA backend that fla would otherwise dispatch to):

    chunk:safe_gate          chunk_kda(chunk_size=64, safe_gate=True)
    chunk:exact              chunk_kda(chunk_size=64, safe_gate=False)
    chunk:safe_gate:C=32     chunk_kda(chunk_size=32, safe_gate=True)
    chunk:exact:C=32         chunk_kda(chunk_size=32, safe_gate=False)
    fused_recurrent          fused_recurrent_kda (token loop, fp32)

Trace routes (kda_kernels.base.RunsTraces; docs/backends.md "Trace routes"):

    chunk:safe_gate, chunk:exact   prefill calls: chunk_kda (C = 64) as vLLM calls it for a paged
                                   cache: the engine gathers each row's initial state from its slot
                                   (zero where has_initial_state is false; fp32, the cache's layout
                                   as state_v_first), runs chunk_kda(output_final_state=True) and
                                   scatters the final states back rounded to the cache dtype; the
                                   gather and scatter are the engine's code, not the kernel's.
    fused_recurrent                decode and spec calls: fused_recurrent_kda_fwd, the entry a serving
                                   engine calls (fla 0.6.0's public fused_recurrent_kda passes
                                   neither ssm_state_indices nor num_accepted_tokens), on the cache
                                   view itself: ssm_state_indices [N] (decode) or [N, W] (spec, with
                                   num_accepted_tokens), inplace_final_state=True, state_v_first
                                   from the cache layout; recipe fla-recurrent.

What fused_recurrent_kda_fwd takes (fla-core 0.6.0 fla/ops/kda/fused_recurrent.py, read): the
state in either layout (STATE_V_FIRST) and any float dtype (loaded as fp32, stored as the cache's
dtype: a bf16 cache is rounded after every token); slots ``initial_state.stride(0)`` apart with
dense [HV, ., .] slabs; no has_initial_state (every row reads its slot) and no pad-slot check:
the slot index is used as it comes, so a padding row's -1 reads and writes one slot stride before
slot 0 and a NULL-block 0 reads and writes slot 0.  A row of T tokens with a [N, W] table writes
the state after token t to ``ssm_state_indices[n, t]``, reading ``[n, num_accepted_tokens[n]-1]``.
Raw gate (use_gate_in_kernel; lower_bound * sigmoid(exp(A_log) (g + dt_bias)) or, without
lower_bound, -exp(A_log) softplus(g + dt_bias): with A_log None the latter is -e * softplus, so a
softplus trace without A_log is refused), beta sigmoid / 2 sigmoid / as given, the q/k l2norm
(eps 1e-6 in the root, as the oracle's).

Problem -> call mapping: gate lower_bound -> use_gate_in_kernel + lower_bound (+A_log,
dt_bias as keywords); softplus -> use_gate_in_kernel with lower_bound None; pregated -> g
as given.  beta sigmoid -> use_beta_sigmoid_in_kernel; sigmoid2 -> + allow_neg_eigval.
qk_l2norm -> use_qk_l2norm_in_kernel.  state kv / vk -> state_v_first False / True, the
initial state in fp32.  Paged caches are not part of chunk_kda's API: not applicable.
fla caches tensors derived from ``cu_seqlens`` keyed by object identity; every call gets
a fresh int64 copy so a reused, mutated tensor can never hit a stale entry.

No autotuning inside a verdict: fla's forward kernels are ``triton.autotune`` kernels (most
under a ``triton.heuristics`` wrapper) that benchmark every config for each new shape key
(85 s for the first chunk_kda call on an H200).  Every call here (``run``, ``run_pass``) pins
each autotuner in ``AUTOTUNED`` to one config of fla's own list by the rule of
``kda_kernels._autotune_pin`` (4 warps, fewest stages, smallest tiles) and restores the lists
afterwards; any other autotuner that fla launches with several configs raises instead of
benchmarking.  The configs that ran are in ``Outputs.info["pinned_configs"]`` (and in
``FlaBackend.last_pinned`` after ``run_pass``).  ``fused_recurrent_kda`` has no autotuner.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from typing import Optional

import torch

from kda_ref.preprocess import beta_activation, l2norm
from kda_ref.problem import Problem
from . import _autotune_pin
from .base import Outputs, Route, set_library_switch
from .trace_support import gather_states, has_padding_rows, problem_of_trace, scatter_states

CHUNK_ROUTES = {
    "chunk:safe_gate": dict(chunk_size=64, safe_gate=True),
    "chunk:exact": dict(chunk_size=64, safe_gate=False),
    "chunk:safe_gate:C=32": dict(chunk_size=32, safe_gate=True),
    "chunk:exact:C=32": dict(chunk_size=32, safe_gate=False),
}


# Every autotuned kernel that chunk_kda's forward can launch in fla-core 0.6.0 (read from its
# source; tests/test_fla_pinning.py checks it against what the adapter's calls launch):
#   name -> (module, attribute).  fused_recurrent_kda_fwd_kernel is plain @triton.jit.
AUTOTUNED = {
    "l2norm_fwd_kernel": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel"),              # q/k, K <= 512
    "l2norm_fwd_kernel_row": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel_row"),      # K > 512 (refused)
    "kda_gate_chunk_cumsum_vector_kernel": ("fla.ops.kda.gate", "kda_gate_chunk_cumsum_vector_kernel"),
    "chunk_local_cumsum_vector_kernel": ("fla.ops.utils.cumsum", "chunk_local_cumsum_vector_kernel"),
    "chunk_kda_fwd_kernel_intra_sub_chunk": ("fla.ops.kda.chunk_intra", "chunk_kda_fwd_kernel_intra_sub_chunk"),
    "chunk_kda_fwd_kernel_intra_token_parallel": ("fla.ops.kda.chunk_intra_token_parallel",
                                                  "chunk_kda_fwd_kernel_intra_token_parallel"),
    "chunk_kda_fwd_kernel_inter_solve_fused": ("fla.ops.kda.chunk_intra", "chunk_kda_fwd_kernel_inter_solve_fused"),
    "recompute_w_u_fwd_kda_kernel": ("fla.ops.kda.wy_fast", "recompute_w_u_fwd_kda_kernel"),
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": ("fla.ops.common.chunk_delta_h",
                                                       "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"),
    "chunk_gla_fwd_kernel_o": ("fla.ops.gla.chunk", "chunk_gla_fwd_kernel_o"),
}


def autotuned_kernels() -> dict:
    """AUTOTUNED resolved to fla's kernel objects (fla imported); a missing one is named."""
    _import_fla()
    out = {}
    for name, (module, attr) in AUTOTUNED.items():
        kernel = getattr(importlib.import_module(module), attr, None)
        if kernel is None:
            raise RuntimeError(f"fla-core layout changed: {module} has no {attr} (this adapter follows fla-core 0.6.0)")
        out[name] = kernel
    return out


def pinned_autotuners(context: str = "fla"):
    """Context manager: every fla autotuner in AUTOTUNED pinned to one config (see the module
    docstring); yields the record of what was pinned and launched."""
    return _autotune_pin.pinned(autotuned_kernels(), context=context)


def launched_configs(record: dict) -> dict:
    """kernel -> pinned config, for the kernels that launched (the provenance of one call)."""
    return {name: r["config"] for name, r in record.items() if r["launches"]}


def _import_fla():
    """Import fla's KDA ops with its FlashKDA dispatch switched off (before the import)."""
    set_library_switch("fla")
    with warnings.catch_warnings():  # fla warns at import on a machine without a GPU; available() says so
        warnings.simplefilter("ignore")
        # lazy: optional dependency (docs/design.md, Imports)
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    return chunk_kda, fused_recurrent_kda


def call_arguments(p: Problem, route: Route) -> tuple[str, dict]:
    """The fla function name and keyword arguments for one route on one Problem
    (pure: no fla import, so the mapping is testable anywhere)."""
    kw: dict = dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, scale=p.scale_value,
                    output_final_state=bool(p.output_final_state),
                    use_qk_l2norm_in_kernel=bool(p.qk_l2norm),
                    use_beta_sigmoid_in_kernel=p.beta_kind in ("sigmoid", "sigmoid2"),
                    allow_neg_eigval=p.beta_kind == "sigmoid2",
                    state_v_first=p.state_layout == "vk")
    if p.gate in ("lower_bound", "softplus"):
        kw.update(use_gate_in_kernel=True, A_log=p.A_log, dt_bias=None if p.dt_bias is None else p.dt_bias.reshape(-1),
                  lower_bound=float(p.lower_bound) if p.gate == "lower_bound" else None)
    else:
        kw.update(use_gate_in_kernel=False)
    if p.initial_state is not None:
        kw["initial_state"] = p.initial_state.to(torch.float32).contiguous()
    if p.cu_seqlens is not None:
        kw["cu_seqlens"] = p.cu_seqlens.to(device=p.device, dtype=torch.int64).clone()
    if route.name == "fused_recurrent":
        return "fused_recurrent_kda", kw
    kw.update(CHUNK_ROUTES[route.name])
    return "chunk_kda", kw


FLA_PASSES = ("gate", "intra", "h", "o")


def _fla_internals():
    """fla's forward stages (the functions chunk_kda_fwd chains), imported lazily."""
    _import_fla()
    # lazy: optional dependency (docs/design.md, Imports)
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    return dict(gate=kda_gate_chunk_cumsum, cumsum=chunk_local_cumsum, intra=chunk_kda_fwd_intra,
                h=chunk_gated_delta_rule_fwd_h, o=chunk_gla_fwd_o_gk, RCP_LN2=RCP_LN2)


class FlaBackend:
    name = "fla"

    def __init__(self):
        self._ops = None
        self._why = None
        self.last_pinned: dict = {}   # kernel -> config pinned in the last run / run_pass that launched it

    def _load(self):
        if self._ops is None and self._why is None:
            try:
                self._ops = dict(zip(("chunk_kda", "fused_recurrent_kda"), _import_fla()))
            except Exception as e:  # ImportError, or fla's own platform checks
                self._why = f"fla-core is not importable: {type(e).__name__}: {e}"
        return self._ops

    def available(self) -> tuple[bool, str]:
        self._load()
        if self._why:
            return False, self._why
        if not torch.cuda.is_available():
            return False, "fla's Triton kernels need a GPU (no CUDA device here)"
        return True, ""

    def version(self) -> str:
        try:
            # lazy: optional dependency (docs/design.md, Imports)
            import fla
            return f"fla-core {fla.__version__}"
        except Exception:
            return "not installed"

    def routes(self) -> list[Route]:
        out = [Route(name, recipe="fla", flags=tuple(sorted(kw.items())),
                     description=f"chunk_kda {kw}") for name, kw in CHUNK_ROUTES.items()]
        out.append(Route("fused_recurrent", recipe="fla", description="fused_recurrent_kda (fp32 token loop)"))
        return out

    def accepts(self, p: Problem, route: Route) -> tuple[bool, str]:
        if route.name not in CHUNK_ROUTES and route.name != "fused_recurrent":
            return False, f"not applicable: unknown fla route {route.name!r}"
        if p.paged:
            return False, "not applicable: fla's chunk_kda / fused_recurrent_kda have no paged state cache"
        if p.K > 256:
            return False, f"not applicable: fla asserts K <= 256, got K={p.K}"
        safe = dict(CHUNK_ROUTES.get(route.name, {})).get("safe_gate", False)
        if safe:
            if p.gate == "softplus":
                return False, "not applicable: safe_gate needs the lower_bound gate (fla raises otherwise)"
            if p.gate == "lower_bound" and not (-5.0 <= float(p.lower_bound) < 0.0):
                return False, f"not applicable: safe_gate needs lower_bound in [-5, 0), got {p.lower_bound}"
            if p.gate == "pregated":
                lo = float(p.g.float().min()) if p.g.numel() else 0.0
                if lo < -5.0:
                    return False, f"not applicable: safe_gate needs a pre-gated g in [-5, 0], min is {lo:.3g}"
        if p.gate == "softplus" and p.A_log is None:
            return False, "not applicable: fla's softplus gate needs A_log"
        return True, ""

    @contextlib.contextmanager
    def _pinned(self, context: str):
        """fla's autotuners pinned for one call (pinned_autotuners); afterwards ``last_pinned``
        holds kernel -> config for the kernels that launched, also when the call raised."""
        self.last_pinned = {}
        record: dict = {}
        try:
            with pinned_autotuners(context) as record:
                yield
        finally:
            self.last_pinned = launched_configs(record)

    # ----- per-pass debugging (the stages of fla's chunk_kda_fwd) ------------------------------
    def debug_plan(self, p: Problem, route: Route) -> dict:
        if route.name not in CHUNK_ROUTES:
            raise ValueError(f"--route: {route.name!r} has no passes to debug (fla's chunk routes do)")
        return dict(form="fla", chunk_size=CHUNK_ROUTES[route.name]["chunk_size"], chunks_per_seg=None,
                    passes=list(FLA_PASSES))

    def run_pass(self, p: Problem, route: Route, name: str, feed: dict) -> dict:
        """One stage of fla's chunked forward on oracle-fed inputs (rounded as fla stores them:
        g_cumsum fp32, everything else in the input dtype), outputs by the oracle's names; fla's
        autotuners pinned as in ``run`` (the configs that launched: ``self.last_pinned``)."""
        fn = _fla_internals()
        kw = CHUNK_ROUTES[route.name]
        C, dt, dev = kw["chunk_size"], p.q.dtype, p.device
        cu = None if p.cu_seqlens is None else p.cu_seqlens.to(device=dev, dtype=torch.int64).clone()
        f32 = lambda n: feed[n].to(device=dev, dtype=torch.float32).contiguous()  # noqa: E731
        low = lambda n: feed[n].to(device=dev, dtype=dt).contiguous()             # noqa: E731
        with self._pinned(f"fla pass {name}"), torch.inference_mode():
            if name == "gate":
                if p.gate in ("lower_bound", "softplus"):
                    g = fn["gate"](g=p.g, A_log=p.A_log, chunk_size=C, scale=fn["RCP_LN2"],
                                   dt_bias=None if p.dt_bias is None else p.dt_bias.reshape(-1), cu_seqlens=cu,
                                   lower_bound=float(p.lower_bound) if p.gate == "lower_bound" else None)
                else:
                    g = fn["cumsum"](g=p.g, scale=fn["RCP_LN2"], chunk_size=C, cu_seqlens=cu)
                return {"g_cumsum": g}
            if name == "intra":
                q = (l2norm(p.q) if p.qk_l2norm else p.q).to(dt)
                k = (l2norm(p.k) if p.qk_l2norm else p.k).to(dt)
                beta = beta_activation(p.beta, p.beta_kind).to(torch.float32)
                w, u, _qg, kg, Aqk, Akk = fn["intra"](
                    q=q, k=k, v=p.v, gk=f32("g_cumsum"), beta=beta, scale=p.scale_value, cu_seqlens=cu,
                    chunk_size=C, safe_gate=kw["safe_gate"], disable_recompute=True,
                    **({"lower_bound": float(p.lower_bound)} if p.gate == "lower_bound" else {}))
                return {"Aqk": Aqk, "Akk": Akk, "w": w, "u": u, "kg": kg}
            if name == "h":
                h0 = None
                if p.initial_state is not None:
                    h0 = p.initial_state.to(torch.float32)
                    h0 = (h0 if p.state_layout == "kv" else h0.transpose(-1, -2)).contiguous()
                h, v_new, final = fn["h"](k=low("kg"), w=low("w"), u=low("u"), gk=f32("g_cumsum"), initial_state=h0,
                                          output_final_state=True, chunk_size=C, cu_seqlens=cu)
                return {"h": h, "v_new": v_new, "final_state": final}
            if name == "o":
                q = (l2norm(p.q) if p.qk_l2norm else p.q).to(dt)
                o = fn["o"](q=q, v=low("v_new"), g=f32("g_cumsum"), A=low("Aqk"), h=low("h"), scale=p.scale_value,
                            cu_seqlens=cu, chunk_size=C)
                return {"o": o}
        raise ValueError(f"--pass: expected {'|'.join(FLA_PASSES)}, got {name!r}")

    def run(self, p: Problem, route: Route, out: Optional[torch.Tensor] = None) -> Outputs:
        ops = self._load()
        if ops is None:
            raise RuntimeError(self._why)
        fn_name, kw = call_arguments(p, route)
        with self._pinned(f"fla route {route.name}"), torch.inference_mode():
            o, final = ops[fn_name](**kw)
        ran = f"fla.{fn_name}" + (f"(chunk_size={kw['chunk_size']}, safe_gate={kw['safe_gate']})"
                                  if fn_name == "chunk_kda" else "")
        if self.last_pinned:
            ran += f"; {len(self.last_pinned)} autotuned kernels pinned (pinned_configs)"
        info = {"route_ran": ran, "pinned_configs": dict(self.last_pinned)}
        return Outputs(o=o, final_state=final if p.output_final_state else None, info=info)

    # ----- serving-trace calls (kda_kernels.base.RunsTraces) ------------------------------------
    TRACE_CHUNK_ROUTES = ("chunk:safe_gate", "chunk:exact")

    def trace_routes(self) -> list[Route]:
        out = [Route(name, recipe="fla", flags=(("groups", ("prefill",)),) + tuple(sorted(CHUNK_ROUTES[name].items())),
                     description=f"prefill: chunk_kda {CHUNK_ROUTES[name]} on states the engine gathers from the "
                                 "cache and scatters back (the gather/scatter is the engine's, vLLM's, not the "
                                 "kernel's)") for name in self.TRACE_CHUNK_ROUTES]
        out.append(Route("fused_recurrent", recipe="fla-recurrent", flags=(("groups", ("decode", "spec")),),
                         description="decode and spec: fused_recurrent_kda_fwd on the cache view in place "
                                     "(ssm_state_indices, num_accepted_tokens, inplace_final_state)"))
        return out

    def trace_accepts(self, trace, route: Route) -> tuple[bool, str]:
        p = problem_of_trace(trace)
        if route.name in self.TRACE_CHUNK_ROUTES:
            return self.accepts(p, Route(route.name, recipe="fla"))
        if route.name != "fused_recurrent":
            return False, f"not applicable: unknown fla trace route {route.name!r}"
        if p.gate == "softplus" and p.A_log is None:
            return False, ("not applicable: fused_recurrent_kda_fwd's softplus gate without A_log is "
                           "-exp(1) * softplus(g + dt_bias) (HAS_A false loads 1.0 and exponentiates it)")
        c = trace.cache
        if c.pad == "minus1" and has_padding_rows(trace) and c.offset < c.stride:
            return False, (f"not applicable: fused_recurrent_kda_fwd has no pad-slot check: a padding row's "
                           f"index -1 reads and writes the {c.slot_numel} elements one slot stride ({c.stride}) "
                           f"before slot 0, outside this cache's buffer (guard {c.offset} elements before "
                           f"slot 0); a trace whose guard covers one slot shows the write")
        return True, ""

    def run_call(self, call, route: Route) -> torch.Tensor:
        if route.name in self.TRACE_CHUNK_ROUTES:
            return self._run_chunk_call(call, route)
        if route.name != "fused_recurrent":
            raise ValueError(f"--route: expected one of {', '.join(r.name for r in self.trace_routes())}, "
                             f"got {route.name!r}")
        self._load()
        if self._ops is None:
            raise RuntimeError(self._why)
        # lazy: optional dependency (docs/design.md, Imports)
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        kw = recurrent_call_arguments(call)
        with self._pinned(f"fla trace route {route.name}"), torch.inference_mode():
            o, _ = fused_recurrent_kda_fwd(**kw)
        return o

    def _run_chunk_call(self, call, route: Route) -> torch.Tensor:
        """chunk_kda on a prefill call, with the engine's gather and scatter around it."""
        ops = self._load()
        if ops is None:
            raise RuntimeError(self._why)
        m = call.model
        p = Problem(q=call.q, k=call.k, v=call.v, g=call.g, beta=call.beta, A_log=m["A_log"], dt_bias=m["dt_bias"],
                    scale=m["scale"], lower_bound=m["lower_bound"], gate=m["gate"], beta_kind=m["beta_kind"],
                    qk_l2norm=m["qk_l2norm"], cu_seqlens=call.cu_seqlens, initial_state=gather_states(call),
                    state_layout=call.spec.layout, output_final_state=True)
        fn_name, kw = call_arguments(p, Route(route.name, recipe="fla"))
        with self._pinned(f"fla trace route {route.name}"), torch.inference_mode():
            o, final = ops[fn_name](**kw)
        scatter_states(call, final)
        return o


def recurrent_call_arguments(call) -> dict:
    """Keyword arguments of fla's fused_recurrent_kda_fwd for a decode or spec PhaseCall (pure:
    no fla import): the cache's [slots, HV, ., .] view as initial_state, written in place."""
    m = call.model
    gate_in = m["gate"] in ("lower_bound", "softplus")
    kw = dict(q=call.q, k=call.k, v=call.v, g=call.g, beta=call.beta, scale=m["scale"],
              initial_state=call.slots_view(), output_final_state=False, inplace_final_state=True,
              state_v_first=call.spec.layout == "vk", cu_seqlens=call.cu_seqlens.to(torch.int64).clone(),
              ssm_state_indices=call.state_indices, num_accepted_tokens=call.num_accepted_tokens,
              use_qk_l2norm_in_kernel=bool(m["qk_l2norm"]), use_gate_in_kernel=gate_in,
              use_beta_sigmoid_in_kernel=m["beta_kind"] in ("sigmoid", "sigmoid2"),
              allow_neg_eigval=m["beta_kind"] == "sigmoid2")
    if gate_in:
        kw.update(A_log=m["A_log"], dt_bias=None if m["dt_bias"] is None else m["dt_bias"].reshape(-1),
                  lower_bound=float(m["lower_bound"]) if m["gate"] == "lower_bound" else None)
    return kw
