"""The oracle's forms agree with the recurrence, and the workspace has the production layout."""
import math

import pytest
import torch

from kda_ref import truth
from kda_ref.chunked import chunked_from_workspace
from kda_ref.fla_form import fla_form
from kda_ref.preprocess import prepare
from kda_ref.recurrence import recurrence_prepared
from kda_ref.segments import segment_plan, segmented
from kda_ref.workspace import (EPS32, EPS64, exact_inverse, inverse_report, production_inverse, residual_ratio,
                               workspace_prepared)
from verification.investigating.selfcheck import RECIPES, Recipe, build, rel

F64 = torch.float64
BY_NAME = {r.name: r for r in RECIPES}

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py



def _problem(name, seed=0):
    return build(BY_NAME[name], seed)


@pytest.mark.parametrize("name", ["varlen-partial-empty", "saturated-lb-5.5", "softplus-mixed", "corr-1.0-beta-1",
                                  "paged", "gva", "vk-state"])
def test_every_form_matches_the_recurrence(name):
    pp = prepare(_problem(name))
    ref = recurrence_prepared(pp)
    for C in (16, 32, 64):
        ws = workspace_prepared(pp, C)
        o, fs = chunked_from_workspace(pp, ws)
        assert rel(o, ref.o) < 1e-12 and rel(fs, ref.final_state) < 1e-12, C
        for cps in (None, 1, 3):
            s = segmented(pp, ws, cps)
            assert rel(s.o, ref.o) < 1e-12 and rel(s.final_state, ref.final_state) < 1e-12, (C, cps)
    for BT in (32, 64):
        f = fla_form(pp, BT)
        assert rel(f.o, ref.o) < 1e-12 and rel(f.final_state, ref.final_state) < 1e-12, BT


def test_a_broken_chunk_step_is_caught():
    pp = prepare(_problem("dense"))
    ref = recurrence_prepared(pp)
    ws = workspace_prepared(pp, 16)
    ws.ws_inv[3, 5, 2] += 1e-9               # one entry of one inverse off by 1e-9
    o, fs = chunked_from_workspace(pp, ws)
    assert rel(o, ref.o) > 1e-12


def test_workspace_layout_is_head_major_with_zero_tails():
    p = _problem("varlen-partial-empty")      # lens 0, 17, 33, 0, 64, 5, 0
    pp = prepare(p)
    C = 16
    ws = workspace_prepared(pp, C)
    lens = [e - b for b, e in pp.bounds]
    tiles = sum(math.ceil(n / C) for n in lens)
    assert ws.tiles == tiles == 2 + 3 + 4 + 1
    HV, K = p.HV, p.K
    assert ws.ws_kd.shape == (HV * tiles, C, K) and ws.ws_gt.shape == (HV * tiles, K)
    assert ws.ws_inv.shape == ws.ws_mqk.shape == (HV * tiles, C, C) and ws.ws_beta.shape == (HV * tiles, C)
    # tile 1 is sequence 1's second chunk: tokens 16..16 (one valid row), tile 2 starts sequence 2
    assert ws.grid.tile_len.tolist() == [16, 1, 16, 16, 1, 16, 16, 16, 16, 5]
    assert ws.pivot.tolist() == [8, 0, 8, 8, 0, 8, 8, 8, 8, 4]
    hv, t = 1, 2
    idx = hv * tiles + t
    bos = ws.grid.tile_start[t].item()
    G = 1.4426950408889634 * torch.cumsum(pp.a[bos:bos + C, hv], 0)
    assert torch.allclose(ws.ws_kd[idx], pp.k[bos:bos + C, hv] * torch.exp2(G), rtol=1e-14, atol=0)
    assert torch.allclose(ws.ws_kr[idx], pp.k[bos:bos + C, hv] * torch.exp2(G[-1] - G), rtol=1e-14, atol=0)
    assert torch.allclose(ws.ws_gt[idx], torch.exp2(G[-1]), rtol=1e-14, atol=0)
    assert torch.equal(ws.ws_beta[idx], pp.beta[bos:bos + C, hv])
    i, j = 9, 4
    want = -pp.beta[bos + i, hv] * (pp.k[bos + i, hv] * pp.k[bos + j, hv] * torch.exp2(G[i] - G[j])).sum()
    assert torch.isclose(ws.L[idx, i, j], want, rtol=1e-13)
    want = pp.scale * (pp.q[bos + i, hv] * pp.k[bos + j, hv] * torch.exp2(G[i] - G[j])).sum()
    assert torch.isclose(ws.ws_mqk[idx, i, j], want, rtol=1e-13)
    # tails: tile 9 has 5 valid rows
    last = hv * tiles + 9
    for name in ("ws_kd", "ws_qd", "ws_kr", "ws_beta", "ws_mqk", "L"):
        assert torch.count_nonzero(getattr(ws, name)[last, 5:]) == 0, name
    assert torch.equal(ws.ws_inv[last, 5:, 5:], torch.eye(C - 5, dtype=F64))
    assert torch.count_nonzero(torch.triu(ws.L, 0)) == 0 and torch.count_nonzero(torch.triu(ws.ws_mqk, 1)) == 0


@pytest.mark.parametrize("C", [16, 32, 64])
def test_production_inverse_matches_the_triangular_solve(C):
    ws = workspace_prepared(prepare(_problem("weak-gate")), C)
    X = production_inverse(ws.L, F64)
    assert rel(X, ws.ws_inv) < 1e-12
    rep = inverse_report(ws)
    for k in ("ratio_exact", "ratio_prod64", "ratio_prod32"):
        assert float(rep[k].max()) <= 30, k
    assert float(rep["cond1"].min()) >= 1.0


def test_fp32_construction_is_judged_with_fp32_eps():
    L = workspace_prepared(prepare(_problem("corr-0.9-beta-1")), 32).L
    X32 = production_inverse(L, torch.float32)
    assert X32.dtype == torch.float32
    r32, r64 = residual_ratio(L, X32, EPS32), residual_ratio(L, X32, EPS64)
    assert float(r32.max()) <= 30 < float(r64.max())   # fp32 error is ~2^29 times fp64's
    assert float(residual_ratio(L, exact_inverse(L), EPS64).max()) <= 30


def test_pivot_form_survives_saturated_and_extreme_softplus_gates():
    for name, lb in (("saturated-lb-5.5", -5.5), ("softplus-wide", None)):
        pp = prepare(_problem(name))
        ws = workspace_prepared(pp, 64)
        for t in ws.tensors().values():
            assert torch.isfinite(t).all(), name
        if lb is not None:
            assert float(pp.a.min()) >= lb and float(pp.a.min()) < lb + 1e-6   # the gate saturates at lb


def test_segment_plan():
    bounds = [(0, 0), (0, 100), (100, 100), (100, 117)]
    plan = segment_plan(bounds, 16, 3)
    # seq 0: one 0-chunk segment; seq 1: 7 chunks -> 3+3+1; seq 2: 0-chunk; seq 3: 2 chunks
    assert plan.seq.tolist() == [0, 1, 1, 1, 2, 3]
    assert plan.nchunks.tolist() == [0, 3, 3, 1, 0, 2]
    assert plan.chunk_base.tolist() == [0, 0, 3, 6, 7, 7]
    assert plan.tok_base.tolist() == [0, 0, 48, 96, 100, 100]
    assert plan.tok_end.tolist() == [0, 48, 96, 100, 100, 117]
    assert plan.is_last.tolist() == [True, False, False, True, True, True]
    assert plan.seq_seg_off.tolist() == [0, 1, 4, 5, 6]
    assert plan.desc().shape == (6, 6) and plan.desc().dtype == torch.int32
    one = segment_plan(bounds, 16, None)
    assert one.nchunks.tolist() == [0, 7, 0, 2] and segment_plan(bounds, 16, 0).nchunks.tolist() == [0, 7, 0, 2]


def test_segments_compose_the_chunk_maps():
    pp = prepare(_problem("dense"))
    ws = workspace_prepared(pp, 16)
    s = segmented(pp, ws, 2)
    # pass A of segment 0 applied to S0 gives the state after its 2 chunks (recurrence at token 32)
    ref = recurrence_prepared(pp, chunk_size=16)
    n = int(s.plan.seq[1])
    assert int(s.plan.seq[0]) == n == 0
    got = s.A_seg[0] @ pp.S0[0] + s.b_seg[0]
    assert rel(got, ref.chunk_states[0, 2]) < 1e-12
    assert rel(s.h_in[1], ref.chunk_states[0, 2]) < 1e-12
    assert torch.equal(s.h_in[0], pp.S0[0])


def test_empty_sequence_keeps_its_initial_state():
    p = _problem("varlen-partial-empty")
    t = truth(p, method="segmented", chunk_size=16, chunks_per_seg=1)
    for n in (0, 3, 6):
        assert torch.equal(t.final_state[n], p.initial_state[n].double())


def test_truth_methods_and_workspace_extras():
    p = _problem("vk-state")
    ts = {m: truth(p, method=m, chunk_size=32, chunks_per_seg=1) for m in ("recurrence", "chunked", "segmented", "fla")}
    for m, t in ts.items():
        assert t.final_state.shape == p.initial_state.shape
        assert rel(t.o, ts["recurrence"].o) < 1e-12 and rel(t.final_state, ts["recurrence"].final_state) < 1e-12, m
    t = truth(p, workspace=True, chunk_size=32, chunks_per_seg=1)
    ex = t.extras
    tiles = math.ceil(77 / 32)
    assert ex["ws_inv"].shape == (p.HV * tiles, 32, 32) and ex["A_seg"].shape == (tiles, p.HV, p.K, p.K)
    assert ex["seg_desc"].shape == (6, tiles) and ex["seq_seg_off"].tolist() == [0, tiles]
    assert ex["ws_cond1"].shape == (p.HV * tiles,)
    with pytest.raises(ValueError, match="method: expected"):
        truth(p, method="nope")


def test_fla_intermediates_in_fla_layouts():
    p = _problem("dense")                 # B=2, T=70
    pp = prepare(p)
    f = fla_form(pp, 32)
    d = f.tensors(p.B, p.T)
    assert d["Aqk"].shape == (2, 70, p.HV, 32) and d["h"].shape == (2, 3, p.HV, p.K, p.V)
    # Akk = (I + L')^{-1} = (I - L)^{-1}: the workspace's inverse in token layout
    ws = workspace_prepared(pp, 32)
    inv = ws.heads("ws_inv")               # [HV, tiles, C, C]
    tile, hv = 1, 1                        # tokens 32..63 of sequence 0
    assert rel(f.Akk[32:64, hv], inv[hv, tile]) < 1e-12
    assert rel(f.h[0], pp.S0[0]) == 0 and rel(f.v_new[32:64, hv], f.u[32:64, hv] - f.w[32:64, hv] @ f.h[1, hv]) < 1e-14
    with pytest.raises(ValueError, match="chunk_size"):
        fla_form(pp, 16)


def test_numpy_path_matches_torch_path():
    from kda_ref import numpy_ref
    p = _problem("paged")
    pp, npp = prepare(p), numpy_ref.prepare(p)
    for key in ("q", "k", "v", "a", "beta", "S0"):
        assert rel(torch.from_numpy(npp[key]), getattr(pp, key)) < 1e-15, key
    o, fs = numpy_ref.chunked(npp, 16)
    ref = recurrence_prepared(pp)
    assert rel(torch.from_numpy(o), ref.o) < 1e-13 and rel(torch.from_numpy(fs), ref.final_state) < 1e-13
    ws = workspace_prepared(pp, 16)
    # sequence 2 (tokens 20..69), head 1, its first chunk = tile 2
    w = numpy_ref.chunk_workspace(npp["q"][20:36, 1], npp["k"][20:36, 1], npp["v"][20:36, 1], npp["a"][20:36, 1],
                                  npp["beta"][20:36, 1], npp["scale"], 16)
    idx = 1 * ws.tiles + 2
    for a, b in (("kd", "ws_kd"), ("qd", "ws_qd"), ("kr", "ws_kr"), ("gt", "ws_gt"), ("L", "L"), ("mqk", "ws_mqk"),
                 ("inv", "ws_inv")):
        assert rel(getattr(ws, b)[idx], torch.from_numpy(w[a])) < 1e-13, a
    assert rel(torch.from_numpy(w["inv_production"]), torch.from_numpy(w["inv"])) < 1e-12


def test_recipe_builder_is_deterministic():
    a, b = build(Recipe("x", lens=(5, 7)), 3), build(Recipe("x", lens=(5, 7)), 3)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
