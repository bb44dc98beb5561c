"""The FlashKDA-family trace routes on prefill calls: our Triton FlashKDA (kda_kernels.triton) and
aiter's paged flash_kda_fwd and chunk_kda:triton (the upstream tree, .vendor/aiter-upstream or
$KDA_AITER_UPSTREAM, loaded by tools/aiter_interpret.py), run step by step on a generated trace in
Triton's CPU interpreter and measured against kda_ref.trace_oracle (tests/trace_check.py: live
outputs, the slots the route's rows write, everything else bit for bit; decode calls are played by
the oracle).  aiter's decode route kda:gluon is not applicable off gfx950 / gfx1250, with the reason.

The run happens in a child process that sets TRITON_INTERPRET=1 before Triton is imported (the
kernels, aiter's included, must be built by the interpreter).

Bound 2 * 2^-8 (bf16 unit roundoff u = 2^-8), as for these kernels on Problems
(tests/test_triton_flashkda.py): measured on the 'chunked-prefill' trace below (prefill chunks of 95
and 86 tokens from zero, then 16, 33 and 27 continuing from the cache) 4.2e-3 (o) and 4.6e-3
(states) for every route of ours, 4.1e-3 / 4.6e-3 for aiter's.
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("KDA_AITER_UPSTREAM") or ROOT / ".vendor" / "aiter-upstream")
BOUND = 2 * 2.0 ** -8
KNOBS = dict(H=1, HV=1, K=128, V=128, dtype="bfloat16", lower_bound=-1.0, requests=2, prompt=(100, 200), chunk=96,
             slot_pad=2)
TRITON_ROUTES = ("unseg:BW=32", "seg:A=fused:B=prefetch:BW=32", "seg:cps=1:A=fused:B=prefetch:BW=32",
                 "seg:cps=4:A=fused:B=prefetch:BW=32", "seg:A=fused:B=prefetch:BW=32:scan=bf16")
AITER_ROUTES = ("triton:unseg", "triton:seg", "triton:seg:cps=1", "triton:seg:cps=4", "chunk_kda:triton")
REFUSED = {  # knobs over KNOBS -> words of the reason (both backends)
    "kv": (dict(layout="kv"), "layout kv"),
    "bf16-cache": (dict(cache_dtype="bfloat16"), "float32"),
    "K64": (dict(K=64, V=64), "128"),
}


def _trace(**over):
    from kda_ref.trace_gen import generate
    return generate(2, "chunked-prefill", **dict(KNOBS, **over))


def _measure(b, names) -> dict:
    from trace_check import run_trace
    rt = {r.name: r for r in b.trace_routes()}
    out = {"routes": {n: [r.recipe, list(dict(r.flags)["groups"])] for n, r in rt.items()}, "cases": {},
           "refused": {}}
    tr = _trace()
    for name in names:
        ok = b.trace_accepts(tr, rt[name])
        out["cases"][name] = dict(run_trace(tr, {"prefill": (b, rt[name])}) if ok[0] else {}, accepted=list(ok))
    for case, (over, _) in REFUSED.items():
        out["refused"][case] = list(b.trace_accepts(_trace(**over), rt[names[0]]))
    return out


def _child() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    import warnings
    warnings.simplefilter("ignore")
    from kda_kernels.triton._interpreter_compat import install
    install()
    from kda_kernels.triton.backend import TritonBackend
    out = {"triton": _measure(TritonBackend(), TRITON_ROUTES)}
    if not (UPSTREAM / "aiter").is_dir():
        out["aiter"] = {"skip": f"no upstream aiter tree in {UPSTREAM} (set KDA_AITER_UPSTREAM; never committed)"}
        return out
    import importlib.util
    spec = importlib.util.spec_from_file_location("aiter_interpret", ROOT / "tools" / "aiter_interpret.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with tool.loaded(UPSTREAM) as mods:
        b = tool.backend_of(mods)
        out["aiter"] = _measure(b, AITER_ROUTES)
        out["aiter"]["kda:gluon"] = list(b.trace_accepts(_trace(), {r.name: r for r in b.trace_routes()}["kda:gluon"]))
    return out


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
    print("RESULT " + json.dumps(_child()))
    sys.exit(0)

import pytest  # noqa: E402

# real kernels through Triton's interpreter (a module fixture of 17-34 s): with the other slow tests
pytestmark = [*globals().get("pytestmark", []), pytest.mark.slow]
import torch  # noqa: E402

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter tests run on machines without a GPU (or with TRITON_INTERPRET=1)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def result():
    from trace_check import child_result
    return child_result(__file__, ROOT, timeout=900)


def _backend(result, name):
    r = result[name]
    if "skip" in r:
        pytest.skip(r["skip"])
    return r


@pytest.mark.parametrize("backend,route", [("triton", n) for n in TRITON_ROUTES] + [("aiter", n) for n in AITER_ROUTES])
def test_prefill_route_matches_the_trace_oracle(result, backend, route):
    r = _backend(result, backend)["cases"][route]
    assert r["accepted"] == [True, ""], r
    assert r["calls"] == {"prefill": 3}, r
    assert r["o"] < BOUND and r["state"] < BOUND, r
    assert r["unexpected"] == [], r["unexpected"]


@pytest.mark.parametrize("backend", ["triton", "aiter"])
def test_trace_routes_run_prefill_with_their_problem_recipes(result, backend):
    routes = _backend(result, backend)["routes"]
    for name, (recipe, groups) in routes.items():
        if name == "kda:gluon":
            assert groups == ["decode", "spec"] and recipe in ("aiter-decode-gfx1250", "aiter-decode-gfx950")
        else:
            assert groups == ["prefill"], (name, groups)
            assert recipe == "flashkda" or name == "chunk_kda:gluon", (name, recipe)


@pytest.mark.parametrize("backend", ["triton", "aiter"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_cache_or_shape_the_paged_kernel_cannot_take_is_refused(result, backend, case):
    ok, why = _backend(result, backend)["refused"][case]
    assert not ok and why.startswith("not applicable: ") and REFUSED[case][1] in why, why


def test_aiter_decode_is_not_applicable_off_amd(result):
    ok, why = _backend(result, "aiter")["kda:gluon"]
    assert not ok and "Gluon packed decode of gfx1250 / gfx950 only" in why and "gfx942" in why, why
