"""Isolation: one child process per cell (``kda-verify run --isolate``).

The parent computes each case's truth and baselines once (TruthCache / BaselineCache) and hands
them, with the Problem, to a child (``python -m verification.running.run_isolated --child SPEC.pt
RECORD.json``) through a file; the child runs and judges the cell (verification.running.run_cell.run_cell)
and writes its Record as JSON.  A kernel that kills its process (illegal memory access, abort,
``os._exit``) is recorded as ``crashed`` with the tail of its stderr, and the run goes on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from kda_kernels.base import applicable
from kda_ref.truth import Truth
from verification.judging.baselines import BaselineCache
from verification.judging.policy import DEFAULT_RECIPE
from verification.judging.record import Record, scalar_metrics
from verification.judging.tolerances import load_tolerances
from verification.running.room import no_room
from verification.running.run_cell import (STDERR_TAIL_CHARS, TruthCache, _base_record, _errored, _resource_errored,
                                   _set_problem, harness_call, is_out_of_memory, run_cell, use_device)
from verification.running.run_select import LoadedBackend, load


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


class IsolatedRunner:
    """Runs cells in child processes.  The parent computes each case's truth and baselines
    once (TruthCache / BaselineCache) and writes them, with the Problem, to one file per
    case under a private temporary directory; each child loads that file, runs the kernel
    and judges it, and writes its record to a file.  A child that dies leaves no record:
    the cell is "crashed", with its exit signal or code and the tail of its stderr."""

    def __init__(self, truth_cache: TruthCache, baseline_cache: BaselineCache,
                 tolerances_path: Optional[str] = None, timeout_s: Optional[float] = None,
                 guards: Optional[bool] = None):
        self.guards = guards
        self.truth_cache = truth_cache
        self.baseline_cache = baseline_cache
        self.tolerances_path = tolerances_path
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="kda-verify-isolate-")
        self._case_files: dict[str, Path] = {}

    def close(self):
        self._tmp.cleanup()

    def _case_file(self, case) -> tuple[Path, float]:
        problem, truth, oracle_s, _ = self.truth_cache.get(case)
        path = self._case_files.get(case.id)
        if path is None:
            for old in self._case_files.values():  # case-major: the previous case is done
                old.unlink(missing_ok=True)
            self._case_files.clear()
            path = Path(self._tmp.name) / f"case-{len(os.listdir(self._tmp.name))}.pt"
            # the Problem is saved as it is (torch.save keeps views, strides and devices)
            torch.save({"problem": problem, "truth": _cpu(truth.tensors()), "oracle_s": oracle_s}, path)
            self._case_files[case.id] = path
        return path, oracle_s

    def run(self, lb: LoadedBackend, route, case, device: str) -> Record:
        rec0 = _base_record(lb, route, case, device)
        if not lb.available or no_room(case, device) is not None:
            return run_cell(lb, route, case, self.truth_cache, self.baseline_cache, None, device)
        try:
            problem = self.truth_cache.problem(case)
            ok, why = applicable(lb.backend, problem, route)
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"accepts() raised {type(e).__name__}: {e}"
        if not ok:
            return run_cell(lb, route, case, self.truth_cache, self.baseline_cache, None, device)
        try:
            truths_before = self.truth_cache.computed.get(case.id, 0)
            case_file, oracle_s = harness_call(lambda: self._case_file(case), device)
            oracle_fresh = self.truth_cache.computed.get(case.id, 0) > truths_before
            problem, truth, _, _ = self.truth_cache.get(case)
            recipe = getattr(route, "recipe", None) or DEFAULT_RECIPE
            baseline, base_s, base_fresh = harness_call(
                lambda: self.baseline_cache.get(case, recipe, problem, truth), device)
        except Exception as e:  # noqa: BLE001
            if is_out_of_memory(e):
                return _resource_errored(rec0, e, "oracle/baseline", device)
            return _errored(rec0, e, "oracle/baseline")
        # computed here, in the parent, or not (the child sees both as cached)
        fresh = {"oracle_s": oracle_s, "oracle_cached": not oracle_fresh,
                 "baseline_s": base_s, "baseline_cached": not base_fresh}
        tmp = Path(self._tmp.name)
        spec_path = tmp / "cell.pt"
        out_path = tmp / "record.json"
        out_path.unlink(missing_ok=True)
        torch.save({"backend_spec": lb.spec, "route": route, "case": case, "case_file": str(case_file),
                    "baseline": _cpu(baseline), "baseline_s": base_s, "device": device,
                    "tolerances_path": self.tolerances_path, "guards": self.guards}, spec_path)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", "verification.running.run_isolated", "--child", str(spec_path), str(out_path)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=self.timeout_s,
                                  errors="replace")
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        wall = time.perf_counter() - t0
        if rc == 0 and out_path.exists():
            rec = Record.from_json(out_path.read_text())
            rec.timings["child_wall_s"] = wall
            rec.timings.update(fresh)
            return rec
        if rc is None:
            how = f"timed out after {self.timeout_s:g} s (killed)"
        elif rc < 0:
            try:
                how = f"killed by signal {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
        else:
            how = f"exited with code {rc} without a record"
        tail = (err or "").strip()[-STDERR_TAIL_CHARS:]
        last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
        rec0.status = "crashed"
        rec0.reason = f"child process {how}" + (f": {last.strip()[:200]}" if last else "")
        rec0.stderr_tail = tail
        _set_problem(rec0, case, problem)
        rec0.baseline = scalar_metrics(baseline)
        rec0.timings = dict(fresh, child_wall_s=wall)
        return rec0


def _child_main(spec_path: str, out_path: str) -> int:
    """The isolated cell: load what the parent prepared, run, judge, write the record."""
    spec = torch.load(spec_path, weights_only=False)
    device = spec["device"]
    use_device(device)
    data = torch.load(spec["case_file"], weights_only=False, map_location=device)
    problem = data["problem"]
    truth = Truth(**{k: v.to(device) for k, v in data["truth"].items()
                     if k in ("o", "final_state", "state_cache")})
    extras = {k: v.to(device) for k, v in data["truth"].items() if k not in ("o", "final_state", "state_cache")}
    truth.extras.update(extras)
    case = spec["case"]
    tc = TruthCache(device=device)
    tc.prime(case, problem, truth, data["oracle_s"])
    bc = BaselineCache()
    bc.prime(case.id, getattr(spec["route"], "recipe", None) or DEFAULT_RECIPE, spec["baseline"], spec["baseline_s"])
    lb = load(spec["backend_spec"])
    db = load_tolerances(spec["tolerances_path"])
    rec = run_cell(lb, spec["route"], case, tc, bc, db, device, guards=spec.get("guards"))
    rec.isolated = True
    Path(out_path).write_text(rec.to_json())
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2], sys.argv[3]))
    print("usage: python -m verification.running.run_isolated --child SPEC.pt RECORD.json (used by kda-verify run --isolate)",
          file=sys.stderr)
    sys.exit(2)
