"""aiter's FlashKDA one pass at a time (AiterBackend.debug_plan / run_pass) in Triton's CPU
interpreter, against the float64 oracle through the per-pass debugger.

aiter is never part of this repository: the module skips unless a copy of its ``aiter/`` tree
lies in ``.vendor/``.  aiter asks the active GPU for its arch when imported; without a GPU the
import gets a stand-in ``arch_info`` (gfx942, no Gluon), a stand-in Triton driver reporting
that target and a ``get_device_properties`` that raises RuntimeError (what aiter expects when
there is no device), for the import only: tools/aiter_interpret.py's loader, with
verification.investigating.aiter_isa's stand-ins.  The interpreter gets the project's fixes
(kda_kernels.triton._interpreter_compat: loop bounds, bf16 dots, bf16 rounding).  Everything is put back afterwards, aiter's modules
included, so later test modules see the machine as it is.  Like every interpreter test, this
module skips on a GPU machine (Triton's interpreter would break compiled kernels there).

Thresholds are the debugger's row thresholds (verification.investigating.debug.THRESHOLDS).
"""
import importlib.util
import os
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / ".vendor"

if not (VENDOR / "aiter").is_dir():
    pytest.skip(f"no copy of aiter's source in {VENDOR} (it is never committed)", allow_module_level=True)
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter tests run on machines without a GPU (or with TRITON_INTERPRET=1)",
                allow_module_level=True)

from kda_kernels.aiter import AiterBackend  # noqa: E402
from kda_kernels.base import Route  # noqa: E402
from kda_ref.problems import generate  # noqa: E402
from verification.investigating.debug import debug_passes, format_reports  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)  # inf in the masked upper triangle


def _tool():
    spec = importlib.util.spec_from_file_location("aiter_interpret", ROOT / "tools" / "aiter_interpret.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def flash_kda():
    tool = _tool()
    try:
        with tool.loaded(VENDOR) as mods:
            yield mods["flash_kda"]
    except tool.NotInterpreted as e:
        pytest.skip(str(e))


def make(lens=None, B=1, T=0, H=1, lb=-1.0, state=None, seed=0):
    """A bf16 problem, K = V = 128 (the generator's): varlen (B = 1) when ``lens`` is given, else B x T."""
    sizes = dict(lens=list(lens)) if lens is not None else dict(B=B, T=T)
    return generate(dict(sizes, H=H, lb=lb, state=state or "none"), seed=seed)


def route(name):
    return Route(name, recipe="flashkda")


def test_debug_plan_resolves_segments_as_aiter_does(flash_kda, monkeypatch):
    b = AiterBackend(module=flash_kda)
    p = make([40, 0, 70])                      # 2 and 3 chunks
    assert b.debug_plan(p, route("triton:seg:cps=1")) == dict(
        form="flashkda", chunk_size=32, chunks_per_seg=1, passes=["K1", "A", "B", "C"])
    assert b.debug_plan(p, route("triton:seg:cps=2"))["passes"] == ["K1", "A", "B", "C"]
    # every sequence fits one segment of 4 chunks: aiter runs pass C alone
    assert b.debug_plan(p, route("triton:seg:cps=4")) == dict(
        form="flashkda", chunk_size=32, chunks_per_seg=None, passes=["K1", "C"])
    assert b.debug_plan(p, route("triton:unseg"))["passes"] == ["K1", "C"]
    # the heuristic route asks aiter's _choose_chunks_per_seg; it needs the CU count
    monkeypatch.setattr(flash_kda, "_num_cus", lambda device_index=0: 256)
    monkeypatch.setenv("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", "1")   # ignored, as run() ignores it
    assert b.debug_plan(p, route("triton:seg"))["passes"] == ["K1", "C"]   # 3 chunks: too shallow
    assert os.environ["CHUNK_DELTA_ATTN_FLASH_KDA_SEG"] == "1"


def test_run_pass_refuses_what_it_cannot_run(flash_kda):
    b = AiterBackend(module=flash_kda)
    p = make([40, 70])
    with pytest.raises(ValueError, match="--pass: expected one of K1|A|B|C, got 'D'"):
        b.run_pass(p, route("triton:seg:cps=1"), "D", {})
    with pytest.raises(ValueError, match="has no pass A on this problem"):
        b.run_pass(p, route("triton:unseg"), "A", {})
    with pytest.raises(ValueError, match="per-pass runs use aiter's Triton launchers"):
        b.run_pass(p, route("gluon:seg:cps=1"), "K1", {})
    with pytest.raises(ValueError, match="feed: pass B needs A_seg, b_seg"):
        b.run_pass(p, route("triton:seg:cps=1"), "B", {})
    with pytest.raises(ValueError, match="not applicable: FlashKDA needs bf16"):
        b.run_pass(p.replace(q=p.q.float()), route("triton:seg:cps=1"), "K1", {})
    with pytest.raises(ValueError, match=r"feed: ws_kd expected shape \[5, 32, 128\], got \[4, 32, 128\]"):
        b.run_pass(p, route("triton:seg:cps=1"), "C", {n: torch.zeros(4, 32, 128) for n in
                   ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk")})


def test_a_kernel_with_other_arguments_is_refused_before_launch(flash_kda, monkeypatch):
    """Another aiter version's scan (here: one that also wants a paged cache) is named, not mis-bound."""
    class OtherScan:
        arg_names = ["A_seg", "b_seg", "h_in", "h0", "state_cache", "seq_seg_off", "H", "K", "V", "BV", "HAS_H0"]
        values = {"HAS_H0": lambda args: args["h0"] is not None}

        def __getitem__(self, grid):
            raise AssertionError("launched a kernel whose arguments differ")

    monkeypatch.setattr(flash_kda, "_flash_kda_seg_scan_kernel", OtherScan())
    b = AiterBackend(module=flash_kda)
    p = make([40, 70])
    feed = {"A_seg": torch.zeros(5, 1, 128, 128), "b_seg": torch.zeros(5, 1, 128, 128)}
    with pytest.raises(ValueError, match=r"_flash_kda_seg_scan_kernel takes other arguments .*missing \['state_cache'\]"):
        b.run_pass(p, route("triton:seg:cps=1"), "B", feed)


def test_every_pass_within_thresholds_segmented(flash_kda):
    """Two sequences of 2 and 3 chunks at one chunk per segment, a K-first initial state:
    K1's workspace and every pass against the oracle, each pass fed the oracle's inputs."""
    b = AiterBackend(module=flash_kda)
    p = make([40, 70], lb=-0.3, state="kv", seed=3)
    reports = debug_passes(b, p, route("triton:seg:cps=1"))
    text = format_reports(reports)
    assert [x.name for x in reports] == ["K1", "A", "B", "C"], text
    assert [t.name for t in reports[0].tensors] == ["ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk"], text
    assert [t.name for t in reports[1].tensors] == ["A_seg", "b_seg"], text
    assert [t.name for t in reports[3].tensors] == ["o", "final_state"], text
    assert all(x.ok for x in reports), text
    # measured on this case: the bf16 tiles at bf16's rounding, o and the state well under 1e-2
    worst = {t.name: t.max_row_err for x in reports for t in x.tensors}
    assert worst["ws_kd"] < 4e-3 and worst["ws_gt"] < 1e-5 and worst["o"] < 1e-2, text


def test_batched_dense_problem_k1_and_pass_c(flash_kda):
    """B = 2 without cu_seqlens: K1's grid is (NT, B*H) and the tiles of batch b follow those of b-1."""
    b = AiterBackend(module=flash_kda)
    p = make(B=2, T=40, H=2, lb=-2.0, state="kv", seed=9)
    reports = debug_passes(b, p, route("triton:unseg"))
    assert [x.name for x in reports] == ["K1", "C"] and all(x.ok for x in reports), format_reports(reports)


def test_unsegmented_pass_c_starts_from_a_v_first_state(flash_kda):
    """Unsegmented: pass C alone from the Problem's V-first initial state (transposed as aiter does);
    a wrong state fed to C shows as an error in o and the final state."""
    b = AiterBackend(module=flash_kda)
    p = make([33, 20], lb=-0.5, state="vk", seed=5)
    reports = debug_passes(b, p, route("triton:unseg"), ["C"])
    assert reports[0].ok, format_reports(reports)
    wrong = p.replace(initial_state=p.initial_state.transpose(-1, -2).contiguous())
    from verification.investigating.debug import compare_tensor, oracle_intermediates
    ref = oracle_intermediates(p, 32, None)
    got = b.run_pass(wrong, route("triton:unseg"), "C", {k: ref["tensors"][k] for k in
                     ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk")})
    ctx = dict(ref, T=p.T, B=p.B)
    rep = compare_tensor("o", got["o"].reshape(ref["tensors"]["o"].shape), ref["tensors"]["o"], ctx)
    assert not rep.ok and (rep.first_over["seq"], rep.first_over["chunk"], rep.first_over["row"]) == (0, 0, 0)
    assert not compare_tensor("final_state", got["final_state"], ref["tensors"]["final_state"], ctx).ok
