"""The compile warm-up of xdist workers (verification/running/warmup.py), with a fake compiler: every
variant is compiled once over the workers instead of once per worker, and nothing waits forever."""
import threading
import time
from types import SimpleNamespace

import pytest

from verification.running import warmup
from verification.running.cases import get_suite


def _lb(name, available=True):
    return SimpleNamespace(name=name, available=available)


def _route(name):
    return SimpleNamespace(name=name)


def _cells(backends=("triton", "fla"), routes=("seg", "unseg"), suites=("smoke", "stress", "k3-prefill")):
    cases = [c for s in suites for c in get_suite(s)]
    return [(_lb(b), _route(r), c) for c in cases for b in backends for r in routes]


def test_one_variant_per_backend_route_and_signature_on_its_smallest_case():
    cells = _cells()
    vs = warmup.variants(cells)
    keys = [(lb.name, r.name, warmup.signature(c)) for lb, r, c in vs]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(lb.name, r.name, warmup.signature(c)) for lb, r, c in cells}
    for lb, r, c in vs:
        same = [x for _, _, x in cells if warmup.signature(x) == warmup.signature(c)]
        assert warmup._size(c) == min(warmup._size(x) for x in same)
    assert [k for k in map(repr, keys)] == [k for k in map(repr, [(lb.name, r.name, warmup.signature(c))
                                                                  for lb, r, c in warmup.variants(cells[::-1])])]


def test_backends_that_compile_nothing_and_unavailable_ones_are_left_out():
    cells = [(_lb("moonshot"), _route("cutlass"), c) for c in get_suite("smoke")]
    cells += [(_lb("aiter", available=False), _route("seg"), c) for c in get_suite("smoke")]
    assert warmup.variants(cells) == []


def test_the_signature_tells_t_divisible_by_16_and_the_short_case_keeps_it():
    d = {c.name: c for c in get_suite("default")}
    a, b = d["B2-T2664-H12"], d["B1-T2048-H12"]
    assert warmup.signature(a) != warmup.signature(b)             # 2664 = 16 * 166 + 8
    for c in d.values():
        short = warmup.shortened(c)
        assert warmup.signature(short) == warmup.signature(c)
        assert short.params.get("T", 0) <= warmup.SHORT_T + 64


@pytest.mark.parametrize("workers", [1, 2, 3, 16])
def test_shares_are_disjoint_and_cover_everything(workers):
    items = list(range(37))
    shares = [warmup.share(items, i, workers) for i in range(workers)]
    assert sorted(x for s in shares for x in s) == items
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_the_barrier_gives_up_after_its_timeout(tmp_path):
    t0 = time.perf_counter()
    waited = warmup.barrier(tmp_path / "b", "gw0", 2, timeout_s=0.3)
    assert 0.3 <= waited < 2 and time.perf_counter() - t0 < 2


def _session(tmp_path, workers, warm, monkeypatch):
    """W fake workers (threads) over the same cells: optionally the warm-up, then each its own
    cases' cells (as --dist loadgroup gives them); a fake Triton disk cache shared by all."""
    monkeypatch.setenv("KDA_VERIFY_WARMUP_WAIT_S", "30")
    cells = _cells()
    disk, compiled, lock = set(), [], threading.Lock()

    def launch(lb, route, case):                # what a kernel call does to Triton's caches
        key = (lb.name, route.name, warmup.signature(case))
        with lock:
            if key in disk:
                return
        time.sleep(0.002)                       # compiling
        with lock:
            compiled.append(key)
            disk.add(key)

    case_ids = sorted({c.id for _, _, c in cells})
    results = {}

    def worker(i):
        wid = f"gw{i}"
        if warm:
            results[wid] = warmup.warm_up(cells, wid, workers, "run1", "cpu", call=launch, root=tmp_path)
        mine = set(case_ids[i::workers])
        for lb, route, case in cells:
            if case.id in mine:
                launch(lb, route, case)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return compiled, warmup.variants(cells), results


def test_with_the_warm_up_every_variant_compiles_once(tmp_path, monkeypatch):
    compiled, vs, results = _session(tmp_path, 4, True, monkeypatch)
    assert len(compiled) == len(set(compiled)) == len(vs)
    assert sum(r["mine"] for r in results.values()) == len(vs)
    assert all(r["variants"] == len(vs) and r["wait_s"] < 30 for r in results.values())


def test_the_warm_up_ignores_a_kernel_that_raises():
    calls = []

    def call(lb, route, case):
        calls.append(case.id)
        raise RuntimeError("the cell records this, not the warm-up")

    todo = warmup.variants(_cells(suites=("smoke",)))
    assert warmup.run_share(todo, call) == 0 and len(calls) == len(todo)


def test_opt_in_only_and_never_for_one_worker(monkeypatch):
    """The warm-up slowed the H200 matrix and poisoned workers (module docstring): off unless asked."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KDA_VERIFY_WARMUP", raising=False)
    assert not warmup.enabled(16) and not warmup.enabled(1)
    monkeypatch.setenv("KDA_VERIFY_WARMUP", "off")
    assert not warmup.enabled(16)
    monkeypatch.setenv("KDA_VERIFY_WARMUP", "on")
    assert warmup.enabled(16) and not warmup.enabled(1)


def test_the_breakdown_counts_the_warm_up_in_compile():
    from verification.running import timing
    sums = timing.add_warmup(timing.cell_sums([{"compile_s": 1.0, "compiles": 2}]),
                             {"variants": 9, "mine": 3, "s": 4.0, "wait_s": 1.5, "compiles": 3, "compile_s": 3.5})
    bd = timing.breakdown(timing.merge_sums([sums]), wall_s=10.0)
    assert bd["compile_s"] == 4.5 and bd["compiles"] == 5 and bd["warmup_variants"] == 3
    line = next(ln for ln in timing.format_lines(dict(bd, compile_how="measured")) if ln.strip().startswith("compile"))
    assert "warm-up: 3 variants, 3 compiles" in line


@pytest.mark.slow
def test_xdist_workers_warm_up_their_shares_and_the_breakdown_says_so(tmp_path):
    """The plugin's wiring in a real -n 2 session (the warm-up forced on: the test backend compiles
    nothing, but each worker still runs its share before its cells)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kda_test_backends import write_tolerances
    pytest.importorskip("xdist")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, KDA_VERIFY_WARMUP="on", KDA_VERIFY_WARMUP_WAIT_S="120",
               PYTHONPATH=os.pathsep.join([str(root / "tests"), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "tests/test_verify_matrix.py", "-p", "no:cacheprovider", "-q",
           "-m", "verify", "-n", "2", "--dist", "loadgroup", "--kda-backend", "kda_test_backends:exact",
           "--kda-suite", "smoke", "--kda-device", "cpu", "--kda-tolerances", write_tolerances(tmp_path)]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    from kda_test_backends import exact
    expected = len({warmup.signature(c) for c in get_suite("smoke")}) * len(exact().routes())
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("compile"))
    assert f"warm-up: {expected} variants" in line, r.stdout
