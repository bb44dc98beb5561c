"""Adapter: the cuDNN frontend's KDA operation (nvidia-cudnn-frontend 1.32.0), its sm90 engines.

Call (``cudnn/linear_attention/ops/kda.py``)::

    cudnn.linear_attention.kimi_delta_attention(q, k, v, g, beta, cu_seqlens, scale=None,
        initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        batch_invariant=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
        safe_gate=False, gate_lower_bound=None, gate_domain="log", a_log=None, dt_bias=None,
        ..., plan_name=None, state_indices=None) -> (o, final_state)

Its contract, as that function and the sm90 engine's ``check_support``
(``hopper/cuda_engine.py``) state it:

    THD only: q, k [T_total, H, K], v [T_total, HV, V] bf16 (q/k/v must be bf16); HV a whole multiple
        of H (grouped value heads, forward only); K = V = 128 ("head dims must be 128")
    g [T_total, HO, K] (HO = max(H, HV)) fp32 / bf16 / fp16: log-space decay, or with safe_gate the raw
        logits of lower_bound * sigmoid(exp(a_log) (g + dt_bias)); a_log [HO], dt_bias [HO, K], both
        required by the sm90 engine under safe_gate ("safe_gate needs both a_log and dt_bias")
    beta [T_total, HO] fp32 or bf16: post-sigmoid, or logits with use_beta_sigmoid_in_kernel;
        allow_neg_eigval (2 sigmoid) declined ("needs beta in (0, 1); the seed-truncation bound assumes it")
    cu_seqlens [N+1] int32 / int64 (always given: a dense batch is cu_seqlens = [0, T, 2T, ...])
    initial_state / final_state [N, HO, V, K] (V-first) fp32 or bf16; the kernel carries the state in
        fp32 (a bf16 state is widened on the way in and rounded on the way out)
    state_indices (a pool-addressed, paged state): declined by the sm90 engine
    any scale (the forward takes it as an argument)

Engines (``plan_name``): ``kda_hopper_cuda`` (CUDA C++ compiled with NVRTC at the first call, needs
cuda-bindings and a CUDA include tree) and ``kda_hopper`` (CuTe DSL, needs nvidia-cutlass-dsl).  On
sm90 the frontend ranks kda_hopper_cuda first; a route pins its engine by plan_name, so a decline is
an error, never a silent fall-through to another engine.

Routes: ``hopper_cuda`` (batch_invariant off, the frontend's default), ``hopper_cuda:batch_invariant``
(batch_invariant=True: the engine does not read the flag, so the route exists to test the promise),
``hopper_dsl`` (refused here: see DSL_REASON).  Recipe ``cudnn-sm90`` (kda_kernels/emulator.py,
REFERENCE_RECIPES, with the kernel lines it follows).

What the adapter converts, and nothing else: [B, T] -> THD (B = 1 with cu_seqlens, else B sequences
of T), cu_seqlens to int32 (exact); a K-first ("kv") problem state transposed to V-first and fp32
(and the final state back); A_log, dt_bias to fp32 (zeros where the problem has none; exact); beta
widened to fp32 (exact).  The gate: lower_bound -> safe_gate with gate_lower_bound; pregated ->
log-space g as given; softplus has no cuDNN form and is refused.  beta: sigmoid -> logits with
use_beta_sigmoid_in_kernel; pregated -> post-sigmoid beta; sigmoid2 refused (allow_neg_eigval).
"""
from __future__ import annotations

import importlib.metadata as md

import torch

from kda_ref.problem import Problem
from .base import Outputs, Route

D = 128
WHEEL = "nvidia-cudnn-frontend 1.32.0"
RECIPE = "cudnn-sm90"
ENGINES = {"hopper_cuda": "kda_hopper_cuda", "hopper_dsl": "kda_hopper"}
DSL_REASON = ("not applicable: cuDNN's kda_hopper engine is CuTe DSL and needs nvidia-cutlass-dsl[cu13] (a 92 MB "
              "wheel, over what one device call carries), and no emulator recipe has been read from its kernel "
              "(hopper/kernel/kda_prefill_sm90.py); this suite runs the NVRTC engine kda_hopper_cuda")
INSTALL_HINT = ("install nvidia-cudnn-frontend (1.32.0 has the sm90 KDA engines) with apache-tvm-ffi and "
                "cuda-bindings, e.g. pip install --no-deps from .whl/cudnn (docs/backends.md, cuDNN frontend)")


def _dname(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dt, str(dt).replace("torch.", ""))


def call_arguments(p: Problem, route: Route) -> tuple[dict, list]:
    """The keyword arguments of kimi_delta_attention for ``p`` on ``route``, and the conversions
    made beyond exact widenings (layouts)."""
    f32 = torch.float32
    N, H, HV, T = p.N, p.H, p.HV, p.B * p.T
    conv = []
    flat = lambda t: t.reshape((T,) + tuple(t.shape[2:]))   # noqa: E731 - [B, T, ...] -> [B*T, ...] (a view where it can)
    if p.cu_seqlens is not None:
        cu = p.cu_seqlens.to(device=p.device, dtype=torch.int32)
    else:
        cu = torch.arange(p.B + 1, device=p.device, dtype=torch.int32) * p.T
        if p.B > 1:
            conv.append(f"batch of {p.B} -> THD with cu_seqlens [0, {p.T}, ...]")
    kw = dict(q=flat(p.q), k=flat(p.k), v=flat(p.v), g=flat(p.g), beta=flat(p.beta).to(f32), cu_seqlens=cu,
              scale=p.scale_value, output_final_state=bool(p.output_final_state),
              use_qk_l2norm_in_kernel=bool(p.qk_l2norm), use_beta_sigmoid_in_kernel=p.beta_kind == "sigmoid",
              batch_invariant=bool(route.flag("batch_invariant", False)), plan_name=ENGINES[route.flag("engine")])
    if p.gate == "lower_bound":
        kw.update(safe_gate=True, gate_lower_bound=float(p.lower_bound), a_log=p.A_log.reshape(HV).to(f32),
                  dt_bias=(torch.zeros(HV, p.K, dtype=f32, device=p.device) if p.dt_bias is None
                           else p.dt_bias.reshape(HV, p.K).to(f32)))
    if p.initial_state is not None:
        s = p.initial_state
        if p.state_layout == "kv":
            s = s.transpose(-1, -2)
            conv.append("initial_state K-first -> V-first")
        if s.dtype != f32:
            conv.append(f"initial_state {_dname(s.dtype)} -> fp32")
        kw["initial_state"] = s.to(f32).contiguous()
    if p.output_final_state and p.state_layout == "kv":
        conv.append("final_state V-first -> K-first")
    return kw, conv


class CudnnBackend:
    name = "cudnn"

    def __init__(self):
        self._fn, self._why = None, None

    def _load(self):
        if self._fn is None and self._why is None:
            try:
                # lazy: optional dependency (docs/design.md, Imports)
                import cudnn
                from cudnn.linear_attention import kimi_delta_attention
                self._cudnn, self._fn = cudnn, kimi_delta_attention
            except Exception as e:  # noqa: BLE001 - any import failure is the reason it cannot run
                self._why = f"cuDNN frontend's KDA is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"
        return self._fn

    def available(self) -> tuple[bool, str]:
        if self._load() is None:
            return False, self._why
        if not torch.cuda.is_available():
            return False, "cuDNN's sm90 KDA engines need an NVIDIA GPU of SM90 exactly; torch sees no CUDA device"
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return False, (f"cuDNN's KDA engines kda_hopper_cuda / kda_hopper require SM90 (their check_support), "
                           f"got SM{cap[0]}{cap[1]}")
        return True, ""

    def version(self) -> str:
        try:
            v = md.version("nvidia-cudnn-frontend")
        except md.PackageNotFoundError:
            return "nvidia-cudnn-frontend not installed"
        backend = ""
        if self._load() is not None:
            try:
                backend = f", cuDNN backend {self._cudnn.backend_version()}"
            except Exception:  # noqa: BLE001 - the frontend's engines are Python; the backend may be absent
                backend = ""
        return f"nvidia-cudnn-frontend {v} (recipe {RECIPE}{backend})"

    def routes(self) -> list[Route]:
        return [
            Route("hopper_cuda", recipe=RECIPE, flags=(("engine", "hopper_cuda"),),
                  description="plan kda_hopper_cuda: the fused sm90 CUDA C++ kernel (NVRTC), batch_invariant off"),
            Route("hopper_cuda:batch_invariant", recipe=RECIPE,
                  flags=(("engine", "hopper_cuda"), ("batch_invariant", True)),
                  description="plan kda_hopper_cuda with batch_invariant=True (the engine does not read it)"),
            Route("hopper_dsl", recipe=RECIPE, flags=(("engine", "hopper_dsl"),),
                  description="plan kda_hopper: the CuTe DSL kernel (refused: nvidia-cutlass-dsl, no recipe)"),
        ]

    def accepts(self, p: Problem, route: Route) -> tuple[bool, str]:
        if route.flag("engine") == "hopper_dsl":
            return False, DSL_REASON
        if p.K != D or p.V != D:
            return False, f"not applicable: cuDNN's kda_hopper_cuda: 'head dims must be 128, got K={p.K} V={p.V}'"
        if p.HV % p.H:
            return False, (f"not applicable: cuDNN's kda_hopper_cuda: 'value heads must be a whole multiple of query "
                           f"heads (got {p.H}/{p.HV})'")
        for name in ("q", "k", "v"):
            t = getattr(p, name)
            if t.dtype != torch.bfloat16:
                return False, f"not applicable: cuDNN's kda_hopper_cuda: 'q/k/v must be bf16', got {name} {_dname(t.dtype)}"
        if p.gate == "softplus":
            return False, ("not applicable: cuDNN's KDA takes a log-space g or the safe gate lower_bound * "
                           "sigmoid(exp(a_log) (g + dt_bias)); it has no softplus gate, got gate=softplus")
        if p.gate == "lower_bound" and p.A_log is None:
            return False, "not applicable: cuDNN's kda_hopper_cuda: 'safe_gate needs both a_log and dt_bias', got no A_log"
        if p.beta_kind == "sigmoid2":
            return False, ("not applicable: cuDNN's kda_hopper_cuda: 'allow_neg_eigval needs beta in (0, 1); the "
                           "seed-truncation bound assumes it', got beta=sigmoid2")
        if p.paged:
            return False, ("not applicable: cuDNN's kda_hopper_cuda: 'state_indices (pool-addressed state) is "
                           "unsupported' (a paged cache)")
        if p.g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"not applicable: cuDNN's KDA: g must be fp32, bf16 or fp16, got {_dname(p.g.dtype)}"
        return True, ""

    def run(self, p: Problem, route: Route) -> Outputs:
        fn = self._load()
        if fn is None:
            raise RuntimeError(self._why)
        kw, conv = call_arguments(p, route)
        with torch.inference_mode():
            o, fs = fn(**kw)
        o = o.reshape(p.B, p.T, p.HV, p.V)
        if p.output_final_state:
            fs = fs.transpose(-1, -2).contiguous() if p.state_layout == "kv" else fs
        else:
            fs = None
        info = {"route_ran": (f"cudnn.linear_attention.kimi_delta_attention plan_name={kw['plan_name']} "
                              f"(batch_invariant={kw['batch_invariant']}, safe_gate={kw.get('safe_gate', False)}, "
                              f"beta_sigmoid={kw['use_beta_sigmoid_in_kernel']}, l2norm={kw['use_qk_l2norm_in_kernel']})"),
                "converted": conv}
        return Outputs(o=o, final_state=fs, info=info)
