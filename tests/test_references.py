"""The eager PyTorch references (kda_kernels/references.py): fla-core's naive_recurrent_kda /
naive_chunk_kda and transformers' Kimi Linear recurrent_/chunk_kimi_delta_attention (torch path).

They run on the CPU, so everything is checked here: routes, versions, refusals in their own
terms, the verdict against the float64 oracle with the fp32 recipe as baseline, the hidden-bug
controls built on that recipe (each must fail under the references' tolerances), and the
invariances.  On a CUDA machine the same tests run on the GPU too (``device`` parameter, marked gpu).
Skipped where fla-core or transformers is not installed."""
import pytest
import torch

from kda_kernels.base import Route, load_backend
from kda_kernels.controls import NEGATIVE_CONTROLS, run_in_recipe
from kda_kernels.emulator import emulate
from kda_kernels.references import RECIPE
from kda_ref.truth import truth
from verification.investigating import invariance as inv
from kda_ref.problems import generate
from verification.running.cases import get_case
from verification.judging.metrics import compare
from verification.judging.tolerances import load_tolerances
from verification.judging.baselines import baseline_metrics
from verification.judging.verdict import judge

NAMES = ("fla-naive", "transformers")
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def _backend(name):
    b = load_backend(name)
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    return b


@pytest.fixture(scope="module", params=NAMES)
def backend(request):
    return _backend(request.param)


def _case(cid, device="cpu"):
    return get_case(cid).build(device=device)


# ------------------------------------------------------------------------- routes, refusals
def test_routes_versions_and_the_fp32_recipe(backend):
    routes = backend.routes()
    assert [r.name.split(":")[1] for r in routes] == ["recurrent", "chunk"]
    assert {r.recipe for r in routes} == {RECIPE} == {"fp32"}
    v = backend.version()
    assert v.startswith("fla-core 0.6.0" if backend.name == "fla-naive" else "transformers 5."), v


def test_paged_caches_are_refused_in_their_own_terms(backend):
    p = get_case("smoke/paged-lb-5").build()
    ok, why = backend.accepts(p, backend.routes()[0])
    assert not ok and why.startswith("not applicable: ") and "no paged state cache" in why


def test_transformers_refuses_gva_and_another_scale_fla_takes_them():
    tf, fla = _backend("transformers"), _backend("fla-naive")
    p = generate(dict(lens=[40], H=1, HV=2, lb=-1.0, state="kv"), seed=3)
    ok, why = tf.accepts(p, tf.routes()[0])
    assert not ok and "one head count" in why and "H=1 HV=2" in why
    assert fla.accepts(p, fla.routes()[0]) == (True, "")
    q = generate(dict(lens=[40], H=2, lb=-1.0), seed=3).replace(scale=0.3)
    ok, why = tf.accepts(q, tf.routes()[0])
    assert not ok and "fixes the scale" in why and "got 0.3" in why


def test_transformers_runs_the_torch_function_not_what_its_decorator_dispatches_to():
    tf = _backend("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear as m
    assert getattr(m.chunk_kimi_delta_attention, "__wrapped__", None) is not None
    p = get_case("smoke/varlen-tail33-lb-5").build()
    out = tf.run(p, tf.routes()[1])
    assert "torch path (__wrapped__" in out.info["route_ran"]


# ------------------------------------------------------------------------- verdicts
CASES = ["smoke/varlen-tail33-lb-5", "smoke/weak-gate-lb-0.1-vk", "stress/correlated-keys-rho1-lb-0.01",
         "stress/empty-seq-middle", "stress/exact-keys-gate-off-beta4"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cid", CASES)
def test_every_route_passes_and_errs_like_fp32_with_bf16_output(backend, cid, device):
    # o: the bf16 rounding of the output (the fp32 recipe's own error, ratio 1.00 on smoke + stress);
    # the final state: fp32 noise (<= 1e-6 on smoke + stress, 0.19-6.5x the recipe's)
    db = load_tolerances()
    p = _case(cid, device)
    tr = truth(p)
    base = baseline_metrics(p, RECIPE, tr)
    for r in backend.routes():
        out = backend.run(p, r)
        v = judge(backend.name, r, p, out, tr, base, db)
        assert v.status == "pass", (r.name, v.reason)
        m = compare(out.tensors(), tr.tensors(), p)
        assert m["o"]["rel_l2"] <= 1.05 * base["o"]["rel_l2"] + 1e-6, (r.name, m["o"], base["o"])
        if "final_state" in m:
            assert m["final_state"]["rel_l2"] < 2e-6, (r.name, m["final_state"])


def test_the_fp32_recipe_without_rounding_is_the_oracle():
    from kda_kernels.emulator import REFERENCE_RECIPES, exact_recipe
    p = get_case("smoke/varlen-tail33-lb-5").build()
    tr = truth(p)
    m = compare(emulate(p, exact_recipe(REFERENCE_RECIPES["fp32"]), keep_f64=True).tensors(), tr.tensors(), p)
    assert max(v["rel_l2"] for v in m.values()) < 1e-12


# ------------------------------------------------------------------------- hidden-bug controls
EXPECTED = {   # control -> (case, tensors that must fail) under the references' tolerances
    "carry_scaled": ("stress/weak-gate-lb-1", {"final_state"}),
    "wrong_L_sign": ("stress/weak-gate-lb-1", {"o", "final_state"}),
    "inv_bf16": ("stress/weak-gate-lb-1", {"final_state"}),
    "tail_not_zeroed": ("stress/tail17-lb-1", {"final_state"}),
    "state_transposed": ("stress/weak-gate-lb-1", {"final_state"}),
    "decay_after_update": ("stress/weak-gate-lb-1", {"o", "final_state"}),
    "mqk_no_diag": ("stress/weak-gate-lb-1", {"o"}),
}


def test_the_controls_table_covers_every_in_recipe_control():
    assert set(EXPECTED) == set(NEGATIVE_CONTROLS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
@pytest.mark.slow
def test_a_reference_with_a_hidden_bug_fails_where_the_reference_passes(name, control):
    # the control on the references' own (fp32) recipe, judged as that backend's route: it must fail
    # on the tensors named; the real reference passes the same case (test above / below)
    b = _backend(name)
    cid, tensors = EXPECTED[control]
    p = get_case(cid).build()
    tr = truth(p)
    base = baseline_metrics(p, RECIPE, tr)
    route = b.routes()[1]
    db = load_tolerances()
    bad = judge(b.name, route, p, run_in_recipe(p, control, recipe=RECIPE), tr, base, db)
    failing = {t for t, rec in bad.tensors.items() if not rec["margin"] <= 1}
    assert bad.status == "fail" and tensors <= failing, (control, bad.status, failing, bad.reason)
    good = judge(b.name, route, p, b.run(p, route), tr, base, db)
    assert good.status == "pass", good.reason


# ------------------------------------------------------------------------- invariances
@pytest.mark.parametrize("device", DEVICES)
def test_invariances_hold_bitwise(backend, device):
    dev = device
    varlen = generate(dict(lens=[70, 0, 129, 5], H=2, state="kv", lb=-1.0), seed=11, device=dev)
    batch = generate(dict(B=3, T=100, H=2, state="vk", lb=-0.3), seed=12, device=dev)
    for r in backend.routes():
        results = [inv.determinism(backend, r, varlen), inv.varlen_slice(backend, r, varlen),
                   inv.batch_slice(backend, r, batch), inv.split_carry(backend, r, varlen, split=64),
                   inv.strided_vs_packed(backend, r, varlen), inv.causality(backend, r, varlen),
                   inv.head_permutation(backend, r, batch)]
        for res in results:
            assert res.ok and res.kind == "bitwise", (r.name, str(res))
