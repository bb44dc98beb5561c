"""The streamed truth (kda_ref.chunked.streamed, truth()'s default) gives the whole-problem chunked
form's results block by block, its blocks cover the chunks exactly, and no block holds more tiles
than its budget allows."""
import pytest
import torch

import kda_ref.chunked as ch
from kda_ref import truth
from kda_ref.chunked import block_bytes_per_tile_head, block_plan, streamed
from kda_ref.preprocess import prepare
from kda_ref.recurrence import recurrence_prepared
from verification.running.cases import get_suite
from verification.investigating.selfcheck import RECIPES, build, rel

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

TOL = 1e-13
BY_NAME = {r.name: r for r in RECIPES}


def _cases():
    out = [c for c in get_suite("smoke")]
    out += [c for c in get_suite("stress", long=False)]
    k3 = sorted(get_suite("k3-prefill", long=False), key=lambda c: sum(c.lens) * c.params.get("H", 2))
    return out + k3[:4]


def _agree(a, b):
    worst = 0.0
    for name, x in a.tensors().items():
        worst = max(worst, rel(x, b.tensors()[name]))
    return worst


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_streamed_matches_the_whole_problem_chunked_form(case):
    p = case.build()
    ref = truth(p, method="chunked")
    assert set(truth(p).tensors()) == set(ref.tensors())
    for bt in (64, 3 * 64, None):                    # one chunk per block, three, the default budget
        t = truth(p, block_tokens=bt)
        assert _agree(t, ref) <= TOL, (case.id, bt)


@pytest.mark.parametrize("name", ["varlen-partial-empty", "paged", "vk-state", "gva", "softplus-mixed",
                                  "corr-1.0-beta-1", "dense"])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_streamed_matches_the_recurrence_at_every_block_size(name, C):
    p = build(BY_NAME[name], 5)
    ref = recurrence_prepared(prepare(p))
    for bt in (1, C, 2 * C, 5 * C, 10 ** 9):
        o, fs = streamed(p, C, block_tokens=bt)
        assert rel(o, ref.o) < 1e-12 and rel(fs, ref.final_state) < 1e-12, (C, bt)


def test_block_plan_covers_every_chunk_once_and_keeps_chunk_alignment():
    bounds = [(0, 0), (0, 100), (100, 100), (100, 117), (117, 117), (117, 300)]   # empties at start, middle, end
    C = 16
    for tpb in (1, 2, 3, 7, 100):
        blocks = block_plan(bounds, C, tpb)
        seen = []
        prev_end = None
        for t0, t1, parts in blocks:
            assert prev_end is None or t0 == prev_end        # blocks tile the token axis in order
            prev_end = t1
            tiles = 0
            for n, b0, b1 in parts:
                bos, eos = bounds[n]
                g0, g1 = t0 + b0, t0 + b1
                assert bos <= g0 < g1 <= eos and (g0 - bos) % C == 0
                assert g1 == eos or (g1 - bos) % C == 0
                tiles += -(-(b1 - b0) // C)
                seen.append((n, g0, g1))
            assert 1 <= tiles <= tpb
            assert parts[0][1] == 0 and parts[-1][2] == t1 - t0
        for n, (bos, eos) in enumerate(bounds):          # each sequence's pieces join up to the whole
            pieces = [(g0, g1) for m, g0, g1 in seen if m == n]
            if eos == bos:
                assert pieces == []
            else:
                assert pieces[0][0] == bos and pieces[-1][1] == eos
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert block_plan([(0, 0), (0, 0)], 16, 4) == []


def test_no_block_holds_more_tiles_than_its_budget(monkeypatch):
    """The streamed form never builds a workspace of the whole problem: every workspace it builds
    holds at most the tiles its byte budget allows, and several blocks carry the state."""
    p = build(BY_NAME["weak-gate"], 0)            # lens 100, 31: 9 tiles at C = 16
    C = 16
    per_tile = p.HV * block_bytes_per_tile_head(C, p.K, p.V)
    built = []
    real = ch.workspace_prepared

    def spy(pp, C_, inverse="exact", **kw):
        ws = real(pp, C_, inverse, **kw)
        built.append(ws.tiles)
        return ws

    monkeypatch.setattr(ch, "workspace_prepared", spy)
    o, fs = streamed(p, C, block_bytes=2 * per_tile + 1)
    assert max(built) == 2 and sum(built) == 9 and len(built) == 5
    ref = recurrence_prepared(prepare(p))
    assert rel(o, ref.o) < 1e-12 and rel(fs, ref.final_state) < 1e-12


def test_a_state_not_carried_between_blocks_is_caught(monkeypatch):
    """If a block started from the initial state instead of the carried one, the results would
    differ from the one-block run: the comparison above can fail."""
    p = build(BY_NAME["dense"], 0)
    ref = truth(p, method="chunked")
    real = ch.prepare_tokens

    def forget(p_, t0, t1, S0, buffers=None):
        from kda_ref.preprocess import initial_state_kfirst
        seq_first = initial_state_kfirst(p_)[: S0.shape[0]]
        return real(p_, t0, t1, seq_first, buffers)

    monkeypatch.setattr(ch, "prepare_tokens", forget)
    assert _agree(truth(p, block_tokens=64), ref) > 1e-3


def test_truth_default_is_streamed_and_workspace_extras_stay_available():
    p = build(BY_NAME["paged"], 1)
    t = truth(p)
    ref = truth(p, method="chunked")
    assert _agree(t, ref) <= TOL
    w = truth(p, workspace=True, chunk_size=16, chunks_per_seg=2)
    assert {"ws_inv", "ws_kd", "A_seg", "h_in", "seg_desc", "ws_cond1"} <= set(w.extras)
    assert _agree(truth(p, chunk_size=16), truth(p, method="chunked", chunk_size=16)) <= TOL
    with pytest.raises(ValueError, match="chunk_size"):
        truth(p, chunk_size=48)


def test_streamed_casts_inputs_block_by_block(monkeypatch):
    """Only one block's tokens are ever turned into float64 at once."""
    p = build(BY_NAME["weak-gate"], 2).to(dtype_map={n: torch.float32 for n in ("q", "k", "v", "g")})
    seen = []
    real = ch.prepare_tokens

    def spy(p_, t0, t1, S0, buffers=None):
        seen.append(t1 - t0)
        return real(p_, t0, t1, S0, buffers)

    monkeypatch.setattr(ch, "prepare_tokens", spy)
    streamed(p, 32, block_tokens=64)
    assert max(seen) <= 64 and sum(seen) == 131 and len(seen) == 3


def test_oracle_command_streams_the_chunked_form(tmp_path):
    from verification.cli import main
    from verification.reporting.problem_file import load_outputs, load_outputs_metadata, save_problem
    p = build(BY_NAME["varlen-partial-empty"], 3)
    pin, pout = str(tmp_path / "p.safetensors"), str(tmp_path / "t.safetensors")
    save_problem(pin, p)
    assert main(["oracle", "--inputs", pin, "--out", pout, "--device", "cpu"]) == 0
    meta = load_outputs_metadata(pout)
    assert meta["method"] == "chunked" and meta["streamed"] == "yes"
    got, ref = load_outputs(pout), truth(p, method="chunked")
    assert rel(got["o"], ref.o) <= TOL and rel(got["final_state"], ref.final_state) <= TOL
    assert main(["oracle", "--inputs", pin, "--out", pout, "--device", "cpu", "--workspace"]) == 0
    assert load_outputs_metadata(pout)["streamed"] == "no" and "ws_inv" in load_outputs(pout)


def test_oracle_bench_reports_time_memory_and_rate_of_the_streamed_truth(capsys):
    import json

    from verification.cli import main
    assert main(["oracle-bench", "--shapes", "1x130x2", "--K", "16", "--V", "16", "--device", "cpu",
                 "--block-tokens", "64", "--repeat", "1", "--phases", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["tiles"] == 3 and r["truth_s"] > 0 and r["peak_bytes"] > 0 and r["peak_kind"] == "resident set"
    assert 0 < r["fraction_of_measured_matmul"] and r["matmul_time_s"] > 0
    assert r["truth_vs_recurrence_rel"] < 1e-12 and r["phases"]["streamed_vs_chunked_rel"] <= TOL


def test_block_budget_shrinks_with_the_workers_sharing_the_device(monkeypatch):
    from kda_ref import budget
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.delenv(budget.WORKERS_ENV, raising=False)
    assert budget.sharing_workers() == 1
    one = ch.default_block_bytes("cpu")
    assert 0 < one <= budget.CPU_BLOCK_CAP
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert budget.sharing_workers() == 16 and ch.default_block_bytes("cpu") <= one
    monkeypatch.setattr(budget, "CPU_BLOCK_CAP", 2 ** 62)             # uncapped: total x share / 16
    many = ch.default_block_bytes("cpu")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert many * 8 < ch.default_block_bytes("cpu")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "x")
    assert budget.sharing_workers() == 1
