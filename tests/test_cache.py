"""The disk cache of truths and baselines (verification/running/cache.py): hits are bit for bit what a
fresh computation gives, every change of problem or code misses, concurrent writers leave complete
entries, the size bound holds and the off switch is off."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verification.running import cache
from verification.judging.baselines import BaselineCache
from verification.running.cases import get_case
from verification.running.run_cell import TruthCache

CASE = "smoke/dense-T64-lb-5"
PAGED = "smoke/paged-lb-5"


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """The cache on, in a directory of this test's own."""
    monkeypatch.setenv("KDA_VERIFY_CACHE", "on")
    monkeypatch.setenv("KDA_VERIFY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KDA_VERIFY_CACHE_GB", raising=False)
    return tmp_path / "cache"


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _same_bits(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert _bits(a[k]) == _bits(b[k]), k          # NaN slots of a paged cache included


def _entries(d: Path, kind: str) -> list:
    return sorted((d / f"v{cache.FORMAT}" / kind).rglob("*.pt"))


@pytest.mark.parametrize("case_id", [CASE, PAGED])
def test_a_second_process_loads_the_truth_bit_for_bit(disk, case_id):
    from kda_ref.truth import truth
    case = get_case(case_id)
    first = TruthCache()
    p1, t1, s1, fresh1 = first.get(case)
    assert fresh1 and first.computed == {case.id: 1} and not first.loaded
    assert len(_entries(disk, "truth")) == 1
    second = TruthCache()                          # another worker, or the next run
    p2, t2, s2, fresh2 = second.get(case)
    assert not fresh2 and second.computed == {} and second.loaded == {case.id: 1} and s2 == 0.0
    _same_bits(t2.tensors(), truth(case.build()).tensors())      # what a recomputation gives
    _same_bits(t2.tensors(), t1.tensors())


def test_baselines_hit_and_equal_the_computed_ones(disk):
    case = get_case(CASE)
    p, t, _, _ = TruthCache().get(case)
    a = BaselineCache()
    m1, _, fresh1 = a.get(case, "flashkda", p, t)
    b = BaselineCache()
    m2, s2, fresh2 = b.get(case, "flashkda", p, t)
    assert fresh1 and not fresh2 and s2 == 0.0 and b.loaded == {(case.id, "flashkda"): 1}
    assert m2 == m1                                # floats, lists and flags: equal values
    m3, _, fresh3 = b.get(case, "fla", p, t)       # another recipe: its own entry
    assert fresh3 and m3 != m1


def test_every_input_and_option_is_in_the_key(disk):
    case = get_case(CASE)
    p = case.build()
    k0 = cache.truth_key(p, case)
    assert cache.truth_key(case.build(), case) == k0                    # a rebuild is the same problem
    assert cache.truth_key(p.replace(lower_bound=-4.0), case) != k0     # an option
    assert cache.truth_key(p.replace(output_final_state=False), case) != k0
    v = p.v.clone()
    v.view(-1)[7] = v.view(-1)[7] * 2 + 1                               # one element of one tensor
    assert cache.truth_key(p.replace(v=v), case) != k0
    other = get_case("smoke/varlen-tail33-lb-5")
    assert cache.truth_key(other.build(), other) != k0
    assert cache.baseline_key(p, "flashkda", case) != cache.baseline_key(p, "fla", case)


def test_a_large_tensor_is_sampled_and_its_ends_are_hashed(monkeypatch):
    monkeypatch.setattr(cache, "FULL_HASH_BYTES", 1024)
    monkeypatch.setattr(cache, "SAMPLED_BYTES", 256)
    x = torch.arange(10_000, dtype=torch.float32)
    base = cache._tensor_bytes(x)
    assert len(base) < x.numel() * 4
    for i in (0, 9_999):                       # the first and last elements are always in
        y = x.clone()
        y[i] = -1
        assert cache._tensor_bytes(y) != base


def test_sampling_a_tensor_of_more_than_2_to_the_24_elements_stays_in_bounds(monkeypatch):
    """The sample's indices are exact integers: a float32 linspace rounded n - 1 up to n for
    n > 2**24 (the H200 matrix's default/B1-T8192-H64 inputs, 67M elements), an index out of
    bounds that a GPU raises as a device-side assert, killing the worker's CUDA context."""
    monkeypatch.setattr(cache, "FULL_HASH_BYTES", 1024)
    n = 2 ** 26                                # 8192 x 64 x 128: float32 rounds n - 1 to n
    x = torch.zeros(n, dtype=torch.uint8)
    x[-2] = 7                                  # the ends and the spaced sample both see the tail
    out = cache._tensor_bytes(x)
    assert len(out) <= cache.SAMPLED_BYTES + 2 * (cache.SAMPLED_BYTES // 8) + 8
    assert cache._tensor_bytes(x) == out and out != cache._tensor_bytes(torch.zeros(n, dtype=torch.uint8))


def _copy_sources(dst: Path) -> Path:
    for pkg in cache._PACKAGES:
        shutil.copytree(cache._ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.yaml", "*.md"))
    return dst


def test_a_change_of_oracle_code_misses(disk, tmp_path, monkeypatch):
    case = get_case(CASE)
    TruthCache().get(case)                                    # stored under today's oracle
    p = case.build()
    truth0, base0 = cache.truth_key(p, case), cache.baseline_key(p, "flashkda", case)
    root = _copy_sources(tmp_path / "src")
    monkeypatch.setattr(cache, "_ROOT", root)
    monkeypatch.setattr(cache, "_VERSIONS", {})
    monkeypatch.setattr(cache, "_PROBLEM_KEYS", {})
    assert (cache.truth_key(p, case), cache.baseline_key(p, "flashkda", case)) == (truth0, base0)  # same bytes
    with open(root / "kda_ref" / "chunked.py", "a") as f:    # an edit of the streamed oracle's module
        f.write("\n# edited\n")
    monkeypatch.setattr(cache, "_VERSIONS", {})
    assert cache.truth_key(p, case) != truth0
    assert cache.baseline_key(p, "flashkda", case) != base0  # measured against that truth
    tc = TruthCache()
    _, _, _, fresh = tc.get(case)
    assert fresh and tc.computed == {case.id: 1} and not tc.loaded


def test_a_change_of_emulator_code_misses_the_baseline_only(tmp_path, monkeypatch):
    case = get_case(CASE)
    p = case.build()
    truth0, base0 = cache.truth_key(p, case), cache.baseline_key(p, "flashkda", case)
    root = _copy_sources(tmp_path / "src")
    monkeypatch.setattr(cache, "_ROOT", root)
    monkeypatch.setattr(cache, "_VERSIONS", {})
    with open(root / "kda_kernels" / "emulator.py", "a") as f:
        f.write("\n# edited\n")
    assert cache.truth_key(p, case) == truth0
    assert cache.baseline_key(p, "flashkda", case) != base0
    with open(root / "verification" / "judging" / "metrics.py", "a") as f:
        f.write("\n# edited\n")
    monkeypatch.setattr(cache, "_VERSIONS", {})
    assert cache.baseline_key(p, "flashkda", case) != base0


def test_the_imports_of_a_module_are_followed(tmp_path):
    files = {f for f in map(str, _module_closure("kda_ref.truth"))}
    assert any(f.endswith("kda_ref/chunked.py") for f in files)        # imported inside truth()
    assert any(f.endswith("kda_ref/workspace.py") for f in files)
    assert not any("kda_kernels" in f for f in files)                   # the oracle needs no kernel


def _module_closure(name):
    seen, todo = {}, [name]
    while todo:
        n = todo.pop()
        f = cache._module_file(n)
        if f is None or n in seen:
            continue
        seen[n] = f
        todo.extend(cache._imports(f, n))
    return seen.values()


WRITER = """
import sys, torch
from verification.running import cache
i = int(sys.argv[1])
value = {"o": torch.full((64, 1024), 3.0, dtype=torch.float64), "who": "same"}
ok = [cache.store("truth", "ab" * 32, value) for _ in range(5)]
ok.append(cache.store("truth", f"{i:064x}", {"o": torch.full((8,), float(i))}))
got = cache.load("truth", "ab" * 32)
sys.exit(0 if all(ok) and got is not None and torch.equal(got["o"], value["o"]) else 1)
"""


@pytest.mark.slow
def test_concurrent_writers_leave_complete_entries(disk):
    n = 8                                      # processes writing the same key and their own at once
    env = dict(os.environ, PYTHONPATH=str(cache._ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(i)], env=env) for i in range(n)]
    assert [p.wait(timeout=300) for p in procs] == [0] * n
    files = list((disk / f"v{cache.FORMAT}").rglob("*"))
    assert not [f for f in files if f.name.endswith(".tmp")]           # every temporary file renamed
    assert len(_entries(disk, "truth")) == n + 1
    assert torch.equal(cache.load("truth", "ab" * 32)["o"], torch.full((64, 1024), 3.0, dtype=torch.float64))
    for i in range(n):
        assert torch.equal(cache.load("truth", f"{i:064x}")["o"], torch.full((8,), float(i)))


def test_a_broken_entry_is_a_miss_and_goes(disk):
    cache.store("truth", "cd" * 32, {"o": torch.zeros(4)})
    (f,) = _entries(disk, "truth")
    f.write_bytes(f.read_bytes()[:40])                                 # a truncated file
    assert cache.load("truth", "cd" * 32) is None and not f.exists()


def test_the_size_bound_removes_the_least_recently_used(disk, monkeypatch):
    for i in range(4):
        cache.store("truth", f"{i:064x}", {"o": torch.zeros(2 ** 15)})     # 256 KiB each
        os.utime(cache._path("truth", f"{i:064x}"), (1000 + i, 1000 + i))      # older first
    cache.load("truth", f"{0:064x}")                                        # used now: kept
    one = cache._path("truth", f"{0:064x}").stat().st_size
    removed = cache.evict(limit=2 * one + 10)
    assert removed == 2
    assert cache.load("truth", f"{0:064x}") is not None and cache.load("truth", f"{3:064x}") is not None
    assert cache.load("truth", f"{1:064x}") is None and cache.load("truth", f"{2:064x}") is None
    monkeypatch.setenv("KDA_VERIFY_CACHE_GB", "0")                          # a store keeps within the bound
    cache.store("truth", "ef" * 32, {"o": torch.zeros(4)})
    assert _entries(disk, "truth") == []


def test_off_means_neither_read_nor_written(disk, monkeypatch):
    case = get_case(CASE)
    monkeypatch.setenv("KDA_VERIFY_CACHE", "off")
    for _ in range(2):
        tc, bc = TruthCache(), BaselineCache()
        p, t, _, fresh = tc.get(case)
        _, _, fresh_b = bc.get(case, "flashkda", p, t)
        assert fresh and fresh_b and tc.disk_s == 0.0
    assert not disk.exists()
    monkeypatch.setenv("KDA_VERIFY_CACHE", "on")
    TruthCache().get(case)
    assert len(_entries(disk, "truth")) == 1
    cache.turn_off()                                                        # what --no-cache does
    assert not cache.enabled() and cache.load("truth", cache.truth_key(case.build(), case)) is None


def test_run_records_loaded_truths_and_no_cache_turns_it_off(disk, tmp_path, monkeypatch):
    import json

    from verification.cli import main
    from verification.judging.record import read_records
    args = ["run", "--backend", "emulator", "--route", "flashkda", "--suite", "smoke", "--case", CASE,
            "--device", "cpu", "--no-report"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    (a,), (b,) = (read_records(tmp_path / d / "results.jsonl") for d in "ab")
    assert not a["timings"]["oracle_cached"] and "truths_loaded" not in a["timings"]
    assert b["timings"]["oracle_cached"] and b["timings"]["truths_loaded"] == 1
    assert b["timings"]["baselines_loaded"] == 1 and b["timings"]["cache_s"] > 0
    assert json.dumps(b["tensors"]) == json.dumps(a["tensors"])      # the same verdict, figure for figure
    assert main(args + ["--out", str(tmp_path / "c"), "--no-cache"]) == 0
    (c,) = read_records(tmp_path / "c" / "results.jsonl")
    assert not c["timings"]["oracle_cached"] and "truths_loaded" not in c["timings"]
    assert os.environ["KDA_VERIFY_CACHE"] == "off"


def test_the_breakdown_counts_loads_apart():
    from verification.running import timing
    sums = timing.cell_sums([{"oracle_s": 0.0, "oracle_cached": True, "cache_s": 0.25, "truths_loaded": 1,
                              "baselines_loaded": 2}, {"oracle_s": 1.0, "oracle_cached": False, "cache_s": 0.5}])
    bd = timing.breakdown(sums, wall_s=3.0)
    assert bd["cache_s"] == 0.75 and bd["oracle_s"] == 1.0 and bd["oracle_runs"] == 1
    line = next(ln for ln in timing.format_lines(bd) if ln.strip().startswith("cache"))
    assert "1 truth, 2 baselines loaded" in line


WAITER = """
import sys, time
from verification.running.cases import get_case
from verification.running.run_cell import TruthCache
tc = TruthCache()
case = get_case(sys.argv[1])
print("ready", flush=True)
t0 = time.perf_counter()
tc.get(case)
print(sum(tc.computed.values()), sum(tc.loaded.values()), f"{time.perf_counter() - t0:.3f}")
"""


def test_a_process_that_wants_a_truth_being_computed_waits_and_loads_it(disk):
    case = get_case(CASE)
    key = cache.truth_key(case.build(), case)
    env = dict(os.environ, PYTHONPATH=str(cache._ROOT), OMP_NUM_THREADS="1")
    with cache.computing("truth", key):          # another worker is computing it
        proc = subprocess.Popen([sys.executable, "-c", WAITER, CASE], env=env, stdout=subprocess.PIPE, text=True)
        import time
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(3)                             # the child is waiting on the lock by now (else it computes)
        assert proc.poll() is None
        from kda_ref.truth import truth
        cache.store("truth", key, truth(case.build()))    # ... and stores it
    out, _ = proc.communicate(timeout=300)
    computed, loaded, waited = out.split()
    assert float(waited) > 1.0
    assert (computed, loaded) == ("0", "1")       # the child loaded it, it computed nothing


def test_a_lock_held_too_long_is_not_waited_for(disk):
    import time
    with cache.computing("truth", "ab" * 32):
        t0 = time.perf_counter()
        with cache.computing("truth", "ab" * 32, timeout_s=0.2):    # flock: a second open file is another holder
            pass
        assert 0.2 <= time.perf_counter() - t0 < 5


def test_a_hashed_problem_is_not_kept_alive():
    import gc
    import weakref
    case = get_case(CASE)
    p = case.build()
    k = cache.problem_key(p, case)
    assert cache.problem_key(p, case) == k
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert ref() is None          # the memo of keys holds no Problem (a 16k-token one is GiBs on the GPU)
