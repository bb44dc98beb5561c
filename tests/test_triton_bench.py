"""`kda-verify bench`: the arithmetic and the argument checks run anywhere; the timing itself
needs CUDA (marked gpu)."""
import json
import math

import pytest
import torch

from verification.investigating import bench
from verification.cli import main


def test_default_suite_shapes_are_the_design_shapes():
    assert bench.shapes_of_suite("default") == list(bench.DEFAULT_SHAPES)
    assert len(bench.DEFAULT_SHAPES) == 13


def test_traffic_flops_and_floor():
    nbytes, flops = bench.traffic(1, 16384, 12)
    tok = 16384 * 12
    assert flops == tok * 2 * (32 * 128 + 32 * 128 + 2 * 128 * 128)
    assert nbytes == tok * (4 * 128 * 2 + 4 + 128 * 2) + 12 * 128 * 128 * 4
    floor = bench.floor_us(1, 16384, 12)
    assert 50 < floor < 62                     # the bandwidth floor of 1x16384x12 at 4.8 TB/s: about 53 us
    assert floor == pytest.approx(1e6 * nbytes / bench.H200_HBM_BYTES_S)


def test_speedups_against_the_best_fla_time_and_geomean():
    def res(backend, route, shape, t):
        return bench.BenchResult(backend, route, *shape, time_us=t, p10_us=t, p90_us=t, reps=3, graph=False,
                                 bytes=1, flops=1, bandwidth_gbs=1, tflops=1, floor_us=1)
    rs = [res("fla", "chunk:safe_gate", (1, 256, 12), 900.0), res("triton", "seg", (1, 256, 12), 100.0),
          res("fla", "chunk:safe_gate", (1, 512, 12), 800.0), res("triton", "seg", (1, 512, 12), 200.0),
          res("triton", "seg", (1, 1024, 12), 50.0)]           # no fla time: not counted
    sp = bench.speedups(rs)[("triton", "seg")]
    assert sp["per_shape"] == {(1, 256, 12): 9.0, (1, 512, 12): 4.0}
    assert sp["geomean"] == pytest.approx(6.0)
    assert math.isnan(bench.geomean([]))


@pytest.mark.parametrize("argv, text", [
    (["bench", "--backend", "cuda"], "--backend"),
    (["bench", "--routes", "seg:A=three"], "A=two|fused"),
    (["bench", "--shapes", "1x0x12"], "--shapes"),
    (["bench", "--reps", "1"], "--reps"),
])
def test_bad_arguments_are_one_line_errors(argv, text, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert text in err and "\n" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_runs_on_the_gpu(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", "--backend", "triton", "--shapes", "1x2048x12", "--routes", "seg,unseg", "--reps", "5",
               "--json-out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 and all(r["time_us"] > 0 for r in data["results"])
    assert all(r["host_us"] > 0 and isinstance(r["host_bound"], bool) for r in data["results"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", [[], ["--graph"]], ids=["events", "graph"])
def test_bench_passes_on_the_gpu(tmp_path, graph):
    out = tmp_path / "p.json"
    rc = main(["bench", "--backend", "triton", "--shapes", "1x2048x12", "--routes", "seg:cps=4,unseg:k1=halves",
               "--reps", "5", "--passes", "--json-out", str(out), *graph])
    assert rc == 0
    p = {r["route"]: r for r in json.loads(out.read_text())["passes"]}
    assert all(p["seg:cps=4"][k] > 0 for k in ("k1", "A", "B", "C", "total"))
    assert "A" not in p["unseg:k1=halves"] and p["unseg:k1=halves"]["k1"] > 0


@pytest.mark.parametrize("time_us, host_us, flush_us, graph, expected", [
    (700.0, 100.0, 55.0, False, False),     # the GPU ran long after the launches were issued
    (180.0, 250.0, 55.0, False, True),      # the launches outlasted the flush and set the end
    (40.0, 50.0, 55.0, False, False),       # issued while the flush ran: the events saw the GPU alone
    (180.0, 250.0, 55.0, True, False),      # graph replay is one launch
    (180.0, math.nan, 55.0, False, False),  # not measured
    (math.nan, 250.0, 55.0, False, False),
])
def test_host_bound_means_the_launches_set_the_measured_time(time_us, host_us, flush_us, graph, expected):
    assert bench.is_host_bound(time_us, host_us, flush_us, graph) is expected


def test_bench_marks_host_bound_rows_and_says_what_to_do(monkeypatch, capsys, tmp_path):
    def fake(backend, route, shape, device, reps=50, warmup=5, graph=False, seed=0, name=None):
        B, T, H = shape
        host = 300.0 if T == 256 else 50.0
        t = 200.0 if T == 256 else 900.0
        return bench.BenchResult(name, route, B, T, H, time_us=t, p10_us=t, p90_us=t, reps=reps, graph=graph,
                                 bytes=1, flops=1, bandwidth_gbs=1.0, tflops=1.0, floor_us=1.0, route_ran=route,
                                 host_us=host, host_bound=bench.is_host_bound(t, host, 55.0, graph))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(bench, "bench_one", fake)
    out = tmp_path / "b.json"
    assert main(["bench", "--backend", "triton", "--routes", "seg", "--shapes", "1x256x12;1x16384x12",
                 "--device", "cpu", "--json-out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    small = [ln for ln in lines if "1x256x12" in ln][0]
    large = [ln for ln in lines if "1x16384x12" in ln][0]
    assert "[host-bound: 300 us to launch]" in small and "host-bound" not in large
    assert any(ln.startswith("host-bound:") and "--graph" in ln for ln in lines)
    rows = {r["T"]: r for r in json.loads(out.read_text())["results"]}
    assert rows[256]["host_bound"] is True and rows[16384]["host_bound"] is False and rows[256]["host_us"] == 300.0


# ---------------------------------------------------------------------------- the timed call is the adapter's
class CountingBackend:
    """A test-local adapter whose run counts its invocations and records the problem it got."""
    name = "counting"

    def __init__(self):
        self.calls = []

    def available(self):
        return True, ""

    def version(self):
        return "0"

    def routes(self):
        from kda_kernels.base import Route
        return [Route("r1", recipe="fla")]

    def accepts(self, p, route):
        return True, ""

    def run(self, p, route):
        from kda_kernels.base import Outputs
        self.calls.append((p, route.name))
        return Outputs(o=torch.zeros(p.B, p.T, p.HV, p.V), final_state=None, info={"route_ran": f"counted {route.name}"})


def test_bench_times_the_adapters_run_of_the_route_and_nothing_else(monkeypatch):
    from kda_ref.problems import problem_digest
    timed = []

    def fake_time_call(fn, inputs, reps, warmup, graph, device, stats=None):   # time_call's calls, no clock
        for i in range(warmup + reps):
            timed.append(fn(inputs[i % len(inputs)]))
        return [10.0] * reps

    monkeypatch.setattr(bench, "time_call", fake_time_call)
    b = CountingBackend()
    r = bench.bench_one(b, "r1", (1, 64, 2), "cpu", reps=5, warmup=2, seed=3)
    assert not r.error and r.backend == "counting" and r.time_us == 10.0
    assert len(b.calls) == len(timed) == 7 and all(name == "r1" for _, name in b.calls)
    assert r.route_ran == "counted r1"                                     # the adapter's own account
    want = {problem_digest(bench.bench_problem(1, 64, 2, "cpu", 3 + i)) for i in range(bench.rotation_count(1, 64, 2))}
    assert {problem_digest(p) for p, _ in b.calls} == want                  # the generator's problems, rotated
    call = bench.route_call(b, "r1")
    assert call.backend is b and call.route.name == "r1"
    with pytest.raises(ValueError, match="--routes for counting: expected one of r1, got 'r2'"):
        bench.route_call(b, "r2")


def test_a_route_the_adapter_refuses_is_the_cells_error(monkeypatch):
    b = CountingBackend()
    b.accepts = lambda p, route: (False, "not applicable: planted")
    monkeypatch.setattr(bench, "time_call", lambda *a, **k: [1.0])
    r = bench.bench_one(b, "r1", (1, 16, 1), "cpu", reps=3, warmup=1)
    assert r.error == "ValueError: not applicable: planted" and not b.calls
