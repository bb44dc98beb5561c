"""The ``serving`` suite: named, seeded serving traces (docs/traces.md, "The serving suite").

Each case builds one trace deterministically, by ``kda_ref.trace_gen.generate`` (a scenario with
knobs) or ``trace_from_rows`` (explicit rows), at small sizes (H = HV = 2, K = V = 128, the decode
kernels' tile; padding rows at the NULL block 0 unless the case is about -1) so the whole suite runs on a CPU under the emulator in about a minute.  ``long``
cases (10^4 decode steps) run only with --long yes or on CUDA, like the other suites' long cases.

Public reports, each a case named after it:

    atom-1750       ROCm/ATOM#1750 (found): "chunk_kda NaNs on gfx1250 for prompts shorter than its
                    chunk size, and its transpose_state_layout output can mismatch what the
                    decode-time fused_recurrent_kda reader expects, so the first decode step goes
                    NaN too": prompts of 1..63 tokens through the prefill side, then decodes on the
                    decode side, V-first cache.
    vllm-50649      vllm-project/vllm#50649: not found in the searchable issue index.  Modelled on
                    what the project's description of it says (docs/traces.md: a state written by
                    prefill in one layout and read by decode in another, has_initial_state on the
                    later chunks of a chunked prefill); the nearest report found, vllm#41292 ("KDA
                    chunked prefill uses wrong recurrent state layout and breaks Kimi-linear
                    long-context retrieval"), is the same failure: a long prompt in chunks at odd
                    boundaries, then decodes.
    sglang-34299    sgl-project/sglang#34299: not found in the searchable issue index.  Modelled on
                    docs/traces.md's description (bf16 state drift over many decode steps); the
                    nearest report found, sglang#38975 ("KDA replay decode round sigmoid(beta)
                    through bf16; recurrent-state drift accumulates with context length"): a long
                    decode (160 steps) over a bf16 cache with bf16 inputs, its drift curve recorded.
    empty-before-later
                    the empty-sequence-before-a-later-one failure (findings: chunk_kda:triton on
                    the H200): a trace cannot hold an empty live row (every live row has a token),
                    so the prefill batch holds 1-token rows before and after a longer one, and a
                    decode step carries a 0-token padding row before live rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from kda_ref.trace import DECODE, PAD, PREFILL, SPEC, CacheSpec
from kda_ref.trace_gen import generate, trace_from_rows
from verification.running.cases import stable_seed

SUITE = "serving"
# K = V = 128: the decode kernels' tiles (aiter's gfx950 decode takes K = V = 128 only); H = HV = 2
# keeps a step cheap on a CPU.  Padding rows point at the NULL block 0 unless a case is about -1:
# aiter's decode kernels guard slots <= 0, so a trace giving slot 0 to a request is not theirs.
# Inputs are bf16, as a serving engine hands them over (and the tolerance entries are calibrated
# on): on fp32 inputs the H200 showed fla's chunk_kda (tf32 dots) at 2.8x the fla recipe's error,
# a recipe made for bf16 inputs, and FlashKDA takes bf16 only.
SMALL = dict(H=2, HV=2, K=128, V=128, dtype="bfloat16")
N0 = dict(pad="null0")


@dataclass
class ServingCase:
    name: str
    seed: int
    make: Callable = field(repr=False)
    params: dict = field(default_factory=dict)
    long: bool = False
    reference: str = ""          # a public report's address, where the case models one
    drift: bool = False          # record the error against decode step (long-decode cases)
    doc: str = ""
    suite: str = SUITE
    suite_opts: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    def build(self):
        """The case's trace (validated)."""
        return self.make(self.seed)


def _gen(scenario: Optional[str], **knobs) -> Callable:
    def make(seed):
        return generate(seed, scenario, **{**SMALL, **knobs})
    return make


def _rows(cache: dict, steps: list, **opts) -> Callable:
    def make(seed):
        return trace_from_rows(CacheSpec(**{**dict(HV=2, K=128, V=128, pad="null0", guard_rows=2), **cache}).check(),
                               steps, seed=seed,
                               H=2, **{"dtype": "bfloat16", **opts})
    return make


def _one_token_prompts() -> list:
    """Four requests with 1-token prompts in one prefill batch (slots 1..4), then three decode steps."""
    steps = [[(1, r, PREFILL, [r + 1], False, 1, 1) for r in range(4)]]
    for _ in range(3):
        steps.append([(1, r, DECODE, [r + 1], True, 1, 1) for r in range(4)])
    return steps


def _spec_accepts() -> list:
    """One request decoding speculatively with k = 3 (W = 4 slots 1..4): steps accepting 1 (only
    the verified token), 2, 4 (all) and 3 of 4, the next reading the checkpoint of the last
    accepted token (num_accepted_tokens), then a decode from that checkpoint; a second request
    decodes beside it in slot 5 (slot 0 is the NULL block)."""
    steps = [[(9, 0, PREFILL, [1, 0, 0, 0], False, 1, 9), (5, 1, PREFILL, [5, 0, 0, 0], False, 1, 5)]]
    prev = 1
    for acc in (1, 2, 4, 3):
        steps.append([(4, 0, SPEC, [1, 2, 3, 4], True, prev, acc), (1, 1, DECODE, [5, 0, 0, 0], True, 1, 1)])
        prev = acc
    # the request's current state is in slot prev (column prev-1); a decode reads it there
    steps.append([(1, 0, DECODE, [prev, 0, 0, 0], True, 1, 1)])
    return steps


def _empty_before_later() -> list:
    """A prefill batch of a 1-token row, a 37-token row and a 1-token row (the short rows before
    and after a later longer one); then decode steps whose batch starts with a 0-token padding row
    and ends with a 1-token one (CUDA-graph padding)."""
    steps = [[(1, 0, PREFILL, [1], False, 1, 1), (37, 1, PREFILL, [2], False, 1, 37),
              (1, 2, PREFILL, [3], False, 1, 1)]]
    for _ in range(3):
        steps.append([(0, -1, PAD, [0], False, 1, 0)] + [(1, r, DECODE, [r + 1], True, 1, 1) for r in range(3)]
                     + [(1, -1, PAD, [0], False, 1, 0)])
    return steps


def _atom_1750(seed):
    """Prompts shorter than one 64-token chunk (1..63, in one chunk each), then decodes."""
    return generate(seed, "short-prompts", prompt=(1, 63), chunk=64, decodes=(2, 6), layout="vk",
                    pad="null0", **SMALL)


def serving_suite() -> list:
    C = []

    def add(name, make, **kw):
        C.append(ServingCase(name=name, seed=stable_seed(f"{SUITE}/{name}"), make=make, **kw))
    add("short-prompts", _gen("short-prompts", **N0), params={"scenario": "short-prompts"},
        doc="prompts of 1..5 tokens, far below one chunk")
    add("one-token-prompts", _rows(dict(slots=5), _one_token_prompts()), params={"prompt": 1},
        doc="1-token prompts through the prefill side")
    add("chunked-prefill-odd", _gen("chunked-prefill", chunk=37, prompt=(60, 130), **N0),
        params={"scenario": "chunked-prefill", "chunk": 37},
        doc="prompts of 60..130 tokens in chunks of 1..37 (odd boundaries; has_initial_state on every later chunk)")
    add("mixed", _gen("mixed"), params={"scenario": "mixed"},
        doc="decode, spec and prefill rows in one batch, graph-padded decode steps")
    add("slot-reuse", _gen("slot-reuse", requests=5, prompt=(1, 24), **N0), params={"scenario": "slot-reuse"},
        doc="5 requests through 2 slots: each freed slot reused at once")
    add("pad-minus1", _gen("graph-padded", slot_pad=1), params={"scenario": "graph-padded", "pad": "minus1"},
        doc="CUDA-graph-padded decode batches, padding rows at slot -1, a padding row between slots")
    add("pad-null0", _gen("null-block"), params={"scenario": "null-block", "pad": "null0"},
        doc="padding rows at the NULL block 0 (never given to a request)")
    add("spec", _gen("spec", **N0), params={"scenario": "spec"},
        doc="speculative decoding, 1..3 drafts, 1..all accepted")
    add("spec-accepts", _rows(dict(slots=6), _spec_accepts()), params={"spec_k": 3},
        doc=_spec_accepts.__doc__.split("\n")[0])
    add("mixed-kv", _gen("mixed", layout="kv", **N0), params={"scenario": "mixed", "layout": "kv"},
        doc="the mixed scenario over a K-first cache")
    add("mixed-bf16-cache", _gen("mixed", cache_dtype="bfloat16", dtype="bfloat16", **N0),
        params={"scenario": "mixed", "cache_dtype": "bfloat16"}, doc="the mixed scenario over a bf16 cache, bf16 inputs")
    for dt in ("float32", "bfloat16"):
        tag = "fp32" if dt == "float32" else "bf16"
        add(f"decode-drift-{tag}", _gen(None, requests=1, max_batch=1, prompt=(8, 8), decodes=(120, 120),
                                          cache_dtype=dt, dtype="bfloat16", **N0),
            params={"decodes": 120, "cache_dtype": dt}, drift=True,
            doc=f"one request, 120 decode steps over a {tag} cache (the CPU variant of the long drift curve)")
        add(f"decode-long-{tag}", _gen(None, requests=1, max_batch=1, prompt=(64, 64), decodes=(10000, 10000),
                                         cache_dtype=dt, dtype="bfloat16", **N0),
            params={"decodes": 10000, "cache_dtype": dt, "K": 128, "V": 128}, drift=True, long=True,
            doc=f"one request, 10^4 decode steps over a {tag} cache at K = V = 128 (the drift curve)")
    add("atom-1750", _atom_1750, params={"prompt": "1..63"}, reference="https://github.com/ROCm/ATOM/pull/1750",
        doc="ROCm/ATOM#1750: prompts shorter than the chunk, then decode on the other side")
    add("vllm-50649", _gen("chunked-prefill", prompt=(100, 160), chunk=64, chunk_multiple=0, decodes=(4, 8),
                            dtype="bfloat16", **N0),
        params={"scenario": "chunked-prefill"}, reference="vllm-project/vllm#50649 (not found; see vllm#41292)",
        doc="chunked prefill then decode across the handover (vllm#50649 not found; modelled on vllm#41292)")
    add("sglang-34299", _gen(None, requests=2, max_batch=2, prompt=(16, 32), decodes=(160, 160),
                             cache_dtype="bfloat16", dtype="bfloat16", **N0),
        params={"decodes": 160, "cache_dtype": "bfloat16"}, drift=True,
        reference="sgl-project/sglang#34299 (not found; see sglang#38975)",
        doc="bf16 state drift over 160 decode steps (sglang#34299 not found; modelled on sglang#38975)")
    add("empty-before-later", _rows(dict(slots=4), _empty_before_later()), params={"lens": [1, 37, 1]},
        doc=_empty_before_later.__doc__.split("\n")[0])
    return C


def get_serving_suite(long: bool = True) -> list:
    return [c for c in serving_suite() if long or not c.long]
