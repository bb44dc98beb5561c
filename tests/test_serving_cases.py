"""The serving suite's cases: each builds a valid trace with what its name promises, and a correct
pairing (the test-local exact backend, its own baseline) passes every CPU case."""
from __future__ import annotations

import pytest

import serving_backends as sb
from kda_ref.trace import DECODE, PAD, PREFILL, SPEC
from verification.serving.cases import get_serving_suite, serving_suite
from verification.serving.cells import tolerances_for
from verification.serving.execute import Pairing, Side, run_pairing, trace_groups
from verification.judging.tolerances import load_tolerances

CPU = get_serving_suite(long=False)
DB = load_tolerances()


def test_ids_unique_and_long_cases_marked():
    ids = [c.id for c in serving_suite()]
    assert len(ids) == len(set(ids))
    longs = [c for c in serving_suite() if c.long]
    assert {c.name for c in longs} == {"decode-long-fp32", "decode-long-bf16"}
    assert all(c.drift for c in longs) and all(c.params["decodes"] >= 10 ** 4 for c in longs)


def test_the_suite_covers_what_it_promises():
    by = {c.name: c.build() for c in CPU}
    assert max(by["short-prompts"].row_len[by["short-prompts"].row_phase == PREFILL].tolist()) < 64
    assert set(by["one-token-prompts"].row_len[by["one-token-prompts"].row_phase == PREFILL].tolist()) == {1}
    cp = by["chunked-prefill-odd"]
    assert (cp.has_initial_state & (cp.row_phase == PREFILL)).any()          # later chunks of a prompt
    mixed = by["mixed"]
    steps = [set(mixed.row_phase[int(mixed.step_rows[s]):int(mixed.step_rows[s + 1])].tolist())
             for s in range(mixed.steps)]
    assert any({PREFILL, DECODE} <= s or {PREFILL, SPEC} <= s for s in steps)
    assert by["pad-minus1"].cache.pad == "minus1" and (by["pad-minus1"].row_phase == PAD).any()
    assert by["pad-minus1"].cache.stride > by["pad-minus1"].cache.slot_numel       # padding between slots
    assert by["pad-null0"].cache.pad == "null0" and (by["pad-null0"].row_phase == PAD).any()
    acc = by["spec-accepts"]
    spec_rows = acc.row_phase == SPEC
    assert sorted(acc.accepted[spec_rows].tolist()) == [1, 2, 3, 4]             # 1 (only the verified token) .. k+1
    assert by["mixed-kv"].cache.layout == "kv" and by["mixed-bf16-cache"].cache.dtype == "bfloat16"
    assert by["decode-drift-bf16"].cache.dtype == "bfloat16" and by["decode-drift-fp32"].cache.dtype == "float32"
    e = by["empty-before-later"]
    assert e.row_len[:3].tolist() == [1, 37, 1] and 0 in e.row_len.tolist()
    assert trace_groups(by["spec"]) >= {"prefill", "spec"}
    refs = {c.name: c.reference for c in CPU if c.reference}
    assert set(refs) == {"atom-1750", "vllm-50649", "sglang-34299"}


@pytest.mark.parametrize("case", CPU, ids=[c.name for c in CPU])
def test_correct_backend_passes(case):
    b = sb.ServingBackend("exact")
    r = {x.name: x for x in b.trace_routes()}
    p = Pairing(Side(b, r["exact-prefill"]), Side(b, r["exact-decode"]))
    tr = case.build()
    dt = "bf16" if str(tr.v.dtype) == "torch.bfloat16" else "fp32"
    res = run_pairing(tr, p, tolerances_for(DB, p, dt), baseline=p, drift=case.drift)
    assert res.status == "pass", res.reason
    assert res.steps == tr.steps
    if case.drift:
        assert res.drift["decode_steps"] >= 120 and res.drift["worst"]["request"] in (0, 1)


def test_a_long_trace_runs_each_decode_route_once_and_a_short_one_every_pairing():
    """A long trace verifies the decode kernel's drift over 10^4 steps: it runs after the first
    prefill route only (each prefill route is verified by the short cases), unless --route chose
    the prefill routes; a short trace runs the whole cross product."""
    from types import SimpleNamespace

    from verification.serving.cells import case_pairs
    a1, a2, a3, d1, d2 = (SimpleNamespace(name=n) for n in ("a1", "a2", "a3", "d1", "d2"))
    pairs = [(a, d) for a in (a1, a2, a3) for d in (d1, d2)]
    long, short = SimpleNamespace(long=True), SimpleNamespace(long=False)
    assert case_pairs(short, pairs) == pairs
    assert case_pairs(long, pairs) == [(a1, d1), (a1, d2)]
    assert case_pairs(long, pairs, routes_chosen=True) == pairs
    assert case_pairs(long, []) == []
