"""The diagnosis of a pairing's first failure (docs/traces.md, "Diagnosis").

A failure at a slot that one side wrote and the other reads is most often a disagreement about
the slot, not arithmetic.  ``diagnose`` tests, on the first failing item of the first failing
step, hypotheses that each predict the kernel's numbers exactly, and names the first that holds
(its error against the prediction within the item's own threshold):

on a written slot (the state judged after the step):
    layout    the slot's memory read in the other layout (K-first [HV, K, V] where the cache is
              V-first [HV, V, K], or the reverse) equals the truth: "layout disagreement: prefill
              triton:seg wrote slot 3 K-first where the trace's cache is V-first (step 4, request 2)"
    dtype     an fp32 cache holding values that are all exactly bf16 (fp16) and equal the truth
              rounded so: the state was rounded to bf16 (fp16) on the way; a bf16 cache whose bits
              read as fp16 equal the truth (fp16 written into a bf16 cache); a bf16 cache holding the
              truth rounded toward zero, not to nearest

    clobbered the row's read slot changed earlier in the step by another call (a padding row's
              write to the pad slot's stand-in, a write to the wrong slot)
    padding a written slot holding a padding row's state (its tokens from zero): the padding row
              wrote over the live row's state

on a row's output (or the state it wrote, when no slot hypothesis holds): what the row read,
its tokens replayed in float64 (kda_ref.recurrence.token_step) from each candidate state and
compared with the kernel's o:
    layout    the read slot's content (before the step) taken in the other layout
    zero      a zero state although the row has an initial state (has_initial_state ignored)
    stale     the read slot's content before its last write (the state a token earlier)
    column    another column of a spec row's table than num_accepted_tokens - 1 (a rejected
              draft's checkpoint read)

Each message names the side's call, the slot, the step and the request, and who last wrote the
slot.  None when no hypothesis holds (the verdict's reason still names request, step, phase and
call).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kda_ref.chunked import prepare_tokens
from kda_ref.recurrence import token_step
from kda_ref.trace import SPEC
from verification.serving.judge import _writer

F64 = torch.float64
ORDER = {"vk": "V-first", "kv": "K-first"}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.to(F64).cpu(), ref.to(F64).cpu()
    if not bool(torch.isfinite(x).all()):
        return math.inf
    num = float(torch.linalg.vector_norm(x - ref))
    den = float(torch.linalg.vector_norm(ref))
    return 0.0 if num == 0 else (math.inf if den == 0 else num / den)


def other_layout_kfirst(spec, content: torch.Tensor) -> torch.Tensor:
    """A slot's memory [*slot_shape] read in the other layout, as K-first [HV, K, V]."""
    flat = content.contiguous().reshape(-1)
    HV, K, V = spec.HV, spec.K, spec.V
    if spec.layout == "vk":                  # the memory taken as K-first
        return flat.reshape(HV, K, V)
    return flat.reshape(HV, V, K).transpose(-1, -2)   # kv cache, the memory taken as V-first


def _holds(err: float, item) -> bool:
    thr = item.threshold if math.isfinite(item.threshold) else 0.0
    return math.isfinite(err) and (err <= thr or (math.isfinite(item.err) and err <= 1e-3 * item.err))


def _writer_note(writers: dict, slot: int) -> str:
    w = writers.get(slot)
    return f", written by {w[0]} at step {w[2]} (request {w[3]})" if w else ""


def slot_hypothesis(spec, content: torch.Tensor, truth_kfirst: torch.Tensor, item) -> Optional[str]:
    """The layout or dtype hypothesis that explains a written slot's content (module docstring)."""
    where = f"(step {item.step}, request {item.request})"
    other = {"vk": "K-first", "kv": "V-first"}[spec.layout]
    if _holds(_rel(other_layout_kfirst(spec, content), truth_kfirst), item):
        return (f"layout disagreement: {item.call} wrote slot {item.slot} {other} where the trace's cache is "
                f"{ORDER[spec.layout]} {where}")
    x = content.cpu()
    ref = spec.to_layout(truth_kfirst)
    if x.dtype == torch.float32 and bool(torch.isfinite(x).all()):
        for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            if bool((x.to(dt).to(torch.float32) == x).all()):
                rounded = ref.to(torch.float32).to(dt).to(F64)
                if _rel(x, rounded) <= 1e-3 * max(_rel(x, ref), 1e-30) or _rel(x, rounded) == 0.0:
                    return (f"dtype disagreement: {item.call} wrote slot {item.slot} rounded to {name} where the "
                            f"trace's cache is fp32 {where}")
    if x.dtype == torch.bfloat16:
        as16 = x.view(torch.int16).view(torch.float16)
        if _holds(_rel(as16, ref), item):
            return (f"dtype disagreement: {item.call} wrote slot {item.slot} as fp16 bits where the trace's cache "
                    f"is bf16 {where}")
        f32 = ref.to(torch.float32).contiguous()
        trunc = (f32.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
        nearest = f32.to(torch.bfloat16)
        same_t = float((trunc.view(torch.int16) == x.view(torch.int16)).double().mean())
        same_n = float((nearest.view(torch.int16) == x.view(torch.int16)).double().mean())
        if same_t >= 0.99 and same_n < 0.9:
            return (f"rounding disagreement: {item.call} wrote slot {item.slot} rounded toward zero to bf16 "
                    f"(truncated), not to nearest {where}")
    return None


def replay_tokens(tr, tok0: int, T: int, S0: torch.Tensor) -> tuple:
    """(o [T, HV, V], the state after the last token, K-first) float64: packed tokens tok0 ..
    tok0 + T - 1 by the token recurrence from K-first S0."""
    pp = prepare_tokens(tr.problem_view(), tok0, tok0 + T, None)
    decay = torch.exp(pp.a)
    S = S0.to(F64).clone()
    o = torch.empty(T, tr.HV, tr.V, dtype=F64)
    for t in range(T):
        S, o[t] = token_step(S, pp.q[t], pp.k[t], pp.v[t], decay[t], pp.beta[t], pp.scale)
    return o, S


def replay_row(tr, rp, S0: torch.Tensor) -> torch.Tensor:
    """o [T, HV, V] float64 of row ``rp``'s tokens by the token recurrence from K-first S0."""
    return replay_tokens(tr, rp.tok0, rp.T, S0)[0]


def padding_hypothesis(tr, st, run, item) -> Optional[str]:
    """A written slot holding what a padding row of the step computes from a zero state (its
    tokens' final state): the padding row wrote it over the live row's state."""
    spec = tr.cache
    content = spec.to_kfirst(spec.view(run.after)[item.slot])
    rt = tr.row_tokens()
    for c in run.calls:
        for row, ph in zip(c.rows, c.phases):
            T = int(rt[row + 1] - rt[row])
            if ph != -1 or T == 0:
                continue
            _, S = replay_tokens(tr, int(rt[row]), T, torch.zeros(tr.HV, tr.K, tr.V, dtype=F64))
            if _holds(_rel(content, S), item):
                return (f"padding row written: {c.label} padding row {row} (pad slot {spec.pad_slot}) wrote its state "
                        f"to slot {item.slot}, over request {item.request}'s (step {item.step})")
    return None


def clobber_hypothesis(tr, st, run, item) -> Optional[str]:
    """The failing row's read slot changed by a call that ran before the row's own call in the
    same step (none should: no slot is written by one row and read by another in a step)."""
    rp = next((x for x in st.plan.rows if x.row == item.row), None)
    if rp is None or rp.read is None:
        return None
    spec = tr.cache
    own = next((i for i, c in enumerate(run.calls) if rp.row in c.rows), None)
    for c in run.calls[:own or 0]:
        if c.changed is None:
            continue
        hit = torch.nonzero(spec.view(c.changed)[rp.read].reshape(-1)).flatten()
        if hit.numel():
            index = spec.offset + rp.read * spec.stride + int(hit[0])
            return (f"slot overwritten before it was read: {_writer(spec, [c], index, rp.read)} changed slot "
                    f"{rp.read} in step {item.step} before {run.calls[own].label} read it for request {rp.request}")
    return None


def row_hypothesis(tr, st, run, item, writers: dict, previous: Optional[dict] = None) -> Optional[str]:
    """What the failing row read, when a candidate state explains its o (module docstring)."""
    rp = next((x for x in st.plan.rows if x.row == item.row), None)
    if rp is None or rp.read is None:
        return None
    spec = tr.cache
    a = rp.tok0 - st.plan.tok0
    got = run.o[a:a + rp.T]
    if not bool(torch.isfinite(got).all()):
        return None
    before = spec.view(run.before)
    where = f"(step {item.step}, request {rp.request})"
    thr_item = item if item.kind == "o" else None
    thr = thr_item.threshold if thr_item is not None else 1e-2

    def explains(S0) -> bool:
        if not bool(torch.isfinite(S0).all()):
            return False
        err = _rel(got, replay_row(tr, rp, S0))
        return math.isfinite(err) and err <= thr
    content = before[rp.read]
    if explains(other_layout_kfirst(spec, content)):
        other = {"vk": "K-first", "kv": "V-first"}[spec.layout]
        return (f"layout disagreement: {item.call} read slot {rp.read} {other} where the trace's cache is "
                f"{ORDER[spec.layout]}{_writer_note(writers, rp.read)} {where}")
    if explains(torch.zeros(tr.HV, tr.K, tr.V, dtype=F64)):
        return (f"has_initial_state ignored: {item.call} started request {rp.request} from a zero state instead of "
                f"slot {rp.read}{_writer_note(writers, rp.read)} {where}")
    prev = (previous or {}).get(rp.read)
    if prev is not None and explains(spec.to_kfirst(prev[1])):
        return (f"stale read: {item.call} read slot {rp.read} as it was before its write at step {prev[0]}, not "
                f"its current content{_writer_note(writers, rp.read)} {where}")
    if rp.phase == SPEC:
        table = tr.state_indices[rp.row].tolist()
        col = int(tr.num_accepted_tokens[rp.row]) - 1
        for j, slot in enumerate(table):
            if j == col or slot == spec.pad_slot or slot == rp.read:
                continue
            if explains(spec.to_kfirst(before[slot])):
                return (f"wrong checkpoint read: {item.call} read slot {slot} (state_indices column {j}) instead of "
                        f"slot {rp.read} (column {col}, the last accepted token's checkpoint): a rejected draft's "
                        f"state kept {where}")
    return None


def diagnose(tr, st, verdict, run, pairing, writers: dict, previous: Optional[dict] = None) -> Optional[str]:
    """The named cause of the first failing item of ``verdict`` (module docstring), or None.
    ``writers``: slot -> (call label, group, step, request) of its last write; ``previous``: slot ->
    (step of its last write, its content before that write), for the stale-read hypothesis."""
    first = verdict.failed[0]
    if first.kind == "untouched":
        return None
    if first.kind == "state":
        found = (slot_hypothesis(tr.cache, tr.cache.view(run.after)[first.slot], st.slots[first.slot], first)
                 or padding_hypothesis(tr, st, run, first))
        if found:
            return found
    failing_o = next((i for i in verdict.failed if i.kind == "o" and i.row == first.row), None)
    return (clobber_hypothesis(tr, st, run, first)
            or row_hypothesis(tr, st, run, failing_o or first, writers, previous))
