"""Every short case of every suite builds the Problem it built when its baselines and tolerances
were measured: tests/data/case_digests.json holds, per case id, kda_ref.problems.problem_digest of
the built Problem (the sha256 of every tensor's name, dtype, shape, strides, storage offset and
bytes, every scalar field and meta), written by ``python tests/test_case_digests.py --write`` from
the generator as it was before it moved into kda_ref.problems.  Long cases (too large to build on
a CPU) are left out; the default suite's (a minute on a CPU) are checked under ``-m slow``; the
fuzz suite is checked at its default draw and at one other seed.  PROBES are small recipes of
what no short case combines (key_cos, which only long cases use; GVA with a converged state, exact
keys, a fused projection, a paged cache with a norm; qk_scale with chunks_per_seg), their digests
written by the generator of commit ae65bc3 (before the move)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kda_ref.problems import problem_digest

DIGESTS = Path(__file__).parent / "data" / "case_digests.json"
FUZZ_DRAWS = ((20, 0), (20, 1))
PROBES = {
    "key-cos-dense": (dict(B=2, T=70, H=2, K=16, V=16, key_cos=(0.85, 0.97), lb=-0.05, state="kv"), 11),
    "key-cos-varlen": (dict(lens=[5, 0, 1, 90], H=2, K=16, V=8, key_cos=(0.5, 0.9)), 3),
    "gva-converged-varlen": (dict(lens=[20, 33], H=1, HV=4, K=16, V=16, converged=True, state_scale=0.1, lb=-0.01), 5),
    "gva-exact-keys": (dict(lens=[7, 40], H=2, HV=4, K=16, V=16, exact_keys=3, g_shift=-200.0, beta_raw=4.0), 6),
    "gva-fused-proj-vk": (dict(B=2, T=24, H=1, HV=2, K=16, V=32, fused_proj=True, state="vk"), 7),
    "gva-paged-norm": (dict(lens=[9, 0, 30], H=1, HV=3, K=16, V=16, state="paged", paged_new=[0], slots=8,
                            slot_pad=5, norm=True, norm_eps=1e-6, rho=0.5), 8),
    "qk-scale-chunks": (dict(B=1, T=50, H=2, K=32, V=16, qk_scale=1e-4, chunks_per_seg=2, state="kv"), 9),
}


def short_cases(suites=None):
    from verification.running.cases import SUITES, get_suite
    out = []
    for s in suites or SUITES:
        if s == "fuzz":
            for n, seed in FUZZ_DRAWS:
                out += get_suite("fuzz", n=n, seed=seed, long=False)
        else:
            out += get_suite(s, long=False)
    return out


def digests(suites=None, probes=True) -> dict:
    from kda_ref.problems import generate
    out = {c.id: problem_digest(c.build()) for c in short_cases(suites)}
    if probes:
        out.update({f"probe/{k}": problem_digest(generate(p, seed=s)) for k, (p, s) in PROBES.items()})
    return out


def _check(suites, probes):
    want = json.loads(DIGESTS.read_text())
    got = digests(suites, probes)
    mine = {k: v for k, v in want.items() if k.split("/")[0] in suites or (probes and k.startswith("probe/"))}
    assert sorted(got) == sorted(mine), "the set of cases changed: rewrite the digests only with a reason"
    changed = [cid for cid in mine if got[cid] != mine[cid]]
    assert not changed, f"{len(changed)} cases build other problems now: {changed[:5]}"


def test_every_short_case_and_probe_builds_the_problem_its_baselines_were_measured_on():
    from verification.running.cases import SUITES
    _check([s for s in SUITES if s != "default"], probes=True)


@pytest.mark.slow
def test_the_default_suites_short_cases_build_the_problems_they_built():
    """The default suite's shapes (up to 1 x 16384 x 64) take most of a minute to build on a CPU."""
    _check(["default"], probes=False)


def test_the_digest_sees_one_bit_and_one_stride():
    from verification.running.cases import get_case
    p = get_case("smoke/dense-T64-lb-5").build()
    d = problem_digest(p)
    q = p.q.clone()
    q.view(torch.int16)[0, 0, 0, 0] ^= 1                     # one bit of one bf16 value
    assert problem_digest(p.replace(q=q)) != d
    assert problem_digest(p.replace(q=p.q.transpose(1, 2).contiguous().transpose(1, 2))) != d
    assert problem_digest(p.replace(meta={})) != d
    assert problem_digest(p.replace(lower_bound=-4.0)) != d


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # this checkout's packages
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_case_digests.py --write")
    DIGESTS.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")
