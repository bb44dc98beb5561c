"""Problem and output files: round trips, the oracle command, and bad files."""
import json

import pytest
import torch
from safetensors.torch import save_file

from kda_ref import ProblemError, truth
from verification.cli import UsageError, main
from verification.problem_file import (load_outputs, load_outputs_metadata, load_problem, save_outputs,
                                       save_problem)
from verification.selfcheck import RECIPES, build

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py



@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_problem_round_trip(tmp_path, recipe):
    p = build(recipe, 11)
    path = str(tmp_path / "p.safetensors")
    save_problem(path, p)
    q = load_problem(path)
    for name, t in p.tensors().items():
        u = q.tensors()[name]
        assert u.dtype == t.dtype and torch.equal(torch.nan_to_num(u), torch.nan_to_num(t)), name
    assert set(p.tensors()) == set(q.tensors())
    for f in ("scale", "lower_bound", "gate", "beta_kind", "qk_l2norm", "state_layout", "output_final_state", "meta"):
        assert getattr(q, f) == getattr(p, f), f


def test_bf16_inputs_and_options_survive(tmp_path):
    p = build(RECIPES[0], 1)
    p = p.to(dtype_map={"q": torch.bfloat16, "k": torch.bfloat16, "v": torch.bfloat16})
    p = p.replace(scale=0.3, qk_l2norm=False, output_final_state=False, beta_kind="sigmoid2")
    path = str(tmp_path / "p.safetensors")
    save_problem(path, p)
    q = load_problem(path)
    assert q.q.dtype == torch.bfloat16 and q.scale == 0.3 and q.qk_l2norm is False
    assert q.output_final_state is False and q.beta_kind == "sigmoid2"


def test_oracle_command_writes_the_truth(tmp_path, capsys):
    p = build([r for r in RECIPES if r.name == "paged"][0], 2)
    pin, pout = str(tmp_path / "p.safetensors"), str(tmp_path / "t.safetensors")
    save_problem(pin, p)
    assert main(["oracle", "--inputs", pin, "--out", pout]) == 0
    got = load_outputs(pout)
    want = truth(p)
    assert set(got) == {"o", "state_cache"}
    assert got["o"].dtype == torch.float64
    assert torch.equal(got["o"], want.o) and torch.equal(torch.nan_to_num(got["state_cache"]),
                                                         torch.nan_to_num(want.state_cache))
    meta = load_outputs_metadata(pout)
    assert meta["method"] == "chunked" and meta["dtype"] == "float64"
    assert main(["oracle", "--inputs", pin, "--out", pout, "--workspace", "--chunk-size", "16",
                 "--chunks-per-seg", "2", "--method", "recurrence"]) == 0
    got = load_outputs(pout)
    for name in ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk", "ws_beta", "A_seg", "b_seg", "h_in",
                 "seg_desc", "seq_seg_off"):
        assert name in got, name
    assert (got["o"] - want.o).norm() / want.o.norm() < 1e-12


def test_outputs_round_trip(tmp_path):
    path = str(tmp_path / "o.safetensors")
    o, fs = torch.randn(1, 4, 2, 3, dtype=torch.float64), torch.randn(1, 2, 3, 3)
    save_outputs(path, {"o": o, "final_state": fs}, {"backend": "x", "route": {"a": 1}})
    got = load_outputs(path)
    assert torch.equal(got["o"], o) and torch.equal(got["final_state"], fs)
    meta = load_outputs_metadata(path)
    assert meta["backend"] == "x" and json.loads(meta["route"]) == {"a": 1}


def _write(tmp_path, p, **meta_override):
    path = str(tmp_path / "bad.safetensors")
    save_problem(path, p)
    if meta_override:
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
        meta.update(meta_override)
        save_file(tensors, path, metadata=meta)
    return path


@pytest.mark.parametrize("key,value", [("gate", "tanh"), ("beta", "relu"), ("state_layout", "kvv"),
                                       ("qk_l2norm", "yes"), ("output_final_state", "1"), ("lower_bound", "-five"),
                                       ("scale", "nan"), ("format", "other/9")])
def test_unknown_metadata_values_are_named(tmp_path, key, value):
    path = _write(tmp_path, build(RECIPES[0], 0), **{key: value})
    with pytest.raises(UsageError, match=rf"^{key}: expected .*got '{value}'"):
        load_problem(path)


def test_missing_and_unknown_tensors_are_named(tmp_path):
    p = build(RECIPES[0], 0)
    path = str(tmp_path / "m.safetensors")
    t = {n: x for n, x in p.tensors().items() if n != "beta"}
    save_file({n: x.contiguous() for n, x in t.items()}, path, metadata={"gate": "lower_bound", "lower_bound": "-5"})
    with pytest.raises(ProblemError, match=r"^beta: expected a tensor 'beta'"):
        load_problem(path)
    t = dict(p.tensors(), gamma=torch.zeros(3))
    save_file({n: x.contiguous() for n, x in t.items()}, path)
    with pytest.raises(UsageError, match=r"^gamma: expected only the tensors"):
        load_problem(path)


def test_missing_or_unreadable_files(tmp_path):
    with pytest.raises(UsageError, match=r"^inputs: expected an existing safetensors file"):
        load_problem(str(tmp_path / "none.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match=r"^inputs: expected a safetensors file"):
        load_problem(str(junk))
    with pytest.raises(UsageError, match=r"^outputs: expected an existing"):
        load_outputs(str(tmp_path / "none.safetensors"))
