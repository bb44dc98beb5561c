"""Segments (context parallelism inside a sequence): the plan and passes A, B, C in float64.

Each chunk is affine in its incoming state, S' = A_c S + b_c, with
    A_c = diag(ws_gt) - ws_kr^T ws_inv diag(β) ws_kd,      b_c = ws_kr^T ws_inv diag(β) v.
A segment of chunks c1..cm composes to S_out = A_seg S_in + b_seg,
    A_seg = A_cm ... A_c1,     b_seg = Σ_j (A_cm ... A_c(j+1)) b_cj.

Pass A: A_seg [segs,HV,K,K] and b_seg [segs,HV,K,V] (one run of the chunk steps on the
        state [A | b], starting from [I | 0], right-hand side [0 | v]).
Pass B: per sequence, h_in[s] = h; h <- A_seg[s] h + b_seg[s] over its segments, from S0.
Pass C: every segment re-run from h_in[s], writing o; the last segment of a sequence gives
        its final state.
Segments never cross sequences; a sequence with no chunks still gets one 0-chunk segment,
whose h_in (and final state) is its initial state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .chunked import run_chunk_grid
from .preprocess import F64, Prepared
from .workspace import Workspace

DESC_ROWS = ("chunk_base", "nchunks", "tok_base", "tok_end", "seq", "is_last")


@dataclass
class SegmentPlan:
    chunks_per_seg: Optional[int]
    chunk_base: torch.Tensor   # [segs] global chunk (tile) index of the first chunk
    nchunks: torch.Tensor      # [segs]
    tok_base: torch.Tensor     # [segs] first token
    tok_end: torch.Tensor      # [segs] one past the last token
    seq: torch.Tensor          # [segs] sequence of the segment
    is_last: torch.Tensor      # [segs] bool: the sequence's last segment
    seq_seg_off: torch.Tensor  # [N+1] prefix offsets of each sequence's segments

    @property
    def segs(self) -> int:
        return int(self.seq.numel())

    def desc(self) -> torch.Tensor:
        """The [6, segs] int32 descriptor: rows chunk_base, nchunks, tok_base, tok_end, seq, is_last."""
        return torch.stack([getattr(self, r).to(torch.int64) for r in DESC_ROWS]).to(torch.int32)

    def grid(self) -> torch.Tensor:
        """[segs, J] tile index of chunk j of segment s (-1 past its last chunk)."""
        J = int(self.nchunks.max()) if self.segs else 0
        j = torch.arange(J, device=self.nchunks.device)[None, :]
        return torch.where(j < self.nchunks[:, None], self.chunk_base[:, None] + j, torch.full_like(j, -1))


def segment_plan(bounds, C: int, chunks_per_seg: Optional[int] = None, device=None) -> SegmentPlan:
    """Cut every sequence ``bounds = [(bos, eos)]`` into segments of ``chunks_per_seg`` chunks of C
    tokens (the last segment may be shorter).  ``chunks_per_seg`` None or <= 0: one segment per
    sequence.  A sequence with 0 chunks gets one 0-chunk segment."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    bos = torch.tensor([b for b, _ in bounds], dtype=torch.long, device=dev).reshape(-1)
    eos = torch.tensor([e for _, e in bounds], dtype=torch.long, device=dev).reshape(-1)
    nch = (eos - bos + C - 1) // C
    chunk_off = torch.cumsum(nch, 0) - nch
    if chunks_per_seg is None or chunks_per_seg <= 0:
        cps = torch.clamp(nch, min=1)
    else:
        cps = torch.full_like(nch, int(chunks_per_seg))
    nseg = torch.clamp((nch + cps - 1) // cps, min=1)
    seq_seg_off = torch.zeros(len(bounds) + 1, dtype=torch.long, device=dev)
    seq_seg_off[1:] = torch.cumsum(nseg, 0)
    segs = int(seq_seg_off[-1])
    seq = torch.repeat_interleave(torch.arange(len(bounds), device=dev), nseg)
    j = torch.arange(segs, device=dev) - seq_seg_off[seq]          # segment index within its sequence
    first = j * cps[seq]
    n_in = torch.clamp(torch.minimum(cps[seq], nch[seq] - first), min=0)
    tok_base = torch.minimum(bos[seq] + first * C, eos[seq])
    tok_end = torch.minimum(tok_base + n_in * C, eos[seq])
    return SegmentPlan(chunks_per_seg=chunks_per_seg, chunk_base=chunk_off[seq] + first, nchunks=n_in,
                       tok_base=tok_base, tok_end=tok_end, seq=seq, is_last=(j == nseg[seq] - 1),
                       seq_seg_off=seq_seg_off)


def pass_a(ws: Workspace, plan: SegmentPlan, K: int, V: int):
    """(A_seg [segs,HV,K,K], b_seg [segs,HV,K,V]) of every segment, all segments at once."""
    dev = ws.ws_kd.device
    X0 = torch.zeros(ws.HV, plan.segs, K, K + V, dtype=F64, device=dev)
    X0[..., :K] = torch.eye(K, dtype=F64, device=dev)
    X = run_chunk_grid(ws, plan.grid(), X0, v_prefix=K)
    X = X.transpose(0, 1)
    return X[..., :K].contiguous(), X[..., K:].contiguous()


def pass_b(plan: SegmentPlan, A_seg: torch.Tensor, b_seg: torch.Tensor, S0: torch.Tensor):
    """h_in [segs,HV,K,V]: the incoming state of every segment, scanned per sequence from S0
    [N,HV,K,V] (sequences side by side); also returns the state after each sequence's last segment."""
    off = plan.seq_seg_off.cpu()
    count = off[1:] - off[:-1]
    h = S0.clone()
    h_in = torch.empty((plan.segs,) + tuple(S0.shape[1:]), dtype=F64, device=S0.device)
    for j in range(int(count.max()) if count.numel() else 0):
        live = torch.nonzero(count > j).flatten()
        s = (off[live] + j).to(S0.device)
        live = live.to(S0.device)
        h_in[s] = h[live]
        h[live] = A_seg[s] @ h[live] + b_seg[s]
    return h_in, h


def pass_c(pp: Prepared, ws: Workspace, plan: SegmentPlan, h_in: torch.Tensor):
    """(o [Ttot,HV,V], final state [N,HV,K,V]): every segment run from its h_in."""
    dev = ws.ws_kd.device
    HV, V = ws.HV, pp.v.shape[-1]
    o_tiles = pp.v.new_zeros(HV, ws.tiles, ws.C, V)
    S = run_chunk_grid(ws, plan.grid(), h_in.transpose(0, 1), o_tiles=o_tiles)
    final = pp.S0.clone()
    last = plan.is_last.to(dev)
    final[plan.seq.to(dev)[last]] = S.transpose(0, 1)[last]
    return ws.grid.scatter(o_tiles), final


@dataclass
class SegmentedResult:
    o: torch.Tensor
    final_state: torch.Tensor
    plan: SegmentPlan
    A_seg: torch.Tensor
    b_seg: torch.Tensor
    h_in: torch.Tensor

    def tensors(self) -> dict:
        dev = self.A_seg.device
        return {"A_seg": self.A_seg, "b_seg": self.b_seg, "h_in": self.h_in,
                "seg_desc": self.plan.desc().to(dev), "seq_seg_off": self.plan.seq_seg_off.to(dev, torch.int32)}


def segmented(pp: Prepared, ws: Workspace, chunks_per_seg: Optional[int] = None) -> SegmentedResult:
    """Passes A, B, C over the segment plan of ``chunks_per_seg`` chunks per segment."""
    K, V = pp.k.shape[-1], pp.v.shape[-1]
    plan = segment_plan(pp.bounds, ws.C, chunks_per_seg)   # index bookkeeping on the host
    A_seg, b_seg = pass_a(ws, plan, K, V)
    h_in, _ = pass_b(plan, A_seg, b_seg, pp.S0)
    o, final = pass_c(pp, ws, plan, h_in)
    return SegmentedResult(o=o, final_state=final, plan=plan, A_seg=A_seg, b_seg=b_seg, h_in=h_in)
