"""CPU tests of the production-kernel adapters' mapping from a Problem to the library call.

fla, aiter and Moonshot's flash_kda run only on GPUs. Here the fla mapping is checked as
pure data (no fla import), and aiter is replaced by a *recorded* stand-in module that
launches stand-in kernels the way aiter's flash_kda_fwd does (K1, pass A/B when
segmented, pass C), because aiter is not importable without a GPU.
"""
import os
import types

import pytest
import torch

from kda_kernels import aiter as aiter_mod
from kda_kernels import fla as fla_mod
from kda_kernels import moonshot as moon_mod
from kda_kernels.base import Route
from kda_ref.problems import generate


def _problem(T=100, H=2, K=128, V=128, cu=None, layout="kv", gate="lower_bound", lb=-5.0, state=True):
    """The generator's problem: g = N(0,1), an N(0,1) initial state in ``layout`` (kv / vk; with
    layout paged and state False, no state and the kv layout for the test to replace)."""
    sizes = dict(B=1, T=T) if cu is None else dict(lens=[b - a for a, b in zip(cu[:-1], cu[1:])])
    p = generate(dict(sizes, H=H, K=K, V=V, gate=gate, lb=lb, g_scale=1.0, state_scale=1.0,
                      state=layout if state and layout != "paged" else "none"), seed=0)
    return p.replace(state_layout=layout) if layout == "paged" else p


# ----- fla ---------------------------------------------------------------------------------
def test_fla_chunk_mapping_lower_bound_vk_varlen():
    p = _problem(cu=[0, 40, 100], layout="vk")
    name, kw = fla_mod.call_arguments(p, Route("chunk:safe_gate:C=32", recipe="fla"))
    assert name == "chunk_kda"
    assert kw["chunk_size"] == 32 and kw["safe_gate"] is True
    assert kw["use_gate_in_kernel"] and kw["lower_bound"] == -5.0 and kw["A_log"] is p.A_log
    assert kw["state_v_first"] is True and kw["initial_state"].dtype == torch.float32
    assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens"] is not p.cu_seqlens  # fresh copy
    assert kw["use_qk_l2norm_in_kernel"] and kw["use_beta_sigmoid_in_kernel"] and not kw["allow_neg_eigval"]


def test_fla_softplus_pregated_and_sigmoid2():
    p = _problem(gate="softplus").replace(beta_kind="sigmoid2")
    _, kw = fla_mod.call_arguments(p, Route("chunk:exact", recipe="fla"))
    assert kw["use_gate_in_kernel"] and kw["lower_bound"] is None and kw["allow_neg_eigval"]
    p2 = _problem(gate="pregated").replace(beta_kind="pregated")
    name, kw2 = fla_mod.call_arguments(p2, Route("fused_recurrent", recipe="fla"))
    assert name == "fused_recurrent_kda" and not kw2["use_gate_in_kernel"] and not kw2["use_beta_sigmoid_in_kernel"]
    assert "chunk_size" not in kw2


def test_fla_accepts_says_why():
    b = fla_mod.FlaBackend()
    ok, why = b.accepts(_problem(layout="paged", state=False).replace(
        state_cache=torch.zeros(3, 2, 128, 128), state_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([True])), Route("chunk:safe_gate"))
    assert not ok and "paged" in why
    ok, why = b.accepts(_problem(gate="softplus"), Route("chunk:safe_gate"))
    assert not ok and "safe_gate" in why
    ok, why = b.accepts(_problem(lb=-5.5), Route("chunk:safe_gate"))
    assert not ok and "[-5, 0)" in why
    assert b.accepts(_problem(lb=-5.5), Route("chunk:exact")) == (True, "")


# ----- aiter (recorded stand-in) ------------------------------------------------------------
class _FakeKernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append(self.name)


def _fake_aiter(with_gluon=False, paged=False):
    """A stand-in for aiter's flash_kda module that records its calls and launches."""
    m = types.ModuleType("fake_flash_kda")
    m.__aiter_layout__ = "recorded"
    m.calls, m.log = [], []
    m._flash_kda_prepare_kernel = _FakeKernel(m.log, "K1")
    m._flash_kda_segment_kernel = _FakeKernel(m.log, "K2")
    m._flash_kda_seg_scan_kernel = _FakeKernel(m.log, "scan")
    if with_gluon:
        m.AITER_FDA_USE_GLUON_K1 = True
        m.AITER_FDA_USE_GLUON_K2 = True

    def flash_kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state=None,
                      output_final_state=False, state_v_first=False, cu_seqlens=None, chunk_indices=None,
                      chunks_per_seg=None, **extra):
        m.calls.append(dict(locals()))
        bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
        nmax = max(-(-(b - a) // 32) for a, b in zip(bounds[:-1], bounds[1:]))
        m._flash_kda_prepare_kernel[(1,)]()
        cps = nmax if chunks_per_seg is None or chunks_per_seg <= 0 else chunks_per_seg
        if nmax > cps:
            m._flash_kda_segment_kernel[(1,)]()
            m._flash_kda_seg_scan_kernel[(1,)]()
        m._flash_kda_segment_kernel[(1,)]()
        N = len(bounds) - 1
        fs = torch.zeros(N, q.shape[2], 128, 128) if output_final_state else None
        return torch.zeros_like(v), fs

    m.flash_kda_fwd = flash_kda_fwd
    if paged:
        def flash_kda_fwd_paged(*a, out=None, state_cache=None, state_indices=None, has_initial_state=None, **kw):
            return flash_kda_fwd(*a, **kw)
        m.flash_kda_fwd = flash_kda_fwd_paged
    return m


def test_aiter_route_names_parse_and_reject():
    assert aiter_mod.parse_route("gluon-k2:seg:cps=4:prefetch=on") == dict(entry="flash_kda", kernels="gluon-k2",
                                                                          chunks_per_seg=4, prefetch=True)
    assert aiter_mod.parse_route("chunk_kda:triton") == dict(entry="chunk_kda", kernels="triton",
                                                             chunks_per_seg=None, prefetch=None, fused_norm=False)
    assert aiter_mod.parse_route("chunk_kda:gluon:norm") == dict(entry="chunk_kda", kernels="gluon",
                                                                 chunks_per_seg=None, prefetch=None, fused_norm=True)
    assert aiter_mod.parse_route("triton:unseg")["chunks_per_seg"] == 0
    assert aiter_mod.parse_route("triton:seg")["chunks_per_seg"] is None
    with pytest.raises(ValueError, match="--route: expected"):
        aiter_mod.parse_route("triton:segmented")


def test_aiter_mapping_and_launch_confirmation():
    fake = _fake_aiter()
    b = aiter_mod.AiterBackend(module=fake)
    p = _problem(T=200, cu=[0, 150, 150, 200], layout="vk")
    out = b.run(p, Route("triton:seg:cps=1"))
    call = fake.calls[-1]
    assert call["chunks_per_seg"] == 1 and call["state_v_first"] is True
    assert call["cu_seqlens"].dtype == torch.int64 and call["dt_bias"].shape == (2 * 128,)
    assert call["initial_state"].dtype == torch.float32
    assert "scanx1" in out.info["route_ran"] and "K1x1" in out.info["route_ran"]
    b.run(p, Route("triton:unseg"))
    assert fake.calls[-1]["chunks_per_seg"] == 0 and fake.log[-1] == "K2" and "scan" not in fake.log[-2:]


def test_aiter_contradicting_launches_are_refused():
    fake = _fake_aiter()
    b = aiter_mod.AiterBackend(module=fake)
    fake.flash_kda_fwd_orig = fake.flash_kda_fwd

    def never_segments(*a, chunks_per_seg=None, **kw):  # a library that ignores chunks_per_seg
        return fake.flash_kda_fwd_orig(*a, chunks_per_seg=0, **kw)
    fake.flash_kda_fwd = never_segments
    with pytest.raises(RuntimeError, match="no scan launched"):
        b.run(_problem(T=200), Route("triton:seg:cps=1"))


def test_aiter_flags_are_restored_and_gluon_needs_gfx950():
    fake = _fake_aiter(with_gluon=True)
    b = aiter_mod.AiterBackend(module=fake)
    ok, why = b.accepts(_problem(), Route("gluon:unseg"))
    assert not ok and "gfx950" in why
    b.run(_problem(), Route("triton:unseg"))
    assert fake.AITER_FDA_USE_GLUON_K1 is True and fake.AITER_FDA_USE_GLUON_K2 is True  # restored
    assert isinstance(fake._flash_kda_prepare_kernel, _FakeKernel)  # counters removed
    ok, why = aiter_mod.AiterBackend(module=_fake_aiter()).accepts(_problem(), Route("gluon-k1:unseg"))
    assert not ok and "no Gluon" in why
    ok, why = b.accepts(_problem(), Route("triton:seg:prefetch=on"))
    assert not ok and "AITER_FDA_SCAN_PREFETCH" in why


class _RecordingJit:
    """Stands in for a JITFunction under a real Triton Autotuner: records each launch's keywords."""

    def __init__(self):
        self.launches = []

        def kernel(x):
            pass
        self.fn, self.arg_names = kernel, ["x"]

    def run(self, *args, grid=None, warmup=False, **kwargs):
        self.launches.append(kwargs)


def _autotuned(configs, prune=None):
    """A real triton.runtime.autotuner.Autotuner over a recording stand-in (imported when a test runs)."""
    from triton.runtime.autotuner import Autotuner
    jit = _RecordingJit()
    return Autotuner(jit, jit.arg_names, list(configs), key=["x"], reset_to_zero=None, restore_value=None,
                     prune_configs_by={"early_config_prune": prune} if prune else None), jit


def _aiter_2026_08_lists():
    """K1's configs with aiter's autotune flag on (its default, 2 warps 1 stage, first) and K2's
    with the flag off (BW 16/32/64), as aiter 2026-08 builds them."""
    import triton
    k1 = [triton.Config({}, num_warps=nw, num_stages=ns) for nw in (2, 4) for ns in (1, 2)]
    k2 = [triton.Config({"BW": 16}, num_warps=2, num_stages=2), triton.Config({"BW": 32}, num_warps=2, num_stages=2),
          triton.Config({"BW": 64}, num_warps=4, num_stages=2)]
    return k1, k2


def test_aiter_pins_real_autotuners_by_its_own_rule_through_the_shared_helper():
    """First BW=32 in aiter's order, else aiter's first (not fla's 4-warps-first rule)."""
    k1, k2 = _aiter_2026_08_lists()
    fake = _fake_aiter()
    fake._flash_kda_prepare_kernel, jit1 = _autotuned(k1)
    fake._flash_kda_segment_kernel, jit2 = _autotuned(k2)
    tuner1, tuner2 = fake._flash_kda_prepare_kernel, fake._flash_kda_segment_kernel
    out = aiter_mod.AiterBackend(module=fake).run(_problem(T=200), Route("triton:seg:cps=1"))
    assert [(c["num_warps"], c["num_stages"]) for c in jit1.launches] == [(2, 1)]
    assert [(c["BW"], c["num_warps"], c["num_stages"]) for c in jit2.launches] == [(32, 2, 2)] * 2
    ran = out.info["route_ran"]
    assert "K1:config={}" in ran and "K2:config={'BW': 32}" in ran and "K2x2" in ran and "scanx1" in ran
    assert tuner1.configs == k1 and tuner2.configs == k2          # aiter's own lists back after the call
    assert fake._flash_kda_prepare_kernel is tuner1 and fake._flash_kda_segment_kernel is tuner2
    from triton.runtime.autotuner import Autotuner
    assert Autotuner.run is Autotuner.__dict__["run"] and Autotuner.run.__name__ == "run"   # Triton's run back


def test_aiter_a_single_config_autotuner_is_left_alone_and_unrecorded():
    k1, _ = _aiter_2026_08_lists()
    fake = _fake_aiter()
    fake._flash_kda_prepare_kernel, jit1 = _autotuned(k1[:1])
    out = aiter_mod.AiterBackend(module=fake).run(_problem(), Route("triton:unseg"))
    assert len(jit1.launches) == 1 and "config" not in out.info["route_ran"]


def test_aiter_an_autotuner_it_did_not_pin_raises_instead_of_benchmarking():
    k1, k2 = _aiter_2026_08_lists()
    fake = _fake_aiter(with_gluon=True)
    stray, jit = _autotuned(k2)
    fwd = fake.flash_kda_fwd

    def with_a_stray_launch(*a, **kw):
        stray[(1,)](0)
        return fwd(*a, **kw)
    fake.flash_kda_fwd = with_a_stray_launch
    with pytest.raises(aiter_mod._autotune_pin.UnpinnedAutotuneError,
                       match=r"would autotune among 3 configs in aiter \(recorded layout\)"):
        aiter_mod.AiterBackend(module=fake).run(_problem(), Route("triton:unseg"))
    assert jit.launches == [] and fake.AITER_FDA_USE_GLUON_K1 is True          # flags restored


def test_aiter_a_pruning_autotuner_is_refused_and_everything_restored():
    k1, _ = _aiter_2026_08_lists()
    fake = _fake_aiter(with_gluon=True)
    tuner, jit = _autotuned(k1, prune=lambda configs, nargs, **kw: configs[:1])
    fake._flash_kda_prepare_kernel = tuner
    with pytest.raises(ValueError, match=r"kernels: 'K1' prunes its configs per launch"):
        aiter_mod.AiterBackend(module=fake).run(_problem(), Route("triton:unseg"))
    assert fake._flash_kda_prepare_kernel is tuner and tuner.configs == k1 and jit.launches == []
    assert fake.AITER_FDA_USE_GLUON_K1 is True and fake.AITER_FDA_USE_GLUON_K2 is True


def test_aiter_paged_only_where_supported():
    paged = _problem(layout="paged", state=False).replace(
        state_cache=torch.zeros(4, 2, 128, 128), state_indices=torch.tensor([2], dtype=torch.int32),
        has_initial_state=torch.tensor([True]))
    ok, why = aiter_mod.AiterBackend(module=_fake_aiter()).accepts(paged, Route("triton:unseg"))
    assert not ok and "paged" in why
    assert aiter_mod.AiterBackend(module=_fake_aiter(paged=True)).accepts(paged, Route("triton:unseg"))[0]


def test_aiter_env_segment_override_cannot_leak_into_a_route(monkeypatch):
    monkeypatch.setenv("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", "4")
    fake = _fake_aiter()
    aiter_mod.AiterBackend(module=fake).run(_problem(T=200), Route("triton:unseg"))
    assert "scan" not in fake.log
    assert os.environ["CHUNK_DELTA_ATTN_FLASH_KDA_SEG"] == "4"


# ----- moonshot ------------------------------------------------------------------------------
def test_moonshot_mapping_is_v_first_with_2d_dt_bias():
    p = _problem(cu=[0, 60, 100])
    kw = moon_mod.call_arguments(p)
    assert kw["dt_bias"].shape == (2, 128) and kw["cu_seqlens"].dtype == torch.int64
    assert torch.equal(kw["initial_state"], p.initial_state.transpose(-1, -2))
    assert kw["final_state"].shape == (2, 2, 128, 128) and kw["out"].dtype == torch.bfloat16
    ok, why = moon_mod.MoonshotBackend().accepts(p.replace(gate="softplus", lower_bound=None), Route("cutlass"))
    assert not ok and "lower_bound" in why


def test_aiter_pins_an_autotuner_under_a_heuristics_wrapper():
    """aiter's K1 is an Autotuner wrapped by triton.heuristics: its configs must be pinned too."""
    class Cfg:
        def __init__(self, bw):
            self.kwargs = {"BW": bw}

    class Tuner(_FakeKernel):
        def __init__(self, log):
            super().__init__(log, "K1")
            self.configs = [Cfg(16), Cfg(32), Cfg(64)]

    class Heuristics:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return self.fn[grid]

    fake = _fake_aiter()
    tuner = Tuner(fake.log)
    fake._flash_kda_prepare_kernel = Heuristics(tuner)
    out = aiter_mod.AiterBackend(module=fake).run(_problem(), Route("triton:unseg"))
    assert "K1:config={'BW': 32}" in out.info["route_ran"]
    assert [c.kwargs["BW"] for c in tuner.configs] == [16, 32, 64]     # restored after the call
