"""`kda-verify check` and `capture`: judge outputs dumped anywhere, through files."""
import json

import pytest
import torch

from kda_kernels.controls import NEGATIVE_CONTROLS, run_in_recipe
from kda_kernels.emulator import RECIPES
from kda_ref.truth import truth
from verification.running.cases import get_case
from verification.cli import main
from verification.reporting.problem_file import save_outputs, save_problem

CATCHING_CASE = {   # from tests/test_negative_controls.py: a stress case on which each control fails
    "carry_scaled": "stress/weak-gate-lb-1", "wrong_L_sign": "stress/weak-gate-lb-1",
    "inv_bf16": "stress/exact-keys-gate-off-beta4", "tail_not_zeroed": "stress/tail17-lb-1",
    "state_transposed": "stress/weak-gate-lb-1", "decay_after_update": "stress/weak-gate-lb-1",
    "mqk_no_diag": "stress/weak-gate-lb-1",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("check")
    paths = {}
    for cid in sorted(set(CATCHING_CASE.values())):
        p = get_case(cid).build()
        path = d / (cid.replace("/", "_") + ".problem.safetensors")
        save_problem(str(path), p)
        paths[cid] = (str(path), p)
    return d, paths


def _check(inputs, outputs, *extra):
    return main(["check", "--inputs", inputs, "--outputs", outputs, "--recipe", "flashkda", *extra])


def test_capture_then_check_passes(files, capsys):
    d, paths = files
    inputs, _ = paths["stress/weak-gate-lb-1"]
    out = str(d / "emu.safetensors")
    assert main(["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", inputs, "--out", out,
                 "--device", "cpu", "--taps"]) == 0
    assert _check(inputs, out, "--backend-name", "triton") == 0
    text = capsys.readouterr().out
    assert "tensor" in text and "ws_inv" in text and text.strip().splitlines()[-1].startswith("PASS")


def test_truth_rounded_to_the_output_dtypes_passes(files, capsys):
    d, paths = files
    for cid, (inputs, p) in paths.items():
        tr = truth(p)
        out = str(d / "rounded.safetensors")
        save_outputs(out, {"o": tr.o.to(p.v.dtype), "final_state": tr.final_state.float()}, {"what": "truth"})
        assert _check(inputs, out) == 0, (cid, capsys.readouterr().out)


@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
@pytest.mark.slow
def test_negative_controls_are_rejected(files, capsys, control):
    d, paths = files
    inputs, p = paths[CATCHING_CASE[control]]
    res = run_in_recipe(p, control, taps=True)
    out = str(d / f"{control}.safetensors")
    save_outputs(out, {**res.tensors(), "ws_inv": res.taps["ws_inv"]}, {"variant": control})
    assert _check(inputs, out, "--backend-name", "aiter", "--json") == 1
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["status"] == "fail" and verdict["reason"]


def test_bad_input_is_one_line_and_exit_two(files, capsys, tmp_path):
    d, paths = files
    inputs, _ = paths["stress/weak-gate-lb-1"]
    assert main(["check", "--inputs", inputs, "--outputs", inputs, "--recipe", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--recipe: expected one of {', '.join(RECIPES)}, got 'fp8'" in err[0]
    assert main(["check", "--inputs", str(tmp_path / "no.safetensors"), "--outputs", inputs, "--recipe", "fla"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["capture", "--backend", "emulator", "--route", "nope", "--inputs", inputs,
                 "--out", str(tmp_path / "x.safetensors")]) == 2
    assert f"--route: expected one of {', '.join(RECIPES)}, got 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_export_then_oracle_then_check_from_the_command_line(tmp_path):
    """The cross-machine workflow: export a case, compute its truth, judge outputs made elsewhere."""
    from verification.cli import main
    from verification.reporting.problem_file import load_outputs, save_outputs
    p, t, o = tmp_path / "p.safetensors", tmp_path / "t.safetensors", tmp_path / "o.safetensors"
    assert main(["export", "--case", "smoke/varlen-tail33-lb-5", "--out", str(p)]) == 0
    assert main(["oracle", "--inputs", str(p), "--out", str(t)]) == 0
    truth = load_outputs(str(t))
    save_outputs(str(o), {"o": truth["o"].bfloat16(), "final_state": truth["final_state"].float()}, {})
    assert main(["check", "--inputs", str(p), "--outputs", str(o), "--recipe", "flashkda"]) == 0
    save_outputs(str(o), {"o": truth["o"].bfloat16(), "final_state": truth["final_state"].float().transpose(-1, -2)}, {})
    assert main(["check", "--inputs", str(p), "--outputs", str(o), "--recipe", "flashkda"]) == 1
    assert main(["export", "--case", "smoke/no-such-case", "--out", str(p)]) == 2


def test_check_judges_a_route_under_the_flags_run_gives_it(monkeypatch, tmp_path, capsys):
    """moonshot's cutlass:state=bf16 declares state_dtype bf16: run judges its bf16 final state under
    that flag, and so must check (the route from the backend's routes(), as run resolves --route)."""
    from kda_kernels.emulator import emulate
    from kda_kernels.moonshot import MoonshotBackend, state_dtype
    from kda_kernels.base import Outputs
    from verification.judging.baselines import BaselineCache
    from verification.running.run_cell import TruthCache, run_cell
    from verification.running.run_select import load
    from verification.judging.tolerances import load_tolerances

    def run(self, p, route):           # what flash_kda computes: the moonshot recipe, states in the route's dtype
        out = emulate(p, "moonshot")
        return Outputs(o=out.o, final_state=out.final_state.to(state_dtype(route)), info={"route_ran": route.name})

    monkeypatch.setattr(MoonshotBackend, "available", lambda self: (True, ""))
    monkeypatch.setattr(MoonshotBackend, "run", run)
    case = get_case("smoke/initial-state-kv-lb-5")
    lb = load("moonshot")
    route = next(r for r in lb.backend.routes() if r.name == "cutlass:state=bf16")
    rec = run_cell(lb, route, case, TruthCache("cpu"), BaselineCache(), load_tolerances(), device="cpu", guards=False)
    assert rec.status == "pass", rec.reason
    p = case.build()
    out = lb.backend.run(p, route)
    assert out.final_state.dtype == torch.bfloat16
    inputs, outputs = str(tmp_path / "p.safetensors"), str(tmp_path / "o.safetensors")
    save_problem(inputs, p)
    save_outputs(outputs, out.tensors(), {"backend": "moonshot", "route": route.name, "recipe": "moonshot"})
    args = ["check", "--inputs", inputs, "--outputs", outputs, "--recipe", "moonshot", "--backend-name", "moonshot"]
    assert main(args + ["--route", route.name, "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert (checked["status"], checked["reason"]) == (rec.status, rec.reason)
    assert checked["tensors"]["final_state"]["expected_dtype"] == "bf16"
    # the fp32 route declares fp32 states: the same bf16 state is the wrong dtype there
    assert main(args + ["--route", "cutlass:state=fp32", "--json"]) == 1
    assert "final_state: dtype bf16, expected fp32 (the route's declared state_dtype)" in json.loads(
        capsys.readouterr().out)["reason"]
    # a route the backend does not have: one line naming --route and the choices, exit 2
    assert main(args + ["--route", "cutlass:state=fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--route: backend 'moonshot' has no route 'cutlass:state=fp16'" in err[0], err
