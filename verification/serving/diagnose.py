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

on a row's output (or the state it wrote, when no slot hypothesis holds): what the row read,
its tokens replayed in float64 (kda_ref.recurrence.token_step) from each candidate state and
compared with the kernel's o:
    layout    the read slot's content (before the step) taken in the other layout
    zero      a zero state although the row has an initial state (has_initial_state ignored)
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

from kda_ref.trace import SPEC

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


def replay_row(tr, rp, S0: torch.Tensor) -> torch.Tensor:
    """o [T, HV, V] float64 of row ``rp``'s tokens by the token recurrence from K-first S0."""
    from kda_ref.chunked import prepare_tokens
    from kda_ref.recurrence import token_step
    pp = prepare_tokens(tr.problem_view(), rp.tok0, rp.tok0 + rp.T, None)
    decay = torch.exp(pp.a)
    S = S0.to(F64).clone()
    o = torch.empty(rp.T, tr.HV, tr.V, dtype=F64)
    for t in range(rp.T):
        S, o[t] = token_step(S, pp.q[t], pp.k[t], pp.v[t], decay[t], pp.beta[t], pp.scale)
    return o


def row_hypothesis(tr, st, run, item, writers: dict) -> Optional[str]:
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


def diagnose(tr, st, verdict, run, pairing, writers: dict) -> Optional[str]:
    """The named cause of the first failing item of ``verdict`` (module docstring), or None."""
    first = verdict.failed[0]
    if first.kind == "untouched":
        return None
    if first.kind == "state":
        found = slot_hypothesis(tr.cache, tr.cache.view(run.after)[first.slot], st.slots[first.slot], first)
        if found:
            return found
    failing_o = next((i for i in verdict.failed if i.kind == "o" and i.row == first.row), None)
    return row_hypothesis(tr, st, run, failing_o or first, writers)
