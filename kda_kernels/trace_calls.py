"""How one step of a serving trace becomes kernel calls (docs/traces.md, "Calls").

A serving engine does not hand a whole step to one kernel.  It splits the step's rows into
groups, each one call:

- ``prefill``: the prefill-chunk rows, to a chunk kernel that takes a paged cache
  (``cu_seqlens`` [N+1], ``state_indices`` [N] (the table's column 0), ``has_initial_state`` [N]);
- ``decode``: the one-token decode rows, to a recurrent kernel (``state_indices`` [N]);
- ``spec``: the speculative rows, to the same recurrent kernel with the whole table
  (``state_indices`` [N, W]) and ``num_accepted_tokens`` [N].

Padding rows (a CUDA-graph-padded batch) ride with the ``decode`` call when the step has one,
else with the ``spec`` call, else they make a ``decode`` call of their own: a graph replay
launches the padded batch even when nothing in it is live.  Calls run in the order prefill,
decode, spec (no slot is written by one row and read by another in the same step, so the order
does not change the truth; it is the order engines use).

This module is the one place that decides the split; the trace runner and every backend that
runs trace calls (kda_kernels.base.RunsTraces) use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kda_ref.trace import DECODE, PAD, PREFILL, SPEC, TOKEN_FIELDS, CacheSpec, Trace

GROUPS = ("prefill", "decode", "spec")
MODEL_FIELDS = ("A_log", "dt_bias", "scale", "lower_bound", "gate", "beta_kind", "qk_l2norm")


@dataclass
class PhaseCall:
    """One kernel call of trace step ``step``: the rows of one group, packed.

    q, k [1, T, H, K]; v [1, T, HV, V]; g [1, T, HV, K]; beta [1, T, HV]: raw inputs in the
    trace's dtype, on the cache's device.  cu_seqlens [N+1] int32.  state_indices: [N] int32 for
    prefill and decode (the slot each row reads when has_initial_state and writes), [N, W] int32
    for spec.  has_initial_state [N] bool.  num_accepted_tokens [N] int32 (spec; None otherwise).
    ``cache`` is the whole flat buffer (``spec.view(cache)`` is the [slots, ...] view a kernel
    takes); the call writes it in place.  ``rows`` [N] are the trace's row numbers,
    ``token_index`` [T] the position of each token in the step's packed tokens (what
    ``assemble`` uses), ``model`` the Problem options (A_log, dt_bias, scale, lower_bound, gate,
    beta_kind, qk_l2norm)."""
    group: str
    step: int
    rows: torch.Tensor
    token_index: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    num_accepted_tokens: Optional[torch.Tensor]
    cache: torch.Tensor
    spec: CacheSpec
    model: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.q.shape[1])

    @property
    def batch(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def slots_view(self) -> torch.Tensor:
        """The [slots, HV, V, K] (layout vk) or [slots, HV, K, V] (kv) strided view of the cache."""
        return self.spec.view(self.cache)

    def describe(self) -> str:
        return (f"step {self.step} {self.group}: {self.batch} rows, {self.tokens} tokens, "
                f"rows {self.rows.tolist()}")


def group_rows(phases: list) -> dict:
    """{group: [row positions within the step]} for a step's ``row_phase`` list, padding rows
    placed as the module docstring says; groups with no row are absent."""
    out = {"prefill": [], "decode": [], "spec": []}
    pads = []
    for i, ph in enumerate(phases):
        if ph == PREFILL:
            out["prefill"].append(i)
        elif ph == DECODE:
            out["decode"].append(i)
        elif ph == SPEC:
            out["spec"].append(i)
        elif ph == PAD:
            pads.append(i)
        else:
            raise ValueError(f"row_phase: expected one of 0, 1, 2, -1, got {ph}")
    if pads:
        target = "decode" if out["decode"] or not out["spec"] else "spec"
        out[target] = sorted(out[target] + pads)
    return {k: v for k, v in out.items() if v}


def to_device(x: torch.Tensor, dev) -> torch.Tensor:
    """``x`` (a host tensor) on ``dev`` without waiting for the device: a blocking host-to-device
    copy synchronises the stream, which on a GPU shared by many processes waits out their time
    slices, once per input of every call of a 10^4-step trace.  From pageable memory CUDA stages
    the copy before returning, so ``x`` may be dropped at once."""
    return x.to(dev, non_blocking=True) if torch.device(dev).type != "cpu" else x


def trace_model(tr: Trace, dev) -> dict:
    """The Problem options of ``tr`` (MODEL_FIELDS), tensors moved to ``dev``: what every call of
    the trace carries as ``model`` (moved once per run, not once per step)."""
    return {n: (to_device(x, dev) if isinstance(x, torch.Tensor) else x)
            for n, x in ((n, getattr(tr, n)) for n in MODEL_FIELDS)}


def split_step(tr: Trace, s: int, cache: torch.Tensor, model: Optional[dict] = None) -> list:
    """The PhaseCalls of step ``s`` in call order (prefill, decode, spec), inputs moved to
    ``cache.device`` (``model``: ``trace_model(tr, cache.device)`` when the caller keeps it)."""
    a = tr.step(s)
    dev = cache.device
    r0 = int(tr.step_rows[s])
    cu = a["cu_seqlens"].to(torch.int64)
    groups = group_rows(a["row_phase"].tolist())
    model = trace_model(tr, dev) if model is None else model
    calls = []
    for name in GROUPS:
        pos = groups.get(name)
        if not pos:
            continue
        idx = torch.tensor(pos, dtype=torch.int64)
        lens = (cu[1:] - cu[:-1])[idx]
        tok = torch.cat([torch.arange(int(cu[p]), int(cu[p + 1]), dtype=torch.int64) for p in pos])
        cu_g = torch.zeros(len(pos) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu_g[1:])
        table = a["state_indices"][idx]
        calls.append(PhaseCall(
            group=name, step=s, rows=idx + r0, token_index=tok,
            **{n: to_device(a[n][:, tok], dev) for n in TOKEN_FIELDS},
            cu_seqlens=to_device(cu_g.to(torch.int32), dev),
            state_indices=to_device((table if name == "spec" else table[:, 0]).contiguous(), dev),
            has_initial_state=to_device(a["has_initial_state"][idx], dev),
            num_accepted_tokens=to_device(a["num_accepted_tokens"][idx], dev) if name == "spec" else None,
            cache=cache, spec=tr.cache, model=model))
    return calls


def assemble(calls: list, outs: list, tokens: int) -> torch.Tensor:
    """The step's o [tokens, HV, V] from each call's o [1, T, HV, V], placed by token_index
    (tokens no call produced stay NaN), in the widest of the calls' dtypes: two backends of one
    pairing may return o in different dtypes (a bf16 prefill kernel beside an fp32 decode kernel),
    and widening loses nothing of either."""
    first = outs[0]
    dtype = first.dtype
    for out in outs[1:]:
        dtype = torch.promote_types(dtype, out.dtype)
    o = torch.full((tokens,) + tuple(first.shape[2:]), float("nan"), dtype=dtype, device=first.device)
    for c, out in zip(calls, outs):
        o[to_device(c.token_index, o.device)] = out[0].to(dtype)
    return o
