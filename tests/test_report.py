"""The report: files, self-contained HTML, strict JSON, merged per-worker results, plots."""
import json
import math
import re

import pytest

from verification.report import load_results, summarize, write_report
from verification.runner import append_record, cell_key


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
    assert "3 FAILING" in md and "kda-verify run --backend triton --route seg:cps=4" in md
    assert "![margin_heatmap](plots/margin_heatmap.png)" in md


def test_report_json_is_strict_and_complete(tmp_path, records):
    for r in records:
        append_record(tmp_path / "results.jsonl", r)
    paths = write_report(tmp_path)
    text = paths["json"].read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["summary"]["counts"]["pass"] == 3 and data["summary"]["counts"]["fail"] == 2
    assert data["summary"]["counts"]["crashed"] == 1 and data["summary"]["counts"]["skipped"] == 1
    assert data["summary"]["ok"] is False
    assert len(data["cells"]) == len(records)
    assert data["summary"]["per_route"]["triton:unseg"]["worst_margin"] == "NaN"


def test_per_worker_results_merge_last_record_wins(tmp_path, records):
    append_record(tmp_path / "results-gw0.jsonl", records[0])
    append_record(tmp_path / "results-gw1.jsonl", records[1])
    append_record(tmp_path / "results-gw1.jsonl", {**records[0], "status": "fail"})
    merged = load_results(tmp_path)
    assert [r["case"] for r in merged] == ["smoke/a", "smoke/b"]
    assert merged[0]["status"] == "fail"


def test_partial_last_line_is_ignored(tmp_path, records):
    append_record(tmp_path / "results.jsonl", records[0])
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"key": "x|y|z", "sta')
    assert len(load_results(tmp_path)) == 1


def test_summary_of_all_pass_is_ok(records):
    s = summarize([r for r in records if r["status"] in ("pass", "skipped")])
    assert s["ok"] and s["failing"] == 0
    assert s["per_route"]["emulator:flashkda"]["worst_margin"] == pytest.approx(4e-3 / (2 * 2.6e-3 + 1e-6))


def test_report_of_only_skipped_cells_writes_no_empty_plots(tmp_path, records):
    skipped = [r for r in records if r["status"] == "skipped"]
    paths = write_report(tmp_path, records=skipped, provenance={"git": {"commit": "abc"}})
    assert "error_vs_T" not in paths["plots"] and "worst_chunks" not in paths["plots"]
    assert "abc" in paths["md"].read_text()


def test_report_command(tmp_path, records, capsys):
    from verification.cli import main
    for r in records:
        append_record(tmp_path / "results-gw0.jsonl", r)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("7 cells: 3 pass, 2 fail, 1 crashed, 1 skipped")
    assert (tmp_path / "report.html").exists() and (tmp_path / "plots" / "margin_heatmap.png").exists()
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "DIR: expected a results directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert "expected results.jsonl or results-*.jsonl" in capsys.readouterr().err
