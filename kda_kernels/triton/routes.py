"""Route names of our Triton FlashKDA, and their parser.

A route name is ``MODE[:key=value]...``:

    unseg[:BW=32][:nw=4][:inv=ieee|bf16x6][:k1=tile|halves]     one segment per sequence: pass C alone
    seg[:cps=N][:A=two|fused][:B=plain|prefetch][:BW=32][:nw=4][:scan=split|bf16][:inv=ieee|bf16x6][:k1=tile|halves]
        cps  chunks (of 32 tokens) per segment; absent = the occupancy heuristic, which may
             pick "unsegmented" when the grid already fills the device
        A    pass A as two launches (b_seg, then A_seg) or one fused launch
        B    pass B scan plain, or prefetching the next segment's A_seg / b_seg
        BW   state columns per program in the chunk-step passes (16, 32, 64 or 128)
        nw   warps per program of the chunk-step and scan kernels (4 or 8; default 4)
        scan precision of pass B: "split" (default: A_seg stored fp32, A_seg and h split into
             bf16 hi + lo parts, three MMAs) or "bf16" (A_seg stored bf16, bf16(A_seg) bf16(h):
             the production recipe, which drifts ~2x the unsegmented error on large states)
        inv  K1's fp32 products of the inverse: "ieee" (default: FMAs, the production recipe) or
             "bf16x6" (six bf16 tensor-core products of 3-way splits, fp32's 24 bits; faster)
        k1   K1's shape: "tile" (default: the 32-row tile, two full pivoted products of which the
             block structure keeps half) or "halves" (the two 16-row halves: the three kept
             blocks and 16x16 inverses only; the same workspace; docs/triton-flashkda.md
             has its measured cost)

Canonical names spell every key of the mode except ``nw``, ``scan``, ``inv`` and ``k1`` at their defaults
(``seg:cps=4:A=fused:B=prefetch:BW=32``; the heuristic's is ``seg:A=fused:B=prefetch:BW=32``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BW_CHOICES = (16, 32, 64, 128)
DEFAULT_BW = 32
DEFAULT_A = "fused"
DEFAULT_B = "prefetch"
DEFAULT_WARPS = 4
DEFAULT_SCAN = "split"
DEFAULT_INV = "ieee"
INV_CHOICES = ("ieee", "bf16x6")
DEFAULT_K1 = "tile"
K1_CHOICES = ("tile", "halves")
WARP_CHOICES = (4, 8)


class RouteError(ValueError):
    """A route name that does not parse; the message names the route."""


@dataclass(frozen=True)
class RouteSpec:
    segmented: bool                 # False: pass C alone from the initial state
    cps: Optional[int] = None       # chunks per segment; None = heuristic (segmented only)
    pass_a: str = DEFAULT_A         # "two" | "fused"
    pass_b: str = DEFAULT_B         # "plain" | "prefetch"
    bw: int = DEFAULT_BW
    warps: int = DEFAULT_WARPS
    scan: str = DEFAULT_SCAN
    inv: str = DEFAULT_INV          # K1's inverse products: "ieee" | "bf16x6"
    k1: str = DEFAULT_K1            # K1's shape: "tile" | "halves"

    @property
    def name(self) -> str:
        nw = "" if self.warps == DEFAULT_WARPS else f":nw={self.warps}"
        inv = ("" if self.inv == DEFAULT_INV else f":inv={self.inv}") + \
            ("" if self.k1 == DEFAULT_K1 else f":k1={self.k1}")
        if not self.segmented:
            return f"unseg:BW={self.bw}{nw}{inv}"
        cps = "" if self.cps is None else f":cps={self.cps}"
        scan = "" if self.scan == DEFAULT_SCAN else f":scan={self.scan}"
        return f"seg{cps}:A={self.pass_a}:B={self.pass_b}:BW={self.bw}{nw}{scan}{inv}"


def parse_route(name: str) -> RouteSpec:
    """``RouteSpec`` of a route name; RouteError (one line, naming the route) if it is bad."""
    if not isinstance(name, str) or not name.strip():
        raise RouteError(f"route: expected a name like 'unseg' or 'seg:cps=4:A=fused:B=prefetch:BW=32', got {name!r}")
    parts = name.strip().split(":")
    mode, rest = parts[0], parts[1:]
    if mode not in ("unseg", "seg"):
        raise RouteError(f"route {name!r}: expected it to start with 'unseg' or 'seg', got {mode!r}")
    allowed = ("BW", "nw", "inv", "k1") if mode == "unseg" else ("cps", "A", "B", "BW", "nw", "scan", "inv", "k1")
    vals: dict[str, str] = {}
    for part in rest:
        key, eq, val = part.partition("=")
        if not eq or key not in allowed:
            raise RouteError(f"route {name!r}: expected key=value with key in {'|'.join(allowed)} "
                             f"for mode {mode}, got {part!r}")
        if key in vals:
            raise RouteError(f"route {name!r}: key {key!r} given twice")
        vals[key] = val
    bw = _int(name, "BW", vals.get("BW", str(DEFAULT_BW)))
    if bw not in BW_CHOICES:
        raise RouteError(f"route {name!r}: expected BW in {BW_CHOICES}, got {bw}")
    nw = _int(name, "nw", vals.get("nw", str(DEFAULT_WARPS)))
    if nw not in WARP_CHOICES:
        raise RouteError(f"route {name!r}: expected nw in {WARP_CHOICES}, got {nw}")
    inv = vals.get("inv", DEFAULT_INV)
    if inv not in INV_CHOICES:
        raise RouteError(f"route {name!r}: expected inv={'|'.join(INV_CHOICES)}, got inv={inv}")
    k1 = vals.get("k1", DEFAULT_K1)
    if k1 not in K1_CHOICES:
        raise RouteError(f"route {name!r}: expected k1={'|'.join(K1_CHOICES)}, got k1={k1}")
    if mode == "unseg":
        return RouteSpec(segmented=False, bw=bw, warps=nw, inv=inv, k1=k1)
    cps = None
    if "cps" in vals:
        cps = _int(name, "cps", vals["cps"])
        if cps < 1:
            raise RouteError(f"route {name!r}: expected cps >= 1, got {cps}")
    pass_a = vals.get("A", DEFAULT_A)
    if pass_a not in ("two", "fused"):
        raise RouteError(f"route {name!r}: expected A=two|fused, got A={pass_a}")
    pass_b = vals.get("B", DEFAULT_B)
    if pass_b not in ("plain", "prefetch"):
        raise RouteError(f"route {name!r}: expected B=plain|prefetch, got B={pass_b}")
    scan = vals.get("scan", DEFAULT_SCAN)
    if scan not in ("split", "bf16"):
        raise RouteError(f"route {name!r}: expected scan=split|bf16, got scan={scan}")
    return RouteSpec(segmented=True, cps=cps, pass_a=pass_a, pass_b=pass_b, bw=bw, warps=nw, scan=scan, inv=inv,
                     k1=k1)


def _int(name: str, key: str, val: str) -> int:
    try:
        return int(val)
    except ValueError:
        raise RouteError(f"route {name!r}: expected an integer {key}, got {val!r}") from None


def route_names() -> list[str]:
    """The pinned routes the backend lists (canonical names): unsegmented at BW 32 / 64 / 8 warps;
    the heuristic, cps=1 and cps=4 crossed with both pass-A and both pass-B variants; cps=32, BW=64,
    8 warps and the bf16 scan on the default variants; BW=64 with the bf16x6 inverse and BW=64 with
    K1 on halves, each unsegmented and on the heuristic.  Any other well-formed name also runs (``parse_route``)."""
    names = [RouteSpec(False, bw=32).name, RouteSpec(False, bw=64).name, RouteSpec(False, bw=32, warps=8).name]
    for cps in (None, 1, 4):
        for a in ("two", "fused"):
            for b in ("plain", "prefetch"):
                names.append(RouteSpec(True, cps, a, b, DEFAULT_BW).name)
    names += [RouteSpec(True, 32).name, RouteSpec(True, None, bw=64).name, RouteSpec(True, None, warps=8).name,
              RouteSpec(True, None, scan="bf16").name, RouteSpec(True, 1, scan="bf16").name,
              RouteSpec(False, bw=64, inv="bf16x6").name, RouteSpec(True, None, bw=64, inv="bf16x6").name,
              RouteSpec(False, bw=64, k1="halves").name, RouteSpec(True, None, bw=64, k1="halves").name]
    return names
