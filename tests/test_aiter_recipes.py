"""The emulator recipes of aiter's Gluon chunk_kda (aiter-gfx1250, aiter-gfx950): the algorithm
is exact without rounding (the 16-token band anchoring, the inverse's doubling and block
substitution, the grouped walk's transfer-matrix scan), the rounding points each change the
result where the source says they matter, and the recipes agree with the float64 oracle at the
bf16 level on the smoke suite."""
from dataclasses import replace

import pytest
import torch

from kda_kernels.emulator import (BF16, CHUNK_KDA_GLUON_RECIPES, FP32, RECIPES, aiter_gfx950_groups,
                                  aiter_token_inputs, chunk_kda_gluon_recipe, emulate, exact_recipe,
                                  walk_group_bounds)
from kda_ref.truth import truth
from verification.running.cases import _case, get_case, get_suite
from verification.judging.metrics import compare

AITER = ("aiter-gfx1250", "aiter-gfx950")


def _err(p, tr, recipe) -> dict:
    return {name: m["rel_l2"] for name, m in compare(emulate(p, recipe).tensors(), tr.tensors(), p).items()}


@pytest.fixture(scope="module")
def smoke():
    return [(c.id, c.build()) for c in get_suite("smoke")]


@pytest.fixture(scope="module")
def weak_long():
    """Two sequences of 12 and 5 chunks and a 3-token one under a weak gate (the state remembers
    across groups) and an initial state."""
    p = _case("t", "groups", lens=[12 * 64 - 7, 5 * 64, 3], H=1, lb=-0.01, state="kv").build()
    return p, truth(p)


@pytest.mark.parametrize("recipe", AITER)
@pytest.mark.slow
def test_on_the_smoke_suite_the_recipes_err_at_the_bf16_level(smoke, recipe):
    # every smoke case: o and the state within [1e-3, 1e-2] of the oracle (correlated keys with a
    # weak gate: 2e-2), and within 1.25x of the fla recipe (same chunk, same storage dtypes): the
    # recipe's expected device error
    for cid, p in smoke:
        tr = truth(p)
        err, fla = _err(p, tr, recipe), _err(p, tr, "fla")
        for name, e in err.items():
            assert 1e-3 < e < (2e-2 if "correlated" in cid else 1e-2), (cid, name, e)
            assert e < 1.25 * fla[name], (cid, name, e, fla[name])


def test_the_exact_grouped_walk_is_the_oracle(weak_long):
    # pass 1 / scan / pass 2 without rounding: entry_{g+1} = T_g entry_g + B_g is the walk itself
    p, tr = weak_long
    for G in (3, 4, 7):
        out = emulate(p, exact_recipe(replace(RECIPES["aiter-gfx950"], walk_groups=G)), keep_f64=True)
        for name, m in compare(out.tensors(), tr.tensors(), p).items():
            assert m["rel_l2"] < 1e-12, (G, name, m["rel_l2"])


def test_the_grouped_walk_rounds_at_group_boundaries_only_beyond_two_groups(weak_long):
    p, _ = weak_long
    r = RECIPES["aiter-gfx950"]
    one, two, four = (emulate(p, replace(r, walk_groups=G)) for G in (1, 2, 4))
    g1250 = emulate(p, replace(RECIPES["aiter-gfx1250"], prep="gfx950"))
    # G = 2: pass 2 of group 1 starts from pass 1's fp32 end state of group 0: the plain walk, bit for bit
    assert torch.equal(one.o, two.o) and torch.equal(one.final_state, two.final_state)
    assert torch.equal(one.o, g1250.o)              # gfx950's walk = gfx1250's, once the gate formulas agree
    # G = 4: entries of groups 2, 3 come from the scan (bf16 entry operand, transfer matrix stored bf16)
    assert not torch.equal(one.o, four.o) and not torch.equal(one.final_state, four.final_state)
    # ... and only the tokens after the first scanned boundary change (sequence 0: groups of 2, 4, 3, 3 chunks)
    lo = walk_group_bounds(12, 4)[2][0] * 64
    o1, o4 = one.o.reshape(-1, p.HV, p.V), four.o.reshape(-1, p.HV, p.V)
    assert torch.equal(o1[:lo], o4[:lo]) and not torch.equal(o1[lo:12 * 64 - 7], o4[lo:12 * 64 - 7])


def test_the_host_rule_for_the_group_count():
    # W950 _get_config with the tuned DEFAULT.json and 256 CUs: G = min(256 // (2 N H), cps // 4, 32),
    # 1 when cps < 24 or G < 4, at most cps
    assert aiter_gfx950_groups(1, 2, 32) == 8            # min(64, 8, 32)
    assert aiter_gfx950_groups(1, 12, 1024) == 10        # min(10, 256, 32)
    assert aiter_gfx950_groups(1, 2, 16384) == 32        # capped at split_max_groups
    assert aiter_gfx950_groups(4, 2, 64) == 1            # 16 chunks per sequence < 24
    assert aiter_gfx950_groups(1, 64, 4096) == 1         # 256 // 128 = 2 groups < 4
    for nc, G in ((12, 4), (5, 8), (33, 10), (0, 3)):
        b = walk_group_bounds(nc, G)
        assert len(b) == G and b[0][0] == 0 and b[-1][1] == nc
        assert all(b[i][1] == b[i + 1][0] for i in range(G - 1))
        sizes = [hi - lo for lo, hi in b]
        assert max(sizes) - min(sizes) <= 1 and (nc < G or sizes[0] == nc // G)


def test_keeping_the_state_operand_fp32_changes_the_result(weak_long):
    # the walk's bf16 cast of the fp32 state before the WMMA with w and qg (W1250:116): an fp32
    # operand gives other outputs, and a smaller error on a weak gate
    p, tr = weak_long
    r = RECIPES["aiter-gfx1250"]
    f32 = replace(r, operand_dtype=FP32)
    a, b = emulate(p, r), emulate(p, f32)
    assert not torch.equal(a.o, b.o) and not torch.equal(a.final_state, b.final_state)
    ea, eb = _err(p, tr, r), _err(p, tr, f32)
    assert eb["final_state"] < ea["final_state"], (ea, eb)


def test_the_bf16_inverse_times_beta_drives_the_correlated_keys_error():
    # A_inv diag(beta) rounded to bf16 once (P1250:336): in fp32 the state error falls to fla's level
    p = get_case("stress/correlated-keys-rho1-lb-0.01").build()
    tr = truth(p)
    r = RECIPES["aiter-gfx1250"]
    base, f32 = _err(p, tr, r), _err(p, tr, replace(r, inv_beta_dtype=FP32))
    assert base["final_state"] > 5e-2 > 2.5e-2 > f32["final_state"], (base, f32)


@pytest.mark.parametrize("recipe", AITER)
def test_a_saturated_gate_at_lb_minus_5_5_loses_the_last_token_of_each_band(recipe):
    # qn = bf16(q 2^lc scale) (P1250:211) with lc down to 16 lb log2(e) = -127 at the band's last
    # token: below bf16's normal range, so that token's own term aqk_ii is lost; fp32 factors keep it
    p = get_case("stress/saturated-gate-lb-5.5").build()
    tr = truth(p)
    o = emulate(p, recipe).o.double().reshape(-1, p.HV, p.V)
    t = tr.o.double().reshape(-1, p.HV, p.V)
    err = (o - t).norm(dim=(1, 2)) / t.norm(dim=(1, 2))
    pos = torch.arange(p.T) % 16
    assert err[pos == 15].median() > 0.1 > 1e-2 > err[pos != 15].median()
    fixed = emulate(p, replace(RECIPES[recipe], factor_dtype=FP32)).o.double().reshape(-1, p.HV, p.V)
    assert ((fixed - t).norm(dim=(1, 2)) / t.norm(dim=(1, 2)))[pos == 15].median() < 1e-2
    p5 = get_case("stress/saturated-gate-lb-5").build()      # lc >= -115.4: normal bf16, no loss
    assert _err(p5, truth(p5), recipe)["o"] < 1e-2


def test_the_kernel_gate_and_beta_formulas_are_fp32_roundings_of_the_oracle():
    from kda_ref.chunked import prepare_tokens
    from kda_ref.preprocess import LOG2E
    p = get_case("smoke/weak-gate-lb-0.1-vk").build()
    pieces = [(0, p.T)]
    pp = prepare_tokens(p, 0, p.T, None)
    for recipe in AITER:
        q, k, gk, beta = aiter_token_inputs(p, pieces, pp, RECIPES[recipe])
        assert torch.allclose(gk, LOG2E * pp.a, rtol=2e-6, atol=0) and not torch.equal(gk, LOG2E * pp.a)
        assert torch.allclose(beta, pp.beta, rtol=2e-6, atol=0)
        assert torch.allclose(q, pp.q, rtol=0, atol=1e-6) and torch.allclose(k, pp.k, rtol=0, atol=1e-6)
        assert q.dtype == torch.float64 and torch.equal(q, q.to(FP32).to(torch.float64))
    # the two architectures' formulas differ in their last bits
    a = aiter_token_inputs(p, pieces, pp, RECIPES["aiter-gfx1250"])[2]
    b = aiter_token_inputs(p, pieces, pp, RECIPES["aiter-gfx950"])[2]
    assert not torch.equal(a, b)


def test_a_paged_empty_fresh_sequence_keeps_its_slot_on_gfx950_only():
    # W950 stores a paged slot from the group holding the sequence's last chunk (none for 0 tokens);
    # W1250 stores it for every valid slot (zeros when the sequence has no initial state)
    p = _case("t", "paged-empty", lens=[0, 40], H=1, state="paged", paged_new=[0]).build()
    slot = int(p.state_indices[0])
    assert torch.isnan(p.state_cache[slot]).all()
    g1250, g950 = emulate(p, "aiter-gfx1250"), emulate(p, "aiter-gfx950")
    assert torch.equal(g1250.state_cache[slot], torch.zeros_like(g1250.state_cache[slot]))
    assert torch.isnan(g950.state_cache[slot]).all()
    other = int(p.state_indices[1])
    assert torch.equal(g1250.state_cache[other], g950.state_cache[other])


def test_the_emulator_refuses_what_the_host_asserts():
    from kda_kernels.base import Route
    from kda_kernels.emulator import EmulatorBackend
    emu = EmulatorBackend()
    p = _case("t", "lb", B=1, T=16, H=1, lb=-5.6).build()
    for name in AITER:
        ok, why = emu.accepts(p, Route(name=name, recipe=name))
        assert not ok and "lower_bound" in why and "-5.6" in why
    assert emu.accepts(_case("t", "lb", B=1, T=16, H=1, lb=-5.5).build(), Route(name=AITER[0], recipe=AITER[0]))[0]


def test_the_route_recipe_map():
    assert CHUNK_KDA_GLUON_RECIPES == {"gfx1250": "aiter-gfx1250", "gfx950": "aiter-gfx950"}
    assert chunk_kda_gluon_recipe("gfx950") == "aiter-gfx950" and chunk_kda_gluon_recipe("gfx942") == "flashkda"
    for name in CHUNK_KDA_GLUON_RECIPES.values():
        r = RECIPES[name]
        assert r.chunk == 64 and r.form == "aiter" and r.operand_dtype == BF16 and r.state_dtype == FP32
