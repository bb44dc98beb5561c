"""The problem generator: one seeded recipe (a ProblemSpec) -> one Problem, deterministically.

Every generated problem in the project comes from here: the suites' cases and the fuzz draw
(verification.running.cases), calibrate and shrink (which run those cases), bench's inputs
(verification.investigating.bench) and the tests' problems.  ``generate(spec)`` is a pure function of the
spec: the same spec gives the same Problem, bit for bit, on every machine (random numbers are
drawn on the CPU from a generator seeded by ``spec.seed`` and only then moved to the device),
except with ``draw="device"`` (below).

Inputs follow aiter's FlashKDA test generator (realistic Kimi ranges), in this draw order:

    q, k   = qk_scale N(0,1) [B,T,H,K]          v = v_scale N(0,1) [B,T,HV,V]      (dtype, bf16)
    g      = g_scale N(0,1) + g_shift [B,T,HV,K] (dtype; gate=pregated: -|that|, a log-decay <= 0)
    beta   = beta_scale N(0,1) fp32 [B,T,HV], or the constant beta_raw
    A_log  = 0.5 |N(0,1)| fp32 [HV]             dt_bias = 0.1 N(0,1) fp32 [HV*K]
    scale  = 1/sqrt(K), lower_bound = lb (gate=lower_bound; None for softplus / pregated)

Fields of ProblemSpec (every one optional; the vocabulary of a case's ``params``):

    B, T, H, HV, K, V   sizes (defaults 1, 64, 2, H, 128, 128); HV > H is GVA (HV % H == 0);
                        ``lens`` [..] makes a varlen problem (B = 1, T = sum(lens), empty
                        sequences allowed)
    lb                  lower bound of the gate (gate = lower_bound; default -5)
    gate, beta_kind     lower_bound | softplus | pregated;  sigmoid | sigmoid2 | pregated
    qk_l2norm           the kernel l2-normalises q and k (default True)
    g_scale, g_shift    raw gate = g_scale*N(0,1) + g_shift (g_shift = 12 saturates the sigmoid)
    qk_scale, v_scale   multiply raw q, k and v (qk_scale 1e-4: row norms ~1e-3, where the
                        l2norm's eps matters)
    beta_raw            a constant raw beta (4 -> beta ~ 0.982) instead of beta_scale N(0,1)
    rho                 correlated keys: k <- rho*k[first token] + (1-rho)*k
    key_cos             (lo, hi): keys of each sequence follow k_t = c k_{t-1} + sqrt(1-c^2) n_t per
                        key head (n_t the drawn keys, c uniform in [lo, hi] per head), so the cosine
                        between consecutive keys is about c, as trained models show (0.85-0.97)
    exact_keys          n: keys are +-1 on n of the first 8 channels (bf16-exact after l2norm)
    state               none | kv | vk | paged;  state_scale (default 0.5) multiplies N(0,1)
    converged           initial state S* and v_t = S*^T khat_t (+ rounding to dtype): S^T k ~ v
    slots, slot_pad     the paged cache: ``slots`` slots (default 2N+3; V-first [slots,HV,V,K],
                        the only layout a Problem's cache has), each ``HV*V*K + slot_pad``
                        elements apart (a padded slot stride: the cache is a strided view)
    paged_new           indices of sequences that start fresh (has_initial_state False);
                        their slots and every unused slot hold NaN
    fused_proj          q/k/v/g are strided bands of one [B,T,H*(2K)+HV*(V+K)] projection
    chunks_per_seg      a hint for segmented routes (stored in problem.meta)
    norm                a fused output norm: out_gate ~ N(0,1) [B,T,HV,V] (dtype), norm_weight =
                        1 + 0.1 N(0,1) fp32 [V] (drawn after every other input, so the rest of the
                        problem is the one the same spec gives without it); norm_eps (1e-5)
    dtype               of q, k, v, g and out_gate (default bfloat16); ``param_dtype`` of beta,
                        A_log, dt_bias, the states and norm_weight (default float32)
    seed                the generator's seed
    draw                cpu (default: machine-independent) | device: drawn by ``device``'s own
                        generator (bench's large inputs, made fast where they are timed; the
                        values then depend on the device's generator; plain problems only)
    long                a case too long for CPU runs (no effect on the problem)

Named shapes: ``ProblemSpec.named("B1-T16384-H12")`` (the default suite's names, optionally
``-HV{n}``) or ``"1x16384x12"`` (bench's ``--shapes``), with any other field as a keyword.
Bad fields raise kda_ref.problem.ProblemError naming the field, what was expected and what came.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from kda_ref.problem import BETA_KINDS, FLOAT_DTYPES, GATE_KINDS, Problem, ProblemError, validate

STATES = ("none", "kv", "vk", "paged")
DRAWS = ("cpu", "device")


@dataclass(frozen=True)
class ProblemSpec:
    """One problem's recipe (the module docstring lists the fields and their defaults)."""
    B: int = 1
    T: int = 64
    H: int = 2
    HV: Optional[int] = None
    K: int = 128
    V: int = 128
    lens: Optional[tuple] = None
    lb: float = -5.0
    gate: str = "lower_bound"
    beta_kind: str = "sigmoid"
    qk_l2norm: bool = True
    g_scale: float = 0.1
    g_shift: float = 0.0
    qk_scale: float = 1.0
    v_scale: float = 1.0
    beta_raw: Optional[float] = None
    beta_scale: float = 1.0
    rho: float = 0.0
    key_cos: Optional[tuple] = None
    exact_keys: int = 0
    state: str = "none"
    state_scale: float = 0.5
    converged: bool = False
    slots: Optional[int] = None
    slot_pad: int = 0
    paged_new: tuple = ()
    fused_proj: bool = False
    chunks_per_seg: Optional[int] = None
    norm: bool = False
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.bfloat16
    param_dtype: torch.dtype = torch.float32
    seed: int = 0
    draw: str = "cpu"
    long: bool = False

    def __post_init__(self):
        def req(cond, msg):
            if not cond:
                raise ProblemError(msg)

        for n in ("B", "T", "H", "K", "V", "exact_keys", "slot_pad", "seed"):
            v = getattr(self, n)
            req(isinstance(v, int) and not isinstance(v, bool) and v >= (1 if n in ("H", "K", "V") else 0),
                f"{n}: expected an integer >= {1 if n in ('H', 'K', 'V') else 0}, got {v!r}")
        req(self.HV is None or (isinstance(self.HV, int) and self.HV >= 1 and self.HV % self.H == 0),
            f"HV: expected a multiple of H={self.H} (GVA), got {self.HV!r}")
        if self.lens is not None:
            req(len(self.lens) >= 1 and all(isinstance(n, int) and n >= 0 for n in self.lens),
                f"lens: expected one or more integers >= 0, got {self.lens!r}")
        req(self.state in STATES, f"state: expected one of {'|'.join(STATES)}, got {self.state!r}")
        req(self.gate in GATE_KINDS, f"gate: expected one of {'|'.join(GATE_KINDS)}, got {self.gate!r}")
        req(self.beta_kind in BETA_KINDS, f"beta_kind: expected one of {'|'.join(BETA_KINDS)}, got {self.beta_kind!r}")
        req(self.draw in DRAWS, f"draw: expected one of {'|'.join(DRAWS)}, got {self.draw!r}")
        for n in ("dtype", "param_dtype"):
            req(getattr(self, n) in FLOAT_DTYPES, f"{n}: expected a torch float dtype, got {getattr(self, n)!r}")
        req(self.slots is None or (isinstance(self.slots, int) and self.slots >= len(self.lengths)),
            f"slots: expected an integer >= N={len(self.lengths)} (one slot per sequence), got {self.slots!r}")
        req(all(0 <= int(i) < len(self.lengths) for i in self.paged_new),
            f"paged_new: expected sequence indices in [0, {len(self.lengths)}), got {list(self.paged_new)}")
        if self.draw == "device":
            extra = [n for n in ("rho", "key_cos", "exact_keys", "converged", "fused_proj") if getattr(self, n)]
            extra += ["state=paged"] if self.state == "paged" else []
            req(not extra, f"draw: expected draw=cpu with {', '.join(extra)} (draw=device makes plain "
                           f"problems), got draw=device")

    # ----- derived ---------------------------------------------------------------------------
    @property
    def varlen(self) -> bool:
        return self.lens is not None

    @property
    def lengths(self) -> list[int]:
        """Every sequence's token count: ``lens``, or B sequences of T."""
        return [int(n) for n in self.lens] if self.varlen else [int(self.T)] * int(self.B)

    def replace(self, **changes) -> "ProblemSpec":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_params(cls, params: dict, seed: int = 0, **more) -> "ProblemSpec":
        """The spec of a case's ``params`` (the module docstring's vocabulary) and ``seed``;
        an unknown parameter is a ProblemError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        p = dict(params, **more)
        bad = sorted(set(p) - names)
        if bad:
            raise ProblemError(f"params: expected parameters among {', '.join(sorted(names))}, got {', '.join(bad)}")
        kw = {}
        for n, v in p.items():
            if n in ("lens", "paged_new", "key_cos") and v is not None:
                v = tuple(v)
            if n in ("B", "T", "H", "HV", "K", "V", "exact_keys", "slots", "slot_pad", "chunks_per_seg") \
                    and v is not None and not isinstance(v, bool):
                v = int(v)
            if n == "lens" and v is not None:
                v = tuple(int(x) for x in v)
            kw[n] = v
        return cls(seed=int(seed), **kw)

    @classmethod
    def named(cls, name: str, **fields) -> "ProblemSpec":
        """A named shape, ``B{B}-T{T}-H{H}[-HV{HV}]`` or ``{B}x{T}x{H}[x{HV}]``, and other fields."""
        m = (re.fullmatch(r"B(\d+)-T(\d+)-H(\d+)(?:-HV(\d+))?", name)
             or re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:x(\d+))?", name.strip().lower()))
        if not m:
            raise ProblemError(f"shape: expected B<b>-T<t>-H<h>[-HV<hv>] or BxTxH[xHV], got {name!r}")
        B, T, H, HV = (None if g is None else int(g) for g in m.groups())
        return cls(B=B, T=T, H=H, HV=HV, **fields)


def generate(spec, device="cpu", meta: Optional[dict] = None, **fields) -> Problem:
    """The Problem of ``spec`` (a ProblemSpec, or a dict of its fields; ``fields`` override
    it) on ``device``, validated; ``meta`` is the problem's free-form provenance (plus
    ``chunks_per_seg`` when the spec has one)."""
    if not isinstance(spec, ProblemSpec):
        spec = ProblemSpec.from_params(dict(spec or {}), **fields)
    elif fields:
        spec = spec.replace(**fields)
    s = spec
    dev = torch.device(device)
    draw_dev = dev if s.draw == "device" else torch.device("cpu")
    gen = torch.Generator(device=draw_dev).manual_seed(int(s.seed))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=draw_dev)

    def low(x):
        return x.to(s.dtype)

    def par(x):
        return x.to(s.param_dtype)

    H = s.H
    HV = s.H if s.HV is None else s.HV
    K, V = s.K, s.V
    varlen = s.varlen
    lens = s.lengths
    B, T = (1, sum(lens)) if varlen else (s.B, s.T)
    N = len(lens)
    bounds = _bounds(lens, B, T, varlen)
    g_scale, g_shift = float(s.g_scale), float(s.g_shift)
    if s.fused_proj:
        # one projection [B,T,H*K | H*K | HV*V | HV*K]; q, k, v, g are strided views of it
        pieces = [randn(B, T, H * K), randn(B, T, H * K), float(s.v_scale) * randn(B, T, HV * V),
                  _gate(g_scale * randn(B, T, HV * K) + g_shift, s.gate)]
        proj = low(torch.cat(pieces, dim=-1))
        o1, o2, o3 = H * K, 2 * H * K, 2 * H * K + HV * V
        q = proj[..., :o1].unflatten(-1, (H, K))
        k = proj[..., o1:o2].unflatten(-1, (H, K))
        v = proj[..., o2:o3].unflatten(-1, (HV, V))
        g = proj[..., o3:].unflatten(-1, (HV, K))
    else:
        qk_scale = float(s.qk_scale)
        q, k = low(qk_scale * randn(B, T, H, K)), low(qk_scale * randn(B, T, H, K))
        v = low(float(s.v_scale) * randn(B, T, HV, V))
        g = low(_gate(g_scale * randn(B, T, HV, K) + g_shift, s.gate))
    beta = float(s.beta_scale) * randn(B, T, HV)
    if s.beta_raw is not None:
        beta = torch.full((B, T, HV), float(s.beta_raw), device=draw_dev)
    beta = par(beta)
    if s.exact_keys:
        # keys with +-1 on `exact_keys` of the first 8 channels: their l2norm is exact in bf16
        # (1/sqrt(n)), so with the gate off (g_shift -200: sigmoid underflows, no decay) every
        # tile is exact and the stored inverse dominates the error budget
        nnz = int(s.exact_keys)
        pick = torch.stack([torch.randperm(8, generator=gen)[:nnz] for _ in range(B * T * H)])
        sign = torch.randint(0, 2, (B * T * H, nnz), generator=gen).float() * 2 - 1
        kk = torch.zeros(B * T * H, K)
        kk.scatter_(1, pick, sign)
        k = low(kk.reshape(B, T, H, K))
    rho = float(s.rho)
    if rho:
        # correlated keys within each sequence: every key leans towards the sequence's first key
        kf = k.float().clone()
        for n, (bos, eos) in enumerate(bounds):
            b, t0, t1 = (0, bos, eos) if varlen else (n, 0, T)
            if t1 > t0:
                kf[b, t0:t1] = rho * kf[b, t0:t0 + 1] + (1.0 - rho) * kf[b, t0:t1]
        k = low(kf)
    if s.key_cos:
        lo, hi = (float(x) for x in s.key_cos)
        c = lo + (hi - lo) * torch.rand(H, generator=gen)
        k = low(ar1_keys(k.float(), c, bounds, varlen))
    A_log = par(0.5 * randn(HV).abs())
    dt_bias = par(0.1 * randn(HV * K))
    state = s.state
    scale_s = float(s.state_scale)
    init = None
    cache = indices = has_init = None
    if s.converged:
        # S* with S*^T khat ~ v: v is made from the keys the kernel will see
        S_star = randn(N, HV, K, V) * scale_s
        kh = k.double() / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + 1e-6)
        kh = kh.repeat_interleave(HV // H, dim=2)
        vv = torch.zeros(B, T, HV, V, dtype=torch.float64)
        for n, (bos, eos) in enumerate(bounds):
            b, t0, t1 = (0, bos, eos) if varlen else (n, 0, T)
            vv[b, t0:t1] = torch.einsum("thk,hkv->thv", kh[b, t0:t1], S_star[n].double())
        v = low(vv)
        init = S_star
        state = "kv" if state == "none" else state
    elif state in ("kv", "vk", "paged"):
        init = randn(N, HV, K, V) * scale_s
    if state == "vk" and init is not None:
        init = init.transpose(-1, -2).contiguous()
    if state == "paged":
        slots = int(s.slots if s.slots is not None else 2 * N + 3)
        new = set(int(i) for i in s.paged_new)
        perm = torch.randperm(slots, generator=gen)[:N]
        indices = perm.to(torch.int32)
        has_init = torch.tensor([n not in new for n in range(N)], dtype=torch.bool)
        pad = int(s.slot_pad)
        buf = torch.full((slots, HV * V * K + pad), math.nan, dtype=s.param_dtype)
        cache = buf[:, :HV * V * K].unflatten(-1, (HV, V, K))
        for n in range(N):
            if has_init[n]:
                cache[int(indices[n])] = init[n].transpose(-1, -2)
        init = None
    if init is not None:
        init = par(init)
    layout = state if state in ("kv", "vk", "paged") else "kv"
    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int64, device=draw_dev) if varlen else None
    meta = dict(meta or {})
    if s.chunks_per_seg is not None:
        meta["chunks_per_seg"] = int(s.chunks_per_seg)
    norm = {}
    if s.norm:
        norm = dict(out_gate=low(randn(B, T, HV, V)), norm_weight=par(1.0 + 0.1 * randn(V)),
                    norm_eps=float(s.norm_eps))
    prob = Problem(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5,
                   lower_bound=float(s.lb) if s.gate == "lower_bound" else None, gate=s.gate,
                   beta_kind=s.beta_kind, qk_l2norm=bool(s.qk_l2norm),
                   cu_seqlens=cu, initial_state=init, state_layout=layout, state_cache=cache,
                   state_indices=indices, has_initial_state=has_init, output_final_state=True, meta=meta,
                   **norm)
    if dev != draw_dev:
        prob = to_device_keep_views(prob, dev)
    return validate(prob)


def _gate(raw: torch.Tensor, gate: str) -> torch.Tensor:
    """The drawn gate as the gate kind takes it: a raw gate, or (pregated) a log-decay -|raw| <= 0."""
    return -raw.abs() if gate == "pregated" else raw


def ar1_keys(noise: torch.Tensor, c: torch.Tensor, bounds, varlen: bool, L: int = 32) -> torch.Tensor:
    """Keys [B, T, H, K] with x_t = c x_{t-1} + sqrt(1 - c^2) n_t within each sequence (x at a
    sequence start = n there; c [H] per key head), from the noise n [B, T, H, K] float32.  Blocks of
    L tokens: inside a block x = P n (P_ij = s c^(i-j), j <= i) for all blocks at once, then the
    block ends carried sequentially: x_i += c^(i+1) x_end(previous block)."""
    B, T, H, K = noise.shape
    out = noise.clone()
    s = torch.sqrt(1.0 - c * c)                                               # [H]
    e = torch.arange(L)
    lag = (e[:, None] - e[None, :]).clamp(min=0).to(torch.float32)
    P = torch.where(e[:, None] >= e[None, :], c[:, None, None] ** lag, torch.zeros(()))   # [H, L, L]
    P = P * s[:, None, None]
    pw = c[:, None] ** (e[None, :] + 1).to(torch.float32)                     # [H, L] c^(i+1)
    for n, (bos, eos) in enumerate(bounds):
        b, t0, t1 = (0, bos, eos) if varlen else (n, 0, T)
        if t1 - t0 < 2:
            continue
        rest = noise[b, t0 + 1:t1]                                            # [n, H, K]
        m = rest.shape[0]
        nb = -(-m // L)
        pad = torch.zeros(nb * L - m, H, K)
        blocks = torch.cat([rest, pad]).reshape(nb, L, H, K).permute(2, 0, 1, 3)     # [H, nb, L, K]
        local = torch.einsum("hij,hbjk->hbik", P, blocks)                    # [H, nb, L, K]
        prev = noise[b, t0]                                                   # [H, K]
        for j in range(nb):
            local[:, j] += pw[:, :, None] * prev[:, None, :]
            prev = local[:, j, -1]
        out[b, t0 + 1:t1] = local.permute(1, 2, 0, 3).reshape(nb * L, H, K)[:m]
    return out


def to_device_keep_views(prob: Problem, device) -> Problem:
    """Move a Problem to ``device``; strided views stay strided views of one moved buffer."""
    changes = {}
    for name, t in prob.tensors().items():
        if t.is_contiguous() or t._base is None:
            changes[name] = t.to(device)
        else:
            base = t._base.to(device)
            changes[name] = base.as_strided(t.shape, t.stride(), t.storage_offset() - t._base.storage_offset())
    return prob.replace(**changes)


def problem_digest(p: Problem) -> str:
    """sha256 of a Problem: its tensors bit for bit (with their strides and, for a view, its
    storage offset: a strided view is another input to a kernel than its contiguous copy) and
    every other field, meta included."""
    h = hashlib.sha256()
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        h.update(f.name.encode())
        if isinstance(v, torch.Tensor):
            h.update(f"{v.dtype}{tuple(v.shape)}{v.stride()}{v.storage_offset() if v._base is not None else 0}".encode())
            c = v.detach().cpu().contiguous()
            h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _bounds(lens, B, T, varlen):
    if not varlen:
        return [(b * T, (b + 1) * T) for b in range(B)]
    c = [0] + list(_cumsum(lens))
    return list(zip(c[:-1], c[1:]))
