"""The oracle verifies itself: its forms against each other, against NumPy and mpmath, and
its inverses by LAPACK's residual ratio.

Checks (each over a set of seeded problems; agreement is ||x - y|| / max(||y||, tiny)
against the token recurrence, the definition, taken over o and the final state):

    chunked C=16|32|64          the workspace + chunk steps, one segment per sequence
    streamed C=16|32|64         the chunked form block by block (truth()'s default), blocks of
                                1 and 3 chunks carrying the state between them
    segmented C=16 cps=1|2|3|7  passes A, B, C (and cps=2 at C=64)
    fla BT=32|64                fla's chunked form, pairwise exponents
    numpy chunked / recurrence  the plain NumPy path against the torch path
    mpmath (40 digits)          the whole forward in mpmath against the float64 oracle
    finite                      no inf/NaN in chunked/streamed/segmented/fla where the recurrence is finite
    paged write-back            slots not written stay bit-identical
    inverse residual ratios     DTRT01 ratio of the exact solve and of the production
                                construction in float64 (eps 2^-53) and float32 (eps 2^-24)

Problems cover varlen with partial chunks and empty sequences, weak gates (lb -0.01),
saturated gates (lb -5.5 with large raw g), softplus gates with raw g from -1000 to +40,
correlated keys (rho 0.9 and 1.0) with beta near 1, nonzero initial states (kv, vk, paged),
GVA, sigmoid2 beta, pre-gated decays and unnormalised q/k.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from kda_ref import numpy_ref
from kda_ref.chunked import chunked_from_workspace, streamed
from kda_ref.fla_form import fla_form
from kda_ref.preprocess import prepare
from kda_ref.problem import Problem
from kda_ref.recurrence import recurrence_prepared
from kda_ref.segments import segmented
from kda_ref.truth import truth
from kda_ref.workspace import inverse_report, workspace_prepared

F64 = torch.float64
AGREE_TOL = 1e-12
MP_TOL = 1e-13
NUMPY_TOL = 1e-13
RATIO_TOL = 30.0
TINY = 1e-300


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / max(||y||, tiny) in float64 (NaN if x holds non-finite values)."""
    x, y = x.to(F64).cpu(), y.to(F64).cpu()
    return float((x - y).norm() / max(float(y.norm()), TINY))


# ----------------------------------------------------------------------------- problems
@dataclass
class Recipe:
    name: str
    lens: tuple
    H: int = 2
    HV: int = 0            # 0: = H
    K: int = 16
    V: int = 16
    gate: str = "lower_bound"
    lb: float = -5.0
    g_mode: str = "normal"  # normal | saturate | softplus_wide | softplus_mixed | pregated
    beta_raw: float = None
    beta_kind: str = "sigmoid"
    rho: float = 0.0
    state: str = "kv"       # none | kv | vk | paged
    state_scale: float = 1.0
    l2norm: bool = True
    dense_B: int = 0        # > 0: dense [B, T] with T = lens[0]
    extra: dict = field(default_factory=dict)


RECIPES = (
    Recipe("dense", lens=(70,), dense_B=2),
    Recipe("varlen-partial-empty", lens=(0, 17, 33, 0, 64, 5, 0)),
    Recipe("weak-gate", lens=(100, 31), lb=-0.01),
    Recipe("saturated-lb-5.5", lens=(130,), lb=-5.5, g_mode="saturate"),
    Recipe("softplus-wide", lens=(70, 45), gate="softplus", lb=None, g_mode="softplus_wide"),
    Recipe("softplus-mixed", lens=(90,), gate="softplus", lb=None, g_mode="softplus_mixed"),
    Recipe("corr-0.9-beta-1", lens=(96, 40), lb=-0.01, rho=0.9, beta_raw=4.0),
    Recipe("corr-1.0-beta-1", lens=(96, 40), lb=-0.01, rho=1.0, beta_raw=4.0),
    Recipe("paged", lens=(20, 0, 50, 33), state="paged"),
    Recipe("vk-state", lens=(77,), state="vk"),
    Recipe("gva", lens=(40, 60), H=1, HV=4, V=32),
    Recipe("sigmoid2-pregated", lens=(65, 12), gate="pregated", lb=None, g_mode="pregated", beta_kind="sigmoid2"),
    Recipe("large-state-K32", lens=(81,), K=32, state_scale=100.0),
    Recipe("no-l2norm", lens=(66,), l2norm=False, extra={"qk_scale": 0.2}),
)


def build(recipe: Recipe, seed: int) -> Problem:
    """A deterministic Problem from a recipe and a seed (float64 inputs on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)            # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=F64)             # noqa: E731
    H, K, V = recipe.H, recipe.K, recipe.V
    HV = recipe.HV or H
    if recipe.dense_B:
        B, T, N, cu = recipe.dense_B, recipe.lens[0], recipe.dense_B, None
    else:
        B, T, N = 1, sum(recipe.lens), len(recipe.lens)
        cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(recipe.lens), 0).tolist()), dtype=torch.int64)
    qs = recipe.extra.get("qk_scale", 1.0)
    q, k, v = qs * r(B, T, H, K), qs * r(B, T, H, K), r(B, T, HV, V)
    if recipe.rho:
        k = recipe.rho * k[:, :1] + (1 - recipe.rho) * k
    if recipe.g_mode == "saturate":
        graw = 30.0 * r(B, T, HV, K) + 20.0
    elif recipe.g_mode == "softplus_wide":
        graw = -1000.0 + 1040.0 * u(B, T, HV, K)
    elif recipe.g_mode == "softplus_mixed":
        pick = u(B, T, HV, K)
        graw = torch.where(pick < 0.3, torch.full_like(pick, -1000.0),
                           torch.where(pick < 0.4, torch.full_like(pick, 40.0), r(B, T, HV, K)))
    elif recipe.g_mode == "pregated":
        graw = -torch.nn.functional.softplus(r(B, T, HV, K))
    else:
        graw = r(B, T, HV, K)
    beta = torch.full((B, T, HV), recipe.beta_raw, dtype=F64) if recipe.beta_raw is not None else r(B, T, HV)
    kw = dict(q=q, k=k, v=v, g=graw, beta=beta, gate=recipe.gate, lower_bound=recipe.lb,
              beta_kind=recipe.beta_kind, qk_l2norm=recipe.l2norm, cu_seqlens=cu)
    if recipe.gate != "pregated":
        kw.update(A_log=torch.log(1 + 3 * u(HV)), dt_bias=0.5 * r(HV * K))
    ss = recipe.state_scale
    if recipe.state == "kv":
        kw.update(initial_state=ss * r(N, HV, K, V))
    elif recipe.state == "vk":
        kw.update(initial_state=ss * r(N, HV, V, K), state_layout="vk")
    elif recipe.state == "paged":
        slots = N + 3
        cache = ss * r(slots, HV, V, K)
        idx = torch.randperm(slots, generator=g)[:N].to(torch.int32)
        has = torch.arange(N) % 2 == 0
        cache[idx.long()[~has]] = float("nan")       # never read: has_initial_state is False
        kw.update(state_layout="paged", state_cache=cache, state_indices=idx, has_initial_state=has)
    return Problem(**kw, meta={"recipe": recipe.name, "seed": seed})


def selfcheck_problems(quick: bool = False) -> list:
    """(name, Problem) pairs: every recipe with 4 seeds (1 with quick)."""
    seeds = (0,) if quick else (0, 1, 2, 3)
    return [(f"{rc.name}/s{s}", build(rc, 1000 * i + s)) for i, rc in enumerate(RECIPES) for s in seeds]


def mp_problems(quick: bool = False) -> list:
    """Small problems for the mpmath check (K = V = 4, a few tokens)."""
    small = (
        Recipe("mp-varlen", lens=(0, 9, 3), H=1, HV=2, K=4, V=4),
        Recipe("mp-saturated", lens=(11,), H=1, K=4, V=4, lb=-5.5, g_mode="saturate"),
        Recipe("mp-softplus", lens=(8, 5), H=1, K=4, V=4, gate="softplus", lb=None, g_mode="softplus_mixed"),
        Recipe("mp-corr-1.0", lens=(12,), H=1, K=4, V=4, lb=-0.01, rho=1.0, beta_raw=4.0, state="vk"),
        Recipe("mp-paged", lens=(6, 7), H=1, K=4, V=4, state="paged"),
    )
    seeds = (0,) if quick else (0, 1)
    return [(f"{rc.name}/s{s}", build(rc, 77 + 31 * i + s)) for i, rc in enumerate(small) for s in seeds]


# ----------------------------------------------------------------------------- checks
@dataclass
class Row:
    check: str
    threshold: float
    problems: int = 0
    worst: float = 0.0
    worst_at: str = ""

    def add(self, value: float, where: str):
        """Record one problem's value; the worst is the largest, and a NaN is worse than any number."""
        self.problems += 1
        worse = math.isnan(value) and not math.isnan(self.worst)
        if self.problems == 1 or worse or (not math.isnan(self.worst) and value > self.worst):
            self.worst, self.worst_at = value, where

    @property
    def passed(self) -> bool:
        return self.problems > 0 and math.isfinite(self.worst) and self.worst <= self.threshold

    def as_dict(self) -> dict:
        return {"check": self.check, "problems": self.problems, "worst": self.worst, "threshold": self.threshold,
                "worst_at": self.worst_at, "passed": self.passed}


def _nonfinite(*xs) -> int:
    return int(sum(int((~torch.isfinite(x)).sum()) for x in xs))


def run_selfcheck(quick: bool = False, device: str = "cpu", progress=None) -> list:
    """Run every check; returns the rows (see ``Row``)."""

    rows: dict = {}

    def row(name, thr):
        if name not in rows:
            rows[name] = Row(name, thr)
        return rows[name]

    seg_cps = {16: (1, 2, 3, 7), 32: (), 64: (2,)}
    for name, p in selfcheck_problems(quick):
        if progress:
            progress(name)
        p = p.to(device)
        pp = prepare(p)
        ref = recurrence_prepared(pp)
        ref_finite = _nonfinite(ref.o, ref.final_state) == 0
        nonfinite = 0
        for C in (16, 32, 64):
            ws = workspace_prepared(pp, C)
            o, fs = chunked_from_workspace(pp, ws)
            nonfinite += _nonfinite(o, fs, ws.ws_inv, ws.ws_mqk)
            row(f"chunked C={C} vs recurrence", AGREE_TOL).add(max(rel(o, ref.o), rel(fs, ref.final_state)), name)
            worst = 0.0
            for blk in (C, 3 * C):
                so, sfs = streamed(p, C, block_tokens=blk)
                nonfinite += _nonfinite(so, sfs)
                worst = max(worst, rel(so, ref.o), rel(sfs, ref.final_state))
            row(f"streamed C={C} (blocks of 1 and 3 chunks) vs recurrence", AGREE_TOL).add(worst, name)
            for cps in (None,) + seg_cps[C]:
                if cps is None and C != 16:
                    continue
                s = segmented(pp, ws, cps)
                nonfinite += _nonfinite(s.o, s.final_state, s.A_seg, s.b_seg, s.h_in)
                label = "unsegmented (one segment per sequence)" if cps is None else f"cps={cps}"
                row(f"segmented C={C} {label} vs recurrence", AGREE_TOL).add(
                    max(rel(s.o, ref.o), rel(s.final_state, ref.final_state)), name)
            rep = inverse_report(ws)
            row(f"inverse residual ratio, exact solve (C={C}, eps 2^-53)", RATIO_TOL).add(
                float(rep["ratio_exact"].max()) if rep["ratio_exact"].numel() else 0.0, name)
            row(f"inverse residual ratio, production fp64 (C={C}, eps 2^-53)", RATIO_TOL).add(
                float(rep["ratio_prod64"].max()) if rep["ratio_prod64"].numel() else 0.0, name)
            row(f"inverse residual ratio, production fp32 (C={C}, eps 2^-24)", RATIO_TOL).add(
                float(rep["ratio_prod32"].max()) if rep["ratio_prod32"].numel() else 0.0, name)
        for BT in (32, 64):
            f = fla_form(pp, BT)
            nonfinite += _nonfinite(f.o, f.final_state)
            row(f"fla form BT={BT} vs recurrence", AGREE_TOL).add(
                max(rel(f.o, ref.o), rel(f.final_state, ref.final_state)), name)
        if ref_finite:
            row("non-finite entries in chunked/streamed/segmented/fla (recurrence finite)", 0).add(float(nonfinite), name)
        if p.paged:
            t = truth(p)
            untouched = torch.ones(p.state_cache.shape[0], dtype=torch.bool)
            untouched[p.state_indices.long().cpu()] = False
            a, b = t.state_cache[untouched.to(t.state_cache.device)], p.state_cache[untouched.to(p.device)].to(F64)
            changed = int((~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum())
            row("paged write-back: entries changed in unwritten slots", 0).add(float(changed), name)
    # the NumPy path on a few problems (it loops in Python)
    for name, p in selfcheck_problems(True)[:6 if quick else 14]:
        pp = prepare(p)
        npp = numpy_ref.prepare(p)
        o_np, f_np = numpy_ref.recurrence(npp)
        ref = recurrence_prepared(pp)
        row("numpy recurrence vs torch recurrence", NUMPY_TOL).add(
            max(rel(ref.o, torch.from_numpy(o_np)), rel(ref.final_state, torch.from_numpy(f_np))), name)
        o_c, f_c = numpy_ref.chunked(npp, 32)
        ws = workspace_prepared(pp, 32)
        o, fs = chunked_from_workspace(pp, ws)
        row("numpy chunked C=32 vs torch chunked C=32", NUMPY_TOL).add(
            max(rel(o, torch.from_numpy(o_c)), rel(fs, torch.from_numpy(f_c))), name)
    # lazy: optional dependency (mpmath, through kda_ref.mp_ref; docs/design.md, Imports)
    from kda_ref.mp_ref import mp_recurrence
    for name, p in mp_problems(quick):
        if progress:
            progress(name)
        o_mp, f_mp = mp_recurrence(p, dps=40)
        pp = prepare(p)
        ref = recurrence_prepared(pp)
        row("float64 recurrence vs mpmath (40 digits)", MP_TOL).add(
            max(rel(ref.o.reshape(o_mp.shape), o_mp), rel(ref.final_state, f_mp)), name)
        o, fs = chunked_from_workspace(pp, workspace_prepared(pp, 16))
        row("float64 chunked C=16 vs mpmath (40 digits)", MP_TOL).add(
            max(rel(o.reshape(o_mp.shape), o_mp), rel(fs, f_mp)), name)
    return list(rows.values())


def format_table(rows: list) -> str:
    w = max(len(r.check) for r in rows) if rows else 10
    lines = [f"{'check':<{w}}  {'problems':>8}  {'worst':>10}  {'threshold':>9}  result  worst at",
             "-" * (w + 60)]
    for r in rows:
        lines.append(f"{r.check:<{w}}  {r.problems:>8}  {r.worst:>10.3g}  {r.threshold:>9.3g}  "
                     f"{'PASS' if r.passed else 'FAIL':<6}  {r.worst_at}")
    return "\n".join(lines)


def selfcheck_report(quick: bool = False, device: str = "cpu") -> dict:
    """Run the checks and summarise.  The problems are tiny, so CPU work runs on one thread
    (several threads only contend for the cores); the thread count is restored afterwards."""
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = run_selfcheck(quick=quick, device=device)
    finally:
        torch.set_num_threads(threads)
    return {"passed": all(r.passed for r in rows), "seconds": time.perf_counter() - t0,
            "quick": quick, "device": device, "rows": [r.as_dict() for r in rows], "_rows": rows}
