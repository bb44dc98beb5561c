"""Host-side plan of one forward: chunk tiles, segments, and the segmentation heuristic.

Tiles are the C-token chunks of every sequence in order (``tile = global chunk index``);
the workspace row of (head h, tile) is ``ws_idx = h * total_tiles + tile``.  Sequence n
(a batch row, or a ``cu_seqlens`` range when B == 1) has ``nch_n = ceil(len_n / C)`` tiles
and ``max(1, ceil(nch_n / cps))`` segments; segments never cross sequences, and a sequence
with no chunks still owns one (empty) segment, so its final state (= its initial state)
is written.

Descriptor tensors (int32, on the device) read by the kernels:

    tiles [total_tiles, 4]   (batch row b, first token t0 within the row, valid rows Lc, seq n)
    segs  [num_segs, 8]      (chunk_base, nchunks, seq n, is_last, b, t0, t_end, 0)
    seg_off [N + 1]          first segment of each sequence (prefix sums)

Plans are cached per (device, B, T, cu_seqlens contents, cps): a repeated forward with the
same ``cu_seqlens`` tensor reads it back from the host once.
"""
from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

C = 32
SEG_BLOCKS_PER_SM = 2  # chunk-step programs resident per SM (~210 registers/thread at 4 warps: 2 fit)
SEG_MIN_SEGMENTS = 4   # segmenting triples the chunk steps; fewer segments cannot pay for it
SEG_MIN_CHUNKS = 48    # shorter sequences stay unsegmented (measured: docs/triton-flashkda.md)


@dataclass
class Plan:
    bounds: tuple            # ((b, t0, t_end), ...) per sequence, tokens local to batch row b
    total_tiles: int
    n_chunks_max: int
    cps: Optional[int]       # None: unsegmented (one segment per sequence)
    num_segs: int
    tiles: torch.Tensor      # int32 [total_tiles, 4]
    segs: torch.Tensor       # int32 [num_segs, 8]
    seg_off: torch.Tensor    # int32 [N + 1]

    @property
    def N(self) -> int:
        return len(self.bounds)

    @property
    def segmented(self) -> bool:
        return self.cps is not None


def num_sms(device) -> int:
    """Streaming multiprocessors (CUs) of the device; 132 (an H200) when there is no GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def choose_chunks_per_seg(n_chunks_max: int, N: int, H: int, V: int, bw: int, sms: int) -> Optional[int]:
    """Chunks per segment for the occupancy heuristic, or None for unsegmented.

    Pass C alone has ``blocks = N*H*ceil(V/bw)`` programs, each a sequential walk over its
    sequence's chunks; one wave of the device holds ``SEG_BLOCKS_PER_SM*sms`` of them.  The
    chunk steps are throughput-bound once a wave is full, so segmenting (pass A walks twice,
    pass C once: three walks for one) pays only when the unsegmented grid fills less than a
    third of a wave and the walk is long (>= SEG_MIN_CHUNKS).  Then each sequence is cut into
    ``floor(wave / blocks)`` segments, so passes A and C run as one full wave rather than a
    full wave and a half-empty second one; fewer than SEG_MIN_SEGMENTS segments keep it
    unsegmented.
    """
    blocks = N * H * max(1, -(-V // bw))
    wave = SEG_BLOCKS_PER_SM * sms
    if n_chunks_max < SEG_MIN_CHUNKS or 3 * blocks > wave:
        return None
    segs = min(wave // blocks, n_chunks_max)
    if segs < SEG_MIN_SEGMENTS:
        return None
    return -(-n_chunks_max // segs)


def sequence_bounds(B: int, T: int, cu_list: Optional[list]) -> tuple:
    if cu_list is None:
        return tuple((b, 0, T) for b in range(B))
    return tuple((0, int(s), int(e)) for s, e in zip(cu_list[:-1], cu_list[1:]))


def build_plan(bounds: tuple, cps: Optional[int], device) -> Plan:
    tiles, segs, seg_off = [], [], [0]
    nmax = 0
    for n, (b, t0, t1) in enumerate(bounds):
        nch = -(-(t1 - t0) // C)
        nmax = max(nmax, nch)
        base = len(tiles)
        for c in range(nch):
            tiles.append((b, t0 + c * C, min(C, t1 - t0 - c * C), n))  # mutant-anchor: plan-tile-rows
        step = nch if cps is None else cps
        nseg = max(1, -(-nch // step)) if step > 0 else 1
        for s in range(nseg):
            c0 = s * step
            m = max(0, min(step, nch - c0))
            segs.append((base + c0, m, n, int(s == nseg - 1), b, t0 + c0 * C, min(t0 + (c0 + m) * C, t1), 0))
        seg_off.append(len(segs))

    def as_tensor(rows, width):
        t = torch.tensor(rows, dtype=torch.int32).reshape(-1, width) if rows else torch.zeros(0, width, dtype=torch.int32)
        return t.to(device)

    return Plan(bounds=bounds, total_tiles=len(tiles), n_chunks_max=nmax, cps=cps, num_segs=len(segs),
                tiles=as_tensor(tiles, 4), segs=as_tensor(segs, 8),
                seg_off=torch.tensor(seg_off, dtype=torch.int32).to(device))


_BOUNDS_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_PLAN_CACHE: "OrderedDict[tuple, Plan]" = OrderedDict()
_CACHE_SIZE = 64


def _lru(cache: OrderedDict, key, make):
    hit = cache.get(key)
    if hit is None:
        hit = make()
        cache[key] = hit
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit


def bounds_of(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> tuple:
    """Sequence bounds.  ``cu_seqlens`` is read back to the host once per tensor object and
    version (a weak reference guards against a new tensor reusing a freed one's id)."""
    if cu_seqlens is None:
        return sequence_bounds(B, T, None)
    key = id(cu_seqlens)
    hit = _BOUNDS_CACHE.get(key)
    if hit is not None:
        ref, version, T_seen, bounds = hit
        if ref() is cu_seqlens and version == cu_seqlens._version and T_seen == T:
            _BOUNDS_CACHE.move_to_end(key)
            return bounds
    bounds = sequence_bounds(B, T, cu_seqlens.tolist())
    _BOUNDS_CACHE[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, T, bounds)
    if len(_BOUNDS_CACHE) > _CACHE_SIZE:
        _BOUNDS_CACHE.popitem(last=False)
    return bounds


def get_plan(bounds: tuple, cps: Optional[int], device) -> Plan:
    return _lru(_PLAN_CACHE, (str(device), bounds, cps), lambda: build_plan(bounds, cps, device))
