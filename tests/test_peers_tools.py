"""tools/device/peer_checks.py and peers_summary.py (the NVIDIA peers job's helpers) on the CPU."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "device" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_names_every_failing_cell_control_and_invariance(tmp_path, capsys):
    d = tmp_path / "cudnn" / "matrix"
    d.mkdir(parents=True)
    recs = [dict(backend="cudnn", route="hopper_cuda", case="smoke/dense-T64-lb-5", status="pass",
                 backend_version="nvidia-cudnn-frontend 1.32.0 (recipe cudnn-sm90)"),
            dict(backend="cudnn", route="hopper_cuda", case="stress/tail17-lb-1", status="fail",
                 backend_version="nvidia-cudnn-frontend 1.32.0 (recipe cudnn-sm90)", reason="o: rel_l2 0.5 > 0.01")]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = [dict(backend="cudnn", route="hopper_cuda", what="control", name="carry_scaled", case="stress/weak-gate-lb-1",
                 caught=True, control_status="fail", failing=["final_state"], changes_recipe=True, kernel_status="pass"),
            dict(backend="cudnn", route="hopper_cuda:batch_invariant", what="invariance", name="batch_slice",
                 shape="batch", ok=False, kind="bitwise", diff=12.0)]
    (tmp_path / "cudnn" / "checks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bench.json").write_text(json.dumps({"results": [dict(backend="cudnn", route="hopper_cuda", B=1, T=2048,
                                                                      H=12, time_us=61.5, error="")]}))
    assert _tool("peers_summary").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| cudnn | hopper_cuda | fail | 1 |" in out and "versions: nvidia-cudnn-frontend 1.32.0" in out
    assert "- fail: cudnn hopper_cuda stress/tail17-lb-1: o: rel_l2 0.5 > 0.01" in out
    assert "control carry_scaled on stress/weak-gate-lb-1: caught (fail, failing final_state); kernel pass" in out
    assert "invariance batch_slice (batch): VIOLATED bitwise diff 12.0" in out
    assert "| cudnn | hopper_cuda | 1x2048x12 | 61.5 |  |" in out


def test_summary_of_no_directory_is_one_line_exit_2(tmp_path, capsys):
    assert _tool("peers_summary").main([str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_peer_checks_bad_input_is_one_line_exit_2(capsys):
    pc = _tool("peer_checks")
    assert pc.main(["--backend", "emulator", "--route", "nope", "--device", "cpu"]) == 2
    assert pc.main(["--backend", "emulator", "--what", "mutants", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("--route: expected routes of emulator (") and err[0].endswith("got 'nope'")
    assert err[1] == "--what: expected controls and/or invariances, got 'mutants'"


def test_an_unavailable_backend_is_one_line_saying_why(capsys):
    import pytest
    try:
        import cudnn  # noqa: F401
        pytest.skip("cudnn is importable here: nothing to refuse")
    except ImportError:
        pass
    assert _tool("peer_checks").main(["--backend", "cudnn", "--device", "cpu"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["what"] == "backend" and row["available"] is False
    assert row["status"].startswith("cuDNN frontend's KDA is not importable")
