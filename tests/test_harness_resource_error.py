"""A harness out-of-memory (oracle, baseline, case build, judging) is retried once with the
cache emptied, and if it persists the cell is a resource-error: never a kernel failure, never a
pass.  Out-of-memory errors are planted with monkeypatch on the CPU."""
import importlib

import pytest
import torch

from verification.running import run_select
from verification.running.cases import get_case
from verification.judging.policy import FAILING, JUDGED, RESOURCE_ERROR
from verification.judging.baselines import BaselineCache
from verification.running.run_cell import TruthCache, harness_call, is_out_of_memory, run_cell
from verification.judging.tolerances import load_tolerances

truth_mod = importlib.import_module("kda_ref.truth")     # the module (kda_ref.truth is also the function)

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

CASE = "smoke/dense-T64-lb-5"


def _oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(_oom()) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))


def test_harness_call_retries_once_and_only_an_out_of_memory():
    calls = []

    def once_short():
        calls.append(1)
        if len(calls) == 1:
            raise _oom()
        return "ok"

    assert harness_call(once_short, "cpu") == "ok" and len(calls) == 2
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):
        harness_call(lambda: calls.append(1) or (_ for _ in ()).throw(_oom()), "cpu")
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(ValueError):
        harness_call(lambda: calls.append(1) or (_ for _ in ()).throw(ValueError("bad")), "cpu")
    assert len(calls) == 1


def _cell(monkeypatch, fail_times: int, where: str):
    """Run the emulator's flashkda route on one smoke case with ``where`` running out of memory
    on its first ``fail_times`` calls."""
    counter = {"n": 0}

    def planted(real):
        def f(*a, **k):
            counter["n"] += 1
            if counter["n"] <= fail_times:
                raise _oom()
            return real(*a, **k)
        return f

    if where == "oracle":
        monkeypatch.setattr(truth_mod, "truth", planted(truth_mod.truth))
    elif where == "baseline":
        import verification.judging.baselines as baselines
        monkeypatch.setattr(baselines, "baseline_metrics", planted(baselines.baseline_metrics))
    elif where == "judging":
        import verification.judging.verdict as verdict
        monkeypatch.setattr(verdict, "judge", planted(verdict.judge))
    elif where == "build":
        import verification.running.cases as cases
        monkeypatch.setattr(cases, "build_problem", planted(cases.build_problem))
    lb = run_select.load("emulator")
    route = run_select.resolve_routes(lb, ["flashkda"])[0]
    return run_cell(lb, route, get_case(CASE), TruthCache("cpu"), BaselineCache(), load_tolerances(), "cpu"), counter["n"]


@pytest.mark.parametrize("where", ["oracle", "baseline", "judging", "build"])
def test_an_out_of_memory_that_persists_is_a_resource_error(monkeypatch, where):
    rec, calls = _cell(monkeypatch, 10 ** 6, where)
    assert rec.status == RESOURCE_ERROR and calls == 2
    assert RESOURCE_ERROR not in FAILING and RESOURCE_ERROR not in JUDGED and rec.status != "pass"
    assert rec.reason.startswith("harness out of memory in ") and "not a kernel result" in rec.reason
    assert "OutOfMemoryError" in rec.reason


@pytest.mark.parametrize("where", ["oracle", "baseline", "judging", "build"])
def test_one_out_of_memory_is_retried_and_the_cell_judged(monkeypatch, where):
    rec, calls = _cell(monkeypatch, 1, where)
    assert rec.status in JUDGED and rec.status != RESOURCE_ERROR, rec.reason


def test_another_harness_exception_stays_an_error(monkeypatch):
    def broken(*a, **k):
        raise ValueError("oracle broke")

    monkeypatch.setattr(truth_mod, "truth", broken)
    lb = run_select.load("emulator")
    route = run_select.resolve_routes(lb, ["flashkda"])[0]
    rec = run_cell(lb, route, get_case(CASE), TruthCache("cpu"), BaselineCache(), load_tolerances(), "cpu")
    assert rec.status == "error" and "oracle/baseline raised ValueError" in rec.reason


def test_a_run_with_a_resource_error_and_no_failure_exits_2():
    from verification.judging.record import Record
    from verification.running.run_progress import RunSummary
    s = RunSummary(out_dir=None)
    s.records = [Record(status="pass"), Record(status="resource-error")]
    assert s.exit_code == 2
    s.records = [Record(status="fail"), Record(status="resource-error")]
    assert s.exit_code == 1
    s.records = [Record(status="pass")]
    assert s.exit_code == 0


def _kernel_cell(monkeypatch, fail_times: int):
    """The emulator's flashkda route on one smoke case, its run out of memory ``fail_times`` times."""
    from kda_kernels.emulator import EmulatorBackend
    counter = {"n": 0}
    monkeypatch.undo()                      # the real run, not an earlier call's planted one
    real = EmulatorBackend.run

    def run(self, problem, route):
        counter["n"] += 1
        if counter["n"] <= fail_times:
            raise _oom()
        return real(self, problem, route)

    monkeypatch.setattr(EmulatorBackend, "run", run)
    lb = run_select.load("emulator")
    route = run_select.resolve_routes(lb, ["flashkda"])[0]
    return run_cell(lb, route, get_case(CASE), TruthCache("cpu"), BaselineCache(), load_tolerances(), "cpu"), counter["n"]


def test_a_kernel_out_of_memory_is_retried_once_and_then_an_error_naming_it(monkeypatch):
    rec, _ = _kernel_cell(monkeypatch, 1)
    assert rec.status in JUDGED and rec.timings["kernel_oom_retried"] == 1, rec.reason
    rec, calls = _kernel_cell(monkeypatch, 10 ** 6)
    assert calls == 2 and rec.status == "error"
    assert "out of memory twice" in rec.reason and "OutOfMemoryError" in rec.reason
    rec, _ = _kernel_cell(monkeypatch, 0)
    assert rec.status in JUDGED and "kernel_oom_retried" not in rec.timings
