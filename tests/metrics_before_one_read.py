"""The judging's metrics as they were before the one-read restructuring, kept verbatim (only
renamed ``before_*`` and the helpers they used imported): tests/test_metrics_one_read.py holds the
restructured ``tensor_metrics`` and ``compare`` to these numbers exactly (==, NaN equal to NaN).
This is the blockwise form of verification/judging/metrics.py as of commit d275ef5."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from verification.judging.metrics import (F64, NEGLIGIBLE, START_ROWS, ZERO_TRUST, _INT_VIEW, _ordered_int, _ratio,
                                          _rows_view, block_rows, dtype_name, missing_metrics, sequence_blocks)


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


def before_slice_sums_from_rows(e2: torch.Tensor, r2: torch.Tensor, problem, tensor: str, per_row: int) -> dict:
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


def before_tensor_metrics(x: torch.Tensor, ref: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
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
        out["slices"] = before_slice_sums_from_rows(E2, R2, problem, tensor, xr.shape[2])
    return out


def before_compare(outputs: dict, truth: dict, problem=None, chunk: int = 32) -> dict:
    """``compare`` as it was: one ``before_tensor_metrics`` per tensor."""
    result = {}
    for name, ref in truth.items():
        if name not in ("o", "final_state", "state_cache"):
            continue
        x = outputs.get(name)
        result[name] = missing_metrics(name) if x is None else before_tensor_metrics(
            x, ref, dtype=x.dtype, problem=problem, tensor=name, chunk=chunk)
    return result
