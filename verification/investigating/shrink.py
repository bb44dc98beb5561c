"""Shrinking a failing cell to the smallest problem that still fails the same way.

A cell (backend, route, case) is run and judged exactly as the matrix runs it
(``verification.running.run_cell.run_cell``: the same oracle, baseline, tolerances and
``verification.judging.verdict.judge``).  While it fails, the problem is reduced greedily and
deterministically, one step at a time, each step kept only when the reduced problem still
fails the same way:

    sequences   drop whole sequences (dense problems: batch rows); an empty sequence stays
                only where dropping it loses the failure
    heads       keep one value head (the worst first; its query/key head under GVA), or drop
                one; every per-head tensor is sliced (q k [.., H], v g beta out_gate [.., HV], A_log
                [HV], dt_bias [HV*K] / [HV, K], initial_state [N, HV, ..], state_cache
                [slots, HV, V, K])
    leading     drop the first c*CUT chunks' tokens of a sequence (CUT = 64 tokens, a multiple of
                every chunk size 16 / 32 / 64, so every later chunk keeps its tokens) and give
                the oracle's state at the cut as the sequence's initial state, in the problem's
                own layout: initial_state [N, HV, K, V] (kv) or [N, HV, V, K] (vk), or the
                sequence's slot of the paged cache [HV, V, K] with has_initial_state set.  The
                state before chunk c is kda_ref.chunked's chunk-boundary state S_c (float64),
                stored in the problem's state dtype (float32 where it had none)
    trailing    drop trailing tokens of a sequence: to half its length (a multiple of 16, then
                exactly), by one 64-token chunk, by 16 tokens, and by one token for sequences of
                at most 128 (causality: the kept tokens' outputs do not depend on the dropped ones)

The families run in that order, each until none of its steps is kept, and the whole round
repeats until a round keeps nothing, or ``max_runs`` cells have run (the first included).

The same failure (``Signature``): the failing status class (fail / mistrusted / error), and
the first failure mark of the original cell among those of the reduced one.  A mark is
(tensor, kind) with kind ``nan`` / ``inf`` (non-finite values), ``missing``, ``shape``,
``dtype``, ``untouched`` (a slot the problem does not write changed), ``mistrusted`` or
``over`` (err / threshold > 1, whole tensor or worst slice), or ("run", "raised <Type>") for a
kernel that raised, ("run", "crashed") for one that killed its process (``isolate``: every cell
in a child process, as ``run --isolate``; the final problem is run once more in this process
for the outputs of the bundle, unless it crashes).  The first mark is the most severe kind, then the largest margin.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kda_ref.chunked import chunked_from_workspace
from kda_ref.preprocess import prepare
from kda_ref.workspace import workspace_prepared
from verification.errors import UsageError
from verification.judging.baselines import BaselineCache
from verification.judging.record import decode_number as as_float
from verification.running.run_cell import TruthCache, clone_keep_strides, run_cell
from verification.running.run_isolated import IsolatedRunner
from verification.running.run_select import LoadedBackend

CUT = 64                      # leading cuts fall on multiples of this many tokens
KIND_ORDER = ("nan", "inf", "missing", "shape", "dtype", "untouched", "mistrusted", "over")
FAILING_STATUS = {"fail": "fail", "mistrusted": "mistrusted", "error": "error", "crashed": "crashed"}
DEFAULT_MAX_RUNS = 200


# ----------------------------------------------------------------------------------------
# Failure signatures
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Signature:
    """What a failing cell record shows: its status class and its failure marks, worst first."""
    status: str                      # fail | mistrusted | error ("" when the cell does not fail)
    marks: tuple                     # ((tensor, kind, margin), ...) worst first

    @property
    def failing(self) -> bool:
        return bool(self.status) and bool(self.marks)

    @property
    def primary(self) -> Optional[tuple]:
        return (self.marks[0][0], self.marks[0][1]) if self.marks else None

    def keeps(self, other: "Signature") -> bool:
        """Whether ``other`` (a reduced problem's) is the same failure as this one."""
        if not (self.failing and other.failing) or other.status != self.status:
            return False
        return self.primary in {(t, k) for t, k, _ in other.marks}

    def describe(self) -> str:
        if not self.failing:
            return "no failure"
        t, k, m = self.marks[0]
        what = {"over": f"over its threshold (margin {m:.3g})", "nan": "NaN values", "inf": "Inf values",
                "missing": "missing", "shape": "of the wrong shape", "dtype": "of the wrong dtype",
                "untouched": "changed in slots the problem does not write",
                "mistrusted": "mostly exact zeros (mistrusted)"}.get(k, k)
        return f"{t} {what}" if t != "run" else f"the kernel {k}"


def _f(x) -> float:
    return as_float(x)


def underlying_status(rec: dict) -> str:
    """The failing status class of a cell record ('' when it does not fail): a known-fail cell
    counts as the failure it is (``known_failure.status``)."""
    st = rec.get("status")
    if st == "known-fail":
        st = (rec.get("known_failure") or {}).get("status", "fail")
    return FAILING_STATUS.get(st, "")


def signature(rec: dict) -> Signature:
    """The Signature of a run_cell record."""
    status = underlying_status(rec)
    if not status:
        return Signature("", ())
    if status == "crashed":                  # the kernel killed its (isolated) process, or ran past --timeout
        return Signature("crashed", (("run", "crashed", math.inf),))
    if status == "error":
        m = re.search(r"raised (\w+)", rec.get("reason", ""))
        return Signature("error", (("run", f"raised {m.group(1) if m else 'an exception'}", math.inf),))
    marks = []
    for name, t in (rec.get("tensors") or {}).items():
        if not isinstance(t, dict):
            continue
        met = (rec.get("metrics") or {}).get(name) or {}
        margin = _f(t.get("margin"))
        kinds = []
        if _f(met.get("nan_frac", 0.0)) > 0:
            kinds.append("nan")
        if _f(met.get("inf_frac", 0.0)) > 0:
            kinds.append("inf")
        if met.get("missing"):
            kinds.append("missing")
        if t.get("metric") == "shape":
            kinds.append("shape")
        if t.get("dtype") and t.get("expected_dtype") and t["dtype"] != t["expected_dtype"]:
            kinds.append("dtype")
        if _f(met.get("untouched_changed", 0) or 0) > 0:
            kinds.append("untouched")
        if met.get("mistrusted"):
            kinds.append("mistrusted")
        if not kinds and margin > 1:
            kinds.append("over")
        elif margin > 1 and "over" not in kinds and not math.isinf(margin):
            kinds.append("over")
        marks += [(name, k, margin) for k in kinds]
    marks.sort(key=lambda m: (KIND_ORDER.index(m[1]), -(m[2] if not math.isnan(m[2]) else math.inf), m[0]))
    return Signature(status, tuple(marks))


# ----------------------------------------------------------------------------------------
# Problem surgery
# ----------------------------------------------------------------------------------------
def seq_lengths(p) -> list[int]:
    return [e - b for b, e in p.seq_bounds()]


def size(p) -> int:
    """N x tokens x HV: the measure a shrink reduces."""
    return p.N * p.B * p.T * p.HV


def shape_text(p) -> str:
    lens = seq_lengths(p)
    shown = lens if len(lens) <= 12 else lens[:12] + ["..."]
    return f"N={p.N} lens={shown} H={p.H} HV={p.HV} T={p.B * p.T}"


def _state_dtype(p) -> torch.dtype:
    return p.initial_state.dtype if p.initial_state is not None else torch.float32


def subproblem(p, spans: list, heads: Optional[list] = None, starts: Optional[dict] = None):
    """A reduced copy of problem ``p``.

    spans: [(n, a, b)]: sequence n's tokens [a, b) of its own (varlen: any n, a, b; dense: the
    same a, b for every kept row n).  heads: value heads to keep (None: all); a query/key head
    is kept for each (h // (HV / H)), so HV / H stays.  starts: {n: K-first state [HV, K, V]
    (of p's heads)} to start sequence n from (the state at a leading cut)."""
    starts = starts or {}
    HV, H = p.HV, p.H
    heads = list(range(HV)) if heads is None else list(heads)
    group = HV // H
    qk_heads = sorted({h // group for h in heads}) if len(heads) < HV else list(range(H))
    if len(heads) < HV and len(heads) > 1 and len(heads) != len(qk_heads) * group:
        raise ValueError("heads: expected one value head, or whole GVA groups")
    if len(heads) == 1:
        qk_heads = [heads[0] // group]
    sel_v = heads if len(heads) < HV else None
    sel_qk = qk_heads if len(qk_heads) < H else None

    def hs(t, sel, dim=2):
        return t if sel is None else t.index_select(dim, torch.tensor(sel, device=t.device))

    rows = [n for n, _, _ in spans]
    if p.cu_seqlens is None:
        a, b = spans[0][1], spans[0][2]
        if any((s[1], s[2]) != (a, b) for s in spans):
            raise ValueError("spans: a dense problem keeps one token range for every row")
        idx = torch.tensor(rows, device=p.device)

        def tok(t):
            return t.index_select(0, idx)[:, a:b]
        cu = None
    else:
        bounds = p.seq_bounds()
        ix = [i for n, a, b in spans for i in range(bounds[n][0] + a, bounds[n][0] + b)]
        idx = torch.tensor(ix, dtype=torch.long, device=p.device)

        def tok(t):
            return t.index_select(1, idx)
        lens = [b - a for _, a, b in spans]
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=p.cu_seqlens.dtype,
                          device=p.cu_seqlens.device)
    ch = dict(q=hs(tok(p.q), sel_qk).contiguous(), k=hs(tok(p.k), sel_qk).contiguous(),
              v=hs(tok(p.v), sel_v).contiguous(), g=hs(tok(p.g), sel_v).contiguous(),
              beta=hs(tok(p.beta), sel_v).contiguous(), cu_seqlens=cu)
    if p.A_log is not None:
        ch["A_log"] = hs(p.A_log, sel_v, 0).contiguous()
    if p.out_gate is not None:                    # the fused output norm's gate, per token and value head
        ch["out_gate"] = hs(tok(p.out_gate), sel_v).contiguous()
    if p.dt_bias is not None:
        d2 = p.dt_bias.reshape(HV, p.K)
        d2 = hs(d2, sel_v, 0)
        ch["dt_bias"] = (d2 if p.dt_bias.dim() == 2 else d2.reshape(-1)).contiguous()
    hsel = torch.tensor(heads, device=p.device)
    if p.paged:
        cache = p.state_cache if sel_v is None else p.state_cache.index_select(1, hsel).contiguous()
        cache = clone_keep_strides(cache)
        si = p.state_indices[torch.tensor(rows, dtype=torch.long)].clone()
        hi = p.has_initial_state[torch.tensor(rows, dtype=torch.long)].clone()
        for j, n in enumerate(rows):
            if n in starts:
                cache[int(si[j])] = starts[n].index_select(0, hsel.to(starts[n].device)).transpose(-1, -2).to(
                    cache.dtype).to(cache.device)
                hi[j] = True
        ch.update(state_cache=cache, state_indices=si, has_initial_state=hi)
    else:
        init = p.initial_state
        if init is not None:
            init = init[torch.tensor(rows, dtype=torch.long)].index_select(1, hsel).clone()
        if starts:
            if init is None:
                shape = (len(rows), len(heads)) + ((p.K, p.V) if p.state_layout == "kv" else (p.V, p.K))
                init = torch.zeros(shape, dtype=_state_dtype(p), device=p.device)
            for j, n in enumerate(rows):
                if n in starts:
                    s = starts[n].index_select(0, hsel.to(starts[n].device))
                    init[j] = (s if p.state_layout == "kv" else s.transpose(-1, -2)).to(init.dtype).to(init.device)
        ch["initial_state"] = None if init is None else init.contiguous()
    meta = dict(p.meta or {})
    return p.replace(meta=meta, **ch)


def chunk_states(p) -> torch.Tensor:
    """The oracle's state before every CUT-token chunk of every sequence, K-first float64
    [N, chunks + 1, HV, K, V] (kda_ref.chunked at C = CUT)."""
    pp = prepare(p)
    ws = workspace_prepared(pp, CUT)
    return chunked_from_workspace(pp, ws, return_chunk_states=True)[2]


def head_errors(p, outputs: dict, truth: dict) -> list[float]:
    """Per value head, the worst relative L2 error over the output tensors (NaN / Inf: inf)."""
    errs = [0.0] * p.HV
    for name, ref in truth.items():
        x = outputs.get(name)
        if x is None or name not in ("o", "final_state", "state_cache") or tuple(x.shape) != tuple(ref.shape):
            continue
        dim = 2 if name == "o" else 1
        d = (x.to(torch.float64) - ref.to(torch.float64)).movedim(dim, 0).reshape(p.HV, -1)
        r = ref.to(torch.float64).movedim(dim, 0).reshape(p.HV, -1)
        for h in range(p.HV):
            dn, rn = float(d[h].norm()), float(r[h].norm())
            e = math.inf if not math.isfinite(dn) else (dn / rn if rn > 0 else (0.0 if dn == 0 else math.inf))
            errs[h] = max(errs[h], e)
    return errs


# ----------------------------------------------------------------------------------------
# Candidate steps: (description, thunk -> Problem)
# ----------------------------------------------------------------------------------------
def _all_spans(p) -> list:
    if p.cu_seqlens is None:
        return [(n, 0, p.T) for n in range(p.B)]
    return [(n, 0, ln) for n, ln in enumerate(seq_lengths(p))]


def sequence_steps(p, ctx) -> list:
    spans = _all_spans(p)
    N = len(spans)
    if N < 2:
        return []
    what = "row" if p.cu_seqlens is None else "sequence"
    out = []
    if N >= 4:
        h = N // 2
        out.append((f"keep {what}s 0-{h - 1}", spans[:h]))
        out.append((f"keep {what}s {h}-{N - 1}", spans[h:]))
    for n in reversed(range(N)):
        out.append((f"drop {what} {n} ({spans[n][2]} tokens)", spans[:n] + spans[n + 1:]))
    return [(d, (lambda s=s: subproblem(p, s))) for d, s in out]


def head_steps(p, ctx) -> list:
    if p.HV < 2:
        return []
    group = p.HV // p.H
    errs = ctx.get("head_errors") or [0.0] * p.HV
    order = sorted(range(p.HV), key=lambda h: (-errs[h] if not math.isnan(errs[h]) else -math.inf, h))
    out = []
    for h in order:
        out.append((f"keep head {h} of {p.HV} (error {errs[h]:.3g})", [h]))
    for h in reversed(order):
        if group == 1 and p.HV > 2:                 # with two heads, dropping one is keeping the other
            out.append((f"drop head {h} of {p.HV}", [x for x in range(p.HV) if x != h]))
    spans = _all_spans(p)
    return [(d, (lambda k=k: subproblem(p, spans, heads=k))) for d, k in out]


def _longest_first(p) -> list:
    spans = _all_spans(p)
    if p.cu_seqlens is None:
        return [None] if p.T > 0 else []
    return sorted((n for n, _, b in spans if b > 0), key=lambda n: (-spans[n][2], n))


def leading_steps(p, ctx) -> list:
    spans = _all_spans(p)
    out = []
    for n in _longest_first(p):
        L = p.T if n is None else spans[n][2]
        full = (L - 1) // CUT                   # cuts that leave at least one token
        cuts = sorted({c for c in (full, full // 2, 1) if 1 <= c <= full}, reverse=True)
        for c in cuts:
            who = "every row" if n is None else f"sequence {n}"
            out.append((f"drop the first {c * CUT} tokens of {who} (start from the oracle's state at token "
                        f"{c * CUT})", n, c))

    def make(n, c):
        st = ctx["chunk_states"]()
        if n is None:
            new = [(r, c * CUT, p.T) for r in range(p.B)]
            starts = {r: st[r, c] for r in range(p.B)}
        else:
            new = [(m, c * CUT, b) if m == n else (m, a, b) for m, a, b in spans]
            starts = {n: st[n, c]}
        return subproblem(p, new, starts=starts)
    return [(d, (lambda n=n, c=c: make(n, c))) for d, n, c in out]


def trailing_steps(p, ctx) -> list:
    spans = _all_spans(p)
    out = []
    for n in _longest_first(p):
        L = p.T if n is None else spans[n][2]
        cands = []
        for new in (16 * -(-(L // 2) // 16), L // 2, L - CUT, L - 16) + ((L - 1,) if L <= 2 * CUT else ()):
            if 0 < new < L and new not in cands:
                cands.append(new)
        for new in cands:
            who = "every row" if n is None else f"sequence {n}"
            if n is None:
                s = [(r, 0, new) for r in range(p.B)]
            else:
                s = [(m, a, new) if m == n else (m, a, b) for m, a, b in spans]
            out.append((f"cut {who} to its first {new} tokens (of {L})", s))
    return [(d, (lambda s=s: subproblem(p, s))) for d, s in out]


FAMILIES = (("sequences", sequence_steps), ("heads", head_steps), ("leading", leading_steps),
            ("trailing", trailing_steps))


# ----------------------------------------------------------------------------------------
# The cell, run the matrix's way
# ----------------------------------------------------------------------------------------
class _Recording:
    """Mixin of ``recording``: run() keeps what it returned (run_cell does not hand outputs back)."""
    last = None

    def run(self, problem, route, *a, **kw):
        self.last = None
        out = super().run(problem, route, *a, **kw)
        self.last = out
        return out


def recording(inner):
    """A shallow copy of backend ``inner`` whose run() keeps what it returned in ``.last``.  Its
    class derives from inner's, so it has every capability inner's class declares (the harness
    tests capabilities with isinstance against runtime-checkable Protocols, which do not see
    attributes a wrapper forwards through __getattr__ on Python >= 3.12)."""
    cls = type(f"Recording{type(inner).__name__}", (_Recording, type(inner)), {})
    try:
        state = vars(inner)               # the backend's own state, shared (no __init__ runs again)
    except TypeError:                     # a backend without __dict__ (__slots__)
        raise UsageError(f"--backend: expected a backend object with a __dict__ (shrink records its "
                         f"outputs), got {type(inner).__name__} with __slots__") from None
    rec = object.__new__(cls)
    rec.__dict__.update(state)
    rec.last = None
    return rec


@dataclass
class ProblemCase:
    """A case whose problem is given (a reduced one): what run_cell needs of a Case."""
    name: str
    suite: str
    seed: int
    problem: object
    params: dict = field(default_factory=dict)
    suite_opts: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    @property
    def shape_key(self) -> tuple:
        p = self.problem
        return (p.B, p.T, p.H)

    def build(self, device="cpu"):
        return self.problem.to(device)


@dataclass
class Attempt:
    record: dict
    signature: Signature
    problem: object
    outputs: Optional[object]
    truth: Optional[object]


@dataclass
class ShrinkResult:
    original: Attempt
    final: Attempt
    trace: list                     # accepted steps: dicts
    runs: int
    seconds: float
    stopped: str                    # "no step keeps the failure" | "max-runs"

    @property
    def shrunk(self) -> bool:
        return len(self.trace) > 0


def greedy_reduce(first, families, candidates, out_of_runs, on_step) -> tuple:
    """The greedy loop of every shrink (a dense problem here; a serving trace in
    verification/serving/shrink.py): family by family, take the first candidate whose attempt
    keeps the first failure's signature and try that family again from it; stop after a round
    over every family keeps nothing, or when the runs are spent.

    ``first``: the failing attempt (``.signature``); ``families`` [(name, steps)];
    ``candidates(steps, cur)`` yields (description, attempt) where ``attempt()`` runs the
    reduction and returns its attempt, or None for a candidate that is no reduction (nothing
    run); ``out_of_runs()``; ``on_step(family, description, kept attempt)``.  Returns (the last
    kept attempt, "max-runs" or "no step keeps the failure")."""
    sig, cur = first.signature, first
    while not out_of_runs():
        kept_any = False
        for fam, steps in families:
            while not out_of_runs():
                kept = None
                for desc, attempt in candidates(steps, cur):
                    if out_of_runs():
                        break
                    att = attempt()
                    if att is not None and sig.keeps(att.signature):
                        kept = (desc, att)
                        break
                if kept is None:
                    break
                desc, cur = kept
                kept_any = True
                on_step(fam, desc, cur)
        if not kept_any:
            break
    return cur, ("max-runs" if out_of_runs() else "no step keeps the failure")


class Shrinker:
    """Runs one (backend, route) on a case and its reductions through ``run_cell``."""

    def __init__(self, loaded, route, db, device: str = "cpu", guards: Optional[bool] = None,
                 log: Optional[Callable[[str], None]] = None, isolate: bool = False,
                 timeout_s: Optional[float] = None, tolerances_path: Optional[str] = None):
        self.rec_backend = recording(loaded.backend)
        self.loaded = LoadedBackend(spec=loaded.spec, backend=self.rec_backend, available=loaded.available,
                                    reason=loaded.reason, version=loaded.version, from_spec=loaded.from_spec)
        self.route, self.db, self.device, self.guards = route, db, device, guards
        self.log = log or (lambda s: None)
        self.runs = 0
        self.isolate, self.timeout_s, self.tolerances_path = isolate, timeout_s, tolerances_path

    def attempt(self, case, isolate: Optional[bool] = None) -> Attempt:
        """Run the cell on ``case`` as the matrix does: in this process (its outputs are kept), or with
        ``isolate`` in a child process (run --isolate: a kernel that kills it is ``crashed``; no outputs)."""
        tc, bc = TruthCache(device=self.device), BaselineCache()
        self.runs += 1
        self.rec_backend.last = None
        if self.isolate if isolate is None else isolate:
            runner = IsolatedRunner(tc, bc, tolerances_path=self.tolerances_path, timeout_s=self.timeout_s,
                                    guards=self.guards)
            try:
                rec = runner.run(self.loaded, self.route, case, self.device)
            finally:
                runner.close()
        else:
            rec = run_cell(self.loaded, self.route, case, tc, bc, self.db, device=self.device, guards=self.guards)
        truth = None
        if rec.get("status") not in ("skipped",) and case.id in tc._truths:
            truth = tc._truths[case.id][0]
        problem = tc._problems.get(case.id)
        return Attempt(rec, signature(rec), problem, self.rec_backend.last, truth)

    def shrink(self, case, max_runs: int = DEFAULT_MAX_RUNS) -> ShrinkResult:
        t0 = time.perf_counter()
        first = self.attempt(case)
        if not first.signature.failing:
            return ShrinkResult(first, first, [], self.runs, time.perf_counter() - t0, "the cell does not fail")
        sig = first.signature
        trace = []
        k = 0

        def candidates(steps, cur):
            ctx = self._context(cur)
            for desc, make in steps(cur.problem, ctx):
                def attempt(make=make):
                    nonlocal k
                    try:
                        cand = make()
                    except ValueError:
                        return None
                    if cand.is_empty or size(cand) >= size(cur.problem):
                        return None
                    k += 1
                    return self.attempt(ProblemCase(name=f"{case.name}~shrink{k}", suite=case.suite, seed=case.seed,
                                                    problem=cand, params=dict(getattr(case, "params", {}) or {}),
                                                    suite_opts=dict(getattr(case, "suite_opts", {}) or {})))
                yield desc, attempt

        def on_step(fam, desc, cur):
            step = {"step": len(trace) + 1, "family": fam, "op": desc, "shape": shape_text(cur.problem),
                    "size": size(cur.problem), "failure": cur.signature.describe(), "run": self.runs}
            trace.append(step)
            self.log(f"  step {step['step']} (run {self.runs}): {desc} -> {step['shape']}: {step['failure']}")

        cur, stopped = greedy_reduce(first, FAMILIES, candidates, lambda: self.runs >= max_runs, on_step)
        if self.isolate and cur.outputs is None and cur.signature.status != "crashed":
            again = self.attempt(ProblemCase(name=f"{case.name}~final", suite=case.suite, seed=case.seed,
                                             problem=cur.problem, params=dict(getattr(case, "params", {}) or {})),
                                 isolate=False)            # the outputs for the bundle, in this process
            if sig.keeps(again.signature):
                cur = again
        return ShrinkResult(first, cur, trace, self.runs, time.perf_counter() - t0, stopped)

    def _context(self, cur: Attempt) -> dict:
        ctx: dict = {}
        if cur.outputs is not None and cur.truth is not None:
            try:
                ctx["head_errors"] = head_errors(cur.problem, cur.outputs.tensors(), cur.truth.tensors())
            except Exception:  # noqa: BLE001 - an order hint only: without it heads go in index order
                ctx["head_errors"] = None
        cache = {}

        def states():
            if "s" not in cache:
                cache["s"] = chunk_states(cur.problem)
            return cache["s"]
        ctx["chunk_states"] = states
        return ctx
