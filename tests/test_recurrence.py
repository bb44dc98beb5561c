import pytest
import torch

from kda_ref import ProblemError, truth
from kda_ref.problems import generate
from kda_ref.recurrence import recurrence


def _problem(seed=0, T=50, H=2, K=8, V=8, cu=(0, 10, 10, 50)):
    """The generator's float64 varlen problem (g and the kv state N(0,1)); ``T`` must be cu[-1]."""
    assert T == cu[-1]
    return generate(dict(lens=[b - a for a, b in zip(cu[:-1], cu[1:])], H=H, K=K, V=V, g_scale=1.0, state="kv",
                         state_scale=1.0, dtype=torch.float64, param_dtype=torch.float64), seed=seed)


def test_chunk_boundary_states_end_in_the_final_state():
    r = recurrence(_problem(), chunk_size=16)
    assert r.chunk_states.shape == (3, 4, 2, 8, 8)
    for n in range(3):
        assert torch.equal(r.chunk_states[n, -1], r.final_state[n])
    # the empty sequence keeps its initial state
    assert torch.equal(r.final_state[1], _problem().initial_state[1].double())


def test_recurrence_matches_a_plain_loop():
    p = _problem(seed=3)
    t = truth(p)
    from kda_ref.preprocess import prepare
    pp = prepare(p)
    for n, (bos, eos) in enumerate(pp.bounds):
        for h in range(p.HV):
            S = pp.S0[n, h].clone()
            for i in range(bos, eos):
                S = torch.exp(pp.a[i, h])[:, None] * S
                d = pp.beta[i, h] * (pp.v[i, h] - S.T @ pp.k[i, h])
                S = S + torch.outer(pp.k[i, h], d)
                assert torch.allclose(t.o[0, i, h], pp.scale * S.T @ pp.q[i, h], rtol=1e-14, atol=1e-14)
            assert torch.allclose(t.final_state[n, h], S, rtol=1e-14, atol=1e-14)


def test_bad_cu_seqlens_is_named():
    p = _problem()
    with pytest.raises(ProblemError, match="cu_seqlens: expected non-decreasing"):
        truth(p.replace(cu_seqlens=torch.tensor([0, 20, 10, 50])))


def test_chunk_boundary_states_match_the_chunked_form():
    from kda_ref.chunked import chunked_from_workspace
    from kda_ref.workspace import workspace_prepared
    from kda_ref.preprocess import prepare
    pp = prepare(_problem(seed=5))
    r = recurrence(_problem(seed=5), chunk_size=16)
    _, _, states = chunked_from_workspace(pp, workspace_prepared(pp, 16), return_chunk_states=True)
    assert states.shape == r.chunk_states.shape
    assert float((states - r.chunk_states).norm() / r.chunk_states.norm()) < 1e-13


@pytest.mark.parametrize("in_place", [False, True])
def test_token_step_host_equals_token_step(in_place):
    """The trace oracle's decode step (numpy products, inputs in their ops' shapes) against
    token_step over 200 chained tokens of random inputs, in place and into a second array: equal
    to rounding (measured worst 2e-16 relative, 2026-12-03)."""
    from kda_ref.recurrence import token_step, token_step_host
    g = torch.Generator().manual_seed(5)
    HV, K, V, n = 3, 16, 8, 200
    q, k = torch.randn(n, HV, K, generator=g, dtype=torch.float64), torch.randn(n, HV, K, generator=g, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(n, HV, V, generator=g, dtype=torch.float64)
    decay = torch.exp(-torch.rand(n, HV, K, generator=g, dtype=torch.float64))
    beta = torch.rand(n, HV, generator=g, dtype=torch.float64)
    S_ref = torch.randn(HV, K, V, generator=g, dtype=torch.float64)
    S = S_ref.clone()
    other = torch.empty_like(S)
    o = torch.full((n, HV, V), float("nan"), dtype=torch.float64)
    d = torch.empty(HV, 1, V, dtype=torch.float64)
    worst = 0.0
    for t in range(n):
        S_ref, o_ref = token_step(S_ref, q[t], k[t], v[t], decay[t], beta[t], 0.25)
        out = S if in_place else (other if t % 2 == 0 else torch.empty_like(S))
        token_step_host(S, q[t].numpy()[:, None, :], k[t].numpy()[:, None, :], k[t][..., None],
                        v[t].numpy()[:, None, :], decay[t][..., None], beta[t].numpy()[:, None, None], 0.25, out,
                        out.numpy(), o[t].numpy(), d, d.numpy())
        if not in_place:
            S, other = out, S
        worst = max(worst, float((S - S_ref).abs().max() / S_ref.abs().max()),
                    float((o[t] - o_ref).abs().max() / o_ref.abs().max()))
    assert worst <= 1e-13, worst
