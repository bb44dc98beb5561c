"""Memory guards for one kernel call: guard bands, poisoned outputs, an untouched paged cache.

A backend that takes caller-owned buffers (``run(problem, route, buffers=GuardedBuffers)``,
advertised by ``accepts_buffers = True``; ours: kda_kernels/triton/backend.py) gets every output,
workspace and state buffer from ``GuardedBuffers``:

    raw = [ band (GUARD_BYTES of 0x5A) | buffer (nbytes) | band (GUARD_BYTES of 0x5A) ]  uint8

one allocation, the buffer a view into its middle.  Outputs (o, final_state) are poisoned first
with a NaN whose payload no arithmetic makes (``POISON_BITS``: e.g. bf16 0x7FA5, fp32 0x7FA5A5A5;
a computed NaN is the canonical 0x7FC0 / 0x7FC00000).  After the call (``check``):

- every band is byte-identical to 0x5A (a NaN written over a NaN guard would be invisible, so
  the band is not NaN);
- no poison is left in an output (every element was written);
- the paged cache (copied, padding included, into a guarded buffer): every byte outside the
  slots named by ``state_indices`` (unreferenced slots, slot padding) is byte-identical to before;
- a slot whose has_initial_state is false holds the poison NaN before the call: it must never be
  read (no NaN in o or in a written slot) and must be written (no poison left in it).

A backend without caller-owned buffers gets what can be checked from outside: the poisoned
unread slots, the untouched unreferenced slots and padding of the cache it returns, no NaN leak.

``guarded_run(backend, problem, route) -> (Outputs, GuardReport)``; ``GuardReport.reason`` reads
``guard: o: 2 byte(s) changed in the band after the buffer (first at byte 0 past its end)``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from kda_kernels.base import TakesBuffers, copy_with_padding

GUARD_BYTES = 4096
GUARD_BYTE = 0x5A
OUTPUT_NAMES = ("o", "final_state")          # buffers that must be written everywhere
POISON_BITS = {                               # a NaN with a payload no kernel computes
    torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5),
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.bfloat16: (torch.int16, 0x7FA5),
    torch.float16: (torch.int16, 0x7EA5),
}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` (float) with the poison NaN of its dtype, in place."""
    if t.dtype not in POISON_BITS:
        raise ValueError(f"poison: expected one of {', '.join(map(str, POISON_BITS))}, got {t.dtype}")
    idt, bits = POISON_BITS[t.dtype]
    t.view(idt).fill_(bits)
    return t


def poison_mask(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` still holds the poison bit pattern."""
    idt, bits = POISON_BITS[t.dtype]
    return t.view(idt) == bits


def _first_index(mask: torch.Tensor) -> tuple:
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


@dataclass
class GuardedBuffer:
    name: str
    raw: torch.Tensor              # uint8 [band + nbytes + band]
    view: torch.Tensor             # the buffer the kernel sees
    nbytes: int
    is_output: bool


class GuardedBuffers:
    """Allocator of guard-banded buffers; ``allocate`` is what a backend's forward calls for every
    buffer it makes (name, shape, dtype, device); ``adopt`` copies a tensor the kernel writes in
    place (the paged cache) with its whole storage (padding) into a guarded buffer."""

    def __init__(self, band: int = GUARD_BYTES):
        self.band = int(band)
        self.buffers: list[GuardedBuffer] = []
        self.cache: Optional[GuardedBuffer] = None
        self.cache_before: Optional[torch.Tensor] = None

    def _raw(self, nbytes: int, device) -> torch.Tensor:
        return torch.full((self.band + nbytes + self.band,), GUARD_BYTE, dtype=torch.uint8, device=device)

    def allocate(self, name: str, shape, dtype, device) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        es = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in shape:
            n *= s
        raw = self._raw(n * es, device)
        view = raw[self.band:self.band + n * es].view(dtype).view(shape)
        if dtype in POISON_BITS:
            poison_(view)     # outputs (checked: all written) and workspaces (a read before write is NaN)
        self.buffers.append(GuardedBuffer(name, raw, view, n * es, name in OUTPUT_NAMES))
        return view

    def adopt(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` with t's strides and offset over a guarded copy of its whole storage."""
        nbytes = t.untyped_storage().nbytes()
        raw = self._raw(nbytes, t.device)
        mid = raw[self.band:self.band + nbytes]
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0, (nbytes,), (1,))
        mid.copy_(src)
        flat = mid.view(t.dtype)
        view = flat.as_strided(t.shape, t.stride(), flat.storage_offset() + t.storage_offset())
        buf = GuardedBuffer(name, raw, view, nbytes, False)
        self.buffers.append(buf)
        self.cache = buf
        self.snapshot_cache()
        return view

    def snapshot_cache(self):
        if self.cache is not None:
            self.cache_before = self.cache.raw[self.band:self.band + self.cache.nbytes].clone()


@dataclass
class GuardReport:
    ok: bool = True
    violations: list = field(default_factory=list)       # one line each, naming buffer, side, offset
    checked: list = field(default_factory=list)          # what was checked, in words
    buffers: dict = field(default_factory=dict)          # name -> bytes guarded
    kernel_s: float = 0.0                                # the backend's call alone (device synchronised)

    @property
    def reason(self) -> str:
        if self.ok:
            return ""
        more = f" (and {len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
        return f"guard: {self.violations[0]}{more}"

    def as_record(self) -> dict:
        return {"ok": self.ok, "violations": list(self.violations), "checked": list(self.checked),
                "buffers": dict(self.buffers), "kernel_s": self.kernel_s}

    def fail(self, msg: str):
        self.ok = False
        self.violations.append(msg)


def _settle(pending: list) -> None:
    """Read the flags of ``pending`` [(bool tensor, detail)] with one device synchronisation and
    call ``detail()`` for each flag that is set (it computes and reports the violation's
    particulars).  On one GPU shared by many worker processes a synchronisation waits for the
    others' time slices: reading each flag on its own (two per buffer, one per output) cost a
    warm H200 matrix 144 s of its 670 s of worker time in guards."""
    if not pending:
        return
    hits = torch.stack([flag.reshape(()) for flag, _ in pending]).tolist()
    for (_, detail), hit in zip(pending, hits):
        if hit:
            detail()


def check_bands(buf: GuardedBuffer, band: int, report: GuardReport, pending: Optional[list] = None) -> None:
    """Every byte of the two guard bands of ``buf`` is still GUARD_BYTE.  With ``pending``, the
    check's flags are appended there for ``_settle`` instead of read at once."""
    before = buf.raw[:band] != GUARD_BYTE
    after = buf.raw[band + buf.nbytes:] != GUARD_BYTE

    def before_detail():
        idx = before.nonzero().flatten()
        first = band - int(idx.min())
        report.fail(f"{buf.name}: {int(idx.numel())} byte(s) changed in the band before the buffer "
                    f"(first at byte offset -{first} from its start)")

    def after_detail():
        idx = after.nonzero().flatten()
        report.fail(f"{buf.name}: {int(idx.numel())} byte(s) changed in the band after the buffer "
                    f"(first at byte offset +{int(idx.min())} past its end)")

    checks = [(before.any(), before_detail), (after.any(), after_detail)]
    if pending is None:
        _settle(checks)
    else:
        pending.extend(checks)


def _slot_layout(cache: torch.Tensor, base: int):
    """(element offset of slot 0 from ``base``, slot stride, elements per slot) of a cache with
    dense slots, or None."""
    if cache.dim() < 2 or not cache[0].is_contiguous():
        return None
    return cache.storage_offset() - base, cache.stride(0), cache[0].numel()


def check_cache(before: torch.Tensor, after: torch.Tensor, cache: torch.Tensor, written_slots: list,
                report: GuardReport, name: str = "state_cache", base: int = 0) -> None:
    """Bytes ``after`` vs ``before`` (the cache's whole storage as uint8, starting at element
    ``base`` of the cache's storage) outside the written slots (masked out first, so a large
    written cache costs one compare, not an index per changed byte)."""
    layout = _slot_layout(cache, base)
    es = cache.element_size()
    if layout is None:
        diff = (after != before).nonzero().flatten()
        if diff.numel():
            report.fail(f"{name}: {int(diff.numel())} byte(s) changed in a cache whose slots are not dense "
                        f"(first at byte offset {int(diff[0])} of its storage)")
        return
    off, st, per = layout
    changed = after != before
    for s in sorted(set(int(x) for x in written_slots)):
        changed[(off + s * st) * es:(off + s * st + per) * es] = False
    diff = changed.nonzero().flatten()
    if diff.numel() == 0:
        return
    elem = diff // es
    rel = elem - off
    slot = torch.div(rel, st, rounding_mode="floor")
    within = rel - slot * st
    in_slot = (rel >= 0) & (slot < cache.shape[0]) & (within < per)
    b, s, w = int(diff[0]), int(slot[0]), int(within[0])
    n_pad = int((~in_slot).sum())
    n_slot = int(in_slot.sum())
    if not bool(in_slot[0]):
        where = (f"slot padding after slot {s} (element {w - per} of the padding)" if 0 <= s < cache.shape[0]
                 else "storage outside every slot")
        report.fail(f"{name}: {n_pad} byte(s) of padding changed (first at byte offset {b} of the storage, "
                    f"{where}); unreferenced slot bytes changed: {n_slot}")
    else:
        report.fail(f"{name}: slot {s} is not referenced by state_indices but {n_slot} of its byte(s) changed "
                    f"(first at byte offset {w * es + (b % es)} of the slot); padding bytes changed: {n_pad}")


def check_no_poison(name: str, t: torch.Tensor, report: GuardReport, pending: Optional[list] = None) -> None:
    """No element of ``t`` still holds the poison (every element was written); ``pending`` as in
    ``check_bands``."""
    if t is None or t.dtype not in POISON_BITS:
        return
    m = poison_mask(t)

    def detail():
        report.fail(f"{name}: {int(m.sum())} element(s) never written (poison left, first at index "
                    f"{_first_index(m)})")

    checks = [(m.any(), detail)]
    if pending is None:
        _settle(checks)
    else:
        pending.extend(checks)


def _nan_leaks(outputs, problem, unread: list, written: list, report: GuardReport) -> None:
    """With NaN in the unread slots ``unread``, no NaN may appear in o or a written slot."""
    if not unread:
        return
    for tname, t in (("o", outputs.o), ("final_state", outputs.final_state)):
        if t is not None and t.is_floating_point():
            nan = torch.isnan(t) & ~poison_mask(t) if t.dtype in POISON_BITS else torch.isnan(t)
            if bool(nan.any()):
                report.fail(f"{tname}: {int(nan.sum())} NaN (first at index {_first_index(nan)}) while slot(s) "
                            f"{unread} (has_initial_state false) held NaN: an unread slot was read")
    sc = outputs.state_cache
    if sc is not None and sc.shape == problem.state_cache.shape:
        for n, s in enumerate(written):
            slot = sc[s]
            nan = torch.isnan(slot) & ~poison_mask(slot)
            if bool(nan.any()):
                report.fail(f"state_cache: slot {s} (written for sequence {n}) holds {int(nan.sum())} NaN "
                            f"while slot(s) {unread} (has_initial_state false) held NaN: an unread slot was read")


def _poisoned_unread(problem, cache: torch.Tensor) -> list:
    idx = [int(i) for i in problem.state_indices.tolist()]
    has = [bool(h) for h in problem.has_initial_state.tolist()]
    unread = [s for s, h in zip(idx, has) if not h]
    for s in unread:
        poison_(cache[s])
    return unread


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(report: GuardReport, fn, problem, *args, **kwargs):
    _sync(problem.device)
    t0 = time.perf_counter()
    out = fn(problem, *args, **kwargs)
    _sync(problem.device)
    report.kernel_s = time.perf_counter() - t0
    return out


def guarded_run(backend, problem, route, **run_kwargs):
    """Run ``backend.run(problem, route)`` under the guards above; returns (Outputs, GuardReport).
    The Problem given is not modified (its cache is copied)."""

    report = GuardReport()
    supports = isinstance(backend, TakesBuffers) and bool(backend.accepts_buffers)
    unread, written = [], []
    if problem.paged:
        written = [int(i) for i in problem.state_indices.tolist()]
    if supports:
        bufs = GuardedBuffers()
        run_problem = problem
        if problem.paged:
            cache = bufs.adopt("state_cache", problem.state_cache)
            unread = _poisoned_unread(problem, cache)
            bufs.snapshot_cache()
            run_problem = problem.replace(state_cache=cache)
        outputs = _timed(report, backend.run, run_problem, route, buffers=bufs, **run_kwargs)
        report.checked.append(f"guard bands of {GUARD_BYTES} bytes of 0x{GUARD_BYTE:02X} around "
                              f"{', '.join(b.name for b in bufs.buffers) or 'no buffer'}")
        pending: list = []                  # every band and poison flag, read with one synchronisation
        for buf in bufs.buffers:
            report.buffers[buf.name] = report.buffers.get(buf.name, 0) + buf.nbytes
            check_bands(buf, bufs.band, report, pending)
        for tname in OUTPUT_NAMES:
            check_no_poison(tname, getattr(outputs, tname, None), report, pending)
        _settle(pending)
        report.checked.append("outputs poisoned before the call, every element written")
        if bufs.cache is not None:
            after = bufs.cache.raw[bufs.band:bufs.band + bufs.cache.nbytes]
            check_cache(bufs.cache_before, after, bufs.cache.view, written, report,
                        base=bufs.band // bufs.cache.view.element_size())
            for s in unread:
                check_no_poison(f"state_cache slot {s} (written, has_initial_state false)",
                                bufs.cache.view[s], report)
    else:
        run_problem = problem
        before = None
        if problem.paged:
            cache = copy_with_padding(problem.state_cache)
            unread = _poisoned_unread(problem, cache)
            before = cache.clone()   # the slots' values (NaN-equal compare below, bitwise)
            run_problem = problem.replace(state_cache=cache)
        outputs = _timed(report, backend.run, run_problem, route, **run_kwargs)
        report.checked.append("no caller-owned buffers: bands and poison not checked")
        sc = outputs.state_cache
        if problem.paged and sc is not None:
            if sc.shape != before.shape:
                report.fail(f"state_cache: expected the cache back shaped {list(before.shape)}, got {list(sc.shape)}")
            else:
                for s in range(before.shape[0]):
                    if s in written:
                        continue
                    a = before[s].contiguous().view(torch.uint8)
                    b = sc[s].to(before.device).contiguous().view(torch.uint8)
                    if not torch.equal(a, b):
                        report.fail(f"state_cache: slot {s} is not referenced by state_indices but changed")
                        break
    if problem.paged:
        report.checked.append(f"unreferenced slots and padding untouched; unread slots {unread} poisoned (NaN)")
        _nan_leaks(outputs, problem, unread, written, report)
    return outputs, report
