"""Run a serving trace step by step through kernel adapters and measure it against the trace oracle
(test scaffolding for the adapters' RunsTraces routes; the trace runner's verdicts are separate).

``run_trace(trace, runners)``: every step is split by kda_kernels.trace_calls.split_step; a call
whose group has a runner ``(backend, route)`` goes to ``backend.run_call``; a call of any other
group is played by the oracle itself (its slots get the oracle's states rounded to the cache dtype,
its outputs the oracle's), so each adapter is measured alone.  Per step, against
kda_ref.trace_oracle: the relative error max|got - ref| / max|ref| of the live tokens' outputs and
of every slot the adapter's rows write, and every element of the buffer outside the step's written
slots compared bit for bit with its value before the step (guard rows, slot padding, other slots).
"""
from __future__ import annotations

import torch

from kda_kernels.trace_calls import split_step
from kda_ref.trace_oracle import trace_oracle


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(ref.abs().max()) if ref.numel() else 0.0
    num = float((got.double() - ref).abs().max()) if ref.numel() else 0.0
    return num / den if den > 0 else num


def changed_regions(spec, before: torch.Tensor, after: torch.Tensor, allowed: list) -> list:
    """Where ``after`` differs from ``before`` bit for bit outside the slots in ``allowed``: a
    sorted list of 'slot N' and 'guard/padding' entries."""
    diff = _bits(before) != _bits(after)
    inside = torch.zeros_like(diff)
    spec.view(inside).fill_(True)
    out = set()
    if bool((diff & ~inside).any()):
        out.add("guard/padding")
    per_slot = spec.view(diff).reshape(spec.slots, -1).any(1)
    out |= {f"slot {i}" for i in per_slot.nonzero().flatten().tolist() if i not in allowed}
    return sorted(out)


def run_trace(trace, runners: dict, device: str = "cpu", seed: int = 0) -> dict:
    """{"o": worst relative error of the runners' outputs, "state": worst of the slots their rows
    wrote, "unexpected": [(step, region)] written outside the step's slots, "calls": {group: n},
    "by_group": {group: {"o", "state", "o_step", "state_step"}} (the worst of each and its step)}.

    The buffer starts as seeded random finite values (not NaN: a kernel that reads a NaN slot and
    writes back the NaN it computed leaves the bits as they were, hiding the write)."""
    cache = trace.cache.allocate(fill=0.0)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
    cache = cache.to(device)
    view = trace.cache.view(cache)
    worst_o = worst_s = 0.0
    unexpected, counts, by_group = [], {}, {}
    for s, st in enumerate(trace_oracle(trace)):
        before = cache.clone()
        rows = {rp.row: rp for rp in st.plan.rows}
        live = st.token_live
        for call in split_step(trace, s, cache):
            runner = runners.get(call.group)
            tok = call.token_index
            mine = [rows[int(r)] for r in call.rows.tolist() if int(r) in rows]
            if runner is None:          # the oracle plays this group
                for rp in mine:
                    for _, slot in rp.writes:
                        view[slot] = st.expected(slot).to(view.dtype)
                continue
            backend, route = runner
            counts[call.group] = counts.get(call.group, 0) + 1
            o = backend.run_call(call, route)
            assert tuple(o.shape) == (1, call.tokens, trace.HV, trace.V), (call.describe(), tuple(o.shape))
            keep = live[tok]
            e_o = _rel(o[0].cpu()[keep], st.o[tok][keep])
            e_s = max([_rel(view[slot].cpu(), st.expected(slot)) for rp in mine for _, slot in rp.writes] or [0.0])
            worst_o, worst_s = max(worst_o, e_o), max(worst_s, e_s)
            g = by_group.setdefault(call.group, {"o": 0.0, "state": 0.0, "o_step": None, "state_step": None})
            if e_o > g["o"]:
                g.update(o=e_o, o_step=s)
            if e_s > g["state"]:
                g.update(state=e_s, state_step=s)
        unexpected += [(s, r) for r in changed_regions(trace.cache, before.cpu(), cache.cpu(), st.written)]
    return {"o": worst_o, "state": worst_s, "unexpected": unexpected, "calls": counts, "by_group": by_group}


def child_result(script: str, root, timeout: int) -> dict:
    """Run ``script`` (a test module whose __main__ prints one ``RESULT <json>`` line) in a child
    Python with ``root`` on PYTHONPATH, and return that JSON: the interpreter tests measure real
    kernels in a process of their own."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])
