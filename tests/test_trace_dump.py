"""Trace dumps: ``kda-verify capture --suite serving`` writes one, ``kda-verify check DUMP`` judges it
with run's serving judge (verification/serving/dump.py, docs/traces.md "Dumps")."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kda_ref.trace import load_trace, save_trace
from verification.cli import main
from verification.serving.dump import MANIFEST, STEP_FILES, TRACE_FILE

CASE = "serving/short-prompts"
PAIR = ["--backend", "emulator", "--route", "flashkda", "--decode-route", "fla-recurrent"]


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump") / "d"
    assert main(["capture", "--suite", "serving", *PAIR, "--case", CASE, "--out", str(d)]) == 0
    return d


def _copy(dump, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(dump, d)
    return d


def _step(d, s):
    f = d / STEP_FILES.format(s)
    return f, load_file(str(f))


def test_capture_then_check_passes_with_runs_verdict_line(dump, capsys):
    man = json.loads((dump / MANIFEST).read_text())
    assert man["format"] == "kda-verify-trace-dump/1" and man["steps"] == load_trace(str(dump / TRACE_FILE)).steps
    capsys.readouterr()
    assert main(["check", str(dump)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("pass       emulator flashkda+fla-recurrent serving/short-prompts"), out
    assert out[1] == "VERIFIED 1 of 1 cells: 1 pass"


def test_a_changed_element_outside_the_written_slots_fails_naming_step_and_slot(dump, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    f, t = _step(d, 3)
    tr = load_trace(str(d / TRACE_FILE))
    written = {int(x) for x in tr.state_indices[int(tr.step_rows[3]):int(tr.step_rows[4])].flatten()}
    assert 0 not in written                                   # slot 0 is the NULL block, never written
    i = tr.cache.offset + 5                                   # an element of slot 0
    t["decode.index"] = torch.cat([t["decode.index"], torch.tensor([i])])
    t["decode.values"] = torch.cat([t["decode.values"], torch.tensor([1.5])])
    save_file(t, str(f))
    capsys.readouterr()
    assert main(["check", str(d)]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("fail ") and "step 3" in line and "slot 0" in line, line
    assert "1 element(s) of the pad slot (NULL block) slot 0 changed" in line, line


def test_a_corrupted_written_slot_fails_naming_the_slot(dump, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    f, t = _step(d, 3)
    t["decode.values"][:1000] += 1.0                            # the first written slot's first 1000 elements
    save_file(t, str(f))
    tr = load_trace(str(d / TRACE_FILE))
    first = int(t["decode.index"][0] - tr.cache.offset) // tr.cache.stride
    capsys.readouterr()
    assert main(["check", str(d)]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert f"state slot {first} step 3" in line, line


def test_a_corrupted_o_row_fails_naming_request_and_step(dump, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    f, t = _step(d, 5)
    t["decode.o"][0, 0] += 1.0                                  # the decode call's first row
    save_file(t, str(f))
    tr = load_trace(str(d / TRACE_FILE))
    r0 = int(tr.step_rows[5])
    req = int(tr.row_request[r0])
    capsys.readouterr()
    assert main(["check", str(d)]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert f"o request {req} step 5 (decode" in line, line


@pytest.mark.parametrize("damage, expect", [
    ("no-step", "step-000004.safetensors: expected step 4's calls, got no such file"),
    ("o-shape", "step-000004.safetensors: expected 'decode.o' a float tensor [1, 4, 2, 128] (step 4's decode call), got"),
    ("manifest", "manifest.json: expected format 'kda-verify-trace-dump/1', got 'x'"),
    ("initial", "cache-initial.safetensors: expected the buffer verification.serving.execute.fresh_cache makes"),
    ("index", "step-000004.safetensors: expected 'decode.index' int64 [n] in [0, "),
])
def test_bad_dump_files_are_one_line_exit_2(dump, tmp_path, capsys, damage, expect):
    d = _copy(dump, tmp_path)
    f, t = _step(d, 4)
    if damage == "no-step":
        f.unlink()
    elif damage == "o-shape":
        t["decode.o"] = t["decode.o"][:, :2].contiguous()
        save_file(t, str(f))
    elif damage == "manifest":
        m = json.loads((d / MANIFEST).read_text())
        m["format"] = "x"
        (d / MANIFEST).write_text(json.dumps(m))
    elif damage == "initial":
        c = load_file(str(d / "cache-initial.safetensors"))
        c["cache"][0] = 0.25
        save_file(c, str(d / "cache-initial.safetensors"))
    elif damage == "index":
        t["decode.index"][0] = -3
        save_file(t, str(f))
    capsys.readouterr()
    assert main(["check", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


def test_a_recorded_trace_round_trips_bitwise(dump, tmp_path, capsys):
    """save -> load of the case's trace is bitwise, and a capture from the saved file writes the
    same dump, bit for bit, as the capture from the case; check passes on it."""
    tr = load_trace(str(dump / TRACE_FILE))
    f = tmp_path / "rec.safetensors"
    save_trace(str(f), tr)
    back = load_trace(str(f))
    a, b = load_file(str(dump / TRACE_FILE)), load_file(str(f))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                                                        b[k].view(torch.uint8) if b[k].is_floating_point() else b[k]), k
    assert back.cache == tr.cache
    d = tmp_path / "d2"
    assert main(["capture", "--suite", "serving", *PAIR, "--inputs", str(f), "--out", str(d)]) == 0
    for s in range(tr.steps):
        x, y = load_file(str(dump / STEP_FILES.format(s))), load_file(str(d / STEP_FILES.format(s)))
        assert x.keys() == y.keys(), s
        for k in x:
            assert torch.equal(x[k].view(torch.uint8) if x[k].is_floating_point() else x[k],
                               y[k].view(torch.uint8) if y[k].is_floating_point() else y[k]), (s, k)
    capsys.readouterr()
    assert main(["check", str(d)]) == 0


def test_dense_check_still_needs_inputs_and_outputs(capsys):
    assert main(["check", "--inputs", "p.safetensors"]) == 2
    assert "--outputs: expected with --inputs" in capsys.readouterr().err
