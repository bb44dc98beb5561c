"""Serving traces: a sequence of forward steps over one paged state cache.

A serving engine calls KDA once per forward step on a varlen batch that mixes requests in
different phases, each row reading its initial state from a slot of one shared cache and writing
its new state back.  A :class:`Trace` records such steps; ``kda_ref.trace_oracle`` gives their
float64 truth; ``kda_ref.trace_gen`` generates them.  Full description: docs/traces.md.

The cache (:class:`CacheSpec`): ``slots`` slots of ``[HV, V, K]`` (layout ``vk``, V-first) or
``[HV, K, V]`` (``kv``) in float32 or bfloat16, inside one flat buffer

    buffer = [guard_rows rows] [slot 0] [pad] [slot 1] [pad] ... [slot slots-1] [guard_rows rows]

with ``slot_stride`` elements from one slot to the next (>= HV*V*K; the gap is padding) and a row
= the innermost dimension (K for vk, V for kv).  Padding rows of a batch point at the pad slot:
``-1`` (convention ``minus1``) or the NULL block ``0`` (``null0``: slot 0 is then never given to
a request).  Neither may ever be written.

Tokens of every step are packed on one axis (steps in order, rows in order within a step):

    q, k [Ttot, H, K]   v [Ttot, HV, V]   g [Ttot, HV, K]   beta [Ttot, HV]      (raw inputs)
    step_rows [S+1]              rows of step s: step_rows[s] .. step_rows[s+1]-1
    row_len [R]                  tokens of each row (its tokens follow the previous row's)
    row_request [R]              request id, -1 for a padding row (a CUDA-graph-padded batch)
    row_phase [R]                0 prefill chunk, 1 decode, 2 speculative decode, -1 padding
    state_indices [R, W]         the kernel's slot table, one row per batch row
    has_initial_state [R]        the kernel's flag
    num_accepted_tokens [R]      the kernel's argument: 1, or on a spec row the accepted count
                                 of the request's previous spec step
    accepted [R]                 tokens of the row that join the request's stream (row_len,
                                 or 1..row_len on a spec row): the verifier's decision

How a row reads and writes the cache (the kernels' conventions, fla ``fused_recurrent_kda_fwd``
with ``inplace_final_state`` and aiter ``fused_recurrent_kda``):

    read  (has_initial_state):  prefill, decode: slot state_indices[n, 0]
                                spec:            slot state_indices[n, num_accepted_tokens[n] - 1]
    write prefill, decode:      the state after the row's last token   -> state_indices[n, 0]
          spec:                 the state after each token t < row_len -> state_indices[n, t]

A trace is consistent (``plan`` checks it, raising :class:`TraceError` naming the step and row)
when every read slot holds the current state of its request (the state after the request's last
accepted token), has_initial_state is true exactly when the request has accepted tokens, no row
writes a pad slot, a slot holding another unfinished request's current state, or a slot another
row of its step reads or writes, and padding rows hold pad slots only.  A request is finished
after its last row; its slots may then be reused.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from safetensors.torch import save_file

from .files import UnreadableFile, read_safetensors
from .problem import BETA_KINDS, GATE_KINDS, Problem, ProblemError, shape_of, validate

TRACE_FORMAT = "kda-verify-trace/1"
PHASES = ("prefill", "decode", "spec")               # row_phase 0, 1, 2; -1 = padding row
PREFILL, DECODE, SPEC, PAD = 0, 1, 2, -1
CACHE_LAYOUTS = ("vk", "kv")
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD_CONVENTIONS = {"minus1": -1, "null0": 0}


class TraceError(ProblemError):
    """Bad trace or trace file: one line naming the field (and step, row), what was expected, what came."""


def _req(cond: bool, msg: str):
    if not cond:
        raise TraceError(msg)


# ----------------------------------------------------------------------------- the cache
@dataclass(frozen=True)
class CacheSpec:
    """The paged state cache: ``slots`` slots of [HV, V, K] (vk) or [HV, K, V] (kv) in one flat
    buffer of ``dtype``, ``slot_stride`` elements apart, ``guard_rows`` rows before the first and
    after the last; ``pad`` names the padding convention (minus1: pad slot -1; null0: pad slot 0,
    the NULL block, never allocated)."""
    slots: int
    HV: int
    K: int
    V: int
    layout: str = "vk"
    dtype: str = "float32"
    slot_stride: Optional[int] = None      # None: dense (HV*V*K)
    guard_rows: int = 0
    pad: str = "minus1"

    @property
    def slot_shape(self) -> tuple:
        return (self.HV, self.V, self.K) if self.layout == "vk" else (self.HV, self.K, self.V)

    @property
    def slot_numel(self) -> int:
        return self.HV * self.K * self.V

    @property
    def row(self) -> int:
        """Elements of one row (the innermost dimension)."""
        return self.K if self.layout == "vk" else self.V

    @property
    def stride(self) -> int:
        return self.slot_numel if self.slot_stride is None else int(self.slot_stride)

    @property
    def pad_slot(self) -> int:
        return PAD_CONVENTIONS[self.pad]

    @property
    def first_slot(self) -> int:
        """The lowest slot a request may hold (1 under null0: slot 0 is the NULL block)."""
        return 1 if self.pad == "null0" else 0

    @property
    def offset(self) -> int:
        return self.guard_rows * self.row

    @property
    def buffer_numel(self) -> int:
        return 2 * self.offset + self.slots * self.stride

    @property
    def torch_dtype(self) -> torch.dtype:
        return CACHE_DTYPES[self.dtype]

    def check(self) -> "CacheSpec":
        for name in ("slots", "HV", "K", "V", "guard_rows"):
            val = getattr(self, name)
            _req(isinstance(val, int) and not isinstance(val, bool) and val >= (0 if name == "guard_rows" else 1),
                 f"cache.{name}: expected an integer >= {0 if name == 'guard_rows' else 1}, got {val!r}")
        _req(self.layout in CACHE_LAYOUTS,
             f"cache.layout: expected one of {'|'.join(CACHE_LAYOUTS)}, got {self.layout!r}")
        _req(self.dtype in CACHE_DTYPES, f"cache.dtype: expected one of {'|'.join(CACHE_DTYPES)}, got {self.dtype!r}")
        _req(self.pad in PAD_CONVENTIONS, f"cache.pad: expected one of {'|'.join(PAD_CONVENTIONS)}, got {self.pad!r}")
        if self.slot_stride is not None:
            s = self.slot_stride
            _req(isinstance(s, int) and not isinstance(s, bool) and s >= self.slot_numel and s % self.row == 0,
                 f"cache.slot_stride: expected a whole number of {self.row}-element rows >= HV*V*K = "
                 f"{self.slot_numel}, got {s!r}")
        _req(self.slots > self.first_slot,
             f"cache.slots: expected more than {self.first_slot} with pad={self.pad}, got {self.slots}")
        return self

    def allocate(self, fill: float = float("nan"), device=None) -> torch.Tensor:
        """A flat buffer [buffer_numel] of the cache dtype, every element ``fill``."""
        return torch.full((self.buffer_numel,), fill, dtype=self.torch_dtype, device=device)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The slots of a flat buffer: a strided view [slots, *slot_shape] (no copy)."""
        _, a, b = self.slot_shape
        return buffer.as_strided((self.slots,) + self.slot_shape, (self.stride, a * b, b, 1), self.offset)

    def outside_slots(self, device=None) -> torch.Tensor:
        """Bool mask [buffer_numel]: the guard rows and the padding between slots, which no
        kernel may ever write."""
        m = torch.ones(self.buffer_numel, dtype=torch.bool, device=device)
        self.view(m).fill_(False)
        return m

    def to_layout(self, state_kfirst: torch.Tensor) -> torch.Tensor:
        """A K-first state [..., K, V] as the cache lays it out (a view)."""
        return state_kfirst.transpose(-1, -2) if self.layout == "vk" else state_kfirst

    def to_kfirst(self, slot_content: torch.Tensor) -> torch.Tensor:
        """A slot's content in the cache layout as K-first [..., K, V] (a view)."""
        return slot_content.transpose(-1, -2) if self.layout == "vk" else slot_content


# ----------------------------------------------------------------------------- the trace
INT_FIELDS = ("step_rows", "row_len", "row_request", "row_phase", "state_indices", "num_accepted_tokens", "accepted")
TOKEN_FIELDS = ("q", "k", "v", "g", "beta")


@dataclass
class Trace:
    cache: CacheSpec
    q: torch.Tensor                  # [Ttot, H, K]
    k: torch.Tensor                  # [Ttot, H, K]
    v: torch.Tensor                  # [Ttot, HV, V]
    g: torch.Tensor                  # [Ttot, HV, K]
    beta: torch.Tensor               # [Ttot, HV]
    step_rows: torch.Tensor          # [S+1] int64
    row_len: torch.Tensor            # [R] int64
    row_request: torch.Tensor        # [R] int64, -1 padding
    row_phase: torch.Tensor          # [R] int8
    state_indices: torch.Tensor      # [R, W] int32
    has_initial_state: torch.Tensor  # [R] bool
    num_accepted_tokens: torch.Tensor  # [R] int32
    accepted: torch.Tensor           # [R] int32
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    lower_bound: Optional[float] = None
    gate: str = "lower_bound"
    beta_kind: str = "sigmoid"
    qk_l2norm: bool = True
    meta: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return int(self.step_rows.numel()) - 1

    @property
    def rows(self) -> int:
        return int(self.row_len.numel())

    @property
    def tokens(self) -> int:
        return int(self.q.shape[0])

    @property
    def H(self) -> int:
        return int(self.q.shape[1])

    @property
    def HV(self) -> int:
        return int(self.v.shape[1])

    @property
    def K(self) -> int:
        return int(self.q.shape[2])

    @property
    def V(self) -> int:
        return int(self.v.shape[2])

    def row_tokens(self) -> torch.Tensor:
        """[R+1] int64: row n covers packed tokens row_tokens[n] .. row_tokens[n+1]-1 (computed
        once per ``row_len`` tensor, so replaying every step costs O(R), not O(R^2))."""
        cached = self.__dict__.get("_row_tokens")
        if cached is None or cached[0] is not self.row_len:
            out = torch.zeros(self.rows + 1, dtype=torch.int64)
            torch.cumsum(self.row_len.to(torch.int64), 0, out=out[1:])
            cached = self.__dict__["_row_tokens"] = (self.row_len, out)
        return cached[1]

    def problem_view(self) -> Problem:
        """Every token of the trace as one varlen-free Problem [1, Ttot] (no state): the object
        ``kda_ref`` preprocessing reads.  Its outputs mean nothing; its inputs are the trace's."""
        return Problem(q=self.q[None], k=self.k[None], v=self.v[None], g=self.g[None], beta=self.beta[None],
                       A_log=self.A_log, dt_bias=self.dt_bias, scale=self.scale, lower_bound=self.lower_bound,
                       gate=self.gate, beta_kind=self.beta_kind, qk_l2norm=self.qk_l2norm,
                       output_final_state=False)

    def step(self, s: int) -> dict:
        """The kernel arguments of step s: q k v g beta [1, Tstep, ...], cu_seqlens [rows+1]
        int32, state_indices [rows, W] int32, has_initial_state [rows] bool,
        num_accepted_tokens [rows] int32, and row_phase, row_request for the caller."""
        _req(0 <= s < self.steps, f"step: expected 0 <= step < {self.steps}, got {s}")
        r0, r1 = int(self.step_rows[s]), int(self.step_rows[s + 1])
        rt = self.row_tokens()
        t0, t1 = int(rt[r0]), int(rt[r1])
        cu = (rt[r0:r1 + 1] - t0).to(torch.int32)
        out = {n: getattr(self, n)[t0:t1][None] for n in TOKEN_FIELDS}
        out.update(cu_seqlens=cu, state_indices=self.state_indices[r0:r1],
                   has_initial_state=self.has_initial_state[r0:r1],
                   num_accepted_tokens=self.num_accepted_tokens[r0:r1],
                   row_phase=self.row_phase[r0:r1], row_request=self.row_request[r0:r1])
        return out

    def describe(self) -> str:
        ph = self.row_phase.tolist()
        counts = {name: ph.count(i) for i, name in enumerate(PHASES)}
        c = self.cache
        reqs = len(set(self.row_request.tolist()) - {-1})
        return (f"steps={self.steps} rows={self.rows} tokens={self.tokens} requests={reqs} "
                f"prefill={counts['prefill']} decode={counts['decode']} spec={counts['spec']} pad={ph.count(PAD)} "
                f"H={self.H} HV={self.HV} K={self.K} V={self.V} cache={c.slots}x{c.layout}/{c.dtype} "
                f"stride={c.stride} guard={c.guard_rows} pad={c.pad}")


def _int_tensor(name: str, t, shape: tuple, kind: str = "integer") -> None:
    ok = isinstance(t, torch.Tensor) and tuple(t.shape) == shape
    if ok and kind == "bool":
        ok = t.dtype == torch.bool
    elif ok:
        ok = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    dims = "[" + ",".join(str(x) for x in shape) + "]"
    _req(ok, f"{name}: expected {'a bool' if kind == 'bool' else 'an integer'} tensor {dims}, "
             f"got {shape_of(t) if isinstance(t, torch.Tensor) else type(t).__name__}")


def validate_trace(tr: Trace) -> Trace:
    """Check the shapes, dtypes and values of every field (the token inputs through
    ``kda_ref.problem.validate``), then the consistency of the steps (``plan``).  Raises
    TraceError (or ProblemError for a token input) naming the first bad field."""
    _req(isinstance(tr.cache, CacheSpec), f"cache: expected a CacheSpec, got {type(tr.cache).__name__}")
    tr.cache.check()
    for n in TOKEN_FIELDS:
        _req(isinstance(getattr(tr, n), torch.Tensor), f"{n}: expected a tensor, got {type(getattr(tr, n)).__name__}")
    for n, d in (("q", 3), ("k", 3), ("v", 3), ("g", 3), ("beta", 2)):
        _req(getattr(tr, n).dim() == d, f"{n}: expected {d} dims, got {shape_of(getattr(tr, n))}")
    validate(tr.problem_view())
    c = tr.cache
    _req((tr.HV, tr.K, tr.V) == (c.HV, c.K, c.V),
         f"cache: expected HV={tr.HV} K={tr.K} V={tr.V} (those of v and q), got HV={c.HV} K={c.K} V={c.V}")
    sr = tr.step_rows
    _req(isinstance(sr, torch.Tensor) and sr.dim() == 1 and sr.numel() >= 2 and not sr.is_floating_point()
         and sr.dtype != torch.bool, f"step_rows: expected an integer tensor [S+1] with S >= 1, got "
                                     f"{shape_of(sr) if isinstance(sr, torch.Tensor) else type(sr).__name__}")
    R = tr.rows if isinstance(tr.row_len, torch.Tensor) and tr.row_len.dim() == 1 else -1
    _req(R >= 1, f"row_len: expected an integer tensor [R] with R >= 1, got "
                 f"{shape_of(tr.row_len) if isinstance(tr.row_len, torch.Tensor) else type(tr.row_len).__name__}")
    _int_tensor("row_len", tr.row_len, (R,))
    s = sr.tolist()
    _req(s[0] == 0 and s[-1] == R, f"step_rows: expected to run from 0 to R={R}, got {s[0]} .. {s[-1]}")
    bad = [i for i in range(1, len(s)) if s[i] <= s[i - 1]]
    _req(not bad, f"step_rows: expected strictly increasing (every step has a row), got {s[bad[0] - 1]} then "
                  f"{s[bad[0]]} at index {bad[0]}" if bad else "")
    _int_tensor("row_request", tr.row_request, (R,))
    _int_tensor("row_phase", tr.row_phase, (R,))
    si = tr.state_indices
    _req(isinstance(si, torch.Tensor) and si.dim() == 2 and si.shape[0] == R and si.shape[1] >= 1,
         f"state_indices: expected an integer tensor [R={R}, W>=1], got "
         f"{shape_of(si) if isinstance(si, torch.Tensor) else type(si).__name__}")
    _int_tensor("state_indices", si, (R, int(si.shape[1])))
    _int_tensor("has_initial_state", tr.has_initial_state, (R,), "bool")
    _int_tensor("num_accepted_tokens", tr.num_accepted_tokens, (R,))
    _int_tensor("accepted", tr.accepted, (R,))
    lens = tr.row_len.tolist()
    neg = [i for i, x in enumerate(lens) if x < 0]
    if neg:
        raise TraceError(f"row_len: expected >= 0 tokens per row, got {lens[neg[0]]} at row {neg[0]}")
    _req(sum(lens) == tr.tokens, f"row_len: expected to sum to the {tr.tokens} tokens of q, got {sum(lens)}")
    ph = tr.row_phase.tolist()
    odd = [i for i, x in enumerate(ph) if x not in (PAD, PREFILL, DECODE, SPEC)]
    _req(not odd, f"row_phase: expected -1 (pad), 0 (prefill), 1 (decode) or 2 (spec), got "
                  f"{ph[odd[0]] if odd else 0} at row {odd[0] if odd else 0}")
    W = int(si.shape[1])
    lo = [i for i, x in enumerate(si.reshape(-1).tolist()) if not (x == c.pad_slot or c.first_slot <= x < c.slots)]
    if lo:
        n, w = divmod(lo[0], W)
        raise TraceError(f"state_indices: expected slots in [{c.first_slot}, {c.slots}) or the pad slot {c.pad_slot} "
                         f"(pad={c.pad}), got {int(si[n, w])} at row {n} column {w}")
    for _ in iter_plan(tr):
        pass
    return tr


# ----------------------------------------------------------------------------- the plan
@dataclass
class RowPlan:
    """One live row of a step: its request, phase, packed token range [tok0, tok0 + T), the
    tokens accepted, the slot it reads (None: starts from zero), the slots it writes
    [(token t, slot)] (the state after token t of the row goes to the slot), and the state ids
    it reads and creates (``new_ids[i]`` is the state of ``writes[i]``; ``keep`` the id of the
    state after the last accepted token)."""
    row: int
    request: int
    phase: int
    tok0: int
    T: int
    accepted: int
    read: Optional[int]
    read_id: Optional[int]
    writes: list
    new_ids: list
    keep: int


@dataclass
class StepPlan:
    step: int
    tok0: int
    tok1: int
    rows: list                 # [RowPlan] of the live rows
    pad_rows: list             # batch row indices (step-local) of padding rows
    written: list              # sorted slots this step writes
    live: dict                 # after the step: slot -> request whose current state it holds (unfinished requests)
    finished: list             # requests whose last row is in this step


def _where(s: int, n: int, r: int, ph: int) -> str:
    return f"step {s} row {n} ({'padding' if r < 0 else f'request {r}, {PHASES[ph]}'})"


def plan(tr: Trace) -> list:
    """The StepPlan of every step (``iter_plan``), as a list."""
    return list(iter_plan(tr))


def iter_plan(tr: Trace) -> Iterator[StepPlan]:
    """Walk the steps without arithmetic: check the trace's consistency (module docstring) and
    yield one StepPlan per step, in order (a generator: a long trace's plans need not all be
    held at once).  State ids number every state the trace creates; a slot's content is known
    by the id of the state last written to it."""
    c = tr.cache
    pad = c.pad_slot
    lens, reqs, phs = tr.row_len.tolist(), tr.row_request.tolist(), tr.row_phase.tolist()
    table, his = tr.state_indices.tolist(), tr.has_initial_state.tolist()
    nacc, acc = tr.num_accepted_tokens.tolist(), tr.accepted.tolist()
    bounds = tr.step_rows.tolist()
    W = len(table[0])
    last_row = {}
    for n, r in enumerate(reqs):
        if r >= 0:
            last_row[r] = n
        elif r != -1:
            raise TraceError(f"row_request: expected a request id >= 0 or -1 (padding), got {r} at row {n}")
    cur = {}                  # request -> id of its current state
    seen = {}                 # request -> accepted tokens so far
    slot_id = {}              # slot -> state id
    current_of = {}           # state id -> request, for ids that are some request's current state
    next_id = 0
    tok = 0
    for s in range(len(bounds) - 1):
        rows, pads, reads, writes_at = [], [], {}, {}
        tok0 = tok
        in_step = set()

        def where(n: int) -> str:          # messages only: "step s row i (request r, phase)"
            return _where(s, n - bounds[s], reqs[n], phs[n])

        def bad(n: int, msg: str):
            raise TraceError(f"{where(n)}: {msg}")

        for n in range(bounds[s], bounds[s + 1]):
            r, ph, T = reqs[n], phs[n], lens[n]
            if r < 0 or ph == PAD:
                if not (r < 0 and ph == PAD):
                    bad(n, f"expected row_request -1 exactly when row_phase is -1, got request {r} phase {ph}")
                if any(x != pad for x in table[n]):
                    bad(n, f"state_indices: expected only the pad slot {pad} on a padding row, got {table[n]}")
                pads.append(n - bounds[s])
                tok += T
                continue
            if r in in_step:
                bad(n, f"expected each request at most once per step, got request {r} twice")
            in_step.add(r)
            if T < 1:
                bad(n, f"row_len: expected >= 1 token on a live row, got {T}")
            if ph == DECODE and T != 1:
                bad(n, f"row_len: expected 1 token on a decode row, got {T}")
            if ph == SPEC and T > W:
                bad(n, f"row_len: expected at most W={W} tokens on a spec row (one slot per token), got {T}")
            a, na = acc[n], nacc[n]
            if not ((1 <= a <= T) if ph == SPEC else a == T):
                bad(n, f"accepted: expected {f'1..{T}' if ph == SPEC else T}, got {a}")
            if not ((1 <= na <= W) if ph == SPEC else na == 1):
                bad(n, f"num_accepted_tokens: expected {f'1..{W}' if ph == SPEC else 1}, got {na}")
            has = r in cur
            if ph != PREFILL and not has:
                bad(n, f"expected a prefill before a {PHASES[ph]} row, got none for request {r}")
            if bool(his[n]) != has:
                bad(n, f"has_initial_state: expected {str(has).lower()} (the request has {seen.get(r, 0)} accepted "
                       f"tokens before this row), got {str(bool(his[n])).lower()}")
            read = read_id = None
            if has:
                col = na - 1 if ph == SPEC else 0
                read = table[n][col]
                if read == pad:
                    bad(n, f"state_indices[{col}]: expected the slot it reads, got the pad slot {pad}")
                if slot_id.get(read) != cur[r]:
                    bad(n, f"reads slot {read} (state_indices[{col}]), which does not hold the request's current "
                           f"state (after its {seen[r]} accepted tokens)")
                read_id = cur[r]
                reads[read] = n
            wr = []
            for t in (range(T) if ph == SPEC else [0]):
                slot = table[n][t]
                if slot == pad:
                    bad(n, f"state_indices[{t}]: expected a slot to write, got the pad slot {pad}")
                if slot in writes_at:
                    other = "this row" if writes_at[slot] == n else where(writes_at[slot])
                    bad(n, f"writes slot {slot}, which {other} also writes in this step")
                writes_at[slot] = n
                wr.append((t if ph == SPEC else T - 1, slot))
            new_ids = list(range(next_id, next_id + len(wr)))
            next_id += len(wr)
            # the state after the last accepted token: spec rows write every token, others the last
            keep = next(i for (t, _), i in zip(wr, new_ids) if t == a - 1)
            rows.append(RowPlan(row=n, request=r, phase=ph, tok0=tok, T=T, accepted=a, read=read, read_id=read_id,
                                writes=wr, new_ids=new_ids, keep=keep))
            tok += T
        for slot, n in reads.items():
            w = writes_at.get(slot)
            if w is not None and w != n:
                bad(w, f"writes slot {slot}, which {where(n)} reads in the same step")
        for slot, n in writes_at.items():
            held = current_of.get(slot_id.get(slot))
            if held is not None and held != reqs[n]:       # finished requests hold no current state
                bad(n, f"writes slot {slot}, which holds the current state of request {held} (not finished: "
                       f"its last row is row {last_row[held]})")
        # apply: the step's writes, then the requests' new current states
        for rp in rows:
            for (_, slot), i in zip(rp.writes, rp.new_ids):
                slot_id[slot] = i
            if rp.read_id is not None:
                current_of.pop(rp.read_id, None)
            cur[rp.request] = rp.keep
            current_of[rp.keep] = rp.request
            seen[rp.request] = seen.get(rp.request, 0) + rp.accepted
        finished = sorted({rp.request for rp in rows if last_row[rp.request] == rp.row})
        for r in finished:
            current_of.pop(cur.pop(r), None)
        live = {slot: current_of[i] for slot, i in slot_id.items() if i in current_of}
        yield StepPlan(step=s, tok0=tok0, tok1=tok, rows=rows, pad_rows=pads, written=sorted(writes_at),
                       live=live, finished=finished)


# ----------------------------------------------------------------------------- files
def _num(x) -> str:
    return "none" if x is None else repr(float(x))


def save_trace(path: str, tr: Trace) -> None:
    """Write a trace: its tensors in their own dtypes (safetensors), the cache spec and options
    as JSON in the metadata key ``trace``."""
    tensors = {n: getattr(tr, n) for n in TOKEN_FIELDS + INT_FIELDS + ("has_initial_state", "A_log", "dt_bias")}
    clean = {n: t.detach().contiguous().clone() for n, t in tensors.items() if t is not None}
    opts = {"cache": dataclasses.asdict(tr.cache), "scale": tr.scale, "lower_bound": tr.lower_bound,
            "gate": tr.gate, "beta_kind": tr.beta_kind, "qk_l2norm": tr.qk_l2norm, "meta": tr.meta}
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    save_file(clean, path, metadata={"format": TRACE_FORMAT, "trace": json.dumps(opts, default=str, sort_keys=True)})


OPTION_KEYS = {"cache", "scale", "lower_bound", "gate", "beta_kind", "qk_l2norm", "meta"}


def load_trace(path: str) -> Trace:
    """Read and validate a trace file; every problem is one TraceError line naming the key."""
    try:
        tensors, meta = read_safetensors(path)
    except UnreadableFile as e:
        raise TraceError(e.line("trace")) from None
    _req(meta.get("format") == TRACE_FORMAT,
         f"format: expected {TRACE_FORMAT!r} in the metadata of {path}, got {meta.get('format')!r}")
    try:
        opts = json.loads(meta.get("trace", ""))
    except ValueError:
        raise TraceError(f"trace: expected JSON options in the metadata of {path}, got "
                         f"{meta.get('trace', '')[:40]!r}") from None
    _req(isinstance(opts, dict), f"trace: expected a JSON object in the metadata of {path}, got {type(opts).__name__}")
    missing = sorted(OPTION_KEYS - set(opts))
    _req(not missing, f"{missing[0] if missing else ''}: expected the key in the trace metadata of {path}, got none")
    extra = sorted(set(opts) - OPTION_KEYS)
    _req(not extra, f"{extra[0] if extra else ''}: expected only the keys {', '.join(sorted(OPTION_KEYS))} in the "
                    f"trace metadata of {path}, got this one too")
    cache = opts["cache"]
    fields = {f.name for f in dataclasses.fields(CacheSpec)}
    _req(isinstance(cache, dict) and set(cache) == fields,
         f"cache: expected an object with the keys {', '.join(sorted(fields))} in the trace metadata of {path}, got "
         f"{sorted(cache) if isinstance(cache, dict) else type(cache).__name__}")
    spec = CacheSpec(**cache)
    for n in TOKEN_FIELDS + INT_FIELDS + ("has_initial_state",):
        _req(n in tensors, f"{n}: expected a tensor {n!r} in {path}, got none")
    known = set(TOKEN_FIELDS + INT_FIELDS + ("has_initial_state", "A_log", "dt_bias"))
    extra = sorted(set(tensors) - known)
    _req(not extra, f"{extra[0] if extra else ''}: expected only the tensors {', '.join(sorted(known))} in {path}, "
                    f"got this one too")
    for key in ("scale", "lower_bound"):
        x = opts[key]
        _req(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)),
             f"{key}: expected a finite number or null in the trace metadata of {path}, got {x!r}")
    _req(opts["gate"] in GATE_KINDS, f"gate: expected one of {'|'.join(GATE_KINDS)} in the trace metadata of {path}, "
                                     f"got {opts['gate']!r}")
    _req(opts["beta_kind"] in BETA_KINDS, f"beta_kind: expected one of {'|'.join(BETA_KINDS)} in the trace metadata "
                                          f"of {path}, got {opts['beta_kind']!r}")
    _req(isinstance(opts["qk_l2norm"], bool), f"qk_l2norm: expected true or false in the trace metadata of {path}, "
                                              f"got {opts['qk_l2norm']!r}")
    _req(isinstance(opts["meta"], dict), f"meta: expected a JSON object in the trace metadata of {path}, "
                                         f"got {opts['meta']!r}")
    tr = Trace(cache=spec, **{n: tensors.get(n) for n in known},
               scale=opts["scale"], lower_bound=opts["lower_bound"], gate=opts["gate"], beta_kind=opts["beta_kind"],
               qk_l2norm=opts["qk_l2norm"], meta=opts["meta"])
    return validate_trace(tr)
