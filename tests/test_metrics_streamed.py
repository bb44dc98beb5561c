"""tensor_metrics streamed over blocks of rows gives today's whole-tensor results: the
implementation that held float64 copies of the whole output (kept below, verbatim, as ``_old_*``)
and the blockwise one agree to 1e-12 relative on every float and exactly on every count, label
and ULP distance, at blocks of 1, 3, 7 rows and the default, over dense, varlen (empty and short
sequences), paged, vk-state and GVA problems, bf16/fp16/fp32 outputs, with NaN, Inf and zeros
planted; a reference on another device than x (moved block by block) gives the same."""
import math
from typing import Optional

import pytest
import torch

from verification.judging import metrics
from verification.judging.metrics import (F64, NEGLIGIBLE, START_ROWS, ZERO_TRUST, _INT_VIEW, _block_ids,  # noqa: F401
                                  _ordered_int, _packed_rows, _ratio, _row_groups, compare, dtype_name,
                                  sequence_blocks, tensor_metrics)
from kda_ref import truth
from verification.investigating.selfcheck import RECIPES, build

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

BY_NAME = {r.name: r for r in RECIPES}
REL = 1e-12


# ----------------------------------------------------------------------------- the whole-tensor form
def _old_max_ulp(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
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


def _old_slice_sums(d: torch.Tensor, r: torch.Tensor, problem, tensor: str) -> Optional[dict]:
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
    has no slices."""
    if problem is None or d.dim() != 4 or d.numel() == 0:
        return None
    out = {}
    if tensor == "o":
        HV, V = d.shape[2], d.shape[3]
        e2 = d.reshape(-1, HV, V).square().sum(-1)                        # [rows, HV]
        r2 = r.reshape(-1, HV, V).square().sum(-1)
        lens = [e - b for b, e in problem.seq_bounds()]
        blocks = sequence_blocks(lens)
        seq_np, blk_np = _block_ids(problem.seq_bounds(), e2.shape[0], blocks)
        seq = torch.from_numpy(seq_np).to(d.device)
        blk = torch.from_numpy(blk_np).to(d.device)
        inside, in_block = seq >= 0, blk >= 0
        N, nb = problem.N, len(blocks)
        starts = [(n, b, min(e, b + START_ROWS)) for n, (b, e) in enumerate(problem.seq_bounds()) if e - b > START_ROWS]
        rows_e, rows_r = e2.sum(1), r2.sum(1)
        es = torch.zeros(N, HV, dtype=F64, device=d.device).index_add_(0, seq[inside], e2[inside])
        rs = torch.zeros(N, HV, dtype=F64, device=d.device).index_add_(0, seq[inside], r2[inside])
        eb = torch.zeros(nb, dtype=F64, device=d.device).index_add_(0, blk[in_block], rows_e[in_block])
        rb = torch.zeros(nb, dtype=F64, device=d.device).index_add_(0, blk[in_block], rows_r[in_block])
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
    N, HV = d.shape[0], d.shape[1]
    e2 = d.reshape(N, HV, -1).square().sum(-1)
    r2 = r.reshape(N, HV, -1).square().sum(-1)
    per = d.shape[2] * d.shape[3]
    vals = torch.cat([e2.flatten(), r2.flatten()]).tolist()                  # one synchronisation
    e2, r2 = vals[:N * HV], vals[N * HV:]
    if tensor == "state_cache":
        slots = [int(s) for s in problem.state_indices.tolist()]
        out["slot_head"] = {"err_sq": e2, "ref_sq": r2,
                            "count": [per] * (N * HV), "labels": [(s, h) for s in slots for h in range(HV)]}
    else:
        out["seq_head"] = {"err_sq": e2, "ref_sq": r2,
                           "count": [per] * (N * HV), "labels": [(n, h) for n in range(N) for h in range(HV)]}
    return out


def _old_tensor_metrics(x: torch.Tensor, ref: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                   problem=None, tensor: str = "o", chunk: int = 32) -> dict:
    """Every metric of one output tensor ``x`` against its float64 reference ``ref``.

    ``dtype`` is the dtype the ULP distance is counted in (default: x's dtype); ``problem``
    gives the sequence bounds (o) and the written slots (state_cache); ``chunk`` is the row
    count of one point of the per-chunk curve.  rel_l2 of the whole tensor, of the tail rows and
    of each chunk point are sqrt(sum of squared errors / sum of squared references) over those
    rows; the sums are reduced on x's device and read back together (a handful of device
    synchronisations per tensor, whatever the sequence length)."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{tensor}: expected shape {list(ref.shape)} (the oracle's), got {list(x.shape)}")
    dtype = dtype or x.dtype
    x = x.detach()
    ref = ref.detach().to(device=x.device)
    extra = {}
    if tensor == "state_cache" and problem is not None:
        written = problem.state_indices.long().to(x.device)
        keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        keep[written] = False
        xo, ro = x[keep].to(F64), ref[keep].to(F64)
        same = (xo == ro) | (torch.isnan(xo) & torch.isnan(ro))
        extra["untouched_changed"] = int((~same).sum())
        x, ref = x[written], ref[written]
    xf, rf = x.to(F64), ref.to(F64)
    n = max(xf.numel(), 1)
    d = xf - rf
    err_sq, ref_sq = d.square().sum(), rf.square().sum()
    per_chunk = tensor == "o" and problem is not None and xf.dim() == 4
    parts, num, den, tail_np = [], None, None, None
    if per_chunk:
        e2 = _packed_rows(d, problem).square().sum(1)                   # per packed row
        r2 = _packed_rows(rf, problem).square().sum(1)
        cid_np, tail_np = _row_groups(problem.seq_bounds(), chunk, e2.shape[0])
        npts = int(cid_np.max()) + 1 if cid_np.size else 0
        cid = torch.from_numpy(cid_np).to(e2.device)
        inside = cid >= 0
        tail_m = torch.from_numpy(tail_np).to(e2.device)
        num = torch.zeros(npts, dtype=F64, device=e2.device).index_add_(0, cid[inside], e2[inside])
        den = torch.zeros(npts, dtype=F64, device=e2.device).index_add_(0, cid[inside], r2[inside])
        parts = [e2[tail_m].sum(), r2[tail_m].sum()]
    absd = d.abs()
    head = torch.stack([torch.isnan(xf).sum().to(F64), torch.isinf(xf).sum().to(F64), (xf == 0).sum().to(F64),
                        err_sq, ref_sq,
                        absd.max() if xf.numel() else torch.zeros((), dtype=F64, device=xf.device),
                        rf.abs().max() if rf.numel() else torch.zeros((), dtype=F64, device=xf.device), *parts])
    vals = head.tolist()                                                     # one synchronisation
    nan_frac, inf_frac, zero_frac = vals[0] / n, vals[1] / n, vals[2] / n
    finite = nan_frac == 0.0 and inf_frac == 0.0
    err = _ratio(vals[3], vals[4]) if finite else math.nan
    max_abs = vals[5] if finite and xf.numel() else (0.0 if finite else math.nan)
    tail, curve = err, []
    if per_chunk:
        if finite and bool(tail_np.any()):
            tail = _ratio(vals[7], vals[8])
        elif finite:
            tail = 0.0
        pts = torch.stack([num, den], 1).tolist() if num.numel() else []
        curve = [_ratio(a, b) if finite else math.nan for a, b in pts]
    negligible = rf.abs() <= NEGLIGIBLE * vals[6]
    nn = max(rf.numel(), 1)
    counts = torch.stack([negligible.sum(), ((xf == 0) & ~negligible).sum()]).tolist()
    ref_zero, spurious = counts[0] / nn, counts[1] / nn
    mistrusted = zero_frac > ZERO_TRUST and spurious > ZERO_TRUST
    out = {"rel_l2": err, "max_abs": max_abs, "tail_rel_l2": tail, "chunk_rel_l2": curve,
           "max_ulp": _old_max_ulp(xf, rf, dtype) if dtype in _INT_VIEW else math.nan,
           "nan_frac": nan_frac, "inf_frac": inf_frac, "zero_frac": zero_frac,
           "ref_zero_frac": ref_zero, "spurious_zero_frac": spurious, "mistrusted": bool(mistrusted), "dtype": dtype_name(dtype),
           "numel": int(x.numel())}
    out.update(extra)
    if finite and tensor in ("o", "final_state", "state_cache"):
        sl = _old_slice_sums(d, rf, problem, tensor)
        if sl is not None:
            out["slices"] = sl
    return out




# ----------------------------------------------------------------------------- comparison
def _same(a, b, path=""):
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (path, a, b)
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(a, bool):
        if math.isnan(a):
            assert math.isnan(b), (path, a, b)
        elif math.isinf(a) or a == 0.0:
            assert a == b, (path, a, b)
        else:
            assert abs(a - b) <= REL * abs(a), (path, a, b, abs(a - b) / abs(a))
    else:
        assert a == b, (path, a, b)


def _outputs(name, dtype, seed=0, plant=None):
    p = build(BY_NAME[name], 5)
    t = truth(p).tensors()
    g = torch.Generator().manual_seed(seed)
    outs = {}
    for k, ref in t.items():
        x = ref + 1e-3 * ref.abs().mean() * torch.randn(ref.shape, generator=g, dtype=F64)
        if k == "state_cache":
            keep = torch.ones(x.shape[0], dtype=torch.bool)
            keep[p.state_indices.long()] = False
            x[keep] = ref[keep]                                  # untouched slots stay bit-equal ...
            x[keep.nonzero()[:1, 0]] += 1.0                       # ... but one
        x = x.to(dtype)
        if plant == "zeros" and k == "o":
            x.view(-1)[: int(0.6 * x.numel())] = 0
        if plant == "nan" and k == "o":
            x.view(-1)[7] = float("nan")
        if plant == "inf" and k == "final_state" or plant == "inf" and k == "state_cache":
            x.view(-1)[3] = float("inf")
        outs[k] = x
    return p, t, outs


CASES = [("dense", torch.bfloat16, None), ("varlen-partial-empty", torch.bfloat16, None),
         ("varlen-partial-empty", torch.float32, "zeros"), ("paged", torch.float32, None),
         ("paged", torch.bfloat16, "inf"), ("vk-state", torch.float16, None), ("gva", torch.bfloat16, "nan"),
         ("weak-gate", torch.float32, None), ("corr-0.9-beta-1", torch.bfloat16, "zeros")]


@pytest.mark.parametrize("name,dtype,plant", CASES, ids=lambda v: str(v))
def test_streamed_metrics_equal_the_whole_tensor_ones(name, dtype, plant):
    p, t, outs = _outputs(name, dtype, plant=plant)
    for tname, ref in t.items():
        if tname not in ("o", "final_state", "state_cache"):
            continue
        x = outs[tname]
        want = _old_tensor_metrics(x, ref, dtype=x.dtype, problem=p, tensor=tname, chunk=32)
        for rows in (1, 3, 7, None):
            got = tensor_metrics(x, ref, dtype=x.dtype, problem=p, tensor=tname, chunk=32, rows_per_block=rows)
            _same(want, got, f"{name}/{tname}/rows={rows}")
        if plant == "nan" and tname == "o":
            assert want["nan_frac"] > 0 and "slices" not in want
        if plant == "zeros" and tname == "o":
            assert want["zero_frac"] > 0.5


def test_compare_is_unchanged_and_the_chunk_length_is_honoured():
    p, t, outs = _outputs("varlen-partial-empty", torch.bfloat16, seed=3)
    for chunk in (16, 32, 64):
        got = compare(outs, t, problem=p, chunk=chunk)
        for name, m in got.items():
            _same(_old_tensor_metrics(outs[name], t[name], dtype=outs[name].dtype, problem=p, tensor=name,
                                      chunk=chunk), m, f"{name}/{chunk}")


def test_small_default_budget_walks_many_blocks_with_the_same_result(monkeypatch):
    """The default block size comes from kda_ref.budget.block_budget: a budget of a few rows gives
    many blocks and the same metrics."""
    import kda_ref.budget as budget
    p, t, outs = _outputs("gva", torch.bfloat16, seed=1)
    want = {k: _old_tensor_metrics(outs[k], t[k], dtype=outs[k].dtype, problem=p, tensor=k) for k in ("o", "final_state")}
    per_row = p.HV * p.V * metrics.METRIC_BYTES_PER_ELEMENT
    monkeypatch.setattr(budget, "block_budget", lambda dev, workers=None: 5 * per_row)
    from verification.judging.metrics import _rows_view, block_rows
    assert block_rows(_rows_view(outs["o"], "o")) == 5
    for k, w in want.items():
        _same(w, tensor_metrics(outs[k], t[k], dtype=outs[k].dtype, problem=p, tensor=k), k)


def test_other_shapes_and_degenerate_tensors():
    g = torch.Generator().manual_seed(2)
    r = torch.randn(37, 5, dtype=F64, generator=g)
    for x, ref in [(r.float(), r), (torch.zeros(0, dtype=torch.float32), torch.zeros(0, dtype=F64)),
                   (torch.zeros(4, 3), torch.zeros(4, 3, dtype=F64)), (r[:, 0].bfloat16(), r[:, 0])]:
        for rows in (1, 4, None):
            _same(_old_tensor_metrics(x, ref, tensor="ws_inv"), tensor_metrics(x, ref, tensor="ws_inv", rows_per_block=rows))
    o = torch.randn(2, 9, 3, 4, dtype=F64, generator=g)          # o without a problem: no slices, no curve
    for rows in (1, 5, None):
        _same(_old_tensor_metrics(o.half(), o), tensor_metrics(o.half(), o, rows_per_block=rows))
    with pytest.raises(ValueError, match="expected shape"):
        tensor_metrics(o[:1], o)


def test_a_non_contiguous_output_and_a_float64_output():
    p, t, outs = _outputs("dense", torch.float32, seed=4)
    ref = t["o"]
    xt = outs["o"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    for x in (xt, outs["o"].double()):
        want = _old_tensor_metrics(x, ref, dtype=x.dtype, problem=p, tensor="o")
        _same(want, tensor_metrics(x, ref, dtype=x.dtype, problem=p, tensor="o", rows_per_block=11))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_a_reference_on_the_cpu_is_moved_block_by_block():
    p, t, outs = _outputs("varlen-partial-empty", torch.bfloat16)
    x = outs["o"].cuda()
    want = _old_tensor_metrics(x, t["o"], dtype=x.dtype, problem=p, tensor="o")
    _same(want, tensor_metrics(x, t["o"], dtype=x.dtype, problem=p, tensor="o", rows_per_block=9))
