"""`kda-verify bench --passes`: each pass of our Triton FlashKDA timed alone.  Here through
Triton's interpreter (wall time; the CUDA path times the same calls with device events)."""
import pytest

from interpreted_triton import interpreted_kernels

interpreted_kernels()

from verification.investigating import bench  # noqa: E402


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


# Per (tile, head) workspace, by hand: ws_kd, ws_qd, ws_kr bf16 [32,128]; ws_gt fp32 [128];
# ws_inv, ws_mqk fp16 [32,32]; ws_beta fp32 [32]
WS_TILE = 3 * 32 * 128 * 2 + 128 * 4 + 2 * 32 * 32 * 2 + 32 * 4          # 29312
WS_PASS_A = 2 * 32 * 128 * 2 + 128 * 4 + 32 * 32 * 2 + 32 * 4           # kd, kr, gt, inv, beta: 19072
STATE = 128 * 128 * 4                                                     # one fp32 [K,V] state
WS_L = 2 * 32 * 32 * 4            # the tile K1's ws_L (fp32 [32,32]), written by its first launch, read by its second


def _traffic(route, shape):
    from kda_kernels.triton import forward as fw
    from kda_kernels.triton.routes import parse_route

    spec = parse_route(route)
    B, T, H = shape
    return bench.pass_traffic(fw.resolve_plan(spec, B, T, H, None, "cpu"), H, spec)


def test_pass_bytes_of_a_segmented_and_an_unsegmented_plan_by_hand():
    # 96 tokens, one head, one chunk per segment: 3 tiles, 3 segments, 1 sequence; A_seg fp32 (scan=split)
    seg = _traffic("seg:cps=1", (1, 96, 1))
    assert seg == {
        "k1": 3 * 96 * 128 * 2 + 96 * 4 + 3 * WS_TILE + 3 * WS_L,             # q, k, g, beta read; workspace
        "A": 3 * WS_PASS_A + 96 * 128 * 2 + 3 * STATE + 3 * STATE,            # ws, v read; A_seg, b_seg
        "B": 3 * STATE + 3 * STATE + 3 * STATE,                               # A_seg, b_seg read; h_in
        "C": 3 * WS_TILE + 96 * 128 * 2 + 3 * STATE + 96 * 128 * 2 + STATE,   # ws, v, h_in; o, final
    }
    two = _traffic("seg:cps=1:A=two", (1, 96, 1))
    assert two["A"] - seg["A"] == 3 * WS_PASS_A                                # the workspace read once more
    assert {k: v for k, v in two.items() if k != "A"} == {k: v for k, v in seg.items() if k != "A"}
    bf16 = _traffic("seg:cps=1:scan=bf16", (1, 96, 1))                        # A_seg bf16: half its bytes
    assert (seg["A"] - bf16["A"], seg["B"] - bf16["B"]) == (3 * 128 * 128 * 2, 3 * 128 * 128 * 2)
    # two heads, two batch rows of 40 tokens: 2 tiles per row (32 + 8 rows), 4 tiles, 2 sequences
    uns = _traffic("unseg", (2, 40, 2))
    assert uns == {"k1": 80 * 2 * 128 * 3 * 2 + 80 * 2 * 4 + 4 * 2 * WS_TILE + 4 * 2 * WS_L,
                   "C": 4 * 2 * WS_TILE + 80 * 2 * 128 * 2 + 80 * 2 * 128 * 2 + 2 * 2 * STATE}
    halves = _traffic("unseg:k1=halves", (2, 40, 2))                       # one K1 launch: no ws_L
    assert uns["k1"] - halves["k1"] == 4 * 2 * WS_L and halves["C"] == uns["C"]
    floors = bench.pass_floors(uns)
    assert floors["C"] == pytest.approx(1e6 * uns["C"] / 4.8e12)


@pytest.mark.usefixtures("one_thread")
def test_pass_times_carries_the_floors_and_bench_prints_the_design_floor(monkeypatch, capsys, tmp_path):
    import json

    import torch

    from verification.cli import main

    def fake(backend, route, shape, device, reps=50, warmup=5, graph=False, seed=0, name=None):
        B, T, H = shape
        return bench.BenchResult(name, route, B, T, H, time_us=9.0, p10_us=9.0, p90_us=9.0, reps=reps,
                                 graph=graph, bytes=1, flops=1, bandwidth_gbs=1.0, tflops=1.0, floor_us=1.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "interpreter")
    monkeypatch.setattr(bench, "bench_one", fake)
    out = tmp_path / "p.json"
    assert main(["bench", "--backend", "triton", "--routes", "seg:cps=1", "--shapes", "1x96x1", "--device", "cpu",
                 "--reps", "3", "--warmup", "1", "--passes", "--json-out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = json.loads(out.read_text())["passes"][0]
    us = {k: 1e6 * b / 4.8e12 for k, b in {                                    # the byte counts above
        "k1": 3 * 96 * 128 * 2 + 96 * 4 + 3 * (WS_TILE + WS_L), "A": 3 * WS_PASS_A + 96 * 128 * 2 + 6 * STATE,
        "B": 9 * STATE, "C": 3 * WS_TILE + 2 * 96 * 128 * 2 + 4 * STATE}.items()}
    fwd = 1e6 * (96 * (4 * 128 * 2 + 4 + 128 * 2) + STATE) / 4.8e12
    assert row["floors"] == pytest.approx(us) and row["design_floor"] == pytest.approx(sum(us.values()))
    assert row["floor"] == pytest.approx(fwd) and row["k1"] > 0 and row["bytes"]["B"] == 9 * STATE
    assert any(ln.startswith("route") and "K1 us (x floor)" in ln for ln in lines)
    cells = [ln for ln in lines if ln.startswith("seg:cps=1 ") and "1x96x1" in ln][0]   # interpreter: ~1e6x
    assert f"{row['k1']:.1f} ({row['k1'] / us['k1']:.0e}x)" in cells
    design = [ln for ln in lines if ln.startswith("design floor 1x96x1 seg:cps=1: ")]
    assert design == [f"design floor 1x96x1 seg:cps=1: K1 {us['k1']:.3g} + A {us['A']:.3g} + B {us['B']:.3g} "
                      f"+ C {us['C']:.3g} = {sum(us.values()):.3g} us = {sum(us.values()) / fwd:.1f}x the "
                      f"forward's floor of {fwd:.3g} us"], lines
