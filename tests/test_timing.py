"""Where the time goes: compile time through Triton's hooks, per-cell compile_s, the breakdown of
`kda-verify run` and `pytest -m verify` (also under xdist) in the output and the report."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kda_test_backends import write_tolerances
from verification.running import compile_time, timing
from verification.cli import main
from verification.judging.record import RESULTS_FILE, read_records
from kda_kernels.emulator import EmulatorBackend

EMULATOR_ROUTES = [r.name for r in EmulatorBackend().routes()]

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]
DENSE = "smoke/dense-T64-lb-5"


@pytest.fixture(scope="module")
def tol(tmp_path_factory):
    return write_tolerances(tmp_path_factory.mktemp("tol"))


@pytest.fixture
def hooks(monkeypatch):
    """A CompileClock installed into Triton's knobs for this test only, chained to recorders that
    stand for hooks installed before it."""
    triton = pytest.importorskip("triton")
    from triton.knobs import HookChain
    seen = {"listener": 0, "post": 0, "times": []}

    def listener(**kw):
        seen["listener"] += 1
        seen["times"].append((kw.get("cache_hit"), kw.get("times")))

    def post(**kw):
        seen["post"] += 1

    monkeypatch.setattr(triton.knobs.compilation, "listener", listener)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", post)
    monkeypatch.setattr(triton.knobs.runtime, "kernel_load_end_hook", HookChain(reversed=True))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    clock = compile_time.install(compile_time.CompileClock())
    assert clock.installed and clock.how == "measured", clock.error
    return triton, clock, seen


def _cross_compile(triton, tmp_path):
    """Compile a trivial kernel for sm90 on this machine (no GPU needed: Triton cross-compiles)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < n
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)

    def build():
        return triton.compile(ASTSource(add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64}, {}),
                              target=GPUTarget("cuda", 90, 32))
    return build


def test_a_fresh_compile_is_measured_and_a_cache_hit_is_cheap(hooks, tmp_path, monkeypatch):
    triton, clock, seen = hooks
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "cache"))      # a cold cache
    build = _cross_compile(triton, tmp_path)
    t0 = time.perf_counter()
    try:
        build()
    except Exception as e:  # noqa: BLE001 - no ptxas here: the hooks are tested below with fake calls
        pytest.skip(f"cannot cross-compile for sm90 here: {type(e).__name__}: {str(e)[:200]}")
    wall = time.perf_counter() - t0
    assert clock.compiles == 1 and 0 < clock.compile_s <= wall
    assert seen["listener"] == 1                                   # the hook installed before ours still runs
    before = clock.compile_s
    build()                                                         # Triton's disk cache: a hit
    assert clock.cache_hits == 1 and clock.compiles == 1
    # cheap by what ran, not by the seconds it took on this (maybe loaded) host: the hit ran no
    # lowering stage, and the clock added exactly the lookup Triton reported for it
    hit, times = seen["times"][-1]
    assert hit is True and not times.lowering_stages and not times.store_results, times
    assert clock.compile_s - before == pytest.approx(times.ir_initialization / 1e6, abs=1e-12)


def test_jit_launch_preparation_is_timed_from_the_compile_to_the_load(hooks):
    triton, clock, seen = hooks
    rt = triton.knobs.runtime
    jit_kw = dict(key="k", repr="k[]", fn=None, compile={}, already_compiled=False)
    t0 = time.perf_counter()
    rt.jit_post_compile_hook(is_manual_warmup=False, **jit_kw)     # as JITFunction._do_compile calls it
    time.sleep(0.05)                                                # launcher stub build + module load
    rt.kernel_load_end_hook(None, None, "k", {}, "hash")            # as CompiledKernel._init_handles calls it
    bracket = time.perf_counter() - t0
    first = clock.load_s
    assert 0.05 <= first <= bracket and seen["post"] == 1          # the span between the two hooks, however slow the host
    rt.kernel_load_end_hook(None, None, "k", {}, "hash")            # a later load of another kernel: not ours
    assert clock.load_s == first
    rt.jit_post_compile_hook(is_manual_warmup=True, **jit_kw)      # a warm-up launches nothing
    time.sleep(0.02)
    rt.kernel_load_end_hook(None, None, "k", {}, "hash")
    assert clock.load_s == first and clock.seconds == clock.compile_s + clock.load_s


def test_interpreted_triton_compiles_nothing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    clock = compile_time.CompileClock()
    assert clock.how == "interpreted"
    bd = timing.breakdown(timing.cell_sums([{"compile_s": 0.0, "compile_how": "interpreted", "kernel_s": 1.0}]), 2.0)
    assert bd["compile_s"] == 0 and bd["compile_how"] == "interpreted"
    assert any("interpreted (TRITON_INTERPRET=1)" in ln for ln in timing.format_lines(bd))


class _CompilingBackend:
    """The test backend 'exact' whose run() first compiles a fresh Triton kernel (cross-compiled)."""

    def __init__(self, build):
        from kda_test_backends import exact
        self._inner = exact()
        self.name = "test-compiling"
        self.build = build

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def run(self, problem, route):
        self.build()
        return self._inner.run(problem, route)


def test_a_cell_records_compile_s_apart_from_kernel_s(hooks, tmp_path, monkeypatch, tol):
    triton, clock, _ = hooks
    monkeypatch.setattr(compile_time, "_CLOCK", clock)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "cache"))
    build = _cross_compile(triton, tmp_path)
    try:
        build()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot cross-compile for sm90 here: {type(e).__name__}")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "cold"))     # the cell compiles afresh
    from verification.running.cases import get_case
    from verification.running.run_matrix import run_matrix
    s = run_matrix([_CompilingBackend(build)], [get_case(DENSE)], None, routes=["r1"], device="cpu",
                   tolerances_path=tol, progress_stream=open(os.devnull, "w"))
    (rec,) = s.records
    t = rec.timings
    assert rec.status == "pass" and t["compiles"] == 1 and t["compile_s"] > 0 and t["compile_how"] == "measured"
    assert t["compile_cache_hits"] == 0
    assert t["kernel_s"] >= 0
    sums = timing.cell_sums([t])
    assert sums["compile_s"] == t["compile_s"] and sums["compiles"] == 1


def test_breakdown_sums_and_other_across_xdist_workers():
    w1 = {"wall_s": 10.0, "sums": timing.cell_sums([{"oracle_s": 2.0, "oracle_cached": False, "kernel_s": 3.0},
                                                    {"oracle_s": 2.0, "oracle_cached": True, "kernel_s": 1.0}])}
    w2 = {"wall_s": 6.0, "sums": timing.cell_sums([{"oracle_s": "1.5", "oracle_cached": "False", "metrics_s": "0.5",
                                                    "compile_s": 1.0, "compile_how": "measured"}])}
    bd = timing.breakdown(timing.merge_sums([w1["sums"], w2["sums"]]), wall_s=12.0, report_s=0.5, workers=[w1, w2])
    assert bd["oracle_s"] == 3.5 and bd["oracle_runs"] == 2 and bd["kernel_s"] == 4.0 and bd["compile_s"] == 1.0
    assert bd["busy_s"] == 16.5 and bd["workers"] == 2 and bd["cells"] == 3
    assert bd["other_s"] == pytest.approx((10 - 6) + (6 - 3.0))      # each worker's time outside its cells
    assert "2 xdist workers" in timing.format_lines(bd)[0]


from verification.running.timing import CELL_PARTS as PARTS


def _check_against_records(bd, records):
    sums = timing.cell_sums(r.get("timings") for r in records)
    for p in PARTS:
        assert bd[f"{p}_s"] == pytest.approx(sums[f"{p}_s"], abs=1e-9), p
    assert bd["cells"] == len(records) and bd["other_s"] >= 0 and bd["report_s"] > 0
    assert bd["busy_s"] == pytest.approx(sum(bd[f"{p}_s"] for p in PARTS + ("report", "other")))
    return sums


def test_run_prints_the_breakdown_and_the_report_holds_it(tmp_path, capsys, tol):
    out = tmp_path / "r"
    t0 = time.perf_counter()
    rc = main(["run", "--backend", "emulator", "--suite", "smoke", "--case", "smoke/dense-*", "--case", "smoke/varlen-*",
               "--out", str(out), "--tolerances", tol, "--device", "cpu"])
    wall = time.perf_counter() - t0
    printed = capsys.readouterr().out
    assert rc == 0
    records = read_records(out / RESULTS_FILE, strict=True)
    report = json.loads((out / "report.json").read_text())
    bd = report["time_breakdown"]
    sums = _check_against_records(bd, records)
    assert sums["oracle_runs"] == 2 and bd["oracle_runs"] == 2          # one truth per case, cached for the others
    assert 0 < bd["wall_s"] <= wall
    assert "time breakdown (this invocation): wall" in printed
    for p in PARTS + ("report", "other"):
        assert f"\n  {p:<9}" in printed, p
    md = (out / "report.md").read_text()
    assert "## Where the time went" in md and "| other |" in md
    assert "Where the time went" in (out / "report.html").read_text()
    # kda-verify report DIR shows the run's breakdown again (kept in run.json)
    assert main(["report", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["time_breakdown"] == bd


@pytest.mark.slow
def test_run_isolated_counts_each_truth_once(tmp_path, capsys, tol):
    out = tmp_path / "r"
    rc = main(["run", "--backend", "emulator", "--route", "flashkda,fla", "--suite", "smoke", "--case", DENSE,
               "--out", str(out), "--tolerances", tol, "--device", "cpu", "--isolate", "--no-report"])
    assert rc == 0, capsys.readouterr().err
    records = read_records(out / RESULTS_FILE, strict=True)
    sums = timing.cell_sums(r["timings"] for r in records)
    assert sums["oracle_runs"] == 1 and sums["baseline_runs"] == 2    # computed in the parent, flagged so
    assert "2 cells" in capsys.readouterr().out


def test_pytest_ends_with_the_breakdown_and_its_report_holds_it(pytester, tmp_path, tol):
    pytester.makepyfile(test_matrix_timing=(ROOT / "tests/test_verify_matrix.py").read_text())
    rep = tmp_path / "rep"
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend", "emulator",
                                       "--kda-case", DENSE, "--kda-device", "cpu", "--kda-tolerances", tol,
                                       "--kda-report", str(rep))
    out = "\n".join(res.outlines)
    assert res.ret == 0, out
    assert "kda-verify time breakdown" in out and f"{len(EMULATOR_ROUTES)} cells" in out, out
    assert "  other " in out and "  compile " in out
    bd = json.loads((rep / "report.json").read_text())["time_breakdown"]
    _check_against_records(bd, read_records(rep / RESULTS_FILE, strict=True))
    # without a report the summary is still there (report 0)
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend", "emulator",
                                       "--kda-route", "flashkda", "--kda-case", DENSE, "--kda-device", "cpu",
                                       "--kda-tolerances", tol)
    out = "\n".join(res.outlines)
    assert "kda-verify time breakdown" in out and "no report written" in out, out
    # a run that does not expand the matrix prints none
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "not verify")
    assert "kda-verify time breakdown" not in "\n".join(res.outlines)


@pytest.mark.slow
def test_pytest_xdist_sums_the_workers(tmp_path, tol):
    pytest.importorskip("xdist")
    rep = tmp_path / "rep"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_verify_matrix.py", "-p", "no:cacheprovider", "-q",
                        "-m", "verify", "-n", "2", "--dist", "loadgroup", "--kda-backend", "emulator", "--kda-route",
                        "flashkda", "--kda-case", "smoke/dense-*", "--kda-case", "smoke/initial-*", "--kda-device", "cpu",
                        "--kda-tolerances", tol, "--kda-report", str(rep)],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kda-verify time breakdown" in r.stdout and "2 xdist workers" in r.stdout, r.stdout
    records = [rec for f in sorted(rep.glob("results-gw*.jsonl")) for rec in read_records(f, strict=True)]
    bd = json.loads((rep / "report.json").read_text())["time_breakdown"]
    assert bd["workers"] == 2 and bd["cells"] == 2
    _check_against_records(bd, records)


def test_a_clock_mark_reads_what_was_compiled_since():
    """run_cell and a serving cell read a cell's compiles as ``clock.since(clock.mark())``: the
    seconds, compiles and cache hits after the mark only; the mark drops an unfinished launch."""
    from types import SimpleNamespace
    clock = compile_time.CompileClock()
    clock.on_compile(SimpleNamespace(ir_initialization=1_000_000, store_results=0, lowering_stages=[]), cache_hit=False)
    clock._pending = 123.0
    mark = clock.mark()
    assert clock._pending is None and mark == (1.0, 1, 0)
    clock.on_compile(SimpleNamespace(ir_initialization=250_000, store_results=0, lowering_stages=[("ptx", 250_000)]),
                     cache_hit=False)
    clock.on_compile(SimpleNamespace(ir_initialization=0, store_results=0, lowering_stages=[]), cache_hit=True)
    assert clock.since(mark) == {"compile_s": 0.5, "compiles": 1, "compile_cache_hits": 1}
