"""RunsTraces backends for the serving tests (loaded as ``serving_backends:<factory>``).

Every one computes exactly (float64 through kda_ref: the inputs prepared by
``kda_ref.chunked.prepare_tokens``, every row token by token with
``kda_ref.recurrence.token_step``), rounds o to the input dtype and each written state to the
cache dtype in the cache's layout, and writes the cache in place.  The broken ones differ in one
thing each:

    exact          correct (the baseline of the tests, standing in for the emulator)
    transposed     prefill writes the state K-first whatever the cache's layout (decode reads correctly)
    no_initial     prefill ignores has_initial_state (every chunk starts from zero)
    pad_slot0      a padding row is computed from zero and written to slot 0
    keep_rejected  a spec row reads the checkpoint after all the previous spec step's tokens, not
                   the accepted one (num_accepted_tokens ignored)
    stale          a decode row reads the state it first read from that slot, not the slot's content
    guard_write    a decode call also writes one element of the guard rows before slot 0
    bf16_state     prefill rounds the state to bf16 before storing it (in an fp32 cache)
    raising        decode calls raise
    interrupt      decode calls raise KeyboardInterrupt (Ctrl-C while a cell runs)

Trace routes (the same in every mode): ``exact-prefill`` (groups prefill), ``exact-decode``
(decode, spec) and ``exact-all`` (every group); each route's recipe is its own name, so the
``exact`` backend serves as the baseline of any of them.
"""
from __future__ import annotations

import torch

from kda_kernels.base import Route
from kda_ref.chunked import prepare_tokens
from kda_ref.problem import Problem
from kda_ref.recurrence import token_step

MODES = ("exact", "transposed", "no_initial", "pad_slot0", "keep_rejected", "stale", "guard_write", "bf16_state",
         "raising", "interrupt")
ROUTES = (Route("exact-prefill", recipe="exact-prefill", flags=(("groups", ("prefill",)),)),
          Route("exact-decode", recipe="exact-decode", flags=(("groups", ("decode", "spec")),)),
          Route("exact-all", recipe="exact-all", flags=(("groups", ("prefill", "decode", "spec")),)))


class ServingBackend:
    def __init__(self, mode: str = "exact", layouts=("vk", "kv")):
        assert mode in MODES, mode
        self.mode = mode
        self.name = "serving-exact" if mode == "exact" else f"serving-{mode.replace('_', '-')}"
        self.layouts = layouts
        self._first_read: dict = {}
        self._last_len: dict = {}

    def available(self):
        return True, ""

    def version(self):
        return "test"

    def routes(self):
        return []

    def accepts(self, problem, route):
        return False, "not applicable: a serving-trace test backend"

    def run(self, problem, route):
        raise NotImplementedError

    def trace_routes(self):
        return list(ROUTES)

    def trace_accepts(self, trace, route):
        if trace.cache.layout not in self.layouts:
            return False, f"not applicable: cache layout {trace.cache.layout} (this route takes {self.layouts})"
        return True, ""

    def run_call(self, call, route):
        mode = self.mode
        if mode == "raising" and call.group != "prefill":
            raise RuntimeError(f"planted failure in a {call.group} call")
        if mode == "interrupt" and call.group != "prefill":
            raise KeyboardInterrupt
        p = Problem(q=call.q, k=call.k, v=call.v, g=call.g, beta=call.beta, output_final_state=False,
                    **call.model)
        pp = prepare_tokens(p, 0, call.tokens, None)
        decay = torch.exp(pp.a)
        spec = call.spec
        view = call.slots_view()
        HV, V = p.HV, p.V
        o = torch.zeros(call.tokens, HV, V, dtype=torch.float64)
        cu = call.cu_seqlens.tolist()
        table = call.state_indices.tolist()
        his = call.has_initial_state.tolist()
        nacc = call.num_accepted_tokens.tolist() if call.num_accepted_tokens is not None else None
        pad = spec.pad_slot
        for n in range(call.batch):
            t0, t1 = cu[n], cu[n + 1]
            row = table[n] if call.group == "spec" else [table[n]]
            if all(s == pad for s in row):                 # a padding row: skipped, unless planted
                if mode == "pad_slot0" and t1 > t0:
                    S = torch.zeros(HV, p.K, V, dtype=torch.float64)
                    for t in range(t0, t1):
                        S, o[t] = token_step(S, pp.q[t], pp.k[t], pp.v[t], decay[t], pp.beta[t], pp.scale)
                    self._write(view, spec, 0, S, call.group)
                continue
            col = 0
            if call.group == "spec":
                col = nacc[n] - 1
                if mode == "keep_rejected":
                    col = self._last_len.get(row[0], nacc[n]) - 1
            read = row[col]
            use_init = his[n] and not (mode == "no_initial" and call.group == "prefill")
            if use_init:
                if mode == "stale" and call.group == "decode":
                    if read not in self._first_read:
                        self._first_read[read] = view[read].clone()
                    content = self._first_read[read]
                else:
                    content = view[read]
                S = spec.to_kfirst(content).to(torch.float64).clone()
            else:
                S = torch.zeros(HV, p.K, V, dtype=torch.float64)
            for i, t in enumerate(range(t0, t1)):
                S, o[t] = token_step(S, pp.q[t], pp.k[t], pp.v[t], decay[t], pp.beta[t], pp.scale)
                if call.group == "spec":
                    self._write(view, spec, row[i], S, call.group)
            if call.group != "spec":
                self._write(view, spec, row[0], S, call.group)
            else:
                self._last_len[row[0]] = t1 - t0
        if mode == "guard_write" and call.group == "decode" and spec.guard_rows:
            call.cache[0] = 1.0
        return o.to(call.v.dtype)[None]

    def _write(self, view, spec, slot, S, group):
        if self.mode == "transposed" and group == "prefill":
            view[slot].copy_(S.contiguous().reshape(view[slot].shape))    # K-first memory, whatever the layout
            return
        if self.mode == "bf16_state" and group == "prefill":
            S = S.to(torch.bfloat16).to(torch.float64)
        view[slot].copy_(spec.to_layout(S))


def _factory(mode):
    def make(**kw):
        return ServingBackend(mode, **kw)
    make.__name__ = mode
    return make


for _m in MODES:
    globals()[_m] = _factory(_m)


def vk_only(**kw):
    """Correct, but takes V-first caches only (trace_accepts refuses kv)."""
    return ServingBackend("exact", layouts=("vk",), **kw)
