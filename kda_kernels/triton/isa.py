"""Compile our Triton FlashKDA kernels for GPUs this machine does not have, and report what
the compiler made of them (``kda-verify isa``).

The kernel variants of a route are exactly those its forward launches: the forward runs with
launch recording on (nothing executes) on a small CPU problem, and every recorded launch is
turned into a Triton signature the way the JIT would specialise it (pointers 16-byte aligned,
integers equal to 1 folded, integers divisible by 16 marked so).  Each unique variant is
compiled with ``triton.compile(ASTSource(...), target=GPUTarget(...))``:

    sm90     GPUTarget("cuda", 90, 32)       PTX -> cubin with the ptxas Triton bundles
    sm100    GPUTarget("cuda", 100, 32)
    gfx942   GPUTarget("hip", "gfx942", 64)
    gfx950   GPUTarget("hip", "gfx950", 64)
    gfx1250  GPUTarget("hip", "gfx1250", 32)

Reported per kernel: compiled or the compiler's error; matrix instructions (wgmma / mma in
the PTX and HGMMA / HMMA in the SASS; v_mfma / v_wmma in the AMDGCN); the static instruction count of the machine code (SASS / AMDGCN); registers (ptxas) or
VGPRs / AGPRs; shared memory or LDS; spills (ptxas spill bytes, AMD vgpr/sgpr spill counts
and scratch size).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import triton
from triton.backends.amd import compiler as amd_compiler
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from . import forward as fw, kernels
from .launch import launch_context
from .routes import RouteSpec, parse_route

TARGETS = {
    "sm90": ("cuda", 90, 32),
    "sm100": ("cuda", 100, 32),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "gfx1250": ("hip", "gfx1250", 32),
}
STATE_CONFIGS = ("none", "kv", "vk", "paged")

_TORCH_TO_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                    torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.bool: "i1", torch.uint8: "u8"}


@dataclass
class Variant:
    kernel: object                    # the JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    routes: list = field(default_factory=list)

    @property
    def label(self) -> str:
        c = {k: v for k, v in self.constexprs.items() if k in self.kernel_constexpr_names}
        short = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(c.items()))
        launch = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.kernel.__name__}[{short}]({launch})"

    @property
    def kernel_constexpr_names(self) -> set:
        return {p.name for p in self.kernel.params if p.is_constexpr}

    @property
    def key(self) -> tuple:
        return (self.kernel.__name__, tuple(sorted((k, str(v)) for k, v in self.constexprs.items())),
                tuple(sorted(self.signature.items())), tuple(sorted(self.options.items())))


@dataclass
class KernelReport:
    arch: str
    kernel: str
    routes: list
    ok: bool
    error: str = ""
    matrix: dict = field(default_factory=dict)     # instruction -> count
    registers: Optional[int] = None                # CUDA registers / AMD VGPRs per thread
    agprs: Optional[int] = None
    shared_bytes: Optional[int] = None
    spills: dict = field(default_factory=dict)
    instructions: Optional[int] = None             # static size of the machine code (SASS / AMDGCN)
    compile_s: float = 0.0
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------- variants
def _small_problem(state: str):
    B, T, H = 1, 96, 2
    bf = torch.bfloat16
    z = lambda *s, dt=bf: torch.zeros(*s, dtype=dt)  # noqa: E731
    kw = dict(q=z(B, T, H, 128), k=z(B, T, H, 128), v=z(B, T, H, 128), g=z(B, T, H, 128), beta=z(B, T, H, dt=torch.float32),
              A_log=z(H, dt=torch.float32), dt_bias=z(H * 128, dt=torch.float32), lower_bound=-5.0)
    if state in ("kv", "vk"):
        kw.update(initial_state=z(B, H, 128, 128, dt=torch.float32), state_layout=state)
    elif state == "paged":
        kw.update(state_cache=z(3, H, 128, 128, dt=torch.float32), state_indices=torch.tensor([1], dtype=torch.int32),
                  has_initial_state=torch.tensor([True]), output_final_state=False)
    return kw


def _spec_for_recording(spec: RouteSpec) -> RouteSpec:
    if spec.segmented and spec.cps is None:   # the heuristic's segmented pipeline (or unseg's kernels)
        return dataclasses.replace(spec, cps=1)
    return spec


def _signature(kernel, args, kwargs):
    names = [p.name for p in kernel.params]
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    bound = dict(zip(names, args))
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound.update({k: v for k, v in kwargs.items() if k not in opts})
    sig, cons, attrs = {}, {}, {}
    for i, name in enumerate(names):
        val = bound[name]
        if name in constexpr_names or val is None or isinstance(val, bool):
            sig[name], cons[name] = "constexpr", val
        elif isinstance(val, torch.Tensor):
            sig[name] = "*" + _TORCH_TO_TRITON[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, int):
            if val == 1:
                sig[name], cons[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2 ** 31 <= val < 2 ** 31 else "i64"
                if val % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"isa: cannot type argument {name}={val!r} of {kernel.__name__}")
    return sig, cons, attrs, opts


def route_variants(route_names: list, states=("kv", "paged"), hip: bool = False) -> list:
    """Unique kernel variants launched by the given routes over the given state configs, as the
    forward would launch them on an AMD (``hip``) or an NVIDIA device."""
    found: dict = {}
    for rname in route_names:
        spec = _spec_for_recording(parse_route(rname))
        for state in states:
            if state not in STATE_CONFIGS:
                raise ValueError(f"--states: expected values in {'|'.join(STATE_CONFIGS)}, got {state!r}")
            with launch_context(recorder=[], target_is_hip=hip) as ctx:
                fw.flashkda_forward(**_small_problem(state), route=spec)
            launches = ctx.recorder
            for kernel, _grid, args, kwargs in launches:
                sig, cons, attrs, opts = _signature(kernel, args, kwargs)
                v = Variant(kernel, sig, cons, attrs, opts)
                v = found.setdefault(v.key, v)
                if parse_route(rname).name not in v.routes:
                    v.routes.append(parse_route(rname).name)
    return list(found.values())


# ----------------------------------------------------------------------------------- compile + inspect
def _tool(name: str) -> Optional[str]:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def _ptxas(arch_num: int) -> Optional[str]:
    """The ptxas Triton itself assembles ``sm_<arch_num>`` PTX with: Triton 3.9 emits PTX 9.4, which
    only its ``ptxas-blackwell`` (CUDA 13) reads at sm90, not the bundled ``ptxas`` (CUDA 12.9)."""
    try:
        # lazy: a probe of what is installed (docs/design.md, Imports)
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(arch_num).path
    except Exception:  # noqa: BLE001 - an older layout: the bundled binary
        return _tool("ptxas")
    return path if path and os.path.exists(path) else _tool("ptxas")


def _cuda_stats(kernel, arch_num: int) -> dict:
    ptx = kernel.asm.get("ptx", "")
    out = {"matrix": {"wgmma (PTX)": len(re.findall(r"\bwgmma\.mma_async", ptx)),
                      "mma (PTX)": len(re.findall(r"\bmma\.sync", ptx))},
           "shared": getattr(kernel.metadata, "shared", None), "registers": None, "spills": {}}
    cubin = kernel.asm.get("cubin")
    with tempfile.TemporaryDirectory() as d:
        if cubin and _tool("cuobjdump"):
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, timeout=120).stdout
            out["matrix"]["HGMMA (SASS)"] = len(re.findall(r"\bHGMMA\b", sass))
            out["matrix"]["HMMA (SASS)"] = len(re.findall(r"\bHMMA\b", sass))
            out["instructions"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))   # static SASS size
        if ptx and _ptxas(arch_num):
            ppath = os.path.join(d, "k.ptx")
            with open(ppath, "w") as f:
                f.write(ptx)
            sm = f"sm_{arch_num}a" if arch_num in (90, 100) else f"sm_{arch_num}"
            res = subprocess.run([_ptxas(arch_num), "-v", f"--gpu-name={sm}", ppath, "-o", os.path.join(d, "v.cubin")],
                                 capture_output=True, text=True, timeout=300)
            log = res.stdout + res.stderr
            m = re.search(r"Used (\d+) registers", log)
            out["registers"] = int(m.group(1)) if m else None
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            if m:
                out["spills"] = {"spill_store_bytes": int(m.group(1)), "spill_load_bytes": int(m.group(2))}
            m = re.search(r"(\d+) bytes stack frame", log)
            if m:
                out["spills"]["stack_frame_bytes"] = int(m.group(1))
    return out


def _amd_stats(kernel) -> dict:
    asm = kernel.asm.get("amdgcn", "")

    def field_(name):
        m = re.search(rf"\.{name}:\s*(\d+)", asm)
        return int(m.group(1)) if m else None

    m = re.search(r"ScratchSize:\s*(\d+)", asm)
    return {"instructions": len(re.findall(r"^\s+(?:[vs]_|ds_|global_|buffer_|flat_|scratch_)\w+", asm, re.M)),
            "matrix": {"v_mfma": len(re.findall(r"^\s*v_mfma", asm, re.M)),
                       "v_wmma": len(re.findall(r"^\s*v_wmma", asm, re.M))},
            "registers": field_("vgpr_count"), "agprs": field_("agpr_count"),
            "shared": field_("group_segment_fixed_size") or getattr(kernel.metadata, "shared", None),
            "spills": {"vgpr_spill_count": field_("vgpr_spill_count"), "sgpr_spill_count": field_("sgpr_spill_count"),
                       "scratch_bytes": int(m.group(1)) if m else None}}


def compile_variant(v: Variant, arch: str) -> KernelReport:
    backend, a, warp = TARGETS[arch]
    rep = KernelReport(arch=arch, kernel=v.label, routes=list(v.routes), ok=False)
    t0 = time.perf_counter()

    def build():
        with _StderrCapture() as cap:
            try:
                return triton.compile(ASTSource(v.kernel, v.signature, v.constexprs, v.attrs),
                                      target=GPUTarget(backend, a, warp), options=dict(v.options))
            except Exception as e:  # noqa: BLE001
                err = cap.text()
                raise RuntimeError(_last_line(e) + (" ... " + err if err else "")) from e

    try:
        try:
            k = build()
        except RuntimeError as e:
            if backend != "hip" or "user_sgpr_count" not in str(e):
                raise
            # The LLVM bundled with Triton rejects more than 16 preloaded kernel arguments (user
            # SGPRs) on gfx1250 (fixed upstream: llvm-project #192579, #194449).  Compile again with
            # argument preloading off so the rest of the kernel can still be inspected.
            rep.note = ("compiled with kernel-argument preloading off; with it on: " + str(e)[:300])
            with _no_kernarg_preload():
                k = build()
        st = _cuda_stats(k, a) if backend == "cuda" else _amd_stats(k)
        rep.ok = True
        rep.matrix, rep.registers, rep.shared_bytes = st["matrix"], st["registers"], st["shared"]
        rep.agprs, rep.spills, rep.instructions = st.get("agprs"), st["spills"], st.get("instructions")
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        rep.error = _last_line(e)
    rep.compile_s = time.perf_counter() - t0
    return rep


class _StderrCapture:
    """Capture file descriptor 2 (where LLVM / LLD print their diagnostics) while compiling."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def text(self) -> str:
        self.file.seek(0)
        raw = self.file.read().decode(errors="replace")
        lines = [ln.strip() for ln in raw.splitlines() if "error" in ln.lower()]
        return " | ".join(dict.fromkeys(lines))[:300]

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.close()
        return False


def _last_line(e: Exception) -> str:
    """One line for a report row: the exception's first line plus its reason: an ``error:`` line
    (LLVM's), or for a Triton CompilationError (``at L:C:``, the source, a ``^`` marker line,
    then the message) the message after the marker."""
    lines = [ln for ln in f"{type(e).__name__}: {e}".strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    marks = [i for i, ln in enumerate(lines) if ln.strip() == "^"]
    after = " ".join(ln.strip() for ln in lines[marks[-1] + 1:]) if marks else ""
    detail = after or next((ln.strip() for ln in lines if "error:" in ln), "")
    return (first if not detail or detail in first else f"{first} ... {detail}")[:400]


class _no_kernarg_preload:
    """Temporarily stop Triton's AMD backend from marking kernel arguments ``inreg``.

    The compile goes to a throw-away cache directory, so this build never answers a later
    ordinary compile of the same kernel from Triton's cache."""

    def __enter__(self):
        self.mod = amd_compiler.amd
        self.saved = self.mod.set_all_fn_arg_inreg
        self.mod.set_all_fn_arg_inreg = lambda fn: None
        self.tmp = tempfile.TemporaryDirectory(prefix="kda-isa-")
        self.knobs = triton.knobs.cache
        self.saved_dir = self.knobs.dir
        self.knobs.dir = self.tmp.name

    def __exit__(self, *exc):
        self.mod.set_all_fn_arg_inreg = self.saved
        self.knobs.dir = self.saved_dir
        self.tmp.cleanup()
        return False


class IsaError(ValueError):
    """isa cannot run here; the message says why."""


def isa_report(archs: list, route_names: list, states=("kv", "paged")) -> list:
    """KernelReports for every (arch, unique kernel variant of the routes)."""

    if not isinstance(kernels.segment_kernel, JITFunction):
        raise IsaError("TRITON_INTERPRET: expected it unset (the interpreter replaced the kernels, so there is "
                       f"nothing to compile), got TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    bad = [a for a in archs if a not in TARGETS]
    if bad:
        raise ValueError(f"--arch: expected values in {','.join(TARGETS)}, got {bad[0]!r}")
    variants = {hip: route_variants(route_names, states, hip) for hip in {TARGETS[a][0] == "hip" for a in archs}}
    return [compile_variant(v, arch) for arch in archs for v in variants[TARGETS[arch][0] == "hip"]]
