"""The per-pass debugger: run one pass of a kernel on oracle-fed inputs and find where
its error enters.

For a FlashKDA-style backend (ours; aiter's launchers where exposed) the passes and what
flows between them are

    K1  problem inputs            -> ws_kd ws_qd ws_kr ws_gt ws_inv ws_mqk ws_beta (+ ws_L: ours)
    A   ws_*                      -> A_seg b_seg             (segmented routes)
    B   A_seg b_seg (+ the initial state)  -> h_in          (segmented routes)
    C   ws_* (+ h_in, or the initial state) -> o final_state

Each pass is fed the oracle's float64 upstream intermediates (the backend rounds them to
its workspace dtypes), so the error it shows is that pass's own.  Every output row is
compared with the oracle's row: the row error is ``||x_row - ref_row|| /
max(||ref_row||, rms row norm of the tensor, 2^-100)``: relative for rows of typical size or larger,
and measured against the typical row for small ones (a row whose entries cancel, like the
decayed dot product of two nearly orthogonal keys, carries the rounding error of its
factors, not of its own size; a real bug moves rows by O(1) of the typical row norm), and the first row (in order of sequence, chunk or segment, row, head)
whose error exceeds the tensor's threshold is named.  The thresholds localise; they are
not the verdict (tolerances.yaml is).  When the backend hands its inverse to the verdict
(a ``kda_kernels.base.ReturnsTaps`` backend with taps on: `mutate --taps yes`,
`debug --taps`), one tensor is also held to the verdict's own rule: K1's ws_inv, which
pass K1 computes from the problem's inputs exactly as a full run does (``inverse_rule``),
so a storage slip that moves every row a little is named at K1 too.  Without taps the
verdict never judges the inverse, and neither does this.

A backend takes part by providing ``debug_plan(problem, route) -> {"chunk_size": C,
"chunks_per_seg": None | int, "passes": [...]}`` and ``run_pass(problem, route, name,
feed) -> {tensor: value}``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from kda_kernels.base import ReturnsTaps, RunsPasses
from kda_kernels.emulator import RECIPES
from kda_ref.fla_form import fla_form
from kda_ref.preprocess import prepare
from kda_ref.problem import Problem, validate
from kda_ref.segments import pass_a, pass_b, pass_c, segment_plan
from kda_ref.tiles import tile_grid
from kda_ref.workspace import workspace_prepared
from verification.errors import KernelFailure
from verification.judging.baselines import emulate_taps, tap_metrics
from verification.judging.metrics import dtype_name
from verification.judging.tolerances import load_tolerances
from verification.judging.verdict import judge_tensor

F64 = torch.float64

# ---- the FlashKDA form (ours, aiter, Moonshot) ----
PASS_INPUTS = {
    "K1": (),
    "A": ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk", "ws_beta"),
    "B": ("A_seg", "b_seg"),
    "C": ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk", "ws_beta", "h_in"),
}
PASS_OUTPUTS = {
    "K1": ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_L", "ws_inv", "ws_mqk", "ws_beta"),   # ws_L: ours only
    "A": ("A_seg", "b_seg"),
    "B": ("h_in",),
    "C": ("o", "final_state"),
}
# No row is measured against less than 2^-100: every intermediate multiplies states, values or
# decays of magnitude below 2^70 on the way to the outputs, so a row error below 2^-100 cannot reach
# a bf16 or fp32 output.  Fully decayed segments (A_seg ~ 1e-37 at lb -5 over 64 tokens) and decays
# below fp32's range (2^-254 at lb -5.5, 0 in any fp32 buffer) live there and are no error worth a name.
ABS_FLOOR = 2.0 ** -100
# Row-error thresholds and why (relative L2 of one row against the oracle's row).
THRESHOLDS = {
    "ws_kd": (1e-2, "bf16 store: rounding alone gives ~1e-3 per row"),
    "ws_qd": (1e-2, "bf16 store: rounding alone gives ~1e-3 per row"),
    "ws_kr": (1e-2, "bf16 store: rounding alone gives ~1e-3 per row"),
    "ws_gt": (1e-4, "fp32 exp2 of an fp32 cumsum over <= 32 rows"),
    "ws_beta": (1e-5, "fp32 sigmoid"),
    "ws_L": (3e-2, "fp32 store of a bf16-factor dot product times beta (our K1's L; max row 4e-3..6e-3 on smoke, stress)"),
    "ws_inv": (3e-2, "fp16 store of an fp32 construction from bf16-rounded factors, times the conditioning"),
    "ws_mqk": (3e-2, "fp16 store of a bf16-factor dot product"),
    "A_seg": (5e-2, "bf16 store of a product of up to 64 chunk maps with bf16 dot operands"),
    "b_seg": (5e-2, "fp32 store, bf16 dot operands over up to 64 chunks"),
    "h_in": (5e-2, "bf16 dot operands in the scan"),
    "o": (5e-2, "bf16 output of bf16-operand dots against an fp32 state"),
    "final_state": (5e-2, "fp32 state with bf16 dot operands"),
    # fla form (bf16 inputs: every intermediate but g_cumsum is stored in bf16)
    "g_cumsum": (1e-4, "fp32 cumsum of the fp32 gate, times fla's fp32 1/ln2"),
    "Aqk": (3e-2, "bf16 store of tf32/bf16 dots, decayed"),
    "Akk": (3e-2, "bf16 store of the (I+L)^-1 blocks built with tf32 merges"),
    "w": (3e-2, "bf16 store; operands rounded to bf16 before the dot"),
    "u": (3e-2, "bf16 store; operands rounded to bf16 before the dot"),
    "kg": (1e-2, "bf16 store of k * exp2(g_last - g)"),
    "v_new": (5e-2, "bf16 store of u - w S with a bf16 state operand"),
    "h": (5e-2, "bf16 store of the fp32 state at each chunk start"),
}

# ---- the fla form (flash-linear-attention chunk_kda) ----
FLA_PASS_INPUTS = {
    "gate": (),
    "intra": ("g_cumsum",),
    "h": ("kg", "w", "u", "g_cumsum"),
    "o": ("v_new", "g_cumsum", "Aqk", "h"),
}
FLA_PASS_OUTPUTS = {
    "gate": ("g_cumsum",),
    "intra": ("Aqk", "Akk", "w", "u", "kg"),
    "h": ("h", "v_new", "final_state"),
    "o": ("o",),
}


@dataclass
class TensorReport:
    name: str
    rel_l2: float
    max_row_err: float
    threshold: float
    rows: int
    rows_over: int
    first_over: Optional[dict]   # {"seq":, "head":, "chunk"/"segment":, "row":, "err":}
    rule_failed: str = ""        # the verdict's own rule for this tensor, when it fails it (K1's ws_inv)

    @property
    def ok(self) -> bool:
        return self.rows_over == 0 and math.isfinite(self.rel_l2) and not self.rule_failed


@dataclass
class PassReport:
    name: str
    tensors: list = field(default_factory=list)
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors)


def oracle_intermediates(p: Problem, chunk_size: int, chunks_per_seg: Optional[int]) -> dict:
    """Every FlashKDA intermediate of a Problem in float64, in the kernel's layouts, plus the
    bookkeeping the locator needs (tile grid, segment plan)."""
    pp = prepare(validate(p))
    ws = workspace_prepared(pp, chunk_size, inverse="exact")
    plan = segment_plan(pp.bounds, chunk_size, chunks_per_seg, device=pp.q.device)
    A_seg, b_seg = pass_a(ws, plan, p.K, p.V)
    h_in, _ = pass_b(plan, A_seg, b_seg, pp.S0)
    o, final = pass_c(pp, ws, plan, h_in)
    out = dict(ws.tensors(), ws_L=ws.ws_L)
    out.update(A_seg=A_seg, b_seg=b_seg, h_in=h_in, o=o.reshape(p.B, p.T, p.HV, p.V), final_state=final)
    return {"tensors": out, "grid": ws.grid, "plan": plan, "HV": p.HV}


def fla_oracle_intermediates(p: Problem, chunk_size: int) -> dict:
    """Every fla-form intermediate of a Problem in float64, in fla's layouts."""
    pp = prepare(validate(p))
    ff = fla_form(pp, chunk_size)
    out = ff.tensors(p.B, p.T)
    out.update(o=ff.o.reshape(p.B, p.T, p.HV, p.V), final_state=ff.final_state)
    grid = tile_grid(pp.bounds, chunk_size, pp.q.shape[0], device=pp.q.device)
    return {"tensors": out, "grid": grid, "plan": None, "HV": p.HV}


FORMS = {
    "flashkda": (PASS_INPUTS, PASS_OUTPUTS),
    "fla": (FLA_PASS_INPUTS, FLA_PASS_OUTPUTS),
}


# A segment map A_seg acts on a state: S_out = A_seg S_in + b_seg, and the map of a segment without
# decay is the identity (row norm 1).  A row is measured against no less than 2^-8 of that scale
# (bf16's resolution of the identity), so a fully decayed map (A_seg ~ 1e-36 at lb -5), whose
# rounding cannot reach S_out, is no error worth a name, while a partly decayed one (rows ~ 0.04 at
# lb -0.1 over 64 tokens) is still measured on its own scale.
ROW_SCALE = {"A_seg": 2.0 ** -8}


def _row_errors(x: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> torch.Tensor:
    """Row errors over the last dim: ||x-ref|| / max(||ref||, rms(||ref||), scale)."""
    x, ref = x.to(F64), ref.to(F64)
    d = torch.linalg.vector_norm(x - ref, dim=-1)
    r = torch.linalg.vector_norm(ref, dim=-1)
    typical = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0
    err = d / torch.clamp(r, min=max(typical, scale, ABS_FLOOR))
    return torch.where(torch.isfinite(x).all(-1), err, torch.full_like(err, math.inf))


def _locate(name: str, err: torch.Tensor, over: torch.Tensor, ctx: dict) -> Optional[dict]:
    """The first row over threshold, in (sequence, chunk|segment, row, head) order."""
    idx = over.nonzero()
    if not len(idx):
        return None
    grid, plan, HV = ctx["grid"], ctx["plan"], ctx["HV"]
    rows = []
    for i in idx.tolist():
        e = float(err[tuple(i)])
        if name.startswith("ws_"):
            wsi, row = i[0], (i[1] if len(i) > 1 else 0)
            head, tile = divmod(wsi, grid.tiles)
            seq = int(grid.tile_seq[tile])
            chunk = tile - int(grid.seq_tile_off[seq])
            rows.append(((seq, chunk, row, head), dict(seq=seq, head=head, chunk=chunk, row=row, err=e)))
        elif name in ("A_seg", "b_seg", "h_in"):
            s, head, row = i[0], i[1], i[2]
            seq = int(plan.seq[s])
            seg = s - int(plan.seq_seg_off[seq])
            rows.append(((seq, seg, row, head), dict(seq=seq, head=head, segment=seg, row=row, err=e)))
        elif name == "h":   # [B, NT, HV, K, V]: global chunk -> (sequence, chunk)
            tile, head, row = i[0] * (grid.tiles // max(1, ctx["B"])) + i[1], i[2], i[3]
            seq = int(grid.tile_seq[tile])
            chunk = tile - int(grid.seq_tile_off[seq])
            rows.append(((seq, chunk, row, head), dict(seq=seq, head=head, chunk=chunk, row=row, err=e)))
        elif name in ("o", "g_cumsum", "Aqk", "Akk", "w", "u", "kg", "v_new"):
            b, t, head = i[0], i[1], i[2]
            tok = b * ctx["T"] + t
            seq = int(torch.searchsorted(grid.seq_bos + grid.seq_len, torch.tensor(tok, device=grid.seq_bos.device),
                                         right=True))
            rel = tok - int(grid.seq_bos[seq])
            rows.append(((seq, rel // grid.C, rel % grid.C, head),
                         dict(seq=seq, head=head, chunk=rel // grid.C, row=rel % grid.C, err=e)))
        else:  # final_state [N, HV, K, V]
            seq, head, row = i[0], i[1], i[2]
            rows.append(((seq, 0, row, head), dict(seq=seq, head=head, row=row, err=e)))
        if len(rows) >= 4096:
            break
    return min(rows, key=lambda r: r[0])[1]


def _valid_rows(name: str, x: torch.Tensor, ref: torch.Tensor, ctx: dict):
    """Drop what the kernel contract leaves undefined: tail rows of ws tiles (and the tail
    columns of ws_inv, whose oracle tail block is the identity)."""
    if name in ("Aqk", "Akk"):   # only the lower triangle (incl. diagonal) of each chunk is defined
        grid = ctx["grid"]
        pos = torch.zeros(grid.Ttot + 1, dtype=torch.long, device=x.device)
        pos[grid.token_index.reshape(-1).to(x.device)] = torch.arange(grid.C, device=x.device).repeat(grid.tiles)
        rowpos = pos[:grid.Ttot].reshape(x.shape[0], x.shape[1])[:, :, None, None]
        m = torch.arange(x.shape[-1], device=x.device) <= rowpos
        return torch.where(m, x.to(F64), 0.0), torch.where(m, ref.to(F64), 0.0)
    if name.startswith("ws_") and name != "ws_gt":
        grid = ctx["grid"]
        lens = grid.tile_len.repeat(ctx["HV"]).to(x.device)                    # per ws_idx
        mask = torch.arange(grid.C, device=x.device)[None, :] < lens[:, None]   # [HV*tiles, C]
        if name == "ws_beta":
            return torch.where(mask, x.to(F64), 0.0)[..., None], torch.where(mask, ref.to(F64), 0.0)[..., None]
        m = mask[..., None]
        if name == "ws_inv":
            m = m & mask[:, None, :]
            # (I - L)^-1 = I + strictly lower part: rows are measured without the identity, whose 1
            # would hide an O(1) error of a small L (strong gates; found by `kda-verify mutate`)
            eye = torch.eye(x.shape[-1], dtype=F64, device=x.device)
            return torch.where(m, x.to(F64) - eye, 0.0), torch.where(m, ref.to(F64) - eye, 0.0)
        return torch.where(m, x.to(F64), 0.0), torch.where(m, ref.to(F64), 0.0)
    return x.to(F64), ref.to(F64)


def compare_tensor(name: str, x: torch.Tensor, ref: torch.Tensor, ctx: dict,
                   thresholds: Optional[dict] = None) -> TensorReport:
    ref = ref.to(x.device)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: kernel shape {list(x.shape)} differs from the oracle's {list(ref.shape)}")
    x, ref = _valid_rows(name, x, ref, ctx)
    thr = (thresholds or {}).get(name, THRESHOLDS.get(name, (5e-2, ""))[0])
    err = _row_errors(x, ref, ROW_SCALE.get(name, 0.0))
    over = ~(err <= thr)
    diff = (x - ref)
    rel = float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(ref)), ABS_FLOOR * math.sqrt(max(err.numel(), 1))))
    if not math.isfinite(rel) or not bool(torch.isfinite(x).all()):
        rel = math.inf
    return TensorReport(name=name, rel_l2=rel, max_row_err=float(err.max()) if err.numel() else 0.0,
                        threshold=thr, rows=int(err.numel()), rows_over=int(over.sum()),
                        first_over=_locate(name, err, over, ctx))


def inverse_rule(backend, p: Problem, route, ws_inv: torch.Tensor) -> str:
    """The verdict's rule for the stored inverse (tolerances.yaml's ws_inv entry: m times the
    route's recipe emulated on this problem, plus the floor, at most the cap) applied to the
    ws_inv that pass K1 returned: the reason when it fails, "" when it passes or when the route
    has no emulated recipe at this tile size.  K1 reads the problem's own inputs, so this is the
    number the verdict judges on the same case.  The row thresholds cannot see a uniform
    storage slip (bf16 where fp16 is due moves every row by ~4e-3, far below 3e-2), the
    verdict's tensor rule does."""
    recipe = RECIPES.get(getattr(route, "recipe", ""))
    if recipe is None or recipe.chunk != int(ws_inv.shape[-1]):
        return ""
    met = tap_metrics(p, {"ws_inv": ws_inv})["ws_inv"]
    base = tap_metrics(p, emulate_taps(p, route.recipe))["ws_inv"]
    tol = load_tolerances().lookup(backend.name, getattr(route, "name", str(route)), dtype_name(p.v.dtype), "ws_inv")
    status, reason, _ = judge_tensor("ws_inv", met, base, tol)
    return reason if status != "pass" else ""


def debug_passes(backend, p: Problem, route, passes=("all",), thresholds: Optional[dict] = None,
                 progress=None) -> list[PassReport]:
    """Run the chosen passes of ``route`` on oracle-fed inputs; one PassReport per pass.  A pass
    that raises is a verification.errors.KernelFailure naming it (exit 1, a kernel failure)."""

    if not isinstance(backend, RunsPasses):
        raise ValueError(f"--backend: {backend.name!r} exposes no passes (needs run_pass and debug_plan)")
    plan = backend.debug_plan(p, route)
    form = plan.get("form", "flashkda")
    pass_inputs, pass_outputs = FORMS[form]
    order = list(plan["passes"])
    want = order if "all" in passes else list(passes)
    bad = [x for x in want if x not in pass_outputs]
    if bad:
        raise ValueError(f"--pass: expected {'|'.join(pass_outputs)}|all, got {bad[0]!r}")
    if form == "fla":
        ref = fla_oracle_intermediates(p, plan["chunk_size"])
    else:
        ref = oracle_intermediates(p, plan["chunk_size"], plan["chunks_per_seg"])
    ctx = dict(ref, T=p.T, B=p.B)
    reports = []
    for name in want:
        if name not in order:
            reports.append(PassReport(name, skipped=f"route {route.name} has no pass {name} (unsegmented)"))
            continue
        feed = {k: ref["tensors"][k] for k in pass_inputs[name]
                if not (name == "C" and k == "h_in" and "A" not in order)}
        if progress:
            progress(f"pass {name}: running on oracle-fed inputs")
        try:
            out = backend.run_pass(p, route, name, feed)
        except Exception as e:  # noqa: BLE001 - the kernel raising is its failure, not the harness's
            raise KernelFailure.of(e, f"{backend.name} {route.name} pass {name}") from e
        rep = PassReport(name)
        for t in pass_outputs[name]:
            if t in out:
                x = out[t]
                r = ref["tensors"][t]
                if t == "o":
                    x = x.reshape(r.shape)
                rep.tensors.append(compare_tensor(t, x, r, ctx, thresholds))
                if form == "flashkda" and name == "K1" and t == "ws_inv" and isinstance(backend, ReturnsTaps) and backend.taps:
                    rep.tensors[-1].rule_failed = inverse_rule(backend, p, route, x)
        reports.append(rep)
    return reports


def _loc(d: Optional[dict]) -> str:
    if not d:
        return "-"
    keys = [k for k in ("seq", "head", "chunk", "segment", "row") if k in d]
    return ", ".join(f"{k} {d[k]}" for k in keys) + f" (err {d['err']:.2e})"


def format_reports(reports: list, header: str = "") -> str:
    lines = [header] if header else []
    for rep in reports:
        if rep.skipped:
            lines.append(f"pass {rep.name}: skipped: {rep.skipped}")
            continue
        lines.append(f"pass {rep.name}: {'ok' if rep.ok else 'ERROR ENTERS HERE'}")
        lines.append(f"  {'tensor':<12} {'rel_l2':>9} {'max_row':>9} {'thresh':>8} {'rows>thr':>10}  first row over threshold")
        for t in rep.tensors:
            lines.append(f"  {t.name:<12} {t.rel_l2:>9.2e} {t.max_row_err:>9.2e} {t.threshold:>8.0e} "
                         f"{t.rows_over:>5}/{t.rows:<5} {_loc(t.first_over)}")
        for t in rep.tensors:
            if t.rule_failed:
                lines.append(f"  {t.name}: every row within its threshold, but the verdict's rule fails: {t.rule_failed}"
                             if t.rows_over == 0 else f"  {t.name}: the verdict's rule fails too: {t.rule_failed}")
    entered = [r.name for r in reports if not r.skipped and not r.ok]
    lines.append("verdict: every pass within its row thresholds" if not entered
                 else f"verdict: the error first exceeds a threshold in pass {entered[0]}")
    return "\n".join(lines)


def reports_to_json(reports: list) -> list:
    return [dict(name=r.name, ok=r.ok, skipped=r.skipped,
                 tensors=[dict(t.__dict__, ok=t.ok) for t in r.tensors]) for r in reports]
