"""Memory guards (verification/running/guards.py) against planted faults.

The backends here compute the float64 oracle's outputs in torch (no kernel, no interpreter),
write them into the caller-owned buffers, and then plant exactly one fault: one element past
o's end, one before its start, one byte into slot padding, a write into an unreferenced slot,
a row of o never written, a read of a slot whose has_initial_state is false.  Each must be
flagged with a reason naming the buffer, the side and the offset; the clean one must pass.
"""
import pytest
import torch

from kda_kernels.base import Outputs, Route
from kda_ref import truth
from kda_ref.problems import generate
from verification.running.guards import (GUARD_BYTES, GuardedBuffers, guarded_run, poison_, poison_mask)

ROUTE = Route(name="oracle")


class OracleBackend:
    """Writes the oracle's outputs into the caller's buffers, then plants ``fault``."""
    name = "oracle-guarded"

    def __init__(self, fault=None, buffers=True):
        self.fault = fault
        self.accepts_buffers = buffers

    def available(self):
        return True, ""

    def version(self):
        return "oracle"

    def routes(self):
        return [ROUTE]

    def accepts(self, problem, route):
        return True, ""

    def run(self, problem, route, buffers=None):
        t = truth(problem)
        dev, dt = problem.device, problem.v.dtype
        alloc = buffers.allocate if buffers is not None else (lambda n, s, d, dv: torch.empty(s, dtype=d, device=dv))
        o = alloc("o", t.o.shape, dt, dev)
        o.copy_(t.o)
        ws = alloc("ws_scratch", (4, 8), torch.float32, dev)
        ws.zero_()
        final = cache = None
        if problem.paged:
            cache = problem.state_cache if buffers is not None else problem.state_cache.clone()
            slots = [int(i) for i in problem.state_indices.tolist()]
            if self.fault == "reads_unread":     # reads the slot before its final state is written
                unread = [s for s, h in zip(slots, problem.has_initial_state.tolist()) if not h]
                o.add_(cache[unread[0]].sum().to(dt) * 0)   # NaN * 0 is NaN
            for s in slots:
                cache[s].copy_(t.state_cache[s])
            if self.fault == "padding":
                s, per = slots[0], cache[0].numel()
                torch.as_strided(cache, (1,), (1,), cache.storage_offset() + s * cache.stride(0) + per).fill_(1.0)
            if self.fault == "unreferenced_slot":
                free = next(i for i in range(cache.shape[0]) if i not in slots)
                cache[free, 0, 0, 0] = 0.0
        elif t.final_state is not None:
            final = alloc("final_state", t.final_state.shape, torch.float32, dev)
            final.copy_(t.final_state)
        if self.fault == "past_end":
            torch.as_strided(o, (1,), (1,), o.storage_offset() + o.numel()).fill_(1.0)
        if self.fault == "before_start":
            torch.as_strided(o, (1,), (1,), o.storage_offset() - 1).fill_(1.0)
        if self.fault == "ws_past_end":
            torch.as_strided(ws, (1,), (1,), ws.storage_offset() + ws.numel() + 7).fill_(2.0)
        if self.fault == "unwritten":
            poison_(o[:, -1])
        return Outputs(o=o, final_state=final, state_cache=cache)


@pytest.fixture(scope="module")
def paged():
    return generate(dict(lens=[20, 47], H=1, state="paged", paged_new=[1], slot_pad=64, slots=5), seed=3)


@pytest.fixture(scope="module")
def dense():
    return generate(dict(B=1, T=24, H=1, state="kv"), seed=4)


def test_band_layout_and_poison():
    bufs = GuardedBuffers()
    x = bufs.allocate("o", (3, 5), torch.bfloat16, "cpu")
    raw = bufs.buffers[0].raw
    assert raw.numel() == 2 * GUARD_BYTES + 30
    assert x.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    assert bool((raw[:GUARD_BYTES] == 0x5A).all()) and bool((raw[GUARD_BYTES + 30:] == 0x5A).all())
    assert bool(poison_mask(x).all()) and bool(torch.isnan(x).all())
    # a computed NaN is not the poison: written NaN is told apart from never written
    x[0, 0] = float("nan")
    assert not bool(poison_mask(x)[0, 0])


def test_clean_backend_passes(paged, dense):
    for p in (paged, dense):
        out, rep = guarded_run(OracleBackend(), p, ROUTE)
        assert rep.ok, rep.violations
        assert "o" in rep.buffers and rep.reason == ""
    assert "state_cache" in guarded_run(OracleBackend(), paged, ROUTE)[1].buffers


def test_the_problem_is_not_modified(paged):
    before = paged.state_cache.clone()
    guarded_run(OracleBackend(fault="padding"), paged, ROUTE)
    assert torch.equal(torch.nan_to_num(before, 7.0), torch.nan_to_num(paged.state_cache, 7.0))


@pytest.mark.parametrize("fault, expect", [
    ("past_end", "guard: o: 2 byte(s) changed in the band after the buffer (first at byte offset +0 past its end)"),
    ("before_start", "guard: o: 2 byte(s) changed in the band before the buffer (first at byte offset -2 from its start)"),
    ("ws_past_end", "guard: ws_scratch: 4 byte(s) changed in the band after the buffer "
                    "(first at byte offset +28 past its end)"),
    ("unwritten", "guard: o: 128 element(s) never written (poison left, first at index (0, 66, 0, 0))"),
])
def test_planted_output_faults_are_named(paged, fault, expect):
    _, rep = guarded_run(OracleBackend(fault=fault), paged, ROUTE)
    assert not rep.ok
    assert rep.reason.startswith(expect), rep.reason


def test_write_into_slot_padding_is_caught(paged):
    _, rep = guarded_run(OracleBackend(fault="padding"), paged, ROUTE)
    assert not rep.ok
    slot = int(paged.state_indices[0])
    st, per = paged.state_cache.stride(0), paged.state_cache[0].numel()
    first_byte = (slot * st + per) * 4          # NaN -> 1.0 changes bytes 2 and 3 of the element
    assert rep.reason.startswith(f"guard: state_cache: 2 byte(s) of padding changed (first at byte offset "
                                 f"{first_byte + 2} of the storage"), rep.reason
    assert f"slot padding after slot {slot} (element 0 of the padding)" in rep.reason


def test_write_into_an_unreferenced_slot_is_caught(paged):
    _, rep = guarded_run(OracleBackend(fault="unreferenced_slot"), paged, ROUTE)
    assert not rep.ok and "is not referenced by state_indices" in rep.reason, rep.reason


@pytest.mark.parametrize("buffers", [True, False])
def test_reading_a_slot_without_initial_state_is_caught(paged, buffers):
    _, rep = guarded_run(OracleBackend(fault="reads_unread", buffers=buffers), paged, ROUTE)
    unread = int(paged.state_indices[1])
    assert not rep.ok
    assert f"(has_initial_state false) held NaN: an unread slot was read" in rep.reason, rep.reason
    assert f"[{unread}]" in rep.reason


def test_backend_without_buffers_checks_the_cache_it_returns(paged):
    _, rep = guarded_run(OracleBackend(buffers=False), paged, ROUTE)
    assert rep.ok, rep.violations
    assert any("not checked" in c for c in rep.checked)
    _, rep = guarded_run(OracleBackend(fault="unreferenced_slot", buffers=False), paged, ROUTE)
    assert not rep.ok and "is not referenced by state_indices but changed" in rep.reason


def test_run_cell_records_guards_and_fails_a_violation():
    from verification.running.cases import Case
    from verification.judging.baselines import BaselineCache
    from verification.running.run_cell import TruthCache, run_cell
    from verification.judging.tolerances import load_tolerances

    case = Case(name="paged-pad", suite="guards", seed=5,
                params=dict(lens=[20, 47], H=1, state="paged", paged_new=[1], slot_pad=64, slots=5))
    tc, bc, db = TruthCache(), BaselineCache(), load_tolerances()
    clean = run_cell(OracleBackend(), ROUTE, case, tc, bc, db, "cpu", guards=True)
    assert clean["status"] == "pass", clean["reason"]
    assert clean["guards"]["ok"] and clean["guards"]["buffers"]["o"] == 67 * 128 * 2
    bad = run_cell(OracleBackend(fault="past_end"), ROUTE, case, tc, bc, db, "cpu", guards=True)
    assert bad["status"] == "fail"
    assert bad["reason"].startswith("guard: o: 2 byte(s) changed in the band after the buffer"), bad["reason"]
    assert bad["margin"] is not None and bad["margin"] <= 1     # the numbers alone would have passed
    off = run_cell(OracleBackend(), ROUTE, case, tc, bc, db, "cpu")   # default on a CPU: guards off
    assert off["status"] == "pass" and "guards" not in off


def test_the_band_and_poison_flags_are_read_with_one_host_read(dense, monkeypatch):
    """On one GPU shared by 16 worker processes every host read waits for the others' time
    slices; the bands (two per buffer) and the outputs' poison are read together, once."""
    from verification.running import guards

    out = OracleBackend().run(dense, ROUTE)          # the truth computed outside the count
    reads = []
    real_bool, real_tolist = torch.Tensor.__bool__, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or real_bool(t))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or real_tolist(t))
    bufs = GuardedBuffers()
    o = bufs.allocate("o", out.o.shape, out.o.dtype, "cpu")
    o.copy_(out.o)
    bufs.allocate("ws_scratch", (4, 8), torch.float32, "cpu").zero_()
    bufs.allocate("ws_more", (2, 8), torch.float32, "cpu").zero_()
    rep = guards.GuardReport()
    pending: list = []
    for buf in bufs.buffers:
        guards.check_bands(buf, bufs.band, rep, pending)
    guards.check_no_poison("o", o, rep, pending)
    guards._settle(pending)
    assert rep.ok and reads == ["tolist"]
    # a violation is still named with its particulars
    bufs.buffers[1].raw[-1] = 0
    rep2, pending = guards.GuardReport(), []
    for buf in bufs.buffers:
        guards.check_bands(buf, bufs.band, rep2, pending)
    guards._settle(pending)
    assert not rep2.ok and "ws_scratch: 1 byte(s) changed in the band after the buffer" in rep2.violations[0]
