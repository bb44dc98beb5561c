"""The emulator's serving-trace routes (kda_kernels.emulator, RunsTraces) and the trace controls
of emulator-bad (kda_kernels.controls), step by step against kda_ref.trace_oracle.

A trace runs through kda_kernels.trace_calls.split_step; each group goes to the route under
test, or, where the route does not run that group, takes the oracle's result (its rows' outputs,
and the slots they write set to the oracle's states in the cache's dtype).  Errors are
max|got - truth| / max|truth| per step (o over a row's tokens, a written slot's content).

Bounds (measured on seed 0 of every named scenario, K = V = 32 unless stated, 2026-12-03,
``python -m pytest -q -s tests/test_emulator_traces.py`` prints every figure):
  fp32 decode recipes (fla-recurrent, aiter-decode-gfx1250, aiter-decode-gfx950 at K = V = 128):
      o up to 5.6e-7 (gfx1250, decode-long), slots up to 3.2e-7 -> DECODE_FP32 = 2e-6 (fp32
      registers and state; 3.5x the worst)
  fla-recurrent on a bf16 cache (spec, both layouts; short-prompts, chunked-prefill, slot-reuse
      measured once): o up to 3.2e-3, slots up to 5.0e-3 -> DECODE_BF16 = 1.5e-2 (each token's
      state stored bf16, 2^-8 relative per store; 3x the worst)
  prefill recipes (flashkda, aiter-gfx1250, aiter-gfx950): o up to 8.6e-3 (aiter, null-block),
      slots up to 6.1e-3 -> PREFILL = 2e-2 (bf16 tiles; 2.3x the worst)
The controls leave these bounds by 10x or more at the step, request or slot each test names.
"""
from __future__ import annotations

import pytest
import torch

from kda_kernels.base import RunsTraces
from kda_kernels.controls import TRACE_CONTROLS, negative_control
from kda_kernels.emulator import (DECODE_RECIPES, PREFILL_TRACE_RECIPES, EmulatorBackend, _decode_inputs,
                                  _decode_token, exact_decode_recipe)
from kda_kernels.trace_calls import assemble, split_step
from kda_ref.chunked import prepare_tokens
from kda_ref.recurrence import token_step
from kda_ref.trace import DECODE, PAD, PREFILL, SPEC, CacheSpec
from kda_ref.trace_gen import SCENARIOS, generate, trace_from_rows
from kda_ref.trace_oracle import trace_oracle

F64 = torch.float64
DECODE_FP32, DECODE_BF16, PREFILL_BOUND = 2e-6, 1.5e-2, 2e-2
EMU = EmulatorBackend()
BAD = negative_control()
ROUTES = {r.name: r for r in EMU.trace_routes()}
CONTROLS = {r.name: r for r in BAD.trace_routes()}
SMALL = dict(K=32, V=32)
# decode-long is 1000 decodes at H = HV = 8, K = V = 128 by default: 60 decodes at the small sizes here
SCENARIO_KNOBS = {name: dict(SMALL, **({"decodes": (60, 60), "H": 2, "HV": 2} if name == "decode-long" else {}))
                  for name in SCENARIOS}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def run_trace(tr, runners: dict, thr: float = float("inf"), stop: bool = False):
    """Run ``tr`` step by step (``runners``: {group: (backend, route)}, other groups fed by the
    oracle) and return (worst o error, worst slot error, first failure or None).  A failure: a row
    whose o errs above ``thr`` ("step s request r"), a written slot above ``thr`` ("step s slot
    n"), a slot not written by the step or a guard/padding element whose bits changed
    ("step s slot n unchanged" / "step s guard rows"); ``stop``: return at the first failure's step."""
    spec = tr.cache
    cache = spec.allocate()
    outside = spec.outside_slots()
    view = spec.view(cache)
    worst_o = worst_s = 0.0
    fail = None
    for s, truth in enumerate(trace_oracle(tr)):
        before = cache.clone()
        calls = split_step(tr, s, cache)
        outs, fed = [], set()
        for c in calls:
            if c.group in runners:
                be, rt = runners[c.group]
                outs.append(be.run_call(c, rt).to(F64))
            else:
                outs.append(torch.full((1, c.tokens, tr.HV, tr.V), float("nan"), dtype=F64))
                fed.update(int(r) for r in c.rows)
        o = assemble(calls, outs, truth.o.shape[0])
        for rp in truth.plan.rows:
            ot = rp.tok0 - truth.plan.tok0
            if rp.row in fed:
                o[ot:ot + rp.T] = truth.o[ot:ot + rp.T]
                for _, slot in rp.writes:
                    view[slot] = truth.expected(slot).to(cache.dtype)
            ref = truth.o[ot:ot + rp.T]
            e = ((o[ot:ot + rp.T] - ref).abs().max() / ref.abs().max()).item()
            worst_o = max(worst_o, e)
            if fail is None and not e <= thr:
                fail = f"step {s} request {rp.request}"
        bview = spec.view(before)
        for slot in range(spec.slots):
            if slot in truth.written:
                ex = truth.expected(slot)
                e = ((view[slot].to(F64) - ex).abs().max() / ex.abs().max()).item()
                worst_s = max(worst_s, e)
                if fail is None and not e <= thr:
                    fail = f"step {s} slot {slot}"
            elif fail is None and not torch.equal(_bits(view[slot]), _bits(bview[slot])):
                fail = f"step {s} slot {slot} unchanged"
        if fail is None and not torch.equal(_bits(cache[outside]), _bits(before[outside])):
            fail = f"step {s} guard rows"
        if fail is not None and stop:
            break
    return worst_o, worst_s, fail


def runners_of(backend, route) -> dict:
    return {g: (backend, route) for g in route.flag("groups")}


# ----------------------------------------------------------------------------- the routes
def test_trace_routes_are_named_by_their_recipe_and_say_their_groups():
    assert isinstance(EMU, RunsTraces) and isinstance(BAD, RunsTraces)
    assert set(ROUTES) == set(PREFILL_TRACE_RECIPES) | set(DECODE_RECIPES)
    for r in ROUTES.values():
        assert r.name == r.recipe
        want = ("prefill",) if r.name in PREFILL_TRACE_RECIPES else DECODE_RECIPES[r.name].groups
        assert r.flag("groups") == want
    assert ROUTES["aiter-decode-gfx950"].flag("groups") == ("decode",)      # no speculative decoding on gfx950
    assert set(CONTROLS) == set(TRACE_CONTROLS)
    # the recipes of every paged-cache kernel route have a trace route: triton's and aiter's FlashKDA,
    # chunk_kda:triton (flashkda) and chunk_kda:gluon (aiter-gfx1250 / aiter-gfx950)
    assert {"flashkda", "aiter-gfx1250", "aiter-gfx950"} <= set(ROUTES)


def test_run_call_refuses_a_group_the_route_does_not_run():
    tr = generate(0, "short-prompts", **SMALL)
    cache = tr.cache.allocate()
    call = split_step(tr, 0, cache)[0]
    assert call.group == "prefill"
    with pytest.raises(ValueError, match="expected a decode/spec call for route fla-recurrent"):
        EMU.run_call(call, ROUTES["fla-recurrent"])


def _route_scenarios():
    for route in ROUTES:
        for sc in SCENARIOS:
            yield route, sc


@pytest.mark.parametrize("route,scenario", list(_route_scenarios()))
def test_every_trace_route_over_every_scenario_matches_the_oracle(route, scenario):
    """Each route over each named scenario (seed 0, K = V = 32; aiter-decode-gfx950 at its K = V =
    128; aiter's decode on the scenario with pad=null0, its pad_slot_guard's convention): within its
    recipe's bound, every untouched slot, guard row and inter-slot pad bitwise unchanged; or refused
    in one line for a reason of the kernel's own."""
    kn = dict(SCENARIO_KNOBS[scenario])
    if route.startswith("aiter-decode"):
        kn["pad"] = "null0"
    if route == "aiter-decode-gfx950":
        kn.update(K=128, V=128, H=2, HV=2, **({"decodes": (20, 20)} if scenario == "decode-long" else {}))
    tr = generate(0, scenario, **kn)
    rt = ROUTES[route]
    ok, why = EMU.trace_accepts(tr, rt)
    if not ok:
        assert why.startswith("not applicable: ") and "\n" not in why
        assert route == "fla-recurrent" and "no pad-slot guard" in why, why
        assert bool((tr.row_phase == PAD).any())
        return
    bound = PREFILL_BOUND if route in PREFILL_TRACE_RECIPES else DECODE_FP32
    eo, es, fail = run_trace(tr, runners_of(EMU, rt), bound)
    print(f"{route} {scenario}: o {eo:.2e} slots {es:.2e}")
    assert fail is None, f"{route} {scenario}: {fail} (o {eo:.2e}, slots {es:.2e})"


@pytest.mark.parametrize("route,knobs", [
    ("fla-recurrent", dict(cache_dtype="bfloat16")),
    ("fla-recurrent", dict(cache_dtype="bfloat16", layout="kv")),
    ("fla-recurrent", dict(layout="kv", pad="null0", slot_pad=3)),
    ("aiter-decode-gfx1250", dict(layout="kv", pad="null0", slot_pad=2)),
])
def test_decode_recipes_on_bf16_and_k_first_caches(route, knobs):
    """fla's kernel stores each token's state in the cache's dtype (bf16 here: fp32 registers, a
    bf16 store per token) in either layout; aiter's gfx1250 kernel takes K-first fp32 states."""
    tr = generate(0, "spec", **SMALL, **knobs)
    ok, why = EMU.trace_accepts(tr, ROUTES[route])
    assert ok, why
    bound = DECODE_BF16 if knobs.get("cache_dtype") == "bfloat16" else DECODE_FP32
    eo, es, fail = run_trace(tr, runners_of(EMU, ROUTES[route]), bound)
    print(f"{route} {knobs}: o {eo:.2e} slots {es:.2e}")
    assert fail is None, fail
    if knobs.get("cache_dtype") == "bfloat16":
        assert es > DECODE_FP32          # the bf16 stores are there (an fp32 store would be ~1e-7)


@pytest.mark.parametrize("route,knobs,words", [
    ("flashkda", dict(cache_dtype="bfloat16"), "takes an fp32 paged state_cache, the trace's is bfloat16"),
    ("aiter-gfx1250", dict(layout="kv"), "takes a V-first [slots, H, V, K] state_cache"),
    ("aiter-decode-gfx1250", dict(cache_dtype="bfloat16", pad="null0"), "takes fp32 states only"),
    ("aiter-decode-gfx950", dict(layout="kv", pad="null0", K=128, V=128), "V-first [V, K] only"),
    ("aiter-decode-gfx950", dict(pad="null0"), "needs K == V == BV, its tuned BV is 128"),
    ("aiter-decode-gfx1250", dict(V=16, pad="null0"), "tiles V by BV = 32"),
    ("aiter-decode-gfx1250", dict(), "pad_slot_guard takes slots <= 0 for padding"),
    ("fla-recurrent", dict(graph_pad=4), "no pad-slot guard"),
])
def test_trace_accepts_refuses_in_the_kernels_terms(route, knobs, words):
    kn = dict(SMALL, **knobs)
    tr = generate(0, "mixed" if route == "fla-recurrent" else "short-prompts", **kn)
    ok, why = EMU.trace_accepts(tr, ROUTES[route])
    assert not ok and why.startswith("not applicable: ") and words in why, why


def _padded_minus1_trace(layout="vk"):
    """Request 0 on slot 1 (slot 0 never used: aiter's guard would take it for padding) under
    pad=minus1: a 5-token prefill, a 3-token chunk, then three decode steps each padded by two
    padding rows on slot -1."""
    c = CacheSpec(slots=3, HV=2, K=32, V=32, layout=layout, guard_rows=2, pad="minus1", slot_stride=2 * 32 * 32 + 32)
    steps = [[(5, 0, PREFILL, [1], False, 1, 5)], [(3, 0, PREFILL, [1], True, 1, 3)]]
    steps += [[(1, 0, DECODE, [1], True, 1, 1), (1, -1, PAD, [-1], False, 1, 0), (1, -1, PAD, [-1], False, 1, 0)]] * 3
    return trace_from_rows(c, steps, seed=1, H=2)


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_padding_rows_under_minus1_and_null0_leave_every_other_slot_alone(layout):
    """aiter's guarded decode skips the padding rows (-1 here; the null-block scenario covers the
    NULL block 0): slot 0, slot 2, the guard rows and the inter-slot padding keep their bits."""
    tr = _padded_minus1_trace(layout)
    eo, es, fail = run_trace(tr, runners_of(EMU, ROUTES["aiter-decode-gfx1250"]), DECODE_FP32)
    assert fail is None, fail
    tr0 = generate(0, "null-block", **SMALL, layout=layout)
    eo, es, fail = run_trace(tr0, runners_of(EMU, ROUTES["aiter-decode-gfx1250"]), DECODE_FP32)
    assert fail is None, fail
    # fla's unguarded kernel would write slot -1 (outside the cache): refused, and run_call says so
    ok, why = EMU.trace_accepts(tr, ROUTES["fla-recurrent"])
    assert not ok and "6 padding rows with tokens" in why, why
    cache = tr.cache.allocate()
    dec = [c for c in split_step(tr, 2, cache) if c.group == "decode"][0]
    with pytest.raises(ValueError, match=r"expected slots in \[0, 3\) .* got -1 on row 1"):
        EMU.run_call(dec, ROUTES["fla-recurrent"])


# ---------------------------------------------------------------- decode vs token_step
@pytest.mark.parametrize("recipe", list(DECODE_RECIPES))
def test_decode_recipe_agrees_with_token_step_to_its_rounding(recipe):
    """The decode recipe's token, from the same state, against kda_ref.recurrence.token_step on
    kda_ref's preprocessing: its exact variant (no rounding) agrees to 1e-13, the fp32 recipe to
    fp32 rounding (measured: o and state within 2.4e-7 of max|.|, over the 8 tokens and every
    head; bound 1e-6)."""
    K = V = 128 if recipe.endswith("gfx950") else 32
    tr = generate(0, "short-prompts", K=K, V=V)
    cache = tr.cache.allocate()
    call = next(c for s in range(tr.steps) for c in split_step(tr, s, cache) if c.group == "decode")
    base = int(tr.row_tokens()[int(tr.step_rows[call.step])])
    pp = prepare_tokens(tr.problem_view(), base, base + int(call.token_index.max()) + 1, None)
    g = torch.Generator().manual_seed(0)
    worst = {}
    for rec in (exact_decode_recipe(DECODE_RECIPES[recipe]), DECODE_RECIPES[recipe]):
        ins = _decode_inputs(call, rec)
        w = 0.0
        for i in range(call.tokens):
            S = (torch.randn(tr.HV, K, V, generator=g, dtype=F64) * 0.3).to(torch.float32).to(F64)
            j = int(call.token_index[i])
            S_ref, o_ref = token_step(S, pp.q[j], pp.k[j], pp.v[j], torch.exp(pp.a[j]), pp.beta[j], pp.scale)
            S_got, o_got = _decode_token(S, *(x[i] if x is not None else None for x in ins), rec)
            w = max(w, ((o_got - o_ref).abs().max() / o_ref.abs().max()).item(),
                    ((S_got - S_ref).abs().max() / S_ref.abs().max()).item())
        worst[rec.name] = w
    print(recipe, {k: f"{v:.2e}" for k, v in worst.items()})
    assert worst[recipe + "-exact"] < 1e-13
    assert 1e-9 < worst[recipe] < 1e-6


# ---------------------------------------------------------------------------- controls
CONTROL_CASES = {    # control -> (scenario, knobs, where it first leaves its recipe's bound)
    "handover-transposed": ("chunked-prefill", {}, "step 0 slot 0"),
    "ignore-initial-state": ("chunked-prefill", {}, "step 1 request 0"),
    "pad-writes-slot0": ("null-block", {}, "step 6 slot 0 unchanged"),
    "pad-writes-last-slot": ("null-block", {}, "step 6 slot 6"),
    "keep-rejected": ("spec", {}, "step 2 request 2"),
    "stale-read": ("short-prompts", {}, "step 2 request 0"),
}


@pytest.mark.parametrize("name", list(TRACE_CONTROLS))
def test_each_trace_control_fails_where_named_and_its_honest_route_does_not(name):
    scenario, knobs, where = CONTROL_CASES[name]
    tr = generate(0, scenario, **SMALL, **knobs)
    ctl = CONTROLS[name]
    ok, why = BAD.trace_accepts(tr, ctl)
    assert ok, why
    bound = PREFILL_BOUND if ctl.recipe in PREFILL_TRACE_RECIPES else DECODE_FP32
    # ten times the bound: the control is wrong, not merely less precise
    eo, es, fail = run_trace(tr, runners_of(negative_control(), ctl), 10 * bound, stop=True)
    print(f"{name}: first failure {fail}; worst o {eo:.3g}, slots {es:.3g}")
    assert fail == where
    honest = ROUTES[ctl.recipe]
    if EMU.trace_accepts(tr, honest)[0]:
        heo, hes, hfail = run_trace(tr, runners_of(EMU, honest), bound)
    else:   # fla has no pad guard: the padded trace's honest run is aiter's guarded decode
        assert name.startswith("pad-writes")
        heo, hes, hfail = run_trace(tr, runners_of(EMU, ROUTES["aiter-decode-gfx1250"]), DECODE_FP32)
    print(f"{name}: honest o {heo:.2e} slots {hes:.2e}")
    assert hfail is None, hfail


def test_trace_controls_refuse_traces_they_cannot_change():
    tr = generate(0, "short-prompts", **SMALL)            # no spec rows, no padding rows
    for name in ("keep-rejected", "pad-writes-slot0"):
        ok, why = BAD.trace_accepts(tr, CONTROLS[name])
        assert not ok and "changes nothing here" in why, why


def test_prefill_row_outside_the_slots_is_neither_read_nor_written():
    """The chunk kernels mask the paged load and store by a non-negative offset: a prefill row on
    slot -1 runs from zero and writes nothing (every slot but the other rows', the guard rows and
    the inter-slot padding keep their bits), its o that of the same row starting from zero."""
    c = CacheSpec(slots=4, HV=2, K=32, V=32, guard_rows=1)
    tr = trace_from_rows(c, [[(7, 0, PREFILL, [0], False, 1, 7), (5, 1, PREFILL, [1], False, 1, 5)],
                             [(9, 0, PREFILL, [0], True, 1, 9), (6, 1, PREFILL, [1], True, 1, 6)]], seed=2, H=2)
    cache = tr.cache.allocate()
    call = split_step(tr, 1, cache)[0]
    n = 0
    call.state_indices = call.state_indices.clone()
    slot = int(call.state_indices[n])
    tr.cache.view(cache).fill_(0.25)                         # states the rows would read
    before = cache.clone()
    call.state_indices[n] = -1
    o = EMU.run_call(call, ROUTES["flashkda"])
    others = set(call.state_indices.tolist()) - {-1}           # the other rows write their own slots
    view, bview = tr.cache.view(cache), tr.cache.view(before)
    for s in range(tr.cache.slots):
        assert (s in others) or torch.equal(_bits(view[s]), _bits(bview[s])), s
    outside = tr.cache.outside_slots()
    assert torch.equal(_bits(cache[outside]), _bits(before[outside]))
    call.state_indices[n] = slot
    call.has_initial_state = call.has_initial_state.clone()
    call.has_initial_state[n] = False
    o_zero = EMU.run_call(call, ROUTES["flashkda"])
    t0, t1 = int(call.cu_seqlens[n]), int(call.cu_seqlens[n + 1])
    assert torch.equal(o[0, t0:t1], o_zero[0, t0:t1])
