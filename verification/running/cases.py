"""Cases and suites (docs/design.md, Vocabulary): a Case is a name, a seed and a recipe of parameters that
builds one Problem deterministically.

A case's Problem is made by the project's one problem generator, kda_ref.problems: the case's
``params`` are the fields of a ``kda_ref.problems.ProblemSpec`` (sizes B, T, H, HV, K, V or varlen
``lens``; the gate's lb, g_scale, g_shift; beta_raw; the key structure rho, key_cos, exact_keys;
state none | kv | vk | paged with state_scale, converged, slots, slot_pad, paged_new; fused_proj;
chunks_per_seg; the fused output norm, norm and norm_eps; dtypes; ``long``, a case too long for CPU
runs, which get_suite(..., long=False) drops), and the case's seed is the spec's seed.  Random
numbers are drawn on the CPU from a generator seeded by the case's seed, then moved to the
requested device, so a case builds the same Problem on every machine (tests/test_case_digests.py
holds every short case's digest).
"""
from __future__ import annotations

import copy
import functools
import random
import re
import zlib
from dataclasses import dataclass, field

import torch

from kda_ref import problems
from kda_ref.problem import Problem
from verification.errors import UsageError

SUITES = ("smoke", "default", "k3-prefill", "stress", "fuzz", "long", "norm")
# The numeric fields of kda_ref.problems.ProblemSpec: the ones a known failure in tolerances.yaml may
# put conditions on (its ``params`` field; verification.judging.tolerances).
NUMERIC_PARAMS = ("B", "T", "H", "HV", "K", "V", "lb", "g_scale", "g_shift", "beta_raw", "rho", "qk_scale",
                  "exact_keys", "state_scale", "slots", "slot_pad", "chunks_per_seg", "norm_eps")

DEFAULT_SHAPES = ((1, 256, 12), (1, 512, 12), (1, 1664, 12), (1, 2048, 12), (1, 8192, 12), (1, 16384, 12),
                  (1, 16384, 64), (1, 16384, 96), (1, 8192, 32), (1, 8192, 64), (2, 2664, 12), (4, 4096, 16),
                  (8, 2048, 16))


def _usage_error(msg: str) -> Exception:
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
    def spec(self) -> problems.ProblemSpec:
        """The generator's recipe of this case: its params and its seed."""
        return problems.ProblemSpec.from_params(self.params, self.seed)

    @property
    def lens(self):
        return self.spec.lengths

    @property
    def shape_key(self) -> tuple:
        """(B, T, H) for plots: T is the total token count of a varlen case."""
        s = self.spec
        return (1, sum(s.lengths), s.H) if s.varlen else (s.B, s.T, s.H)

    def build(self, device="cpu") -> Problem:
        """The Problem of this case (deterministic from the seed), on ``device``."""
        return build_problem(self.params, self.seed, device=device, meta={"case": self.id, "seed": self.seed})

    def __repr__(self) -> str:
        return f"Case({self.id!r}, seed={self.seed})"


def build_problem(params: dict, seed: int, device="cpu", meta=None) -> Problem:
    """The Problem of a case's ``params`` and ``seed``: kda_ref.problems.generate of
    ``ProblemSpec.from_params(params, seed)`` (the one generator; its docstring has the math)."""
    return problems.generate(problems.ProblemSpec.from_params(params, seed), device=device, meta=meta)


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
