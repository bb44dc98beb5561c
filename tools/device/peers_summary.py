"""The summary of a tools/device/nvidia_peers_job.sh output directory, as markdown on stdout.

    python3 tools/device/peers_summary.py OUT_DIR

For every results.jsonl under OUT_DIR (kda-verify run directories, at any depth): cells per backend,
route and status, and every failing cell (fail, mistrusted, crashed, error) with its reason; for every
*checks.jsonl (tools/device/peer_checks.py): the hidden-bug controls (caught or not, the kernel's own
status on that case) and the invariances (ok, kind, diff); fix/verdict.txt (tools/fixed_in.py verdict)
as it is; bench*.json (kda-verify bench --json-out) as one row per backend and shape.  Reads what is
there and says what is missing; exit 0, 2 when OUT_DIR is not a directory (one line).
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

BAD = ("fail", "mistrusted", "crashed", "error")


def _lines(path: Path):
    for ln in path.read_text(errors="replace").splitlines():
        ln = ln.strip()
        if ln.startswith("{"):
            try:
                yield json.loads(ln)
            except json.JSONDecodeError:
                continue


def results(out: Path) -> list[str]:
    md = []
    for f in sorted(out.rglob("results.jsonl")):
        recs = [r for r in _lines(f) if "status" in r and "case" in r]
        if not recs:
            continue
        md.append(f"### {f.parent.relative_to(out)} ({len(recs)} cells)")
        by = collections.Counter((r.get("backend"), r.get("route"), r.get("status")) for r in recs)
        vers = sorted({str(r.get("backend_version", "")).split(" (")[0] for r in recs} - {""})
        if vers:
            md.append("versions: " + "; ".join(vers))
        md.append("| backend | route | status | cells |")
        md.append("|---|---|---|---|")
        for (b, rt, st), n in sorted(by.items(), key=lambda kv: tuple(map(str, kv[0]))):
            md.append(f"| {b} | {rt} | {st} | {n} |")
        bad = [r for r in recs if r.get("status") in BAD]
        for r in bad[:40]:
            md.append(f"- {r.get('status')}: {r.get('backend')} {r.get('route')} {r.get('case')}: "
                      f"{str(r.get('reason', ''))[:300]}")
        if len(bad) > 40:
            md.append(f"- ... {len(bad) - 40} more failing cells")
        kf = [r for r in recs if r.get("status") == "known-fail"]
        for r in kf[:10]:
            md.append(f"- known-fail: {r.get('backend')} {r.get('route')} {r.get('case')} "
                      f"(tolerances.yaml:{(r.get('known_failure') or r.get('extra', {}).get('known_failure') or {}).get('line', '?')})")
        md.append("")
    return md


def checks(out: Path) -> list[str]:
    md = []
    for f in sorted(out.rglob("*checks.jsonl")):
        rows = list(_lines(f))
        if not rows:
            continue
        md.append(f"### {f.relative_to(out)}")
        for r in rows:
            head = f"{r.get('backend')} {r.get('route', '')}"
            if r.get("what") == "backend":
                md.append(f"- {head}: not available: {r.get('status')}")
            elif "error" in r:
                md.append(f"- {head} {r.get('what')} {r.get('name')}: raised {r['error']}")
            elif "status" in r and r.get("what") in ("control", "invariance"):
                md.append(f"- {head} {r.get('what')} {r.get('name')}: {r['status']}")
            elif r.get("what") == "control":
                md.append(f"- {head} control {r['name']} on {r.get('case')}: "
                          f"{'caught' if r.get('caught') else 'NOT caught'} ({r.get('control_status')}, failing "
                          f"{','.join(r.get('failing', [])) or '-'}{'' if r.get('changes_recipe') else '; changes nothing in this recipe'}); "
                          f"kernel {r.get('kernel_status')}")
            elif r.get("what") == "invariance":
                md.append(f"- {head} invariance {r['name']} ({r.get('shape')}): {'ok' if r.get('ok') else 'VIOLATED'} "
                          f"{r.get('kind')} diff {r.get('diff')}")
        md.append("")
    return md


def bench(out: Path) -> list[str]:
    md = []
    for f in sorted(out.rglob("bench*.json")):
        try:
            data = json.loads(f.read_text())
        except (json.JSONDecodeError, OSError):
            md.append(f"### {f.name}: unreadable")
            continue
        rows = data if isinstance(data, list) else data.get("results", [])
        md.append(f"### {f.relative_to(out)}")
        md.append("| backend | route | B x T x H | us | error |")
        md.append("|---|---|---|---|---|")
        for r in rows:
            shape = "x".join(str(r.get(k, "?")) for k in ("B", "T", "H"))
            t = r.get("time_us")
            md.append(f"| {r.get('backend')} | {r.get('route')} | {shape} | "
                      f"{'' if t is None else f'{t:.1f}'} | {str(r.get('error', ''))[:80]} |")
        md.append("")
    return md


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"OUT_DIR: expected one directory, got {' '.join(argv) or 'none'}", file=sys.stderr)
        return 2
    out = Path(argv[0])
    md = [f"# {out.name}: summary", ""]
    for title, part in (("Matrix and repro runs", results(out)), ("Hidden-bug controls and invariances", checks(out)),
                        ("Bench", bench(out))):
        md += [f"## {title}", ""] + (part or ["(none under this directory)", ""])
    for v in sorted(out.rglob("verdict.txt")):
        md += [f"## {v.relative_to(out)}", "", "```", v.read_text(errors="replace").strip(), "```", ""]
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
