"""The report: files, self-contained HTML, strict JSON, merged per-worker results, plots."""
import html
import json
import math
import re

import pytest

from verification.reporting.report_load import load_results
from verification.reporting.report_render import write_report
from verification.reporting.report_summary import summarize
from verification.judging.record import append_record, cell_key


def _rec(backend, route, case, status, err, base, T, margin=None, curve=None, reason=""):
    thr = 2 * base + 1e-6
    m = err / thr if margin is None else margin
    return {
        "key": cell_key(backend, route, case), "backend": backend, "backend_spec": backend, "route": route,
        "recipe": "flashkda", "case": case, "suite": case.split("/")[0], "seed": 7, "status": status,
        "reason": reason, "shape": {"B": 1, "T": T, "H": 2, "HV": 2, "K": 128, "V": 128, "N": 1},
        "tensors": {"o": {"err": err, "threshold": thr, "margin": m, "baseline_err": base,
                          "tolerance_key": f"{backend}/{route}/bf16/o"}},
        "metrics": {"o": {"rel_l2": err, "tail_rel_l2": err, "chunk_rel_l2": curve or [err] * max(1, T // 32)}},
        "baseline": {"o": {"rel_l2": base}}, "margin": m, "timings": {"kernel_s": 0.001},
        "repro": f"kda-verify run --backend {backend} --route {route} --suite smoke --case {case} --out DIR",
    }


@pytest.fixture
def records():
    return [
        _rec("emulator", "flashkda", "smoke/a", "pass", 3e-3, 2.5e-3, 64),
        _rec("emulator", "flashkda", "smoke/b", "pass", 4e-3, 2.6e-3, 256),
        _rec("triton", "seg:cps=4", "smoke/a", "fail", 9e-2, 2.5e-3, 64, curve=[1e-3, 5e-2, 9e-2],
             reason="o: err 0.09 > threshold"),
        _rec("triton", "seg:cps=4", "smoke/b", "pass", 3e-3, 2.6e-3, 256),
        {**_rec("triton", "unseg", "smoke/a", "crashed", math.nan, 2.5e-3, 64), "tensors": {}, "metrics": {},
         "margin": None, "reason": "child process killed by signal SIGABRT", "stderr_tail": "Fatal: abort\n"},
        {**_rec("fla", "chunk:exact", "smoke/a", "skipped", math.nan, 2.5e-3, 64), "tensors": {}, "metrics": {},
         "margin": None, "reason": "backend unavailable: no GPU"},
        _rec("triton", "unseg", "smoke/b", "fail", math.nan, 2.6e-3, 256, margin=math.nan, reason="o: NaN"),
    ]


def test_report_files_exist_and_html_is_self_contained(tmp_path, records):
    for r in records:
        append_record(tmp_path / "results.jsonl", r)
    paths = write_report(tmp_path)
    for k in ("md", "html", "json"):
        assert paths[k].exists() and paths[k].stat().st_size > 0
    assert set(paths["plots"]) == {"error_vs_T", "worst_chunks", "margin_heatmap"}
    for p in paths["plots"].values():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 3
    # no external asset: every src/href is inline data, no <link>, no <script src>
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<link" not in page and "<script" not in page
    # the failing cells, their repro lines and the crash's stderr appear
    assert "seg:cps=4" in page and "SIGABRT" in page and "Fatal: abort" in page
    assert f"--out {tmp_path}/repro" in page
    md = paths["md"].read_text()
    assert "**VERIFIED 5 of 7 cells: 3 pass, 2 fail, 1 crashed, 1 skipped**" in md
    assert "kda-verify run --backend triton --route seg:cps=4" in md and "ALL PASS" not in md + page
    assert "![margin_heatmap](plots/margin_heatmap.png)" in md


def test_report_json_is_strict_and_complete(tmp_path, records):
    for r in records:
        append_record(tmp_path / "results.jsonl", r)
    paths = write_report(tmp_path)
    text = paths["json"].read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["summary"]["counts"]["pass"] == 3 and data["summary"]["counts"]["fail"] == 2
    assert data["summary"]["counts"]["crashed"] == 1 and data["summary"]["counts"]["skipped"] == 1
    assert data["summary"]["ok"] is False and data["summary"]["verified"] == 5
    assert len(data["cells"]) == len(records)
    assert data["summary"]["per_route"]["triton:unseg"]["worst_margin"] == "NaN"


def test_per_worker_results_merge_last_record_wins(tmp_path, records):
    append_record(tmp_path / "results-gw0.jsonl", records[0])
    append_record(tmp_path / "results-gw1.jsonl", records[1])
    append_record(tmp_path / "results-gw1.jsonl", {**records[0], "status": "fail"})
    merged = load_results(tmp_path)
    assert [r["case"] for r in merged] == ["smoke/a", "smoke/b"]
    assert merged[0]["status"] == "fail"


def test_the_latest_record_of_a_cell_wins_by_its_time_not_by_file_order(tmp_path, records):
    append_record(tmp_path / "results-gw0.jsonl", {**records[0], "status": "pass", "time_utc": "2026-12-02T03:00:05Z"})
    append_record(tmp_path / "results-gw1.jsonl", {**records[0], "status": "fail", "time_utc": "2026-12-02T03:00:01Z"})
    assert load_results(tmp_path)[0]["status"] == "pass"


def test_report_merges_several_directories_into_out(tmp_path, records, capsys):
    """A suite run in parts: every cell once in OUT/results.jsonl, the later run's record of a
    cell run twice, both invocations' provenance in OUT/run.json, the report of the merge."""
    from verification.cli import main
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for d, recs, t in ((a, records[:2], "2026-12-02T01:00:00Z"), (b, records[1:3], "2026-12-02T02:00:00Z")):
        d.mkdir()
        for r in recs:
            append_record(d / "results-gw0.jsonl", {**r, "time_utc": t, "reason": f"from {d.name}"})
        (d / "run.json").write_text(json.dumps({"runs": [{"git": {"commit": d.name}}]}))
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert "merged 3 cells of 2 directories" in capsys.readouterr().out
    merged = load_results(out)
    assert [r["key"] for r in merged] == [r["key"] for r in records[:3]]
    assert [r["reason"] for r in merged] == ["from a", "from b", "from b"]
    assert [r["git"]["commit"] for r in json.loads((out / "run.json").read_text())["runs"]] == ["a", "b"]
    assert (out / "report.md").exists() and not (a / "report.md").exists()
    for argv, said in ((["report", str(a), str(b)], "--out: expected a directory for the merge of 2"),
                       (["report", str(a), str(b), "--out", str(a)], "--out: expected a directory other than"),
                       (["report", str(a), str(b), "--out", str(out)], "--out: expected a directory without results")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err


def test_partial_last_line_is_ignored(tmp_path, records):
    append_record(tmp_path / "results.jsonl", records[0])
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"key": "x|y|z", "sta')
    assert len(load_results(tmp_path)) == 1


def test_summary_of_all_pass_is_ok(records):
    s = summarize([r for r in records if r["status"] in ("pass", "skipped")])
    assert s["ok"] and s["failing"] == 0
    assert s["per_route"]["emulator:flashkda"]["worst_margin"] == pytest.approx(4e-3 / (2 * 2.6e-3 + 1e-6))


def test_report_of_only_skipped_cells_writes_no_empty_plots_and_is_never_green(tmp_path, records):
    skipped = [r for r in records if r["status"] == "skipped"]
    paths = write_report(tmp_path, records=skipped, provenance={"git": {"commit": "abc"}})
    assert "error_vs_T" not in paths["plots"] and "worst_chunks" not in paths["plots"]
    md, page = paths["md"].read_text(), paths["html"].read_text()
    assert "abc" in md
    line = "NOTHING VERIFIED: 1 cells skipped (backend fla unavailable: no GPU)"
    assert f"**{line}**" in md and line in page and "ALL PASS" not in md + page
    assert summarize(skipped)["ok"] is False
    assert 'class="verdict" style="color:#2e7d32"' not in page                # not green


def test_report_command(tmp_path, records, capsys):
    from verification.cli import main
    for r in records:
        append_record(tmp_path / "results-gw0.jsonl", r)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("VERIFIED 5 of 7 cells: 3 pass, 2 fail, 1 crashed, 1 skipped\n")
    assert (tmp_path / "report.html").exists() and (tmp_path / "plots" / "margin_heatmap.png").exists()
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "DIR: expected a results directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert "expected results.jsonl or results-*.jsonl" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- rendering
def _slice_rec(case, status="fail", **kw):
    r = _rec("triton", "seg:cps=4", case, status, 9e-3, 3e-3, 64, reason=kw.pop("reason", "o: err > threshold"))
    r["tensors"]["o"].update({"dtype": kw.pop("dtype", "bf16"), "expected_dtype": "bf16", "tensor_margin": 1.4,
                              "margin": 2.5, "slice": {"where": "sequence 2 head 0", "err": 2.1e-2,
                                                       "baseline_err": 4e-3, "threshold": 8.4e-3, "margin": 2.5}})
    r["tensors"]["final_state"] = {"err": 1e-3, "threshold": 5e-3, "margin": 0.2, "dtype": "fp32",
                                   "expected_dtype": "fp32", "baseline_err": 2e-3}
    r["margin"] = 2.5
    r.update(kw)
    return r


def test_failing_cells_show_the_worst_slice_and_cells_show_dtypes(tmp_path):
    recs = [_slice_rec("smoke/a"), _slice_rec("smoke/b", status="pass", dtype="fp32")]
    paths = write_report(tmp_path, records=recs, provenance={})
    md, page = paths["md"].read_text(), paths["html"].read_text()
    fail_table = md.split("## Failing cells", 1)[1].split("\n## ", 1)[0]
    row = next(ln for ln in fail_table.splitlines() if ln.startswith("| fail |"))
    assert row == ("| fail | triton | seg:cps=4 | smoke/a | o | 0.009 | 0.006 | 1.4 | sequence 2 head 0 | 0.021 | "
                   "0.004 | 2.5 |"), row
    assert "<td>sequence 2 head 0</td>" in page
    cells = md.split("## Cells", 1)[1].split("\n## ", 1)[0]
    assert "| o bf16, final_state fp32 |" in cells
    assert "| o fp32 (expected bf16), final_state fp32 |" in cells


def test_out_of_contract_cells_have_their_own_section_and_never_count_as_pass_or_fail(tmp_path):
    ooc = {**_rec("moonshot", "cutlass:state=fp32", "stress/lb-6", "out-of-contract", 0.3, 3e-3, 64),
           "reason": "out of contract (lower_bound -6 outside [-5, 0]); the kernel returned finite values: o rel_l2 0.3"}
    recs = [_rec("moonshot", "cutlass:state=fp32", "smoke/a", "pass", 3e-3, 2.5e-3, 64), ooc]
    s = summarize(recs)
    assert s["headline"] == "VERIFIED 1 of 2 cells: 1 pass, 1 out-of-contract" and s["ok"] and s["failing"] == 0
    assert s["per_route"]["moonshot:cutlass:state=fp32"]["worst_margin"] == pytest.approx(3e-3 / (2 * 2.5e-3 + 1e-6))
    paths = write_report(tmp_path, records=recs, provenance={})
    md, page = paths["md"].read_text(), paths["html"].read_text()
    from verification.reporting.report_render import OUT_OF_CONTRACT as title
    section = md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    assert "stress/lb-6" in section and "the kernel returned finite values" in section
    assert f"<h2>{title}</h2>" in page and "## Failing cells" not in md
    assert "out-of-contract" not in s["headline"].split(":")[1].split(",")[0]      # not among the passes


def test_markdown_and_html_have_the_same_sections_in_the_same_order(tmp_path, records):
    from verification.reporting.report_render import OUT_OF_CONTRACT, SECTIONS
    extra = [{**_rec("emulator", "moonshot", "smoke/c", "known-fail", 3.4, 5e-3, 64), "reason": "known failure: x"},
             {**_rec("moonshot", "cutlass", "smoke/d", "out-of-contract", 0.3, 3e-3, 64), "reason": "out of contract"}]
    paths = write_report(tmp_path, records=records + extra, provenance={"git": {"commit": "abc"}},
                         timing={"started": 0.0, "sums": {}})
    md_titles = re.findall(r"^## (.+)$", paths["md"].read_text(), flags=re.M)
    html_titles = [html.unescape(t) for t in re.findall(r"<h2>(.+?)</h2>", paths["html"].read_text())]
    assert md_titles == html_titles
    assert md_titles == [t for t in SECTIONS if t in md_titles]
    assert {"Failing cells", "Known failures", OUT_OF_CONTRACT, "Skipped (not verified)", "Routes", "Plots",
            "Cells", "Repro", "Provenance"} <= set(md_titles)


@pytest.mark.parametrize("seed", range(5))
def test_clip_never_cuts_mid_word(seed):
    import random

    from verification.reporting.report_summary import clip
    rnd = random.Random(seed)
    words = ["o:", "rel_l2", "0.0103", ">", "threshold", "sequence", "2", "head", "0;", "final_state:", "(tolerance",
             "*/*/bf16/o)", "x" * 30]
    text = " ".join(rnd.choice(words) for _ in range(80))
    for width in (20, 57, 120, 200):
        out = clip(text, width)
        first = text.split(" ")[0]
        assert out.endswith(" …") and (len(out) <= width + 1 or out == first + " …")
        kept, orig = out[:-2].split(" "), text.split(" ")
        assert kept[:-1] == orig[:len(kept) - 1] and kept[-1] == orig[len(kept) - 1].rstrip(",;:"), out
    assert clip("short reason", 200) == "short reason"
    assert clip("a" * 50 + " tail", 20) == "a" * 50 + " …"           # one long word is kept whole


def test_a_long_reason_in_the_cells_table_ends_at_a_word_boundary(tmp_path):
    reason = "final_state: rel_l2 0.0103 > 0.00479 = 2*0.00239+1e-05 (tolerance */*/bf16/final_state); " * 5
    rec = {**_rec("triton", "unseg", "smoke/a", "fail", 9e-3, 3e-3, 64), "reason": reason}
    md = write_report(tmp_path, records=[rec], provenance={})["md"].read_text()
    row = next(ln for ln in md.split("## Cells", 1)[1].splitlines() if ln.startswith("| fail |"))
    cell = row.rstrip(" |").rsplit(" | ", 1)[1]
    assert cell.endswith(" …")
    assert reason.startswith(cell[:-2].replace("\\|", "|")) and reason[len(cell) - 2] == " ", cell


# ---------------------------------------------------------------------------------------- plots
def _varlen_records(n_routes):
    recs = []
    for i in range(n_routes):
        route = f"seg:cps={i}:A=fused:B=prefetch:BW=32:scan=bf16:extra=long-name"
        for case, T in (("smoke/a", 40), ("smoke/b", 64), ("smoke/c", 67), ("smoke/d", 96), ("smoke/e", 97)):
            recs.append(_rec("triton", route, case, "pass", 3e-3 + 1e-4 * i, 3e-3, T))
    return recs


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("n_routes", [3, 24])
def test_error_vs_T_labels_every_T_and_keeps_titles_whole_and_apart(n_routes):
    from verification.reporting.report_plots import error_vs_T_figure
    fig = error_vs_T_figure(_varlen_records(n_routes))
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.axison]
    shown = [[t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()] for ax in axes]
    shown = [x for x in shown if x]
    assert len(shown) >= min(4, len(axes))                 # every column's lowest panel (shared x above it)
    assert all(x == ["40", "64", "67", "96", "97"] for x in shown), shown
    titles = [ax.title for ax in axes if ax.get_title()]
    assert titles and not any("…" in t.get_text() for t in titles)
    assert all(t.get_text().replace("\n", "").startswith("triton:seg:cps=") for t in titles) or n_routes <= 6
    if fig._suptitle is not None:
        sup = fig._suptitle.get_window_extent(r)
        assert not any(_overlap(sup, t.get_window_extent(r)) for t in titles)
    fw, fh = fig.get_size_inches() * fig.dpi
    for t in titles + ([fig._suptitle] if fig._suptitle is not None else []):
        e = t.get_window_extent(r)
        assert e.x0 >= 0 and e.x1 <= fw and e.y0 >= 0 and e.y1 <= fh, t.get_text()
    # the baseline is drawn above the route line (dashed, zorder 4) on a band below it (zorder 1)
    ax = axes[0]
    zs = sorted(line.get_zorder() for line in ax.get_lines())
    assert zs[0] < 3 <= zs[-2] < zs[-1]
    import matplotlib.pyplot as plt
    plt.close(fig)


def _pixels(path):
    import numpy as np
    from matplotlib.image import imread
    img = imread(path)[..., :3]
    return np.round(img * 255).astype(int).reshape(-1, 3)


def test_margin_heatmap_draws_known_fail_in_the_html_colour_and_its_title_fits(tmp_path):
    import numpy as np

    from verification.reporting.report_plots import STATUS_COLOURS, margin_heatmap_figure, plot_margin_heatmap
    recs = [_rec("emulator", "moonshot", "smoke/correlated-weak-lb-0.01", "known-fail", 3.4, 5e-3, 64, margin=264.0),
            _rec("emulator", "flashkda", "smoke/correlated-weak-lb-0.01", "pass", 3e-3, 3e-3, 64)]
    p = plot_margin_heatmap(recs, tmp_path / "h.png")
    want = np.array([int(STATUS_COLOURS["known-fail"][k:k + 2], 16) for k in (1, 3, 5)])
    px = _pixels(p)
    assert (np.abs(px - want).max(axis=1) <= 2).sum() > 500                # a known-fail cell's worth of it
    fig = margin_heatmap_figure(recs)
    fig.canvas.draw()
    e = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    fw = fig.get_size_inches()[0] * fig.dpi
    assert e.x0 >= 0 and e.x1 <= fw
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "KF 264" in texts
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_worst_chunks_legend_gives_o_margin_and_names_the_other_failing_tensor():
    from verification.reporting.report_plots import worst_chunks_figure
    r = _rec("emulator-bad", "carry_scaled", "smoke/a", "fail", 3e-3, 2.5e-3, 64, curve=[3e-3, 3e-3])
    r["tensors"]["o"]["margin"] = 0.6
    r["tensors"]["final_state"] = {"err": 1e-2, "threshold": 5e-3, "margin": 2.15}
    r["margin"] = 2.15
    fig = worst_chunks_figure([r])
    (text,) = [t.get_text() for t in fig.legends[0].get_texts()]
    assert text == "emulator-bad:carry_scaled  smoke/a: o margin 0.6, cell fail (final_state 2.15)", text
    import matplotlib.pyplot as plt
    plt.close(fig)
