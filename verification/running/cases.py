"""Cases and suites (docs/design.md, Vocabulary): a Case is a name, a seed and a recipe of parameters that
builds one Problem deterministically.

Inputs follow aiter's FlashKDA test generator (realistic Kimi ranges):

    q, k, v ~ N(0,1) bf16 [B,T,H,128]      g = g_scale*N(0,1) + g_shift, bf16 [B,T,H,128]
    beta_raw ~ N(0,1) fp32 (or a constant) A_log = 0.5|N(0,1)| fp32 [H]
    dt_bias = 0.1 N(0,1) fp32 [H*128]      scale = 1/sqrt(128), lower_bound lb (default -5)

Random numbers are drawn on the CPU from a generator seeded by the case's seed, then moved to
the requested device, so a case builds the same Problem on every machine.

Parameters (``Case.params``; every one optional):
    B, T, H, HV, K, V   sizes (defaults 1, 64, 2, H, 128, 128); ``lens`` [..] makes a varlen
                        problem (B = 1, T = sum(lens), empty sequences allowed)
    lb                  lower bound of the gate (gate = lower_bound)
    g_scale, g_shift    raw gate = g_scale*N(0,1) + g_shift (g_shift = 12 saturates the sigmoid)
    beta_raw            a constant raw beta (4 -> beta ~ 0.982) instead of N(0,1)
    rho                 correlated keys: k <- rho*k[first token] + (1-rho)*k
    key_cos             (lo, hi): keys of each sequence follow k_t = c k_{t-1} + sqrt(1-c^2) n_t per
                        key head (n_t the drawn keys, c uniform in [lo, hi] per head), so the cosine
                        between consecutive keys is about c, as trained models show (0.85-0.97)
    qk_scale            multiplies raw q and k (1e-4: row norms ~1e-3, where the l2norm's eps matters)
    exact_keys          n: keys are +-1 on n of the first 8 channels (bf16-exact after l2norm)
    state               none | kv | vk | paged;  state_scale (default 0.5) multiplies N(0,1)
    converged           initial state S* and v_t = S*^T khat_t (+ bf16 rounding): S^T k ~ v
    paged_new           indices of sequences that start fresh (has_initial_state False);
                        their slots and every unused slot hold NaN; slot_pad adds a slot stride pad
    fused_proj          q/k/v/g are strided bands of one [B,T,H*(3K+V)] projection
    chunks_per_seg      a hint for segmented routes (stored in problem.meta)
    norm                a fused output norm: out_gate ~ N(0,1) bf16 [B,T,HV,V], norm_weight =
                        1 + 0.1 N(0,1) fp32 [V] (drawn after every other input, so the rest of the
                        problem is the one the same parameters give without it); norm_eps (1e-5)
    long                a case too long for CPU runs (get_suite(..., long=False) drops it)
"""
from __future__ import annotations

import copy
import functools
import math
import random
import re
import zlib
from dataclasses import dataclass, field

import torch

from kda_ref.problem import Problem, validate

SUITES = ("smoke", "default", "k3-prefill", "stress", "fuzz", "long", "norm")
# The numeric parameters of the module docstring: the ones a known failure in tolerances.yaml may
# put conditions on (its ``params`` field; verification.judging.tolerances).
NUMERIC_PARAMS = ("B", "T", "H", "HV", "K", "V", "lb", "g_scale", "g_shift", "beta_raw", "rho", "qk_scale",
                  "exact_keys", "state_scale", "slots", "slot_pad", "chunks_per_seg", "norm_eps")

DEFAULT_SHAPES = ((1, 256, 12), (1, 512, 12), (1, 1664, 12), (1, 2048, 12), (1, 8192, 12), (1, 16384, 12),
                  (1, 16384, 64), (1, 16384, 96), (1, 8192, 32), (1, 8192, 64), (2, 2664, 12), (4, 4096, 16),
                  (8, 2048, 16))


def _usage_error(msg: str) -> Exception:
    from verification.errors import UsageError
    return UsageError(msg)


def stable_seed(text: str) -> int:
    """A seed that depends only on the text (crc32), the same on every machine and run."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass
class Case:
    name: str
    suite: str
    seed: int
    params: dict = field(default_factory=dict)
    suite_opts: dict = field(default_factory=dict)   # the draw a fuzz case comes from: {"n": N, "seed": S}

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    @property
    def long(self) -> bool:
        return bool(self.params.get("long", False))

    @property
    def lens(self):
        p = self.params
        if "lens" in p:
            return list(p["lens"])
        return [p.get("T", 64)] * p.get("B", 1)

    @property
    def shape_key(self) -> tuple:
        """(B, T, H) for plots: T is the total token count of a varlen case."""
        p = self.params
        if "lens" in p:
            return (1, sum(p["lens"]), p.get("H", 2))
        return (p.get("B", 1), p.get("T", 64), p.get("H", 2))

    def build(self, device="cpu") -> Problem:
        """The Problem of this case (deterministic from the seed), on ``device``."""
        return build_problem(self.params, self.seed, device=device, meta={"case": self.id, "seed": self.seed})

    def __repr__(self) -> str:
        return f"Case({self.id!r}, seed={self.seed})"


def _bf16(x):
    return x.to(torch.bfloat16)


def build_problem(params: dict, seed: int, device="cpu", meta=None) -> Problem:
    """Realistic KDA inputs from ``params`` (see the module docstring) and ``seed``."""
    p = dict(params)
    gen = torch.Generator().manual_seed(int(seed))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    H = int(p.get("H", 2))
    HV = int(p.get("HV", H))
    K, V = int(p.get("K", 128)), int(p.get("V", 128))
    varlen = "lens" in p
    if varlen:
        lens = [int(n) for n in p["lens"]]
        B, T = 1, sum(lens)
    else:
        B, T = int(p.get("B", 1)), int(p.get("T", 64))
        lens = [T] * B
    N = len(lens)
    g_scale, g_shift = float(p.get("g_scale", 0.1)), float(p.get("g_shift", 0.0))
    if p.get("fused_proj"):
        # one projection [B,T,H*K | H*K | HV*V | HV*K]; q, k, v, g are strided views of it
        pieces = [randn(B, T, H * K), randn(B, T, H * K), randn(B, T, HV * V), g_scale * randn(B, T, HV * K) + g_shift]
        proj = _bf16(torch.cat(pieces, dim=-1))
        o1, o2, o3 = H * K, 2 * H * K, 2 * H * K + HV * V
        q = proj[..., :o1].unflatten(-1, (H, K))
        k = proj[..., o1:o2].unflatten(-1, (H, K))
        v = proj[..., o2:o3].unflatten(-1, (HV, V))
        g = proj[..., o3:].unflatten(-1, (HV, K))
    else:
        qk_scale = float(p.get("qk_scale", 1.0))
        q, k = _bf16(qk_scale * randn(B, T, H, K)), _bf16(qk_scale * randn(B, T, H, K))
        v = _bf16(randn(B, T, HV, V))
        g = _bf16(g_scale * randn(B, T, HV, K) + g_shift)
    beta = randn(B, T, HV)
    if "beta_raw" in p:
        beta = torch.full((B, T, HV), float(p["beta_raw"]))
    if p.get("exact_keys"):
        # keys with +-1 on `exact_keys` of the first 8 channels: their l2norm is exact in bf16
        # (1/sqrt(n)), so with the gate off (g_shift -200: sigmoid underflows, no decay) every
        # tile is exact and the stored inverse dominates the error budget
        nnz = int(p["exact_keys"])
        pick = torch.stack([torch.randperm(8, generator=gen)[:nnz] for _ in range(B * T * H)])
        sign = torch.randint(0, 2, (B * T * H, nnz), generator=gen).float() * 2 - 1
        kk = torch.zeros(B * T * H, K)
        kk.scatter_(1, pick, sign)
        k = _bf16(kk.reshape(B, T, H, K))
    rho = float(p.get("rho", 0.0))
    if rho:
        # correlated keys within each sequence: every key leans towards the sequence's first key
        kf = k.float().clone()
        for n, (bos, eos) in enumerate(_bounds(lens, B, T, varlen)):
            b, t0, t1 = (0, bos, eos) if varlen else (n, 0, T)
            if t1 > t0:
                kf[b, t0:t1] = rho * kf[b, t0:t0 + 1] + (1.0 - rho) * kf[b, t0:t1]
        k = _bf16(kf)
    if p.get("key_cos"):
        lo, hi = (float(x) for x in p["key_cos"])
        c = lo + (hi - lo) * torch.rand(H, generator=gen)
        k = _bf16(_ar1_keys(k.float(), c, _bounds(lens, B, T, varlen), varlen))
    A_log = 0.5 * randn(HV).abs()
    dt_bias = 0.1 * randn(HV * K)
    lb = float(p.get("lb", -5.0))
    state = p.get("state", "none")
    scale_s = float(p.get("state_scale", 0.5))
    init = None
    cache = indices = has_init = None
    if p.get("converged"):
        # S* with S*^T khat ~ v: v is made from the keys the kernel will see
        S_star = randn(N, HV, K, V) * scale_s
        kh = k.double() / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + 1e-6)
        kh = kh.repeat_interleave(HV // H, dim=2)
        vv = torch.zeros(B, T, HV, V, dtype=torch.float64)
        for n, (bos, eos) in enumerate(_bounds(lens, B, T, varlen)):
            b, t0, t1 = (0, bos, eos) if varlen else (n, 0, T)
            vv[b, t0:t1] = torch.einsum("thk,hkv->thv", kh[b, t0:t1], S_star[n].double())
        v = _bf16(vv)
        init = S_star
        state = "kv" if state == "none" else state
    elif state in ("kv", "vk", "paged"):
        init = randn(N, HV, K, V) * scale_s
    if state == "vk" and init is not None:
        init = init.transpose(-1, -2).contiguous()
    if state == "paged":
        slots = int(p.get("slots", 2 * N + 3))
        new = set(int(i) for i in p.get("paged_new", []))
        perm = torch.randperm(slots, generator=gen)[:N]
        indices = perm.to(torch.int32)
        has_init = torch.tensor([n not in new for n in range(N)], dtype=torch.bool)
        pad = int(p.get("slot_pad", 0))
        buf = torch.full((slots, HV * V * K + pad), math.nan, dtype=torch.float32)
        cache = buf[:, :HV * V * K].unflatten(-1, (HV, V, K))
        for n in range(N):
            if has_init[n]:
                cache[int(indices[n])] = init[n].transpose(-1, -2)
        init = None
    layout = state if state in ("kv", "vk", "paged") else "kv"
    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int64) if varlen else None
    meta = dict(meta or {})
    if "chunks_per_seg" in p:
        meta["chunks_per_seg"] = int(p["chunks_per_seg"])
    norm = {}
    if p.get("norm"):
        norm = dict(out_gate=_bf16(randn(B, T, HV, V)), norm_weight=1.0 + 0.1 * randn(V),
                    norm_eps=float(p.get("norm_eps", 1e-5)))
    prob = Problem(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5,
                   lower_bound=lb, gate="lower_bound", beta_kind="sigmoid", qk_l2norm=True,
                   cu_seqlens=cu, initial_state=init, state_layout=layout, state_cache=cache,
                   state_indices=indices, has_initial_state=has_init, output_final_state=True, meta=meta,
                   **norm)
    if str(device) != "cpu":
        prob = _to_device_keep_views(prob, device)
    return validate(prob)


def _ar1_keys(noise: torch.Tensor, c: torch.Tensor, bounds, varlen: bool, L: int = 32) -> torch.Tensor:
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


def _to_device_keep_views(prob: Problem, device) -> Problem:
    """Move a Problem to ``device``; strided views stay strided views of one moved buffer."""
    changes = {}
    for name, t in prob.tensors().items():
        if t.is_contiguous() or t._base is None:
            changes[name] = t.to(device)
        else:
            base = t._base.to(device)
            changes[name] = base.as_strided(t.shape, t.stride(), t.storage_offset() - t._base.storage_offset())
    return prob.replace(**changes)


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


# ----------------------------------------------------------------------------------- suites
def _case(suite: str, name: str, **params) -> Case:
    return Case(name=name, suite=suite, seed=stable_seed(f"{suite}/{name}"), params=params)


def smoke_suite() -> list[Case]:
    """Six tiny cases (K=V=128, T <= 100, H <= 2): seconds per case even in Triton's interpreter."""
    s = "smoke"
    return [
        _case(s, "dense-T64-lb-5", B=1, T=64, H=2),
        _case(s, "varlen-tail33-lb-5", lens=[33, 64], H=2),
        _case(s, "initial-state-kv-lb-5", B=2, T=40, H=1, state="kv"),
        _case(s, "paged-lb-5", lens=[20, 47], H=2, state="paged", paged_new=[1]),
        _case(s, "weak-gate-lb-0.1-vk", B=1, T=96, H=2, lb=-0.1, state="vk"),
        _case(s, "correlated-weak-lb-0.01", B=1, T=64, H=1, lb=-0.01, rho=0.9, beta_raw=4.0),
    ]


def norm_suite() -> list[Case]:
    """Problems with a fused output norm (``norm``: out_gate, norm_weight, norm_eps), which only a
    route that applies the norm takes (aiter's ``chunk_kda:gluon:norm``, the emulator's aiter
    recipes; kda_kernels.base.applicable): a smoke-sized varlen case with an initial state and a
    k3-prefill-sized one (H 12, a paged cache, fresh and continued sequences, a padded slot
    stride, eps 1e-6), both at the weak gate lb -0.1, where the state persists and o's mean
    square per token (median 3.0e-4 and 1.7e-4) dwarfs eps; at lb -5 these inputs give o a mean
    square near 5e-6, below aiter's eps 1e-5, where the norm barely normalises and a wrong eps
    hides.  A suite of its own, so every other suite's cells stay as they were."""
    s = "norm"
    return [
        _case(s, "varlen-tail33-kv-lb-0.1", lens=[33, 64], H=2, state="kv", lb=-0.1, norm=True),
        _case(s, "k3-N4-T1939-paged-lb-0.1", lens=[1024, 7, 640, 268], H=12, state="paged", paged_new=[1],
              slot_pad=64, lb=-0.1, norm=True, norm_eps=1e-6),
    ]


def default_suite() -> list[Case]:
    """The 13 production benchmark shapes (K=V=128, lb -5)."""
    return [_case("default", f"B{B}-T{T}-H{H}", B=B, T=T, H=H, long=B * T * H > 2 ** 20)
            for B, T, H in DEFAULT_SHAPES]


def k3_prefill_suite() -> list[Case]:
    """26 synthetic Kimi-K3 (H=12, TP8) varlen prefill forwards: some sequences continue a
    cached prefix through the paged cache (has_initial_state True), the others start fresh
    and their slots hold NaN, which must never be read."""
    gen = torch.Generator().manual_seed(stable_seed("k3-prefill"))
    cases = []
    for i in range(26):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        # log-uniform lengths between 1 and 4096 tokens, some exactly chunk-aligned
        lens = [max(1, int(2 ** (12 * float(torch.rand(1, generator=gen))))) for _ in range(n)]
        if i % 5 == 0:
            lens[0] = 32 * max(1, lens[0] // 32)
        fresh = [j for j in range(n) if float(torch.rand(1, generator=gen)) < 0.5]
        total = sum(lens)
        cases.append(_case("k3-prefill", f"p{i:02d}-N{n}-T{total}", lens=lens, H=12, state="paged",
                           paged_new=fresh, slot_pad=(64 if i % 4 == 1 else 0), long=total * 12 > 2 ** 17))
    return cases


def stress_suite() -> list[Case]:
    """The numerically hard corners: weak and saturated gates, correlated keys, tails, empty sequences, large states."""
    s = "stress"
    c = []
    for lb in (-0.01, -0.1, -1.0):
        c.append(_case(s, f"weak-gate-lb{lb:g}", B=1, T=96, H=2, lb=lb, state="kv"))
    for lb in (-5.0, -5.5):
        c.append(_case(s, f"saturated-gate-lb{lb:g}", B=1, T=96, H=2, lb=lb, g_scale=1.0, g_shift=12.0))
    for rho in (0.9, 1.0):
        c.append(_case(s, f"correlated-keys-rho{rho:g}-lb-0.01", B=1, T=96, H=2, lb=-0.01, rho=rho,
                       beta_raw=4.0))
    for tail in (1, 15, 16, 17, 31, 32, 33):
        c.append(_case(s, f"tail{tail}-lb-1", lens=[tail, 64 + tail], H=1, lb=-1.0, state="kv"))
    for where, lens in (("start", [0, 40, 70]), ("middle", [40, 0, 70]), ("end", [40, 70, 0])):
        c.append(_case(s, f"empty-seq-{where}", lens=lens, H=1, lb=-1.0, state="kv"))
    c.append(_case(s, "exact-keys-gate-off-beta4", B=1, T=96, H=2, lb=-1.0, g_shift=-200.0, exact_keys=4,
                   beta_raw=4.0))
    c.append(_case(s, "small-norm-qk-lb-1", B=1, T=64, H=2, lb=-1.0, qk_scale=1e-4, state="kv"))
    c.append(_case(s, "one-chunk-per-segment-lb-0.1", B=1, T=160, H=1, lb=-0.1, state="kv", chunks_per_seg=1))
    c.append(_case(s, "large-state-x100-lb-0.1", B=1, T=96, H=1, lb=-0.1, state="kv", state_scale=100.0))
    c.append(_case(s, "converged-state-lb-0.01", B=1, T=96, H=1, lb=-0.01, converged=True, state_scale=0.1))
    c.append(_case(s, "fused-projection-bands-lb-1", B=2, T=48, H=2, lb=-1.0, fused_proj=True, state="vk"))
    c.append(_case(s, "long-T65536-lb-0.1", B=1, T=65536, H=2, lb=-0.1, state="kv", long=True))
    c.append(_case(s, "long-T65536-correlated-lb-0.01", B=1, T=65536, H=2, lb=-0.01, rho=0.9, beta_raw=4.0,
                   long=True))
    # every key of a sequence identical (rho 1), the gate off (raw gate -12: sigmoid ~ 6e-6, almost no
    # decay) and beta ~ 1 (logit 8): L is -beta on every strict-lower entry of every chunk, the
    # worst-conditioned inverse build, repeated for 16384 tokens; outputs must stay finite
    c.append(_case(s, "collinear-keys-T16384-gate-12-beta8-lb-5", B=1, T=16384, H=2, rho=1.0, g_scale=0.0,
                   g_shift=-12.0, beta_raw=8.0, long=True))
    return c


LONG_T = (16384, 131072, 262144, 1048576)       # H = 12: error against T, 16K the anchor
LONG_GATES = ((-5.0, "none"), (-0.05, "kv"))   # production gate; weak gate, where the state persists


def long_suite() -> list[Case]:
    """Long-context cases (K=V=128, every one ``long``: run where the device has room, never on a
    CPU): T = 16K, 128K, 256K and 1M tokens at H = 12 and 128K at H = 96, each at lb -5 and at the
    weak lb -0.05 with an initial state; a varlen pack of one 524288-token sequence and 64 short
    ones (1-4096 tokens, log-uniform); and keys with consecutive cosines 0.85-0.97 (key_cos) at
    128K (both gates) and 1M (weak gate)."""
    s = "long"
    c = []
    for T, H in [(t, 12) for t in LONG_T] + [(131072, 96)]:
        for lb, state in LONG_GATES:
            c.append(_case(s, f"T{T}-H{H}-lb{lb:g}", B=1, T=T, H=H, lb=lb, state=state, long=True))
    gen = torch.Generator().manual_seed(stable_seed("long/varlen"))
    short = [max(1, int(2 ** (12 * float(torch.rand(1, generator=gen))))) for _ in range(64)]
    lens = short[:32] + [524288] + short[32:]
    for lb, state in LONG_GATES:
        c.append(_case(s, f"varlen-524288+64-H12-lb{lb:g}", lens=lens, H=12, lb=lb, state=state, long=True))
    for T, gates in ((131072, LONG_GATES), (1048576, LONG_GATES[1:])):
        for lb, state in gates:
            c.append(_case(s, f"key-cos-0.85-0.97-T{T}-H12-lb{lb:g}", B=1, T=T, H=12, lb=lb, state=state,
                           key_cos=(0.85, 0.97), long=True))
    return c


FUZZ_DOMAIN = "K=V=128, HV=H, bf16 q/k/v/g, fp32 beta, lower-bound gate lb in [-5.5, -0.01], l2norm, sigmoid beta"
FUZZ_N, FUZZ_SEED = 20, 0           # the default draw (CI's)


def fuzz_options(n=None, seed=None, names=("--fuzz-n", "--fuzz-seed")) -> tuple[int, int]:
    """(n, seed) of a fuzz draw from option values (strings or ints; None: the default), or a
    UsageError naming the option: n must be an integer >= 1, seed an integer >= 0."""
    out = []
    for value, name, default, low in ((n, names[0], FUZZ_N, 1), (seed, names[1], FUZZ_SEED, 0)):
        if value is None:
            out.append(default)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _usage_error(f"{name}: expected an integer >= {low}, got {value!r}")
        text = str(value).strip()
        if not re.fullmatch(r"[+-]?\d+", text) or int(text) < low:
            raise _usage_error(f"{name}: expected an integer >= {low}, got {value!r}")
        out.append(int(text))
    return out[0], out[1]


FUZZ_LEN_EDGES = (0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 130)   # chunk edges for C = 32 and 64


def _fuzz_params(seed: int, i: int) -> dict:
    """Problem i of the fuzz draw with ``seed``: a pure function of (seed, i), drawn with
    Python's ``random.Random`` (whose ``random()`` stream is stable across versions and
    machines), so case i is the same for any n, on any machine.  The domain: 1-4 sequences of
    0..130 tokens (30% taken from the chunk edges), not all empty; H 1-2; the gate, key
    correlation and state settings below; beta_raw present half the time."""
    rng = random.Random(stable_seed(f"fuzz-params/{seed}/{i}"))

    def pick(options):
        return options[int(rng.random() * len(options))]

    while True:
        lens = [pick(FUZZ_LEN_EDGES) if rng.random() < 0.3 else int(rng.random() * 131)
                for _ in range(1 + int(rng.random() * 4))]
        if sum(lens) > 0:
            break
    p = {"lens": lens, "H": pick((1, 2)),
         "lb": pick((-5.5, -5.0, -3.0, -1.0, -0.3, -0.1, -0.01)),
         "g_scale": pick((0.1, 1.0, 4.0)), "g_shift": pick((0.0, -4.0, 4.0, 12.0)),
         "rho": pick((0.0, 0.0, 0.5, 0.9, 1.0)), "state": pick(("none", "kv", "vk", "paged")),
         "state_scale": pick((0.1, 1.0, 10.0))}
    if rng.random() < 0.5:
        p["beta_raw"] = pick((-4.0, 0.0, 4.0))
    return p


@functools.lru_cache(maxsize=8)
def _fuzz_draw(n: int, seed: int) -> tuple:
    return tuple(_fuzz_params(seed, i) for i in range(n))


def fuzz_suite(n: int = FUZZ_N, seed: int = FUZZ_SEED) -> list[Case]:
    """The first ``n`` problems of the fuzz draw with ``seed``, within the FlashKDA domain
    (FUZZ_DOMAIN).  Case ``fuzz{seed}-{i:03d}`` is ``_fuzz_params(seed, i)``: the same for any n
    and on every machine (a Hypothesis-engine draw was not: the H200's Hypothesis drew other
    problems under the same seed, so a failing id did not reproduce elsewhere).  The repro line
    of a fuzz cell carries --fuzz-n and --fuzz-seed (the run's size and seed)."""
    n, seed = fuzz_options(n, seed, names=("n", "seed"))
    out = []
    for i, p in enumerate(_fuzz_draw(n, seed)):
        p = copy.deepcopy(p)
        if p["state"] == "paged":
            p["paged_new"] = [j for j in range(len(p["lens"])) if j % 2 == 1]
        out.append(Case(name=f"fuzz{seed}-{i:03d}", suite="fuzz", seed=stable_seed(f"fuzz/{seed}/{i}"),
                        params=p, suite_opts={"n": n, "seed": seed}))
    return out


def get_suite(name: str, **opts) -> list[Case]:
    """The cases of suite ``name``.  Options: ``long=False`` drops long cases (CPU runs);
    fuzz takes ``n`` (default 20) and ``seed`` (default 0); None means the default."""
    if name not in SUITES:
        raise _usage_error(f"--suite: expected one of {', '.join(SUITES)}, got {name!r}")
    long = opts.pop("long", True)
    if name == "fuzz":
        n, seed = fuzz_options(opts.pop("n", None), opts.pop("seed", None), names=("n", "seed"))
    if opts:
        raise _usage_error(f"get_suite: unknown option(s) {', '.join(sorted(opts))} for suite {name!r} "
                           f"(expected long, and n, seed for fuzz)")
    cases = {"smoke": smoke_suite, "default": default_suite, "k3-prefill": k3_prefill_suite,
             "stress": stress_suite, "long": long_suite, "norm": norm_suite}.get(name)
    cases = cases() if cases else fuzz_suite(n=n, seed=seed)
    return [c for c in cases if long or not c.long]


_FUZZ_NAME = re.compile(r"fuzz(\d+)-(\d+)")


def get_case(case_id: str, n=None, seed=None, names=("--fuzz-n", "--fuzz-seed")) -> Case:
    """One case by id ``suite/name``.  A fuzz id ``fuzz/fuzz{S}-{i}`` is case i of the draw of
    ``n`` cases with seed S: pass the n (and seed) of the run it comes from (its repro line's
    --fuzz-n / --fuzz-seed); seed defaults to the S of the name, n to 20.  ``names``: the
    options named in errors."""
    suite, _, name = case_id.partition("/")
    if suite not in SUITES or not name:
        raise _usage_error(f"--case: expected <suite>/<name> with suite one of {', '.join(SUITES)}, got {case_id!r}")
    opts = {}
    if suite == "fuzz":
        n = None if n is None else fuzz_options(n=n, names=names)[0]
        seed = None if seed is None else fuzz_options(seed=seed, names=names)[1]
        m = _FUZZ_NAME.fullmatch(name)
        if m:
            s_name, index = int(m.group(1)), int(m.group(2))
            if seed is not None and seed != s_name:
                raise _usage_error(f"{names[1]}: expected the seed of {case_id} ({s_name}), got {seed}")
            seed = s_name
            if index >= (FUZZ_N if n is None else n):
                raise _usage_error(f"{names[0]}: expected the n of the draw {case_id} comes from (more than "
                                   f"{index}; its repro line carries {names[0]} N), got "
                                   f"{FUZZ_N if n is None else n}{' (the default)' if n is None else ''}")
        opts = {"n": n, "seed": seed}
    elif n is not None or seed is not None:
        raise _usage_error(f"{names[0] if n is not None else names[1]}: expected together with a fuzz case, "
                           f"got {case_id!r}")
    for c in get_suite(suite, **opts):
        if c.name == name:
            return c
    raise _usage_error(f"--case: no case named {name!r} in suite {suite!r}"
                       + (f" (a draw of {len(get_suite(suite, **opts))} cases with seed {opts['seed']})"
                          if suite == "fuzz" else ""))
