"""Negative controls: kernels with one deliberate bug each, the backend ``emulator-bad``.

They prove that the harness sees the bugs it exists to catch.  Each is the flashkda recipe of
the emulator (``kda_kernels.emulator``) with one slip, built here from outside: the emulator
that computes every baseline holds no switch of theirs.

In-recipe controls (``NEGATIVE_CONTROLS``), one slip inside a chunk's algebra, each made by
swapping one step of the emulator (an ``emulator.Hooks`` field), its recipe, or its output:

    carry_scaled        the state carried across every chunk boundary is scaled by 0.99
                        (state_update: rnd(0.99 * rnd(S gt + upd)))
    wrong_L_sign        INV = (I + L)^{-1} (build_inverse of -L)
    inv_bf16            the INV/Mqk buffer stored in bf16 (the recipe's inv, Mqk, u and U-for-Mqk
                        dtypes bf16: aiter keeps INV and Mqk in one buffer)
    tail_not_zeroed     a sequence's last chunk reads the tokens that follow it in memory
                        (wrapping) instead of zeros, and treats those rows as valid (tiles, valid)
    state_transposed    the final state comes back transposed (the output, dense or the written
                        cache slots)
    decay_after_update  S <- (S + kr^T U) gt (state_update)
    mqk_no_diag         Mqk without its diagonal (mqk_mask i > j)

Batch-level controls (``BATCH_CONTROLS``), the bugs a pooled error hides inside a large batch:

    state_leak        sequence n starts from sequence n-1's final state where it has no initial
                      state of its own (no reset at a sequence start): one request's state
                      leaking into the next one's output
    head_gate_scaled  the log-decay a of one head (the last) on one sequence (the middle one,
                      N // 2) is multiplied by 1.05, i.e. the decay exp(a) is raised to 1.05
    slots_swapped     the final states of the first two written cache slots land in each
                      other's slot (paged problems)

Each runs the problem one sequence at a time (``per_sequence``), so a control changes nothing
outside the sequences and slots it names; where it would change nothing at all (one sequence,
every sequence with its own initial state, no two written slots) it is not applicable.

Trace controls (``TRACE_CONTROLS``; serving traces, docs/traces.md), trace routes of
``emulator-bad`` (kda_kernels.base.RunsTraces), each the emulator's trace route of its recipe
(flashkda for the prefill group, fla-recurrent for decode and spec) with one step of
``emulator.TraceHooks`` replaced:

    handover-transposed   prefill stores the state in the other layout: K-first bytes into a
                          V-first cache, V-first into a K-first one (store)
    ignore-initial-state  a prefill chunk starts from zero though has_initial_state is true (load)
    pad-writes-slot0      a padding row runs from a zero state and writes it to slot 0 (slot, load)
    pad-writes-last-slot  ... to the last slot, as an unguarded state_cache[-1] does (slot, load)
    keep-rejected         a spec row reads the checkpoint of the last token its table's previous
                          spec step wrote, not column num_accepted_tokens - 1 (read_column)
    stale-read            a decode row reads its slot as it was before the previous step's write
                          where that write was the control's own (load)

keep-rejected and stale-read remember, per backend object, what they last wrote (keyed by the
cache buffer and the slot or table, used only while the slot still holds exactly those bits).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from kda_ref.preprocess import F64, gate_activation
from kda_ref.problem import Problem
from kda_ref.trace import DECODE, PAD, PREFILL, SPEC

from .base import Outputs, Route
from .emulator import (BF16, DEFAULT_HOOKS, RECIPES, REFERENCE_RECIPES, EmulatorBackend, build_inverse, emulate, rnd,
                       valid_rows)
from .emulator import (DEFAULT_TRACE_HOOKS, PREFILL_TRACE_RECIPES, TraceHooks, _trace_refusal, kernel_slot, load_slot,
                       read_column, run_decode_call, run_prefill_call, store_slot)

NEGATIVE_CONTROLS: dict[str, str] = {
    "carry_scaled": "the state carried across every chunk boundary is scaled by 0.99",
    "wrong_L_sign": "INV = (I + L)^{-1} instead of (I - L)^{-1}",
    "inv_bf16": "the INV/Mqk buffer stored in bf16 instead of fp16 (so the INV.u and Mqk.U dots take bf16 operands)",
    "tail_not_zeroed": "rows past a sequence's end in its last chunk hold stale tokens instead of zeros",
    "state_transposed": "the final state is returned transposed ([V,K] where [K,V] is due)",
    "decay_after_update": "S <- (S + kr^T U) * gt: the chunk decay applied after the update",
    "mqk_no_diag": "Mqk without its diagonal: o_i misses token i's own update",
}
CARRY_SCALE = 0.99


# --------------------------------------------------------------------- in-recipe controls
def _carry_scaled(S, gt, upd, recipe):
    return rnd(CARRY_SCALE * rnd(S * gt + upd, recipe.state_dtype), recipe.state_dtype)


def _decay_after_update(S, gt, upd, recipe):
    return rnd((S + upd) * gt, recipe.state_dtype)


def _negated_L_inverse(L, recipe, op):
    return build_inverse(-L, recipe, op)


def _strict_mqk_mask(C, device):
    i = torch.arange(C, device=device)
    return i[:, None] > i[None, :]


def _stale_tiles(x: torch.Tensor, bounds, NC: int, C: int) -> torch.Tensor:
    """The emulator's tiles, but a sequence's last chunk reads, past the sequence's end, the
    tokens that follow in memory (wrapping at the end of the packed rows)."""
    Ttot = x.shape[0]
    N = len(bounds)
    out = x.new_zeros((N, NC * C) + tuple(x.shape[1:]))
    for n, (bos, eos) in enumerate(bounds):
        out[n, : eos - bos] = x[bos:eos]
        if eos > bos and Ttot:
            end = -(-(eos - bos) // C) * C
            idx = torch.arange(eos, bos + end, device=x.device) % Ttot
            out[n, eos - bos:end] = x[idx]
    return out.reshape((N, NC, C) + tuple(x.shape[1:])).movedim(3, 2)


def _stale_valid(lens: torch.Tensor, C: int) -> torch.Tensor:
    """Every row of a chunk that holds any token counts as valid, so the stale rows reach the
    tiles kd, qd, kr and u (chunks holding no token keep zero tiles and stay invalid)."""
    return valid_rows(lens, C) | (lens > 0)[:, :, None, None]


HOOKS = {
    "carry_scaled": replace(DEFAULT_HOOKS, state_update=_carry_scaled),
    "wrong_L_sign": replace(DEFAULT_HOOKS, build_inverse=_negated_L_inverse),
    "tail_not_zeroed": replace(DEFAULT_HOOKS, tiles=_stale_tiles, valid=_stale_valid),
    "decay_after_update": replace(DEFAULT_HOOKS, state_update=_decay_after_update),
    "mqk_no_diag": replace(DEFAULT_HOOKS, mqk_mask=_strict_mqk_mask),
}


def _transpose_final_state(problem: Problem, out: Outputs) -> Outputs:
    """The final state transposed in the last two axes: the dense output, or the cache slots written."""
    if out.state_cache is not None:
        idx = problem.state_indices.long()
        out.state_cache[idx] = out.state_cache[idx].transpose(-1, -2)
    elif out.final_state is not None:
        out.final_state = out.final_state.transpose(-1, -2).contiguous()
    return out


def run_in_recipe(problem: Problem, name: str, taps: bool = False, recipe: str = "flashkda") -> Outputs:
    """The in-recipe control ``name`` (NEGATIVE_CONTROLS) on ``problem``: ``recipe`` (default the
    flashkda recipe; any name ``emulate`` knows, e.g. the fp32 references' "fp32") with its one slip;
    ``taps`` as for ``emulate`` (the ws_inv tap in the dtype the control stores)."""
    if name not in NEGATIVE_CONTROLS:
        raise ValueError(f"control: expected one of {', '.join(NEGATIVE_CONTROLS)}, got {name!r}")
    recipe = {**RECIPES, **REFERENCE_RECIPES}[recipe]
    if name == "inv_bf16":
        recipe = replace(recipe, inv_dtype=BF16, mqk_dtype=BF16, u_dtype=BF16, U_mqk_dtype=BF16)
    out = emulate(problem, recipe, taps=taps, hooks=HOOKS.get(name, DEFAULT_HOOKS))
    if name == "state_transposed":
        out = _transpose_final_state(problem, out)
    out.info = {"route_ran": f"{recipe.name}+{name}"}
    return out


# ------------------------------------------------------------------------ batch controls
BATCH_CONTROLS: dict[str, str] = {
    "state_leak": "sequence n starts from sequence n-1's final state where it has no initial state of its own",
    "head_gate_scaled": "one head's log-decay on one sequence (the last head, sequence N//2) scaled by 1.05",
    "slots_swapped": "the final states of the first two written cache slots are written to each other's slot",
}
GATE_SCALE = 1.05


def own_initial_state(problem: Problem) -> list[bool]:
    """Whether each sequence starts from a state of its own (a dense initial state, or a paged
    slot it reads because has_initial_state is true)."""
    if problem.paged:
        return [bool(x) for x in problem.has_initial_state.tolist()]
    return [problem.initial_state is not None] * problem.N


def _kfirst(state: torch.Tensor, layout: str) -> torch.Tensor:
    return state if layout == "kv" else state.transpose(-1, -2)


def sequence_problem(problem: Problem, n: int, start: Optional[torch.Tensor]) -> Problem:
    """Sequence n of ``problem`` alone, as a dense problem [1, len_n] in the kv layout, starting
    from ``start`` (K-first [HV, K, V]) or from zero."""
    bos, eos = problem.seq_bounds()[n]
    def tok(t):
        return t.reshape((problem.B * problem.T,) + tuple(t.shape[2:]))[bos:eos].unsqueeze(0)
    init = None if start is None else start.unsqueeze(0).to(torch.float32)
    return problem.replace(q=tok(problem.q), k=tok(problem.k), v=tok(problem.v), g=tok(problem.g),
                           beta=tok(problem.beta), cu_seqlens=None, initial_state=init, state_layout="kv",
                           state_cache=None, state_indices=None, has_initial_state=None, output_final_state=True)


def start_state(problem: Problem, n: int) -> Optional[torch.Tensor]:
    """Sequence n's own initial state, K-first [HV, K, V] float64, or None (it starts from zero)."""
    if problem.paged:
        if not bool(problem.has_initial_state[n]):
            return None
        return problem.state_cache[int(problem.state_indices[n])].to(F64).transpose(-1, -2)
    if problem.initial_state is None:
        return None
    return _kfirst(problem.initial_state[n], problem.state_layout).to(F64)


def per_sequence(problem: Problem, run_one: Callable[[int, Problem], Outputs],
                 start: Callable[[int, Optional[torch.Tensor]], Optional[torch.Tensor]]) -> Outputs:
    """Run every sequence alone and assemble the outputs of ``problem``.

    ``start(n, previous_final)`` gives sequence n's starting state (K-first [HV, K, V] or None)
    from the final state of sequence n-1; ``run_one(n, sub)`` runs the one-sequence problem.
    o is [B, T, HV, V] in v's dtype; the final states go out in the problem's layout (dense) or
    into a copy of the cache at state_indices (paged)."""
    Tt = problem.B * problem.T
    o = torch.zeros(Tt, problem.HV, problem.V, dtype=problem.v.dtype, device=problem.device)
    finals, prev = [], None
    for n, (bos, eos) in enumerate(problem.seq_bounds()):
        s0 = start(n, prev)
        if eos == bos:
            fin = s0 if s0 is not None else torch.zeros(problem.HV, problem.K, problem.V, dtype=F64,
                                                         device=problem.device)
        else:
            out = run_one(n, sequence_problem(problem, n, s0))
            o[bos:eos] = out.o[0].to(o.dtype)
            fin = out.final_state[0].to(F64)
        finals.append(fin)
        prev = fin
    final = torch.stack(finals)                                           # [N, HV, K, V]
    o = o.reshape(problem.B, problem.T, problem.HV, problem.V)
    if problem.paged:
        cache = problem.state_cache.detach().clone()
        cache[problem.state_indices.long()] = final.transpose(-1, -2).to(cache.dtype)
        return Outputs(o=o, state_cache=cache)
    if not problem.output_final_state:
        return Outputs(o=o)
    return Outputs(o=o, final_state=_kfirst(final, problem.state_layout).to(torch.float32).contiguous())


def _emulated(n: int, sub: Problem) -> Outputs:
    return emulate(sub, "flashkda")


def run_state_leak(problem: Problem) -> Outputs:
    own = own_initial_state(problem)
    return per_sequence(problem, _emulated,
                        lambda n, prev: start_state(problem, n) if own[n] or prev is None else prev)


def gate_target(problem: Problem) -> tuple[int, int]:
    """(sequence, head) whose decay head_gate_scaled scales."""
    return problem.N // 2, problem.HV - 1


def run_head_gate_scaled(problem: Problem) -> Outputs:
    target, head = gate_target(problem)

    def run_one(n: int, sub: Problem) -> Outputs:
        if n != target:
            return emulate(sub, "flashkda")
        a = gate_activation(sub.g.reshape(-1, sub.HV, sub.K), sub.gate, sub.A_log, sub.dt_bias, sub.lower_bound)
        a[:, head] *= GATE_SCALE
        pregated = sub.replace(g=a.to(torch.float32).reshape(sub.g.shape), gate="pregated", A_log=None,
                               dt_bias=None, lower_bound=None)
        return emulate(pregated, "flashkda")

    return per_sequence(problem, run_one, lambda n, prev: start_state(problem, n))


def run_slots_swapped(problem: Problem) -> Outputs:
    out = emulate(problem, "flashkda")
    a, b = (int(s) for s in problem.state_indices[:2].tolist())
    cache = out.state_cache.clone()
    cache[a], cache[b] = out.state_cache[b], out.state_cache[a]
    return Outputs(o=out.o, state_cache=cache, info=out.info)


RUNNERS = {"state_leak": run_state_leak, "head_gate_scaled": run_head_gate_scaled,
           "slots_swapped": run_slots_swapped}


def changes_anything(name: str, problem: Problem) -> tuple[bool, str]:
    """Whether control ``name`` changes any output of ``problem`` (and why not)."""
    lens = [e - b for b, e in problem.seq_bounds()]
    if name == "state_leak":
        own = own_initial_state(problem)
        if any(not own[n] and any(lens[:n]) for n in range(1, problem.N)):
            return True, ""
        return False, "no sequence after a non-empty one starts without a state of its own"
    if name == "head_gate_scaled":
        n, _ = gate_target(problem)
        return (lens[n] > 0, "" if lens[n] > 0 else f"sequence {n} is empty")
    if name == "slots_swapped":
        if not problem.paged or problem.N < 2:
            return False, "needs a paged cache with two written slots"
        if lens[0] == 0 and lens[1] == 0 and not bool(problem.has_initial_state[:2].any()):
            return False, "both swapped slots receive zero states"
        return True, ""
    raise ValueError(f"control: expected one of {', '.join(BATCH_CONTROLS)}, got {name!r}")


# ------------------------------------------------------------------------ trace controls
TRACE_CONTROLS: dict[str, tuple] = {     # name -> (recipe, groups, what is wrong)
    "handover-transposed": ("flashkda", ("prefill",),
                            "prefill writes the state K-first into a V-first cache (V-first into a K-first one)"),
    "ignore-initial-state": ("flashkda", ("prefill",),
                             "a prefill chunk starts from zero though has_initial_state is true"),
    "pad-writes-slot0": ("fla-recurrent", ("decode", "spec"),
                         "a padding row runs from a zero state and writes its state to slot 0"),
    "pad-writes-last-slot": ("fla-recurrent", ("decode", "spec"),
                             "a padding row runs from a zero state and writes its state to the last slot"),
    "keep-rejected": ("fla-recurrent", ("decode", "spec"),
                      "a spec row reads the last draft's checkpoint, not state_indices[n, num_accepted_tokens-1]"),
    "stale-read": ("fla-recurrent", ("decode", "spec"),
                   "a decode reads its slot as it was before the previous step's write"),
}


def _store_other_layout(call, n: int, slot: int, S: torch.Tensor) -> None:
    """handover-transposed: the slot receives the state's bytes in the other layout."""
    view = call.slots_view()
    other = S if call.spec.layout == "vk" else S.transpose(-1, -2)
    view[slot] = other.contiguous().reshape(view.shape[1:]).to(view.dtype)


def _load_zero(call, n: int, slot: int) -> torch.Tensor:
    """ignore-initial-state: every initial state is zero."""
    c = call.spec
    return torch.zeros(c.HV, c.K, c.V, dtype=F64, device=call.cache.device)


def _pad_hooks(target: str) -> TraceHooks:
    """pad-writes-*: the pad slot resolves to slot 0 or the last slot (never skipped); a row whose
    read entry is the pad slot starts from zero."""
    def slot(call, n, s, guard):
        if s == call.spec.pad_slot:
            return 0 if target == "slot0" else call.spec.slots - 1
        return kernel_slot(call, n, s, guard)

    def load(call, n, s):
        table = call.state_indices.reshape(call.batch, -1)
        if int(table[n, read_column(call, n)]) == call.spec.pad_slot:
            return _load_zero(call, n, s)
        return load_slot(call, n, s)

    return TraceHooks(slot=slot, load=load)


class _Memory:
    """What keep-rejected and stale-read remember of their own writes (per backend object)."""

    def __init__(self):
        self.last_col = {}    # (cache ptr, table) -> (column, slot, the bits stored there)
        self.prev = {}        # (cache ptr, slot) -> (content before the write, content after)

    @staticmethod
    def _holds(call, slot: int, bits: torch.Tensor) -> bool:
        return torch.equal(call.slots_view()[slot], bits)

    def keep_rejected(self) -> TraceHooks:
        def store(call, n, slot, S):
            store_slot(call, n, slot, S)
            if call.group == "spec":
                table = tuple(call.state_indices[n].tolist())
                col = table.index(slot)
                self.last_col[(call.cache.data_ptr(), table)] = (col, slot, call.slots_view()[slot].clone())

        def column(call, n):
            honest = read_column(call, n)
            if call.group != "spec":
                return honest
            got = self.last_col.get((call.cache.data_ptr(), tuple(call.state_indices[n].tolist())))
            if got is not None and self._holds(call, got[1], got[2]):
                return got[0]
            return honest

        return TraceHooks(store=store, read_column=column)

    def stale_read(self) -> TraceHooks:
        def store(call, n, slot, S):
            before = call.slots_view()[slot].clone()
            store_slot(call, n, slot, S)
            self.prev[(call.cache.data_ptr(), slot)] = (before, call.slots_view()[slot].clone())

        def load(call, n, slot):
            got = self.prev.get((call.cache.data_ptr(), slot))
            if call.group == "decode" and got is not None and self._holds(call, slot, got[1]):
                return call.spec.to_kfirst(got[0]).to(F64)
            return load_slot(call, n, slot)

        return TraceHooks(store=store, load=load)


def trace_control_changes(name: str, trace) -> tuple[bool, str]:
    """Whether trace control ``name`` has anything to change in ``trace`` (and why not)."""
    ph, his = trace.row_phase.tolist(), trace.has_initial_state.tolist()
    lens = trace.row_len.tolist()
    if name == "handover-transposed":
        return (PREFILL in ph, "" if PREFILL in ph else "no prefill row")
    if name == "ignore-initial-state":
        ok = any(p == PREFILL and h for p, h in zip(ph, his))
        return ok, "" if ok else "no prefill chunk after a request's first"
    if name.startswith("pad-writes"):
        ok = any(p == PAD and t > 0 for p, t in zip(ph, lens))
        return ok, "" if ok else "no padding row with tokens"
    if name == "keep-rejected":
        return (SPEC in ph, "" if SPEC in ph else "no speculative row")
    if name == "stale-read":
        reqs = [r for r, p in zip(trace.row_request.tolist(), ph) if p == DECODE]
        ok = len(reqs) > len(set(reqs))
        return ok, "" if ok else "no request decodes twice"
    raise ValueError(f"control: expected one of {', '.join(TRACE_CONTROLS)}, got {name!r}")


class ControlBackend(EmulatorBackend):
    """``emulator-bad``: every negative control as a route (recipe flashkda), with the ws_inv
    tap on the emulator's in-recipe controls so a wrongly stored inverse is visible."""

    def __init__(self, variant: Optional[str] = None, taps: bool = True):
        if variant is not None and variant not in {**NEGATIVE_CONTROLS, **BATCH_CONTROLS, **TRACE_CONTROLS}:
            raise ValueError(f"variant: expected one of {', '.join([*NEGATIVE_CONTROLS, *BATCH_CONTROLS, *TRACE_CONTROLS])}, "
                             f"got {variant!r}")
        super().__init__(taps=taps)
        self.only = variant
        self.name = "emulator-bad"

    def routes(self) -> list[Route]:
        every = {**NEGATIVE_CONTROLS, **BATCH_CONTROLS}
        names = [self.only] if self.only in every else ([] if self.only else list(every))
        return [Route(name=n, recipe="flashkda", flags=(("variant", n),), description=every[n]) for n in names]

    def accepts(self, problem: Problem, route: Route):
        ok, why = super().accepts(problem, route.__class__(name=route.name, recipe="flashkda"))
        if not ok:
            return ok, why
        variant = route.flag("variant")
        if variant in BATCH_CONTROLS:
            changes, why = changes_anything(variant, problem)
            if not changes:
                return False, f"not applicable: the control {variant} changes nothing here ({why})"
        return True, ""

    # ----- trace controls (kda_kernels.base.RunsTraces)
    def trace_routes(self) -> list[Route]:
        """Every trace control as a route named by the control (its recipe: the emulator trace
        route it is otherwise, flashkda or fla-recurrent)."""
        names = [self.only] if self.only in TRACE_CONTROLS else ([] if self.only else list(TRACE_CONTROLS))
        return [Route(name=n, recipe=TRACE_CONTROLS[n][0], flags=(("groups", TRACE_CONTROLS[n][1]), ("variant", n)),
                      description=TRACE_CONTROLS[n][2]) for n in names]

    def trace_accepts(self, trace, route: Route) -> tuple[bool, str]:
        """What the control's recipe's kernel refuses (padding rows aside), and traces where the
        control has nothing to change."""
        variant = route.flag("variant")
        if variant not in TRACE_CONTROLS:
            return False, f"not applicable: {route.name!r} is not a trace control"
        recipe = TRACE_CONTROLS[variant][0]
        why = _trace_refusal(trace, recipe, padding=False)
        if why:
            return False, why
        if recipe in PREFILL_TRACE_RECIPES:
            ok, why = self.accepts(trace.problem_view(), Route(name=recipe, recipe=recipe))
            if not ok:
                return ok, why
        changes, why = trace_control_changes(variant, trace)
        if not changes:
            return False, f"not applicable: the control {variant} changes nothing here ({why})"
        return True, ""

    def _trace_hooks(self, variant: str) -> TraceHooks:
        mem = self.__dict__.setdefault("_trace_memory", _Memory())
        if variant == "handover-transposed":
            return TraceHooks(store=_store_other_layout)
        if variant == "ignore-initial-state":
            return TraceHooks(load=_load_zero)
        if variant == "pad-writes-slot0":
            return _pad_hooks("slot0")
        if variant == "pad-writes-last-slot":
            return _pad_hooks("last")
        if variant == "keep-rejected":
            return mem.keep_rejected()
        if variant == "stale-read":
            return mem.stale_read()
        return DEFAULT_TRACE_HOOKS

    def run_call(self, call, route: Route) -> torch.Tensor:
        """One PhaseCall with the control's slip: the cache written in place, o [1, T, HV, V]."""
        variant = route.flag("variant")
        if variant not in TRACE_CONTROLS:
            raise ValueError(f"route: expected a trace control ({', '.join(TRACE_CONTROLS)}), got {route.name!r}")
        recipe, groups, _ = TRACE_CONTROLS[variant]
        if call.group not in groups:
            raise ValueError(f"call: expected a {'/'.join(groups)} call for {variant}, got {call.describe()}")
        hooks = self._trace_hooks(variant)
        if recipe in PREFILL_TRACE_RECIPES:
            return run_prefill_call(call, recipe, hooks)
        return run_decode_call(call, recipe, hooks)

    def run(self, problem: Problem, route: Route) -> Outputs:
        variant = route.flag("variant")
        if variant in BATCH_CONTROLS:
            out = RUNNERS[variant](problem)
            out.info = {"route_ran": f"flashkda+{variant}"}
            return out
        return run_in_recipe(problem, variant, taps=self.taps)


def negative_control(variant: Optional[str] = None, taps: bool = True) -> ControlBackend:
    """Backend factory (``kda_kernels.controls:negative_control``, built-in name ``emulator-bad``):
    every negative control as a route of ``emulator-bad``, or only ``variant``."""
    return ControlBackend(variant=variant, taps=taps)
