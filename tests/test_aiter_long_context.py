"""tools/aiter_long_context.py: a row is written after the truth and after each recipe (a long T
stopped midway keeps what it measured), with a progress line on stderr at each; the plot takes
partial rows; bad input is one line, exit 2."""
import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "aiter_long_context.py"
spec = importlib.util.spec_from_file_location("aiter_long_context", TOOL)
alc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(alc)

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def test_rows_are_written_as_they_come_and_a_partial_row_plots(tmp_path, capsys, monkeypatch):
    out = tmp_path / "rows.json"
    seen = []
    real = alc.measure

    def spy(T, lb, state, emit):
        def emit_and_read(row):
            emit(row)
            seen.append(json.loads(out.read_text())[-1]["done"])
        return real(T, lb, state, emit_and_read)
    monkeypatch.setattr(alc, "measure", spy)
    assert alc.main(["--T", "128", "--lb=-5", "--out", str(out)]) == 0
    assert seen == [[], ["aiter-gfx1250"], ["aiter-gfx1250", "aiter-gfx1250-fp32op"],
                    ["aiter-gfx1250", "aiter-gfx1250-fp32op", "aiter-gfx950"]]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and err[0].endswith(tuple(f"truth done, {s} s" for s in range(0, 60))), err
    (row,) = json.loads(out.read_text())
    assert row["T"] == 128 and row["lb"] == -5 and 1e-3 < row["aiter-gfx1250"]["o"] < 1e-2
    # a row stopped after the truth and one recipe still plots
    partial = dict(row, T=256, done=["aiter-gfx1250"])
    for name in ("aiter-gfx1250-fp32op", "aiter-gfx950"):
        partial.pop(name)
    out.write_text(json.dumps([row, partial]))
    assert alc.main(["--plot", str(out), "--png", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, line", [(["--T", "1k", "--out", "x.json"], "--T: expected comma-separated integers"),
                                        (["--T", "64", "--lb=-1", "--out", "x.json"], "--lb: expected some of -0.05, -5"),
                                        (["--T", "64"], "--out: expected a JSON file")])
def test_bad_input_is_one_line_exit_2(argv, line, capsys):
    assert alc.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err
