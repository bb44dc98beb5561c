"""``kda-verify isa --backend aiter``: cross-compile the FlashKDA kernels of the aiter tree on
PYTHONPATH (Triton and, where the tree has them, the gfx950 Gluon ones) for AMD targets this
machine lacks, and report per kernel what the compiler made of it.

The variants compiled are those aiter's own launcher passes: ``flash_kda_fwd`` runs on a small
CPU problem of the Kimi-K3 shape (H = 12, K = V = 128, chunk C = 32; varlen, paged state cache)
with every launch object replaced by a recorder (nothing executes), once per plan:

    triton:unseg   chunks_per_seg = 0      K1, pass C (paged cache read in pass C)
    triton:seg     chunks_per_seg = 2      K1, pass A (b_seg, A_seg), scan, pass C (from h_in)
    gluon:unseg / gluon:seg                the same with AITER_FDA_USE_GLUON_K1 / _K2 on

(a tree without the paged cache: the same plans with a dense initial state).

and each recorded launch is resolved the way Triton would launch it: the kernel's single
autotune config (aiter's tuned table or its fallback; with several configs, the adapter's pin
rule), its heuristics, its parameters' defaults; pointers 16-byte aligned, integers equal to 1
folded.  ``k2_segment_gluon`` (a module some trees carry, routed to by no launcher) is compiled
with pass C's arguments of a dense segmented call, BW = 32 with its own BW -> warps table.
The CU count aiter's heuristics ask for is 256 (MI355X); the arch aiter sees at import is
gfx950 (a stand-in ``arch_info``: no GPU needed).

Per kernel: VGPRs and AGPRs as the code object states them (on gfx90a and later, gfx950 included,
``.vgpr_count`` is the unified register count, AGPRs included; ``.agpr_count`` the AGPR part), SGPRs,
spills (VGPR / SGPR spill counts, scratch bytes), LDS bytes (the dynamic shared memory Triton
launches with plus any static LDS), occupancy (waves per SIMD, as the AMDGPU backend reports it), v_mfma / v_wmma counts and the
static instruction count of the AMDGCN; a kernel that does not compile is a row with the
compiler's one-line reason.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import re
import sys
import time
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from kda_kernels import _autotune_pin
from kda_kernels.aiter import PIN_RULE
from kda_kernels.base import set_library_switch

ARCHS = ("gfx942", "gfx950", "gfx1250")
FLASH_KDA = "aiter.ops.triton._triton_kernels.chunk_delta_attn.flash_kda"
ARCH_INFO = "aiter.ops.triton.utils._triton.arch_info"
GLUON_PKG = "aiter.ops.triton._gluon_kernels.gfx950.chunk_delta_attn."
SEGMENT_GLUON = GLUON_PKG + "flash_kda_k2_segment"
NUM_CUS = 256
K3 = dict(H=12, lens=(100, 200))            # 4 and 7 chunks of 32
PLANS = (("unseg", 0), ("seg", 2))


class AiterIsaError(ValueError):
    """isa --backend aiter cannot run here; the message says why."""


@dataclass
class AiterKernelReport:
    arch: str
    kernel: str
    routes: list
    ok: bool
    error: str = ""
    vgprs: Optional[int] = None
    agprs: Optional[int] = None
    sgprs: Optional[int] = None
    spills: dict = field(default_factory=dict)
    lds_bytes: Optional[int] = None
    occupancy: Optional[int] = None
    matrix: dict = field(default_factory=dict)
    instructions: Optional[int] = None
    compile_s: float = 0.0
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------- import
# The stand-ins for importing aiter without its GPU, once for the project: this command's
# cross-compiles, tools/aiter_interpret.py's interpreter runs and the interpreter tests (which
# load that tool) all take them from here.
class _TargetOnlyDriver:
    def __init__(self, arch):
        self.arch = arch

    def get_current_target(self):
        # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
        from triton.backends.compiler import GPUTarget
        return GPUTarget("hip", self.arch, 64)

    def get_current_device(self):
        return 0


def arch_stand_in(arch: str) -> types.ModuleType:
    """A stand-in ``arch_info`` answering ``arch`` (Gluon, fp4 and MX preshuffling on gfx950 and
    gfx1250, TDM on gfx1250, fp8 everywhere, the LDS capacity per arch); ``set_stub_arch``
    changes its answer (aiter's KDA host modules are imported once per arch)."""
    m = types.ModuleType(ARCH_INFO)
    m.ARCH = arch
    m.get_arch = lambda: m.ARCH
    m.is_gluon_avail = lambda: m.ARCH in ("gfx950", "gfx1250")
    m.is_fp4_avail = lambda: m.ARCH in ("gfx950", "gfx1250")
    m.is_fp8_avail = lambda: True
    m.is_mx_scale_preshuffling_avail = lambda: m.ARCH in ("gfx950", "gfx1250")
    m.is_tdm_avail = lambda: m.ARCH == "gfx1250"
    m._LDS_CAP_BYTES = {"gfx1250": 327680, "gfx950": 163840, "gfx942": 65536}
    return m


def set_stub_arch(arch: str) -> None:
    """Make the stand-in ``arch_info`` (installed if absent) answer ``arch``."""
    stub = sys.modules.setdefault(ARCH_INFO, arch_stand_in(arch))
    if hasattr(stub, "ARCH"):
        stub.ARCH = arch


@contextmanager
def cpu_import(arch: str):
    """For an import of aiter's modules without a GPU: a driver answering ``arch``'s target and a
    torch that says there is no device; both put back afterwards."""
    # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
    from triton.runtime.driver import driver
    saved_props, saved_driver = torch.cuda.get_device_properties, driver._active

    def no_device(*a, **k):
        raise RuntimeError(f"no GPU (aiter imported for {arch} on a machine without one)")
    torch.cuda.get_device_properties, driver._active = no_device, _TargetOnlyDriver(arch)
    try:
        yield
    finally:
        torch.cuda.get_device_properties, driver._active = saved_props, saved_driver


def _check_not_interpreted() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
        raise AiterIsaError("TRITON_INTERPRET: expected it unset (the interpreter has no kernels to compile), "
                            f"got TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")


def flash_kda_present() -> bool:
    """Whether the aiter tree on PYTHONPATH has the 2026-08-style FlashKDA module (not imported)."""
    try:
        return importlib.util.find_spec(FLASH_KDA) is not None
    except ModuleNotFoundError:
        return False


def load_aiter(arch: str = "gfx950"):
    """aiter's flash_kda module from PYTHONPATH, imported as on an ``arch`` machine without one:
    a stand-in ``arch_info`` and, for the import only, a driver answering that target."""
    _check_not_interpreted()
    set_library_switch("aiter")
    if FLASH_KDA in sys.modules:
        return sys.modules[FLASH_KDA]
    set_stub_arch(arch)
    try:
        with cpu_import(arch):
            return importlib.import_module(FLASH_KDA)
    except ModuleNotFoundError as e:
        raise AiterIsaError(f"--backend aiter: expected aiter's aiter/ tree on PYTHONPATH (AITER_TRITON_ONLY=1), "
                            f"got ModuleNotFoundError: {e}") from None


# ----------------------------------------------------------------------------------- recording
class _Recorder:
    """Stands in for ``kernel[grid](**kwargs)`` (or a fast_launch wrapper of it): records, runs nothing."""

    def __init__(self, kernel, log: list, plan: str):
        self.kernel, self.log, self.plan = getattr(kernel, "_kernel", kernel), log, plan

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.kernel, args, kwargs, self.plan))
        return launch


def _problem(state: str):
    H, lens = K3["H"], K3["lens"]
    T, N = sum(lens), len(lens)
    bf = torch.bfloat16
    z = lambda *s, dt=bf: torch.zeros(*s, dtype=dt)  # noqa: E731
    kw = dict(q=z(1, T, H, 128), k=z(1, T, H, 128), v=z(1, T, H, 128), g=z(1, T, H, 128),
              beta=z(1, T, H, dt=torch.float32), A_log=z(H, dt=torch.float32), dt_bias=z(H * 128, dt=torch.float32),
              scale=128 ** -0.5, lower_bound=-5.0,
              cu_seqlens=torch.tensor([0] + [sum(lens[:i + 1]) for i in range(N)], dtype=torch.int64))
    if state == "paged":
        kw.update(state_cache=z(2 * N + 1, H, 128, 128, dt=torch.float32),
                  state_indices=torch.arange(N, dtype=torch.int32), has_initial_state=torch.ones(N, dtype=torch.bool),
                  state_v_first=True, out=z(1, T, H, 128))
    else:
        kw.update(initial_state=z(N, H, 128, 128, dt=torch.float32), output_final_state=True)
    return kw


@contextmanager
def _patched(pairs):
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in pairs if hasattr(obj, name)]
    try:
        for obj, name, value in pairs:
            if hasattr(obj, name):
                setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def record_launches(mod) -> list:
    """(kernel object, args, kwargs, plan) of every launch flash_kda_fwd makes over PLANS, for the
    Triton kernels and, where the module has the flags, the Gluon ones."""
    log: list = []
    params = inspect.signature(mod.flash_kda_fwd).parameters
    kernel_sets = [("triton", False)]
    if hasattr(mod, "AITER_FDA_USE_GLUON_K1"):
        kernel_sets.append(("gluon", True))
    states = ["paged"] if "state_cache" in params else []
    states.append("dense")
    for kset, gluon in kernel_sets:
        for state in states:
            for plan, cps in PLANS:
                tag = f"{kset}:{plan}" + ("" if state == "paged" or "paged" not in states else ":dense")
                pairs = [(mod, "_num_cus", lambda device_index=0: NUM_CUS),
                         (mod, "AITER_FDA_USE_GLUON_K1", gluon), (mod, "AITER_FDA_USE_GLUON_K2", gluon),
                         (mod, "_GLUON_ARCH_OK", gluon)]
                for attr in ("_prepare_fast", "_segment_fast", "_seg_scan_fast", "_flash_kda_prepare_kernel",
                             "_flash_kda_segment_kernel", "_flash_kda_seg_scan_kernel"):
                    if hasattr(mod, attr):
                        pairs.append((mod, attr, _Recorder(getattr(mod, attr), log, tag)))
                if gluon:
                    for modname, attr in (("flash_kda_k1", "_k1_fast"), ("flash_kda_k2", "k2_ab_fused_fast")):
                        try:
                            g = importlib.import_module(GLUON_PKG + modname)
                        except Exception as e:  # noqa: BLE001 - reported as a row
                            log.append((None, (f"{GLUON_PKG + modname}: {type(e).__name__}: {e}",), {}, tag))
                            continue
                        pairs.append((g, attr, _Recorder(getattr(g, attr), log, tag)))
                if hasattr(mod, "_k2_gluon_schedule") and hasattr(mod._k2_gluon_schedule, "cache_clear"):
                    mod._k2_gluon_schedule.cache_clear()
                with _patched(pairs):
                    kw = _problem(state)
                    mod.flash_kda_fwd(**{k: v for k, v in kw.items() if k in params}, chunks_per_seg=cps)
    return log


# ----------------------------------------------------------------------------------- resolution
def _resolve(kernel, args, kwargs):
    """The JITFunction and the full keyword set Triton would launch it with: autotune config(s)
    (one: aiter's table or fallback; several: the adapter's pin rule), heuristics, defaults."""
    # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
    from triton.runtime.jit import JITFunction
    k, kw = kernel, dict(kwargs)
    opts = {n: kw.pop(n) for n in ("num_warps", "num_stages") if n in kw}
    while not isinstance(k, JITFunction):
        if getattr(k, "configs", None):
            cfg = _autotune_pin.choose_config(list(k.configs), PIN_RULE)
            kw.update(cfg.kwargs)
            opts.setdefault("num_warps", cfg.num_warps)
            opts.setdefault("num_stages", cfg.num_stages)
        if getattr(k, "values", None):
            full = {**dict(zip(k.arg_names, args)), **kw}
            for name, fn in k.values.items():
                kw[name] = fn(full)
        k = k.fn
    names = [p.name for p in k.params]
    bound = {**dict(zip(names, args)), **kw}
    for p in k.params:
        if p.name not in bound and p.default is not inspect_empty():
            bound[p.name] = p.default
    return k, bound, opts


def inspect_empty():
    return inspect.Parameter.empty


@dataclass
class AiterVariant:
    jit: object
    bound: dict
    opts: dict
    plans: list = field(default_factory=list)
    note: str = ""
    signature: Optional[tuple] = None    # (signature, constexprs, attributes) when set by the caller
    label_text: str = ""                 # the table's name for it when set by the caller

    @property
    def gluon(self) -> bool:
        return type(self.jit).__name__.startswith("Gluon") or "gluon" in type(self.jit).__module__

    @property
    def label(self) -> str:
        if self.label_text:
            return self.label_text
        cons = {p.name: self.bound[p.name] for p in self.jit.params
                if p.is_constexpr and not _is_layout(self.bound[p.name])}
        short = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(cons.items()))
        launch = ",".join(f"{k}={v}" for k, v in sorted(self.opts.items()))
        return f"{self.jit.__name__}[{short}]({launch})"

    @property
    def key(self):
        return (self.jit.__name__, tuple(sorted((k, str(v)) for k, v in self.bound.items()
                                               if not isinstance(v, torch.Tensor))),
                tuple(sorted((k, str(v.dtype)) for k, v in self.bound.items() if isinstance(v, torch.Tensor))),
                tuple(sorted(self.opts.items())))


def _is_layout(v) -> bool:
    return type(v).__module__.startswith("triton.experimental.gluon")


def aiter_variants(mod) -> tuple[list, list]:
    """(unique variants, rows for launchers that could not be imported)."""
    found, broken = {}, []
    for kernel, args, kwargs, plan in record_launches(mod):
        if kernel is None:
            broken.append((args[0], plan))
            continue
        jit, bound, opts = _resolve(kernel, args, kwargs)
        v = AiterVariant(jit, bound, opts)
        v = found.setdefault(v.key, v)
        if plan not in v.plans:
            v.plans.append(plan)
    variants = list(found.values())
    seg = _segment_gluon_variant(variants)
    if any(not p.endswith(":dense") for v in variants for p in v.plans):   # paged (K3 prefill) plans exist:
        variants = [v for v in variants if not all(p.endswith(":dense") for p in v.plans)]   # dense ones only feed
        for v in variants:                                                 # k2_segment_gluon
            v.plans = [p for p in v.plans if not p.endswith(":dense")]
    if seg is not None:
        variants.append(seg)
    return variants, broken


def _segment_gluon_variant(variants) -> Optional[AiterVariant]:
    """k2_segment_gluon with pass C's arguments of the dense segmented Triton call, BW 32."""
    try:
        g = importlib.import_module(SEGMENT_GLUON)
    except Exception:  # noqa: BLE001 - the tree has no such module
        return None
    pass_c = [v for v in variants if v.jit.__name__ == "_flash_kda_segment_kernel" and v.bound.get("COMPUTE_OUTPUT")
              and v.bound.get("HAS_H_IN") and not v.bound.get("PAGED_CACHE")]
    if not pass_c:
        return None
    src = pass_c[0].bound
    bw = 32
    nw = g.BW_WARPS[bw]
    bound = {p.name: src[p.name] for p in g.k2_segment_gluon.params if p.name in src}
    bound.update(BW=bw, **g.build_layouts(nw))
    return AiterVariant(g.k2_segment_gluon, bound, {"num_warps": nw}, plans=["(no launcher)"],
                        note="routed to by no launcher: pass C's arguments of a dense segmented call")


# ----------------------------------------------------------------------------------- compile
def _amd_fields(asm: str) -> dict:
    def f(name):
        m = re.search(rf"\.{name}:\s*(\d+)", asm)
        return int(m.group(1)) if m else None

    scratch = re.search(r"ScratchSize:\s*(\d+)", asm)
    occ = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    return dict(vgprs=f("vgpr_count"), agprs=f("agpr_count"), sgprs=f("sgpr_count"),
                lds=f("group_segment_fixed_size"), occupancy=int(occ.group(1)) if occ else None,
                spills={"vgpr_spill_count": f("vgpr_spill_count"), "sgpr_spill_count": f("sgpr_spill_count"),
                        "scratch_bytes": int(scratch.group(1)) if scratch else None},
                matrix={"v_mfma": len(re.findall(r"^\s*v_mfma", asm, re.M)),
                        "v_wmma": len(re.findall(r"^\s*v_wmma", asm, re.M))},
                instructions=len(re.findall(r"^\s+(?:[vs]_|ds_|global_|buffer_|flat_|scratch_)\w+", asm, re.M)))


def compile_aiter_variant(v: AiterVariant, arch: str) -> AiterKernelReport:

    # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    # lazy: kda_kernels.triton builds its kernels at import (docs/design.md, Imports)
    from kda_kernels.triton.isa import TARGETS, _last_line, _no_kernarg_preload, _signature, _StderrCapture
    backend, a, warp = TARGETS[arch]
    rep = AiterKernelReport(arch=arch, kernel=v.label, routes=list(v.plans), ok=False, note=v.note)
    t0 = time.perf_counter()
    try:
        sig, cons, attrs = v.signature if v.signature is not None else _signature(v.jit, (), v.bound)[:3]
        src = (GluonASTSource if v.gluon else ASTSource)(v.jit, sig, cons, attrs)

        def build():
            with _StderrCapture() as cap, _always_compile():
                try:
                    return triton.compile(src, target=GPUTarget(backend, a, warp), options=dict(v.opts))
                except Exception as e:  # noqa: BLE001
                    err = cap.text()
                    raise RuntimeError(_last_line(e) + (" ... " + err if err else "")) from e
        try:
            k = build()
        except RuntimeError as e:
            if "user_sgpr_count" not in str(e):
                raise
            # as for our own kernels (kda_kernels.triton.isa): the LLVM bundled with Triton rejects more
            # than 16 preloaded kernel arguments on gfx1250; compiled again with preloading off
            rep.note = (rep.note + "; " if rep.note else "") + (
                "compiled with kernel-argument preloading off; with it on: " + str(e)[:200])
            with _no_kernarg_preload():
                k = build()
        st = _amd_fields(k.asm.get("amdgcn", ""))
        rep.ok = True
        rep.vgprs, rep.agprs, rep.sgprs, rep.occupancy = st["vgprs"], st["agprs"], st["sgprs"], st["occupancy"]
        # Triton launches AMD kernels with their LDS as dynamic shared memory (metadata.shared); the code
        # object's group_segment_fixed_size holds only static LDS (0 for Triton's kernels)
        rep.lds_bytes = (getattr(k.metadata, "shared", None) or 0) + (st["lds"] or 0)
        rep.spills, rep.matrix, rep.instructions = st["spills"], st["matrix"], st["instructions"]
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        rep.error = _last_line(e)
    rep.compile_s = time.perf_counter() - t0
    return rep


@contextmanager
def _always_compile():
    """TRITON_ALWAYS_COMPILE=1 for the block: a variant compiled before is compiled again, so its
    compile seconds are a compile's, not a cache hit's."""
    saved = os.environ.get("TRITON_ALWAYS_COMPILE")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_ALWAYS_COMPILE", None)
        else:
            os.environ["TRITON_ALWAYS_COMPILE"] = saved


KERNEL_TIMEOUT_S = 900


def compile_bounded(v: AiterVariant, arch: str, timeout_s: float = KERNEL_TIMEOUT_S) -> AiterKernelReport:
    """compile_aiter_variant in a forked child, given up after ``timeout_s`` (LLVM's SLP vectorizer
    was seen to run for tens of CPU minutes on aiter's K1 for gfx1250): a row saying so."""
    try:
        ctx = mp.get_context("fork")
    except ValueError:                     # no fork on this platform: compile here, unbounded
        return compile_aiter_variant(v, arch)
    recv, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(compile_aiter_variant(v, arch).as_dict())
        finally:
            send.close()
    t0 = time.perf_counter()
    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    got = recv.recv() if recv.poll(timeout_s) else None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if got is None:
        return AiterKernelReport(arch=arch, kernel=v.label, routes=list(v.plans), ok=False, note=v.note,
                                 error=f"did not compile within {timeout_s:g} s (the compiler was stopped)",
                                 compile_s=time.perf_counter() - t0)
    return AiterKernelReport(**got)


def aiter_isa_report(archs: list, on_report=None, timeout_s: float = KERNEL_TIMEOUT_S, kernels=None) -> list:
    """Every (arch, variant) compiled (each bounded by ``timeout_s``): the FlashKDA kernels where the
    tree has them, and on gfx950 / gfx1250 aiter's Gluon KDA kernels (verification.investigating.aiter_kda_isa)
    where it has those; ``kernels`` (substrings of kernel names) keeps only those that match.
    ``on_report(report)`` is called as each one finishes."""
    # lazy: import cycle (aiter_kda_isa builds on this module's AiterVariant, _Recorder, _patched)
    from verification.investigating import aiter_kda_isa as kda_isa
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise AiterIsaError(f"--arch: expected values in {','.join(ARCHS)} for --backend aiter, got {bad[0]!r}")
    _check_not_interpreted()
    have_flash, have_kda = flash_kda_present(), kda_isa.kda_modules_present()
    if not (have_flash or have_kda):
        raise AiterIsaError("--backend aiter: expected aiter's aiter/ tree on PYTHONPATH (AITER_TRITON_ONLY=1), "
                            f"got neither {FLASH_KDA} nor {kda_isa.CHUNK_KDA}")
    wanted = lambda name: not kernels or any(k in name for k in kernels)  # noqa: E731
    reports = []

    def emit(r):
        reports.append(r)
        if on_report is not None:
            on_report(r)
    variants, broken = aiter_variants(load_aiter("gfx950")) if have_flash else ([], [])
    variants = [v for v in variants if wanted(v.jit.__name__)]
    for arch in archs:
        for v in variants:
            emit(compile_bounded(v, arch, timeout_s))
        for why, plan in broken:
            emit(AiterKernelReport(arch=arch, kernel="(launcher import)", routes=[plan], ok=False, error=why[:400]))
        if not have_kda or arch not in kda_isa.GLUON_ARCHS:
            continue
        families = []
        for fam in kda_isa.FAMILIES:
            too_old = kda_isa.triton_too_old(arch, fam)
            if too_old:
                emit(AiterKernelReport(arch=arch, kernel=f"{fam} (Gluon)", routes=[], ok=False, error=too_old))
            else:
                families.append(fam)
        if not families:
            continue
        try:
            kvars, refused = kda_isa.kda_variants(arch, tuple(families))
        except Exception as e:  # noqa: BLE001 - an import the tree or this Triton cannot do is a row
            emit(AiterKernelReport(arch=arch, kernel="(host import)", routes=[], ok=False,
                                   error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        for v in kvars:
            if wanted(v.jit.__name__):
                emit(compile_bounded(v, arch, timeout_s))
        for why, plan in refused:
            emit(AiterKernelReport(arch=arch, kernel="(host wrapper)", routes=[plan], ok=False, error=why[:400]))
    return reports


def _spill_text(r) -> str:
    return " ".join(f"{k.replace('_count', '').replace('_bytes', 'B')}={v}" for k, v in r.spills.items() if v)


def table(reports, out=None) -> None:
    """The table of ``kda-verify isa``, with SGPRs and occupancy."""
    table_header(out)
    for r in reports:
        table_row(r, out)


def table_header(out=None) -> None:
    out = out or sys.stdout
    head = (f"{'arch':8} {'ok':3} {'vgpr':>5} {'agpr':>4} {'sgpr':>4} {'lds':>7} {'occ':>3} {'instr':>6} "
            f"{'spills':22} {'matrix instructions':24} {'secs':>5} kernel")
    print(head, file=out)
    print("-" * len(head), file=out, flush=True)


def table_row(r, out=None) -> None:
    out = out or sys.stdout
    dash = lambda x: "-" if x is None else x  # noqa: E731
    routes = r.routes if len(r.routes) <= 4 else r.routes[:3] + [f"+{len(r.routes) - 3} more"]
    if not r.ok:
        print(f"{r.arch:8} NO  {r.kernel}  [{', '.join(routes)}]\n         error: {r.error}", file=out, flush=True)
        return
    mat = " ".join(f"{k}={v}" for k, v in r.matrix.items())
    print(f"{r.arch:8} yes {dash(r.vgprs):>5} {dash(r.agprs):>4} {dash(r.sgprs):>4} {dash(r.lds_bytes):>7} "
          f"{dash(r.occupancy):>3} {dash(r.instructions):>6} {_spill_text(r) or 'none':22} {mat:24} "
          f"{r.compile_s:5.1f} {r.kernel}  [{', '.join(routes)}]", file=out, flush=True)
    if r.note:
        print(f"         note: {r.note[:200]}", file=out, flush=True)
