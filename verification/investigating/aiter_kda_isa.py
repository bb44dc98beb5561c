"""``kda-verify isa --backend aiter``, ROCm/aiter's own KDA kernels: the Gluon chunked prefill
(``chunk_kda_prepare_kernel``, ``chunk_kda_walk_kernel`` and, on gfx950, ``chunk_kda_scan_kernel``)
and the Gluon decode (``fused_recurrent_kda_packed_decode_kernel``), cross-compiled for gfx1250
(wave 32) and gfx950 (wave 64) on a CPU.

The variants are the ones aiter's own host wrappers pick: for each arch the wrappers
(``chunk_kda`` of ``aiter.ops.triton.attention.chunk_kda``, ``fused_recurrent_kda`` of
``aiter.ops.triton.attention.kda``) are imported as on that arch and called on small CPU problems
with every kernel replaced by a recorder (nothing executes); their config selection (the
DEFAULT.json tiers, the BV rule over the CU count, gfx950's group split, the decode buckets)
decides each launch.  The problems (H = 12, K = V = 128, bf16; 256 CUs):

    chunk_kda   N in {2, 4, 8, 16, 32} sequences of 64 tokens (every BV tier of the gfx1250 walk
                and of gfx950's pass-0 tiers; N = 1 is left out: Triton folds an integer 1 into
                a constant, which would split each variant in two), two sequences of 1600 tokens
                (gfx950's grouped walk: pass 1, scan, pass 2), each with no state, a dense state
                in and out, and a paged cache, with and without the fused output norm
    decode      one token per sequence (N = 1, 24: the default and 256-512 seq-head buckets)
                and four tokens (N = 1, 32, 256: the T > 1 buckets), dense or paged (in place),
                V-first or K-first; paged spec decoding and cache_state_updates; the fused
                conv + gated RMSNorm packed decode

Each recorded launch is compiled the way Triton would launch it: its constexprs, None arguments
as constexprs, integer arguments equal to 1 folded unless the kernel says do_not_specialize,
pointers 16-byte aligned unless it says do_not_specialize_on_alignment; the launch options
(num_warps, waves_per_eu, llvm_fn_attrs) as passed.  The gfx1250 chunk_kda kernels need
triton >= 3.9 (``tdm.async_load_fused``, ``reinterpret``): with an older one that family is one
row saying so; the others are compiled whatever the version, a failure being a row with its reason
(gfx950's decode calls ``_reinterpret``, which exists up to 3.8).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from contextlib import contextmanager
from typing import Optional

import torch

from verification.investigating.aiter_isa import AiterVariant, _Recorder, _patched, cpu_import, set_stub_arch

CHUNK_KDA = "aiter.ops.triton.attention.chunk_kda"
KDA = "aiter.ops.triton.attention.kda"
GLUON_ARCHS = ("gfx950", "gfx1250")
FAMILIES = ("chunk_kda", "kda_decode")
H, D = 12, 128
# (arch, family) -> the oldest Triton whose Gluon has what those kernels use; measured: the gfx1250
# prepare / walk call tdm.async_load_fused and shared_memory_descriptor.reinterpret (3.8 has
# neither), while gfx950's decode calls shared_memory_descriptor._reinterpret, which 3.9 renamed
# (with 3.9 it is a row saying so; with 3.8 it compiles), so no one Triton builds the whole set
REQUIRES = {("gfx1250", "chunk_kda"): (3, 9)}


def triton_too_old(arch: str = "gfx1250", family: str = "chunk_kda") -> Optional[str]:
    """'needs triton >= X (this is Y)' when the installed Triton cannot build ``family``'s Gluon
    kernels for ``arch`` (REQUIRES), else None."""
    # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
    import triton
    need = REQUIRES.get((arch, family))
    if need is None:
        return None
    parts = []
    for p in triton.__version__.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < need:
        return f"needs triton >= {'.'.join(map(str, need))} (this is {triton.__version__})"
    return None


def kda_modules_present() -> bool:
    """Whether the aiter tree on PYTHONPATH has the KDA host wrappers (without importing them)."""
    try:
        return importlib.util.find_spec(CHUNK_KDA) is not None
    except ModuleNotFoundError:
        return False


@contextmanager
def _as_arch(arch: str):
    """aiter's KDA host modules freshly imported as on an ``arch`` machine (they pick their Gluon
    kernels by the arch at import)."""
    set_stub_arch(arch)
    for name in (CHUNK_KDA, KDA):
        sys.modules.pop(name, None)
    with cpu_import(arch):
        mods = (importlib.import_module(CHUNK_KDA), importlib.import_module(KDA))
    yield mods


# ----------------------------------------------------------------------------------- problems
def _z(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def _cu(lens):
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int64)


def chunk_kda_calls():
    """(plan, kwargs of chunk_kda) over the prefill problems."""
    shapes = [(f"N={n}", [64] * n) for n in (2, 4, 8, 16, 32)] + [("N=2,T=1600", [1600, 1600])]
    for tag, lens in shapes:
        T, N = sum(lens), len(lens)
        for state in ("none", "dense", "paged"):
            for norm in (False, True):
                kw = dict(q=_z(1, T, H, D), k=_z(1, T, H, D), v=_z(1, T, H, D), g=_z(1, T, H, D),
                          beta=_z(1, T, H), A_log=_z(H, dtype=torch.float32),
                          dt_bias=_z(H * D, dtype=torch.float32), lower_bound=-5.0, cu_seqlens=_cu(lens))
                if state == "dense":
                    kw.update(initial_state=_z(N, H, D, D, dtype=torch.float32), output_final_state=True)
                elif state == "paged":
                    kw.update(state_cache=_z(N + 2, H, D, D, dtype=torch.float32),
                              state_indices=torch.arange(N, dtype=torch.int32),
                              has_initial_state=torch.ones(N, dtype=torch.bool))
                if norm:
                    kw.update(out_gate=_z(1, T, H, D), norm_weight=_z(D, dtype=torch.float32))
                yield f"{tag}:{state}" + (":norm" if norm else ""), kw


def decode_calls():
    """(plan, kwargs of fused_recurrent_kda) over the decode problems."""
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0)
    for T, ns in ((1, (1, 24)), (4, (1, 32, 256))):
        for N in ns:
            for state in ("dense", "paged"):
                for v_first in (True, False):
                    shape = (N, H, D, D)
                    kw = dict(q=_z(1, N * T, H, D), k=_z(1, N * T, H, D), v=_z(1, N * T, H, D),
                              g=_z(1, N * T, H, D), beta=_z(1, N * T, H), A_log=_z(H, dtype=torch.float32),
                              dt_bias=_z(H * D, dtype=torch.float32), cu_seqlens=_cu([T] * N),
                              state_v_first=v_first, **gate)
                    if state == "dense":
                        kw.update(initial_state=_z(*shape, dtype=torch.float32), inplace_final_state=False,
                                  output_final_state=True)
                    else:
                        kw.update(initial_state=_z(N * T + 1, H, D, D, dtype=torch.float32),
                                  ssm_state_indices=torch.arange(1, N * T + 1, dtype=torch.int32).view(N, T))
                    yield f"T={T},N={N}:{state}:{'vk' if v_first else 'kv'}", kw
    # paged speculative decoding, with and without per-token cache_state_updates; and the
    # packed decode's fused conv + gated RMSNorm
    for csu in (False, True):
        N, T = 4, 4
        kw = dict(q=_z(1, N * T, H, D), k=_z(1, N * T, H, D), v=_z(1, N * T, H, D), g=_z(1, N * T, H, D),
                  beta=_z(1, N * T, H), A_log=_z(H, dtype=torch.float32), dt_bias=_z(H * D, dtype=torch.float32),
                  cu_seqlens=_cu([T] * N), initial_state=_z(N * T + 1, H, D, D, dtype=torch.float32),
                  ssm_state_indices=torch.arange(1, N * T + 1, dtype=torch.int32).view(N, T),
                  num_accepted_tokens=torch.full((N,), 2, dtype=torch.int32), cache_state_updates=csu, **gate)
        yield "T=4,N=4:paged:spec" + (":cache_state_updates" if csu else ""), kw


def packed_decode_call():
    n = 8
    return "packed:conv+rmsnorm", dict(
        mixed_qkv=_z(n, 3 * H * D), g=_z(n, H, D), beta=_z(n, H), A_log=_z(H, dtype=torch.float32),
        dt_bias=_z(H * D, dtype=torch.float32), lower_bound=-5.0,
        initial_state=_z(n + 1, H, D, D, dtype=torch.float32), ssm_state_indices=torch.arange(1, n + 1, dtype=torch.int32),
        conv_state=_z(n + 1, 3 * H * D, 3), conv_weight=_z(3, 4, H * D), out_gate=_z(n, H, D),
        norm_weight=_z(D, dtype=torch.float32), norm_eps=1e-5, out=_z(n, H, D))


# ----------------------------------------------------------------------------------- recording
def record_kda_launches(arch: str, families=FAMILIES, num_cus: int = 256) -> list:
    """(kernel, args, kwargs, plan) of every launch aiter's KDA host wrappers make on ``arch``; a
    call the host wrapper itself refuses is a (None, (reason,), {}, plan) entry."""
    log: list = []
    with _as_arch(arch) as (ck, kda):
        def run(fn, plan, kw, pairs):
            with _patched(pairs):
                try:
                    fn(**kw)
                except Exception as e:  # noqa: BLE001 - the host's refusal is a row
                    log.append((None, (f"host wrapper refused: {type(e).__name__}: {str(e)[:200]}",), {}, plan))

        if "chunk_kda" in families:
            for plan, kw in chunk_kda_calls():
                pairs = [(ck.walk, "get_num_sms", lambda: num_cus)]
                for mod, attr in ((ck.prepare, "chunk_kda_prepare_kernel"), (ck.walk, "chunk_kda_walk_kernel"),
                                  (ck.walk, "chunk_kda_scan_kernel")):
                    if hasattr(mod, attr):
                        pairs.append((mod, attr, _Recorder(getattr(mod, attr), log, plan)))
                run(ck.chunk_kda, plan, kw, pairs)
        if "kda_decode" in families:
            kernel = kda.fused_recurrent_kda_packed_decode_kernel
            for plan, kw in list(decode_calls()) + [packed_decode_call()]:
                fn = kda.fused_recurrent_kda_packed_decode if plan.startswith("packed") else kda.fused_recurrent_kda
                run(fn, plan, kw, [(kda, "fused_recurrent_kda_packed_decode_kernel", _Recorder(kernel, log, plan))])
    return log


# ----------------------------------------------------------------------------------- variants
def _launch_option_names() -> set:
    # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
    from triton.backends.amd.compiler import HIPOptions
    return {f.name for f in dataclasses.fields(HIPOptions)}


def gluon_signature(jit, bound: dict):
    """(signature, constexprs, attributes) as Triton's launcher specialises a call: constexpr
    parameters, None and bool arguments constexpr; an int equal to 1 folded and a multiple of 16
    marked divisible unless the parameter is do_not_specialize; a tensor 16-byte aligned unless
    do_not_specialize_on_alignment."""
    # lazy: kda_kernels.triton builds its kernels at import (docs/design.md, Imports)
    from kda_kernels.triton.isa import _TORCH_TO_TRITON
    sig, cons, attrs = {}, {}, {}
    for i, p in enumerate(jit.params):
        val = bound[p.name]
        if p.is_constexpr or val is None or isinstance(val, bool):
            sig[p.name], cons[p.name] = "constexpr", val
        elif isinstance(val, torch.Tensor):
            sig[p.name] = "*" + _TORCH_TO_TRITON[val.dtype]
            if not p.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, int):
            if val == 1 and not p.do_not_specialize:
                sig[p.name], cons[p.name] = "constexpr", 1
            else:
                sig[p.name] = "i32" if -2 ** 31 <= val < 2 ** 31 else "i64"
                if val % 16 == 0 and not p.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"isa: cannot type argument {p.name}={val!r} of {jit.__name__}")
    return sig, cons, attrs


def kda_variants(arch: str, families=FAMILIES, num_cus: int = 256) -> tuple[list, list]:
    """(unique AiterVariants with their signature, (reason, plan) of refused calls) for ``arch``;
    each variant's label names its kernel, the constexprs that differ between that kernel's
    variants (plus BV / NUM_WARPS), and its launch options."""
    opt_names = _launch_option_names()
    found, refused = {}, []
    for kernel, args, kwargs, plan in record_kda_launches(arch, families, num_cus):
        if kernel is None:
            refused.append((args[0], plan))
            continue
        kw = dict(kwargs)
        opts = {k: kw.pop(k) for k in list(kw) if k in opt_names}
        names = [p.name for p in kernel.params]
        bound = {**dict(zip(names, args)), **kw}
        for p in kernel.params:
            if p.name not in bound and p.has_default:
                bound[p.name] = p.default
        v = AiterVariant(kernel, bound, opts, signature=gluon_signature(kernel, bound))
        key = (kernel.__name__, repr(sorted((k, str(x)) for k, x in v.signature[1].items())),
               repr(sorted(v.signature[0].items())), repr(sorted(v.signature[2].items())),
               tuple(sorted((k, str(x)) for k, x in opts.items())))
        v = found.setdefault(key, v)
        if plan not in v.plans:
            v.plans.append(plan)
    variants = list(found.values())
    _label(variants)
    return variants, refused


ALWAYS = ("BV", "NUM_WARPS", "NUM_STAGES", "KS", "PASS", "SK", "NUM_BUFFERS", "IS_PAGED", "FUSE_NORM")


def _label(variants) -> None:
    by_kernel: dict = {}
    for v in variants:
        by_kernel.setdefault(v.jit.__name__, []).append(v)
    for name, vs in by_kernel.items():
        keys = [k for k in vs[0].signature[1]
                if k in ALWAYS or len({repr(x.signature[1].get(k)) for x in vs}) > 1]
        for v in vs:
            cons = v.signature[1]
            short = ",".join(f"{k}={_short(cons.get(k))}" for k in keys if k in cons)
            launch = ",".join(f"{k}={x}" for k, x in sorted(v.opts.items()))
            v.label_text = f"{name}[{short}]({launch})"


def _short(x):
    if isinstance(x, bool):
        return int(x)
    if x is None:
        return "None"
    return x
