"""kda_ref.budget: the bytes one block of float64 work may hold come from the device's total memory,
a fixed share and the number of workers sharing the device (never from the memory free now),
and the streamed truth sizes its default blocks from it."""
import pytest
import torch

import kda_ref.chunked as ch
from kda_ref import budget
from kda_ref.chunked import block_bytes_per_tile_head, streamed
from verification.investigating.selfcheck import RECIPES, build

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

GiB = 2 ** 30


@pytest.fixture
def no_worker_env(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.delenv(budget.WORKERS_ENV, raising=False)
    return monkeypatch


def test_workers_come_from_the_override_then_xdist_then_one(no_worker_env):
    mp = no_worker_env
    assert budget.sharing_workers() == 1
    mp.setenv("PYTEST_XDIST_WORKER_COUNT", "14")
    assert budget.sharing_workers() == 14
    mp.setenv(budget.WORKERS_ENV, "3")                   # the explicit override wins
    assert budget.sharing_workers() == 3
    for bad in ("0", "-2", "many", ""):                  # not an integer >= 1: ignored
        mp.setenv(budget.WORKERS_ENV, bad)
        assert budget.sharing_workers() == 14
    mp.setenv("PYTEST_XDIST_WORKER_COUNT", "x")
    assert budget.sharing_workers() == 1


def test_budget_is_total_times_share_over_workers_capped(no_worker_env):
    mp = no_worker_env
    mp.setattr(budget, "device_total_bytes", lambda dev: 140 * GiB)
    one = budget.block_budget("cuda:0")
    assert one == int(140 * GiB * budget.BLOCK_SHARE)
    assert 2 * GiB < one < 4 * GiB                      # an H200's block: a few GiB, far below 8 GiB
    mp.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert budget.block_budget("cuda:0") == one // 16
    assert budget.block_budget("cuda:0", workers=2) == one // 2
    mp.setattr(budget, "device_total_bytes", lambda dev: 10 ** 15)
    assert budget.block_budget("cuda:0", workers=1) == budget.CUDA_BLOCK_CAP
    assert budget.block_budget("cpu", workers=1) == budget.CPU_BLOCK_CAP
    mp.setattr(budget, "device_total_bytes", lambda dev: 1)
    assert budget.block_budget("cpu", workers=64) == 1


def test_budget_does_not_depend_on_free_memory(no_worker_env):
    """Two readings with a large allocation held in between give the same budget."""
    a = budget.block_budget("cpu")
    hold = torch.empty(64 * 2 ** 20, dtype=torch.uint8).fill_(1)
    b = budget.block_budget("cpu")
    del hold
    assert a == b


def test_cpu_total_is_the_machine_memory_or_the_cgroup_limit(no_worker_env):
    total = budget.device_total_bytes("cpu")
    assert total > 2 ** 26
    no_worker_env.setattr(budget, "_cgroup_limit", lambda: 2 ** 27)
    assert budget.device_total_bytes("cpu") == min(total, 2 ** 27)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_total_is_the_gpu_memory(no_worker_env):
    assert budget.device_total_bytes("cuda") == torch.cuda.get_device_properties(0).total_memory


def test_streamed_default_blocks_follow_the_budget_bitwise(no_worker_env):
    """truth's default blocks are block_budget's: a budget of one tile per block gives the bits of
    block_tokens = C, one of three tiles those of block_tokens = 3 C."""
    p = build(next(r for r in RECIPES if r.name == "varlen-partial-empty"), 5)
    C = 16
    per_tile = p.HV * block_bytes_per_tile_head(C, p.K, p.V)
    for tiles in (1, 3):
        no_worker_env.setattr(ch, "block_budget", lambda dev, t=tiles: t * per_tile + per_tile // 2)
        o, fs = streamed(p, C)
        o_ref, fs_ref = streamed(p, C, block_tokens=tiles * C)
        assert torch.equal(o, o_ref) and torch.equal(fs, fs_ref), tiles
