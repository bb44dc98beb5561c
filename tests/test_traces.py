"""Serving traces (kda_ref.trace, trace_gen, trace_oracle): the step oracle against the
whole-sequence oracle, the cache's slots, padding and guards, and the trace file."""
import math

import pytest
import torch

from kda_ref import Problem, truth
from kda_ref.recurrence import recurrence
from kda_ref.trace import (DECODE, PAD, PREFILL, SPEC, CacheSpec, TraceError, load_trace, plan, save_trace,
                           validate_trace)
from kda_ref.trace_gen import SCENARIOS, generate, trace_from_rows
from kda_ref.trace_oracle import request_streams, trace_oracle

# float64 oracles that take different routes (the chunked form over a request's whole stream,
# the token recurrence step by step, the chunked form chunk by chunk) agree to rounding: measured
# worst max|diff| / max|ref| 3.4e-14 over these tests' traces (2026-12-03)
TOL = 1e-13


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _problem(tr, idx):
    """The Problem of packed tokens ``idx`` of the trace, as one sequence from a zero state."""
    ix = torch.tensor(idx, dtype=torch.long)
    return Problem(q=tr.q[ix][None], k=tr.k[ix][None], v=tr.v[ix][None], g=tr.g[ix][None], beta=tr.beta[ix][None],
                   A_log=tr.A_log, dt_bias=tr.dt_bias, scale=tr.scale, lower_bound=tr.lower_bound, gate=tr.gate,
                   beta_kind=tr.beta_kind, qk_l2norm=tr.qk_l2norm)


def _check_against_whole_sequences(tr):
    """Every step's o and every written slot against oracles of whole sequences: accepted tokens
    and each request's final state against kda_ref.truth of its accepted stream; every token
    (drafts included) and every checkpoint against the recurrence over the row's context (the
    request's accepted tokens before the row, then the row's tokens).  Returns the worst
    relative difference."""
    plans = plan(tr)
    streams = request_streams(tr, plans)
    whole = {r: truth(_problem(tr, idx)) for r, idx in streams.items()}
    pos = {r: {j: i for i, j in enumerate(idx)} for r, idx in streams.items()}
    before = {r: [] for r in streams}
    worst = 0.0
    last_state, kept = {}, {}
    for st, sp in zip(trace_oracle(tr, plans=plans), plans):
        for rp in sp.rows:
            ctx = before[rp.request] + list(range(rp.tok0, rp.tok0 + rp.T))
            ref = recurrence(_problem(tr, ctx), chunk_size=1)
            n0 = len(before[rp.request])
            o = st.o[rp.tok0 - sp.tok0: rp.tok0 - sp.tok0 + rp.T]
            worst = max(worst, _rel(o, ref.o[n0:]))
            for t, slot in rp.writes:
                worst = max(worst, _rel(st.slots[slot], ref.chunk_states[0, n0 + t + 1]))
                # the cache layout is a view of the same numbers
                assert torch.equal(tr.cache.to_kfirst(st.expected(slot)), st.slots[slot])
            for t in range(rp.accepted):
                i = pos[rp.request][rp.tok0 + t]
                worst = max(worst, _rel(o[t], whole[rp.request].o[0, i]))
            before[rp.request] += list(range(rp.tok0, rp.tok0 + rp.accepted))
            keep_slot = rp.writes[[sid for sid in rp.new_ids].index(rp.keep)][1]
            last_state[rp.request] = st.slots[keep_slot].clone()
            assert st.live.get(keep_slot) == (None if rp.request in sp.finished else rp.request)
        assert set(st.written) == {slot for rp in sp.rows for _, slot in rp.writes}
        for slot in st.written:
            kept[slot] = st.slots[slot].clone()
        # a slot this step did not write still holds, bitwise, what was last written to it
        assert set(st.slots) == set(kept) and all(torch.equal(st.slots[x], kept[x]) for x in kept)
        live = torch.zeros_like(st.token_live)
        for rp in sp.rows:
            live[rp.tok0 - sp.tok0: rp.tok0 - sp.tok0 + rp.T] = True
        assert torch.equal(st.token_live, live)
        assert bool(torch.isnan(st.o[~live]).all()) and not bool(torch.isnan(st.o[live]).any())
    for r, S in last_state.items():
        worst = max(worst, _rel(S, whole[r].final_state[0]))
    assert worst <= TOL, worst
    return worst


def _one_request_all_phases(pad="minus1", layout="vk"):
    """Request 0: prefill chunks of 5, 70 and 1 tokens, two decodes, spec steps (k = 2) accepting
    1 and 3 of 3 and 2 of 2 (its read slot, column 2, is not rewritten: it keeps a stale
    checkpoint), then a decode that reads the slot the last spec step left the state in.
    Request 1 alongside: a 3-token prompt, decodes; a padding row in the decode steps."""
    first = 1 if pad == "null0" else 0
    P = -1 if pad == "minus1" else 0
    a, b, c, d = first, first + 1, first + 2, first + 3
    cache = CacheSpec(slots=first + 4, HV=2, K=8, V=8, layout=layout, slot_stride=2 * 8 * 8 + 16, guard_rows=3, pad=pad)
    steps = [
        [(5, 0, PREFILL, [a, P, P], False, 1, 5), (3, 1, PREFILL, [d, P, P], False, 1, 3)],
        [(70, 0, PREFILL, [a, P, P], True, 1, 70), (1, 1, DECODE, [d, P, P], True, 1, 1)],
        [(1, 0, PREFILL, [a, P, P], True, 1, 1), (1, -1, PAD, [P, P, P], False, 1, 0)],
        [(1, 0, DECODE, [a, P, P], True, 1, 1), (1, 1, DECODE, [d, P, P], True, 1, 1)],
        [(1, 0, DECODE, [a, P, P], True, 1, 1), (1, -1, PAD, [P, P, P], False, 1, 0)],
        [(3, 0, SPEC, [a, b, c], True, 1, 1), (1, 1, DECODE, [d, P, P], True, 1, 1)],
        [(3, 0, SPEC, [a, b, c], True, 1, 3)],
        [(2, 0, SPEC, [a, b, c], True, 3, 2), (1, -1, PAD, [P, P, P], False, 1, 0)],
        [(1, 0, DECODE, [b, P, P], True, 1, 1)],
    ]
    return trace_from_rows(cache, steps, seed=11, H=1)


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_one_request_through_every_phase_equals_the_whole_sequence_oracle(one_thread, layout):
    tr = _one_request_all_phases(layout=layout)
    _check_against_whole_sequences(tr)


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - {"decode-long"}))
def test_generated_scenarios_equal_the_whole_sequence_oracle(one_thread, scenario):
    tr = generate(3, scenario, K=8, V=8, prompt=(1, 90) if scenario != "short-prompts" else (1, 5))
    _check_against_whole_sequences(tr)


def test_incremental_over_many_decode_steps(one_thread):
    tr = generate(0, "decode-long", H=2, HV=2, K=8, V=8, decodes=(1500, 1500))
    *_, last = trace_oracle(tr)
    idx = request_streams(tr)[0]
    t = truth(_problem(tr, idx))
    slot = next(iter(last.written))
    assert _rel(last.slots[slot], t.final_state[0]) <= TOL
    assert _rel(last.o[0], t.o[0, -1]) <= TOL


def test_spec_rows_write_every_token_and_read_the_accepted_checkpoint():
    tr = _one_request_all_phases()
    plans = plan(tr)
    spec = [rp for sp in plans for rp in sp.rows if rp.phase == SPEC]
    assert [rp.writes for rp in spec] == [[(0, 0), (1, 1), (2, 2)]] * 2 + [[(0, 0), (1, 1)]]
    assert [rp.read for rp in spec] == [0, 0, 2]      # num_accepted_tokens 1, 1, 3 -> columns 0, 0, 2
    last_decode = plans[-1].rows[0]
    assert last_decode.read == 1                       # accepted 2 of the last spec step: column 1


def test_slots_are_reused_after_a_request_finishes(one_thread):
    tr = generate(5, "slot-reuse", K=8, V=8)
    owners = {}
    for sp in plan(tr):
        for rp in sp.rows:
            for _, slot in rp.writes:
                owners.setdefault(slot, set()).add(rp.request)
    assert max(len(v) for v in owners.values()) >= 3, owners
    _check_against_whole_sequences(tr)


def _rows(tr):
    """The trace's steps as trace_from_rows rows (to edit one field)."""
    cols = (tr.row_len, tr.row_request, tr.row_phase, tr.state_indices, tr.has_initial_state,
            tr.num_accepted_tokens, tr.accepted)
    rows = [list(x) for x in zip(*(c.tolist() for c in cols))]
    b = tr.step_rows.tolist()
    return [rows[b[s]:b[s + 1]] for s in range(len(b) - 1)]


def _rebuild(tr, steps):
    return trace_from_rows(tr.cache, steps, seed=11, H=tr.H)


@pytest.mark.parametrize("pad", ["minus1", "null0"])
def test_pad_slots_are_never_written(pad):
    tr = generate(2, "null-block" if pad == "null0" else "mixed", K=8, V=8)
    assert tr.cache.pad == pad
    written = set()
    pads = 0
    for st in trace_oracle(tr):
        written |= set(st.written)
        pads += len(st.plan.pad_rows)
        assert tr.cache.pad_slot not in st.live
    assert pads > 0 and tr.cache.pad_slot not in written
    if pad == "null0":
        assert 0 not in written


@pytest.mark.parametrize("pad", ["minus1", "null0"])
def test_a_live_row_pointing_at_the_pad_slot_is_refused(pad):
    tr = _one_request_all_phases(pad=pad)
    steps = _rows(tr)
    steps[3][0][3] = [tr.cache.pad_slot, tr.cache.pad_slot, tr.cache.pad_slot]     # request 0's decode
    with pytest.raises(TraceError, match=r"^step 3 row 0 \(request 0, decode\): state_indices\[0\]: expected the "
                                         r"slot it reads, got the pad slot"):
        _rebuild(tr, steps)
    steps = _rows(tr)
    steps[2][1][3] = [tr.cache.first_slot + 1, tr.cache.pad_slot, tr.cache.pad_slot]   # the padding row
    with pytest.raises(TraceError, match=r"^step 2 row 1 \(padding\): state_indices: expected only the pad slot"):
        _rebuild(tr, steps)


def test_inconsistent_traces_are_refused_in_one_line():
    tr = _one_request_all_phases()
    cases = [
        ((1, 0, 4), False, r"step 1 row 0 \(request 0, prefill\): has_initial_state: expected true \(the request has "
                           r"5 accepted tokens before this row\), got false"),
        ((8, 0, 3), [0, -1, -1], r"step 8 row 0 \(request 0, decode\): reads slot 0 \(state_indices\[0\]\), which "
                                 r"does not hold the request's current state \(after its 84 accepted tokens\)"),
        ((7, 0, 5), 2, r"step 7 row 0 \(request 0, spec\): reads slot 1 \(state_indices\[1\]\), which does not hold"),
        ((3, 1, 3), [0, -1, -1], r"step 3 row 1 \(request 1, decode\): reads slot 0"),
        ((6, 0, 6), 4, r"step 6 row 0 \(request 0, spec\): accepted: expected 1..3, got 4"),
    ]
    for (s, n, f), val, msg in cases:
        steps = _rows(tr)
        steps[s][n][f] = val
        with pytest.raises(TraceError, match="^" + msg) as e:
            _rebuild(tr, steps)
        assert "\n" not in str(e.value)


def test_writing_a_slot_that_holds_another_running_request_is_refused():
    tr = _one_request_all_phases()
    steps = _rows(tr)
    steps[0][1][3] = [0, -1, -1]          # request 1's prefill takes request 0's slot in the same step
    with pytest.raises(TraceError, match=r"^step 0 row 1 \(request 1, prefill\): writes slot 0, which step 0 row 0 "
                                         r"\(request 0, prefill\) also writes in this step"):
        _rebuild(tr, steps)
    cache = CacheSpec(slots=3, HV=1, K=4, V=4)
    steps = [[(4, 0, PREFILL, [0, -1], False, 1, 4), (3, 1, PREFILL, [1, -1], False, 1, 3)],
             [(2, 0, SPEC, [0, 1], True, 1, 1)],              # the spec checkpoints overwrite request 1's state
             [(1, 1, DECODE, [1, -1], True, 1, 1)]]
    with pytest.raises(TraceError, match=r"^step 1 row 0 \(request 0, spec\): writes slot 1, which holds the current "
                                         r"state of request 1 \(not finished: its last row is row 3\)"):
        trace_from_rows(cache, steps)
    steps[1][0] = (2, 0, SPEC, [0, 2], True, 1, 1)         # a free slot: fine
    trace_from_rows(cache, steps)


def test_graph_padded_batch_has_more_rows_than_requests(one_thread):
    tr = generate(4, "graph-padded", K=8, V=8)
    padded = [s for s, sp in enumerate(plan(tr)) if sp.pad_rows]
    assert padded
    for s in padded:
        args = tr.step(s)
        live = int((args["row_request"] >= 0).sum())
        rows = args["cu_seqlens"].numel() - 1
        assert rows % 8 == 0 and rows > live
        assert bool((args["state_indices"][args["row_request"] < 0] == -1).all())
        assert args["q"].shape[1] == int(args["cu_seqlens"][-1])
    _check_against_whole_sequences(tr)


def test_cache_view_leaves_guards_and_slot_padding_outside():
    c = CacheSpec(slots=5, HV=2, K=8, V=4, layout="vk", slot_stride=2 * 4 * 8 + 3 * 8, guard_rows=2).check()
    buf = c.allocate(fill=float("nan"))
    view = c.view(buf)
    assert view.shape == (5, 2, 4, 8)
    view.fill_(1.0)
    outside = c.outside_slots()
    assert int(outside.sum()) == 2 * 2 * 8 + 5 * 3 * 8
    assert bool(torch.isnan(buf[outside]).all()) and bool((buf[~outside] == 1).all())
    with pytest.raises(TraceError, match=r"^cache.slot_stride: expected a whole number of 8-element rows >= "
                                         r"HV\*V\*K = 64, got 70"):
        CacheSpec(slots=5, HV=2, K=8, V=4, slot_stride=70).check()


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, one_thread, cache_dtype):
    tr = generate(7, "mixed", K=8, V=8, cache_dtype=cache_dtype, layout="kv", slot_pad=2, dtype="bfloat16")
    path = str(tmp_path / "t.safetensors")
    save_trace(path, tr)
    back = load_trace(path)
    assert back.cache == tr.cache and back.meta["scenario"] == "mixed"
    for name in ("q", "k", "v", "g", "beta", "step_rows", "row_len", "row_request", "row_phase", "state_indices",
                 "has_initial_state", "num_accepted_tokens", "accepted", "A_log", "dt_bias"):
        a, b = getattr(tr, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (back.gate, back.lower_bound, back.beta_kind, back.qk_l2norm, back.scale) == \
           (tr.gate, tr.lower_bound, tr.beta_kind, tr.qk_l2norm, tr.scale)
    for x, y in zip(trace_oracle(tr), trace_oracle(back)):
        assert torch.equal(x.o.nan_to_num(7.0), y.o.nan_to_num(7.0)) and x.written == y.written


def _edit_file(src, dst, tensors=None, meta=None, drop=()):
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(src, framework="pt") as f:
        md = dict(f.metadata())
        ts = {n: f.get_tensor(n) for n in f.keys() if n not in drop}
    ts.update(tensors or {})
    md.update(meta or {})
    save_file(ts, dst, metadata=md)
    return dst


def test_malformed_trace_files_give_one_line(tmp_path):
    import json
    tr = _one_request_all_phases()
    good = str(tmp_path / "good.safetensors")
    save_trace(good, tr)
    opts = json.loads(__import__("safetensors").safe_open(good, framework="pt").metadata()["trace"])
    bad_cache = dict(opts, cache=dict(opts["cache"], layout="kvk"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    cases = [
        (str(tmp_path / "missing.safetensors"), r"^trace: expected an existing safetensors file"),
        (str(junk), r"^trace: expected a safetensors file, got .* that cannot be read"),
        (_edit_file(good, str(tmp_path / "f.st"), meta={"format": "kda-verify-problem/1"}),
         r"^format: expected 'kda-verify-trace/1'"),
        (_edit_file(good, str(tmp_path / "j.st"), meta={"trace": "{oops"}), r"^trace: expected JSON options"),
        (_edit_file(good, str(tmp_path / "c.st"), meta={"trace": json.dumps(bad_cache)}),
         r"^cache.layout: expected one of vk\|kv, got 'kvk'"),
        (_edit_file(good, str(tmp_path / "g.st"), meta={"trace": json.dumps(dict(opts, gate="relu"))}),
         r"^gate: expected one of lower_bound\|softplus\|pregated"),
        (_edit_file(good, str(tmp_path / "m.st"), drop=("accepted",)), r"^accepted: expected a tensor 'accepted'"),
        (_edit_file(good, str(tmp_path / "x.st"), tensors={"extra": torch.zeros(1)}), r"^extra: expected only"),
        (_edit_file(good, str(tmp_path / "d.st"), tensors={"has_initial_state": tr.has_initial_state.int()}),
         r"^has_initial_state: expected a bool tensor \[16\], got \[16\] int32"),
        (_edit_file(good, str(tmp_path / "r.st"), tensors={"row_len": tr.row_len + 1}),
         r"^row_len: expected to sum to the 96 tokens of q, got 112"),
        (_edit_file(good, str(tmp_path / "s.st"), tensors={"state_indices": tr.state_indices + 9}),
         r"^state_indices: expected slots in \[0, 4\) or the pad slot -1 \(pad=minus1\), got 9 at row 0 column 0"),
        (_edit_file(good, str(tmp_path / "n.st"), tensors={"q": tr.q.clone().fill_(math.nan)}),
         r"^q: expected finite values"),
    ]
    for path, msg in cases:
        with pytest.raises(TraceError if "q: expected" not in msg else ValueError, match=msg) as e:
            load_trace(path)
        assert "\n" not in str(e.value), str(e.value)


def test_validate_names_bad_fields():
    tr = _one_request_all_phases()
    tr.step_rows = torch.tensor([0, 5, 5, 16])
    with pytest.raises(TraceError, match=r"^step_rows: expected strictly increasing \(every step has a row\), got 5 "
                                         r"then 5 at index 2"):
        validate_trace(tr)


def test_generator_knobs_are_checked():
    from kda_ref.trace_gen import knobs_for
    with pytest.raises(TraceError, match=r"^scenario: expected one of mixed\|"):
        knobs_for("bursty")
    with pytest.raises(TraceError, match=r"^spec_kk: expected a trace knob \("):
        knobs_for("spec", spec_kk=2)
    with pytest.raises(TraceError, match=r"^slots: expected room for one request \(4 slots\), got 2"):
        generate(0, "spec", slots=2)
    tr = generate(0, "mixed", K=8, V=8, cache_dtype="bfloat16")
    assert tr.cache.allocate().dtype == torch.bfloat16
    with pytest.raises(TraceError, match=rf"^step: expected 0 <= step < {tr.steps}, got {tr.steps}"):
        tr.step(tr.steps)
