"""The report's long-context plot (plots/long_context.png) and its growth table."""
import pytest

from verification.reporting.report_plots import long_context_figure
from verification.reporting.report_render import write_report
from verification.reporting.report_summary import long_growth_rows
from verification.judging.record import cell_key

LONG_T = (16384, 131072, 262144, 1048576)


def _long(backend, route, name, T, o, state=None, status="pass", H=12, lb=-5.0, state_name="final_state", **params):
    """A record of case long/<name>: o (and the state tensor, if given) at rel-L2 ``o`` / ``state``,
    baselines at half of them."""
    tensors = {"o": {"err": o, "threshold": 4 * o, "margin": 0.25, "baseline_err": o / 2}}
    metrics = {"o": {"rel_l2": o}}
    if state is not None:
        tensors[state_name] = {"err": state, "threshold": 4 * state, "margin": 0.25, "baseline_err": state / 2}
        metrics[state_name] = {"rel_l2": state}
    return {"key": cell_key(backend, route, f"long/{name}"), "backend": backend, "route": route, "recipe": "flashkda",
            "case": f"long/{name}", "suite": "long", "seed": 1, "status": status, "reason": "",
            "params": {"T": T, "H": H, "lb": lb, "long": True, **params},
            "shape": {"B": 1, "T": T, "H": H, "HV": H, "K": 128, "V": 128, "N": 1},
            "tensors": tensors, "metrics": metrics, "margin": 0.25, "timings": {}, "repro": ""}


def long_records():
    """Two routes over the long suite's cases: errors grow with T (more for lb -0.05)."""
    recs = []
    for route, scale in (("flashkda", 1.0), ("seg:cps=4", 1.3)):
        for lb, slope in ((-5.0, 0.05), (-0.05, 0.25)):
            for i, T in enumerate(LONG_T):
                o = scale * 3e-3 * (1 + slope * i)
                st = "fail" if route != "flashkda" and lb == -0.05 and T == LONG_T[-1] else "pass"
                recs.append(_long("triton", route, f"T{T}-H12-lb{lb:g}", T, o, state=2 * o, status=st, lb=lb))
            recs.append(_long("triton", route, f"T131072-H96-lb{lb:g}", 131072, scale * 3.2e-3, state=6e-3, H=96, lb=lb))
            lens = [524288] + [64] * 64
            recs.append(_long("triton", route, f"varlen-524288+64-H12-lb{lb:g}", sum(lens), scale * 3.4e-3,
                              state_name="state_cache", state=7e-3, lb=lb, lens=lens))
        recs.append(_long("triton", route, "key-cos-0.85-0.97-T1048576-H12-lb-0.05", 1048576, scale * 5e-3, state=1e-2,
                          lb=-0.05, key_cos=[0.85, 0.97], status="known-fail" if route == "flashkda" else "pass"))
    return recs


def test_the_plot_is_written_with_long_records_and_its_table_follows_it(tmp_path):
    paths = write_report(tmp_path, records=long_records(), provenance={})
    assert "long_context" in paths["plots"]
    assert paths["plots"]["long_context"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    plots = md.split("## Plots", 1)[1].split("\n## ", 1)[0]
    assert "![long_context](plots/long_context.png)" in plots
    assert plots.index("![long_context]") < plots.index("| route | gate | H | T small | T large |")
    assert "| triton:flashkda | lb -5 | 12 | 16K | 1M |" in plots
    assert "H | 96" not in plots and "| 96 |" not in plots            # one T only: no growth row
    assert "Long context (long_context.png)" in paths["html"].read_text()


def test_no_long_records_no_file_and_no_table(tmp_path):
    smoke = [{**r, "case": r["case"].replace("long/", "smoke/"), "key": r["key"].replace("long/", "smoke/")}
             for r in long_records()]
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "long_context.png").write_bytes(b"stale")
    paths = write_report(tmp_path, records=smoke, provenance={})
    assert "long_context" not in paths["plots"] and not (tmp_path / "plots" / "long_context.png").exists()
    md = paths["md"].read_text()
    assert "long_context" not in md and "growth" not in md
    assert long_context_figure(smoke) is None and long_growth_rows(smoke) == []


def test_growth_is_the_ratio_of_the_largest_to_the_smallest_T():
    recs = [_long("emu", "r", "T16384-H12-lb-5", 16384, 2e-3, state=1e-3),
            _long("emu", "r", "T262144-H12-lb-5", 262144, 4e-3, state=1.5e-3),
            _long("emu", "r", "T1048576-H12-lb-5", 1048576, 5e-3, state=4e-3)]
    (row,) = long_growth_rows(recs)
    assert row == ["emu:r", "lb -5", "12", "16K", "1M", "0.002", "0.005", "2.5", "0.001", "0.004", "4"]


def test_a_record_without_a_state_tensor_does_not_break_it(tmp_path):
    recs = [_long("emu", "r", "T16384-H12-lb-5", 16384, 2e-3),
            _long("emu", "r", "T1048576-H12-lb-5", 1048576, 6e-3, state=4e-3)]
    (row,) = long_growth_rows(recs)
    assert row[5:] == ["0.002", "0.006", "3", "–", "0.004", "–"]
    no_state = [_long("emu", "r", f"T{T}-H12-lb-5", T, 2e-3) for T in LONG_T]
    paths = write_report(tmp_path, records=no_state, provenance={})
    assert "long_context" in paths["plots"]
    assert long_growth_rows(no_state)[0][-3:] == ["–", "–", "–"]


def test_the_axes_are_log_with_T_ticks_and_one_line_per_route_and_gate():
    import matplotlib.pyplot as plt
    fig = long_context_figure(long_records())
    o_ax, st_ax = fig.axes[:2]
    for ax in (o_ax, st_ax):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["16K", "128K", "256K", "1M"]
    # 2 routes x 2 gates x (H12 line + H96 point) coloured, plus a grey baseline under each
    coloured = [ln for ln in o_ax.get_lines() if ln.get_color() != "0.6"]
    assert len(coloured) == 8
    assert {ln.get_linestyle() for ln in coloured} == {"-", "--"}
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"triton:flashkda", "triton:seg:cps=4", "failing cell", "known-fail cell"} <= set(legend)
    assert any(t.startswith("varlen pack") for t in legend) and any(t.startswith("key-cos") for t in legend)
    plt.close(fig)


@pytest.mark.parametrize("status", ["skipped", "crashed"])
def test_unjudged_long_cells_are_left_off(status):
    recs = [_long("emu", "r", "T16384-H12-lb-5", 16384, 2e-3, status=status)]
    assert long_context_figure(recs) is None
