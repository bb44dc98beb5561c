"""kda-verify calibrate: proposals from measurements, a diff, a valid proposal file, no rewrite."""
import hashlib
import json

import pytest

from verification.cli import main
from verification.investigating.calibrate import ceil2
from verification.judging.tolerances import parse_tolerances
from kda_kernels.emulator import EmulatorBackend

TOL = """\
# a test tolerance file
schema: 1
entries:
  # the emulator
  - backend: emulator
    route: "*"
    dtype: "*"
    tensor: "*"
    m: 1.0
    floor: 0.0
    cap: 5.0e-2
    reason: the emulator is its own baseline
    calibrated_on: by hand
  - backend: other
    route: "*"
    dtype: bf16
    tensor: o
    m: 3.0
    floor: 1.0e-4
    cap: 5.0e-2
    reason: untouched by the calibration
    calibrated_on: by hand
"""
CASE = ["--suite", "smoke", "--case", "smoke/dense-T64-lb-5", "--device", "cpu"]


def test_ceil2_rounds_up_to_two_significant_digits():
    assert ceil2(2.26) == 2.3 and ceil2(4.0) == 4.0 and ceil2(0.01231) == 0.013 and ceil2(1.0) == 1.0
    assert ceil2(9.91) == 10.0 and ceil2(3.0e-7) == 3.0e-7


def test_calibrate_proposes_a_diff_and_never_rewrites_the_file(tmp_path, capsys):
    tol = tmp_path / "tolerances.yaml"
    tol.write_text(TOL)
    digest = hashlib.sha256(tol.read_bytes()).hexdigest()
    out = tmp_path / "proposal.yaml"
    assert main(["calibrate", "--backend", "emulator", "--route", "flashkda", *CASE, "--tolerances", str(tol),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert hashlib.sha256(tol.read_bytes()).hexdigest() == digest
    # the emulator is its own baseline: worst ratio 1, so m = 2 x 1 (a loosening, flagged for a reason)
    assert "-    m: 1.0\n+    m: 2.0\n" in text
    assert '+    note: "LOOSENS m 1 -> 2: write the reason here before accepting"' in text
    assert "     cap: 5.0e-2\n" in text                 # an unchanged field keeps its text
    changed = [ln for ln in text.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    assert changed and not any("other" in ln or "untouched" in ln for ln in changed)
    prop = parse_tolerances(out.read_text(), str(out))
    (pats, entry), = prop.entries
    assert pats == ("emulator", "*", "*", "*") and entry.m == 2.0 and entry.cap == 5.0e-2
    assert "flashkda smoke/dense-T64-lb-5" in entry.reason


def test_a_cell_without_an_entry_gets_a_new_entry(tmp_path, capsys):
    tol = tmp_path / "tolerances.yaml"
    tol.write_text(TOL)
    assert main(["calibrate", "--backend", "kda_test_backends:exact", "--route", "r1", *CASE,
                 "--tolerances", str(tol), "--headroom", "3"]) == 0
    text = capsys.readouterr().out
    assert "+  - backend: test-exact\n+    route: r1\n+    dtype: bf16\n+    tensor: o\n" in text
    assert "+    tensor: final_state\n" in text
    new = "".join(ln[1:] + "\n" for ln in text.split("+++", 1)[1].splitlines()[1:] if ln.startswith(("+", " ")))
    assert "3x the worst observed ratio" in new


def test_bad_headroom_is_a_usage_error(capsys):
    assert main(["calibrate", "--backend", "emulator", *CASE, "--headroom", "0.5"]) == 2
    assert "--headroom: expected a number >= 1, got 0.5" in capsys.readouterr().err


@pytest.mark.slow
def test_from_results_reuses_an_earlier_run_and_leaves_known_failures_out(tmp_path, capsys):
    from verification.cli import main
    out = tmp_path / "run"
    assert main(["run", "--backend", "emulator", "--suite", "smoke", "--case", "smoke/correlated-weak-lb-0.01",
                 "--out", str(out), "--device", "cpu"]) == 0        # the moonshot cell is a known failure
    capsys.readouterr()
    assert main(["calibrate", "--backend", "emulator", "--from-results", str(out)]) == 0
    text = capsys.readouterr().out
    n = len(EmulatorBackend().routes())                             # one cell per recipe; moonshot's fails
    assert f"{n} cells (1 known-fail, {n - 1} pass)" in text
    assert "moonshot smoke/correlated" not in text                  # its error is not the level to expect
    # calibrated_on names the earlier run's device (a CPU run records "gpu": "none"), date and commit
    prov = json.loads((out / "run.json").read_text())["runs"][-1]
    on = [ln for ln in text.splitlines() if ln.startswith("+") and "calibrated_on:" in ln]
    assert on and all(f"CPU (cpu), {prov['time_utc'][:10]}, commit {str(prov['git']['commit'])[:10]}, suite smoke"
                      in ln for ln in on), on
    assert "no run.json" not in text
    assert main(["calibrate", "--backend", "fla", "--from-results", str(out)]) == 2
    capsys.readouterr()
    (out / "run.json").unlink()                                     # without it the records' device is all there is
    assert main(["calibrate", "--backend", "emulator", "--from-results", str(out)]) == 0
    on = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("+") and "calibrated_on:" in ln]
    assert on and all("the records' device cpu (no run.json beside them), date unknown, commit unknown" in ln
                      for ln in on), on


def test_earlier_provenance_reads_the_latest_run_and_names_its_device(tmp_path):
    from verification.investigating.calibrate import device_description, earlier_provenance
    assert earlier_provenance(str(tmp_path)) is None                 # no run.json
    (tmp_path / "run.json").write_text("{not json")
    assert earlier_provenance(str(tmp_path)) is None
    runs = [{"time_utc": "2026-11-30T10:00:00Z", "device": {"device": "cuda", "gpu": "NVIDIA H200"}},
            {"time_utc": "2026-12-01T10:00:00Z", "device": {"device": "cpu", "type": "cpu", "gpu": "none"}}]
    (tmp_path / "run.json").write_text(json.dumps({"runs": runs}))
    assert earlier_provenance(str(tmp_path))["time_utc"].startswith("2026-12-01")
    assert device_description(runs[0]["device"]) == "NVIDIA H200"
    assert device_description(runs[1]["device"]) == "CPU (cpu)"
    assert device_description({"type": "cpu", "gpu": None}) == "CPU (cpu)"
