"""Adapter: AMD aiter's FlashKDA forward (``flash_kda_fwd``), every aiter layout seen.

aiter is not on any package index; put its ``aiter/`` tree on PYTHONPATH and import it
with ``AITER_TRITON_ONLY=1``.  The module layouts seen:

    2026-08   aiter.ops.triton._triton_kernels.chunk_delta_attn.flash_kda   switch CHUNK_DELTA_ATTN_USE_FLASH_KDA
    newest    the same module path (fork copies; tools/assemble_aiter.py builds one tree): switch
              AITER_FDA_ENABLE, Gluon K1/K2 via AITER_FDA_USE_GLUON (module flags
              AITER_FDA_USE_GLUON_K1/K2), paged state_cache [slots, H, V, K] fp32 with
              state_indices int32 [N] and has_initial_state bool [N] (stride(0) may be padded), out=,
              launches through fast_launch wrappers (_prepare_fast, _segment_fast, _seg_scan_fast)
    renamed   aiter.ops.triton._triton_kernels.kimi_delta_attn.flash_kda    (tried first when present)

A paged problem's cache is handed to aiter as a copy with its own strides (slot padding
kept), which aiter writes in place; where flash_kda_fwd takes ``out=``, o is always written into
a buffer the adapter allocates, and a result that is not that buffer is refused.

chunk_kda (``aiter.ops.triton.attention.chunk_kda.chunk_kda``, the newest tree): chunked KDA prefill
at C = 64 as two Gluon kernels (prepare, then the walk; gfx950 adds a scan) on gfx1250 / gfx950, and on
any other arch a Triton fallback, ``kimi_delta_attn.chunk_kimi_delta_attn(..., state_v_first=True)``,
which dispatches to the kimi_delta_attn ``flash_kda_fwd`` (C = 32).  Routes ``chunk_kda:gluon`` and
``chunk_kda:triton``; which one a GPU has is decided by the module's own ``_ARCH``, so the other is
"not applicable" with the reason.  Its states are V-first fp32 [N, H, V, K] (a K-first Problem's
state is transposed in and out), its tokens one packed [1, T, H, 128] batch with cu_seqlens (a
dense [B, T] Problem goes in as B sequences of T tokens).  The fused gated RMSNorm output
(``out_gate``, ``norm_weight``, ``norm_eps``): route ``chunk_kda:gluon:norm`` (flag ``fused_norm``), for
Problems that carry them (kda_kernels.base.applicable keeps every other route off those).

Routes: ``<kernels>:<segmentation>[:prefetch=on|off]`` with kernels in triton | gluon |
gluon-k1 | gluon-k2 (AITER_FDA_USE_GLUON = 0 / 1 / k1 / k2) and segmentation in unseg |
seg | seg:cps=N (``chunks_per_seg`` = 0, None, N).  Gluon kernels exist only on gfx950
(the arch decides: on any other GPU those routes are "not applicable" with the reason);
the scan-prefetch switch AITER_FDA_SCAN_PREFETCH exists in no aiter version seen, so the
prefetch routes say so when the installed module lacks it.

Flags are set around each call and restored afterwards, so routes never leak into each
other; afterwards the adapter confirms which kernels actually launched (it counts
launches of the module's kernel objects) instead of trusting the flags, and refuses a
result whose launches contradict the route; a Triton route that counts no K1 or no K2 launch
is refused too (an aiter version launching through objects the adapter does not wrap).  Each
Triton kernel that would autotune among several configs is pinned to one for the call
(kda_kernels._autotune_pin with PIN_RULE: the first config with BW=32 in aiter's order, else
aiter's first), and any other autotuner launched with several configs raises instead of
benchmarking inside a verdict.
No AMD GPU exists where this project is developed: the Gluon routes are untested here.

Trace routes (kda_kernels.base.RunsTraces; docs/backends.md "Trace routes"):

    triton:unseg, triton:seg, triton:seg:cps=1, triton:seg:cps=4, gluon:seg, chunk_kda:triton,
    chunk_kda:gluon    prefill calls, the cache's V-first fp32 view as flash_kda_fwd's /
                       chunk_kda's ``state_cache`` (a private copy of the whole buffer is written
                       and copied back, as for a paged Problem); recipes as their Problem routes
    kda:gluon          decode and spec calls: ``aiter.ops.triton.attention.kda.fused_recurrent_kda``
                       (ssm_state_indices, num_accepted_tokens, inplace_final_state, pad_slot_guard),
                       the Gluon packed decode of gfx1250 / gfx950
                       (recipe aiter-decode-gfx1250 / aiter-decode-gfx950); it raises RuntimeError on
                       any other arch, so off AMD the route is not applicable.  aiter publishes no
                       Triton KDA decode (docs/backends.md says what was searched).

``debug_plan`` / ``run_pass`` (verification.investigating.debug) launch the module's Triton kernels one
pass at a time (K1, pass A, the scan, pass C) on oracle-fed inputs, with flash_kda_fwd's grids,
constexprs and segment descriptors (its own ``_build_segments``), kernel parameters with defaults
(the newest layout's paged ones, cache modifiers) at their defaults; dense states only.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
from typing import Optional

import torch

from kda_kernels.emulator import CHUNK_KDA_GLUON_RECIPES
from kda_ref.problem import Problem
from . import _autotune_pin
from .base import Outputs, Route, copy_with_padding, set_library_switch
from .trace_support import copy_back, paged_problem, problem_of_trace, trace_refusal

LAYOUTS = (
    ("kimi_delta_attn", "aiter.ops.triton._triton_kernels.kimi_delta_attn.flash_kda"),
    ("chunk_delta_attn", "aiter.ops.triton._triton_kernels.chunk_delta_attn.flash_kda"),
)
KERNEL_SETS = {"triton": (False, False), "gluon": (True, True), "gluon-k1": (True, False), "gluon-k2": (False, True)}
SEGMENTATIONS = ("unseg", "seg", "seg:cps=1", "seg:cps=4")
TRITON_KERNELS = {"K1": "_flash_kda_prepare_kernel", "K2": "_flash_kda_segment_kernel",
                  "scan": "_flash_kda_seg_scan_kernel"}
# the newest layout launches each Triton kernel through a fast_launch wrapper of it
FAST_LAUNCHERS = {"K1": "_prepare_fast", "K2": "_segment_fast", "scan": "_seg_scan_fast"}
# the gfx950 Gluon launchers of the fork layout (chunk_delta_attn) and of upstream's renamed one
# (kimi_delta_attn, which adds a Gluon pass C): (module, attribute, count key, called directly)
_GLUON_PKG = "aiter.ops.triton._gluon_kernels.gfx950.chunk_delta_attn."
_GLUON_PKG_KDA = "aiter.ops.triton._gluon_kernels.gfx950.kimi_delta_attn."
GLUON_LAUNCHERS = ((_GLUON_PKG + "flash_kda_k1", "gluon_k1_prepare", "gluon:K1", True),
                   (_GLUON_PKG + "flash_kda_k2", "k2_ab_fused_fast", "gluon:K2", False),
                   (_GLUON_PKG_KDA + "flash_kda_k1", "gluon_k1_prepare", "gluon:K1", True),
                   (_GLUON_PKG_KDA + "flash_kda_k2", "k2_ab_fused_fast", "gluon:K2", False),
                   (_GLUON_PKG_KDA + "flash_kda_k2", "k2_c_fast", "gluon:K2C", False))
GLUON_K2_KEYS = ("gluon:K2", "gluon:K2C")
FLAGS = ("AITER_FDA_ENABLE", "AITER_FDA_USE_GLUON_K1", "AITER_FDA_USE_GLUON_K2", "AITER_FDA_SCAN_PREFETCH",
         "CHUNK_DELTA_ATTN_USE_FLASH_KDA")
PINNED_BW = 32  # the K2 tile width each route pins where aiter would autotune among several
# Which config an autotuned aiter kernel is pinned to (kda_kernels._autotune_pin says why aiter's
# rule is not the fla one): the first with BW == PINNED_BW in aiter's order, else aiter's first.
PIN_RULE = _autotune_pin.first_matching(BW=PINNED_BW)
# chunk_kda (the newest tree): its host module, the kimi_delta_attn forward whose FlashKDA switch
# its Triton fallback goes through, the archs it runs Gluon on, and the Gluon kernels it launches
# as (attribute of chunk_kda holding the module, kernel attribute, count key)
CHUNK_KDA = "aiter.ops.triton.attention.chunk_kda"
CHUNK_FWD = "aiter.ops.triton._triton_kernels.kimi_delta_attn.chunk_fwd"
CHUNK_KDA_ARCHS = ("gfx1250", "gfx950")
CHUNK_KDA_GLUON_KERNELS = (("prepare", "chunk_kda_prepare_kernel", "gluon:prepare"),
                           ("walk", "chunk_kda_walk_kernel", "gluon:walk"),
                           ("walk", "chunk_kda_scan_kernel", "gluon:walk_scan"))
# route -> (kernels, emulator recipe of its baseline).  The fallback is aiter's Triton FlashKDA
# (flashkda).  The Gluon prepare/walk pair chunks at 64 with 16-row bands and an fp32 inverse by
# doubling and block substitution: of the recipes here the fla one (C = 64, 16-row anchors, fp32
# inverse) is the closest; a recipe of its own replaces it once one exists.
# route -> (kernels, recipe); the Gluon route's recipe is its GPU's (``_gluon_recipe``)
# chunk_kda:gluon:norm: the Gluon pair with the walk's fused gated RMSNorm (out_gate, norm_weight, norm_eps:
# FUSE_NORM), for Problems that carry the norm (only it takes them: kda_kernels.base.applicable)
CHUNK_KDA_ROUTES = {"chunk_kda:gluon": ("gluon", None), "chunk_kda:gluon:norm": ("gluon", None),
                    "chunk_kda:triton": ("triton", "flashkda")}
# the decode host (fused_recurrent_kda) and the emulator recipe of its Gluon kernel by arch
KDA_DECODE = "aiter.ops.triton.attention.kda"
DECODE_RECIPES = {"gfx1250": "aiter-decode-gfx1250", "gfx950": "aiter-decode-gfx950"}
_ROUTE_RE = re.compile(r"^(triton|gluon|gluon-k1|gluon-k2):(unseg|seg(?::cps=(\d+))?)(?::prefetch=(on|off))?$")


def _paged_cache_refusal(p: Problem, owner: str) -> Optional[str]:
    """Why ``owner``'s kernels cannot take ``p``'s paged cache (fp32 [slots, H, V, K] with dense slots,
    only stride(0) padded), or None when they can or ``p`` has none."""
    if not p.paged:
        return None
    sc = p.state_cache
    if sc.dtype != torch.float32:
        return f"not applicable: {owner}'s paged state_cache is fp32, got {sc.dtype}"
    if sc.stride(-1) != 1 or sc.stride(2) != p.K or sc.stride(1) != p.V * p.K:
        return (f"not applicable: {owner}'s paged state_cache needs dense [H, V, K] slots "
                f"(only stride(0) may be padded), got strides {tuple(sc.stride())}")
    return None


def parse_route(name: str) -> dict:
    """'gluon-k2:seg:cps=4:prefetch=on' -> entry "flash_kda", kernels, chunks_per_seg (0 =
    unsegmented, None = aiter's heuristic), prefetch (None = leave the library default);
    'chunk_kda:gluon' / 'chunk_kda:triton' -> entry "chunk_kda", kernels gluon / triton (segments
    and prefetch as the library decides)."""
    if name in CHUNK_KDA_ROUTES:
        return dict(entry="chunk_kda", kernels=CHUNK_KDA_ROUTES[name][0], chunks_per_seg=None, prefetch=None,
                    fused_norm=name.endswith(":norm"))
    m = _ROUTE_RE.match(name)
    if not m:
        raise ValueError(f"--route: expected <triton|gluon|gluon-k1|gluon-k2>:<unseg|seg|seg:cps=N>"
                         f"[:prefetch=on|off] or {' or '.join(CHUNK_KDA_ROUTES)} for aiter, got {name!r}")
    kernels, seg, cps, pf = m.groups()
    return dict(entry="flash_kda", kernels=kernels,
                chunks_per_seg=0 if seg == "unseg" else (int(cps) if cps else None),
                prefetch=None if pf is None else pf == "on")


def route_names() -> list[str]:
    names = [f"{k}:{s}" for k in KERNEL_SETS for s in SEGMENTATIONS]
    names += [f"triton:{s}:prefetch={p}" for s in ("seg", "seg:cps=4") for p in ("on", "off")]
    return names + list(CHUNK_KDA_ROUTES)


def current_arch() -> str:
    """'gfx950', 'gfx1250', 'sm90', ... of the active GPU, or 'none'."""
    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(0)
    gcn = getattr(props, "gcnArchName", "") or ""
    if gcn:
        return gcn.split(":")[0]
    return f"sm{props.major}{props.minor}"


class _LaunchCounter:
    """Wraps a Triton kernel object: ``kernel[grid](...)`` still launches, and is counted."""

    def __init__(self, kernel, counts: dict, key: str):
        self._kernel, self._counts, self._key = kernel, counts, key

    def __getitem__(self, grid):
        launcher = self._kernel[grid]

        def counted(*a, **kw):
            self._counts[self._key] = self._counts.get(self._key, 0) + 1
            return launcher(*a, **kw)
        return counted

    def __getattr__(self, name):
        return getattr(self._kernel, name)


class _CallCounter:
    """Wraps a launcher function: ``fn(...)`` still runs, and is counted."""

    def __init__(self, fn, counts: dict, key: str):
        self._fn, self._counts, self._key = fn, counts, key

    def __call__(self, *a, **kw):
        self._counts[self._key] = self._counts.get(self._key, 0) + 1
        return self._fn(*a, **kw)


class AiterBackend:
    name = "aiter"

    def __init__(self, module=None, chunk_kda=None, chunk_fwd=None, chunk_kda_why: str = "", kda=None):
        """``module``: an already-imported flash_kda module; ``chunk_kda`` / ``chunk_fwd``: the
        chunk_kda host module and the kimi_delta_attn forward module (tests pass recording fakes
        or modules imported under the interpreter; None imports them when a chunk_kda route asks,
        unless ``module`` is given: then chunk_kda is absent, ``chunk_kda_why`` saying why)."""
        self._mod = module
        self._layout = None
        self._why = None
        if module is not None:
            self._layout = getattr(module, "__aiter_layout__", "given")
        self._ck, self._ck_fwd = chunk_kda, chunk_fwd
        self._ck_why = None if chunk_kda is None and module is None else (chunk_kda_why if chunk_kda is None else "")
        self._kda, self._kda_why = kda, None      # aiter.ops.triton.attention.kda (the decode host)

    # ----- discovery -----------------------------------------------------------------
    def _load(self):
        if self._mod is not None or self._why is not None:
            return self._mod
        set_library_switch("aiter")
        errors = []
        for layout, path in LAYOUTS:
            try:
                self._mod = importlib.import_module(path)
                self._layout = layout
                return self._mod
            except Exception as e:  # ModuleNotFoundError, or aiter's arch probe failing without a GPU
                errors.append(f"{path}: {type(e).__name__}: {e}")
        self._why = ("aiter is not importable (put its aiter/ tree on PYTHONPATH; AITER_TRITON_ONLY=1): "
                     + " | ".join(errors))
        return None

    def _load_chunk_kda(self):
        """The chunk_kda host module, or None (``self._ck_why`` says why).  With a given flash_kda
        module and no given chunk_kda one, chunk_kda counts as absent (a recording fake of
        flash_kda_fwd alone)."""
        if self._ck is not None or self._ck_why:
            return self._ck
        if self._ck_why == "":
            self._ck_why = "aiter's chunk_kda was not given to this adapter"
            return None
        set_library_switch("aiter")
        try:
            self._ck = importlib.import_module(CHUNK_KDA)
        except Exception as e:  # ModuleNotFoundError (an older tree), or its arch probe failing
            self._ck_why = f"{CHUNK_KDA}: {type(e).__name__}: {e}"
            return None
        try:
            self._ck_fwd = importlib.import_module(CHUNK_FWD)
        except Exception:      # the fallback route then says it cannot set the FlashKDA switch
            self._ck_fwd = None
        return self._ck

    @staticmethod
    def _chunk_kda_arch(ck) -> str:
        """The arch chunk_kda dispatches on: its own ``_ARCH`` (read at import; on a CUDA device
        aiter's arch_info gives Triton's int capability, 90, named here sm90), else the GPU's."""
        arch = getattr(ck, "_ARCH", None)
        if isinstance(arch, int):
            return f"sm{arch}"
        return str(arch or current_arch())

    def _gluon_recipe(self) -> str:
        """The emulator recipe of chunk_kda's Gluon kernels on this GPU (aiter-gfx1250 / aiter-gfx950,
        which round where those kernels' sources round); off those archs, where the route is not
        applicable, the gfx1250 one names it."""
        ck = self._load_chunk_kda() if self._load() is not None else None
        arch = self._chunk_kda_arch(ck) if ck is not None else str(current_arch())
        return CHUNK_KDA_GLUON_RECIPES.get(arch, CHUNK_KDA_GLUON_RECIPES["gfx1250"])

    def available(self) -> tuple[bool, str]:
        if self._load() is None:
            return False, self._why
        if not torch.cuda.is_available() and self._layout != "given":
            return False, "aiter's FlashKDA needs a GPU (no CUDA/HIP device here)"
        return True, ""

    def version(self) -> str:
        mod = self._load()
        if mod is None:
            return "not installed"
        feats = [f for f in ("state_cache", "out") if self._supports(f)]
        feats += [f for f in FLAGS if hasattr(mod, f)]
        if any(hasattr(mod, a) for a in FAST_LAUNCHERS.values()):
            feats.append("fast_launch")
        ck = self._load_chunk_kda()
        if ck is not None:
            feats.append(f"chunk_kda on {self._chunk_kda_arch(ck)}")
        return f"aiter flash_kda ({self._layout} layout{', ' + ', '.join(feats) if feats else ''})"

    def _supports(self, arg: str) -> bool:
        try:
            return arg in inspect.signature(self._mod.flash_kda_fwd).parameters
        except (TypeError, ValueError, AttributeError):
            return False

    def routes(self) -> list[Route]:
        out = []
        for name in route_names():
            r = parse_route(name)
            flags = tuple(sorted(r.items(), key=lambda kv: kv[0]))
            if r["entry"] == "chunk_kda":
                kernels, recipe = CHUNK_KDA_ROUTES[name]
                recipe = recipe or self._gluon_recipe()
                what = ("the Gluon prepare and walk (gfx1250 / gfx950)" if kernels == "gluon" else
                        "the Triton fallback (chunk_kimi_delta_attn -> flash_kda_fwd) on other archs")
                what += ", the walk's fused gated RMSNorm (out_gate, norm_weight)" if r["fused_norm"] else ""
                out.append(Route(name, recipe=recipe, flags=flags, description=f"chunk_kda: {what}"))
                continue
            out.append(Route(name, recipe="flashkda", flags=flags,
                             description=f"AITER_FDA_USE_GLUON={r['kernels']}, chunks_per_seg={r['chunks_per_seg']}"))
        return out

    # ----- applicability -------------------------------------------------------------
    def route_exists(self, route: Route) -> tuple[bool, str]:
        """Whether this route exists with this aiter version on this GPU, and why not."""
        r = parse_route(route.name)
        if r["entry"] == "chunk_kda":
            return self._chunk_kda_route_exists(r)
        mod = self._load()
        if r["kernels"] != "triton":
            if mod is not None and not hasattr(mod, "AITER_FDA_USE_GLUON_K1"):
                return False, (f"not applicable: this aiter version ({self._layout} layout) has no Gluon "
                               f"FlashKDA kernels (no AITER_FDA_USE_GLUON)")
            arch = current_arch()
            if arch != "gfx950":
                return False, (f"not applicable: aiter's Gluon FlashKDA kernels run on gfx950 only; this GPU is "
                               f"{arch} (no AMD GPU is available to this project)")
        if r["prefetch"] is not None and mod is not None and not hasattr(mod, "AITER_FDA_SCAN_PREFETCH"):
            return False, ("not applicable: this aiter version has no scan-prefetch switch "
                           "(AITER_FDA_SCAN_PREFETCH is absent from the module)")
        return True, ""

    def _chunk_kda_route_exists(self, r: dict) -> tuple[bool, str]:
        ck = self._load_chunk_kda()
        if ck is None:
            return False, f"not applicable: this aiter tree has no chunk_kda ({self._ck_why})"
        arch = self._chunk_kda_arch(ck)
        if r["kernels"] == "gluon":
            if arch not in CHUNK_KDA_ARCHS:
                return False, (f"not applicable: aiter's chunk_kda runs its Gluon prepare and walk on "
                               f"{' / '.join(CHUNK_KDA_ARCHS)} only; this GPU is {arch}, where chunk_kda takes "
                               f"its Triton fallback (route chunk_kda:triton)")
            return True, ""
        if arch in CHUNK_KDA_ARCHS:
            return False, (f"not applicable: on {arch} aiter's chunk_kda takes its Gluon path (route "
                           f"chunk_kda:gluon); its Triton fallback runs on other archs only")
        if self._ck_fwd is None or not hasattr(self._ck_fwd, "AITER_FDA_ENABLE"):
            return False, ("not applicable: chunk_kda's Triton fallback calls chunk_kimi_delta_attn(out=, "
                           "state_cache=, ...), which needs upstream's kimi_delta_attn forward "
                           f"({CHUNK_FWD} with its AITER_FDA_ENABLE switch); this tree lacks it (the 2026-08 "
                           "chunk_kimi_delta_attn takes neither out nor state_cache)")
        if self._load() is None or self._layout == "chunk_delta_attn":
            return False, ("not applicable: chunk_kda's Triton fallback calls the kimi_delta_attn flash_kda_fwd, "
                           f"not importable here ({self._why or self._layout + ' layout only'})")
        return True, ""

    def _chunk_kda_accepts(self, p: Problem, r: dict) -> tuple[bool, str]:
        """chunk_kda's own limits: K = V = 128 (HEAD_DIM), one head count (no GVA), the fused gate
        lower_bound * sigmoid(exp(A_log) (g + dt_bias)), beta sigmoid and q/k l2norm in the kernel,
        bf16 q, k, v; lower_bound in [-5.5, 0) (chunk_kda_prepare asserts it), and on the Triton
        fallback in [-5, 0) (chunk_kimi_delta_attn raises outside its safe range); a paged cache
        fp32 with dense [H, V, K] slots (stride(0) may be padded)."""
        gluon = r["kernels"] == "gluon"
        if r.get("fused_norm") and not p.fused_norm:
            return False, ("not applicable: chunk_kda:gluon:norm applies the fused output norm; the problem has "
                           "no out_gate / norm_weight (route chunk_kda:gluon runs it without)")
        if p.K != 128 or p.V != 128:
            return False, f"not applicable: chunk_kda is specialised to K = V = 128, got K={p.K} V={p.V}"
        if p.HV != p.H:
            return False, f"not applicable: chunk_kda takes one head count for q, k and v (H={p.H}, HV={p.HV})"
        if p.gate != "lower_bound" or p.A_log is None:
            return False, ("not applicable: chunk_kda computes the gate lower_bound * sigmoid(exp(A_log) * "
                           f"(g + dt_bias)) itself; got gate {p.gate!r}" + ("" if p.A_log is not None else " without A_log"))
        if p.beta_kind != "sigmoid" or not p.qk_l2norm:
            return False, "not applicable: chunk_kda applies beta sigmoid and the q/k l2norm in the kernel"
        if any(t.dtype != torch.bfloat16 for t in (p.q, p.k, p.v)):
            return False, (f"not applicable: chunk_kda takes bf16 q, k, v, got {p.q.dtype} / {p.k.dtype} / "
                           f"{p.v.dtype}")
        lo = -5.5 if gluon else -5.0
        if not lo <= float(p.lower_bound) < 0:
            who = ("chunk_kda_prepare asserts" if gluon else
                   "the Triton fallback's chunk_kimi_delta_attn raises outside its safe range:")
            return False, f"not applicable: {who} lower_bound in [{lo}, 0), got {p.lower_bound}"
        why = _paged_cache_refusal(p, "chunk_kda")
        if why:
            return False, why
        if not gluon and p.N * p.H > 65535:
            return False, (f"not applicable: N*H = {p.N * p.H} exceeds the CUDA grid-y limit 65535 of the "
                           "fallback's flash_kda scan")
        return True, ""

    def accepts(self, p: Problem, route: Route) -> tuple[bool, str]:
        ok, why = self.route_exists(route)
        if not ok:
            return ok, why
        r = parse_route(route.name)
        if r["entry"] == "chunk_kda":
            return self._chunk_kda_accepts(p, r)
        if p.K != 128 or p.V != 128:
            return False, f"not applicable: FlashKDA needs K = V = 128, got K={p.K} V={p.V}"
        if p.HV != p.H:
            return False, f"not applicable: FlashKDA has no GVA (H={p.H}, HV={p.HV})"
        if p.gate != "lower_bound" or p.A_log is None:
            return False, "not applicable: FlashKDA needs the lower_bound gate with A_log"
        if not -5.55 < float(p.lower_bound) < 0:
            return False, f"not applicable: FlashKDA's pivot overflows fp32 for lower_bound <= -5.55, got {p.lower_bound}"
        if p.beta_kind != "sigmoid" or not p.qk_l2norm:
            return False, "not applicable: FlashKDA needs beta sigmoid and qk l2norm in the kernel"
        if p.q.dtype != torch.bfloat16 or p.v.dtype != torch.bfloat16:
            return False, f"not applicable: FlashKDA needs bf16 q and v, got {p.q.dtype} / {p.v.dtype}"
        if p.paged and not self._supports("state_cache"):
            return False, f"not applicable: this aiter version ({self._layout} layout) has no paged state cache"
        why = _paged_cache_refusal(p, "aiter")
        if why:
            return False, why
        if p.N * p.H > 65535:
            return False, f"not applicable: N*H = {p.N * p.H} exceeds the CUDA grid-y limit 65535 of aiter's scan"
        return True, ""

    # ----- running ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _pinned(self, r: dict, counts: dict):
        """Set the route's module flags, count kernel launches and pin every Triton kernel that
        would autotune among several configs to one (``_autotune_pin.pinned`` with PIN_RULE,
        which also makes any other autotuner launched with several configs raise); restore
        everything after."""
        mod = self._mod
        saved = {}
        to_pin = {}

        def setattr_saved(name, value, owner=None):
            owner = mod if owner is None else owner
            if hasattr(owner, name):
                saved[(id(owner), name)] = (owner, getattr(owner, name))
                setattr(owner, name, value)

        k1, k2 = KERNEL_SETS[r["kernels"]]
        setattr_saved("AITER_FDA_USE_GLUON_K1", k1)
        setattr_saved("AITER_FDA_USE_GLUON_K2", k2)
        if r["prefetch"] is not None:
            setattr_saved("AITER_FDA_SCAN_PREFETCH", r["prefetch"])
        env_saved = os.environ.pop("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", None)  # the explicit argument decides
        for key, attr in TRITON_KERNELS.items():
            if hasattr(mod, attr):
                kernel = getattr(mod, attr)
                configs = getattr(_autotune_pin.find_autotuner(kernel), "configs", None)
                if configs and len(configs) > 1:  # pin one config: no autotuning inside a verdict
                    to_pin[key] = kernel
                setattr_saved(attr, _LaunchCounter(kernel, counts, key))
        for key, attr in FAST_LAUNCHERS.items():     # fast_launch wrappers hold the kernel itself
            if hasattr(mod, attr):
                setattr_saved(attr, _LaunchCounter(getattr(mod, attr), counts, key))
        if r["kernels"] != "triton" and hasattr(mod, "AITER_FDA_USE_GLUON_K1"):
            for modname, attr, key, direct in GLUON_LAUNCHERS:
                try:
                    gmod = importlib.import_module(modname)
                except Exception:   # absent from this tree: the route then counts no Gluon launch and is refused
                    continue
                if hasattr(gmod, attr):
                    fn = getattr(gmod, attr)
                    setattr_saved(attr, (_CallCounter if direct else _LaunchCounter)(fn, counts, key), owner=gmod)
        for attr in [a for a in dir(mod) if "gluon" in a.lower() and callable(getattr(mod, a, None))
                     and hasattr(getattr(mod, a), "__getitem__") and not a.startswith("AITER")]:
            setattr_saved(attr, _LaunchCounter(getattr(mod, attr), counts, f"gluon:{attr}"))
        try:
            with _autotune_pin.pinned(to_pin, context=f"aiter ({self._layout} layout)", rule=PIN_RULE):
                for key, kernel in to_pin.items():   # the one config each holds while pinned
                    counts[f"{key}:config"] = str(_autotune_pin.find_autotuner(kernel).configs[0].kwargs)
                yield
        finally:
            for (_, name), (owner, value) in saved.items():
                setattr(owner, name, value)
            if env_saved is not None:
                os.environ["CHUNK_DELTA_ATTN_FLASH_KDA_SEG"] = env_saved

    def call_arguments(self, p: Problem, r: dict) -> dict:
        """Keyword arguments of flash_kda_fwd for one Problem (layouts and dtypes as aiter wants)."""
        kw = dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, A_log=p.A_log.to(torch.float32),
                  dt_bias=None if p.dt_bias is None else p.dt_bias.reshape(-1).to(torch.float32),
                  scale=p.scale_value, lower_bound=float(p.lower_bound),
                  output_final_state=bool(p.output_final_state) and not p.paged,
                  state_v_first=p.state_layout in ("vk", "paged"), chunks_per_seg=r["chunks_per_seg"])
        if p.cu_seqlens is not None:
            kw["cu_seqlens"] = p.cu_seqlens.to(device=p.device, dtype=torch.int64).clone()
        if p.initial_state is not None:
            kw["initial_state"] = p.initial_state.to(torch.float32)
        if p.paged:   # written in place: a private copy with the Problem's strides (slot padding kept)
            kw.update(state_cache=copy_with_padding(p.state_cache), state_indices=p.state_indices.to(torch.int32),
                      has_initial_state=p.has_initial_state.bool())
        if p.paged or self._supports("out"):
            kw["out"] = torch.empty_like(p.v)
        return kw

    @staticmethod
    def confirm(r: dict, counts: dict, segmented_expected: Optional[bool]) -> str:
        """Describe what launched; raise if it contradicts the route."""
        counts = {k: v for k, v in counts.items() if not k.endswith(":config")}
        gluon = sum(v for k, v in counts.items() if k.startswith("gluon:"))
        wants_gluon = r["kernels"] != "triton"
        if not wants_gluon and gluon:
            raise RuntimeError(f"aiter route {r['kernels']} launched Gluon kernels: {counts}")
        if wants_gluon and not gluon:
            raise RuntimeError(f"aiter route {r['kernels']} launched no Gluon kernel: {counts}")
        gluon_k1, gluon_k2 = KERNEL_SETS[r["kernels"]]
        gk1, gk2 = counts.get("gluon:K1", 0), sum(counts.get(k, 0) for k in GLUON_K2_KEYS)
        if gk1 and not gluon_k1:
            raise RuntimeError(f"aiter route {r['kernels']} asks for the Triton K1 but the Gluon K1 launched: {counts}")
        if gk2 and not gluon_k2:
            raise RuntimeError(f"aiter route {r['kernels']} asks for the Triton K2 but a Gluon K2 launched: {counts}")
        scans = counts.get("scan", 0)
        if segmented_expected is True and not scans:
            raise RuntimeError(f"aiter route asked for segmentation but no scan launched: {counts}")
        if segmented_expected is False and scans:
            raise RuntimeError(f"aiter route asked for no segmentation but the scan launched: {counts}")
        k1 = counts.get("K1", 0) or (gluon if gluon_k1 else 0)
        k2 = counts.get("K2", 0) or gk2
        for name, n in (("K1", k1), ("K2", k2)):
            if not n:
                raise RuntimeError(f"aiter route {r['kernels']}: counted no {name} launch ({counts or 'none at all'}); "
                                   "this aiter version launches through objects the adapter does not wrap")
        return ", ".join(f"{k}x{v}" for k, v in sorted(counts.items())) or "no launches counted"

    # ----- chunk_kda ---------------------------------------------------------------------
    def chunk_kda_arguments(self, p: Problem) -> dict:
        """Keyword arguments of chunk_kda for one Problem.

        Tokens as one packed batch [1, B*T, H, 128] with cu_seqlens (int64 [N+1]; a dense [B, T]
        Problem is B sequences of T tokens); A_log [H] and dt_bias [H*K] fp32 (zeros when the
        Problem has none: g + 0 is g); states V-first fp32 [N, H, V, K] (a K-first initial state
        transposed); o written into an ``out`` buffer the adapter allocates; a paged cache a
        private copy with the Problem's strides (slot padding kept), which chunk_kda writes in place."""
        B, T, H, K = p.q.shape
        dev = p.q.device

        def packed(t):
            return t.reshape(1, B * T, *t.shape[2:]).contiguous()
        if p.cu_seqlens is not None:
            cu = p.cu_seqlens.to(device=dev, dtype=torch.int64).clone()
        else:
            cu = torch.arange(B + 1, device=dev, dtype=torch.int64) * T
        dt = (torch.zeros(H * K, device=dev, dtype=torch.float32) if p.dt_bias is None
              else p.dt_bias.reshape(-1).to(torch.float32).contiguous())
        kw = dict(q=packed(p.q), k=packed(p.k), v=packed(p.v), g=packed(p.g), beta=packed(p.beta),
                  A_log=p.A_log.reshape(-1).to(torch.float32).contiguous(), dt_bias=dt,
                  lower_bound=float(p.lower_bound), cu_seqlens=cu, scale=p.scale_value,
                  output_final_state=bool(p.output_final_state) and not p.paged)
        if p.initial_state is not None:
            h0 = p.initial_state.to(torch.float32)
            kw["initial_state"] = (h0.transpose(-1, -2) if p.state_layout == "kv" else h0).contiguous()
        if p.paged:
            kw.update(state_cache=copy_with_padding(p.state_cache),
                      state_indices=p.state_indices.to(device=dev, dtype=torch.int32).contiguous(),
                      has_initial_state=p.has_initial_state.to(device=dev).bool().contiguous())
        if p.fused_norm:                    # the walk's fused gated RMSNorm (chunk_kda:gluon:norm)
            kw.update(out_gate=packed(p.out_gate), norm_weight=p.norm_weight.to(device=dev).contiguous(),
                      norm_eps=float(p.norm_eps))
        kw["out"] = torch.empty_like(kw["v"])
        return kw

    @contextlib.contextmanager
    def _chunk_kda_counted(self, counts: dict):
        """Count launches of chunk_kda's Gluon kernels (where its module holds them); restore after."""
        saved = []
        for holder, attr, key in CHUNK_KDA_GLUON_KERNELS:
            owner = getattr(self._ck, holder, None)
            if owner is not None and hasattr(owner, attr):
                saved.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, _LaunchCounter(getattr(owner, attr), counts, key))
        try:
            yield
        finally:
            for owner, attr, value in reversed(saved):
                setattr(owner, attr, value)

    @contextlib.contextmanager
    def _flash_kda_enabled(self):
        """chunk_kimi_delta_attn's FlashKDA switch on for the call (the fallback route is the FlashKDA
        path; with it off aiter would run its C = 64 pipeline, which takes no out= or state_cache)."""
        fwd = self._ck_fwd
        before = fwd.AITER_FDA_ENABLE
        fwd.AITER_FDA_ENABLE = True
        try:
            yield
        finally:
            fwd.AITER_FDA_ENABLE = before

    @staticmethod
    def confirm_chunk_kda(r: dict, counts: dict) -> str:
        """Describe what chunk_kda launched; raise if it contradicts the route: the Gluon route runs
        one prepare and at least one walk and no Triton FlashKDA kernel; the fallback route is
        checked as the FlashKDA route triton:seg (K1 and K2, no Gluon kernel)."""
        launched = {k: v for k, v in counts.items() if not k.endswith(":config")}
        if r["kernels"] == "gluon":
            triton = {k: v for k, v in launched.items() if not k.startswith("gluon:")}
            if triton or launched.get("gluon:prepare", 0) != 1 or not launched.get("gluon:walk", 0):
                raise RuntimeError(f"aiter route chunk_kda:gluon: expected one Gluon prepare and the walk, "
                                   f"counted {launched or 'none at all'}")
            return ", ".join(f"{k}x{v}" for k, v in sorted(launched.items()))
        return AiterBackend.confirm(dict(r, kernels="triton"), counts, None)

    def _run_chunk_kda(self, p: Problem, r: dict) -> Outputs:
        if self._load_chunk_kda() is None:
            raise RuntimeError(self._ck_why)
        kw = self.chunk_kda_arguments(p)
        counts: dict = {}
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._chunk_kda_counted(counts))
            if r["kernels"] == "triton":
                if self._load() is None:
                    raise RuntimeError(self._why)
                stack.enter_context(self._flash_kda_enabled())
            if self._load() is not None:    # FlashKDA's launches counted on the Gluon route too (none may run)
                stack.enter_context(self._pinned(dict(r, kernels="triton"), counts))
            stack.enter_context(torch.inference_mode())
            o, final = self._ck.chunk_kda(**kw)
        ran = self.confirm_chunk_kda(r, counts)
        if o is not None and o.data_ptr() != kw["out"].data_ptr():
            raise RuntimeError("aiter chunk_kda(out=...) returned o in another buffer than out")
        o = kw["out"].reshape(p.v.shape)
        pinned = {k: v for k, v in counts.items() if k.endswith(":config") and counts.get(k[:-len(":config")])}
        if pinned:
            ran += "; pinned " + ", ".join(f"{k}={v}" for k, v in pinned.items())
        info = {"route_ran": ran, "layout": "chunk_kda on " + self._chunk_kda_arch(self._ck)}
        if p.paged:
            return Outputs(o=o, state_cache=kw["state_cache"], info=info)
        if not p.output_final_state:
            return Outputs(o=o, info=info)
        if final is None:
            raise RuntimeError("aiter chunk_kda(output_final_state=True) returned no final state")
        final = final.transpose(-1, -2) if p.state_layout == "kv" else final
        return Outputs(o=o, final_state=final, info=info)

    def run(self, p: Problem, route: Route) -> Outputs:
        r = parse_route(route.name)
        if r["entry"] == "chunk_kda":
            return self._run_chunk_kda(p, r)
        if self._load() is None:
            raise RuntimeError(self._why)
        kw = self.call_arguments(p, r)
        n_chunks_max = max([-(-(e - b) // 32) for b, e in p.seq_bounds()] + [0])
        cps = r["chunks_per_seg"]
        segmented_expected = None if cps is None else (cps > 0 and n_chunks_max > cps)
        counts: dict = {}
        with self._pinned(r, counts), torch.inference_mode():
            o, final = self._mod.flash_kda_fwd(**kw)
        ran = self.confirm(r, counts, segmented_expected)
        out_buf = kw.get("out")
        if out_buf is not None:
            if o is not None and o.data_ptr() != out_buf.data_ptr():
                raise RuntimeError("aiter flash_kda_fwd(out=...) returned o in another buffer than out")
            o = out_buf
        pinned = {k: v for k, v in counts.items() if k.endswith(":config")}
        if pinned:
            ran += "; pinned " + ", ".join(f"{k}={v}" for k, v in pinned.items())
        if p.paged:
            return Outputs(o=o, state_cache=kw["state_cache"],
                           info={"route_ran": ran, "layout": self._layout})
        return Outputs(o=o, final_state=final if p.output_final_state else None,
                       info={"route_ran": ran, "layout": self._layout})

    # ----- serving-trace calls (kda_kernels.base.RunsTraces) --------------------------------
    TRACE_PREFILL_ROUTES = ("triton:unseg", "triton:seg", "triton:seg:cps=1", "triton:seg:cps=4", "gluon:seg",
                            "chunk_kda:triton", "chunk_kda:gluon")

    def _load_kda(self):
        """aiter.ops.triton.attention.kda (fused_recurrent_kda, the decode host), or None
        (``self._kda_why`` says why)."""
        if self._kda is not None or self._kda_why:
            return self._kda
        set_library_switch("aiter")
        try:
            self._kda = importlib.import_module(KDA_DECODE)
        except Exception as e:  # ModuleNotFoundError (an older tree), or its arch probe failing
            self._kda_why = f"{KDA_DECODE}: {type(e).__name__}: {e}"
        return self._kda

    def _kda_arch(self) -> str:
        kda = self._load_kda()
        arch = getattr(kda, "_ARCH", None) if kda is not None else None
        if isinstance(arch, int):
            return f"sm{arch}"
        return str(arch or current_arch())

    def trace_routes(self) -> list[Route]:
        by = {r.name: r for r in self.routes()}
        out = [Route(n, recipe=by[n].recipe, flags=(("groups", ("prefill",)),) + by[n].flags,
                     description=f"prefill: {by[n].description}, the trace cache's V-first fp32 view as state_cache")
               for n in self.TRACE_PREFILL_ROUTES]
        recipe = DECODE_RECIPES.get(self._kda_arch(), DECODE_RECIPES["gfx1250"])
        out.append(Route("kda:gluon", recipe=recipe, flags=(("groups", ("decode", "spec")),),
                         description="decode and spec: fused_recurrent_kda (attention/kda.py), the Gluon packed "
                                     "decode of gfx1250 / gfx950, on the cache view in place"))
        return out

    def trace_accepts(self, trace, route: Route) -> tuple[bool, str]:
        if route.name == "kda:gluon":
            return self._kda_trace_accepts(trace)
        if route.name not in self.TRACE_PREFILL_ROUTES:
            return False, f"not applicable: unknown aiter trace route {route.name!r}"
        ok, why = self.accepts(problem_of_trace(trace), route)
        if not ok:
            return ok, why
        if parse_route(route.name)["entry"] == "flash_kda" and not self._supports("state_cache"):
            return False, f"not applicable: this aiter version ({self._layout} layout) has no paged state cache"
        owner = "chunk_kda" if route.name.startswith("chunk_kda") else "aiter's flash_kda_fwd"
        why = trace_refusal(trace, owner, layouts=("vk",), dtypes=("float32",))
        return (False, why) if why else (True, "")

    def _kda_trace_accepts(self, trace) -> tuple[bool, str]:
        """fused_recurrent_kda's limits, read from kda.py and both kda_decode.py kernels: an AMD
        gfx1250 / gfx950 GPU, fp32 state slabs dense in [HV, ., .] (the slot stride a whole number
        of rows); on gfx950 V-first only and no speculative rows (static_assert); A_log with the
        in-kernel gate.  The calls run with pad_slot_guard (a row whose slot is <= 0 is skipped, its
        o zero), which takes padding rows at -1 and at the NULL block 0 alike, and, under pad -1,
        would skip a live row given slot 0 too: such a trace is not applicable (the emulator's
        aiter-decode recipes decide the same)."""
        kda = self._load_kda()
        if kda is None:
            return False, f"not applicable: this aiter tree has no KDA decode host ({self._kda_why})"
        arch = self._kda_arch()
        if getattr(kda, "fused_recurrent_kda_packed_decode_kernel", None) is None or arch not in CHUNK_KDA_ARCHS:
            return False, (f"not applicable: aiter's fused_recurrent_kda (attention/kda.py) is the Gluon packed "
                           f"decode of gfx1250 / gfx950 only and raises RuntimeError elsewhere; this GPU is {arch} "
                           f"(aiter has no Triton KDA decode)")
        p = problem_of_trace(trace)
        if p.gate in ("lower_bound", "softplus") and p.A_log is None:
            return False, "not applicable: fused_recurrent_kda asserts A_log with the in-kernel gate"
        why = trace_refusal(trace, "fused_recurrent_kda", layouts=("vk",) if arch == "gfx950" else ("vk", "kv"),
                            dtypes=("float32",))
        if why:
            return False, why
        if arch == "gfx950" and bool((trace.row_phase == 2).any()):
            return False, "not applicable: gfx950's kda_decode kernel has no speculative decoding (static_assert)"
        live = (trace.row_phase == 1) | (trace.row_phase == 2)
        if trace.cache.pad == "minus1" and bool((trace.state_indices[live] == 0).any()):
            return False, ("not applicable: fused_recurrent_kda's pad_slot_guard takes slots <= 0 for padding, "
                           "and this trace (pad -1) gives slot 0 to a decode or spec row")
        return True, ""

    def kda_call_arguments(self, call) -> dict:
        """Keyword arguments of fused_recurrent_kda for a decode or spec PhaseCall: the cache's
        [slots, HV, ., .] view as initial_state, written in place (inplace_final_state);
        pad_slot_guard on (padding rows at -1 or 0 skipped)."""
        m = call.model
        gate_in = m["gate"] in ("lower_bound", "softplus")
        kw = dict(q=call.q, k=call.k, v=call.v, g=call.g, beta=call.beta, scale=m["scale"],
                  initial_state=call.slots_view(), output_final_state=False, inplace_final_state=True,
                  state_v_first=call.spec.layout == "vk", cu_seqlens=call.cu_seqlens.to(torch.int64).contiguous(),
                  ssm_state_indices=call.state_indices.contiguous(),
                  num_accepted_tokens=(None if call.num_accepted_tokens is None
                                       else call.num_accepted_tokens.contiguous()),
                  use_qk_l2norm_in_kernel=bool(m["qk_l2norm"]), use_gate_in_kernel=gate_in,
                  use_beta_sigmoid_in_kernel=m["beta_kind"] in ("sigmoid", "sigmoid2"),
                  allow_neg_eigval=m["beta_kind"] == "sigmoid2", pad_slot_guard=True)
        if gate_in:
            kw.update(A_log=m["A_log"].to(torch.float32).contiguous(),
                      dt_bias=None if m["dt_bias"] is None else m["dt_bias"].reshape(-1).to(torch.float32).contiguous(),
                      lower_bound=float(m["lower_bound"]) if m["gate"] == "lower_bound" else None)
        return kw

    def run_call(self, call, route: Route) -> torch.Tensor:
        if route.name == "kda:gluon":
            kda = self._load_kda()
            if kda is None:
                raise RuntimeError(self._kda_why)
            with torch.inference_mode():
                o, _ = kda.fused_recurrent_kda(**self.kda_call_arguments(call))
            return o
        if call.group != "prefill":
            raise ValueError(f"call: aiter route {route.name} runs prefill calls, got a {call.group} call")
        out = self.run(paged_problem(call), route)
        copy_back(call, out.state_cache)
        return out.o

    # ----- per-pass debugging (verification.investigating.debug) -------------------------------------
    #
    # aiter's launchers, one at a time, with the grids and constexprs flash_kda_fwd uses:
    #   K1  _flash_kda_prepare_kernel[(tiles | NT, B*H)]          -> ws_kd ws_qd ws_kr ws_gt ws_inv_mqk
    #   A   _flash_kda_segment_kernel twice, (V/BW, segs*H):     h=0, v        -> b_seg [segs,H,K,V] fp32
    #                                                            h=I, v=0, W=K -> A_seg [segs,H,K,K] bf16
    #   B   _flash_kda_seg_scan_kernel[(V/32, N*H)], BV=32        -> h_in [segs,H,K,V] fp32
    #   C   _flash_kda_segment_kernel, HAS_H_IN, COMPUTE_OUTPUT   -> o (like v), final state
    # Layouts are the oracle's (kda_ref.workspace, kda_ref.segments): workspace head-major,
    # ws_idx = h * tiles + tile; states K-first.  aiter keeps INV and Mqk in one fp16 buffer
    # ws_inv_mqk [H*tiles, 2C, C] (rows 0..C-1 INV, rows C..2C-1 Mqk): K1 returns its two halves
    # as ws_inv and ws_mqk, and passes A and C pack the fed ones back.  aiter has no ws_beta:
    # passes A and C take sigmoid(beta) of the Problem's raw beta in-kernel, so K1 returns none.
    # The final state of pass C is written K-first (STATE_V_FIRST off) whatever the Problem's
    # layout; a V-first initial state is transposed to K-first as flash_kda_fwd does.
    PASS_NAMES = ("K1", "A", "B", "C")

    def _segment_geometry(self, p: Problem, r: dict) -> dict:
        """Tiles and segments exactly as flash_kda_fwd derives them (its own _build_segments)."""
        mod = self._mod
        C = int(mod.FLASH_KDA_CHUNK)
        dev = p.q.device
        if p.cu_seqlens is not None:
            cu = p.cu_seqlens.to(device=dev, dtype=torch.int64)
            chunk_indices = mod.prepare_chunk_indices(cu, C)
            N, NT, total_tiles = cu.numel() - 1, 0, int(chunk_indices.shape[0])
            bounds = cu.tolist()
            seqs = tuple((bounds[i], bounds[i + 1]) for i in range(N))
        else:
            cu, chunk_indices = None, None
            N, NT = p.B, -(-p.T // C)
            total_tiles = p.B * NT
            seqs = tuple((b * p.T, b * p.T + p.T) for b in range(p.B))
        n_chunks_max = max(-(-(e - b) // C) for b, e in seqs)
        cps = r["chunks_per_seg"]
        if cps is None:     # aiter's heuristic, without the env override (run() removes it too)
            env_saved = os.environ.pop("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", None)
            try:
                cps = int(mod._choose_chunks_per_seg(n_chunks_max, N, p.H, p.V))
            finally:
                if env_saved is not None:
                    os.environ["CHUNK_DELTA_ATTN_FLASH_KDA_SEG"] = env_saved
        elif cps <= 0:
            cps = n_chunks_max
        desc, seq_seg_off, num_segs, max_segs = mod._build_segments(seqs, C, cps, dev)
        return dict(C=C, N=N, NT=NT, total_tiles=total_tiles, cu_seqlens=cu, chunk_indices=chunk_indices,
                    cps=cps, desc=desc, seq_seg_off=seq_seg_off, num_segs=int(num_segs),
                    segmented=int(max_segs) > 1)

    def _pass_setup(self, p: Problem, route) -> tuple[dict, dict]:
        if self._load() is None:
            raise RuntimeError(self._why)
        name = route.name if isinstance(route, Route) else str(route)
        r = parse_route(name)
        if r["kernels"] != "triton":
            raise ValueError(f"--route: per-pass runs use aiter's Triton launchers (triton:...), got {name!r}")
        if p.paged:
            raise ValueError("problem: not applicable: aiter per-pass runs take dense states only, "
                             "got state_layout='paged'")
        ok, why = self.accepts(p, Route(name, recipe="flashkda"))
        if not ok:
            raise ValueError(f"problem: {why}")
        return r, self._segment_geometry(p, r)

    def debug_plan(self, problem: Problem, route) -> dict:
        """Chunk size 32, the chunks per segment the route resolves to (None: unsegmented, i.e.
        every sequence fits one segment, as flash_kda_fwd decides by its segment count), and
        the passes it runs."""
        _, geo = self._pass_setup(problem, route)
        seg = geo["segmented"]
        return dict(form="flashkda", chunk_size=geo["C"], chunks_per_seg=geo["cps"] if seg else None,
                    passes=["K1", "A", "B", "C"] if seg else ["K1", "C"])

    @staticmethod
    def _initial_state_kfirst(p: Problem) -> Optional[torch.Tensor]:
        """The dense initial state as [N, H, K, V] fp32 (a V-first one transposed), or None."""
        if p.initial_state is None:
            return None
        h0 = p.initial_state
        if p.state_layout == "vk":
            h0 = h0.transpose(-1, -2)
        return h0.to(device=p.q.device, dtype=torch.float32).contiguous()

    def _workspace_from_feed(self, feed: dict, p: Problem, geo: dict, pass_name: str) -> dict:
        """The fed float64 workspace rounded to aiter's dtypes; ws_inv and ws_mqk packed into
        ws_inv_mqk [H*tiles, 2C, C] fp16."""
        need = ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk")
        missing = [n for n in need if n not in feed]
        if missing:
            raise ValueError(f"feed: pass {pass_name} needs {', '.join(missing)}, got {sorted(feed)}")
        dev, C, K = p.q.device, geo["C"], p.K
        rows = p.H * geo["total_tiles"]
        shapes = dict(ws_kd=(rows, C, K), ws_qd=(rows, C, K), ws_kr=(rows, C, K), ws_gt=(rows, K),
                      ws_inv=(rows, C, C), ws_mqk=(rows, C, C))
        for n, shape in shapes.items():
            if tuple(feed[n].shape) != shape:
                raise ValueError(f"feed: {n} expected shape {list(shape)}, got {list(feed[n].shape)}")
        ws = {n: feed[n].to(device=dev, dtype=torch.bfloat16).contiguous() for n in ("ws_kd", "ws_qd", "ws_kr")}
        ws["ws_gt"] = feed["ws_gt"].to(device=dev, dtype=torch.float32).contiguous()
        ws["ws_inv_mqk"] = torch.cat([feed["ws_inv"].to(device=dev, dtype=torch.float16),
                                      feed["ws_mqk"].to(device=dev, dtype=torch.float16)], dim=1).contiguous()
        return ws

    def _segment_common(self, p: Problem, geo: dict, ws: dict, v: torch.Tensor, beta: torch.Tensor) -> dict:
        """The arguments flash_kda_fwd passes to every _flash_kda_segment_kernel launch."""
        desc = geo["desc"]
        return dict(ws_kd=ws["ws_kd"], ws_qd=ws["ws_qd"], ws_kr=ws["ws_kr"], ws_gt=ws["ws_gt"],
                    ws_inv_mqk=ws["ws_inv_mqk"], beta_raw=beta,
                    seg_chunk_base=desc[0], seg_nchunks=desc[1], seg_tok_base=desc[2], seg_tok_end=desc[3],
                    seg_seq=desc[4], seg_is_last=desc[5], TOTAL_TILES=geo["total_tiles"],
                    NUM_SEGS_CLASS=self._mod._seg_occupancy_class(geo["num_segs"]),
                    H=p.H, K=p.K, V=p.V, C=geo["C"], STATE_V_FIRST=False)

    def _launch(self, attr: str, grid, **kwargs) -> None:
        """``mod.<attr>[grid](**kwargs)``, after checking that the kernel takes exactly these
        arguments (plus those its heuristics and configs supply, and those with defaults): the launchers
        here follow the 2026-08 module, and another aiter version's kernel must refuse in words, not
        mis-bind."""
        kernel = getattr(self._mod, attr, None)
        if kernel is None:
            raise ValueError(f"--backend: not applicable: this aiter version ({self._layout} layout) has no {attr}")
        supplied, arg_names, defaults, k = set(), None, {}, kernel
        while k is not None and hasattr(k, "arg_names"):
            supplied |= set(getattr(k, "values", None) or {})                      # triton.heuristics
            supplied |= {n for c in (getattr(k, "configs", None) or []) for n in c.kwargs}   # autotune configs
            arg_names = list(k.arg_names)
            k = getattr(k, "fn", None)
        if callable(k) and arg_names is not None:    # the kernel's Python function: its defaults
            try:
                defaults = {n: q.default for n, q in inspect.signature(k).parameters.items()
                            if q.default is not inspect.Parameter.empty}
            except (TypeError, ValueError):
                defaults = {}
        # parameters with defaults (the newest layout's paged ones, cache modifiers) at their defaults, passed
        # explicitly: aiter's heuristics read them from the launch's arguments
        kwargs = {**{n: v for n, v in defaults.items() if n not in supplied and n not in kwargs}, **kwargs}
        passed = set(kwargs) - {"num_warps", "num_stages"}
        if arg_names is not None:
            missing = sorted(set(arg_names) - passed - supplied)
            unknown = sorted(passed - set(arg_names))
            if missing or unknown:
                raise ValueError(f"--backend: not applicable: this aiter version's {attr} takes other arguments "
                                 f"than the 2026-08 launcher passes (missing {missing}, unknown {unknown})")
        kernel[grid](**kwargs)

    def run_pass(self, problem: Problem, route, pass_name: str, feed: Optional[dict] = None) -> dict:
        """One pass of aiter's FlashKDA alone, on oracle-fed inputs (see the comment above):

            "K1": feed unused               -> ws_kd ws_qd ws_kr ws_gt ws_inv ws_mqk
            "A":  ws_* (+ v, beta)           -> A_seg [segs,H,K,K] bf16, b_seg [segs,H,K,V] fp32
            "B":  A_seg, b_seg (+ S0)        -> h_in [segs,H,K,V] fp32
            "C":  ws_* (+ h_in if segmented, else S0) -> o [B,T,H,V] bf16, final_state [N,H,K,V] fp32
        """
        name = str(pass_name).upper()
        if name not in self.PASS_NAMES:
            raise ValueError(f"--pass: expected one of {'|'.join(self.PASS_NAMES)}, got {pass_name!r}")
        p, feed = problem, feed or {}
        r, geo = self._pass_setup(p, route)
        if name in ("A", "B") and not geo["segmented"]:
            raise ValueError(f"--pass: route {getattr(route, 'name', route)!r} has no pass {name} on this problem "
                             f"(every sequence fits one segment of {geo['cps']} chunks)")
        kw = {k: (t.contiguous() if isinstance(t, torch.Tensor) else t)
              for k, t in self.call_arguments(p, r).items()}
        dev, H, K, V, C = p.q.device, p.H, p.K, p.V, geo["C"]
        segs = geo["num_segs"]
        counts: dict = {}
        with self._pinned(r, counts), torch.inference_mode():
            mod = self._mod
            if name == "K1":
                rows = H * geo["total_tiles"]
                ws = dict(ws_kd=torch.empty(rows, C, K, dtype=torch.bfloat16, device=dev),
                          ws_qd=torch.empty(rows, C, K, dtype=torch.bfloat16, device=dev),
                          ws_kr=torch.empty(rows, C, K, dtype=torch.bfloat16, device=dev),
                          ws_gt=torch.empty(rows, K, dtype=torch.float32, device=dev),
                          ws_inv_mqk=torch.empty(rows, 2 * C, C, dtype=torch.float16, device=dev))
                inv_block = min(int(mod.FLASH_KDA_INV_BLOCK), C)
                varlen = geo["cu_seqlens"] is not None
                self._launch(
                    "_flash_kda_prepare_kernel", (geo["total_tiles"] if varlen else geo["NT"], p.B * H),
                    q=kw["q"], k=kw["k"], g_raw=kw["g"], beta_raw=kw["beta"], A_log=kw["A_log"],
                    dt_bias=kw["dt_bias"], **ws, cu_seqlens=geo["cu_seqlens"], chunk_indices=geo["chunk_indices"],
                    scale=kw["scale"], lower_bound=kw["lower_bound"], T=p.T, NT=geo["NT"],
                    TOTAL_TILES=geo["total_tiles"], H=H, K=K, C=C, BC=inv_block,
                    NUM_DOUBLING=inv_block.bit_length() - 2, NUM_MERGE=(C // inv_block).bit_length() - 1)
                out = {n: ws[n] for n in ("ws_kd", "ws_qd", "ws_kr", "ws_gt")}
                out.update(ws_inv=ws["ws_inv_mqk"][:, :C], ws_mqk=ws["ws_inv_mqk"][:, C:])
                expect = {"K1": 1}
            elif name == "A":
                common = self._segment_common(p, geo, self._workspace_from_feed(feed, p, geo, name), kw["v"],
                                              kw["beta"])
                b_seg = torch.empty(segs, H, K, V, dtype=torch.float32, device=dev)
                A_seg = torch.empty(segs, H, K, K, dtype=torch.bfloat16, device=dev)
                for buf, width, identity, has_v in ((b_seg, V, False, True), (A_seg, K, True, False)):
                    self._launch(
                        "_flash_kda_segment_kernel", lambda meta, _w=width: (-(-_w // meta["BW"]), segs * H),
                        v_input=kw["v"], out=None, h_in=None, h_out=buf, final_state=None, W=width,
                        INIT_IDENTITY=identity, HAS_H_IN=False, HAS_V=has_v, COMPUTE_OUTPUT=False,
                        STORE_H_OUT=True, STORE_FINAL=False, **common)
                out, expect = {"A_seg": A_seg, "b_seg": b_seg}, {"K2": 2}
            elif name == "B":
                missing = [n for n in ("A_seg", "b_seg") if n not in feed]
                if missing:
                    raise ValueError(f"feed: pass B needs {', '.join(missing)}, got {sorted(feed)}")
                A_seg = feed["A_seg"].to(device=dev, dtype=torch.bfloat16).contiguous()
                b_seg = feed["b_seg"].to(device=dev, dtype=torch.float32).contiguous()
                for n, t, shape in (("A_seg", A_seg, (segs, H, K, K)), ("b_seg", b_seg, (segs, H, K, V))):
                    if tuple(t.shape) != shape:
                        raise ValueError(f"feed: {n} expected shape {list(shape)}, got {list(t.shape)}")
                h_in = torch.empty(segs, H, K, V, dtype=torch.float32, device=dev)
                BV_SCAN = 32
                self._launch(
                    "_flash_kda_seg_scan_kernel", (-(-V // BV_SCAN), geo["N"] * H),
                    A_seg=A_seg, b_seg=b_seg, h_in=h_in, h0=self._initial_state_kfirst(p),
                    seq_seg_off=geo["seq_seg_off"], H=H, K=K, V=V, BV=BV_SCAN, num_warps=4)
                out, expect = {"h_in": h_in}, {"scan": 1}
            else:
                common = self._segment_common(p, geo, self._workspace_from_feed(feed, p, geo, name), kw["v"],
                                              kw["beta"])
                if geo["segmented"]:
                    if "h_in" not in feed:
                        raise ValueError(f"feed: pass C of a segmented route needs h_in, got {sorted(feed)}")
                    h_in = feed["h_in"].to(device=dev, dtype=torch.float32).contiguous()
                    if tuple(h_in.shape) != (segs, H, K, V):
                        raise ValueError(f"feed: h_in expected shape {[segs, H, K, V]}, got {list(h_in.shape)}")
                else:
                    h_in = self._initial_state_kfirst(p)
                o = torch.empty_like(kw["v"])
                final = torch.empty(geo["N"], H, K, V, dtype=torch.float32, device=dev)
                self._launch(
                    "_flash_kda_segment_kernel", lambda meta: (-(-V // meta["BW"]), segs * H),
                    v_input=kw["v"], out=o, h_in=h_in, h_out=None, final_state=final, W=V,
                    INIT_IDENTITY=False, HAS_H_IN=h_in is not None, HAS_V=True, COMPUTE_OUTPUT=True,
                    STORE_H_OUT=False, STORE_FINAL=True, **common)
                out, expect = {"o": o, "final_state": final}, {"K2": 1}
        launched = {k: v for k, v in counts.items() if not k.endswith(":config")}
        if launched != expect:
            raise RuntimeError(f"aiter pass {name}: expected launches {expect}, counted {launched}")
        return out
