"""Negative controls: deliberately wrong variants of the flashkda emulator that the verdict
must flag on the stress suite (a CPU-sized subset), while the correct emulator passes.

EXPECTED is the evidence table of docs/tolerances.md "Negative controls": which tensor and metric
catch each control, measured here on every run."""
import pytest

from kda_kernels.base import Route
from kda_kernels.controls import NEGATIVE_CONTROLS, negative_control, run_in_recipe
from kda_kernels.emulator import EmulatorBackend, emulate
from kda_ref.truth import truth
from verification.running.cases import get_case
from verification.judging.tolerances import load_tolerances
from verification.judging.baselines import baseline_metrics
from verification.judging.verdict import judge

SUBSET = ["stress/weak-gate-lb-1", "stress/tail17-lb-1", "stress/exact-keys-gate-off-beta4",
          "stress/correlated-keys-rho0.9-lb-0.01"]

# control -> (a case that catches it, tensors that must fail there)
EXPECTED = {
    "carry_scaled": ("stress/weak-gate-lb-1", {"final_state"}),
    "wrong_L_sign": ("stress/weak-gate-lb-1", {"o", "final_state", "ws_inv"}),
    "inv_bf16": ("stress/exact-keys-gate-off-beta4", {"o", "ws_inv"}),
    "tail_not_zeroed": ("stress/tail17-lb-1", {"final_state"}),
    "state_transposed": ("stress/weak-gate-lb-1", {"final_state"}),
    "decay_after_update": ("stress/weak-gate-lb-1", {"o", "final_state"}),
    "mqk_no_diag": ("stress/weak-gate-lb-1", {"o"}),
}


@pytest.fixture(scope="module")
def judged():
    db = load_tolerances()
    bad = negative_control()
    emu = EmulatorBackend()
    out = {}
    for cid in SUBSET:
        p = get_case(cid).build()
        tr = truth(p)
        base = baseline_metrics(p, "flashkda", tr, taps=True)
        for r in bad.routes():
            if r.name in NEGATIVE_CONTROLS:          # the batch controls: tests/test_batch_controls.py
                out[(r.name, cid)] = judge(bad.name, r, p, bad.run(p, r), tr, base, db)
        good = Route(name="flashkda", recipe="flashkda")
        out[("correct-as-kernel", cid)] = judge("triton", good, p, EmulatorBackend(taps=True).run(p, good), tr, base, db)
        out[("correct-emulator", cid)] = judge(emu.name, good, p, emu.run(p, good), tr, base, db)
    return out


def test_there_are_at_least_six_controls_and_each_is_in_the_table():
    assert len(NEGATIVE_CONTROLS) >= 6 and set(EXPECTED) == set(NEGATIVE_CONTROLS)


@pytest.mark.parametrize("cid", SUBSET)
def test_the_correct_emulator_passes(judged, cid):
    for who in ("correct-as-kernel", "correct-emulator"):
        v = judged[(who, cid)]
        assert v.status == "pass", (who, cid, v.reason)


@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
def test_every_control_is_flagged_by_the_expected_tensors(judged, control):
    cid, tensors = EXPECTED[control]
    v = judged[(control, cid)]
    assert v.status == "fail", (control, cid, v.reason)
    failing = {name for name, t in v.tensors.items() if not t["margin"] <= 1}
    assert tensors <= failing, (control, failing, v.reason)


def test_no_control_passes_the_whole_subset(judged):
    for control in NEGATIVE_CONTROLS:
        assert any(judged[(control, cid)].status != "pass" for cid in SUBSET), control


def test_each_in_recipe_control_changes_the_flashkda_outputs_and_names_itself():
    # the controls are built outside the emulator; the emulator's own routes are the recipes only
    p = get_case("stress/tail17-lb-1").build()
    good = emulate(p, "flashkda")
    assert not {r.name for r in EmulatorBackend().routes()} & set(NEGATIVE_CONTROLS)
    for control in NEGATIVE_CONTROLS:
        out = run_in_recipe(p, control)
        assert out.info == {"route_ran": f"flashkda+{control}"}
        changed = [n for n, t in out.tensors().items()
                   if t.shape != good.tensors()[n].shape or not t.equal(good.tensors()[n])]
        assert changed, control
    with pytest.raises(ValueError, match="control: expected one of carry_scaled"):
        run_in_recipe(p, "nope")
