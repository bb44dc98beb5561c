"""A kernel is judged against what its recipe does in range, and out of that range against what
the recipe does at the problem's own scale (verification/judging/baselines.py, verification/judging/verdict.py).

The flashkda recipe stores u, INV and Mqk in fp16, whose normal range starts at 6.1e-5: with
rms(v) ~ 1e-5 and below its error grows (1.6-1.8x at 1e-5, 11-14x at 1e-6, all zeros at 1e-8).
A kernel doing what its recipe does there is "out-of-contract" (never a pass, never a failure),
with the numbers; one that errs more than its recipe at that scale still fails."""
import pytest
import torch

from kda_kernels.base import Outputs
from kda_kernels.emulator import RECIPES, emulate
from kda_ref.truth import truth
from verification.judging.baselines import baseline_metrics
from kda_ref.problems import generate
from verification.running.cases import get_case
from verification.cli import main
from verification.reporting.problem_file import save_outputs, save_problem
from planted import judge_plant

LENS = {"lens": [1, 64, 200], "H": 2, "lb": -0.5}


def _scaled(params, v_scale, state_scale=None, seed=1):
    p = generate(params, seed=seed)
    ch = {"v": (p.v.double() * v_scale).to(p.v.dtype)}
    if p.initial_state is not None and state_scale is not None:
        ch["initial_state"] = (p.initial_state.double() * state_scale).to(p.initial_state.dtype)
    return p.replace(**ch)


def test_the_in_range_rounding_is_fp16s_inside_its_range_and_keeps_the_significand_outside():
    from kda_kernels.emulator import WideRange, rnd
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200000, generator=g, dtype=torch.float64)
    x = x * torch.exp(3 * torch.randn(200000, generator=g, dtype=torch.float64))
    inside = x[(x.abs() >= 2.0 ** -14) & (x.abs() <= 65504)]
    assert torch.equal(rnd(inside, WideRange(torch.float16, 11)), inside.half().double())
    tiny = torch.tensor([1e-7, 3e-8, 1e5], dtype=torch.float64)
    wide = rnd(tiny, WideRange(torch.float16, 11))
    assert ((wide - tiny).abs() <= 2.0 ** -11 * tiny).all()             # fp16 flushes / overflows these
    assert not torch.equal(tiny.half().double(), wide)


def test_in_range_the_in_range_recipe_is_the_recipe():
    from kda_kernels.emulator import in_range_recipe
    from verification.judging.baselines import off_range
    p = get_case("smoke/varlen-tail33-lb-5").build()
    tr = truth(p)
    assert off_range(p) is None
    for name, recipe in RECIPES.items():
        real, wide = emulate(p, name), emulate(p, in_range_recipe(recipe, p))
        for t, x in real.tensors().items():
            e_real = float((x.double() - tr.tensors()[t]).norm())
            e_wide = float((wide.tensors()[t].double() - tr.tensors()[t]).norm())
            assert abs(e_wide / e_real - 1) < 2e-3, (name, t, e_real, e_wide)   # flashkda: a few fp16 subnormals
    assert "in_range" not in baseline_metrics(p, "flashkda", tr)["o"]


@pytest.mark.parametrize("scale", [1e-5, 1e-6])
@pytest.mark.parametrize("state", ["none", "kv"])
@pytest.mark.slow
def test_the_recipes_own_outputs_below_its_range_are_out_of_contract_with_the_numbers(tmp_path, capsys, scale, state):
    p = _scaled({**LENS, "state": state}, scale, scale)
    inputs, outputs = str(tmp_path / "p.safetensors"), str(tmp_path / "o.safetensors")
    save_problem(inputs, p)
    out = emulate(p, "flashkda")            # what a kernel of the flashkda recipe returns, bit for bit
    save_outputs(outputs, out.tensors(), {"backend": "emulator", "route": "flashkda", "recipe": "flashkda"})
    rc = main(["check", "--inputs", inputs, "--outputs", outputs, "--recipe", "flashkda"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("OUT-OF-CONTRACT: "), last
    assert "outside the flashkda recipe's range (rms(v) " in last and "in range; the kernel's" in last, last
    # a kernel worse than its recipe at this scale still fails: 3x the recipe's own error
    tr = truth(p)
    worse = Outputs(o=(tr.o + 3 * (out.o.double() - tr.o)).to(p.v.dtype),
                    final_state=(tr.final_state + 3 * (out.final_state.double() - tr.final_state)).float())
    assert judge_plant(p, worse, tr).status == "fail"


def test_a_quiet_token_in_an_ordinary_state_is_judged_against_its_own_recipe():
    # v ~ 1e-6 with a state of rms 0.1: no rescaling of v and the state together brings both into
    # fp16's range (v / 2^-20 made the state ~1e5, the flashkda baseline NaN, and the verdict
    # borrowed the fla recipe's); the recipe's own error at this scale is sound
    quiet = {**LENS, "state": "kv", "state_scale": 0.1}
    p = _scaled(quiet, 1e-6)
    tr = truth(p)
    v = judge_plant(p, emulate(p, "flashkda"), tr)
    assert v.status == "pass", v.reason
    assert "fla recipe" not in v.reason and not any("baseline_recipe" in t for t in v.tensors.values()), v.reason
    # lb -5: the state is gone after a few tokens and the rest is at 1e-6, where the recipe's fp16 u
    # is subnormal: its own outputs are out of its range (they failed before), the exact ones pass
    p = _scaled({"B": 1, "T": 64, "H": 2, "lb": -5, "state": "vk", "state_scale": 0.1}, 1e-6)
    tr = truth(p)
    v = judge_plant(p, emulate(p, "flashkda"), tr)
    assert v.status == "out-of-contract" and "rms(v) 1e-06" in v.reason, v.reason
    exact = Outputs(o=tr.o.to(p.v.dtype), final_state=tr.final_state.float())
    assert judge_plant(p, exact, tr).status == "pass"


def test_out_of_contract_cells_are_never_green_and_are_shown_with_their_numbers(tmp_path, capsys):
    problems, outputs = tmp_path / "problems", tmp_path / "outputs"
    problems.mkdir()
    for name, scale in (("quiet", 1e-6), ("unit", 1.0)):
        save_problem(str(problems / f"{name}.safetensors"), _scaled(LENS, scale))
    assert main(["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", str(problems),
                 "--out", str(outputs), "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["check", "--inputs", str(problems), "--outputs", str(outputs)]) == 0
    text = capsys.readouterr().out
    assert "VERIFIED 1 of 2 cells: 1 pass, 1 out-of-contract" in text, text
    report = (outputs / "report.md").read_text()
    assert "outside the flashkda recipe's range (rms(v) 1e-06" in report
    (problems / "unit.safetensors").unlink()
    assert main(["check", "--inputs", str(problems), "--outputs", str(outputs)]) == 2   # nothing verified
    assert "NOTHING VERIFIED" in capsys.readouterr().out
