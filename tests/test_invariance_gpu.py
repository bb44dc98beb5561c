"""Invariances and memory guards of our Triton FlashKDA compiled on CUDA (marked gpu; run with
``python -m pytest -q -m gpu tests/test_invariance_gpu.py``): every pinned route of the backend,
small and production-like shapes.  The kinds and bounds are verification/invariance.py's: bitwise
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
    from verification.cases import build_problem
    return build_problem(params, seed, device="cuda")


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
    from verification import invariance as inv
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
    from verification.guards import guarded_run
    r = backend.route(route)
    for name in ("paged", "varlen", "batch"):
        _, rep = guarded_run(backend, problems[name], r)
        assert rep.ok, (name, rep.violations)
        assert "o" in rep.buffers and "ws_inv" in rep.buffers


def test_guards_production_shape(backend):
    """A K3-prefill-like pack (H = 32, ~16k tokens, paged) under guards, default routes."""
    from verification.guards import guarded_run
    p = _build(dict(lens=[8192, 1, 4097, 3000, 1100], H=32, state="paged", paged_new=[2], slot_pad=128), 7)
    for route in ("seg", "unseg"):
        _, rep = guarded_run(backend, p, backend.route(route))
        assert rep.ok, (route, rep.violations)


def test_run_cell_on_cuda_records_guards(backend):
    from verification.cases import get_case
    from verification.runner import BaselineCache, TruthCache, run_cell
    from verification.tolerances import load_tolerances
    case = get_case("smoke/paged-lb-5")
    rec = run_cell(backend, backend.route("seg:cps=1"), case, TruthCache(device="cuda"), BaselineCache(),
                   load_tolerances(), "cuda")          # guards default on for CUDA
    assert rec["guards"]["ok"], rec["guards"]
    assert rec["status"] == "pass", rec["reason"]
