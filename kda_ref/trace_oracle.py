"""The float64 truth of a serving trace, step by step.

Each request's truth is the KDA recurrence over its accepted tokens, in order, from a zero state:
whatever the steps that carried them (prefill chunks of any length, decodes, speculative
decodes whose rejected drafts leave it), the outputs of a token and the state after it are those
of the whole-sequence oracle (``kda_ref.truth``) on the request's accepted stream.  A rejected
draft token's output, and the state after it, are those of the stream up to the draft.

``trace_oracle(trace)`` walks the steps in order and yields one :class:`StepTruth` per step:

    o           [Tstep, HV, V] float64: every live row's tokens (drafts included); NaN on the
                tokens of padding rows, which nothing constrains
    token_live  [Tstep] bool: the tokens o defines
    written     sorted slots the step writes; every other slot, the guard rows and the padding
                between slots must be bitwise unchanged by the step
    live        slot -> request whose current state (after its last accepted token) it holds
    slots       slot -> K-first float64 state [HV, K, V]: the expected content after the step of
                every slot the trace has written so far (``expected(slot)``: in the cache layout)

The arithmetic is kda_ref's: preprocessing by ``kda_ref.chunked.prepare_tokens`` over blocks of
whole steps, prefill rows by the chunked form (``kda_ref.chunked.chunked``, C = 64), decode and
spec rows one token at a time by ``kda_ref.recurrence.token_step`` (the state after every draft
token is a checkpoint).  Incremental: each step costs its own tokens' work; the states carried
between steps are the ones some slot or request still holds, their arrays reused once nothing
does.  A yielded StepTruth is valid until the next one is taken (its ``o`` stays valid; its
``slots`` arrays may be reused): copy what must outlive the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .chunked import chunked, prepare_tokens
from .preprocess import Prepared
from .recurrence import token_step_host
from .trace import PREFILL, CacheSpec, StepPlan, Trace, iter_plan

F64 = torch.float64


@dataclass
class StepTruth:
    step: int
    o: torch.Tensor
    written: list
    live: dict
    slots: dict
    plan: StepPlan
    cache: CacheSpec

    @property
    def token_live(self) -> torch.Tensor:
        """[Tstep] bool: the tokens of the step's live rows (those ``o`` defines)."""
        live = torch.zeros(self.plan.tok1 - self.plan.tok0, dtype=torch.bool)
        for rp in self.plan.rows:
            live[rp.tok0 - self.plan.tok0: rp.tok0 - self.plan.tok0 + rp.T] = True
        return live

    def expected(self, slot: int) -> torch.Tensor:
        """The expected content of ``slot`` after this step in the cache's layout (float64, a view)."""
        return self.cache.to_layout(self.slots[slot])


def trace_oracle(tr: Trace, chunk_size: int = 64, block_tokens: int = 256,
                 plans: Optional[list] = None, threads: Optional[int] = 1) -> Iterator[StepTruth]:
    """Yield the StepTruth of every step of ``tr`` in order (module docstring).  ``plans``: the
    trace's StepPlans when already computed (``kda_ref.trace.plan``; default ``iter_plan``,
    which checks the trace's consistency as it goes).  ``block_tokens``: the token inputs are
    preprocessed in blocks of whole steps of about this many tokens (256: at H = 8, K = 128 a
    block's float64 arrays are 2 MB each and stay in cache; 4096-token blocks made a decode
    step 1.2-2.1x slower).
    ``threads``: the CPU threads torch uses while a step is computed (restored before each
    yield; None leaves torch's setting): a step's arrays are small (a state of H = 8,
    K = V = 128 is 1 MB), and on a shared 2-core machine two threads contending for the cores
    made the steps of the test traces 5-50x slower than one."""
    steps = _trace_steps(tr, chunk_size, block_tokens, iter_plan(tr) if plans is None else plans)
    while True:
        prev = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            st = next(steps, None)
        finally:
            torch.set_num_threads(prev)
        if st is None:
            return
        yield st


def _trace_steps(tr: Trace, chunk_size: int, block_tokens: int, plans) -> Iterator[StepTruth]:
    p = tr.problem_view()
    HV, K, V = tr.HV, tr.K, tr.V
    states: dict = {}          # state id -> [HV, K, V] float64
    refs: dict = {}            # state id -> slots holding it + 1 if it is a request's current state
    slot_id: dict = {}
    cur: dict = {}
    pool: list = []

    def new_array():
        return pool.pop() if pool else torch.empty(HV, K, V, dtype=F64)

    def incref(i):
        refs[i] = refs.get(i, 0) + 1

    def decref(i):
        if i is None:
            return
        refs[i] -= 1
        if refs[i] == 0:
            del refs[i]
            arr = states.pop(i, None)          # None: its array became a newer state in place
            if arr is not None:
                pool.append(arr)

    b0 = b1 = 0
    pp = tok = None
    d = torch.empty(HV, 1, V, dtype=F64)           # token_step_host's scratch
    d_np = d.numpy()
    for sp in plans:
        if sp.tok1 > b1:                           # a new block of inputs from this step on
            b0, b1 = sp.tok0, min(tr.tokens, max(sp.tok1, sp.tok0 + block_tokens))
            pp = prepare_tokens(p, b0, b1, None)
            tok = _token_major(pp)
        o = torch.full((sp.tok1 - sp.tok0, HV, V), float("nan"), dtype=F64)
        o_np = o.numpy()
        made = []                                  # (state id, array) created by this step
        for rp in sp.rows:
            t0, T = rp.tok0 - b0, rp.T
            ot = rp.tok0 - sp.tok0
            S = states[rp.read_id] if rp.read_id is not None else None
            if rp.phase == PREFILL:
                S0 = S[None] if S is not None else torch.zeros(1, HV, K, V, dtype=F64)
                sub = Prepared(q=pp.q[t0:t0 + T], k=pp.k[t0:t0 + T], v=pp.v[t0:t0 + T], a=pp.a[t0:t0 + T],
                               beta=pp.beta[t0:t0 + T], scale=pp.scale, bounds=[(0, T)], S0=S0)
                o_r, final, _ = chunked(sub, chunk_size)
                o[ot:ot + T] = o_r
                made.append((rp.new_ids[0], final[0]))
                continue
            # decode / spec: token by token; the read state is updated in place when nothing else
            # holds it after this row (the request's current state moves, the slots it sits in are
            # all rewritten by this row)
            if S is None:
                S = torch.zeros(HV, K, V, dtype=F64)
                spare = True
            else:
                rewritten = sum(1 for _, slot in rp.writes if slot_id.get(slot) == rp.read_id)
                spare = refs[rp.read_id] - 1 - rewritten == 0
            ids = dict((t, sid) for (t, _), sid in zip(rp.writes, rp.new_ids))
            for t in range(T):
                if spare:
                    out = S
                    if rp.read_id is not None and S is states.get(rp.read_id):
                        del states[rp.read_id]
                else:
                    out = new_array()
                i = t0 + t
                token_step_host(S, tok.q[i], tok.k[i], tok.kcol[i], tok.v[i], tok.decay[i], tok.beta[i], pp.scale,
                                out, out.numpy(), o_np[ot + t], d, d_np)
                S = out
                spare = t not in ids             # a checkpoint is kept: the next token needs a new array
                if t in ids:
                    made.append((ids[t], S))
        # the step's writes, then the requests' current states (what the plan decided)
        for sid, arr in made:
            states[sid] = arr
        for rp in sp.rows:
            for (_, slot), sid in zip(rp.writes, rp.new_ids):
                incref(sid)
                decref(slot_id.get(slot))
                slot_id[slot] = sid
            incref(rp.keep)
            decref(cur.get(rp.request))
            cur[rp.request] = rp.keep
        for r in sp.finished:
            decref(cur.pop(r))
        yield StepTruth(step=sp.step, o=o, written=sp.written, live=sp.live,
                        slots={slot: states[sid] for slot, sid in slot_id.items()}, plan=sp, cache=tr.cache)


@dataclass
class _TokenMajor:
    """A block's decode inputs, token-major and contiguous, in the shapes token_step_host takes:
    q, k [n, HV, 1, K] numpy; kcol [n, HV, K, 1] torch (a list of the n tokens' views, made in
    one call); v [n, HV, 1, V] numpy; decay = exp(a) [n, HV, K, 1] torch (a list, likewise); beta
    [n, HV, 1, 1] numpy (views of one copy of the block's arrays)."""
    q: object
    k: object
    kcol: tuple
    v: object
    decay: tuple
    beta: object


def _token_major(pp: Prepared) -> _TokenMajor:
    k = pp.k.contiguous()
    return _TokenMajor(q=pp.q.contiguous().numpy()[:, :, None, :], k=k.numpy()[:, :, None, :],
                       kcol=k[..., None].unbind(0), v=pp.v.contiguous().numpy()[:, :, None, :],
                       decay=torch.exp(pp.a).contiguous()[..., None].unbind(0),
                       beta=pp.beta.contiguous().numpy()[..., None, None])


def request_streams(tr: Trace, plans: Optional[list] = None) -> dict:
    """request -> packed token indices of its accepted stream, in order (what the request's
    whole-sequence oracle runs over)."""
    plans = iter_plan(tr) if plans is None else plans
    out: dict = {}
    for sp in plans:
        for rp in sp.rows:
            out.setdefault(rp.request, []).extend(range(rp.tok0, rp.tok0 + rp.accepted))
    return out
