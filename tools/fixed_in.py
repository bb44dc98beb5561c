"""Recheck the findings register on new builds: which known failures a build fixes.

    python tools/fixed_in.py cases --backend moonshot
        one line per known failure of that backend: the `kda-verify run` arguments of its shrink
        repro (--route R --suite S --case C [--fuzz-n N]), tab-separated after the entry's line
    python tools/fixed_in.py verdict RESULTS_DIR... [--write]
        reads every RESULTS_DIR/results.jsonl (kda-verify run output, any builds), and for each
        known failure and each backend version that ran one of its cells: "fixed in" when every
        judged cell passed, "still fails in" when one failed (fail, known-fail, mistrusted,
        crashed); prints the fixed-in / still-fails-in fields per entry, and with --write puts
        them into tolerances.yaml (replacing earlier values of those two fields only)
    python tools/fixed_in.py recipes [--route moonshot] [--recipes moonshot,moonshot-fwdsub] [--write]
        the emulator's predictions: for each known failure of backend emulator whose route starts with
        --route, runs its shrink repro's case on the CPU with each recipe of --recipes (emulator routes,
        judged as `kda-verify run` judges them) and fills fixed-in / still-fails-in in the recipes'
        terms (RECIPE_BUILDS, e.g. "recipe moonshot-fwdsub (7afb9f45's inverse)"): fixed where the
        cell passes, still failing where it fails (fail, known-fail, mistrusted, crashed, error)

A version names the build (``backend_version`` of the records, e.g. "flash_kda 0.0.1+1ce47ea.neumann
(recipe moonshot, ...)": the text before " (" is kept).  Exit 0; 2 on bad input (one line).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verification.judging.record import read_records  # noqa: E402
from verification.judging.tolerances import load_tolerances  # noqa: E402

FAILED = ("fail", "known-fail", "mistrusted", "crashed")
TOL = ROOT / "verification" / "judging" / "tolerances.yaml"
# an emulator recipe, named as a build of the kernel it predicts
RECIPE_BUILDS = {"moonshot": "recipe moonshot (1ce47ea's fp16 Neumann inverse)",
                 "moonshot-fwdsub": "recipe moonshot-fwdsub (7afb9f45's inverse)"}


def repro_args(shrink: str) -> list:
    """The `kda-verify run` arguments of a shrink command (route, suite, case, fuzz-n)."""
    words = shlex.split(shrink)
    opt = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
    case = opt.get("--case", "")
    out = ["--route", opt["--route"]] if "--route" in opt else []
    out += ["--suite", case.split("/", 1)[0], "--case", case]
    if "--fuzz-n" in opt:
        out += ["--fuzz-n", opt["--fuzz-n"]]
    return out


def build_name(version: str) -> str:
    return (version or "unknown").split(" (", 1)[0].strip()


def verdicts(dirs, db) -> dict:
    """{entry line: {"fixed": [builds], "fails": [builds]}} over the records of ``dirs``."""
    records = []
    for d in dirs:
        f = Path(d) / "results.jsonl"
        if not f.is_file():
            raise SystemExit(f"RESULTS_DIR: expected a kda-verify run directory with results.jsonl, got '{d}'")
        records += read_records(f)
    out = {}
    for kf in db.known_failures:
        seen = {}
        for r in records:
            if r.status not in FAILED + ("pass",) or not kf.matches(r.backend, r.route, r.case, r.params):
                continue
            claimed = (r.extra.get("known_failure") or {}).get("line")
            if r.status == "known-fail" and claimed != kf.line:
                continue        # excused by another entry that also matches: that entry's failure, not this one's
            b = build_name(r.backend_version)
            seen[b] = seen.get(b, False) or r.status in FAILED
        if seen:
            out[kf.line] = {"fixed": sorted(b for b, bad in seen.items() if not bad),
                            "fails": sorted(b for b, bad in seen.items() if bad)}
    return out


def recipe_cells(kf, recipes, device: str = "cpu", caches=None) -> dict:
    """{recipe: the run_cell record of known failure ``kf``'s shrink repro on the emulator route of
    that recipe} (the case its shrink command names, with its --fuzz-n); ``caches``: a (TruthCache,
    BaselineCache) pair shared across calls (entries with one repro case compute its truth once)."""
    from verification.running.cases import get_case
    from verification.judging.baselines import BaselineCache
    from verification.running.run_cell import TruthCache, run_cell
    from verification.running.run_select import as_loaded
    words = repro_args(kf.shrink)
    case_id = words[words.index("--case") + 1]
    n = int(words[words.index("--fuzz-n") + 1]) if "--fuzz-n" in words else None
    case = get_case(case_id, n=n)
    backend = as_loaded("emulator")
    routes = {r.name: r for r in backend.backend.routes()}
    truth, base = caches or (TruthCache(device=device), BaselineCache())
    db = load_tolerances()
    out = {}
    for name in recipes:
        if name not in routes:
            raise SystemExit(f"--recipes: expected emulator routes ({', '.join(routes)}), got {name!r}")
        out[name] = run_cell(backend, routes[name], case, truth, base, db, device)
    return out


def recipe_verdicts(records: dict) -> dict:
    """{"fixed": [builds], "fails": [builds]} from recipe_cells' records, in RECIPE_BUILDS' names."""
    res = {"fixed": [], "fails": []}
    for name, rec in records.items():
        if rec.status in ("pass",) + FAILED + ("error",):
            res["fixed" if rec.status == "pass" else "fails"].append(RECIPE_BUILDS.get(name, f"recipe {name}"))
    return res


def write_fields(text: str, line: int, fields: dict) -> str:
    """tolerances.yaml's text with the known-failure entry that starts at ``line`` (1-based) given
    ``fields`` ({yaml key: value}); earlier values of those keys in that entry are replaced."""
    lines = text.split("\n")
    start = line - 1
    indent = len(lines[start]) - len(lines[start].lstrip(" "))
    end = start + 1
    while end < len(lines) and lines[end].strip() and (len(lines[end]) - len(lines[end].lstrip(" "))) > indent:
        end += 1
    body = [ln for ln in lines[start:end] if ln.strip().split(":", 1)[0] not in fields]
    pad = " " * (indent + 2)
    body += [f'{pad}{k}: "{v}"' for k, v in fields.items() if v]
    return "\n".join(lines[:start] + body + lines[end:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/fixed_in.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases")
    c.add_argument("--backend", required=True)
    v = sub.add_parser("verdict")
    v.add_argument("dirs", nargs="+")
    v.add_argument("--write", action="store_true")
    r = sub.add_parser("recipes")
    r.add_argument("--route", default="moonshot")
    r.add_argument("--recipes", default="moonshot,moonshot-fwdsub")
    r.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    db = load_tolerances()
    if a.cmd == "recipes":
        return _recipes(a, db)
    if a.cmd == "cases":
        for kf in db.known_failures:
            if kf.backend == a.backend and kf.shrink:
                print(f"{kf.line}\t" + " ".join(shlex.quote(x) for x in repro_args(kf.shrink)))
        return 0
    try:
        res = verdicts(a.dirs, db)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    text = TOL.read_text(encoding="utf-8")
    by_line = {kf.line: kf for kf in db.known_failures}
    for line in sorted(res, reverse=True):           # bottom up: earlier line numbers stay valid
        kf, r = by_line[line], res[line]
        fields = {"fixed-in": "; ".join(r["fixed"]), "still-fails-in": "; ".join(r["fails"])}
        print(f"tolerances.yaml:{line} {kf.backend} / {kf.route} / {kf.case}"
              + (f" ({kf.describe_params()})" if kf.params else ""))
        for k, val in fields.items():
            print(f"    {k}: {val or '-'}")
        text = write_fields(text, line, fields)
    if not res:
        print("no record matches a known failure", file=sys.stderr)
    if a.write and res:
        TOL.write_text(text, encoding="utf-8")
        print(f"wrote {len(res)} entries into {TOL}")
    return 0


def _recipes(a, db) -> int:
    entries = [kf for kf in db.known_failures if kf.backend == "emulator" and kf.route.startswith(a.route)]
    if not entries:
        print(f"--route: expected the route of an emulator known failure, got {a.route!r} (none matches)",
              file=sys.stderr)
        return 2
    recipes = [x for x in a.recipes.split(",") if x]
    from verification.judging.baselines import BaselineCache
    from verification.running.run_cell import TruthCache
    caches = (TruthCache(device="cpu"), BaselineCache())
    text = TOL.read_text(encoding="utf-8")
    for kf in sorted(entries, key=lambda k: -k.line):        # bottom up: earlier line numbers stay valid
        try:
            records = recipe_cells(kf, recipes, caches=caches)
        except SystemExit as e:
            print(e, file=sys.stderr)
            return 2
        r = recipe_verdicts(records)
        fields = {"fixed-in": "; ".join(r["fixed"]), "still-fails-in": "; ".join(r["fails"])}
        print(f"tolerances.yaml:{kf.line} emulator / {kf.route} / {kf.case}"
              + (f" ({kf.describe_params()})" if kf.params else ""))
        for name, rec in records.items():
            print(f"    {name}: {rec['status']}  {rec.get('reason', '')[:160]}")
        for k, val in fields.items():
            print(f"    {k}: {val or '-'}")
        text = write_fields(text, kf.line, fields)
    if a.write:
        TOL.write_text(text, encoding="utf-8")
        print(f"wrote {len(entries)} entries into {TOL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
