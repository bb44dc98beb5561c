"""The serving-trace runner and its verdicts (verification/serving): a correct pairing passes,
each planted bug fails naming request, step, phase and call, the handover diagnosis names a
layout (or dtype) disagreement, the bitwise check catches writes outside the written slots."""
from __future__ import annotations

import pytest

import serving_backends as sb
from kda_ref.trace import DECODE, PAD, PREFILL, SPEC, CacheSpec
from kda_ref.trace_gen import generate, trace_from_rows
from verification.serving.execute import Pairing, Side, run_pairing
from verification.serving.cells import tolerances_for
from verification.judging.tolerances import load_tolerances

DB = load_tolerances()
EXACT = sb.ServingBackend("exact")


def _route(b, name):
    return next(r for r in b.trace_routes() if r.name == name)


def pairing(prefill_mode="exact", decode_mode="exact"):
    bp = sb.ServingBackend(prefill_mode)
    bd = bp if decode_mode == prefill_mode else sb.ServingBackend(decode_mode)
    return Pairing(Side(bp, _route(bp, "exact-prefill")), Side(bd, _route(bd, "exact-decode")))


def run(tr, p, **kw):
    base = pairing()
    dt = {"float32": "fp32", "bfloat16": "bf16"}[str(tr.v.dtype).replace("torch.", "")]
    return run_pairing(tr, p, tolerances_for(DB, p, dt), baseline=base, **kw)


def chunked_spec_trace(layout="vk", cache_dtype="float32", guard_rows=2):
    """Request 0: prefill chunks of 5 and 21 tokens, a decode, spec steps accepting 1 and 3 of 3,
    a decode; request 1 beside it; graph padding rows at slot -1 in the decode-only steps."""
    cache = CacheSpec(slots=5, HV=2, K=8, V=16, layout=layout, dtype=cache_dtype, guard_rows=guard_rows)
    steps = [
        [(5, 0, PREFILL, [0, -1, -1], False, 1, 5), (3, 1, PREFILL, [3, -1, -1], False, 1, 3)],
        [(21, 0, PREFILL, [0, -1, -1], True, 1, 21), (1, 1, DECODE, [3, -1, -1], True, 1, 1)],
        [(1, 0, DECODE, [0, -1, -1], True, 1, 1), (1, 1, DECODE, [3, -1, -1], True, 1, 1),
         (1, -1, PAD, [-1, -1, -1], False, 1, 0)],
        [(3, 0, SPEC, [0, 1, 2], True, 1, 1), (1, 1, DECODE, [3, -1, -1], True, 1, 1)],
        [(3, 0, SPEC, [0, 1, 2], True, 1, 3), (1, 1, DECODE, [3, -1, -1], True, 1, 1)],
        [(1, 0, DECODE, [2, -1, -1], True, 1, 1), (1, 1, DECODE, [3, -1, -1], True, 1, 1),
         (1, -1, PAD, [-1, -1, -1], False, 1, 0), (1, -1, PAD, [-1, -1, -1], False, 1, 0)],
    ]
    return trace_from_rows(cache, steps, seed=7, H=2)


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_correct_pairing_passes(layout, cache_dtype):
    res = run(chunked_spec_trace(layout, cache_dtype), pairing())
    assert res.status == "pass", res.reason
    assert res.steps == 6 and res.worst is not None and res.worst.margin < 1


def test_transposed_handover_is_a_layout_disagreement():
    res = run(chunked_spec_trace("vk"), pairing("transposed", "exact"))
    assert res.status == "fail"
    f = res.first_failure
    assert (f.step, f.request, f.kind, f.phase) == (0, 0, "state", "prefill")
    assert res.diagnosis == ("layout disagreement: prefill serving-transposed:exact-prefill wrote slot 0 K-first "
                             "where the trace's cache is V-first (step 0, request 0)")
    assert res.reason.startswith("layout disagreement") and "call prefill serving-transposed:exact-prefill" in res.reason


def test_has_initial_state_ignored_names_the_second_chunk():
    res = run(chunked_spec_trace(), pairing("no_initial", "exact"))
    f = res.first_failure
    assert res.status == "fail" and (f.step, f.request, f.phase) == (1, 0, "prefill")
    assert "request 0 step 1" in res.reason or "step 1 (request 0" in res.reason
    assert res.diagnosis.startswith("has_initial_state ignored: prefill serving-no-initial:exact-prefill started "
                                    "request 0 from a zero state instead of slot 0")


def test_padding_row_writing_slot0_is_caught_bitwise():
    # request 1 lives in slot 3, so slot 0 is request 0's: at step 2 it is written by request 0's
    # decode and the padding row both; at step 5 request 0 reads slot 2, slot 0 is unwritten
    res = run(chunked_spec_trace(), pairing("exact", "pad_slot0"))
    assert res.status == "fail"
    first = res.first_failure
    assert first.step == 2 and first.slot == 0
    untouched = [i for i in res.failures if i.kind == "untouched"]
    assert untouched and untouched[0].step == 5
    assert "slot 0 changed" in untouched[0].reason
    assert "padding row" in untouched[0].reason and "call decode serving-pad-slot0:exact-decode" in untouched[0].reason


def test_rejected_draft_kept_names_the_checkpoint():
    res = run(chunked_spec_trace(), pairing("exact", "keep_rejected"))
    f = res.first_failure
    assert res.status == "fail" and (f.step, f.request, f.phase) == (4, 0, "spec")
    assert res.diagnosis.startswith("wrong checkpoint read: spec serving-keep-rejected:exact-decode read slot 2 "
                                    "(state_indices column 2) instead of slot 0 (column 0")


def test_stale_read_fails_naming_request_and_step():
    res = run(chunked_spec_trace(), pairing("exact", "stale"))
    f = res.first_failure
    # request 1 decodes from slot 3 at step 1 (first read, correct) and again at step 2 (stale)
    assert res.status == "fail" and (f.step, f.request, f.phase) == (2, 1, "decode")
    assert "call decode serving-stale:exact-decode" in f.where
    assert res.diagnosis.startswith("stale read: decode serving-stale:exact-decode read slot 3 as it was before its "
                                    "write at step 1, not its current content")


def test_guard_row_write_is_named():
    res = run(chunked_spec_trace(), pairing("exact", "guard_write"))
    assert res.status == "fail"
    f = res.first_failure
    assert f.kind == "untouched" and f.step == 1
    assert "guard rows before slot 0 changed" in f.reason and "call decode serving-guard-write:exact-decode" in f.reason


def test_bf16_rounded_state_in_fp32_cache_is_a_dtype_disagreement():
    res = run(chunked_spec_trace(), pairing("bf16_state", "exact"))
    assert res.status == "fail"
    assert res.diagnosis.startswith("dtype disagreement: prefill serving-bf16-state:exact-prefill wrote slot 0 "
                                    "rounded to bf16 where the trace's cache is fp32 (step 0, request 0)")


def test_raising_call_is_an_error_naming_step_and_call():
    res = run(chunked_spec_trace(), pairing("exact", "raising"))
    assert res.status == "error"
    assert res.reason.startswith("step 1 call decode serving-raising:exact-decode (rows [3]) raised RuntimeError")


def test_wrong_layout_read_by_decode_is_named():
    """The decode side reading V-first memory K-first: its first decode's o fails, and the
    replay from the slot taken in the other layout names it."""
    class ReadsKFirst(sb.ServingBackend):
        def run_call(self, call, route):
            if call.group == "decode":
                view = call.slots_view()
                for s in call.state_indices.tolist():
                    if s >= 0:
                        view[s].copy_(view[s].clone().reshape(-1).reshape(view[s].shape[0], view[s].shape[2],
                                                                          view[s].shape[1]).transpose(-1, -2))
            return super().run_call(call, route)
    bd = ReadsKFirst("exact")
    bd.name = "serving-reads-kfirst"
    bp = sb.ServingBackend("exact")
    p = Pairing(Side(bp, _route(bp, "exact-prefill")), Side(bd, _route(bd, "exact-decode")))
    res = run(chunked_spec_trace("vk"), p)
    assert res.status == "fail"
    assert res.first_failure.step == 1 and res.first_failure.request == 1
    assert res.diagnosis.startswith("layout disagreement: decode serving-reads-kfirst:exact-decode read slot 3 "
                                    "K-first where the trace's cache is V-first, written by prefill "
                                    "serving-exact:exact-prefill at step 0 (request 1)")


def test_drift_curve_recorded():
    tr = generate(1, None, requests=1, max_batch=1, prompt=(4, 4), decodes=(60, 60), H=2, HV=2, K=8, V=8,
                  cache_dtype="bfloat16")
    res = run(tr, pairing(), drift=True)
    assert res.status == "pass"
    d = res.drift
    assert d["decode_steps"] == 60 and len(d["step"]) == 60 and d["cache_dtype"] == "bfloat16"
    assert d["worst"]["request"] == 0 and d["worst"]["o_err"] == max(d["o_err"])


def test_baseline_rows_reused():
    tr = chunked_spec_trace()
    first = run(tr, pairing())
    again = run_pairing(tr, pairing(), tolerances_for(DB, pairing(), "fp32"), baseline_rows=first.baseline_rows)
    assert again.status == "pass" and again.worst.margin == first.worst.margin


def test_a_kernel_that_is_its_own_baseline_runs_once():
    calls = []

    class Counting(sb.ServingBackend):
        def run_call(self, call, route):
            calls.append(call.step)
            return super().run_call(call, route)
    b = Counting("exact")
    p = Pairing(Side(b, _route(b, "exact-prefill")), Side(b, _route(b, "exact-decode")))
    tr = chunked_spec_trace()
    res = run_pairing(tr, p, tolerances_for(DB, p, "fp32"), baseline=p)
    assert res.status == "pass" and len(res.baseline_rows) == tr.steps
    assert len(calls) == sum(1 for s in range(tr.steps) for _ in set(tr.row_phase[int(tr.step_rows[s]):
                                                                                 int(tr.step_rows[s + 1])].tolist()) - {-1})


def test_null_block_write_names_the_padding_row():
    """Under the NULL-block convention a live row's unused table columns hold 0 too: the write of
    slot 0 is the padding row's, not the live row's."""
    tr = generate(3, "null-block", K=8, V=16)
    res = run(tr, pairing("exact", "pad_slot0"))
    first = res.first_failure
    assert res.status == "fail" and first.kind == "untouched" and first.slot == 0
    assert "the pad slot (NULL block) slot 0 changed" in first.reason
    assert "padding row" in first.reason and "(pad slot 0)" in first.reason and "(decode, table" not in first.reason


def test_padding_row_over_a_written_slot_is_named():
    """Step 2 writes slot 0 (request 0's decode) and the padding row writes it too, after."""
    res = run(chunked_spec_trace(), pairing("exact", "pad_slot0"))
    assert res.first_failure.step == 2 and res.first_failure.kind == "state"
    assert res.diagnosis == ("padding row written: decode serving-pad-slot0:exact-decode padding row 6 (pad slot -1) "
                             "wrote its state to slot 0, over request 0's (step 2)")


def test_a_padding_row_that_reads_and_writes_the_null_block_is_seen(tmp_path, capsys):
    """fla's decode kernel (and the fla-recurrent recipe that models it) writes a padding row's
    state into its pad slot.  With the whole cache NaN, a NaN read and a NaN written left the NULL
    block's bits equal and the cell passed on the CPU (the H200 showed the write); the NULL block
    and the guard rows now start from a finite pattern, so the write is seen and named."""
    from verification.cli import main
    rc = main(["run", "--suite", "serving", "--backend", "emulator", "--route", "flashkda",
               "--decode-route", "fla-recurrent", "--case", "serving/pad-null0", "--out", str(tmp_path / "r"),
               "--no-report"])
    out = capsys.readouterr().out
    # a known failure since the register lists it (tolerances.yaml: emulator / *+fla-recurrent / serving/pad-null0)
    from verification.judging.record import read_records
    rec, = read_records(tmp_path / "r" / "results.jsonl")
    assert rc == 0 and rec.status == "known-fail" and rec.known_failure["status"] == "fail", out
    assert "pad slot (NULL block) slot 0 changed" in rec.reason and "padding row" in rec.reason, rec.reason


def test_a_cpu_run_holds_torch_to_one_thread_and_restores_it():
    """run_pairing on the CPU runs its steps (the kernel's calls, the oracle, the judge) on one
    torch thread: on the loaded 2-core machine two threads made a long case's step 100x slower.
    The caller's setting is back afterwards."""
    import torch
    seen = []

    class Threads(sb.ServingBackend):
        def run_call(self, call, route):
            seen.append(torch.get_num_threads())
            return super().run_call(call, route)
    b = Threads("exact")
    p = Pairing(Side(b, _route(b, "exact-prefill")), Side(b, _route(b, "exact-decode")))
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        res = run_pairing(chunked_spec_trace(), p, tolerances_for(DB, p, "fp32"), baseline=p)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(prev)
    assert res.status == "pass" and seen and set(seen) == {1}
    assert after == 2


def test_the_unwritten_mask_is_the_complement_of_the_written_one_and_built_once():
    """judge_step's bitwise check compares against ~written_mask; the mask is kept per slot set."""
    import torch
    from verification.serving.judge import unwritten_mask, written_mask
    spec = CacheSpec(slots=5, HV=2, K=8, V=16, layout="vk", dtype="float32", guard_rows=2)
    for slots in ([], [0], [1, 3], [0, 1, 2, 3, 4]):
        m = unwritten_mask(spec, slots)
        assert torch.equal(m, ~written_mask(spec, slots))
        assert unwritten_mask(spec, slots) is m


def test_the_baseline_runs_on_the_host_whatever_the_kernels_device(monkeypatch):
    """The baseline (the emulator's run of the recipes) runs on BASELINE_DEVICE, the host, not
    beside the kernel: on the H200 its ~120 small operations per decode token, launched and waited
    for on a GPU shared by 15 workers, kept a 10^4-step cell running past 170 s.  The kernel's run
    here is asked for on "cpu:0" to tell the two apart."""
    from verification.serving import execute
    made = []
    init = execute.TraceRun.__init__

    def spy(self, tr, pairing, device="cpu", **kw):
        made.append((pairing.prefill.name, str(device)))
        init(self, tr, pairing, device=device, **kw)
    monkeypatch.setattr(execute.TraceRun, "__init__", spy)
    kernel, base = sb.ServingBackend("exact"), sb.ServingBackend("exact")
    kernel.name, base.name = "kernel", "baseline"
    p = Pairing(Side(kernel, _route(kernel, "exact-prefill")), Side(kernel, _route(kernel, "exact-decode")))
    b = Pairing(Side(base, _route(base, "exact-prefill")), Side(base, _route(base, "exact-decode")))
    res = run_pairing(chunked_spec_trace(), p, tolerances_for(DB, p, "fp32"), baseline=b, device="cpu:0")
    assert res.status == "pass", res.reason
    assert made == [("kernel", "cpu:0"), ("baseline", execute.BASELINE_DEVICE)] and execute.BASELINE_DEVICE == "cpu"


@pytest.mark.parametrize("beside", ["inline", "process"])
def test_the_baseline_beside_hands_over_its_failures_and_never_outlives_the_run(beside, monkeypatch):
    """The baseline's steps run in line (BaselineInline), or for a long trace in a forked process
    beside the kernel's walk (BaselineProcess; here every trace).  A baseline call that raises
    makes the cell not applicable, naming the baseline; a kernel that raises early ends the run
    with the process stopped (it was blocked on its full pipe); an interrupt in the baseline
    reaches the caller as the interrupt; the rows are the same either way (the verdict equal to
    the kernel's own).  Nothing is left behind."""
    import multiprocessing
    from verification.serving import execute
    monkeypatch.setattr(execute, "BASELINE_PROCESS_STEPS", 0 if beside == "process" else 10 ** 9)
    tr, p = chunked_spec_trace(), pairing()
    made = execute.baseline_ahead(tr, p)
    made.close()
    assert type(made).__name__ == {"inline": "BaselineInline", "process": "BaselineProcess"}[beside]
    other = sb.ServingBackend("exact")
    other.name = "baseline"
    base = Pairing(Side(other, _route(other, "exact-prefill")), Side(other, _route(other, "exact-decode")))
    beside_rows = run_pairing(tr, p, tolerances_for(DB, p, "fp32"), baseline=base)
    inline = run_pairing(tr, p, tolerances_for(DB, p, "fp32"), baseline=p)      # its own baseline: in line
    assert beside_rows.baseline_rows == inline.baseline_rows and len(inline.baseline_rows) == tr.steps
    assert beside_rows.status == "pass" and beside_rows.worst.margin == inline.worst.margin
    tols = tolerances_for(DB, p, "fp32")
    res = run_pairing(tr, p, tols, baseline=pairing("exact", "raising"))
    assert res.status == "not-applicable" and res.reason.startswith(
        "the baseline (emulator) failed: step 1 call decode serving-raising:exact-decode"), res.reason
    long = generate(5, None, requests=1, max_batch=1, prompt=(4, 4), decodes=(300, 300), H=2, HV=2, K=8, V=8)
    res = run_pairing(long, pairing("exact", "raising"), tolerances_for(DB, p, "fp32"), baseline=p)
    assert res.status == "error" and res.steps == 1
    with pytest.raises(KeyboardInterrupt):
        run_pairing(tr, p, tols, baseline=pairing("exact", "interrupt"))
    assert not multiprocessing.active_children()


def test_a_baseline_process_that_stalls_is_an_error_not_a_hung_cell(monkeypatch):
    """A forked baseline that sends nothing for STALL_S (a child that deadlocked after the fork)
    raises a RuntimeError that says so; the process is stopped and reaped.  The fork itself
    raises no warning for the run's output."""
    import multiprocessing
    import time
    import warnings
    from verification.serving import execute

    class Slow(sb.ServingBackend):
        def run_call(self, call, route):
            time.sleep(2.0)
            return super().run_call(call, route)
    slow = Slow("exact")
    slow.name = "baseline"
    base = Pairing(Side(slow, _route(slow, "exact-prefill")), Side(slow, _route(slow, "exact-decode")))
    monkeypatch.setattr(execute, "BASELINE_PROCESS_STEPS", 0)
    monkeypatch.setattr(execute.BaselineProcess, "STALL_S", 0.3)
    p = pairing()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=r"the baseline's process sent nothing for 0.3 s \(still running\)"):
            run_pairing(chunked_spec_trace(), p, tolerances_for(DB, p, "fp32"), baseline=base)
    assert not multiprocessing.active_children()
