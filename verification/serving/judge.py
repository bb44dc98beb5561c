"""Verdicts on one step of a serving trace (docs/traces.md, "Verdicts").

``judge_step(truth, base, o, before, after, tols, calls)`` is a pure function of the step's
truth (kda_ref.trace_oracle.StepTruth), the baseline's errors on the same step (``measure`` of
the emulator's run), the kernel's o [Tstep, HV, V], the flat cache buffer before and after the
step, the tolerance entries of the routes that ran each group, and what the calls were
(``CallInfo``: group, label, rows, tables, and optionally which buffer elements each call
changed).  It judges:

- o per (request, step): the request's live tokens in the step.  With d = o - o_ref over those
  tokens, the slice error is verification.judging.verdict.slice_errors' (its squared error over its
  squared reference, the reference floored at NEGLIGIBLE_SLICE of the step's rms: a near-zero
  row is measured on the step's scale).  Threshold

        a   = slice_allowance: 1 + 1/sqrt(tokens)      (one decode token: 2; a 64-token chunk: 1.125)
        b   = max(b_row, SLICE_FLOOR_SHARE * b_step)   (the baseline's error on the row, at least its
                                                        error over the step's live tokens)
        thr = min(m * a * b + floor, cap)              (tolerances.yaml entry of the route that ran
                                                        the row's group, tensor o)

  Padding rows' tokens are not judged.
- the state per written slot: rel_l2 of the slot's content (cache dtype, cache layout, upcast)
  against ``truth.expected(slot)``, threshold min(m * b + floor, cap) with the entry for tensor
  state_cache of the route whose call wrote the slot, b the baseline's error on that slot.
- every other element of the buffer (unwritten slots, guard rows, padding between slots) must be
  bitwise unchanged (NaN-aware: compared as integers): a change fails, naming the step, the slot
  or region and the call (and row, where the call's table says) that wrote it.

Where the baseline errs above the cap itself (no rounding of its recipe meets the cap there), the
cap is lifted to m * a * b + floor and the item says so (``cap_lifted``).  Any NaN or Inf in the
judged values fails.  A baseline error that is NaN or Inf (the emulator broken on the trace) leaves
the item not-applicable, never a pass.

Items: ``Item``; the step's verdict: ``StepVerdict`` (its items, failing first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from verification.judging.verdict import NEGLIGIBLE_SLICE, SLICE_FLOOR_SHARE, slice_allowance, slice_errors  # noqa: F401

F64 = torch.float64
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
        torch.float64: torch.int64}


@dataclass
class CallInfo:
    """One call of a step as the judge needs it: its group, a label ("prefill triton:seg"),
    the trace rows it carried, their tables ([W] slot lists), phases (-1 padding), and
    ``changed``: bool [buffer_numel] of the elements the call changed (None: not recorded)."""
    group: str
    label: str
    rows: list
    tables: list
    phases: list
    changed: Optional[torch.Tensor] = None


@dataclass
class Item:
    kind: str                       # "o" | "state" | "untouched"
    step: int
    status: str                     # pass | fail | not-applicable
    err: float = math.nan
    baseline_err: float = math.nan
    threshold: float = math.nan
    margin: float = math.nan
    request: Optional[int] = None
    row: Optional[int] = None
    phase: str = ""
    group: str = ""
    call: str = ""
    slot: Optional[int] = None
    tokens: int = 0
    where: str = ""                 # "request 2 step 4 (decode, call decode fla:recurrent)"
    reason: str = ""
    cap_lifted: bool = False

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}


@dataclass
class StepVerdict:
    step: int
    items: list = field(default_factory=list)

    @property
    def failed(self) -> list:
        return [i for i in self.items if i.status == "fail"]

    @property
    def status(self) -> str:
        sts = {i.status for i in self.items}
        return "fail" if "fail" in sts else ("not-applicable" if "not-applicable" in sts else "pass")


PHASE_NAMES = {0: "prefill", 1: "decode", 2: "spec", -1: "padding"}


# ------------------------------------------------------------------------------ measuring
def measure(truth, o: torch.Tensor, after: torch.Tensor, before: Optional[torch.Tensor] = None) -> dict:
    """The errors of one run on one step: {"rows": {trace row: (err, err_sq, ref_sq, count)},
    "step": err over every live token, "slots": {slot: rel_l2}} (module docstring).  Used for the
    kernel and for the baseline alike.  With ``before`` (the buffer before the step) it also
    counts the elements outside the written slots whose bits changed, ``"outside"`` (what
    judge_step's bitwise check reads first), in the same transfer."""
    plan = truth.plan
    rows = plan.rows
    e2, r2, cnt = [], [], []
    bad = []
    view = truth.cache.view(after)
    written = list(truth.written)
    outside = None
    if before is not None:
        outside = changed_outside(truth.cache, written, before, after).sum()
    if o.device.type == "cpu" and after.device.type == "cpu":
        o, host = o.to(F64), [view[s].to(F64) for s in written]
        outside = None if outside is None else int(outside)
    else:
        # o, the written slots and the outside count, float64 on the host in one transfer (one
        # device sync per step, not one per row, one per slot and one for the bitwise check);
        # the same numbers as casting each piece on its own
        parts = [o.reshape(-1).to(F64)] + [view[s].reshape(-1).to(F64) for s in written]
        if outside is not None:
            parts.append(outside.reshape(1).to(F64))
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()
        if outside is not None:
            flat, outside = flat[:-1], int(flat[-1])
        n_o = o.numel()
        o = flat[:n_o].view(o.shape)
        host = flat[n_o:].view((len(written),) + tuple(view.shape[1:])) if written else None
    for rp in rows:
        a = rp.tok0 - plan.tok0
        x = o[a:a + rp.T]
        r = truth.o[a:a + rp.T]
        finite = bool(torch.isfinite(x).all())
        d = x - r
        e2.append(float((d * d).sum()) if finite else math.inf)
        r2.append(float((r * r).sum()))
        cnt.append(int(r.numel()))
        bad.append(not finite)
    errs = slice_errors({"err_sq": e2, "ref_sq": r2, "count": cnt}) if rows else []
    errs = [math.inf if b else e for e, b in zip(errs, bad)]
    tot_e, tot_r = sum(e2), sum(r2)
    step_err = 0.0 if tot_e == 0 else (math.inf if tot_r == 0 or math.isinf(tot_e) else math.sqrt(tot_e / tot_r))
    out_rows = {rp.row: (errs[i], e2[i], r2[i], cnt[i]) for i, rp in enumerate(rows)}
    slots = {}
    for j, s in enumerate(written):
        x = host[j]
        ref = truth.expected(s)
        if not bool(torch.isfinite(x).all()):
            slots[s] = math.inf
            continue
        num = float(torch.linalg.vector_norm(x - ref))
        den = float(torch.linalg.vector_norm(ref))
        slots[s] = 0.0 if num == 0 else (math.inf if den == 0 else num / den)
    out = {"rows": out_rows, "step": step_err, "slots": slots}
    if outside is not None:
        out["outside"] = outside
    return out


def changed_mask(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """bool [numel]: the elements whose bits differ (NaN equal to a NaN of the same bits)."""
    it = _INT[before.dtype]
    return before.view(it) != after.view(it)


def changed_outside(spec, written, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """bool [numel]: the elements outside the ``written`` slots whose bits changed (what the
    bitwise check fails on)."""
    return changed_mask(before, after) & unwritten_mask(spec, written, device=after.device)


def written_mask(spec, slots, device=None) -> torch.Tensor:
    """bool [buffer_numel]: the elements of ``slots``."""
    m = torch.zeros(spec.buffer_numel, dtype=torch.bool, device=device)
    v = spec.view(m)
    for s in slots:
        v[s] = True
    return m


_UNWRITTEN: dict = {}       # (spec, slots, device) -> ~written_mask: a trace's steps write few distinct slot sets
_UNWRITTEN_MAX_BYTES = 2 ** 28


def unwritten_mask(spec, slots, device=None) -> torch.Tensor:
    """bool [buffer_numel]: every element outside ``slots`` (``~written_mask``), built once per
    (spec, slot set, device) and shared: callers must not write into it.  The masks kept stay
    under 256 MB (all are dropped when a new one would pass that)."""
    key = (spec, tuple(slots), str(device))
    m = _UNWRITTEN.get(key)
    if m is None:
        if sum(x.numel() for x in _UNWRITTEN.values()) + spec.buffer_numel > _UNWRITTEN_MAX_BYTES:
            _UNWRITTEN.clear()
        m = _UNWRITTEN[key] = ~written_mask(spec, slots, device=device)
    return m


def region_of(spec, index: int) -> tuple:
    """(name, slot or None) of a flat buffer element: "guard rows before slot 0", "guard rows
    after slot N-1", "padding after slot i" or "slot i"."""
    if index < spec.offset:
        return "guard rows before slot 0", None
    rel = index - spec.offset
    if rel >= spec.slots * spec.stride:
        return f"guard rows after slot {spec.slots - 1}", None
    slot, within = divmod(rel, spec.stride)
    if within >= spec.slot_numel:
        return f"padding after slot {slot}", None
    return f"slot {slot}", slot


def _writer(spec, calls: list, index: int, slot: Optional[int]) -> str:
    """Which call (and row) changed element ``index``: the call whose ``changed`` mask holds it;
    the row of that call whose table names the slot, or a padding row whose pad slot is the
    slot (-1 indexes the last slot)."""
    who = [c for c in calls if c.changed is not None and bool(c.changed[index])]
    if not who:
        return "a call of the step" if calls else "the step"
    c = who[0]
    if slot is not None:
        for row, table, ph in zip(c.rows, c.tables, c.phases):
            for x in table:
                if ph != -1 and x == spec.pad_slot:     # a live row's unused table column
                    continue
                hit = x == slot or (x < 0 and x + spec.slots == slot)
                if hit and ph == -1:
                    return (f"call {c.label}, padding row {row} (pad slot {x}"
                            f"{', the last slot' if x < 0 else ''})")
                if hit:
                    return f"call {c.label}, row {row} ({PHASE_NAMES.get(ph, ph)}, table {table})"
        pads = [row for row, ph in zip(c.rows, c.phases) if ph == -1]
        if pads:
            return (f"call {c.label} (no row of it names slot {slot}; its padding row(s) {pads}, pad slot "
                    f"{spec.pad_slot}, are the ones with no slot of their own)")
    return f"call {c.label}"


def _threshold(tol, b: float, a: float = 1.0) -> tuple:
    """(threshold, cap_lifted) for baseline error b and allowance a (module docstring)."""
    raw = tol.m * a * b + tol.floor
    if b > tol.cap:
        return raw, True
    return min(raw, tol.cap), False


def _margin(err: float, thr: float) -> float:
    if math.isnan(err) or math.isnan(thr) or math.isinf(err):
        return math.inf
    return err / thr if thr > 0 else (0.0 if err == 0 else math.inf)


# ------------------------------------------------------------------------------ judging
def judge_step(truth, base: dict, o: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
               tols: dict, calls: list, kernel: Optional[dict] = None) -> StepVerdict:
    """The verdict of one step (module docstring).  ``base``: ``measure`` of the baseline on
    this step; ``tols``: {group: {"o": Tolerance, "state_cache": Tolerance}}; ``calls``: the
    step's CallInfo list; ``kernel``: ``measure`` of the kernel when already computed."""
    s = truth.step
    spec = truth.cache
    kernel = kernel if kernel is not None else measure(truth, o, after)
    row_call = {}
    for c in calls:
        for r in c.rows:
            row_call[r] = c
    items = []
    # bitwise: nothing outside the written slots changes
    counted = kernel.get("outside")             # measure's count, read with the rest of the step
    outside = changed_outside(spec, truth.written, before, after) if counted is None or counted else None
    if counted if counted is not None else bool(outside.any()):
        idx = torch.nonzero(outside).flatten().tolist()
        seen = {}
        for i in idx:
            name, slot = region_of(spec, i)
            seen.setdefault(name, (i, slot, 0))
            seen[name] = (seen[name][0], slot, seen[name][2] + 1)
        for name, (i, slot, n) in seen.items():
            who = _writer(spec, calls, i, slot)
            what = "the pad slot (NULL block) " if spec.pad == "null0" and slot == 0 else ""
            items.append(Item(kind="untouched", step=s, status="fail", slot=slot, err=float(n), margin=math.inf,
                              call=who, where=f"step {s} {what}{name}",
                              reason=(f"step {s}: {n} element(s) of {what}{name} changed, which the step does not "
                                      f"write (they must stay bitwise unchanged); written by {who}")))
    # o per (request, step)
    base_step = base.get("step", math.nan)
    for rp in truth.plan.rows:
        c = row_call.get(rp.row)
        group = c.group if c else {0: "prefill", 1: "decode", 2: "spec"}[rp.phase]
        tol = tols[group]["o"]
        err = kernel["rows"][rp.row][0]
        b_row = base["rows"].get(rp.row, (math.nan,))[0]
        phase = PHASE_NAMES[rp.phase]
        where = f"request {rp.request} step {s} ({phase}, {rp.T} token{'s' if rp.T != 1 else ''}, call {c.label if c else group})"
        if not (math.isfinite(b_row) and math.isfinite(base_step)):
            items.append(Item(kind="o", step=s, status="not-applicable", err=err, request=rp.request, row=rp.row,
                              phase=phase, group=group, call=c.label if c else "", tokens=rp.T, where=where,
                              reason=f"o {where}: the baseline's error is {b_row} (not finite), so nothing judges it"))
            continue
        a = slice_allowance("seq_head", None, tokens=rp.T)
        b = max(b_row, SLICE_FLOOR_SHARE * base_step)
        thr, lifted = _threshold(tol, b, a)
        margin = _margin(err, thr)
        st = "fail" if margin > 1 else "pass"
        reason = ""
        if st == "fail":
            rule = f"{tol.m:g}*{a:.3g}*{b:.3g}+{tol.floor:g}" if thr < tol.cap or lifted else f"cap {tol.cap:g}"
            reason = f"o {where}: rel_l2 {err:.3g} > {thr:.3g} = {rule} (tolerance {tol.key})"
            if not math.isfinite(err):
                reason = f"o {where}: NaN or Inf in the output (NaN never passes)"
        items.append(Item(kind="o", step=s, status=st, err=err, baseline_err=b, threshold=thr, margin=margin,
                          request=rp.request, row=rp.row, phase=phase, group=group, call=c.label if c else "",
                          tokens=rp.T, where=where, reason=reason, cap_lifted=lifted))
    # the state per written slot
    writer = {}
    for rp in truth.plan.rows:
        for t, slot in rp.writes:
            writer[slot] = (rp, t)
    for slot in truth.written:
        rp, t = writer[slot]
        c = row_call.get(rp.row)
        group = c.group if c else {0: "prefill", 1: "decode", 2: "spec"}[rp.phase]
        tol = tols[group]["state_cache"]
        err = kernel["slots"][slot]
        b = base["slots"].get(slot, math.nan)
        phase = PHASE_NAMES[rp.phase]
        where = (f"slot {slot} step {s} (request {rp.request}, {phase}"
                 + (f" token {t}" if rp.phase == 2 else "") + f", call {c.label if c else group})")
        if not math.isfinite(b):
            items.append(Item(kind="state", step=s, status="not-applicable", err=err, request=rp.request, row=rp.row,
                              phase=phase, group=group, slot=slot, call=c.label if c else "", where=where,
                              reason=f"state {where}: the baseline's error is {b} (not finite)"))
            continue
        thr, lifted = _threshold(tol, b)
        margin = _margin(err, thr)
        st = "fail" if margin > 1 else "pass"
        reason = ""
        if st == "fail":
            reason = (f"state {where}: rel_l2 {err:.3g} > {thr:.3g} = min({tol.m:g}*{b:.3g}+{tol.floor:g}, "
                      f"cap {tol.cap:g}) (tolerance {tol.key})")
            if not math.isfinite(err):
                reason = f"state {where}: NaN or Inf in the written slot (NaN never passes)"
        items.append(Item(kind="state", step=s, status=st, err=err, baseline_err=b, threshold=thr, margin=margin,
                          request=rp.request, row=rp.row, phase=phase, group=group, slot=slot,
                          call=c.label if c else "", tokens=rp.T, where=where, reason=reason, cap_lifted=lifted))
    items.sort(key=lambda i: (i.status != "fail", {"untouched": 0, "state": 1, "o": 2}[i.kind]))
    return StepVerdict(step=s, items=items)
