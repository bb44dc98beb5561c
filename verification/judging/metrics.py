"""Metrics of one output tensor against the float64 oracle (docs/design.md, Metrics).

For an output x and its float64 reference r (both upcast to float64; d = x - r):

    rel_l2       ||d||_2 / ||r||_2                      (0 if both are 0, inf if only r is 0)
    max_abs      max |d|
    tail_rel_l2  rel_l2 over the last half of every sequence (o only; where a bad carry shows);
                 for a state tensor it equals rel_l2
    chunk_rel_l2 [rel_l2 over the rows of chunk c of every sequence, c = 0, 1, ...] (o only)
    max_ulp      max distance in units in the last place of ``dtype`` between x and r rounded
                 to ``dtype`` (inf if x holds a NaN)
    nan_frac, inf_frac, zero_frac   fractions of x that are NaN, +-Inf, exactly 0
    mistrusted   more than ZERO_TRUST (30%) of x is exactly 0 where r is not negligible
                 (|r| > 2^-24 max|r|, below which any kernel may flush): a mostly-zero output
                 on non-degenerate input is never a pass
    slices       the squared error and squared reference of every slice (``slice_sums``):
                 o per (sequence, head) and per (sequence, SLICE_ROWS-token block); a state per
                 (sequence, head), the paged cache per (written slot, head).  A pooled figure
                 hides a bug that ruins one short sequence, one head or one slot of a batch;
                 the verdict judges each slice against the same slice of the baseline.

Streamed: every metric is accumulated over blocks of rows (o: tokens; a state: sequences) sized by
``kda_ref.budget.block_budget``, each block cast to float64 alone, so judging a long output holds no
float64 copy of it (H200, o (1,1048576,12,128): the whole-tensor form rose 106.5 GiB above its
inputs, the blockwise one 1.4 GiB).

The paged ``state_cache`` is compared on the slots the problem writes (``state_indices``);
every other slot must stay bit-identical to the reference (NaN equal to NaN), counted in
``untouched_changed``.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from kda_ref import budget as kda_budget

F64 = torch.float64
ZERO_TRUST = 0.30      # oneDNN benchdnn's zero_trust_percent: more zeros than this is suspicious
NEGLIGIBLE = 2.0 ** -24  # |ref| below this times max|ref|: a value any kernel may flush to zero
SLICE_ROWS = 16        # tokens per (sequence, block) slice of o
START_ROWS = 4         # the first tokens of each sequence, a slice of their own: a state carried
                       # into a sequence at lb -5 decays within a few tokens, which a 16-token
                       # block would dilute four times
METRIC_KEYS = ("rel_l2", "max_abs", "tail_rel_l2", "chunk_rel_l2", "max_ulp",
               "nan_frac", "inf_frac", "zero_frac", "mistrusted")

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """Short dtype names used in tolerance keys and reports: bf16, fp16, fp32, fp64."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero, inf when only ref is)."""
    x, ref = x.to(F64), ref.to(F64)
    num = float(torch.linalg.vector_norm(x - ref))
    den = float(torch.linalg.vector_norm(ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _ordered_int(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Map floats of ``dtype`` to integers whose order is the float order (adjacent floats
    differ by 1): sign-magnitude bit patterns folded onto two's complement, in int64."""
    bits = x.to(dtype).contiguous().view(_INT_VIEW[dtype]).to(torch.int64)
    nbits = torch.finfo(dtype).bits
    sign_bit = 1 << (nbits - 1)
    mag = bits & (sign_bit - 1)
    return torch.where(bits < 0, -mag, mag)


def max_ulp(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest ULP distance between x and ref, both rounded to ``dtype`` (inf on NaN/Inf mismatch)."""
    if x.numel() == 0:
        return 0.0
    if dtype not in _INT_VIEW:
        raise ValueError(f"dtype: expected one of bf16|fp16|fp32|fp64 for max_ulp, got {dtype}")
    xd, rd = x.to(dtype), ref.to(F64).to(dtype)
    bad = torch.isnan(xd) | torch.isnan(rd) | (torch.isinf(xd) & (xd != rd))
    if bool(bad.any()):
        return math.inf
    return float((_ordered_int(xd, dtype) - _ordered_int(rd, dtype)).abs().max())


def _packed_rows(t: torch.Tensor, problem) -> torch.Tensor:
    """o [B,T,HV,V] -> [B*T, HV*V] (rows are packed tokens)."""
    return t.reshape(problem.B * problem.T, -1)


def _row_groups(problem, chunk: int, rows: int) -> tuple:
    """Per packed row: its chunk point (-1: a row outside every sequence) and whether it lies in
    the last half of its sequence.  numpy arrays over the ``rows`` packed tokens; the number of
    chunk points = the longest sequence's chunk count."""
    cid = np.full(rows, -1, dtype=np.int64)
    tail = np.zeros(rows, dtype=bool)
    for bos, eos in problem.seq_bounds():
        n = eos - bos
        cid[bos:eos] = np.arange(n) // chunk
        tail[bos + n // 2:eos] = True
    return cid, tail


def _ratio(num_sq: float, den_sq: float) -> float:
    """sqrt(num_sq / den_sq) as rel_l2 defines it (0 when both are zero, inf when only den is)."""
    if den_sq == 0.0:
        return 0.0 if num_sq == 0.0 else math.inf
    return math.sqrt(num_sq) / math.sqrt(den_sq)


def sequence_blocks(lens, block: int = SLICE_ROWS) -> list:
    """The (sequence n, first token, end token) ranges of o's block slices, tokens local to the
    sequence: SLICE_ROWS tokens each, a last block shorter than that merged into the one before it
    (a slice of 1 to 15 tokens would be judged on too few tokens to compare two roundings)."""
    out = []
    for n, L in enumerate(lens):
        starts = list(range(0, L, block))
        if len(starts) > 1 and L - starts[-1] < block:
            starts.pop()
        out.extend((n, t0, starts[i + 1] if i + 1 < len(starts) else L) for i, t0 in enumerate(starts))
    return out


def _block_ids(problem, rows: int, blocks: list):
    """Per packed row: its sequence n (-1 outside every sequence) and its block's index in
    ``blocks`` (-1 outside)."""
    seq = np.full(rows, -1, dtype=np.int64)
    blk = np.full(rows, -1, dtype=np.int64)
    bounds = problem.seq_bounds()
    for n, (bos, eos) in enumerate(bounds):
        seq[bos:eos] = n
    for i, (n, t0, t1) in enumerate(blocks):
        bos = bounds[n][0]
        blk[bos + t0:bos + t1] = i
    return seq, blk


def slice_sums(d: torch.Tensor, r: torch.Tensor, problem, tensor: str) -> Optional[dict]:
    """Squared error and squared reference of every slice of one output, float64 on d's device.

    d = x - ref and r = ref, both float64 and shaped as the output:
    o [B,T,HV,V] -> "seq_head" [N, HV] (sequence n, head h; count = len_n * V elements,
                    tokens = len_n),
                    "seq_block" (sequence n, its tokens t0..t1 in ``sequence_blocks``, all heads) and
                    "seq_start" (sequence n's first START_ROWS tokens, all heads; sequences
                    longer than that);
    final_state [N,HV,*,*] -> "seq_head" [N, HV];
    state_cache (written slots only, in state_indices order) [N,HV,*,*] -> "slot_head" [N, HV].
    Returns {kind: {"err_sq": [...], "ref_sq": [...], "count": [...], "labels": [...]}} as
    plain lists (labels: (n, h), (n, first token, last token) or (slot, h)); None when the tensor
    has no slices.  (``tensor_metrics`` gets the same from its blockwise row sums,
    ``slice_sums_from_rows``.)"""
    if problem is None or d.dim() != 4 or d.numel() == 0:
        return None
    dv, rv = _rows_view(d, tensor), _rows_view(r, tensor)
    return slice_sums_from_rows(dv.square().sum(-1), rv.square().sum(-1), problem, tensor, dv.shape[2])


def slice_sums_from_rows(e2: torch.Tensor, r2: torch.Tensor, problem, tensor: str, per_row: int) -> dict:
    """``slice_sums`` from the per-(row, head) sums of squares: e2, r2 [rows, HV] float64, rows =
    packed tokens (o) or sequences / written slots (final_state, state_cache); ``per_row`` =
    elements per (row, head): V for o, K*V for a state."""
    out = {}
    dev = e2.device
    if tensor == "o":
        HV, V = e2.shape[1], per_row
        lens = [e - b for b, e in problem.seq_bounds()]
        blocks = sequence_blocks(lens)
        seq_np, blk_np = _block_ids(problem, e2.shape[0], blocks)
        seq = torch.from_numpy(seq_np).to(dev)
        blk = torch.from_numpy(blk_np).to(dev)
        inside, in_block = seq >= 0, blk >= 0
        N, nb = problem.N, len(blocks)
        starts = [(n, b, min(e, b + START_ROWS)) for n, (b, e) in enumerate(problem.seq_bounds()) if e - b > START_ROWS]
        rows_e, rows_r = e2.sum(1), r2.sum(1)
        es = torch.zeros(N, HV, dtype=F64, device=dev).index_add_(0, seq[inside], e2[inside])
        rs = torch.zeros(N, HV, dtype=F64, device=dev).index_add_(0, seq[inside], r2[inside])
        eb = torch.zeros(nb, dtype=F64, device=dev).index_add_(0, blk[in_block], rows_e[in_block])
        rb = torch.zeros(nb, dtype=F64, device=dev).index_add_(0, blk[in_block], rows_r[in_block])
        se = [rows_e[b:e].sum() for _, b, e in starts]
        sr = [rows_r[b:e].sum() for _, b, e in starts]
        vals = torch.cat([es.flatten(), rs.flatten(), eb, rb, torch.stack(se + sr) if starts else eb[:0]]).tolist()
        nh, ns = N * HV, len(starts)                                           # one synchronisation above
        es, rs, eb, rb = vals[:nh], vals[nh:2 * nh], vals[2 * nh:2 * nh + nb], vals[2 * nh + nb:2 * nh + 2 * nb]
        se, sr = vals[2 * nh + 2 * nb:2 * nh + 2 * nb + ns], vals[2 * nh + 2 * nb + ns:]
        out["seq_head"] = {"err_sq": es, "ref_sq": rs,
                           "count": [lens[n] * V for n in range(N) for _ in range(HV)],
                           "tokens": [lens[n] for n in range(N) for _ in range(HV)],
                           "labels": [(n, h) for n in range(N) for h in range(HV)]}
        out["seq_block"] = {"err_sq": eb, "ref_sq": rb, "count": [(t1 - t0) * HV * V for _, t0, t1 in blocks],
                            "labels": [[n, t0, t1 - 1] for n, t0, t1 in blocks]}
        if starts:
            out["seq_start"] = {"err_sq": se, "ref_sq": sr, "count": [(e - b) * HV * V for _, b, e in starts],
                                "labels": [[n, 0, e - b - 1] for n, b, e in starts]}
        return out
    N, HV = e2.shape[0], e2.shape[1]
    vals = torch.cat([e2.flatten(), r2.flatten()]).tolist()                  # one synchronisation
    e2, r2 = vals[:N * HV], vals[N * HV:]
    if tensor == "state_cache":
        slots = [int(s) for s in problem.state_indices.tolist()]
        out["slot_head"] = {"err_sq": e2, "ref_sq": r2,
                            "count": [per_row] * (N * HV), "labels": [(s, h) for s in slots for h in range(HV)]}
    else:
        out["seq_head"] = {"err_sq": e2, "ref_sq": r2,
                           "count": [per_row] * (N * HV), "labels": [(n, h) for n in range(N) for h in range(HV)]}
    return out


# Bytes of one block of tensor_metrics per element of the output: the float64 block of x, of the
# reference and of d, |d| or d^2, the zero and negligible masks and the ULP distance's integers.
METRIC_BYTES_PER_ELEMENT = 96


def _rows_view(t: torch.Tensor, tensor: str) -> torch.Tensor:
    """``t`` as [rows, groups, elements]: o [B,T,HV,V] -> [B*T, HV, V] (packed tokens); another
    4-D tensor (a state [N,HV,K,V], the written slots of a cache) -> [N, HV, K*V]; anything else
    -> [numel, 1, 1].  A view where ``t``'s strides allow."""
    if t.dim() == 4:
        if tensor == "o":
            return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])
        return t.reshape(t.shape[0], t.shape[1], -1)
    return t.reshape(-1, 1, 1)


def block_rows(view: torch.Tensor, budget: Optional[int] = None) -> int:
    """Rows of ``view`` [rows, groups, elements] per block of ``tensor_metrics``: the block budget
    of the view's device (``kda_ref.budget.block_budget``: a share of the device's total memory
    divided by the workers sharing it) over METRIC_BYTES_PER_ELEMENT per element; at least 1."""
    if budget is None:
        budget = kda_budget.block_budget(view.device)   # through the module: tests set a small budget
    per_row = max(1, view.shape[1] * view.shape[2]) * METRIC_BYTES_PER_ELEMENT
    return max(1, int(budget) // per_row)


def tensor_metrics(x: torch.Tensor, ref: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                   problem=None, tensor: str = "o", chunk: int = 32, rows_per_block: Optional[int] = None) -> dict:
    """Every metric of one output tensor ``x`` against its float64 reference ``ref``.

    ``dtype`` is the dtype the ULP distance is counted in (default: x's dtype); ``problem``
    gives the sequence bounds (o) and the written slots (state_cache); ``chunk`` is the row
    count of one point of the per-chunk curve.  rel_l2 of the whole tensor, of the tail rows and
    of each chunk point are sqrt(sum of squared errors / sum of squared references) over those
    rows.

    Streamed: the tensor is walked in blocks of rows (o: packed tokens; a state: sequences) of
    ``rows_per_block`` (default ``block_rows``: the device's block budget), each block of x and
    of ref cast to float64 on x's device alone, so no float64 copy of the whole tensor is made
    (ref may stay on another device: it is moved block by block).  Two passes: max|ref| (for the
    negligible threshold of ``mistrusted``), then every sum, count and maximum; what is kept of
    size T is the per-(token, head) sums of squares [B*T, HV] (o, for the chunk curve, the tail and
    the slices).  The sums are reduced on x's device and read back together."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{tensor}: expected shape {list(ref.shape)} (the oracle's), got {list(x.shape)}")
    dtype = dtype or x.dtype
    x = x.detach()
    ref = ref.detach()
    dev = x.device
    extra = {}
    if tensor == "state_cache" and problem is not None:
        ref = ref.to(device=dev)
        written = problem.state_indices.long().to(dev)
        keep = torch.ones(x.shape[0], dtype=torch.bool, device=dev)
        keep[written] = False
        xo, ro = x[keep].to(F64), ref[keep].to(F64)
        same = (xo == ro) | (torch.isnan(xo) & torch.isnan(ro))
        extra["untouched_changed"] = int((~same).sum())
        del xo, ro, same
        x, ref = x[written], ref[written]
    numel = x.numel()
    xr, rr = _rows_view(x, tensor), _rows_view(ref, tensor)
    R = xr.shape[0]
    step = max(1, int(rows_per_block)) if rows_per_block is not None else block_rows(xr)
    spans = [(i, min(R, i + step)) for i in range(0, R, step)] if numel else []
    ulp = dtype in _INT_VIEW
    rows_kept = problem is not None and x.dim() == 4 and numel > 0 and tensor in ("o", "final_state", "state_cache")
    per_chunk = tensor == "o" and problem is not None and x.dim() == 4

    def ref_block(i0, i1):
        return rr[i0:i1].to(device=dev, dtype=F64)

    zf = torch.zeros((), dtype=F64, device=dev)
    zi = torch.zeros((), dtype=torch.int64, device=dev)
    rmax = zf                                                              # pass 1: max |ref|
    for i0, i1 in spans:
        rmax = torch.maximum(rmax, ref_block(i0, i1).abs().amax())
    thr = NEGLIGIBLE * rmax
    nan_c = inf_c = zero_c = negl_c = spur_c = ulp_bad = ulp_max = zi
    err_sq = ref_sq = max_abs = zf
    if rows_kept:
        E2 = torch.empty(R, xr.shape[1], dtype=F64, device=dev)
        R2 = torch.empty(R, xr.shape[1], dtype=F64, device=dev)
    for i0, i1 in spans:                                                   # pass 2: everything else
        xb, rb = xr[i0:i1].to(F64), ref_block(i0, i1)
        nan_c = nan_c + torch.isnan(xb).sum()
        inf_c = inf_c + torch.isinf(xb).sum()
        zb = xb == 0
        zero_c = zero_c + zb.sum()
        negl = rb.abs() <= thr
        negl_c = negl_c + negl.sum()
        spur_c = spur_c + (zb & ~negl).sum()
        del zb, negl
        db = xb - rb
        e2, r2 = db.square().sum(-1), rb.square().sum(-1)                 # [rows, groups]
        err_sq, ref_sq = err_sq + e2.sum(), ref_sq + r2.sum()
        max_abs = torch.maximum(max_abs, db.abs().amax())
        del db
        if rows_kept:
            E2[i0:i1], R2[i0:i1] = e2, r2
        if ulp:
            xd, rd = xb.to(dtype), rb.to(dtype)
            bad = torch.isnan(xd) | torch.isnan(rd) | (torch.isinf(xd) & (xd != rd))
            ulp_bad = ulp_bad + bad.sum()
            ulp_max = torch.maximum(ulp_max, (_ordered_int(xd, dtype) - _ordered_int(rd, dtype)).abs().amax())
            del xd, rd, bad
        del xb, rb, e2, r2
    n = max(numel, 1)
    parts, num, den, tail_np = [], None, None, None
    if per_chunk:
        rows_e, rows_r = (E2.sum(1), R2.sum(1)) if rows_kept else (zf.new_zeros(R), zf.new_zeros(R))
        cid_np, tail_np = _row_groups(problem, chunk, R)
        npts = int(cid_np.max()) + 1 if cid_np.size else 0
        cid = torch.from_numpy(cid_np).to(dev)
        inside = cid >= 0
        tail_m = torch.from_numpy(tail_np).to(dev)
        num = torch.zeros(npts, dtype=F64, device=dev).index_add_(0, cid[inside], rows_e[inside])
        den = torch.zeros(npts, dtype=F64, device=dev).index_add_(0, cid[inside], rows_r[inside])
        parts = [rows_e[tail_m].sum(), rows_r[tail_m].sum()]
    head = torch.stack([nan_c.to(F64), inf_c.to(F64), zero_c.to(F64), err_sq, ref_sq, max_abs, rmax,
                        negl_c.to(F64), spur_c.to(F64), ulp_bad.to(F64), ulp_max.to(F64), *parts])
    vals = head.tolist()                                                     # one synchronisation
    nan_frac, inf_frac, zero_frac = vals[0] / n, vals[1] / n, vals[2] / n
    finite = nan_frac == 0.0 and inf_frac == 0.0
    err = _ratio(vals[3], vals[4]) if finite else math.nan
    max_abs = vals[5] if finite and numel else (0.0 if finite else math.nan)
    tail, curve = err, []
    if per_chunk:
        if finite and bool(tail_np.any()):
            tail = _ratio(vals[11], vals[12])
        elif finite:
            tail = 0.0
        pts = torch.stack([num, den], 1).tolist() if num.numel() else []
        curve = [_ratio(a, b) if finite else math.nan for a, b in pts]
    ref_zero, spurious = vals[7] / n, vals[8] / n
    mistrusted = zero_frac > ZERO_TRUST and spurious > ZERO_TRUST
    if not ulp:
        ulp_v = math.nan
    elif numel == 0:
        ulp_v = 0.0
    else:
        ulp_v = math.inf if vals[9] > 0 else vals[10]
    out = {"rel_l2": err, "max_abs": max_abs, "tail_rel_l2": tail, "chunk_rel_l2": curve,
           "max_ulp": ulp_v,
           "nan_frac": nan_frac, "inf_frac": inf_frac, "zero_frac": zero_frac,
           "ref_zero_frac": ref_zero, "spurious_zero_frac": spurious, "mistrusted": bool(mistrusted), "dtype": dtype_name(dtype),
           "numel": int(numel)}
    out.update(extra)
    if finite and rows_kept:
        out["slices"] = slice_sums_from_rows(E2, R2, problem, tensor, xr.shape[2])
    return out


def missing_metrics(tensor: str) -> dict:
    """The record of an expected tensor the backend did not return (never passes)."""
    return {"rel_l2": math.nan, "max_abs": math.nan, "tail_rel_l2": math.nan, "chunk_rel_l2": [],
            "max_ulp": math.inf, "nan_frac": 0.0, "inf_frac": 0.0, "zero_frac": 0.0, "ref_zero_frac": 0.0,
            "spurious_zero_frac": 0.0,
            "mistrusted": False, "dtype": None, "numel": 0, "missing": True}


def compare(outputs: dict, truth: dict, problem=None, chunk: int = 32) -> dict:
    """Metrics of every tensor of ``truth`` (name -> float64 tensor) found in ``outputs``
    (name -> tensor in the kernel's dtype); an expected tensor that is absent is reported
    with ``missing: True``.  Extra output tensors are ignored."""
    result = {}
    for name, ref in truth.items():
        if name not in ("o", "final_state", "state_cache"):
            continue
        x = outputs.get(name)
        if x is None:
            result[name] = missing_metrics(name)
            continue
        result[name] = tensor_metrics(x, ref, dtype=x.dtype, problem=problem, tensor=name, chunk=chunk)
    return result


def inverse_metrics(x: torch.Tensor, ref: torch.Tensor, tile_len: torch.Tensor) -> dict:
    """Metrics of a stored chunk inverse (tap ``ws_inv`` [HV*tiles, C, C], head-major tiles)
    against the oracle's exact (I - L)^{-1}, on the entries that carry information: rows
    i < Lc of each tile, columns j < i (the unit diagonal is exact in every format and would
    only dilute the error).  ``tile_len`` [tiles] holds Lc per tile."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"ws_inv: expected shape {list(ref.shape)} (the oracle's), got {list(x.shape)}")
    C = ref.shape[-1]
    reps = ref.shape[0] // max(tile_len.numel(), 1)
    lc = tile_len.to(ref.device).repeat(reps)
    i = torch.arange(C, device=ref.device)
    used = (i[None, :, None] < lc[:, None, None]) & (i[None, None, :] < i[None, :, None])
    xs, rs = x.detach().to(ref.device)[used], ref[used]
    m = tensor_metrics(xs, rs, dtype=x.dtype, tensor="ws_inv")
    m["tail_rel_l2"] = m["rel_l2"]
    return m
