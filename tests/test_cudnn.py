"""The cudnn adapter (the cuDNN frontend's KDA, its sm90 engine kda_hopper_cuda): routes, refusals, runs.

On a CPU, cudnn is replaced by a stand-in package whose ``linear_attention.kimi_delta_attention``
makes the checks of cudnn/linear_attention/ops/kda.py (run_kda_fwd) and of the engine's
check_support (hopper/cuda_engine.py) that the adapter relies on, and computes the cudnn-sm90
recipe of the emulator from the THD arguments it was handed (V-first states, cu_seqlens, the safe
gate's parameters), so the adapter's mapping is checked end to end through run_cell.  The tests
marked ``gpu`` need nvidia-cudnn-frontend on an SM90 GPU.
"""
import json
import sys
import types

import pytest
import torch

from kda_kernels import cudnn as cd
from kda_kernels.emulator import REFERENCE_RECIPES, emulate
from kda_ref.problem import Problem
from verification.running.cases import get_case
from verification.cli import main
from verification.judging.baselines import BaselineCache
from verification.running.run_cell import TruthCache, run_cell
from verification.judging.tolerances import load_tolerances

BF = torch.bfloat16


def _check(cond, msg):
    if not cond:
        raise ValueError(msg)


def fake_kda(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, batch_invariant=False, use_beta_sigmoid_in_kernel=False,
             allow_neg_eigval=False, safe_gate=False, gate_lower_bound=None, gate_domain="log", a_log=None,
             dt_bias=None, plan_name=None, **_):
    """kimi_delta_attention's checks, then the cudnn-sm90 recipe on what it was given."""
    _check(q.dim() == 3, "expected THD [total_tokens, heads, dim] tensors")
    _check(cu_seqlens.dtype in (torch.int32, torch.int64), "cu_seqlens must be int32 or int64")
    _check(plan_name in ("kda_hopper_cuda", "kda_hopper"), f"no {plan_name} plan for this graph")
    _check(all(t.dtype == BF for t in (q, k, v)), "KdaHopperCudaEngine: q/k/v must be bf16")
    _check(q.shape[-1] == 128 and v.shape[-1] == 128, "KdaHopperCudaEngine: head dims must be 128")
    _check(g.dtype in (torch.float32, BF, torch.float16) and beta.dtype in (torch.float32, BF), "g/beta dtype")
    _check(not safe_gate or (a_log is not None and dt_bias is not None), "safe_gate needs both a_log and dt_bias")
    _check(safe_gate or (a_log is None and dt_bias is None), "a_log/dt_bias require safe_gate=True")
    _check(not allow_neg_eigval, "allow_neg_eigval needs beta in (0, 1)")
    N, HO = cu_seqlens.numel() - 1, max(q.shape[1], v.shape[1])
    _check(initial_state is None or (initial_state.dtype == torch.float32
                                     and tuple(initial_state.shape) == (N, HO, 128, 128)), "initial_state")
    p = Problem(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], A_log=a_log,
                dt_bias=None if dt_bias is None else dt_bias.reshape(-1), scale=scale,
                lower_bound=gate_lower_bound if safe_gate else None, gate="lower_bound" if safe_gate else "pregated",
                beta_kind="sigmoid" if use_beta_sigmoid_in_kernel else "pregated",
                qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens.long(), initial_state=initial_state,
                state_layout="vk", output_final_state=True)
    res = emulate(p, "cudnn-sm90")
    fs = res.final_state if output_final_state else torch.empty(0)
    return res.o[0], fs


@pytest.fixture
def fake(monkeypatch):
    """cudnn replaced by the stand-in; the backend reports itself available on the CPU."""
    pkg = types.ModuleType("cudnn")
    la = types.ModuleType("cudnn.linear_attention")
    pkg.calls = []

    def kda(*a, **kw):
        pkg.calls.append(kw)
        return fake_kda(*a, **kw)
    la.kimi_delta_attention = kda
    pkg.linear_attention = la
    pkg.backend_version = lambda: 92000
    monkeypatch.setitem(sys.modules, "cudnn", pkg)
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", la)
    monkeypatch.setattr(cd.CudnnBackend, "available", lambda self: (True, ""))
    return pkg


def _route(name="hopper_cuda"):
    return next(r for r in cd.CudnnBackend().routes() if r.name == name)


# ---------------------------------------------------------------------------- routes, refusals
def test_routes_pin_an_engine_each_and_are_judged_with_the_cudnn_recipe():
    routes = cd.CudnnBackend().routes()
    assert [r.name for r in routes] == ["hopper_cuda", "hopper_cuda:batch_invariant", "hopper_dsl"]
    assert {r.recipe for r in routes} == {"cudnn-sm90"} and "cudnn-sm90" in REFERENCE_RECIPES
    assert [cd.ENGINES[r.flag("engine")] for r in routes] == ["kda_hopper_cuda", "kda_hopper_cuda", "kda_hopper"]


def test_the_dsl_route_is_refused_with_its_reason():
    ok, why = cd.CudnnBackend().accepts(get_case("smoke/dense-T64-lb-5").build(), _route("hopper_dsl"))
    assert not ok and why == cd.DSL_REASON and "nvidia-cutlass-dsl" in why and "92 MB" in why


REFUSALS = [
    ("K=64", lambda p: p.replace(q=p.q[..., :64].contiguous(), k=p.k[..., :64].contiguous(),
                                 g=p.g[..., :64].contiguous(), dt_bias=None, initial_state=None),
     "'head dims must be 128, got K=64 V=128'"),
    ("fp32-q", lambda p: p.replace(q=p.q.float()), "'q/k/v must be bf16', got q fp32"),
    ("softplus", lambda p: p.replace(gate="softplus", lower_bound=None), "no softplus gate, got gate=softplus"),
    ("sigmoid2", lambda p: p.replace(beta_kind="sigmoid2"), "'allow_neg_eigval needs beta in (0, 1)"),
]


@pytest.mark.parametrize("name,change,words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_are_not_applicable_in_cudnns_own_terms(name, change, words):
    p = change(get_case("stress/weak-gate-lb-0.1").build())
    ok, why = cd.CudnnBackend().accepts(p, _route())
    assert not ok and why.startswith("not applicable: ") and words in why, why


def test_a_paged_problem_is_not_applicable():
    ok, why = cd.CudnnBackend().accepts(get_case("smoke/paged-lb-5").build(), _route())
    assert not ok and "state_indices (pool-addressed state) is unsupported" in why


def test_grouped_value_heads_and_pregated_inputs_are_accepted():
    p = get_case("stress/weak-gate-lb-0.1").build()
    gva = p.replace(q=p.q[:, :, :1].contiguous(), k=p.k[:, :, :1].contiguous())
    assert gva.HV % gva.H == 0 and cd.CudnnBackend().accepts(gva, _route()) == (True, "")


# ---------------------------------------------------------------------------- runs (stand-in kernel)
RUNS = ["smoke/dense-T64-lb-5", "smoke/varlen-tail33-lb-5", "smoke/initial-state-kv-lb-5",
        "smoke/weak-gate-lb-0.1-vk", "stress/empty-seq-middle"]


@pytest.mark.parametrize("case_id", RUNS)
def test_run_hands_cudnn_thd_and_its_layouts_and_returns_the_problems(fake, case_id, one_thread):
    p = get_case(case_id).build()
    out = cd.CudnnBackend().run(p, _route())
    kw = fake.calls[-1]
    assert kw["q"].shape == (p.B * p.T, p.H, 128) and kw["cu_seqlens"].dtype == torch.int32
    assert kw["cu_seqlens"].numel() == p.N + 1 and kw["plan_name"] == "kda_hopper_cuda"
    assert kw["safe_gate"] and kw["use_beta_sigmoid_in_kernel"] and kw["beta"].dtype == torch.float32
    if p.initial_state is not None:
        want = p.initial_state if p.state_layout == "vk" else p.initial_state.transpose(-1, -2)
        assert torch.equal(kw["initial_state"], want.float())
    ref = emulate(p, "cudnn-sm90")
    assert torch.equal(out.o, ref.o) and torch.equal(out.final_state, ref.final_state)
    assert out.info["route_ran"].startswith("cudnn.linear_attention.kimi_delta_attention plan_name=kda_hopper_cuda")


def test_a_batch_goes_in_as_thd_with_equal_segments(fake, one_thread):
    p = get_case("smoke/initial-state-kv-lb-5").build()          # B = 2
    out = cd.CudnnBackend().run(p, _route("hopper_cuda:batch_invariant"))
    kw = fake.calls[-1]
    assert kw["cu_seqlens"].tolist() == [0, p.T, 2 * p.T] and kw["batch_invariant"] is True
    assert out.final_state.shape == (2, 1, 128, 128)
    assert f"batch of 2 -> THD with cu_seqlens [0, {p.T}, ...]" in out.info["converted"]


def test_a_cell_passes_through_run_cell(fake, one_thread):
    rec = run_cell(cd.CudnnBackend(), _route(), get_case("smoke/initial-state-kv-lb-5"), TruthCache(device="cpu"),
                   BaselineCache(), load_tolerances(), "cpu")
    assert rec.status == "pass", rec.reason


# ---------------------------------------------------------------------------- this machine
def test_backends_json_says_in_one_line_why_cudnn_cannot_run_here(capsys):
    try:
        import cudnn  # noqa: F401
        pytest.skip("cudnn is importable here: the reason is the CPU-only machine's")
    except ImportError:
        pass
    assert main(["backends", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "cudnn")
    assert row["routes"] == ["hopper_cuda", "hopper_cuda:batch_invariant", "hopper_dsl"]
    assert row["available"] is False and "\n" not in row["reason"]
    assert row["reason"].startswith("cuDNN frontend's KDA is not importable (ModuleNotFoundError: ")


# ---------------------------------------------------------------------------- the real engine
def _real():
    ok, _ = cd.CudnnBackend().available()
    return ok


def gpu(f):
    """A test of the real engine: marked gpu (python -m pytest -m gpu tests/test_cudnn.py), skipped without
    nvidia-cudnn-frontend on an SM90 GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not _real(), reason="needs nvidia-cudnn-frontend on an SM90 GPU")(f))


INVARIANCE_SHAPES = {      # tests/test_invariance_gpu.py's, without the paged one (declined by the engine)
    "varlen": dict(lens=[1, 300, 33, 1100], H=4, state="kv"),
    "batch": dict(B=3, T=700, H=4, state="vk"),
    "one": dict(B=1, T=2048, H=8, state="kv"),
}


@gpu
@pytest.mark.parametrize("route", ["hopper_cuda", "hopper_cuda:batch_invariant"])
def test_gpu_invariances(route):
    """The invariances of verification/investigating/invariance.py, chunk size 16.  The kernel cuts each sequence into
    P = 264 // (N H) pieces (hopper/cuda_host.py), so a slice run alone is cut elsewhere: varlen and batch
    slices are not expected bitwise on hopper_cuda; batch_invariant=True promises them."""
    from verification.investigating import invariance as inv
    from kda_ref.problems import generate
    b, r = cd.CudnnBackend(), _route(route)
    pr = {n: generate(params, seed=seed, device="cuda") for seed, (n, params) in enumerate(INVARIANCE_SHAPES.items())}
    results = [inv.determinism(b, r, pr["one"], repeats=3),
               inv.varlen_slice(b, r, pr["varlen"]),
               inv.batch_slice(b, r, pr["batch"]),
               inv.causality(b, r, pr["varlen"]),
               inv.causality(b, r, pr["batch"], prefix=256),
               inv.head_permutation(b, r, pr["batch"]),
               inv.split_carry(b, r, pr["one"], split=1024)]
    for x in results:
        print(f"cudnn {r.name}: {x}")
    failed = [str(x) for x in results if not x.ok]
    assert not failed, "\n".join(failed)
