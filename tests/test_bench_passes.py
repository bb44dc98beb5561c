"""`kda-verify bench --passes`: each pass of our Triton FlashKDA timed alone.  Here through
Triton's interpreter (wall time; the CUDA path times the same calls with device events)."""
import pytest

from interpreted_triton import interpreted_kernels

interpreted_kernels()

from verification import bench  # noqa: E402


@pytest.fixture(autouse=True)
def interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # the interpreter reads it at the first launch too


@pytest.mark.usefixtures("one_thread")
def test_every_pass_of_a_segmented_route_is_timed():
    t = bench.pass_times("seg:cps=1", (1, 96, 1), "cpu", reps=3, warmup=1)
    assert t["cps"] == 1 and t["segments"] == 3
    assert all(t[k] > 0 for k in ("k1", "A", "B", "C", "total")), t


@pytest.mark.usefixtures("one_thread")
def test_an_unsegmented_plan_has_k1_and_c_only():
    t = bench.pass_times("unseg:k1=halves", (1, 64, 1), "cpu", reps=3, warmup=1)
    assert t["cps"] is None and t["segments"] == 1 and "A" not in t and "B" not in t
    assert t["k1"] > 0 and t["C"] > 0 and t["total"] > 0
