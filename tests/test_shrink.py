"""kda-verify shrink: the reductions are exact where they claim to be, a shrink keeps the same
failure, three negative controls of emulator-bad shrink to a smaller problem whose bundle fails
`kda-verify check` as the cell did, and repro.py runs in a fresh process without kda-verify for
a backend that does not need it (a stand-in flash_kda made here)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kda_kernels import moonshot as moon
from kda_ref.problem import validate
from kda_ref.truth import truth
from verification.reporting.bundle import checks_from_record, repro_source, write_bundle
from kda_ref.problems import generate
from verification.running.cases import get_case
from verification.cli import main
from verification.running.run_select import as_loaded, load, resolve_routes
from verification.investigating.shrink import (CUT, Shrinker, Signature, chunk_states, head_errors, signature, size,
                                 subproblem)
from verification.judging.tolerances import load_tolerances

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

F64 = torch.float64


def _close(a, b, tol=1e-10):
    a, b = a.to(F64), b.to(F64)
    return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-300)


# ---------------------------------------------------------------------------- exact reductions
def _f64_states(p):
    """The problem with its states in float64, so a state handed over at a cut is exact."""
    ch = {}
    if p.initial_state is not None:
        ch["initial_state"] = p.initial_state.to(F64)
    if p.state_cache is not None:
        ch["state_cache"] = p.state_cache.to(F64)
    return p.replace(**ch)


@pytest.mark.parametrize("params", [
    dict(B=1, T=150, H=2, K=16, V=8, state="kv"),
    dict(B=2, T=140, H=1, K=16, V=8, state="vk"),
    dict(B=2, T=130, H=1, K=16, V=8),                                 # no initial state: one is made
    dict(lens=[70, 0, 135], H=1, K=16, V=8, state="kv"),
    dict(lens=[150, 66], H=2, K=16, V=8, state="paged", paged_new=[1]),
], ids=["kv", "vk", "none", "varlen", "paged"])
def test_a_leading_cut_with_the_oracles_state_gives_the_same_outputs(params):
    """Dropping the first c*64 tokens of a sequence and starting it from kda_ref's chunk-boundary
    state S_c reproduces the original o on every kept token and the original final state."""
    p = validate(_f64_states(generate(params, seed=7)))
    st = chunk_states(p)
    t = truth(p)
    lens = [e - b for b, e in p.seq_bounds()]
    n = max(range(len(lens)), key=lambda i: lens[i])
    c = (lens[n] - 1) // CUT
    assert c >= 1
    if p.cu_seqlens is None:
        spans = [(r, c * CUT, p.T) for r in range(p.B)]
        starts = {r: st[r, c] for r in range(p.B)}
    else:
        spans = [(m, c * CUT if m == n else 0, lens[m]) for m in range(len(lens))]
        starts = {n: st[n, c]}
    q = validate(subproblem(p, spans, starts=starts))
    # a problem without a state gets a float32 one: the handed-over state is then rounded to fp32
    tol = 1e-10 if p.initial_state is not None or p.paged else 1e-6
    assert (q.initial_state.dtype if q.initial_state is not None else q.state_cache.dtype) == (
        F64 if tol == 1e-10 else torch.float32)
    tq = truth(q)
    o_p = t.o.reshape(-1, p.HV, p.V)
    bounds = p.seq_bounds()
    keep = [i for m, a, b in spans for i in range(bounds[m][0] + a, bounds[m][0] + b)]
    assert _close(tq.o.reshape(-1, q.HV, q.V), o_p[keep], tol)
    assert not _close(tq.o.reshape(-1, q.HV, q.V), o_p[keep].roll(1, 0), 1e-3)
    if p.paged:
        idx = p.state_indices.long()
        assert _close(tq.state_cache[idx], t.state_cache[idx], tol)
    else:
        assert _close(tq.final_state, t.final_state, tol)
    assert size(q) < size(p)


def test_keeping_one_head_slices_every_per_head_tensor():
    """GVA (H=1, HV=2), softplus gate (A_log, dt_bias), a kv state: head 1 alone is head 1 of the whole."""
    p = validate(generate(dict(B=1, T=40, H=2, HV=4, K=16, V=8, state="kv"), seed=3))
    p = p.replace(gate="softplus", lower_bound=None)
    t = truth(p)
    for h in range(p.HV):
        q = validate(subproblem(p, [(0, 0, p.T)], heads=[h]))
        assert (q.H, q.HV) == (1, 1)
        tq = truth(q)
        assert _close(tq.o[:, :, 0], t.o[:, :, h], 1e-12)
        assert _close(tq.final_state[:, 0], t.final_state[:, h], 1e-12)


def test_dropping_a_sequence_keeps_the_others_outputs():
    p = validate(generate(dict(lens=[20, 0, 33, 50], H=1, K=16, V=8, state="kv"), seed=5))
    t = truth(p)
    q = validate(subproblem(p, [(0, 0, 20), (1, 0, 0), (3, 0, 50)]))
    tq = truth(q)
    b = p.seq_bounds()
    keep = list(range(b[0][0], b[0][1])) + list(range(b[3][0], b[3][1]))
    assert _close(tq.o.reshape(-1, 1, p.V), t.o.reshape(-1, 1, p.V)[keep], 1e-12)
    assert _close(tq.final_state, t.final_state[[0, 1, 3]], 1e-12)


def test_head_errors_rank_the_head_that_is_wrong():
    p = validate(generate(dict(B=1, T=16, H=3, K=16, V=8), seed=1))
    t = truth(p).tensors()
    x = {k: v.clone() for k, v in t.items()}
    x["o"][:, :, 2] *= 1.5
    errs = head_errors(p, x, t)
    assert max(range(3), key=lambda h: errs[h]) == 2 and errs[0] == 0.0


# ---------------------------------------------------------------------------- the same failure
def _rec(status="fail", **tensors):
    out = {"status": status, "reason": "", "tensors": {}, "metrics": {}}
    for name, (margin, nan) in tensors.items():
        out["tensors"][name] = {"margin": margin, "metric": "rel_l2"}
        out["metrics"][name] = {"nan_frac": nan, "inf_frac": 0.0}
    return out


def test_signature_orders_non_finite_first_and_keeps_means_the_same_mark():
    s = signature(_rec(o=(3.0, 0.0), final_state=(float("inf"), 0.1)))
    assert s.primary == ("final_state", "nan")
    assert s.keeps(signature(_rec(o=(0.5, 0.0), final_state=(float("inf"), 0.2))))
    assert not s.keeps(signature(_rec(o=(9.0, 0.0), final_state=(2.0, 0.0))))       # over, not NaN
    over = signature(_rec(o=(3.0, 0.0), final_state=(0.5, 0.0)))
    assert over.primary == ("o", "over")
    assert over.keeps(signature(_rec(o=(1.5, 0.0), final_state=(4.0, 0.0))))
    assert not over.keeps(signature(_rec(o=(0.9, 0.0), final_state=(4.0, 0.0))))    # o no longer over
    assert not over.keeps(signature(_rec("mistrusted", o=(3.0, 0.0))))              # another status
    assert not signature(_rec("pass", o=(0.5, 0.0))).failing


def test_a_known_failure_is_the_failure_it_is_and_a_raise_has_its_type():
    rec = _rec("known-fail", o=(2.0, 0.0))
    rec["known_failure"] = {"status": "fail"}
    assert signature(rec).status == "fail" and signature(rec).primary == ("o", "over")
    err = signature({"status": "error", "reason": "moonshot cutlass run raised RuntimeError: boom"})
    assert err.primary == ("run", "raised RuntimeError")
    assert not err.keeps(signature({"status": "error", "reason": "x run raised ValueError: y"}))
    assert Signature("", ()).describe() == "no failure"


# ---------------------------------------------------------------------------- negative controls
CONTROLS = [("mqk_no_diag", "smoke/varlen-tail33-lb-5"),
            ("carry_scaled", "stress/weak-gate-lb-0.01"),
            ("tail_not_zeroed", "stress/tail17-lb-1")]


# one control in the default run (3.5-4 s each on 2 cores); the other two on CI's slow line
@pytest.mark.parametrize("route,case_id", [pytest.param(r, c, id=r, marks=() if r == "tail_not_zeroed" else pytest.mark.slow)
                                           for r, c in CONTROLS])
def test_a_negative_control_shrinks_and_its_bundle_fails_as_the_cell_did(route, case_id, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["shrink", "--backend", "emulator-bad", "--route", route, "--case", case_id,
                 "--out", str(out)]) == 0
    data = json.loads((out / "shrink.json").read_text())
    case = get_case(case_id).build()
    assert data["trace"], "no step was kept"
    assert data["final"]["size"] < size(case), data["final"]
    assert data["final"]["N"] * data["final"]["T"] * data["final"]["H"] < case.N * case.B * case.T * case.H
    assert data["original"]["status"] == "fail" and data["final"]["status"] == "fail"
    for name in ("problem.safetensors", "truth.safetensors", "outputs.safetensors", "repro.py", "REPORT.md"):
        assert (out / name).is_file(), name
    report = (out / "REPORT.md").read_text()
    for text in ("## What fails", "## Shrunk problem", "## Shrink trace", "## Environment", "## Reproduce",
                 data["final"]["shape"], data["command"]):
        assert text in report, text
    capsys.readouterr()
    # kda-verify check on the bundle: the same verdict as the shrunk cell
    rc = main(["check", "--inputs", str(out / "problem.safetensors"), "--outputs", str(out / "outputs.safetensors"),
               "--recipe", "flashkda", "--backend-name", "emulator-bad", "--route", route, "--json"])
    verdict = json.loads(capsys.readouterr().out)
    assert rc == 1 and verdict["status"] == "fail"
    primary = data["trace"][-1]["failure"].split(" ")[0]
    assert verdict["tensors"][primary]["margin"] == pytest.approx(data["final"]["tensors"][primary]["margin"], rel=1e-9)
    # repro.py (the project's own backend: kda_kernels) reproduces it in a fresh process
    r = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 1 and "REPRODUCED" in r.stdout, r.stdout + r.stderr
    # the repro's measures are the verdict's
    for c in data["checks"]:
        if isinstance(c["observed"], float):
            shown = [ln for ln in r.stdout.splitlines() if ln.startswith("check ") and f"{c['observed']:.4g}" in ln]
            assert shown, (c, r.stdout)


def test_a_workspace_tap_failure_reproduces_from_a_moved_bundle(tmp_path, monkeypatch, capsys):
    """wrong_L_sign shrinks to T=2, where only the stored inverse (the ws_inv tap) still fails: the
    bundle's truth holds the oracle's inverse, repro.py asks the kernel for its tap and exits 1
    REPRODUCED in a fresh process from another directory after the bundle was moved, and
    REPORT.md names no absolute path (its commands run from the bundle's directory)."""
    import shutil
    out = tmp_path / "made" / "b"
    assert main(["shrink", "--backend", "emulator-bad", "--route", "wrong_L_sign", "--case",
                 "smoke/initial-state-kv-lb-5", "--out", str(out)]) == 0
    assert "repro.py in a fresh process: exit 1: REPRODUCED" in capsys.readouterr().out
    data = json.loads((out / "shrink.json").read_text())
    assert data["final"]["failure"].startswith("ws_inv over its threshold")
    outputs_margins = [t["margin"] for n, t in data["final"]["tensors"].items() if n != "ws_inv"]
    assert outputs_margins and max(outputs_margins) <= 1, "not a tap-only failure: the test would not test taps"
    assert [c["tensor"] for c in data["checks"] if c["failed"]] == ["ws_inv"]
    assert data["repro_check"] == {"exit": 1, "reproduced": True, "last_line": "REPRODUCED"}
    report = (out / "REPORT.md").read_text()
    assert str(tmp_path) not in report and "python repro.py          # exit 1: REPRODUCED" in report
    assert str(tmp_path) not in json.dumps({k: data[k] for k in ("command", "check_command", "repro_command")})
    moved = tmp_path / "elsewhere" / "bundle"
    shutil.move(str(out), str(moved))
    shutil.rmtree(tmp_path / "made")
    (tmp_path / "cwd").mkdir()
    r = subprocess.run([sys.executable, str(moved / "repro.py")], capture_output=True, text=True,
                       cwd=tmp_path / "cwd", timeout=300)
    assert r.returncode == 1 and r.stdout.strip().splitlines()[-1] == "REPRODUCED", r.stdout + r.stderr
    observed = next(c for c in data["checks"] if c["tensor"] == "ws_inv")["observed"]
    assert any(ln.startswith("check ws_inv rel_l2: ") and f"{observed:.4g}" in ln and ln.endswith("FAILS")
               for ln in r.stdout.splitlines()), r.stdout
    monkeypatch.chdir(moved)                                 # REPORT.md's check command, from the bundle
    assert main(data["check_command"].split()[1:]) == 1


def test_a_passing_cell_exits_1_and_writes_no_bundle(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["shrink", "--backend", "emulator", "--route", "flashkda", "--case", "smoke/dense-T64-lb-5",
                 "--out", str(out)]) == 1
    assert "nothing to shrink" in capsys.readouterr().out
    assert not (out / "problem.safetensors").exists()


@pytest.mark.parametrize("argv,fragment", [
    (["--backend", "emulator-bad", "--route", "carry_scaled", "--case", "nope/x"], "--case: expected <suite>/<name>"),
    (["--backend", "emulator-bad", "--case", "smoke/dense-T64-lb-5"], "--route: expected with --case"),
    (["--backend", "emulator-bad", "--route", "carry_scaled", "--case", "smoke/dense-T64-lb-5", "--max-runs", "0"],
     "--max-runs: expected an integer >= 1"),
    (["--backend", "emulator-bad", "--route", "nope", "--case", "smoke/dense-T64-lb-5"], "--route:"),
    (["--backend", "emulator-bad", "--route", "slots_swapped", "--case", "smoke/dense-T64-lb-5"],
     "is skipped here, so there is no failure to shrink"),
    (["--from-results", "nowhere"], "--cell: expected a cell key"),
    (["--from-results", "nowhere", "--cell", "a|b|c"], "--from-results: expected a results directory"),
])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, tmp_path, capsys):
    assert main(["shrink", *argv, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_from_results_finds_the_cell_and_an_unknown_key_names_one(tmp_path, capsys):
    from verification.commands.shrink import _from_results
    from verification.judging.record import append_record
    d = tmp_path / "run"
    d.mkdir()
    append_record(d / "results.jsonl", {"key": "emulator-bad|carry_scaled|fuzz/fuzz0-3", "backend": "emulator-bad",
                                         "backend_spec": "emulator-bad", "route": "carry_scaled",
                                         "case": "fuzz/fuzz0-3",
                                         "repro": "kda-verify run --backend emulator-bad --route carry_scaled --suite "
                                                  "fuzz --case fuzz/fuzz0-3 --fuzz-n 30 --fuzz-seed 0 --out DIR"})

    class A:
        from_results, cell = str(d), "emulator-bad|carry_scaled|fuzz/fuzz0-3"
    assert _from_results(A) == ("emulator-bad", "carry_scaled", "fuzz/fuzz0-3", "30", "0")
    assert main(["shrink", "--from-results", str(d), "--cell", "x|y|z", "--out", str(tmp_path / "b")]) == 2
    assert "emulator-bad|carry_scaled|fuzz/fuzz0-3" in capsys.readouterr().err


# ---------------------------------------------------------------------------- repro.py without kda-verify
FAKE_FLASH_KDA = '''
"""A stand-in flash_kda: the KDA token recurrence in float64 (FAKE_CARRY scales the state at
every 16-token chunk boundary: 1 is a correct kernel)."""
import os
import torch


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None):
    carry = float(os.environ.get("FAKE_CARRY", "1"))
    B, T, H, D = q.shape
    flat = lambda t: t.reshape((B * T,) + tuple(t.shape[2:])).double()
    qd, kd, vd, gd, bd = flat(q), flat(k), flat(v), flat(g), flat(beta)
    qd = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + 1e-6)
    kd = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    a = lower_bound * torch.sigmoid(torch.exp(A_log.double())[:, None] * (gd + dt_bias.double()))
    b = torch.sigmoid(bd)
    if cu_seqlens is None:
        bounds = [(i * T, (i + 1) * T) for i in range(B)]
    else:
        c = cu_seqlens.tolist()
        bounds = list(zip(c[:-1], c[1:]))
    o = torch.zeros_like(vd)
    for n, (bos, eos) in enumerate(bounds):
        S = (initial_state[n].double().transpose(-1, -2) if initial_state is not None
             else torch.zeros(H, D, D, dtype=torch.float64))
        for t in range(bos, eos):
            if t > bos and (t - bos) % 16 == 0:
                S = S * carry
            S = torch.exp(a[t])[:, :, None] * S
            d = b[t][:, None] * (vd[t] - torch.einsum("hk,hkv->hv", kd[t], S))
            S = S + kd[t][:, :, None] * d[:, None, :]
            o[t] = scale * torch.einsum("hk,hkv->hv", qd[t], S)
        if final_state is not None:
            final_state[n].copy_(S.transpose(-1, -2).to(final_state.dtype))
    out.copy_(o.reshape(out.shape).to(out.dtype))
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    (lib / "flash_kda").mkdir(parents=True)
    (lib / "flash_kda" / "__init__.py").write_text(textwrap.dedent(FAKE_FLASH_KDA))
    blocker = tmp_path / "no-kda-verify"
    for pkg in ("verification", "kda_kernels", "kda_ref"):
        (blocker / pkg).mkdir(parents=True)
        (blocker / pkg / "__init__.py").write_text(f"raise ImportError('{pkg} is not importable here')\n")
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.delitem(sys.modules, "flash_kda", raising=False)
    monkeypatch.setattr(moon.MoonshotBackend, "available", lambda self: (True, ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(lib)]))
    return lib, env


@pytest.mark.slow
def test_repro_runs_without_kda_verify_for_a_library_backend(stand_in, tmp_path, monkeypatch):
    lib, env = stand_in
    monkeypatch.setenv("FAKE_CARRY", "0.9")
    lb = as_loaded(moon.MoonshotBackend())
    route = resolve_routes(lb, ["cutlass:state=fp32"])[0]
    case = get_case("stress/weak-gate-lb-0.01")
    res = Shrinker(lb, route, load_tolerances()).shrink(case)
    assert res.original.signature.failing and res.trace
    # the stand-in's bug acts first at the chunk boundary before token 16: 17 tokens of one head are the least
    assert [e - b for b, e in res.final.problem.seq_bounds()] == [17] and res.final.problem.H == 1
    out = tmp_path / "bundle"
    write_bundle(out, res, lb, route, case, "cpu", "kda-verify shrink ...")
    src = (out / "repro.py").read_text()
    imports = [ln.strip() for ln in src.splitlines() if ln.strip().startswith(("import ", "from "))]
    assert "import flash_kda" in imports
    assert not [ln for ln in imports if any(m in ln for m in ("kda_kernels", "kda_ref", "verification"))], imports
    # the fresh process cannot import kda-verify at all
    r = subprocess.run([sys.executable, "-c", "import verification"], capture_output=True, text=True, env=env,
                       cwd=tmp_path)
    assert r.returncode != 0 and "not importable here" in r.stderr
    for carry, rc, word in (("0.9", 1, "REPRODUCED"), ("1", 0, "NOT REPRODUCED")):
        r = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True,
                           env=dict(env, FAKE_CARRY=carry), cwd=tmp_path, timeout=300)
        assert r.returncode == rc and r.stdout.strip().splitlines()[-1] == word, r.stdout + r.stderr
    # without the library the repro says so: exit 2
    r = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(env, PYTHONPATH=str(tmp_path / "no-kda-verify")), timeout=300)
    assert r.returncode == 2 and "cannot import the kernel's library" in r.stderr


def _namespace(backend, route, tmp_path):
    path = tmp_path / f"repro_{backend}.py"
    path.write_text(repro_source(backend, route, []))
    ns = {"__name__": "repro", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns


def _P(p):
    P = dict(p.tensors())
    P.update(scale=p.scale_value, lower_bound=p.lower_bound, gate=p.gate, beta_kind=p.beta_kind,
             qk_l2norm=p.qk_l2norm, state_layout=p.state_layout, output_final_state=p.output_final_state)
    return P


def _same_arguments(mine: dict, theirs: dict, buffers=("out", "final_state")):
    assert set(mine) == set(theirs), (sorted(mine), sorted(theirs))
    for k, v in theirs.items():
        w = mine[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(w, torch.Tensor) and w.dtype == v.dtype and w.shape == v.shape, k
            if k not in buffers:
                torch.testing.assert_close(w, v, rtol=0, atol=0, equal_nan=True, msg=k)
        else:
            assert w == v, k


CALL_CASES = ["smoke/initial-state-kv-lb-5", "smoke/weak-gate-lb-0.1-vk", "smoke/varlen-tail33-lb-5"]


@pytest.mark.parametrize("case_id", CALL_CASES)
def test_repro_calls_flash_kda_and_fla_with_the_adapters_arguments(case_id, tmp_path):
    from kda_kernels import fla
    p = get_case(case_id).build()
    for r in moon.MoonshotBackend().routes():
        ns = _namespace("moonshot", r, tmp_path)
        _same_arguments(ns["kernel_arguments"](_P(p)), moon.call_arguments(p, r))
    for r in fla.FlaBackend().routes():
        ns = _namespace("fla", r, tmp_path)
        name, kw = ns["kernel_arguments"](_P(p))
        want_name, want = fla.call_arguments(p, r)
        assert name == want_name
        _same_arguments(kw, want, buffers=())


@pytest.mark.parametrize("case_id", CALL_CASES + ["smoke/paged-lb-5"])
def test_repro_calls_aiter_with_the_adapters_arguments(case_id, tmp_path):
    import types

    from kda_kernels import aiter

    def flash_kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, output_final_state=True,
                      state_v_first=False, chunks_per_seg=None, cu_seqlens=None, initial_state=None,
                      state_cache=None, state_indices=None, has_initial_state=None, out=None):
        raise AssertionError("not called")
    mod = types.SimpleNamespace(flash_kda_fwd=flash_kda_fwd)
    backend = aiter.AiterBackend(module=mod)
    p = get_case(case_id).build()
    for r in backend.routes()[:6]:
        ns = _namespace("aiter", r, tmp_path)
        mine = ns["kernel_arguments"](_P(p), mod)
        _same_arguments(mine, backend.call_arguments(p, aiter.parse_route(r.name)), buffers=("out",))
        k1, k2 = aiter.KERNEL_SETS[aiter.parse_route(r.name)["kernels"]]
        assert (ns["FLAGS"]["gluon_k1"], ns["FLAGS"]["gluon_k2"]) == (k1, k2)


@pytest.mark.parametrize("case_id", CALL_CASES + ["smoke/paged-lb-5"])
def test_repro_calls_aiter_chunk_kda_with_the_adapters_arguments(case_id, tmp_path, monkeypatch):
    """A chunk_kda route's repro calls chunk_kda (not flash_kda_fwd) with the adapter's arguments,
    and its Triton fallback with the FlashKDA switch on."""
    import sys
    import types

    from kda_kernels import aiter
    seen = {}

    def chunk_kda(**kw):
        seen.update(kw)
        final = None if kw.get("state_cache") is not None or not kw["output_final_state"] else \
            torch.zeros(kw["cu_seqlens"].numel() - 1, kw["q"].shape[2], 128, 128)
        return kw["out"], final
    ck = types.SimpleNamespace(chunk_kda=chunk_kda, _ARCH="sm90")
    fwd = types.SimpleNamespace(AITER_FDA_ENABLE=False)
    monkeypatch.setitem(sys.modules, aiter.CHUNK_KDA, ck)
    monkeypatch.setitem(sys.modules, aiter.CHUNK_FWD, fwd)
    backend = aiter.AiterBackend(module=types.SimpleNamespace(), chunk_kda=ck, chunk_fwd=fwd)
    p = get_case(case_id).build()
    r = [r for r in backend.routes() if r.name == "chunk_kda:triton"][0]
    ns = _namespace("aiter", r, tmp_path)
    assert ns["FLAGS"] == {"entry": "chunk_kda", "kernels": "triton"}
    out = ns["kernel"](_P(p))
    assert fwd.AITER_FDA_ENABLE is True
    _same_arguments(seen, backend.chunk_kda_arguments(p), buffers=("out",))
    assert out["o"].shape == p.v.shape


def test_checks_name_the_failing_measures():
    rec = {"tensors": {"o": {"margin": 3.0, "tensor_margin": 3.0, "metric": "tail_rel_l2", "threshold": 0.01,
                             "err": 0.03, "baseline_err": 0.004},
                       "final_state": {"margin": 2.0, "tensor_margin": 0.5, "metric": "rel_l2", "threshold": 0.01,
                                       "err": 0.005, "slice": {"kind": "seq_head", "label": [0, 1], "margin": 2.0,
                                                               "threshold": 0.01, "err": 0.02, "where": "s"}}},
           "metrics": {"o": {"nan_frac": 0.0, "inf_frac": 0.0}, "final_state": {"nan_frac": 0.0, "inf_frac": 0.0}}}
    checks = checks_from_record(rec)
    assert [(c["tensor"], c["measure"], c["failed"]) for c in checks] == [
        ("o", "tail_rel_l2", True), ("final_state", "rel_l2", False), ("final_state", "slice", True)]
    rec["metrics"]["o"]["nan_frac"] = 0.1
    assert [(c["measure"], c["failed"]) for c in checks_from_record(rec)[:2]] == [("finite", True),
                                                                                 ("tail_rel_l2", True)]


def test_max_runs_stops_the_shrink(tmp_path):
    lb = load("emulator-bad")
    route = resolve_routes(lb, ["mqk_no_diag"])[0]
    res = Shrinker(lb, route, load_tolerances()).shrink(get_case("smoke/varlen-tail33-lb-5"), max_runs=2)
    assert res.runs == 2 and res.stopped == "max-runs"


def test_the_report_states_the_judges_verdict_of_a_known_failure():
    from verification.reporting.bundle import verdict_of
    rec = {"status": "known-fail", "known_failure": {"status": "fail", "reason": "chunks (after) an empty sequence"},
           "reason": "known failure (tolerances.yaml line 9: chunks (after) an empty sequence): o: rel_l2 76.7 > 0.004"}
    assert verdict_of(rec) == ("fail", "o: rel_l2 76.7 > 0.004")
    assert verdict_of({"status": "fail", "reason": "x"}) == ("fail", "x")


class _Zeros:
    """The emulator's flashkda route with o all zeros (mistrusted) or one unwritten cache slot changed."""

    def __init__(self, how):
        from kda_kernels.emulator import EmulatorBackend
        self.inner, self.how, self.name = EmulatorBackend(), how, "emulator"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, problem, route):
        out = self.inner.run(problem, route)
        if self.how == "zeros":
            out.o = torch.zeros_like(out.o)
        else:
            unused = sorted(set(range(out.state_cache.shape[0])) - set(problem.state_indices.tolist()))
            out.state_cache = out.state_cache.clone()
            out.state_cache[unused[0]] = 1.0
        return out


@pytest.mark.parametrize("how,case_id,word", [("zeros", "smoke/dense-T64-lb-5", "exact zeros"),
                                               ("slot", "smoke/paged-lb-5", "unwritten slots unchanged")])
def test_a_mistrusted_or_untouched_slot_failure_has_a_check_the_repro_holds(how, case_id, word, tmp_path):
    lb = as_loaded(_Zeros(how))
    route = resolve_routes(as_loaded(_Zeros(how)), ["flashkda"])[0]
    case = get_case(case_id)
    res = Shrinker(lb, route, load_tolerances()).shrink(case, max_runs=4)
    assert res.original.signature.primary[1] == ("mistrusted" if how == "zeros" else "untouched")
    data = write_bundle(tmp_path / "b", res, lb, route, case, "cpu", "cmd")
    assert {c["measure"] for c in data["checks"]} & {"zeros", "untouched"}
    src = repro_source("emulator", route, data["checks"]).replace(
        "    out = backend.run(prob, route)", "    out = ZEROS.run(prob, route)")
    (tmp_path / "b" / "repro.py").write_text(src)
    ns = {"__name__": "repro", "__file__": str(tmp_path / "b" / "repro.py"), "ZEROS": _Zeros(how)}
    exec(compile(src, "repro.py", "exec"), ns)
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = ns["main"](["--device", "cpu"])
    assert rc == 1 and word in buf.getvalue() and "FAILS" in buf.getvalue(), buf.getvalue()


CRASHER = '''
import os

from kda_kernels.emulator import EmulatorBackend


class Crasher(EmulatorBackend):
    """The emulator, except that a problem with two heads or more kills the process."""

    def __init__(self):
        super().__init__()
        self.name = "crasher"

    def run(self, problem, route, **kw):
        if problem.HV >= 2:
            os._exit(134)
        return super().run(problem, route, **kw)


def crasher():
    return Crasher()
'''


@pytest.mark.slow
def test_isolate_shrinks_a_kernel_that_kills_its_process(tmp_path, monkeypatch, capsys):
    (tmp_path / "crashkernel.py").write_text(CRASHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "b"
    assert main(["shrink", "--backend", "crashkernel:crasher", "--route", "flashkda", "--case", "smoke/dense-T64-lb-5",
                 "--out", str(out), "--isolate", "--max-runs", "4"]) == 0
    data = json.loads((out / "shrink.json").read_text())
    assert data["original"]["status"] == "crashed" and data["final"]["status"] == "crashed"
    assert data["final"]["HV"] == 2 and data["trace"] and data["final"]["size"] < data["original"]["size"]
    assert not (out / "outputs.safetensors").exists() and (out / "problem.safetensors").exists()
    assert [c["measure"] for c in data["checks"]] == ["crash"]
    assert "kills the process" in (out / "REPORT.md").read_text()
    assert main(["shrink", "--backend", "emulator", "--route", "flashkda", "--case", "smoke/dense-T64-lb-5",
                 "--out", str(out), "--timeout", "5"]) == 2
    assert "--timeout: expected together with --isolate" in capsys.readouterr().err


@pytest.mark.slow
def test_a_crash_bundle_reproduces_by_dying_and_a_broken_repro_is_not_reproduced(tmp_path, monkeypatch):
    """The crasher's bundle: repro.py loads the backend by its spec (package.module:factory) and
    the process dies as the cell did (exit 134), which the bundle states as reproduced; a repro that
    fails itself (here: a backend it cannot load) exits 2, never 1 (Python's exit code for an
    uncaught exception, which would read as REPRODUCED)."""
    (tmp_path / "crashkernel.py").write_text(CRASHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "b"
    assert main(["shrink", "--backend", "crashkernel:crasher", "--route", "flashkda", "--case", "smoke/dense-T64-lb-5",
                 "--out", str(out), "--isolate", "--max-runs", "2"]) == 0
    data = json.loads((out / "shrink.json").read_text())
    assert data["repro_check"]["exit"] == 134 and data["repro_check"]["reproduced"], data["repro_check"]
    assert "# exit 134: the kernel kills the process: REPRODUCED" in (out / "REPORT.md").read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}        # crashkernel not importable
    r = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert r.returncode == 2 and "repro: error: the repro itself failed" in r.stderr, (r.returncode, r.stderr[-800:])


SHAPESHIFTER = '''
import os
import torch
from kda_kernels.base import Outputs, Route
from kda_ref.truth import truth


class Shapeshifter:
    """Fails in the form the file $KDA_TEST_FORM names, read at every call: "nan" (one NaN in the
    final state, o exact), "o" (o off by noise as large as itself, the state exact) or "pass"
    (exact): a kernel whose failure differs between processes, as one that leaves memory unwritten."""
    name = "shapeshifter"

    def available(self):
        return True, ""

    def version(self):
        return "test-0"

    def routes(self):
        return [Route(name="flashkda", recipe="flashkda", description="shapeshifter")]

    def accepts(self, problem, route):
        return True, ""

    def run(self, problem, route):
        form = open(os.environ["KDA_TEST_FORM"]).read().strip()
        t = truth(problem)
        o, fs = t.o.clone(), t.final_state.to(torch.float32).clone()
        if form == "nan":
            fs.view(-1)[0] = float("nan")
        elif form == "o":
            o = o + torch.randn(o.shape, generator=torch.Generator().manual_seed(0), dtype=o.dtype) * o.std()
        return Outputs(o=o.to(torch.bfloat16), final_state=fs, info={"route_ran": route.name})


def shapeshifter():
    return Shapeshifter()
'''


@pytest.mark.slow      # 6.5-8 s on 2 cores
def test_a_failure_that_changes_form_still_reproduces_and_a_pass_does_not(tmp_path, monkeypatch, capsys):
    """The bundle's checks hold the verdict (each judged tensor's metric against its recorded
    threshold, and its worst slice) as well as the failure's kind: shrunk while the final state
    held a NaN, the repro run where the kernel now gets o wrong instead (the state finite and
    right) reproduces, naming what fails now and what was recorded; where the kernel is right,
    it does not.  (With the kind alone, the finite check held and the repro said NOT REPRODUCED,
    exit 0, while o was off by 100%.)"""
    (tmp_path / "shapekernel.py").write_text(SHAPESHIFTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    form = tmp_path / "form"
    form.write_text("nan")
    monkeypatch.setenv("KDA_TEST_FORM", str(form))
    out = tmp_path / "b"
    assert main(["shrink", "--backend", "shapekernel:shapeshifter", "--route", "flashkda", "--case",
                 "smoke/initial-state-kv-lb-5", "--out", str(out), "--max-runs", "2"]) == 0
    data = json.loads((out / "shrink.json").read_text())
    assert data["final"]["failure"] == "final_state NaN values"
    assert data["repro_check"] == {"exit": 1, "reproduced": True, "last_line": "REPRODUCED"}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + [x for x in sys.path if x]))

    def repro():
        r = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, cwd=tmp_path,
                           env=env, timeout=300)
        return r.returncode, r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]

    form.write_text("o")
    code, last = repro()
    assert code == 1 and last.startswith("REPRODUCED in another form: now fails o ") and \
        "(the bundle recorded final_state finite" in last, (code, last)
    form.write_text("pass")
    assert repro() == (0, "NOT REPRODUCED")
    form.write_text("nan")
    assert repro() == (1, "REPRODUCED")
    failed = {(c["tensor"], c["measure"]) for c in data["checks"] if c.get("failed")}
    held = {(c["tensor"], c["measure"]) for c in data["checks"] if not c.get("failed")}
    assert ("final_state", "finite") in failed and any(t == "o" for t, _ in held), data["checks"]
