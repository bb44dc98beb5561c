"""Seeded generation of serving traces (``kda_ref.trace``), with named scenario knobs.

A scheduler like a serving engine's: requests arrive with a prompt and a number of decode steps;
up to ``max_batch`` run at once, each holding ``spec_k + 1`` slots when it decodes
speculatively, else one, taken from a free list and returned when it finishes (most recently
freed first, so slots are reused).  Each step every running request contributes one row: a
prefill chunk of 1..``chunk`` tokens (any length; ``chunk_multiple`` draws whole multiples of
``chunk_multiple`` instead, the last chunk being the prompt's remainder), a decode token, or a
speculative step of ``spec_k + 1`` tokens (the verified token and k drafts; with
``spec_variable`` 1..k drafts) of which 1..all are accepted at random.  With ``mix`` off a
step holds prefill rows or decode rows, not both.  A step of decode rows only is padded with
padding rows up to a multiple of ``graph_pad`` (a CUDA-graph batch size).  ``SCENARIOS`` names knob sets; ``generate(seed, **knobs)``.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

import torch

from .trace import DECODE, PAD, PREFILL, SPEC, CacheSpec, Trace, TraceError, validate_trace

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class TraceKnobs:
    requests: int = 4                 # requests over the whole trace
    max_batch: int = 3                # requests running at once
    prompt: tuple = (1, 150)          # prompt tokens, uniform in [lo, hi]
    decodes: tuple = (1, 12)          # decode (or spec) steps per request, uniform in [lo, hi]
    chunk: int = 64                   # the largest prefill chunk of one step
    chunk_multiple: int = 0           # > 0: chunks are whole multiples of it (the last the remainder)
    spec_k: int = 0                   # draft tokens per spec step (0: no speculative decoding)
    spec_fraction: float = 0.0        # share of requests that decode speculatively
    spec_variable: bool = False       # a spec step carries 1..k drafts (uniform), not always k
    mix: bool = True                  # prefill chunks and decodes in one step
    graph_pad: int = 0                # pad decode-only steps to a multiple of this many rows
    slots: Optional[int] = None       # cache slots (None: just enough for max_batch, so slots are reused)
    layout: str = "vk"
    cache_dtype: str = "float32"
    slot_pad: int = 0                 # padding rows between slots (slot stride = HV*V*K + slot_pad rows)
    guard_rows: int = 2
    pad: str = "minus1"
    H: int = 2
    HV: int = 2
    K: int = 16
    V: int = 16
    dtype: str = "float32"            # the token inputs' dtype
    gate: str = "lower_bound"
    lower_bound: float = -5.0
    beta_kind: str = "sigmoid"
    qk_l2norm: bool = True


SCENARIOS = {
    "mixed": dict(requests=6, max_batch=3, spec_k=2, spec_fraction=0.5, graph_pad=4),
    "short-prompts": dict(requests=6, max_batch=4, prompt=(1, 5), chunk=64),
    "chunked-prefill": dict(requests=3, max_batch=2, prompt=(100, 300), chunk=48, decodes=(1, 3)),
    "spec": dict(requests=4, max_batch=3, spec_k=3, spec_fraction=1.0, spec_variable=True, decodes=(3, 10)),
    "graph-padded": dict(requests=5, max_batch=3, mix=False, graph_pad=8, decodes=(2, 6)),
    "null-block": dict(requests=5, max_batch=3, pad="null0", graph_pad=4, spec_k=1, spec_fraction=0.5),
    "slot-reuse": dict(requests=8, max_batch=2, prompt=(1, 40), decodes=(1, 4)),
    "decode-long": dict(requests=1, max_batch=1, prompt=(8, 8), decodes=(1000, 1000), H=8, HV=8, K=128, V=128),
}


def knobs_for(scenario: Optional[str] = None, **overrides) -> TraceKnobs:
    """The knobs of a named scenario (None: the defaults), with ``overrides``."""
    if scenario is not None and scenario not in SCENARIOS:
        raise TraceError(f"scenario: expected one of {'|'.join(SCENARIOS)}, got {scenario!r}")
    names = {f.name for f in dataclasses.fields(TraceKnobs)}
    bad = sorted(set(overrides) - names)
    if bad:
        raise TraceError(f"{bad[0]}: expected a trace knob ({', '.join(sorted(names))}), got this one")
    return TraceKnobs(**{**(SCENARIOS[scenario] if scenario else {}), **overrides})


def generate(seed: int = 0, scenario: Optional[str] = None, **overrides) -> Trace:
    """A seeded, validated trace of scenario ``scenario`` (``SCENARIOS``) with knob overrides."""
    kb = knobs_for(scenario, **overrides)
    rng = random.Random(seed)
    spec_width = kb.spec_k + 1
    W = spec_width if kb.spec_k > 0 else 1
    first = 1 if kb.pad == "null0" else 0
    nslots = kb.slots if kb.slots is not None else first + kb.max_batch * W
    row = kb.K if kb.layout == "vk" else kb.V
    cache = CacheSpec(slots=nslots, HV=kb.HV, K=kb.K, V=kb.V, layout=kb.layout, dtype=kb.cache_dtype,
                      slot_stride=kb.HV * kb.V * kb.K + kb.slot_pad * row if kb.slot_pad else None,
                      guard_rows=kb.guard_rows, pad=kb.pad).check()
    pad = cache.pad_slot
    free = list(range(first, nslots))
    rng.shuffle(free)
    waiting = []
    for r in range(kb.requests):
        spec = kb.spec_k > 0 and rng.random() < kb.spec_fraction
        waiting.append(dict(id=r, prompt=rng.randint(*kb.prompt), done=0, decodes=rng.randint(*kb.decodes),
                            spec=spec, slots=None, accepted=1))
    running = []
    steps = []                     # rows: (len, request, phase, table, has_initial, num_accepted, accepted)
    while waiting or running:
        while waiting and len(running) < kb.max_batch and len(free) >= (spec_width if waiting[0]["spec"] else 1):
            rq = waiting.pop(0)
            need = spec_width if rq["spec"] else 1
            rq["slots"], free[:] = free[:need], free[need:]
            running.append(rq)
        if not running:
            raise TraceError(f"slots: expected room for one request ({spec_width} slots), got {nslots - first}")
        prefilling = [rq for rq in running if rq["done"] < rq["prompt"]]
        decoding = [rq for rq in running if rq["done"] >= rq["prompt"]]
        if kb.mix:
            batch = running
        else:
            batch = prefilling if prefilling and (not decoding or rng.random() < 0.5) else decoding
        step = []
        for rq in batch:
            table = [pad] * W
            if rq["done"] < rq["prompt"]:
                left = rq["prompt"] - rq["done"]
                if kb.chunk_multiple:
                    n = kb.chunk_multiple * rng.randint(1, max(1, kb.chunk // kb.chunk_multiple))
                else:
                    n = rng.randint(1, kb.chunk)
                n = min(n, left)
                table[0] = rq["slots"][0]
                step.append((n, rq["id"], PREFILL, table, rq["done"] > 0, 1, n))
                rq["done"] += n
            elif rq["spec"]:
                table[:spec_width] = rq["slots"]
                n = rng.randint(2, spec_width) if kb.spec_variable else spec_width
                acc = rng.randint(1, n)
                step.append((n, rq["id"], SPEC, table, True, rq["accepted"], acc))
                rq["accepted"] = acc
                rq["decodes"] -= 1
            else:
                table[0] = rq["slots"][0]
                step.append((1, rq["id"], DECODE, table, True, 1, 1))
                rq["decodes"] -= 1
        if kb.graph_pad and step and all(ph != PREFILL for _, _, ph, _, _, _, _ in step):
            while len(step) % kb.graph_pad:
                step.append((1, -1, PAD, [pad] * W, False, 1, 0))
        steps.append(step)
        for rq in list(running):
            if rq["done"] >= rq["prompt"] and rq["decodes"] <= 0:
                running.remove(rq)
                free[:0] = rq["slots"]          # most recently freed first: reused next
    return trace_from_rows(cache, steps, seed=seed, H=kb.H, dtype=kb.dtype, gate=kb.gate,
                           lower_bound=kb.lower_bound if kb.gate == "lower_bound" else None,
                           beta_kind=kb.beta_kind, qk_l2norm=kb.qk_l2norm,
                           meta={"seed": seed, "scenario": scenario, "knobs": dataclasses.asdict(kb)})


def trace_from_rows(cache: CacheSpec, steps: list, seed: int = 0, H: Optional[int] = None, dtype: str = "float32",
                    gate: str = "lower_bound", lower_bound: Optional[float] = -5.0, beta_kind: str = "sigmoid",
                    qk_l2norm: bool = True, meta: Optional[dict] = None) -> Trace:
    """A validated trace from explicit steps, with seeded random token inputs (randn; A_log in
    [0, 1), dt_bias randn / 2).  ``steps``: one list of rows per step, a row being
    ``(row_len, request, phase, table, has_initial_state, num_accepted_tokens, accepted)`` with
    ``table`` a list of W slots (every row the same W) and phase one of PREFILL DECODE SPEC PAD.
    H defaults to cache.HV."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    H = cache.HV if H is None else H
    rows = [r for st in steps for r in st]
    bounds = [0]
    for st in steps:
        bounds.append(bounds[-1] + len(st))
    Tt = sum(r[0] for r in rows)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    tr = Trace(cache=cache, q=rnd(Tt, H, cache.K), k=rnd(Tt, H, cache.K), v=rnd(Tt, cache.HV, cache.V),
               g=rnd(Tt, cache.HV, cache.K), beta=rnd(Tt, cache.HV),
               step_rows=torch.tensor(bounds, dtype=torch.int64),
               row_len=torch.tensor([r[0] for r in rows], dtype=torch.int64),
               row_request=torch.tensor([r[1] for r in rows], dtype=torch.int64),
               row_phase=torch.tensor([r[2] for r in rows], dtype=torch.int8),
               state_indices=torch.tensor([list(r[3]) for r in rows], dtype=torch.int32),
               has_initial_state=torch.tensor([bool(r[4]) for r in rows], dtype=torch.bool),
               num_accepted_tokens=torch.tensor([r[5] for r in rows], dtype=torch.int32),
               accepted=torch.tensor([r[6] for r in rows], dtype=torch.int32),
               A_log=torch.rand(cache.HV, generator=g).to(dt), dt_bias=rnd(cache.HV * cache.K, scale=0.5),
               lower_bound=lower_bound, gate=gate, beta_kind=beta_kind, qk_l2norm=qk_l2norm, meta=dict(meta or {}))
    return validate_trace(tr)
