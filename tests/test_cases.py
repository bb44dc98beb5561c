"""Cases and suites: deterministic, realistic, and covering the default shapes and the stress corners."""
import math

import pytest
import torch

from verification.running.cases import DEFAULT_SHAPES, SUITES, Case, get_case, get_suite
from verification.errors import UsageError


def test_suite_names_and_unknown_suite():
    assert SUITES == ("smoke", "default", "k3-prefill", "stress", "fuzz", "long", "norm")
    with pytest.raises(UsageError, match=r"--suite: expected one of smoke, default, k3-prefill, stress, fuzz, long, norm, "
                                         r"got 'smok'"):
        get_suite("smok")
    with pytest.raises(UsageError, match="unknown option"):
        get_suite("smoke", n=3)


def test_ids_are_unique_and_readable():
    ids = [c.id for s in ("smoke", "default", "k3-prefill", "stress") for c in get_suite(s)]
    assert len(ids) == len(set(ids))
    assert "smoke/varlen-tail33-lb-5" in ids and all(i.count("/") == 1 for i in ids)


def test_smoke_is_tiny_and_covers_the_basics():
    cases = get_suite("smoke")
    assert len(cases) == 6
    problems = [c.build() for c in cases]
    for p in problems:
        assert p.K == p.V == 128 and p.T <= 100 and p.H <= 2
    assert any(p.cu_seqlens is not None and any((e - b) % 32 for b, e in p.seq_bounds()) for p in problems)
    assert any(p.initial_state is not None for p in problems)
    assert any(p.paged for p in problems)
    assert any(p.lower_bound == -5 for p in problems) and any(p.lower_bound > -1 for p in problems)


def test_default_is_the_production_shapes():
    cases = get_suite("default")
    assert [c.shape_key for c in cases] == list(DEFAULT_SHAPES) and len(cases) == 13
    assert all(c.params.get("lb", -5.0) == -5.0 for c in cases)


def test_builds_are_deterministic_and_in_production_dtypes():
    c = get_case("smoke/initial-state-kv-lb-5")
    a, b = c.build(), c.build()
    for name, t in a.tensors().items():
        assert torch.equal(t, getattr(b, name)), name
    assert a.q.dtype == a.k.dtype == a.v.dtype == a.g.dtype == torch.bfloat16
    assert a.beta.dtype == a.A_log.dtype == a.dt_bias.dtype == a.initial_state.dtype == torch.float32
    assert a.scale == pytest.approx(128 ** -0.5) and a.meta["case"] == c.id and a.meta["seed"] == c.seed


def test_k3_prefill_continues_prefixes_through_the_paged_cache():
    cases = get_suite("k3-prefill")
    assert len(cases) == 26 and all(c.params["H"] == 12 and c.params["state"] == "paged" for c in cases)
    assert any(c.params["paged_new"] for c in cases)
    assert any(len(c.params["paged_new"]) < len(c.params["lens"]) for c in cases)
    p = next(c for c in cases if 0 < len(c.params["paged_new"]) < len(c.params["lens"]) and not c.long).build()
    hs, idx = p.has_initial_state, p.state_indices.long()
    assert hs.any() and (~hs).any()
    assert torch.isfinite(p.state_cache[idx[hs]]).all()
    assert torch.isnan(p.state_cache[idx[~hs]]).all()          # must never be read
    unused = [s for s in range(p.state_cache.shape[0]) if s not in set(idx.tolist())]
    assert unused and torch.isnan(p.state_cache[unused]).all()  # and must stay untouched


def test_stress_covers_the_hard_corners():
    cases = {c.name: c for c in get_suite("stress")}
    names = " ".join(cases)
    for lb in ("-0.01", "-0.1", "-1"):
        assert f"weak-gate-lb{lb}" in names
    assert "saturated-gate-lb-5 " in names + " " and "saturated-gate-lb-5.5" in names
    assert "correlated-keys-rho0.9" in names and "correlated-keys-rho1-" in names
    for t in (1, 15, 16, 17, 31, 32, 33):
        assert f"tail{t}-" in names
    for where in ("start", "middle", "end"):
        assert f"empty-seq-{where}" in names
    assert cases["one-chunk-per-segment-lb-0.1"].build().meta["chunks_per_seg"] == 1
    assert any(c.long and c.shape_key[1] >= 65536 for c in cases.values())
    assert not any(c.long for c in get_suite("stress", long=False))
    sat = cases["saturated-gate-lb-5.5"].build()
    from kda_ref.preprocess import prepare
    assert float(prepare(sat).a.min()) == pytest.approx(-5.5, abs=1e-3)     # sigmoid saturated
    corr = cases["correlated-keys-rho1-lb-0.01"].build()
    k = corr.k.float()
    assert torch.allclose(k, k[:, :1].expand_as(k)) and float(corr.beta.min()) == 4.0
    conv = cases["converged-state-lb-0.01"].build()
    from kda_ref.preprocess import prepare as prep
    pp = prep(conv)
    resid = pp.v[0] - torch.einsum("hk,hkv->hv", pp.k[0], pp.S0[0])
    assert float(resid.norm() / pp.v[0].norm()) < 1e-2                    # S^T k ~ v at the start
    big = cases["large-state-x100-lb-0.1"].build()
    assert float(big.initial_state.abs().max()) > 100
    fused = cases["fused-projection-bands-lb-1"].build()
    assert not fused.q.is_contiguous() and fused.q.untyped_storage().data_ptr() == fused.v.untyped_storage().data_ptr()
    for where in ("start", "middle", "end"):
        assert 0 in [e - b for b, e in cases[f"empty-seq-{where}"].build().seq_bounds()]


def test_fuzz_is_derandomized_and_inside_the_domain():
    a, b = get_suite("fuzz", n=6), get_suite("fuzz", n=6)
    assert [c.params for c in a] == [c.params for c in b] and len(a) == 6
    assert [c.params for c in get_suite("fuzz", n=6, seed=1)] != [c.params for c in a]
    for c in a:
        p = c.build()
        assert p.K == p.V == 128 and -5.5 <= p.lower_bound <= -0.01 and p.T > 0 and p.HV == p.H


def test_case_is_the_documented_dataclass():
    c = Case(name="x", suite="smoke", seed=3, params={"T": 17, "H": 1})
    assert c.id == "smoke/x" and c.shape_key == (1, 17, 1) and not c.long
    p = c.build()
    assert p.T == 17 and math.isclose(p.lower_bound, -5.0)
    with pytest.raises(UsageError, match="--case: no case named 'nope'"):
        get_case("smoke/nope")


def test_moving_a_problem_keeps_strided_views_strided():
    from kda_ref.problems import to_device_keep_views
    p = get_case("stress/fused-projection-bands-lb-1").build()
    m = to_device_keep_views(p, "cpu")
    for name in ("q", "k", "v", "g"):
        a, b = getattr(p, name), getattr(m, name)
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert m.q.untyped_storage().data_ptr() == m.g.untyped_storage().data_ptr()
