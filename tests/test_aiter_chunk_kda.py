"""The aiter adapter's chunk_kda routes (``aiter.ops.triton.attention.chunk_kda``) and its launch
accounting for upstream's renamed FlashKDA layout (kimi_delta_attn: a Gluon pass C of its own),
by recorded calls: stand-in modules with chunk_kda's signature and launch objects record what the
adapter passes and what it does with the result.  Run everywhere (no GPU, no aiter tree).

chunk_kda on gfx1250 / gfx950 launches its Gluon ``prepare.chunk_kda_prepare_kernel`` and
``walk.chunk_kda_walk_kernel`` (gfx950 also ``walk.chunk_kda_scan_kernel``); on any other arch it
calls ``chunk_kimi_delta_attn``, which reaches ``flash_kda_fwd`` while its forward module's
``AITER_FDA_ENABLE`` is on.  The stand-ins do the same through fake launch objects.
"""
import types

import pytest
import torch

from kda_kernels.aiter import AiterBackend
from kda_kernels.base import Route
from kda_ref.problems import generate


class _Kernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append(self.name)


def _flash_stand_in():
    """The kimi_delta_attn flash_kda module's launch surface (the fallback's kernels)."""
    m = types.ModuleType("flash_kda_stand_in")
    m.__aiter_layout__ = "kimi_delta_attn"
    m.log = []
    m._prepare_fast = _Kernel(m.log, "K1")
    m._segment_fast = _Kernel(m.log, "K2")
    m._seg_scan_fast = _Kernel(m.log, "scan")
    m.AITER_FDA_USE_GLUON_K1 = m.AITER_FDA_USE_GLUON_K2 = True

    def flash_kda_fwd(*a, **kw):
        raise AssertionError("the chunk_kda routes call chunk_kda, not flash_kda_fwd")
    m.flash_kda_fwd = flash_kda_fwd
    return m


def _chunk_kda_stand_in(arch: str, flash, fwd, gluon_launches=("prepare", "walk")):
    """chunk_kda as aiter's host dispatches it: Gluon kernels on gfx1250 / gfx950, else the
    fallback, which launches FlashKDA's K1 and K2 while ``fwd.AITER_FDA_ENABLE`` is on (its C = 64
    pipeline, counted by nothing here, otherwise).  o = 1 into ``out``; the final state is the
    initial state as given (V-first), so a transposition the adapter gets wrong shows."""
    m = types.ModuleType("chunk_kda_stand_in")
    m._ARCH = arch
    m.calls, m.enable_during = [], []
    log = []
    if arch in ("gfx1250", "gfx950"):
        m.prepare = types.SimpleNamespace(chunk_kda_prepare_kernel=_Kernel(log, "prepare"))
        m.walk = types.SimpleNamespace(chunk_kda_walk_kernel=_Kernel(log, "walk"),
                                       chunk_kda_scan_kernel=_Kernel(log, "scan"))

    def chunk_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices=None,
                  chunk_offsets=None, scale=None, out=None, initial_state=None, output_final_state=False,
                  state_cache=None, state_indices=None, has_initial_state=None, out_gate=None,
                  norm_weight=None, norm_eps=1e-5, config=None):
        m.calls.append(dict(locals()))
        if m._ARCH in ("gfx1250", "gfx950"):
            for name in gluon_launches:
                {"prepare": m.prepare.chunk_kda_prepare_kernel, "walk": m.walk.chunk_kda_walk_kernel,
                 "K1": flash._prepare_fast}[name][(1,)]()
        else:
            m.enable_during.append(fwd.AITER_FDA_ENABLE)
            if fwd.AITER_FDA_ENABLE:
                flash._prepare_fast[(1,)]()
                flash._segment_fast[(1,)]()
        o = out if out is not None else torch.empty_like(v)
        o.fill_(1.0)
        if state_cache is not None:
            for slot in state_indices.tolist():
                state_cache[slot] = 2.0
            return o, None
        final = None
        if output_final_state:
            N = cu_seqlens.numel() - 1
            final = (initial_state.clone() if initial_state is not None
                     else torch.zeros(N, q.shape[2], v.shape[-1], q.shape[-1]))
        return o, final

    m.chunk_kda = chunk_kda
    return m


def _backend(arch="sm90", fda_enable=False, **kw):
    flash = _flash_stand_in()
    fwd = types.SimpleNamespace(AITER_FDA_ENABLE=fda_enable)
    ck = _chunk_kda_stand_in(arch, flash, fwd, **kw)
    return AiterBackend(module=flash, chunk_kda=ck, chunk_fwd=fwd), ck, flash, fwd


def route(name):
    return Route(name, recipe="flashkda")


# ----- which route a GPU has --------------------------------------------------------------------
def test_the_arch_chunk_kda_dispatches_on_decides_the_route():
    b, *_ = _backend("sm90")
    assert b.route_exists(route("chunk_kda:triton")) == (True, "")
    ok, why = b.route_exists(route("chunk_kda:gluon"))
    assert not ok and "gfx1250 / gfx950 only" in why and "sm90" in why and why.startswith("not applicable")
    b, *_ = _backend("gfx950")
    assert b.route_exists(route("chunk_kda:gluon")) == (True, "")
    ok, why = b.route_exists(route("chunk_kda:triton"))
    assert not ok and "gfx950" in why and "chunk_kda:gluon" in why


def test_an_int_arch_from_cuda_is_named_as_an_sm():
    b, ck, *_ = _backend("sm90")
    ck._ARCH = 90                      # aiter's arch_info on a CUDA device: Triton's int capability
    ok, why = b.route_exists(route("chunk_kda:gluon"))
    assert not ok and "this GPU is sm90" in why
    assert b.route_exists(route("chunk_kda:triton")) == (True, "")


def test_without_chunk_kda_its_routes_are_not_applicable():
    b = AiterBackend(module=_flash_stand_in())
    ok, why = b.route_exists(route("chunk_kda:triton"))
    assert not ok and "no chunk_kda" in why


def test_a_tree_without_upstreams_kimi_forward_has_no_fallback_route():
    """chunk_kda.py beside the 2026-08 kimi_delta_attn wrapper (no out=, no state_cache=): its
    fallback would raise TypeError on every call, so the route is not applicable, in words."""
    flash = _flash_stand_in()
    ck = _chunk_kda_stand_in("sm90", flash, types.SimpleNamespace(AITER_FDA_ENABLE=True))
    b = AiterBackend(module=flash, chunk_kda=ck, chunk_fwd=None)
    ok, why = b.route_exists(route("chunk_kda:triton"))
    assert not ok and "kimi_delta_attn forward" in why and "neither out nor state_cache" in why


def test_routes_and_recipes():
    b, *_ = _backend()
    by = {r.name: r for r in b.routes()}
    assert by["chunk_kda:triton"].recipe == "flashkda"        # the fallback is aiter's Triton FlashKDA
    assert by["chunk_kda:gluon"].recipe == "aiter-gfx1250"    # off gfx: the gfx1250 recipe names it
    for arch in ("gfx1250", "gfx950"):                         # on its GPU, that GPU's recipe
        g, *_ = _backend(arch)
        assert {r.name: r for r in g.routes()}["chunk_kda:gluon"].recipe == f"aiter-{arch}"
    assert dict(by["chunk_kda:gluon"].flags)["entry"] == "chunk_kda"
    assert dict(by["triton:unseg"].flags)["entry"] == "flash_kda"


# ----- what chunk_kda takes -----------------------------------------------------------------------
def test_refusals_in_chunk_kdas_own_terms():
    b, *_ = _backend("sm90")
    g, *_ = _backend("gfx1250")
    p = generate(dict(B=1, T=40, H=1, lb=-5.2), seed=0)
    ok, why = b.accepts(p, route("chunk_kda:triton"))
    assert not ok and "[-5.0, 0)" in why and "-5.2" in why     # chunk_kimi_delta_attn's safe range
    assert g.accepts(p, route("chunk_kda:gluon")) == (True, "")   # chunk_kda_prepare's [-5.5, 0)
    ok, why = g.accepts(generate(dict(B=1, T=40, H=1, lb=-5.6), seed=0), route("chunk_kda:gluon"))
    assert not ok and "[-5.5, 0)" in why
    ok, why = b.accepts(generate(dict(B=1, T=40, H=1, K=64, V=64), seed=0), route("chunk_kda:triton"))
    assert not ok and "K = V = 128" in why
    ok, why = b.accepts(generate(dict(B=1, T=40, H=1, HV=2), seed=0), route("chunk_kda:triton"))
    assert not ok and "one head count" in why
    p = generate(dict(B=1, T=40, H=1), seed=0)
    ok, why = b.accepts(p.replace(q=p.q.float(), k=p.k.float(), v=p.v.float()), route("chunk_kda:triton"))
    assert not ok and "bf16 q, k, v" in why
    ok, why = b.accepts(p.replace(beta_kind="identity"), route("chunk_kda:triton"))
    assert not ok and "beta sigmoid" in why


# ----- the mapping --------------------------------------------------------------------------------
def test_dense_batch_goes_in_packed_with_v_first_states_and_comes_back_in_the_problems_layout():
    b, ck, flash, fwd = _backend("sm90")
    p = generate(dict(B=2, T=40, H=2, state="kv"), seed=1)
    assert p.dt_bias is not None
    out = b.run(p, route("chunk_kda:triton"))
    c = ck.calls[-1]
    assert c["q"].shape == (1, 80, 2, 128) and torch.equal(c["q"][0, 40:], p.q[1])
    assert c["cu_seqlens"].dtype == torch.int64 and c["cu_seqlens"].tolist() == [0, 40, 80]
    assert c["A_log"].shape == (2,) and c["dt_bias"].shape == (256,) and c["dt_bias"].dtype == torch.float32
    assert c["initial_state"].shape == (2, 2, 128, 128)
    assert torch.equal(c["initial_state"], p.initial_state.float().transpose(-1, -2))   # V-first in
    assert c["output_final_state"] is True and c["state_cache"] is None and c["out_gate"] is None
    assert c["scale"] == p.scale_value and c["lower_bound"] == float(p.lower_bound)
    assert out.o.shape == p.v.shape and bool((out.o == 1).all())
    assert torch.equal(out.final_state, p.initial_state.float())                       # K-first out
    assert out.info["route_ran"] == "K1x1, K2x1"


def test_a_v_first_problem_keeps_its_layout_and_a_missing_dt_bias_is_zero():
    b, ck, *_ = _backend("sm90")
    p = generate(dict(lens=[30, 1, 50], H=1, state="vk"), seed=2)
    p = p.replace(dt_bias=None)
    out = b.run(p, route("chunk_kda:triton"))
    c = ck.calls[-1]
    assert torch.equal(c["initial_state"], p.initial_state.float())
    assert c["cu_seqlens"].tolist() == [0, 30, 31, 81]
    assert bool((c["dt_bias"] == 0).all()) and c["dt_bias"].shape == (128,)
    assert torch.equal(out.final_state, p.initial_state.float())


def test_paged_cache_is_a_padded_copy_written_in_place():
    b, ck, *_ = _backend("sm90")
    p = generate(dict(lens=[40, 70], H=1, state="paged", paged_new=[1], slot_pad=64), seed=0)
    before = p.state_cache.clone()
    out = b.run(p, route("chunk_kda:triton"))
    c = ck.calls[-1]
    sc = c["state_cache"]
    assert sc.stride() == p.state_cache.stride() and sc.data_ptr() != p.state_cache.data_ptr()
    assert c["state_indices"].dtype == torch.int32 and c["has_initial_state"].tolist() == [True, False]
    assert c["initial_state"] is None and c["output_final_state"] is False and c["out"] is not None
    assert out.state_cache is sc and out.final_state is None
    assert bool((out.state_cache[p.state_indices.long()] == 2.0).all())
    assert torch.equal(p.state_cache.view(torch.int32), before.view(torch.int32))   # the Problem's own


# ----- what ran -----------------------------------------------------------------------------------
def test_the_fallback_route_switches_flashkda_on_for_the_call_and_restores_it():
    b, ck, flash, fwd = _backend("sm90", fda_enable=False)
    b.run(generate(dict(B=1, T=40, H=1), seed=0), route("chunk_kda:triton"))
    assert ck.enable_during == [True] and fwd.AITER_FDA_ENABLE is False
    assert isinstance(flash._prepare_fast, _Kernel)                     # counters removed


def test_a_fallback_that_launches_no_flashkda_kernel_is_refused():
    """A tree whose chunk_kimi_delta_attn took its C = 64 pipeline: nothing the route names ran."""
    b, ck, flash, fwd = _backend("sm90")
    b._flash_kda_enabled = lambda: __import__("contextlib").nullcontext()   # the switch left off
    with pytest.raises(RuntimeError, match="counted no K1 launch"):
        b.run(generate(dict(B=1, T=40, H=1), seed=0), route("chunk_kda:triton"))


def test_the_gluon_route_counts_prepare_and_walk():
    b, ck, flash, _ = _backend("gfx1250")
    out = b.run(generate(dict(B=1, T=40, H=1, state="kv"), seed=0), route("chunk_kda:gluon"))
    assert out.info["route_ran"] == "gluon:preparex1, gluon:walkx1"
    assert out.info["layout"] == "chunk_kda on gfx1250"
    assert isinstance(ck.prepare.chunk_kda_prepare_kernel, _Kernel)


def test_the_record_names_only_pinned_configs_of_kernels_that_ran(monkeypatch):
    """On the Gluon route FlashKDA's autotuned kernels are pinned (and counted) but never launch:
    their pinned config is no part of what ran."""
    import contextlib
    b, *_ = _backend("gfx1250")

    @contextlib.contextmanager
    def pinned(r, counts):
        counts["K2:config"] = "{'BW': 32}"
        yield
    monkeypatch.setattr(b, "_pinned", pinned)
    out = b.run(generate(dict(B=1, T=40, H=1), seed=0), route("chunk_kda:gluon"))
    assert out.info["route_ran"] == "gluon:preparex1, gluon:walkx1"


@pytest.mark.parametrize("launches, why", [(("prepare",), "expected one Gluon prepare and the walk"),
                                           (("prepare", "walk", "K1"), "expected one Gluon prepare")])
def test_gluon_launches_that_contradict_the_route_are_refused(launches, why):
    b, *_ = _backend("gfx950", gluon_launches=launches)
    with pytest.raises(RuntimeError, match=why):
        b.run(generate(dict(B=1, T=40, H=1), seed=0), route("chunk_kda:gluon"))


def test_o_outside_out_is_refused():
    b, ck, *_ = _backend("sm90")
    inner = ck.chunk_kda
    ck.chunk_kda = lambda **kw: inner(**dict(kw, out=None))
    with pytest.raises(RuntimeError, match="another buffer than out"):
        b.run(generate(dict(B=1, T=40, H=1), seed=0), route("chunk_kda:triton"))


# ----- FlashKDA routes: upstream's Gluon pass C and contradicting Gluon launches ---------------
def test_confirm_takes_upstreams_gluon_pass_c_as_k2():
    """Upstream (kimi_delta_attn) runs pass C as the Gluon k2_c_fast: an unsegmented gluon route
    launches the Gluon K1 and that, no Triton K2."""
    r = dict(kernels="gluon", chunks_per_seg=0, prefetch=None)
    assert AiterBackend.confirm(r, {"gluon:K1": 1, "gluon:K2C": 1}, False) == "gluon:K1x1, gluon:K2Cx1"


@pytest.mark.parametrize("kernels, counts, why", [
    ("gluon-k2", {"gluon:K1": 1, "K1": 1, "gluon:K2C": 1}, "asks for the Triton K1 but the Gluon K1"),
    ("gluon-k1", {"gluon:K1": 1, "K2": 1, "gluon:K2": 1}, "asks for the Triton K2 but a Gluon K2"),
])
def test_confirm_refuses_a_gluon_kernel_the_route_did_not_ask_for(kernels, counts, why):
    with pytest.raises(RuntimeError, match=why):
        AiterBackend.confirm(dict(kernels=kernels, chunks_per_seg=0, prefetch=None), counts, None)


def test_the_norm_route_passes_gate_weight_and_eps_and_takes_only_norm_problems():
    """chunk_kda:gluon:norm hands chunk_kda out_gate (packed like v), norm_weight and norm_eps; it
    takes only problems that carry the norm, chunk_kda:gluon none that do (one place decides:
    kda_kernels.base.applicable), and off gfx1250 / gfx950 it is not applicable with the reason."""
    from kda_kernels.base import applicable
    b, ck, *_ = _backend("gfx1250")
    routes = {r.name: r for r in b.routes()}
    assert routes["chunk_kda:gluon:norm"].flag("fused_norm") and not routes["chunk_kda:gluon"].flag("fused_norm")
    assert routes["chunk_kda:gluon:norm"].recipe == "aiter-gfx1250"
    p = generate(dict(B=2, T=40, H=1, state="kv", norm=True, norm_eps=1e-6), seed=0)
    assert applicable(b, p, routes["chunk_kda:gluon:norm"]) == (True, "")
    out = b.run(p, routes["chunk_kda:gluon:norm"])
    kw = ck.calls[-1]
    assert kw["out_gate"].shape == (1, 80, 1, 128) and torch.equal(kw["out_gate"][0, 40:], p.out_gate[1])
    assert torch.equal(kw["norm_weight"], p.norm_weight) and kw["norm_eps"] == 1e-6
    assert out.info["route_ran"] == "gluon:preparex1, gluon:walkx1"
    ok, why = applicable(b, p, routes["chunk_kda:gluon"])
    assert not ok and "fused output norm" in why
    ok, why = applicable(b, p.replace(out_gate=None, norm_weight=None), routes["chunk_kda:gluon:norm"])
    assert not ok and "no out_gate / norm_weight" in why
    b.run(p.replace(out_gate=None, norm_weight=None), routes["chunk_kda:gluon"])
    assert ck.calls[-1]["out_gate"] is None
    sm = _backend("sm90")[0]
    ok, why = applicable(sm, p, {r.name: r for r in sm.routes()}["chunk_kda:gluon:norm"])
    assert not ok and "Gluon prepare and walk on gfx1250 / gfx950 only" in why
