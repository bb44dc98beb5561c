"""Every kind of bad input gets a one-line error naming the argument, what was expected and
what came: from kda_ref.validate (ProblemError) and from the CLI (exit 2, no traceback)."""
import subprocess
import sys

import pytest
import torch

from kda_kernels.base import BUILTIN_BACKENDS
from kda_ref import ProblemError, validate
from verification.running.cases import SUITES
from verification.cli import main
from verification.reporting.problem_file import save_problem
from verification.investigating.selfcheck import RECIPES, build

BY_NAME = {r.name: r for r in RECIPES}

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py



def base(name="varlen-partial-empty"):
    return build(BY_NAME[name], 0)


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _cu(values):
    return torch.tensor(values, dtype=torch.int64)


def _dense_b2_varlen():
    p = base("dense")            # B=2, T=70
    return p.replace(cu_seqlens=_cu([0, 70]), initial_state=p.initial_state[:1])


def _paged_dup():
    p = base("paged")
    return p.replace(state_indices=_set(p.state_indices, 1, int(p.state_indices[0])))


def _paged_nan_read():
    p = base("paged")            # sequences 0 and 2 read their slots
    return p.replace(state_cache=_set(p.state_cache, int(p.state_indices[0]), float("nan")))


CASES = [
    # (id, problem builder, message regex)
    ("k-K", lambda p: p.replace(k=p.k[..., :-1]), r"^k: K = 15, but q, g, dt_bias have K = 16$"),
    ("q-K", lambda p: p.replace(q=p.q[..., :-1]), r"^q: K = 15, but k, g, dt_bias have K = 16$"),
    ("q-K-no-dt_bias", lambda p: p.replace(q=p.q[..., :-1], dt_bias=None), r"^q: K = 15, but k, g have K = 16$"),
    ("dt_bias-K", lambda p: p.replace(dt_bias=p.dt_bias.reshape(2, 16)[:, :-1]),
     r"^dt_bias: K = 15 \(\[2, 15\] float64 with HV=2\), but q, k, g have K = 16$"),
    ("dt_bias-size-K", lambda p: p.replace(dt_bias=torch.zeros(64, dtype=torch.float64)),
     r"^dt_bias: K = 32 \(\[64\] float64 with HV=2\), but q, k, g have K = 16$"),
    ("K-no-majority", lambda p: p.replace(q=p.q[..., :-1], k=p.k[..., :-1]),
     r"^q, k, g, dt_bias: expected one K across them, got q K = 15, k K = 15, g K = 16, dt_bias K = 16$"),
    ("k-shape", lambda p: p.replace(k=p.k[:, :-1]), r"^k: expected the shape of q \[1, 119, 2, 16\], got \[1, 118, 2, 16\]"),
    ("H-zero", lambda p: p.replace(q=p.q[:, :, :0], k=p.k[:, :, :0]),
     r"^q: expected H >= 1 query/key heads, got H=0 in \[1, 119, 0, 16\] float64$"),
    ("HV-zero", lambda p: p.replace(v=p.v[:, :, :0], g=p.g[:, :, :0], beta=p.beta[:, :, :0]),
     r"^v: expected HV >= 1 value heads, got HV=0 in \[1, 119, 0, 16\] float64$"),
    ("q-float8", lambda p: p.replace(q=p.q.to(torch.float8_e4m3fn)),
     r"^q: expected a float16, bfloat16, float32 or float64 tensor, got \[1, 119, 2, 16\] float8_e4m3fn$"),
    ("beta-float8", lambda p: p.replace(beta=p.beta.to(torch.float8_e5m2)),
     r"^beta: expected a float16, bfloat16, float32 or float64 tensor, got \[1, 119, 2\] float8_e5m2$"),
    ("dt_bias-float8", lambda p: p.replace(dt_bias=p.dt_bias.to(torch.float8_e4m3fn)),
     r"^dt_bias: expected a float16, bfloat16, float32 or float64 tensor, got \[32\] float8_e4m3fn$"),
    ("v-int", lambda p: p.replace(v=p.v.to(torch.int32)), r"^v: expected a float16, .* tensor, got .* int32$"),
    ("state-int", lambda p: p.replace(initial_state=p.initial_state.to(torch.int64)),
     r"^initial_state: expected a float16, bfloat16, float32 or float64 tensor, got \[7, 2, 16, 16\] int64$"),
    ("cache-int", lambda p: base("paged").replace(state_cache=torch.zeros(base("paged").state_cache.shape,
                                                                          dtype=torch.int32)),
     r"^state_cache: expected a float16, bfloat16, float32 or float64 tensor, got \[7, 2, 16, 16\] int32$"),
    ("dt_bias-K-HV", lambda p: p.replace(dt_bias=p.dt_bias.reshape(2, 16).T.contiguous()),
     r"^dt_bias: expected \[32\] \(HV\*K\) or \[2,16\] \(HV,K\), got \[16, 2\] float64 "
     r"\(\[K,HV\] is not accepted: pass dt_bias.T\)$"),
    ("dt_bias-other-2d", lambda p: p.replace(dt_bias=p.dt_bias.reshape(4, 8)),
     r"^dt_bias: expected \[32\] \(HV\*K\) or \[2,16\] \(HV,K\), got \[4, 8\] float64$"),
    ("pregated-decay-above-1", lambda p: p.replace(gate="pregated", g=_set(-p.g.abs(), (0, 9, 1, 4), 0.25)),
     r"^g: expected a log-decay <= 0 with gate=pregated \(a decay exp\(g\) <= 1\), got 1 values > 0 "
     r"\(max 0.25, first at index \(0, 9, 1, 4\)\)$"),
    ("cu-bool", lambda p: p.replace(cu_seqlens=p.cu_seqlens.bool()),
     r"^cu_seqlens: expected an integer tensor \[N\+1\] with N >= 1, got \[8\] bool$"),
    ("v-T", lambda p: p.replace(v=p.v[:, :-1]), r"^v: expected \[B=1,T=119,HV,V\], got \[1, 118, 2, 16\]"),
    ("HV-not-multiple", lambda p: p.replace(v=torch.zeros(1, 119, 3, 16)), r"^v: expected HV a multiple of H=2"),
    ("g-K", lambda p: p.replace(g=p.g[..., :-1]), r"^g: K = 15, but q, k, dt_bias have K = 16$"),
    ("g-T", lambda p: p.replace(g=p.g[:, :-1]), r"^g: expected \[1,119,2,16\] \(\[B,T,HV,K\]\), got \[1, 118, 2, 16\]"),
    ("beta-shape", lambda p: p.replace(beta=p.beta[..., :1]), r"^beta: expected \[1,119,2\], got \[1, 119, 1\]"),
    ("A_log-shape", lambda p: p.replace(A_log=p.A_log[:1]), r"^A_log: expected \[2\] \(one per value head\), got \[1\]"),
    ("dt_bias-shape", lambda p: p.replace(dt_bias=p.dt_bias[:-1]), r"^dt_bias: expected \[32\] \(HV\*K\)"),
    ("state-V", lambda p: p.replace(initial_state=p.initial_state[..., :-1]),
     r"^initial_state: expected \[7, 2, 16, 16\] .*got \[7, 2, 16, 15\]"),
    ("cu-start", lambda p: p.replace(cu_seqlens=_cu([1, 17, 50, 50, 114, 119, 119, 119])),
     r"^cu_seqlens: expected to start at 0, got 1"),
    ("cu-decreasing", lambda p: p.replace(cu_seqlens=_cu([0, 17, 50, 40, 114, 119, 119, 119])),
     r"^cu_seqlens: expected non-decreasing, got 50 then 40 at index 3"),
    ("cu-end", lambda p: p.replace(cu_seqlens=_cu([0, 17, 50, 50, 114, 118, 118, 118])),
     r"^cu_seqlens: expected to end at T=119, got 118"),
    ("cu-float", lambda p: p.replace(cu_seqlens=p.cu_seqlens.double()), r"^cu_seqlens: expected an integer tensor"),
    ("cu-B2", lambda p: _dense_b2_varlen(), r"^cu_seqlens: expected B == 1 with varlen, got B=2"),
    ("nan-q", lambda p: p.replace(q=_set(p.q, (0, 3, 1, 2), float("nan"))),
     r"^q: expected finite values, got 1 NaN/Inf \(first at index \(0, 3, 1, 2\)\)"),
    ("inf-k", lambda p: p.replace(k=_set(p.k, (0, 5, 0, 0), float("inf"))), r"^k: expected finite values, got 1"),
    ("nan-v", lambda p: p.replace(v=_set(p.v, (0, 0, 0, 0), float("nan"))), r"^v: expected finite values"),
    ("inf-g", lambda p: p.replace(g=_set(p.g, (0, 7, 1, 3), -float("inf"))), r"^g: expected finite values"),
    ("nan-beta", lambda p: p.replace(beta=_set(p.beta, (0, 7, 1), float("nan"))), r"^beta: expected finite values"),
    ("nan-A_log", lambda p: p.replace(A_log=_set(p.A_log, 0, float("nan"))), r"^A_log: expected finite values"),
    ("inf-dt_bias", lambda p: p.replace(dt_bias=_set(p.dt_bias, 4, float("inf"))), r"^dt_bias: expected finite values"),
    ("nan-state", lambda p: p.replace(initial_state=_set(p.initial_state, (2, 0, 0, 0), float("nan"))),
     r"^initial_state: expected finite values"),
    ("nan-read-slot", lambda p: _paged_nan_read(), r"^state_cache: expected finite values in slot \d+ \(read by sequence 0: has_initial_state is true\), got 512 NaN/Inf"),
    ("state-N", lambda p: p.replace(initial_state=p.initial_state[:-1]), r"^initial_state: expected \[7, 2, 16, 16\]"),
    ("state-H", lambda p: p.replace(initial_state=p.initial_state[:, :1]), r"^initial_state: expected \[7, 2, 16, 16\]"),
    ("state-layout", lambda p: base("gva").replace(state_layout="vk"),
     r"^initial_state: expected \[2, 4, 32, 16\] \(\[N,HV,V,K\] for layout vk\), got \[2, 4, 16, 32\]"),
    ("slot-out-of-range", lambda p: base("paged").replace(state_indices=_set(base("paged").state_indices, 2, 7)),
     r"^state_indices: expected values in \[0, 7\) \(slots\), got \[7\]"),
    ("slot-negative", lambda p: base("paged").replace(state_indices=_set(base("paged").state_indices, 0, -1)),
     r"^state_indices: expected values in \[0, 7\)"),
    ("slot-duplicated", lambda p: _paged_dup(), r"^state_indices: expected distinct slots, got slot \[\d+\] used twice"),
    ("lb-missing", lambda p: p.replace(lower_bound=None),
     r"^lower_bound: expected a number < 0 for gate=lower_bound, got none"),
    ("lb-positive", lambda p: p.replace(lower_bound=2.0), r"^lower_bound: expected a finite number < 0, got 2.0"),
    ("softplus-no-A_log", lambda p: p.replace(gate="softplus", A_log=None), r"^A_log: expected \[HV\] for gate=softplus"),
    ("gate-kind", lambda p: p.replace(gate="tanh"), r"^gate: expected one of lower_bound\|softplus\|pregated, got 'tanh'"),
    ("beta-kind", lambda p: p.replace(beta_kind="relu"), r"^beta_kind: expected one of sigmoid\|sigmoid2\|pregated"),
    ("layout-kind", lambda p: p.replace(state_layout="kvv"), r"^state_layout: expected one of kv\|vk\|paged"),
]


@pytest.mark.parametrize("case_id,make,pattern", CASES, ids=[c[0] for c in CASES])
def test_validate_names_the_argument(case_id, make, pattern):
    p = make(base())
    with pytest.raises(ProblemError, match=pattern) as e:
        validate(p)
    assert "\n" not in str(e.value)


CLI_CASES = [c for c in CASES if c[0] not in ("gate-kind", "beta-kind", "layout-kind")]


@pytest.mark.parametrize("case_id,make,pattern", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_exits_2_with_one_line(tmp_path, capsys, case_id, make, pattern):
    path = str(tmp_path / "p.safetensors")
    save_problem(path, make(base()))
    rc = main(["oracle", "--inputs", path, "--out", str(tmp_path / "t.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kda-verify oracle: error: ")
    import re
    assert re.search(pattern.lstrip("^"), lines[0]), lines[0]
    assert not (tmp_path / "t.safetensors").exists()


@pytest.mark.parametrize("key,value,pattern", [
    ("gate", "tanh", r"gate: expected one of lower_bound\|softplus\|pregated in the metadata of .*, got 'tanh'"),
    ("beta", "relu", r"beta: expected one of sigmoid\|sigmoid2\|pregated"),
    ("state_layout", "kvv", r"state_layout: expected one of kv\|vk\|paged"),
    ("lower_bound", "none", r"lower_bound: expected a number < 0 for gate=lower_bound, got none"),
])
def test_cli_bad_metadata(tmp_path, capsys, key, value, pattern):
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = str(tmp_path / "p.safetensors")
    save_problem(path, base())
    with safe_open(path, framework="pt") as f:
        meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, path, metadata=dict(meta, **{key: value}))
    rc = main(["oracle", "--inputs", path, "--out", str(tmp_path / "t.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    import re
    assert re.search(pattern, err[0]), err[0]


@pytest.mark.parametrize("argv,pattern", [
    (["oracle", "--inputs", "P", "--out", "T", "--device", "tpu"], "--device: expected cpu or cuda[:N], got 'tpu'"),
    (["oracle", "--inputs", "P", "--out", "T", "--chunk-size", "48"], "--chunk-size: expected 16, 32 or 64, got 48"),
    (["oracle", "--inputs", "P", "--out", "T", "--method", "fla", "--chunk-size", "16"],
     "--chunk-size: expected 32 or 64 (fla), got 16"),
    (["oracle-bench", "--shapes", "1x2", "--device", "cpu"], "--shapes: expected BxTxH[,BxTxH...] like 1x16384x96"),
    (["oracle-bench", "--shapes", "1x0x2", "--device", "cpu"], "--shapes: expected positive B, T, H, got '1x0x2'"),
    (["oracle-bench", "--recurrence-tokens", "0", "--device", "cpu"], "--recurrence-tokens: expected a positive"),
    (["oracle-bench", "--repeat", "0", "--device", "cpu"], "--repeat: expected an integer >= 1, got 0"),
    (["oracle-bench", "--chunks-per-seg", "-2", "--device", "cpu"], "--chunks-per-seg: expected an integer >= 1, got -2"),
    (["oracle-bench", "--peak-tflops", "-1", "--device", "cpu"], "--peak-tflops: expected a number > 0, got -1"),
    (["oracle", "--inputs", "P", "--out", "T", "--chunks-per-seg", "0"], "--chunks-per-seg: expected an integer >= 1, got 0"),
    (["isa", "--kernels", "walk"], "--kernels: expected only with --backend aiter, got it with --backend triton"),
    (["isa", "--kernel-timeout", "-1"], "--kernel-timeout: expected only with --backend aiter, got it with --backend triton"),
    (["isa", "--backend", "aiter", "--routes", "seg"], "--routes: expected only with --backend triton, got it with --backend aiter"),
])
def test_cli_bad_flags(tmp_path, capsys, argv, pattern):
    save_problem(str(tmp_path / "P"), base())
    argv = [str(tmp_path / a) if a in ("P", "T") else a for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and pattern in err[0], err


def test_cli_missing_file_and_bad_device_without_traceback(tmp_path):
    save_problem(str(tmp_path / "p.safetensors"), base())
    r = subprocess.run([sys.executable, "-m", "verification", "oracle", "--inputs",
                        str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "t")],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "oracle: error: inputs: expected an existing safetensors file" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", "verification", "oracle", "--inputs", str(tmp_path / "p.safetensors"),
                            "--out", str(tmp_path / "t"), "--device", "cuda"], capture_output=True, text=True)
        assert r.returncode == 2 and "no CUDA device here" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------- run, pytest options, tolerances, files
RUN_CASES = [
    (["--suite", "nope"], f"--suite: expected one of {', '.join(SUITES)}, got 'nope'"),
    (["--route", "nope"], "--route: backend 'emulator' has no route 'nope'; expected one of: flashkda, fla, moonshot"),
    (["--backend", "nope"], f"--backend: expected a built-in name ({', '.join(BUILTIN_BACKENDS)}) "
                            "or package.module:factory, got 'nope'"),
    (["--case", "smoke/nope"], "--case: expected a case id (or glob) of suite(s) smoke, got 'smoke/nope'"),
    (["--device", "tpu"], "--device: expected cpu or cuda[:N], got 'tpu'"),
    (["--tolerances", "MISSING"], "--tolerances: expected a YAML file, got "),
    (["--max-cells", "0"], "--max-cells: expected an integer >= 1, got 0"),
    (["--fuzz-n", "0"], "--fuzz-n: expected an integer >= 1, got '0'"),
    (["--fuzz-n", "2k"], "--fuzz-n: expected an integer >= 1, got '2k'"),
    (["--fuzz-seed", "-1"], "--fuzz-seed: expected an integer >= 0, got '-1'"),
    (["--fuzz-n", "50"], "--fuzz-n: expected together with the fuzz suite, got --fuzz-n 50 with suite(s) smoke"),
]


@pytest.mark.parametrize("extra,message", RUN_CASES, ids=[c[0][0] for c in RUN_CASES])
def test_run_bad_flags_one_line(tmp_path, capsys, extra, message):
    argv = {"--backend": "emulator", "--suite": "smoke", "--out": str(tmp_path / "r")}
    flags = dict(zip(extra[::2], [str(tmp_path / v) if v == "MISSING" else v for v in extra[1::2]]))
    argv.update(flags)
    rc = main(["run", *[x for kv in argv.items() for x in kv], "--no-report"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"kda-verify run: error: {message}"), err[0]
    assert not (tmp_path / "r" / "results.jsonl").exists()            # no cell ran


def test_run_tolerance_file_with_an_unknown_field(tmp_path, capsys):
    from verification.judging.tolerances import DEFAULT_PATH
    text = open(DEFAULT_PATH).read()
    assert "\n    reason: " in text
    bad = tmp_path / "t.yaml"
    bad.write_text(text.replace("\n    reason: ", "\n    margin: 3\n    reason: ", 1))
    rc = main(["run", "--backend", "emulator", "--suite", "smoke", "--out", str(tmp_path / "r"),
               "--tolerances", str(bad), "--no-report"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "t.yaml:" in err[0] and "unknown field 'margin'" in err[0], err[0]


def test_problem_file_with_a_missing_tensor(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = str(tmp_path / "p.safetensors")
    save_problem(path, base())
    with safe_open(path, framework="pt") as f:
        meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys() if n != "beta"}
    save_file(tensors, path, metadata=meta)
    for argv in (["oracle", "--inputs", path, "--out", str(tmp_path / "t.safetensors")],
                 ["check", "--inputs", path, "--outputs", str(tmp_path / "o.safetensors"), "--recipe", "flashkda"]):
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert f"error: beta: expected a tensor 'beta' in {path}, got none (it holds " in err[0], err[0]


pytest_plugins = ["pytester"]

PYTEST_OPTION_CASES = [
    (["--kda-suite", "nope"], f"--suite: expected one of {', '.join(SUITES)}, got 'nope'"),
    (["--kda-backend", "nope"], "--backend: expected a built-in name"),
    (["--kda-route", "nope"], "--route: backend 'emulator' has no route 'nope'"),
    (["--kda-case", "smoke/nope"], "--case: expected a case id (or glob) of suite(s) smoke, got 'smoke/nope'"),
    (["--kda-device", "tpu"], "--device: expected cpu or cuda[:N], got 'tpu'"),
    (["--kda-tolerances", "MISSING"], "--tolerances: expected a YAML file, got "),
    (["--kda-fuzz-n", "0"], "--kda-fuzz-n: expected an integer >= 1, got '0'"),
    (["--kda-fuzz-seed", "x"], "--kda-fuzz-seed: expected an integer >= 0, got 'x'"),
]


@pytest.mark.parametrize("extra,message", PYTEST_OPTION_CASES, ids=[c[0][0] for c in PYTEST_OPTION_CASES])
def test_pytest_options_fail_one_item_naming_the_option(pytester, tmp_path, extra, message):
    from pathlib import Path
    matrix = Path(__file__).resolve().parent / "test_verify_matrix.py"
    pytester.makepyfile(test_matrix_bad_options=matrix.read_text())
    opts = {"--kda-backend": "emulator"}
    opts.update(dict(zip(extra[::2], [str(tmp_path / v) if v == "MISSING" else v for v in extra[1::2]])))
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rf", "-m", "verify",
                                       *[x for kv in opts.items() for x in kv])
    out = "\n".join(res.outlines)
    assert res.ret == 2, out          # bad input (verification.judging.policy), as the matching run flag exits
    assert "verify[options]" in out and f"kda-verify options: {message}" in out, out
    assert "Traceback" not in out and "INTERNALERROR" not in out, out


def test_timeout_without_isolate_and_a_case_of_no_suite_are_named(tmp_path, capsys):
    assert main(["run", "--backend", "emulator", "--suite", "smoke", "--out", str(tmp_path / "r"), "--timeout", "5"]) == 2
    assert "--timeout: expected together with --isolate" in capsys.readouterr().err
    assert main(["export", "--case", "nope/x", "--out", str(tmp_path / "p.safetensors")]) == 2
    assert "--case: expected <suite>/<name>" in capsys.readouterr().err


# ------------------------------------------------------------- empty problems
def _empty_varlen():
    p = base()                    # varlen, B = 1: T = 0 with every sequence empty
    return p.replace(q=p.q[:, :0], k=p.k[:, :0], v=p.v[:, :0], g=p.g[:, :0], beta=p.beta[:, :0],
                     cu_seqlens=torch.zeros_like(p.cu_seqlens))


def _empty_batch():
    p = base("dense")             # B = 0
    return p.replace(q=p.q[:0], k=p.k[:0], v=p.v[:0], g=p.g[:0], beta=p.beta[:0], initial_state=p.initial_state[:0])


@pytest.mark.parametrize("make,shape", [(_empty_varlen, "B=1, T=0"), (_empty_batch, "B=0, T=70")],
                         ids=["T0", "B0"])
def test_an_empty_problem_is_valid_and_says_it_is_empty(make, shape):
    p = validate(make())
    assert p.is_empty
    assert p.empty_reason() == (f"an empty problem ({shape}: no tokens) has nothing to verify; "
                                f"expected B >= 1 and T >= 1")
    assert not base().is_empty and base().empty_reason() is None


@pytest.mark.parametrize("make", [_empty_varlen, _empty_batch], ids=["T0", "B0"])
def test_check_on_an_empty_problem_exits_2_with_one_line(tmp_path, capsys, make):
    from verification.reporting.problem_file import save_outputs
    p = make()
    pin, pout = str(tmp_path / "p.safetensors"), str(tmp_path / "o.safetensors")
    save_problem(pin, p)
    save_outputs(pout, {"o": torch.zeros(p.v.shape)}, {})
    rc = main(["check", "--inputs", pin, "--outputs", pout, "--recipe", "flashkda"])
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, cap
    assert lines[0].startswith("kda-verify check: error: ") and "empty problem" in lines[0], lines[0]
    assert "nothing to verify" in lines[0], lines[0]
