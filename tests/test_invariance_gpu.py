"""Invariances and memory guards of our Triton FlashKDA compiled on CUDA (marked gpu; run with
``python -m pytest -q -m gpu tests/test_invariance_gpu.py``): every pinned route of the backend,
small and production-like shapes.  The kinds and bounds are verification/investigating/invariance.py's: bitwise
where the design guarantees it, rel_l2 <= 5e-3 where a chunk or segment boundary moves."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def backend():
    from kda_kernels.triton.backend import TritonBackend
    return TritonBackend()


def _routes():
    from kda_kernels.triton.routes import route_names
    return route_names()


def _build(params, seed):
    from kda_ref.problems import generate
    return generate(params, seed=seed, device="cuda")


SHAPES = {
    "varlen": dict(lens=[1, 300, 33, 0, 1100], H=4, state="kv"),
    "batch": dict(B=3, T=700, H=4, state="vk"),
    "one": dict(B=1, T=2048, H=8, state="kv"),
    "paged": dict(lens=[200, 47, 513], H=4, state="paged", paged_new=[1], slot_pad=64),
}


@pytest.fixture(scope="module")
def problems():
    return {name: _build(params, seed) for seed, (name, params) in enumerate(SHAPES.items())}


@pytest.mark.parametrize("route", _routes())
def test_invariances_every_route(backend, problems, route):
    from verification.investigating import invariance as inv
    r = backend.route(route)
    results = [inv.determinism(backend, r, problems["one"], repeats=3),
               inv.varlen_slice(backend, r, problems["varlen"]),
               inv.batch_slice(backend, r, problems["batch"]),
               inv.paged_vs_dense(backend, r, problems["paged"]),
               inv.paged_vs_dense(backend, r, problems["batch"]),
               inv.strided_vs_packed(backend, r, problems["varlen"]),
               inv.causality(backend, r, problems["varlen"]),
               inv.causality(backend, r, problems["batch"], prefix=256),
               inv.head_permutation(backend, r, problems["batch"]),
               inv.split_carry(backend, r, problems["one"], split=1024),
               inv.split_carry(backend, r, problems["one"], split=1000)]
    failed = [str(x) for x in results if not x.ok]
    assert not failed, "\n".join(failed)
    kinds = {x.name: x.kind for x in results}
    assert kinds["determinism"] == kinds["paged_vs_dense"] == kinds["head_permutation"] == "bitwise"


@pytest.mark.parametrize("route", _routes())
def test_guards_every_route(backend, problems, route):
    from verification.running.guards import guarded_run
    r = backend.route(route)
    for name in ("paged", "varlen", "batch"):
        _, rep = guarded_run(backend, problems[name], r)
        assert rep.ok, (name, rep.violations)
        assert "o" in rep.buffers and "ws_inv" in rep.buffers


def test_guards_production_shape(backend):
    """A K3-prefill-like pack (H = 32, ~16k tokens, paged) under guards, default routes."""
    from verification.running.guards import guarded_run
    p = _build(dict(lens=[8192, 1, 4097, 3000, 1100], H=32, state="paged", paged_new=[2], slot_pad=128), 7)
    for route in ("seg", "unseg"):
        _, rep = guarded_run(backend, p, backend.route(route))
        assert rep.ok, (route, rep.violations)


def test_run_cell_on_cuda_records_guards(backend):
    from verification.running.cases import get_case
    from verification.judging.baselines import BaselineCache
    from verification.running.run_cell import TruthCache, run_cell
    from verification.judging.tolerances import load_tolerances
    case = get_case("smoke/paged-lb-5")
    rec = run_cell(backend, backend.route("seg:cps=1"), case, TruthCache(device="cuda"), BaselineCache(),
                   load_tolerances(), "cuda")          # guards default on for CUDA
    assert rec.guards["ok"], rec.guards
    assert rec.status == "pass", rec.reason


def _planted(name, edits, what, tmp_path):
    from verification.investigating.mutate import load_mutant_backend
    from verification.investigating.mutants import Mutant
    return load_mutant_backend(Mutant(name=name, pass_name="C", edits=edits, what=what), tmp_path)


def test_planted_out_of_bounds_write_in_the_compiled_kernel_is_caught(tmp_path):
    """Pass C's o store loses its row mask: the tail chunk of the last sequence (T = 40, so rows
    40..63) is written past o's end, into the guard band after it."""
    from verification.running.guards import guarded_run
    bad = _planted("planted_o_store_unmasked",
                   (("walk-store-o", "tl.store(o_ptr + b * sob + tok[:, None].to(tl.int64) * sot + h * soh"
                     " + cols[None, :] * sod, o.to(o_ptr.dtype.element_ty), mask=vmask)",
                     "tl.store(o_ptr + b * sob + tok[:, None].to(tl.int64) * sot + h * soh"
                     " + cols[None, :] * sod, o.to(o_ptr.dtype.element_ty))"),),
                   "o stored without the row mask", tmp_path)
    p = _build(dict(B=1, T=40, H=2, state="kv"), 11)
    _, rep = guarded_run(bad, p, bad.route("unseg"))
    assert not rep.ok and any(v.startswith("o") and "after" in v for v in rep.violations), rep.violations
    from kda_kernels.triton.backend import TritonBackend
    _, clean = guarded_run(TritonBackend(), p, TritonBackend().route("unseg"))
    assert clean.ok, clean.violations


def test_planted_read_of_a_slot_without_initial_state_is_caught(tmp_path):
    """The paged read ignores has_initial_state: the slot of a new sequence holds NaN under the
    guards, so reading it must show up (o or the state becomes NaN) and the guard names it."""
    from verification.running.guards import guarded_run
    bad = _planted("planted_has_initial_state_ignored",
                   (("mask=has & (off >= 0), other=0.0)", "mask=(off >= 0), other=0.0)"),),
                   "paged read ignores has_initial_state", tmp_path)
    p = _build(dict(lens=[200, 47, 513], H=2, state="paged", paged_new=[1], slot_pad=64), 12)
    _, rep = guarded_run(bad, p, bad.route("unseg"))
    assert not rep.ok, "a read of a slot whose has_initial_state is false went unnoticed"
    print("\n".join(rep.violations))
