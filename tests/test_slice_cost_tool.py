"""tools/device/slice_cost.py on the CPU: its "without slices" timings are taken with the slices
really left out of tensor_metrics (a stub of a function tensor_metrics no longer calls would time
the slices twice and report a share of about 0)."""
import importlib.util
from pathlib import Path

import verification.judging.metrics as metrics

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("slice_cost", ROOT / "tools" / "device" / "slice_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_timings_without_slices_have_no_slices(monkeypatch, capsys):
    real = metrics.tensor_metrics
    seen = []

    def spy(*args, **kwargs):
        m = real(*args, **kwargs)
        seen.append("slices" in m)
        return m

    monkeypatch.setattr(metrics, "tensor_metrics", spy)
    assert _tool().main(["--device", "cpu", "--shapes", "1x128x1", "--reps", "1"]) == 0
    assert seen.count(True) == 2 and seen.count(False) == 2, seen
    assert metrics._slices_pending.__name__ == "_slices_pending"          # the stub was taken back
    assert "1x128x1" in capsys.readouterr().out
