"""The adapters' trace-call mapping without running a kernel: aiter's kda:gluon decode (no AMD GPU
here) against a recording stand-in of attention/kda.py, its applicability by arch and trace, and
the shared pieces of kda_kernels.trace_support (the engine's gather / scatter, copy_back)."""
import types

import pytest
import torch

from kda_kernels.aiter import AiterBackend
from kda_kernels.base import copy_with_padding
from kda_kernels.fla import recurrent_call_arguments
from kda_kernels.trace_calls import split_step
from kda_kernels.trace_support import copy_back, gather_states, scatter_states
from kda_ref.trace_gen import generate


def _fake_kda(arch: str, calls: list):
    def fused_recurrent_kda(**kw):
        calls.append(kw)
        return torch.zeros_like(kw["v"]), kw["initial_state"]
    return types.SimpleNamespace(_ARCH=arch, fused_recurrent_kda_packed_decode_kernel=object(),
                                 fused_recurrent_kda=fused_recurrent_kda)


def _backend(arch, calls=None):
    return AiterBackend(module=types.SimpleNamespace(flash_kda_fwd=None), chunk_kda_why="not given",
                        kda=_fake_kda(arch, [] if calls is None else calls))


def _route(b):
    return {r.name: r for r in b.trace_routes()}["kda:gluon"]


def test_kda_gluon_takes_the_recipe_of_its_arch():
    assert _route(_backend("gfx1250")).recipe == "aiter-decode-gfx1250"
    assert _route(_backend("gfx950")).recipe == "aiter-decode-gfx950"
    assert dict(_route(_backend("gfx950")).flags)["groups"] == ("decode", "spec")


@pytest.mark.parametrize("arch,scenario,knobs,words", [
    ("sm90", "spec", {}, "Gluon packed decode of gfx1250 / gfx950 only"),
    ("gfx950", "spec", {}, "no speculative decoding"),
    ("gfx950", "slot-reuse", dict(layout="kv"), "layout kv"),
    ("gfx1250", "slot-reuse", dict(cache_dtype="bfloat16"), "float32"),
    ("gfx1250", "slot-reuse", {}, "gives slot 0 to a decode or spec row"),
])
def test_kda_gluon_refuses_what_its_kernels_cannot_take(arch, scenario, knobs, words):
    b = _backend(arch)
    ok, why = b.trace_accepts(generate(1, scenario, **knobs), _route(b))
    assert not ok and why.startswith("not applicable: ") and words in why, why


@pytest.mark.parametrize("arch,scenario,knobs", [("gfx1250", "spec", dict(layout="kv", pad="null0")), ("gfx950", "null-block", {}),
                                                  ("gfx1250", "mixed", dict(pad="null0")),
                                                  ("gfx1250", "graph-padded", dict(slots=7))])
def test_kda_gluon_maps_every_call_onto_the_cache_view(arch, scenario, knobs):
    calls = []
    b = _backend(arch, calls)
    tr = generate(2, scenario, **knobs)
    if arch == "gfx950":      # gfx950 runs no spec rows: a decode-only trace
        tr = generate(2, scenario, spec_k=0, spec_fraction=0.0, **knobs)
    assert b.trace_accepts(tr, _route(b)) == (True, "")
    cache = tr.cache.allocate(fill=0.0)
    seen = set()
    for s in range(tr.steps):
        for c in split_step(tr, s, cache):
            if c.group == "prefill":
                continue
            o = b.run_call(c, _route(b))
            kw = calls[-1]
            seen.add(c.group)
            assert o.shape == c.v.shape
            view = c.slots_view()
            assert kw["initial_state"].data_ptr() == view.data_ptr() and kw["initial_state"].stride() == view.stride()
            assert kw["inplace_final_state"] and kw["state_v_first"] == (tr.cache.layout == "vk")
            assert torch.equal(kw["ssm_state_indices"], c.state_indices)
            assert kw["ssm_state_indices"].dim() == (2 if c.group == "spec" else 1)
            assert (kw["num_accepted_tokens"] is None) == (c.group != "spec")
            assert kw["pad_slot_guard"]
            assert kw["use_gate_in_kernel"] and kw["lower_bound"] == tr.lower_bound
            assert kw["use_beta_sigmoid_in_kernel"] and kw["use_qk_l2norm_in_kernel"]
            assert kw["dt_bias"].shape == (tr.HV * tr.K,) and kw["cu_seqlens"].dtype == torch.int64
    assert seen and ("spec" in seen) == bool((tr.row_phase == 2).any()), seen


def test_fla_recurrent_arguments_follow_the_trace_options():
    tr = generate(1, "spec", gate="softplus", beta_kind="sigmoid2", layout="kv")
    cache = tr.cache.allocate(fill=0.0)
    c = next(c for s in range(tr.steps) for c in split_step(tr, s, cache) if c.group == "spec")
    kw = recurrent_call_arguments(c)
    assert kw["use_gate_in_kernel"] and kw["lower_bound"] is None and kw["A_log"] is tr.A_log
    assert kw["use_beta_sigmoid_in_kernel"] and kw["allow_neg_eigval"] and not kw["state_v_first"]
    assert kw["num_accepted_tokens"] is c.num_accepted_tokens and kw["ssm_state_indices"].shape == c.state_indices.shape
    assert kw["initial_state"].data_ptr() == c.slots_view().data_ptr()


def test_gather_zeroes_new_rows_and_scatter_rounds_to_the_cache():
    tr = generate(3, "chunked-prefill", cache_dtype="bfloat16", slot_pad=1)
    cache = tr.cache.allocate(fill=0.0)
    cache.copy_(torch.randn(cache.shape))
    before = cache.clone()
    c = next(c for s in range(1, tr.steps) for c in split_step(tr, s, cache)
             if c.group == "prefill" and c.has_initial_state.any())
    init = gather_states(c)
    view = c.slots_view()
    assert init.dtype == torch.float32 and init.is_contiguous()
    for n, (slot, has) in enumerate(zip(c.state_indices.tolist(), c.has_initial_state.tolist())):
        assert torch.equal(init[n], view[slot].float() if has else torch.zeros_like(init[n]))
    final = torch.randn_like(init)
    scatter_states(c, final)
    for n, slot in enumerate(c.state_indices.tolist()):
        assert torch.equal(view[slot], final[n].to(torch.bfloat16))
    untouched = torch.ones_like(cache, dtype=torch.bool)
    for slot in c.state_indices.tolist():
        tr.cache.view(untouched)[slot] = False
    assert torch.equal(cache[untouched].view(torch.int16), before[untouched].view(torch.int16))


def test_copy_back_brings_every_element_the_kernel_wrote():
    tr = generate(3, "slot-reuse", slot_pad=2, guard_rows=3)
    cache = tr.cache.allocate(fill=0.0)
    c = split_step(tr, 0, cache)[0]
    priv = copy_with_padding(c.slots_view())
    flat = priv.new_empty(0).set_(priv.untyped_storage(), 0, (cache.numel(),), (1,))
    flat[0] = 7.0          # a guard row
    flat[-1] = 8.0         # the last guard row
    priv[1, 0, 0, 0] = 9.0  # a slot
    copy_back(c, priv)
    assert cache[0] == 7.0 and cache[-1] == 8.0 and c.slots_view()[1, 0, 0, 0] == 9.0
    assert int((cache != 0).sum()) == 3
