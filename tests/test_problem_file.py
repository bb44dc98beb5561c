"""Problem and output files: round trips, the oracle command, and bad files."""
import json

import pytest
import torch
from safetensors.torch import save_file

from kda_ref import ProblemError, truth
from verification.cli import main
from verification.errors import UsageError
from verification.reporting.problem_file import (load_outputs, load_outputs_metadata, load_problem, save_outputs,
                                       save_problem)
from verification.investigating.selfcheck import RECIPES, build

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


def _no_metadata_file(tmp_path, **meta):
    path = str(tmp_path / "nometa.safetensors")
    p = build(RECIPES[1], 0)
    save_file({n: x.contiguous() for n, x in p.tensors().items()}, path, metadata=meta or None)
    return path


def test_a_file_without_its_metadata_block_is_named(tmp_path, capsys):
    path = _no_metadata_file(tmp_path)
    with pytest.raises(UsageError, match=r"^metadata: expected the string metadata block of a kda-verify-problem/1 "
                                         r"file in .*nometa.safetensors \(keys format, scale, lower_bound, gate, "
                                         r".*\), got none: the file holds tensors only"):
        load_problem(path)
    for argv in (["oracle", "--inputs", path, "--out", str(tmp_path / "t.safetensors")],
                 ["check", "--inputs", path, "--outputs", str(tmp_path / "o.safetensors"), "--recipe", "flashkda"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error: metadata: expected the string metadata block" in err[0], err
        assert "lower_bound" not in err[0].split("got")[-1], err[0]


def test_a_lower_bound_gate_without_its_key_is_named(tmp_path):
    path = _no_metadata_file(tmp_path, format="kda-verify-problem/1")
    with pytest.raises(UsageError, match=r"^lower_bound: expected a number < 0 in the metadata of .* "
                                         r"for gate=lower_bound \(the default gate\), got no 'lower_bound' key$"):
        load_problem(path)
    path = _no_metadata_file(tmp_path, gate="lower_bound")
    with pytest.raises(UsageError, match=r"of .* for gate=lower_bound, got no 'lower_bound' key$"):
        load_problem(path)
    p = load_problem(_no_metadata_file(tmp_path, gate="lower_bound", lower_bound="-5"))
    assert p.lower_bound == -5.0


# ------------------------------------------------------------- output files held to the problem
def _truth_file(tmp_path, recipe="varlen-partial-empty", C=32):
    p = build([r for r in RECIPES if r.name == recipe][0], 0)
    pin, pout = str(tmp_path / "p.safetensors"), str(tmp_path / "t.safetensors")
    save_problem(pin, p)
    assert main(["oracle", "--inputs", pin, "--out", pout, "--workspace", "--chunk-size", str(C)]) == 0
    return p, pin, pout


def _rewrite(path, **changes):
    tensors = load_outputs(path)
    tensors.update(changes)
    save_outputs(path, {n: t for n, t in tensors.items() if t is not None}, {})


def test_outputs_of_the_problem_load(tmp_path):
    p, _, pout = _truth_file(tmp_path)
    got = load_outputs(pout, p)
    lens = [e - b for b, e in p.seq_bounds()]
    assert got["ws_inv"].shape == (p.HV * sum(-(-n // 32) for n in lens), 32, 32)     # 2 x 6 tiles
    assert got["ws_inv"].shape[0] == 12


@pytest.mark.parametrize("name,make,pattern", [
    ("o", lambda t, p: t["o"][:, :-1], r"^o: expected \[1, 119, 2, 16\] \(\[B,T,HV,V\]\) in .*, got \[1, 118, 2, 16\] float64$"),
    ("final_state", lambda t, p: t["final_state"][:-1],
     r"^final_state: expected \[7, 2, 16, 16\] \(\[N,HV,K,V\], layout kv\) in .*, got \[6, 2, 16, 16\] float64$"),
    ("ws_inv", lambda t, p: t["ws_inv"][:-1],
     r"^ws_inv: expected \[12, 32, 32\] \(\[HV\*tiles,C,C\]: HV=2 x 6 tiles at C=32\) in .*, got \[11, 32, 32\] float64$"),
])
def test_outputs_not_shaped_by_the_problem_are_named(tmp_path, name, make, pattern):
    p, _, pout = _truth_file(tmp_path)
    _rewrite(pout, **{name: make(load_outputs(pout), p)})
    load_outputs(pout)                                   # without the problem only ws_inv's own form is held
    with pytest.raises(ProblemError, match=pattern):
        load_outputs(pout, p)


def test_an_integer_output_is_named(tmp_path):
    _, _, pout = _truth_file(tmp_path)
    _rewrite(pout, o=load_outputs(pout)["o"].to(torch.int32))
    with pytest.raises(ProblemError, match=r"^o: expected a float16, bfloat16, float32 or float64 tensor in .*, "
                                           r"got \[1, 119, 2, 16\] int32$"):
        load_outputs(pout)


def test_a_paged_state_cache_of_another_shape_is_named(tmp_path):
    p, _, pout = _truth_file(tmp_path, recipe="paged")
    _rewrite(pout, state_cache=load_outputs(pout)["state_cache"][:-1])
    with pytest.raises(ProblemError, match=r"^state_cache: expected \[7, 2, 16, 16\] \(the problem's state_cache\) "
                                           r"in .*, got \[6, 2, 16, 16\] float64$"):
        load_outputs(pout, p)


@pytest.mark.parametrize("make,got", [(lambda x: x[:, :, :16], r"\[12, 32, 16\] float64"),
                                      (lambda x: x[0], r"\[32, 32\] float64"),
                                      (lambda x: x[:, :24, :24], r"\[12, 24, 24\] float64")],
                         ids=["not-square", "2-dims", "C-24"])
def test_a_ws_inv_of_no_chunk_size_is_named_by_check(tmp_path, capsys, make, got):
    _, pin, pout = _truth_file(tmp_path)
    _rewrite(pout, ws_inv=make(load_outputs(pout)["ws_inv"]).contiguous())
    with pytest.raises(ProblemError, match=rf"^ws_inv: expected \[HV\*tiles,C,C\] with C = 16\|32\|64 in .*, got {got}$"):
        load_outputs(pout)
    rc = main(["check", "--inputs", pin, "--outputs", pout, "--recipe", "flashkda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kda-verify check: error: ws_inv: expected"), err


@pytest.mark.parametrize("value,kind", [("[1, 2]", "array"), ('"case"', "string"), ("7", "number")])
def test_meta_that_is_no_json_object_is_refused_in_one_line(tmp_path, value, kind, capsys):
    """meta is Problem.meta, a dict: a JSON array (or scalar) is bad input naming the key, and
    ``check`` on the file exits 2 with that one line (it raised AttributeError in the directory form)."""
    from verification.cli import main
    path = _write(tmp_path, build(RECIPES[0], 0), meta=value)
    with pytest.raises(UsageError, match=rf"^meta: expected a JSON object .* got a JSON {kind} "):
        load_problem(path)
    assert main(["check", "--inputs", path, "--outputs", path, "--recipe", "flashkda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kda-verify check: error: meta: expected a JSON object"), err
