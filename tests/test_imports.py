"""The runtime packages keep no re-export aliases: a name a module imports at module level
(``from X import name``) is one that module uses, so every importer names the real home of what
it imports and a module can move without a shim left behind.

A package's ``__init__.py`` is its public API and is not checked.  The exceptions below are
whole modules whose re-exports are their purpose (each with its reason); anything else unused
fails, naming the file, line and name."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kda_ref", "kda_kernels", "kda_verify", "verification")

EXCEPTIONS = {
    # the index of every Triton kernel, by the pass that launches it (its docstring)
    "kda_kernels/triton/kernels.py": "every name",
    # the forward's facade: `forward as fw` in isa.py, backend.py and bench.py reads the passes'
    # constants and entry points through it; `from . import kernels` builds the kernels
    "kda_kernels/triton/forward.py": "every name",
    # the serving judge re-exports the slice constants of verdict.py its callers read
    "verification/serving/judge.py": {"NEGLIGIBLE_SLICE"},
}


def unused_imports(path: Path) -> list:
    """(line, name) of each module-level ``from X import name`` the module never uses."""
    tree = ast.parse(path.read_text())
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found = []
    for node in tree.body:
        for st in (node.body if isinstance(node, ast.Try) else [node]):
            if isinstance(st, ast.ImportFrom) and st.module != "__future__":
                found += [(st.lineno, a.asname or a.name) for a in st.names if (a.asname or a.name) not in used]
    return found


def test_no_module_re_exports_what_it_imports():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" or EXCEPTIONS.get(rel) == "every name":
                continue
            bad += [f"{rel}:{line}: {name}" for line, name in unused_imports(path)
                    if name not in EXCEPTIONS.get(rel, set())]
    assert not bad, "imported but unused (a re-export: import it from its home instead):\n" + "\n".join(bad)


THROUGH_EXCEPTIONS: dict = {}      # none left


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_importers_name_the_home_of_what_they_import():
    """No module, test or tool imports a name from a module of the packages that itself only
    imports it (e.g. ``encode`` of verification.judging.record taken through another module that imports it): the importer names the module that defines it.  A package's __init__ and
    the facades in EXCEPTIONS are homes by design."""
    borrowed = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" or EXCEPTIONS.get(rel) == "every name":
                continue
            names = set()
            for node in ast.parse(path.read_text()).body:
                for st in (node.body if isinstance(node, ast.Try) else [node]):
                    if isinstance(st, ast.ImportFrom) and st.module != "__future__":
                        names |= {a.asname or a.name for a in st.names}
            borrowed[_module_name(path)] = names
    bad = []
    for folder in (*PACKAGES, "tests", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in borrowed:
                    bad += [f"{rel}:{node.lineno}: {a.name} from {node.module}" for a in node.names
                            if a.name in borrowed[node.module]
                            and (node.module, a.name) not in THROUGH_EXCEPTIONS.get(rel, set())]
    assert not bad, "imported through a module that only imports it (import it from its home):\n" + "\n".join(bad)


def test_the_check_sees_an_unused_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from __future__ import annotations\n\nfrom os import path, sep  # noqa: F401\n\nprint(sep)\n")
    assert unused_imports(p) == [(3, "path")]


def test_the_aiter_stand_ins_exist_once():
    """The stand-ins aiter is imported with on a machine without its GPU (an ``arch_info``
    module, a driver answering only the target) are verification/investigating/aiter_isa.py's, which
    ``kda-verify isa --backend aiter`` needs at run time; tools/aiter_interpret.py and the
    interpreter tests take them from there (the tests through the tool's loader)."""
    import importlib.util

    from verification.investigating.aiter_isa import ARCH_INFO
    makers = []
    for folder in ("verification", "kda_kernels", "tools", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            text = path.read_text()
            if ("class _TargetOnlyDriver" in text or "ModuleType(ARCH_INFO)" in text
                    or f'ModuleType("{ARCH_INFO}")' in text):
                makers.append(path.relative_to(ROOT).as_posix())
    assert makers == ["verification/investigating/aiter_isa.py"], makers
    spec = importlib.util.spec_from_file_location("aiter_interpret", ROOT / "tools" / "aiter_interpret.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    arch = tool._stand_ins()[ARCH_INFO]
    assert arch.get_arch() == tool.STAND_IN_ARCH == "gfx942" and not arch.is_gluon_avail()


# Function-level imports (docs/design.md, "Imports"): a repository or standard-library module is
# imported at module level; third-party imports are not checked here (the optional ones stay lazy).
# Each kept one is a (file, module) pair below, with its reason; "*" is a whole file.
LAZY_ALLOWED = {
    # the pytest plugin loads into every pytest session: its hooks import the harness and torch
    ("verification/pytest_plugin.py", "*"),
    # the CLI imports the command modules when it builds the parser
    ("verification/cli.py", "verification.commands"),
    # kda_kernels.triton builds its kernels at import, after TRITON_INTERPRET is decided
    ("verification/investigating/aiter_isa.py", "kda_kernels.triton.isa"),
    ("verification/investigating/aiter_kda_isa.py", "kda_kernels.triton.isa"),
    ("verification/investigating/bench.py", "kda_kernels.triton"),
    ("verification/investigating/bench.py", "kda_kernels.triton.routes"),
    ("verification/investigating/mutate.py", "kda_kernels.triton.backend"),
    # import cycle: aiter_kda_isa builds on aiter_isa's AiterVariant, _Recorder, _patched
    ("verification/investigating/aiter_isa.py", "verification.investigating"),   # its aiter_kda_isa
    # optional dependency: kda_ref.mp_ref imports mpmath (the test extra)
    ("verification/investigating/selfcheck.py", "kda_ref.mp_ref"),
    # a probe of what is installed: fcntl is absent on some platforms
    ("verification/running/room.py", "fcntl"),
    # a fallback for a missing verification.running.cases (dead since cases.py is in the package;
    # tests/test_triton_bench.py reads bench.DEFAULT_SHAPES): left for bench's own rewrite
    ("verification/investigating/bench.py", "verification.running.cases"),
}
LOCAL_TOPS = set(PACKAGES)
# the parser imports every command module (for its arguments), so --help would import everything a
# command runs: a command module imports the repository's machinery in its functions (the standard
# library at the top)
COMMANDS = "verification/commands/"


def function_level_imports(path: Path, rel: str) -> list:
    """(line, module) of each import inside a function body of the file at ``path`` (``rel`` is its
    path from the repository root, for resolving relative imports), module names absolute."""
    tree = ast.parse(path.read_text())
    package = rel[:-3].split("/")[:-1]
    found = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found |= {(node.lineno, a.name) for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    base = package[:len(package) - node.level + 1] if node.level else []
                    mod = ".".join(base + ([node.module] if node.module else []))
                    if node.module is None:          # from . import x: x is a module of the package
                        found |= {(node.lineno, f"{mod}.{a.name}") for a in node.names}
                    else:
                        found.add((node.lineno, mod))
    return sorted(found)


def lazy_violations(rel: str, imports: list) -> list:
    """The function-level imports of a repository or standard-library module not allowed for ``rel``."""
    if (rel, "*") in LAZY_ALLOWED:
        return []
    command = rel.startswith(COMMANDS)
    return [f"{rel}:{line}: {mod}" for line, mod in imports
            if (mod.split(".")[0] in LOCAL_TOPS and not command or mod.split(".")[0] in sys.stdlib_module_names)
            and (rel, mod) not in LAZY_ALLOWED]


def test_imports_are_at_module_level():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad += lazy_violations(rel, function_level_imports(path, rel))
    assert not bad, ("imported inside a function (move it to the top of the module, or add the pair to "
                     "LAZY_ALLOWED with its reason and docs/design.md's Imports section):\n" + "\n".join(bad))


def test_the_check_sees_a_function_level_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\n\n\ndef f():\n    import json\n    from . import sibling\n"
                 "    from ..judging.metrics import compare\n    import torch\n    return os, json\n")
    rel = "verification/serving/m.py"
    found = function_level_imports(p, rel)
    assert found == [(5, "json"), (6, "verification.serving.sibling"), (7, "verification.judging.metrics"),
                     (8, "torch")]
    assert lazy_violations(rel, found) == [f"{rel}:5: json", f"{rel}:6: verification.serving.sibling",
                                           f"{rel}:7: verification.judging.metrics"]
    assert lazy_violations("verification/commands/m.py", found) == ["verification/commands/m.py:5: json"]
    assert lazy_violations("verification/pytest_plugin.py", found) == []
