"""Our Triton FlashKDA compiled on a CUDA device against the float64 oracle (marked gpu; run with
``python -m pytest -q -m gpu tests/test_triton_gpu.py``).  Bounds as in test_triton_flashkda.py:
o and final state within 2u (u = 2^-8, bf16) relative L2 of the oracle; paged == dense and
strided == packed bitwise; segmented within 5e-3 of unsegmented (check_views_and_routes also runs
on the CPU under TRITON_INTERPRET=1 at small sizes)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

U_BF16 = 2.0 ** -8


def rel(x, ref):
    x, ref = x.double(), ref.double().to(x.device)
    return float((x - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def backend():
    from kda_kernels.triton.backend import TritonBackend
    return TritonBackend()


def _default_cases():
    from verification.running.cases import get_suite
    return get_suite("default")


@pytest.mark.parametrize("case", _default_cases(), ids=lambda c: c.name)
def test_default_shapes_against_the_oracle(case, backend):
    from kda_ref import truth
    p = case.build(device="cuda")
    tr = truth(p)
    for route in ("seg", "unseg", "seg:cps=4:A=two:B=plain"):
        out = backend.run(p, backend.route(route))
        assert torch.isfinite(out.o.float()).all(), route
        assert rel(out.o, tr.o) <= 2 * U_BF16, (route, rel(out.o, tr.o))
        assert rel(out.final_state, tr.final_state) <= 2 * U_BF16, (route, rel(out.final_state, tr.final_state))
    del tr
    torch.cuda.empty_cache()


@pytest.mark.parametrize("case_id", ["smoke/paged-lb-5", "smoke/weak-gate-lb-0.1-vk",
                                     "smoke/correlated-weak-lb-0.01", "smoke/varlen-tail33-lb-5"])
def test_smoke_cases_every_route(case_id, backend):
    from kda_ref import truth
    from verification.running.cases import get_case
    p = get_case(case_id).build(device="cuda")
    tr = truth(p)
    bound = 4 * U_BF16 if "correlated" in case_id else 2 * U_BF16
    for route in backend.routes():
        out = backend.run(p, route)
        got = out.state_cache if p.paged else out.final_state
        ref = tr.state_cache if p.paged else tr.final_state
        if p.paged:
            idx = p.state_indices.long()
            got, ref = got[idx], ref[idx]
        assert rel(out.o, tr.o) <= bound, (route.name, rel(out.o, tr.o))
        assert rel(got, ref) <= bound, (route.name, rel(got, ref))


def test_paged_equals_dense_and_strided_equals_packed_bitwise(backend):
    check_views_and_routes(backend, "cuda", 4, [700, 0, 129, 1500])


def check_views_and_routes(backend, device, H, lens,
                           routes=("unseg", "seg:cps=4", "seg:cps=1:A=two:B=plain")):
    """One varlen problem (an empty sequence, a strided projection, a V-first state) as paged,
    dense and packed views: the three bitwise equal on every route; every route's o and final
    state within 2u of the float64 oracle; every segmented route within 5e-3 of the unsegmented
    one and really segmented (chunks_per_seg set)."""
    from kda_ref import Problem, truth
    torch.manual_seed(0)
    N, T = len(lens), sum(lens)
    proj = torch.randn(1, T, 4 * H * 128, device=device).to(torch.bfloat16)
    q, k, v, g = (proj[..., i * H * 128:(i + 1) * H * 128].unflatten(-1, (H, 128)) for i in range(4))
    g = g * 0.1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    init = torch.randn(N, H, 128, 128, device=device)          # V-first
    base = Problem(q=q, k=k, v=v, g=g, beta=torch.randn(1, T, H, device=device),
                   A_log=torch.rand(H, device=device), dt_bias=0.1 * torch.randn(H * 128, device=device),
                   lower_bound=-0.5, cu_seqlens=cu, initial_state=init, state_layout="vk")
    slots = 2 * N + 1
    cache_buf = torch.full((slots, H * 128 * 128 + 32), float("nan"), device=device)
    cache = cache_buf[:, :H * 128 * 128].unflatten(-1, (H, 128, 128))
    idx = torch.tensor([7, 2, 0, 5][:N] if N <= 4 else list(range(1, 2 * N, 2)), dtype=torch.int32, device=device)
    has = torch.tensor([n != 2 for n in range(N)], device=device)
    dense0 = init.clone()
    dense0[~has] = 0
    for n in range(N):
        if has[n]:
            cache[int(idx[n])] = init[n]
    paged = base.replace(initial_state=None, state_layout="paged", state_cache=cache, state_indices=idx,
                         has_initial_state=has)
    dense = base.replace(initial_state=dense0)
    packed = dense.replace(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous())
    tr = truth(dense)
    unseg = backend.run(dense, backend.route("unseg"))
    for route in routes:
        a, b, c = backend.run(paged, backend.route(route)), backend.run(dense, backend.route(route)), \
            backend.run(packed, backend.route(route))
        assert torch.equal(a.o, b.o) and torch.equal(b.o, c.o), route
        assert torch.equal(b.final_state, c.final_state), route
        for n in range(N):
            assert torch.equal(a.state_cache[int(idx[n])], b.final_state[n]), (route, n)
        assert rel(b.o, tr.o) <= 2 * U_BF16, (route, rel(b.o, tr.o))
        assert rel(b.final_state, tr.final_state) <= 2 * U_BF16, (route, rel(b.final_state, tr.final_state))
        if route.startswith("seg"):
            assert b.info.get("chunks_per_seg") is not None, (route, b.info)
            assert rel(b.o, unseg.o) <= 5e-3 and rel(b.final_state, unseg.final_state) <= 5e-3, route
