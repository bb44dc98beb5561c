"""The fused output norm (aiter chunk_kda's out_gate / norm_weight): a Problem that carries it is
validated and round-trips through a problem file; its truth is kda_ref.norm.gated_rmsnorm of the
oracle's o, for every method; only a route flagged fused_norm takes it (kda_kernels.base.applicable,
one place); the emulator's aiter recipes apply the norm as the Gluon walk rounds it, pass the
verdict over the norm suite's smoke-sized case, and a slip in the norm (eps 1e-3, the gate left
out) fails it."""
import json

import pytest
import torch

from kda_kernels.base import Route, applicable
from kda_kernels.emulator import RECIPES, EmulatorBackend, emulate, exact_recipe
from kda_ref.norm import gated_rmsnorm
from kda_ref.problem import ProblemError, validate
from kda_ref.truth import truth
from kda_ref.problems import generate
from verification.running.cases import get_case, get_suite
from verification.cli import main
from verification.judging.metrics import compare

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

SMALL = dict(lens=[33, 20], H=2, state="kv", lb=-0.1, norm=True)


@pytest.fixture(scope="module")
def small():
    return generate(SMALL, seed=7)


def _plain(p):
    return p.replace(out_gate=None, norm_weight=None)


@pytest.mark.parametrize("change, fragment", [
    (lambda p: p.replace(norm_weight=None), "norm_weight: expected [128] with out_gate given, got None"),
    (lambda p: p.replace(out_gate=None), "out_gate: expected [1,53,2,128] with norm_weight given, got None"),
    (lambda p: p.replace(out_gate=p.out_gate[..., :64]), "out_gate: expected [1,53,2,128] ([B,T,HV,V], like v)"),
    (lambda p: p.replace(norm_weight=p.norm_weight[:64]), "norm_weight: expected [128] (V), got [64] float32"),
    (lambda p: p.replace(norm_eps=0.0), "norm_eps: expected a finite number > 0, got 0.0"),
    (lambda p: p.replace(out_gate=p.out_gate.to(torch.int32)), "out_gate: expected a float16, bfloat16"),
])
def test_a_bad_norm_is_one_line_naming_the_argument(small, change, fragment):
    with pytest.raises(ProblemError) as e:
        validate(change(small))
    assert str(e.value).startswith(fragment) and "\n" not in str(e.value), str(e.value)


def test_a_norm_nan_is_refused(small):
    gate = small.out_gate.clone()
    gate[0, 3, 1, 5] = float("nan")
    with pytest.raises(ProblemError, match=r"out_gate: expected finite values, got 1 NaN/Inf \(first at index \(0, 3, 1, 5\)\)"):
        validate(small.replace(out_gate=gate))


def test_the_norm_round_trips_through_a_problem_file(small, tmp_path):
    from verification.reporting.problem_file import load_problem, save_problem
    p = small.replace(norm_eps=3e-6)
    save_problem(str(tmp_path / "p.safetensors"), p)
    q = validate(load_problem(str(tmp_path / "p.safetensors")))
    assert q.norm_eps == 3e-6 and torch.equal(q.out_gate, p.out_gate) and torch.equal(q.norm_weight, p.norm_weight)
    assert q.out_gate.dtype == torch.bfloat16 and q.norm_weight.dtype == torch.float32
    save_problem(str(tmp_path / "plain.safetensors"), _plain(p))      # no norm: no norm key, defaults back
    r = load_problem(str(tmp_path / "plain.safetensors"))
    assert r.out_gate is None and r.norm_weight is None and not r.fused_norm


@pytest.mark.parametrize("method", ["streamed", "chunked", "recurrence"])
def test_the_truth_is_the_norm_of_the_oracles_o(small, method):
    t, plain = truth(small, method=method), truth(_plain(small), method=method)
    want = gated_rmsnorm(plain.o, small.out_gate, small.norm_weight, small.norm_eps)
    assert torch.equal(t.o, want) and torch.equal(t.final_state, plain.final_state)
    # the norm itself: o / sqrt(mean o^2 + eps) * w * sigmoid(gate), per token and head
    x = plain.o[0, 5, 1].double()
    by_hand = x / (x.square().mean() + small.norm_eps).sqrt() * small.norm_weight.double() \
        * torch.sigmoid(small.out_gate[0, 5, 1].double())
    assert torch.allclose(t.o[0, 5, 1], by_hand, rtol=1e-13, atol=0)


def test_only_a_route_flagged_fused_norm_takes_a_norm_problem(small):
    emu = EmulatorBackend()
    routes = {r.name: r for r in emu.routes()}
    assert {n for n, r in routes.items() if r.flag("fused_norm")} == {"aiter-gfx1250", "aiter-gfx950"}
    ok, why = applicable(emu, small, routes["flashkda"])
    assert not ok and why == ("not applicable: the problem has a fused output norm (out_gate, norm_weight) and this "
                              "route's kernel applies none")
    assert applicable(emu, small, routes["aiter-gfx1250"]) == (True, "")
    assert applicable(emu, _plain(small), routes["flashkda"]) == (True, "")
    # a backend that knows nothing of the norm is kept off it all the same
    assert not applicable(emu, small, Route("fla", recipe="fla"))[0]


@pytest.mark.parametrize("recipe", ["aiter-gfx1250", "aiter-gfx950"])
def test_the_recipes_apply_the_norm_where_the_walk_rounds_it(small, recipe):
    out, plain = emulate(small, recipe), emulate(_plain(small), recipe)
    # the walk: o as stored (bf16) -> fp32, of * (rsqrt(sum(of^2)/V + eps) * w) * sigmoid(gate), -> bf16 once
    of = plain.o.float()
    of = of * (torch.rsqrt((of * of).sum(-1, keepdim=True) / 128 + small.norm_eps) * small.norm_weight.float())
    want = (of * torch.sigmoid(small.out_gate.float())).to(torch.bfloat16)
    diff = (out.o.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert out.o.dtype == torch.bfloat16 and float(diff.max()) <= 2 ** -7, float(diff.max())   # one bf16 ulp
    assert float((out.o != want).float().mean()) < 0.01                      # the tanh form of the sigmoid
    assert torch.equal(out.final_state, plain.final_state)
    exact = emulate(small, exact_recipe(RECIPES[recipe]), keep_f64=True)
    assert compare(exact.tensors(), truth(small).tensors(), small)["o"]["rel_l2"] < 1e-12
    with pytest.raises(ValueError, match="recipe: fla has no fused output norm"):
        emulate(small, "fla")


def test_the_emulator_passes_and_a_slip_in_the_norm_fails(tmp_path, capsys, monkeypatch):
    """emulator aiter-gfx1250 / aiter-gfx950 over the norm suite's smoke-sized case pass; the same
    recipe with eps 1e-3, or without the gate, fails on o (tests/kda_test_backends.py norm_mutant)."""
    case = "norm/varlen-tail33-kv-lb-0.1"
    assert get_case(case).build().fused_norm
    out = tmp_path / "r"
    rc = main(["run", "--backend", "emulator,kda_test_backends:norm_mutant", "--suite", "norm", "--case", case, "--out", str(out)])
    recs = {(r["backend"], r["route"]): r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    status = {k: r["status"] for k, r in recs.items()}
    assert status[("emulator", "aiter-gfx1250")] == status[("emulator", "aiter-gfx950")] == "pass", status
    assert {s for (b, r), s in status.items() if b == "emulator" and not r.startswith("aiter-")} == {"skipped"}
    for route in ("eps1e-3", "no_gate"):
        r = recs[("test-norm-mutant", route)]
        assert r["status"] == "fail" and r["tensors"]["o"]["margin"] > 1, (route, r["reason"])
        assert r["tensors"]["final_state"]["margin"] <= 1
    assert rc == 1


def test_the_norm_suite_is_its_own():
    ids = [c.id for c in get_suite("norm")]
    assert ids == ["norm/varlen-tail33-kv-lb-0.1", "norm/k3-N4-T1939-paged-lb-0.1"]
    for s in ("smoke", "default", "k3-prefill", "stress"):
        assert not any(c.params.get("norm") for c in get_suite(s, long=False)), s


def test_a_norm_failure_shrinks_with_its_gate_and_its_bundle_reproduces(tmp_path):
    """shrink slices out_gate with the tokens and heads it keeps; the bundle's problem carries the
    norm (out_gate, norm_weight, norm_eps) and repro.py, in a fresh process, rebuilds it and reproduces."""
    from verification.reporting.problem_file import load_problem
    out = tmp_path / "b"
    assert main(["shrink", "--backend", "kda_test_backends:norm_mutant", "--route", "no_gate", "--case",
                 "norm/varlen-tail33-kv-lb-0.1", "--out", str(out), "--max-runs", "3"]) == 0
    data = json.loads((out / "shrink.json").read_text())
    p = validate(load_problem(str(out / "problem.safetensors")))
    assert p.fused_norm and p.out_gate.shape == p.v.shape and data["final"]["size"] < data["original"]["size"]
    assert data["repro_check"]["reproduced"] and data["repro_check"]["exit"] == 1, data["repro_check"]
