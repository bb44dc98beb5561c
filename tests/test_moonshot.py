"""The moonshot adapter (Moonshot's CUTLASS flash_kda): routes, refusals, out-of-contract cells.

On a CPU, flash_kda is replaced by a stand-in module whose ``fwd`` makes the checks of
flash_kda's csrc/flash_kda.cpp (dtypes, contiguity, shapes, state dtypes) and computes the
moonshot recipe of the emulator from the arguments it was handed (V-first states, bf16
logits), so the adapter's mapping (layouts, state dtypes, varlen, batches) is checked end to
end through run_cell.  The tests marked ``gpu`` need the real flash_kda on an SM90 GPU.
"""
import json
import sys
import types

import pytest
import torch

from kda_kernels import moonshot as moon
from kda_kernels.base import Route, out_of_contract
from kda_kernels.emulator import emulate
from kda_ref.problem import Problem
from verification.running.cases import get_case
from verification.cli import main
from verification.judging.baselines import BaselineCache
from verification.running.run_cell import TruthCache, run_cell
from verification.judging.tolerances import load_tolerances

BF = torch.bfloat16


def _check(cond, msg):
    if not cond:
        raise RuntimeError(msg)


def fake_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
             cu_seqlens=None):
    """flash_kda.fwd's checks (csrc/flash_kda.cpp), then the moonshot recipe on what it was given."""
    _check(all(t.is_contiguous() for t in (q, k, v, g, beta, out)), "all tensors must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        _check(t.dtype == BF, f"{name} must be bfloat16")
    for name, s in (("initial_state", initial_state), ("final_state", final_state)):
        if s is not None:
            _check(s.is_contiguous(), f"{name} must be contiguous CUDA tensor")
            _check(s.dtype in (BF, torch.float32), f"{name} must be bfloat16 or float32")
    if initial_state is not None and final_state is not None:
        _check(initial_state.dtype == final_state.dtype, "initial_state and final_state must have the same dtype")
    _check(A_log.dtype == torch.float32 and A_log.is_contiguous(), "A_log must be float32")
    _check(dt_bias.dtype == torch.float32 and dt_bias.is_contiguous(), "dt_bias must be float32")
    B, T, H, Dm = q.shape
    _check(v.shape == q.shape, "v must match q shape")
    _check(g.shape == q.shape, "g must match q shape")
    _check(dt_bias.shape == (H, Dm), "dt_bias must be [H, D]")
    _check(Dm == 128, "currently only supports D == 128")
    if cu_seqlens is not None:
        _check(B == 1, "B must be 1 when cu_seqlens is provided")
        _check(cu_seqlens.dtype == torch.int64, "cu_seqlens must be int64")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    for name, s in (("initial_state", initial_state), ("final_state", final_state)):
        _check(s is None or tuple(s.shape) == (N, H, Dm, Dm), f"{name} must be [N, H, D, D]")
    p = Problem(q=q, k=k, v=v, g=g, beta=beta.float(), A_log=A_log, dt_bias=dt_bias.reshape(-1), scale=scale,
                lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                initial_state=None if initial_state is None else initial_state.float(), state_layout="vk",
                output_final_state=final_state is not None)
    res = emulate(p, "moonshot")
    out.copy_(res.o)
    if final_state is not None:
        final_state.copy_(res.final_state.to(final_state.dtype))


@pytest.fixture
def fake(monkeypatch):
    """flash_kda replaced by the stand-in; the backend reports itself available on the CPU."""
    mod = types.ModuleType("flash_kda")
    mod.calls = []

    def fwd(*a, **kw):
        mod.calls.append(kw)
        return fake_fwd(*a, **kw)
    mod.fwd = fwd
    monkeypatch.setitem(sys.modules, "flash_kda", mod)
    monkeypatch.setattr(moon.MoonshotBackend, "available", lambda self: (True, ""))
    return mod


def _route(state="fp32"):
    return next(r for r in moon.MoonshotBackend().routes() if r.flag("state_dtype") == state)


def _bf16_logits(p: Problem) -> Problem:
    return p.replace(beta=p.beta.to(BF).float())


# ---------------------------------------------------------------------------- routes, refusals
def test_routes_are_both_state_dtypes_judged_with_the_moonshot_recipe():
    routes = moon.MoonshotBackend().routes()
    assert [r.name for r in routes] == ["cutlass:state=fp32", "cutlass:state=bf16"]
    assert {r.recipe for r in routes} == {"moonshot"}


def _strided(p):
    return get_case("stress/fused-projection-bands-lb-1").build()


REFUSALS = [
    ("K=64", lambda p: p.replace(q=p.q[..., :64].contiguous(), k=p.k[..., :64].contiguous(),
                                 g=p.g[..., :64].contiguous(), dt_bias=None, initial_state=None),
     "K = V = 128 (it checks 'currently only supports D == 128'"),
    ("GVA", lambda p: p.replace(q=p.q[:, :, :1].contiguous(), k=p.k[:, :, :1].contiguous()),
     "no GVA (it checks 'v must match q shape'), got H=1 HV=2"),
    ("softplus", lambda p: p.replace(gate="softplus", lower_bound=None), "got gate=softplus"),
    ("pregated", lambda p: p.replace(gate="pregated", lower_bound=None, A_log=None), "got gate=pregated"),
    ("sigmoid2", lambda p: p.replace(beta_kind="sigmoid2"), "got beta=sigmoid2"),
    ("no-l2norm", lambda p: p.replace(qk_l2norm=False), "always l2-normalizes"),
    ("fp32-q", lambda p: p.replace(q=p.q.float()), "bf16 q only (it checks 'q must be bfloat16'), got fp32"),
    ("strided", _strided, "raises RuntimeError 'all tensors must be contiguous' on strided inputs, got q, k, v, g"),
]


@pytest.mark.parametrize("name,change,words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_are_not_applicable_in_moonshots_own_terms(name, change, words):
    p = change(get_case("stress/weak-gate-lb-0.1").build())
    ok, why = moon.MoonshotBackend().accepts(p, _route())
    assert not ok and why.startswith("not applicable: ") and words in why, why


def test_a_problem_without_tokens_is_refused_before_the_kernel_aborts():
    p = get_case("stress/weak-gate-lb-0.1").build()
    empty = p.replace(q=p.q[:, :0], k=p.k[:, :0], v=p.v[:, :0], g=p.g[:, :0], beta=p.beta[:, :0])
    ok, why = moon.MoonshotBackend().accepts(empty, _route())
    assert not ok and "aborts the process on a problem without tokens" in why and why.endswith("got B=1 T=0")


def test_a_paged_problem_is_not_applicable():
    ok, why = moon.MoonshotBackend().accepts(get_case("smoke/paged-lb-5").build(), _route())
    assert not ok and "no paged state cache" in why


def test_the_strided_refusal_is_what_the_kernel_raises(fake):
    """The stand-in raises what csrc/flash_kda.cpp raises on the fused-projection bands."""
    p = get_case("stress/fused-projection-bands-lb-1").build()
    with pytest.raises(RuntimeError, match="all tensors must be contiguous"):
        moon.MoonshotBackend().run(p, _route())


def test_lower_bound_outside_minus5_0_is_out_of_contract_not_refused():
    b = moon.MoonshotBackend()
    p = get_case("stress/saturated-gate-lb-5.5").build()
    assert b.accepts(p, _route()) == (True, "")
    assert out_of_contract(b, p, _route()) == ("lower_bound -5.5 outside the [-5, 0] flash_kda documents; "
                                               "flash_kda.fwd does not check it")
    for lb in (-5.0, -0.01):
        assert out_of_contract(b, p.replace(lower_bound=lb), _route()) is None
    assert out_of_contract(object(), p, _route()) is None     # a backend documents no such range


# ---------------------------------------------------------------------------- runs (stand-in kernel)
RUNS = ["smoke/dense-T64-lb-5", "smoke/varlen-tail33-lb-5", "smoke/initial-state-kv-lb-5",
        "smoke/weak-gate-lb-0.1-vk", "stress/empty-seq-middle"]


@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("case_id", RUNS)
def test_run_hands_flash_kda_its_layouts_and_returns_the_problems(fake, case_id, state, one_thread):
    p = get_case(case_id).build()
    out = moon.MoonshotBackend().run(p, _route(state))
    kw = fake.calls[-1]
    sdt = moon.STATE_DTYPES[state]
    assert kw["final_state"].dtype == sdt and kw["final_state"].shape == (p.N, p.H, 128, 128)
    if p.initial_state is not None:
        assert kw["initial_state"].dtype == sdt
        want = p.initial_state if p.state_layout == "vk" else p.initial_state.transpose(-1, -2)
        assert torch.equal(kw["initial_state"], want.to(sdt))
    assert (kw.get("cu_seqlens") is not None) == (p.cu_seqlens is not None)
    ref = emulate(_bf16_logits(p), "moonshot")
    assert torch.equal(out.o, ref.o)
    assert out.final_state.shape == p.initial_state.shape if p.initial_state is not None else True
    assert torch.equal(out.final_state.float(), ref.final_state)      # bf16 states are exact in either dtype
    ran = out.info["route_ran"]
    assert ran == (f"flash_kda.fwd launch_fwd<HasStateIn={p.initial_state is not None}, HasStateOut=True, "
                   f"StateFP32={state == 'fp32'}, IsVarlen={p.cu_seqlens is not None}>")
    assert "beta fp32 logits -> bf16" in out.info["converted"]
    assert ("initial_state K-first -> V-first" in out.info["converted"]) == (
        p.initial_state is not None and p.state_layout == "kv")


def test_batched_problem_with_state_runs_as_b_sequences(fake, one_thread):
    p = get_case("smoke/initial-state-kv-lb-5").build()          # B = 2
    assert p.B == 2
    out = moon.MoonshotBackend().run(p, _route())
    assert "cu_seqlens" not in fake.calls[-1] and out.final_state.shape == (2, 1, 128, 128)


def test_no_final_state_asked_none_passed(fake, one_thread):
    p = get_case("smoke/dense-T64-lb-5").build().replace(output_final_state=False)
    out = moon.MoonshotBackend().run(p, _route("bf16"))
    assert "final_state" not in fake.calls[-1] and out.final_state is None
    assert "HasStateIn=False, HasStateOut=False" in out.info["route_ran"]


def _cell(case_id, route, backend=None):
    return run_cell(backend or moon.MoonshotBackend(), route, get_case(case_id), TruthCache(device="cpu"),
                    BaselineCache(), load_tolerances(), "cpu")


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_a_cell_in_contract_passes_through_run_cell(fake, state, one_thread):
    rec = _cell("smoke/initial-state-kv-lb-5", _route(state))
    assert rec.status == "pass", rec.reason
    assert rec.info["route_ran"].startswith("flash_kda.fwd launch_fwd<HasStateIn=True")


def test_an_out_of_contract_cell_says_what_the_kernel_returned(fake, one_thread):
    rec = _cell("stress/saturated-gate-lb-5.5", _route())
    assert rec.status == "out-of-contract"
    assert rec.reason.startswith("out of contract (lower_bound -5.5 outside the [-5, 0] flash_kda documents; "
                                    "flash_kda.fwd does not check it); the kernel returned finite values: o rel_l2 ")
    assert "% exact zeros (oracle " in rec.reason and "final_state rel_l2" in rec.reason
    assert rec.contract_verdict["status"] in ("pass", "fail", "mistrusted")
    assert "known_failure" not in rec


def test_an_out_of_contract_cell_that_raises_says_so(fake, one_thread):
    def boom(*a, **kw):
        raise RuntimeError("illegal memory access")
    fake.fwd = boom
    rec = _cell("stress/saturated-gate-lb-5.5", _route())
    assert rec.status == "out-of-contract" and rec.contract_verdict["status"] == "error"
    assert rec.reason.endswith("moonshot cutlass:state=fp32 run raised RuntimeError: illegal memory access")


# ---------------------------------------------------------------------------- this machine
def test_backends_json_lists_every_moonshot_route_with_the_reason_it_cannot_run(capsys):
    try:
        import flash_kda  # noqa: F401
        pytest.skip("flash_kda is importable here: the reason is the CPU-only machine's")
    except ImportError:
        pass
    assert main(["backends", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "moonshot")
    assert row["routes"] == ["cutlass:state=fp32", "cutlass:state=bf16"]
    assert row["available"] is False
    assert row["reason"].startswith("Moonshot's flash_kda is not importable (ModuleNotFoundError: ")
    assert "tools/build_flash_kda.sh SRC" in row["reason"]


# ---------------------------------------------------------------------------- the real kernel
def _real():
    try:
        import flash_kda
    except ImportError:
        return None
    ok, _ = moon.MoonshotBackend().available()
    return flash_kda if ok else None


def gpu(f):
    """A test of the real kernel: marked gpu (python -m pytest -m gpu tests/test_moonshot.py), skipped
    without flash_kda on an SM90 GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(_real() is None, reason="needs Moonshot's flash_kda on an SM90 GPU")(f))


@gpu
def test_gpu_strided_inputs_raise_what_the_refusal_says():
    p = get_case("stress/fused-projection-bands-lb-1").build(device="cuda")
    assert not p.q.is_contiguous()
    with pytest.raises(RuntimeError, match="all tensors must be contiguous"):
        _real().fwd(**moon.call_arguments(p))


@gpu
@pytest.mark.parametrize("case_id", ["smoke/initial-state-kv-lb-5", "smoke/varlen-tail33-lb-5",
                                     "stress/weak-gate-lb-0.1"])
def test_gpu_fp32_and_bf16_states_give_the_same_bits(case_id):
    """The kernel computes with a bf16 state: fp32 states in and out are that state widened."""
    p = get_case(case_id).build(device="cuda")
    b = moon.MoonshotBackend()
    a32, a16 = b.run(p, _route("fp32")), b.run(p, _route("bf16"))
    assert torch.equal(a32.o, a16.o)
    assert a16.final_state.dtype == BF and torch.equal(a32.final_state, a16.final_state.float())


INVARIANCE_SHAPES = {      # tests/test_invariance_gpu.py's, without the paged one (flash_kda has no paged cache)
    "varlen": dict(lens=[1, 300, 33, 1100], H=4, state="kv"),     # no empty sequence: alone it has no tokens
    "batch": dict(B=3, T=700, H=4, state="vk"),
    "one": dict(B=1, T=2048, H=8, state="kv"),
}


@gpu
@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_gpu_invariances(state):
    """The invariances that apply to flash_kda (verification/investigating/invariance.py), chunk size 16: a split
    only at a chunk boundary (a cut inside a chunk is another rounding path, and with a bf16 state
    between chunks the two paths differ by about the recipe's own error, so the 5e-3 bound of a
    moved segment boundary does not apply)."""
    from verification.investigating import invariance as inv
    from kda_ref.problems import generate
    b, r = moon.MoonshotBackend(), _route(state)
    assert inv.chunk_size_of(r) == 16
    pr = {n: generate(params, seed=seed, device="cuda") for seed, (n, params) in enumerate(INVARIANCE_SHAPES.items())}
    results = [inv.determinism(b, r, pr["one"], repeats=3),
               inv.varlen_slice(b, r, pr["varlen"]),
               inv.batch_slice(b, r, pr["batch"]),
               inv.causality(b, r, pr["varlen"]),
               inv.causality(b, r, pr["batch"], prefix=256),
               inv.causality(b, r, pr["one"], prefix=16 * 37),
               inv.head_permutation(b, r, pr["batch"]),
               inv.head_permutation(b, r, pr["one"]),
               inv.split_carry(b, r, pr["one"], split=1024)]
    for x in results:
        print(f"moonshot {r.name}: {x}")
    failed = [str(x) for x in results if not x.ok]
    assert not failed, "\n".join(failed)
    assert {x.kind for x in results} == {"bitwise"}


@gpu
def test_gpu_flash_kda_is_deterministic_and_accepts_lb_outside_its_documented_range():
    p = get_case("stress/saturated-gate-lb-5.5").build(device="cuda")
    b = moon.MoonshotBackend()
    o1, o2 = b.run(p, _route()), b.run(p, _route())
    assert torch.equal(o1.o, o2.o) and torch.equal(o1.final_state, o2.final_state)


# ---------------------------------------------------------------------------- bench, side by side
def _result(backend, route, shape, t, host_bound=False, error=""):
    from verification.investigating import bench
    return bench.BenchResult(backend, route, *shape, time_us=t, p10_us=t, p90_us=t, reps=3, graph=False, bytes=1,
                             flops=1, bandwidth_gbs=1.0, tflops=1.0, floor_us=bench.floor_us(*shape),
                             host_bound=host_bound, error=error)


def test_bench_side_by_side_table_has_every_backend_per_shape_with_its_floor(capsys):
    from verification.investigating import bench
    from verification.commands.bench import _print_side_by_side
    rs = [_result("triton", "seg", (1, 8192, 96), 2578.0), _result("moonshot", "cutlass:state=fp32", (1, 8192, 96), 1458.0),
          _result("fla-pinned", "chunk:safe_gate", (1, 8192, 96), 4000.0, host_bound=True),
          _result("triton", "seg", (1, 2048, 12), 269.0),
          _result("moonshot", "cutlass:state=fp32", (1, 2048, 12), float("nan"), error="RuntimeError: x")]
    cols, rows = bench.side_by_side(rs)
    assert cols == [("triton", "seg"), ("moonshot", "cutlass:state=fp32"), ("fla-pinned", "chunk:safe_gate")]
    assert list(rows) == [(1, 8192, 96), (1, 2048, 12)]
    _print_side_by_side(rs)
    out = capsys.readouterr().out.splitlines()
    row = next(ln for ln in out if ln.strip().startswith("1x8192x96"))
    f = bench.floor_us(1, 8192, 96)
    assert f"{f:.0f}" in row and f"1458.0 ({1458.0 / f:.1f}x)" in row and " hb" in row
    assert row.endswith("moonshot cutlass:state=fp32")
    row = next(ln for ln in out if ln.strip().startswith("1x2048x12"))
    assert "error" in row and row.endswith("triton seg")


def test_bench_backend_names_are_checked_in_one_line():
    from verification.cli import main as cli
    assert cli(["bench", "--backend", "triton,cutlass"]) == 2


# ---------------------------------------------------------------------------- which build ran
@pytest.mark.parametrize("version,recipe", [("0.0.1+1ce47ea.neumann", "moonshot"),
                                            ("0.0.1+1ce47ea.fwdsub7afb9f4", "moonshot-fwdsub"),
                                            ("0.0.1+7afb9f4.fwdsub", "moonshot-fwdsub"),
                                            ("0.0.1", "moonshot")])
def test_the_build_beside_the_imported_module_picks_the_recipe_and_names_itself(tmp_path, monkeypatch, version,
                                                                                 recipe):
    # two builds side by side (pip --target dirs): the one on sys.path first is the one that runs,
    # its version (tools/build_flash_kda.sh writes the inverse it compiled) picks the baseline
    for other, d in (("0.0.1+0000000.other", tmp_path / "b"), (version, tmp_path / "a")):
        (d / "flash_kda").mkdir(parents=True)
        (d / "flash_kda" / "__init__.py").write_text("def fwd(**kw):\n    pass\n")
        (d / f"flash_kda-{other}.dist-info").mkdir()
        (d / f"flash_kda-{other}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash_kda\nVersion: {other}\n")
    monkeypatch.delitem(sys.modules, "flash_kda", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    b = moon.MoonshotBackend()
    assert {r.recipe for r in b.routes()} == {recipe}
    assert b.version().startswith(f"flash_kda {version} (recipe {recipe}, {tmp_path / 'a'}")
