"""Room on the device: a case larger than the device is skipped with the reason before anything
is built; a case over a worker's share runs under the per-device big-case lock, which two
processes never hold at once and which a worker lets go when it moves to another case."""
import multiprocessing as mp
import os
import time

import pytest

from verification.running import room
from verification.running.cases import get_case


def test_cell_bytes_counts_tokens_heads_and_channels():
    c = get_case("long/T1048576-H12-lb-5")
    assert room.case_size(c) == (1048576, 12, 128, 128)
    assert room.cell_bytes(c) == room.CELL_BYTES_PER_ELEMENT * 1048576 * 12 * 256
    v = get_case("long/varlen-524288+64-H12-lb-5")
    assert room.case_size(v)[0] == sum(v.params["lens"])


def test_a_case_larger_than_the_device_is_skipped_before_it_is_built(monkeypatch):
    from verification.judging.baselines import BaselineCache
    from verification.running.run_cell import TruthCache, run_cell
    c = get_case("long/T1048576-H12-lb-5")
    monkeypatch.setattr(room, "_total", lambda device: 24 * 2 ** 30)
    built = []
    monkeypatch.setattr(type(c), "build", lambda self, device="cpu": built.append(1))
    why = room.no_room(c, "cpu")
    need = room.CELL_BYTES_PER_ELEMENT * 1048576 * 12 * 256 / 2 ** 30
    assert why.startswith(f"device too small: one cell of this case needs about {need:.0f} GiB") and "has 24 GiB" in why
    from verification.running.run_select import as_loaded, resolve_routes
    lb = as_loaded("emulator")
    route = resolve_routes(lb, ["flashkda"])[0]
    rec = run_cell(lb, route, c, TruthCache("cpu"), BaselineCache(), None, device="cpu")
    assert rec.status == "skipped" and rec.reason == why and built == []
    monkeypatch.setattr(room, "_total", lambda device: 141 * 2 ** 30)
    assert room.no_room(c, "cpu") is None


def test_is_big_needs_more_than_one_worker_and_more_than_a_share(monkeypatch):
    c = get_case("long/T1048576-H12-lb-5")                 # about 75 GiB
    monkeypatch.setattr(room, "_total", lambda device: 141 * 2 ** 30)
    assert not room.is_big(c, "cuda:0", workers=1)
    assert room.is_big(c, "cuda:0", workers=2)              # share 70.5 GiB
    assert not room.is_big(get_case("long/T262144-H12-lb-5"), "cuda:0", workers=2)


def _hold(lock_dir, t_hold, out):
    os.environ[room.LOCK_DIR_ENV] = lock_dir
    lock = room.BigCaseLock("cuda:0")
    lock.hold("long/x")
    t0 = time.time()
    time.sleep(t_hold)
    t1 = time.time()
    lock.release()
    out.put((t0, t1))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_two_processes_never_hold_the_lock_at_once(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(str(tmp_path), 0.4, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(20)
    (a0, a1), (b0, b1) = sorted([q.get(timeout=5), q.get(timeout=5)])
    assert a1 <= b0, "the second holder started before the first let go"


def test_truth_cache_takes_the_lock_for_a_big_case_and_lets_go_on_the_next(monkeypatch, tmp_path):
    from verification.running.run_cell import TruthCache
    monkeypatch.setenv(room.LOCK_DIR_ENV, str(tmp_path))
    big, small = get_case("long/T1048576-H12-lb-5"), get_case("smoke/dense-T64-lb-5")
    monkeypatch.setattr(room, "is_big", lambda case, device, workers=None: case.id == big.id)
    tc = TruthCache("cuda:0")
    monkeypatch.setattr(type(big), "build", lambda self, device="cpu": f"problem {self.id}")
    assert tc.problem(big) == f"problem {big.id}"
    assert tc._big.held and tc._big.case_id == big.id and big.id in tc.lock_wait_s
    import fcntl                                         # another worker's attempt would block now
    fd = os.open(room.lock_path("cuda:0"), os.O_RDWR)
    with pytest.raises(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    tc.problem(small)                                    # moving on: dropped and released
    assert not tc._big.held and big.id not in tc._problems
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)       # now free
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
