"""The repository's own pointers resolve: every docs file and design invariant that code, docs or
scripts name exists in this repository, and every relative link in a Markdown page leads to a file."""
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit

SKIP = {".git", ".venv", "runs", "__pycache__", ".pytest_cache"}
TEXT = {".py", ".md", ".sh", ".sbatch", ".yaml", ".txt", ".ini", ".json"}


def repository_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP]
        out += [Path(folder) / f for f in files if Path(f).suffix in TEXT or f == "run"]
    return out


def test_every_docs_file_named_in_code_docs_or_scripts_exists():
    missing = []
    for path in repository_files():
        for name in re.findall(r"\bdocs/[\w./-]*\w(?![\\\w])", path.read_text(errors="replace")):
            if not (ROOT / name).exists():
                missing.append(f"{path.relative_to(ROOT)} names {name}")
    assert not missing, "\n".join(missing)


def test_no_file_points_at_a_design_document_the_repository_does_not_hold():
    pointers = [str(p.relative_to(ROOT)) for p in repository_files()
                if p.name != "test_repository.py" and re.search(r"(?<![/\w])DESIGN\.md", p.read_text(errors="replace"))]
    assert not pointers, f"these cite DESIGN.md, which is not in the repository (use docs/design.md): {pointers}"


def test_every_invariant_cited_is_defined_in_docs_design_md():
    defined = set(re.findall(r"^\*\*(I\d+) ", (ROOT / "docs" / "design.md").read_text(), flags=re.M))
    assert {f"I{n}" for n in range(1, 22)} <= defined
    cited = []
    for path in repository_files():
        for ids in re.findall(r"docs/design\.md,? (I\d+(?:\s*[-,]\s*I?\d+)*)", path.read_text(errors="replace")):
            cited += re.findall(r"I?(\d+)", ids)
    assert cited, "no citation found: the pattern is broken"
    undefined = sorted({f"I{n}" for n in cited} - defined)
    assert not undefined, f"cited but not defined in docs/design.md: {undefined}"


def test_every_mutant_fits_the_code_and_the_docs_list_the_mutants_as_the_script_prints_them():
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = mutants  # its dataclass looks its module up there
    spec.loader.exec_module(mutants)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mutants.main(["--markdown"]) == 0
    page = (ROOT / "docs" / "tests.md").read_text()
    stale = [line for line in out.getvalue().splitlines() if line not in page]
    assert not stale, f"docs/tests.md's mutant table is not `python scripts/mutants.py --markdown`'s output: {stale[:3]}"
    stale = [m.name for m in mutants.MUTANTS if (ROOT / m.file).read_text().count(m.old) != 1]
    assert not stale, f"mutants whose text no longer occurs exactly once in their file (they no longer fit the code): {stale}"
    design = (ROOT / "docs" / "design.md").read_text()
    stale = [line for line in mutants.invariant_table().splitlines() if line not in design]
    assert not stale, f"docs/design.md's invariant table is not `python scripts/mutants.py --invariants`'s output: {stale[:3]}"


def test_every_section_that_code_or_docs_cite_by_name_exists():
    """A cited section (the page, a comma, the name in double quotes) is a heading `## Name` or a paragraph
    that opens with `**Name.**`."""
    missing = []
    for path in repository_files():
        for page, name in re.findall(r'docs/(\w+)\.md, "([^"]+)"', path.read_text(errors="replace")):
            text = (ROOT / "docs" / f"{page}.md").read_text() if (ROOT / "docs" / f"{page}.md").exists() else ""
            if not re.search(rf"^#+ {re.escape(name)}\s*$|^\*\*{re.escape(name)}\.?\*\*", text, flags=re.M):
                missing.append(f"{path.relative_to(ROOT)}: docs/{page}.md, \"{name}\"")
    assert not missing, f"cited sections that do not exist: {sorted(set(missing))}"


def test_every_relative_link_in_a_markdown_page_leads_to_a_file():
    broken = []
    for page in [p for p in repository_files() if p.suffix == ".md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)


def test_a_unit_test_cannot_start_a_process():
    """The guard in conftest.py that keeps the unit tier honest (docs/tests.md, "Tiers")."""
    import subprocess

    with pytest.raises(AssertionError, match="is marked unit but starts a process: mark it e2e"):
        subprocess.run(["true"])


# ---------------------------------------------------------------- the house (docs/design.md, "The floors")
ROOMS = ("common", "checkpoint", "runtime", "model", "data", "run", "weights", "objectives", "configs", "cli")
MAY_IMPORT = {
    # each room, the rooms it may import (its own floor's sideways ones included); nothing else, nothing upward
    "common": set(),
    "checkpoint": {"common"},
    "runtime": {"common"},
    "model": {"common"},
    "data": {"common", "runtime"},
    "run": {"common", "checkpoint", "runtime"},
    "weights": {"common", "checkpoint", "data", "model"},
    "objectives": {"common", "checkpoint", "data", "model", "runtime", "weights"},
    "configs": {"common", "checkpoint", "data", "model", "runtime", "run", "objectives"},
    "train": {"common", "checkpoint", "data", "model", "runtime", "run", "weights", "objectives", "configs"},
    "cli": {"common", "checkpoint", "data", "model", "runtime", "run", "weights", "objectives", "configs"},
}
ENTRY_POINTS = {"checkpoint/__main__.py"}  # `python -m checkpoint`: the commands' old name, an alias of cli (nothing imports it)


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module of this repository that `path` imports, at the top or inside a function."""
    import ast

    tree, module = ast.parse(path.read_text()), module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in (*ROOMS, "train")}
    return out


def room_sources() -> dict[str, Path]:
    files = {module_of(p): p for room in ROOMS for p in (ROOT / room).rglob("*.py")}
    files["train"] = ROOT / "train.py"
    return files


def test_no_room_imports_upward_and_checkpoint_knows_no_model_data_or_config():
    wrong = []
    for module, path in room_sources().items():
        room = module.split(".")[0]
        if str(path.relative_to(ROOT)) in ENTRY_POINTS:
            continue
        for target in imports_of(path):
            other = target.split(".")[0]
            if other != room and other not in MAY_IMPORT[room]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target} ({room} may import {sorted(MAY_IMPORT[room]) or 'nothing of ours'})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_module_imports_in_a_circle_not_even_inside_a_function():
    sources = room_sources()
    known = set(sources)
    graph = {}
    for module, path in sources.items():
        targets = set()
        for target in imports_of(path):
            while target and target not in known:  # "data.chat.ChatOptions" is data.chat's
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(f"{target}."):  # a package's own __init__ aside
                targets.add(target)
        graph[module] = targets
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_each_room_says_its_job_in_its_docstring_and_the_top_level_is_the_one_asked_for():
    import ast

    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / room / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 8, f"{room}/__init__.py: no docstring that says the room's job"
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in ("runs", "__pycache__")}
    loose = sorted(p for p in top if p.endswith(".py") and p != "train.py")
    assert not loose, f"loose modules at the top level (they belong in a room): {loose}"
    assert len((ROOT / "train.py").read_text().splitlines()) <= 350, "train.py is the loop: at most 350 lines"
    assert len((ROOT / "README.md").read_bytes()) <= 8192, "the README is a map: at most 8 KB (the manual is docs/)"


def test_the_shell_scripts_take_every_exit_code_from_the_one_table():
    """scripts/train.sh and scripts/slurm/train.sbatch ask common/outcome.py (python3 common/outcome.py NAME)
    for each code they exit with, and write no code of their own."""
    from common.outcome import EXIT_CODES

    for script in ("scripts/train.sh", "scripts/slurm/train.sbatch"):
        text = (ROOT / script).read_text()
        assert "common/outcome.py" in text, script
        literal = [line for line in text.splitlines() if re.search(r"\bexit (0|1|2|75)\b", line) and not line.lstrip().startswith("#")]
        assert not literal, f"{script} exits with a literal code: {literal}"
        for name in re.findall(r"\$\(code (\w+)\)", text):
            assert name in EXIT_CODES, f"{script} asks for an outcome the table does not have: {name}"


def test_a_mutant_whose_tests_were_skipped_is_not_proved_and_fails_the_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = mutants
    spec.loader.exec_module(mutants)
    skipped = "s\nSKIPPED [1] tests/test_slurm.py:32: no Slurm here\n1 skipped in 0.1s\n"
    assert mutants.judge(0, skipped).startswith("NOT PROVED (1 test(s) skipped, e.g. tests/test_slurm.py:32")
    assert mutants.judge(1, "F\nFAILED tests/test_a.py::test_b - assert\n1 failed\n") == "caught by tests/test_a.py::test_b"
    assert mutants.judge(0, ".\n1 passed\n") == "SURVIVED"
    assert mutants.judge(1, "E\nERROR tests/test_a.py - ImportError\n").startswith("SURVIVED (1 collection")


def test_the_bench_is_a_small_runner_over_sections_that_register_themselves_one_module_each():
    """scripts/bench.py runs what scripts/benches/ registers (read here, not imported: the package sets the
    kernels' arithmetic for its process); every section docs/bench.json holds is registered."""
    import ast
    import json

    assert len((ROOT / "scripts" / "bench.py").read_text().splitlines()) < 300, "scripts/bench.py is the runner: under 300 lines"
    names, orders = [], []
    for path in sorted((ROOT / "scripts" / "benches").glob("*.py")):
        if path.name in ("__init__.py", "helpers.py"):
            continue
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name}: no docstring that says what the section measures"
        calls = [d for node in tree.body if isinstance(node, ast.FunctionDef) for d in node.decorator_list
                 if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "section"]
        assert len(calls) == 1, f"{path.name}: one section per module, registered with @section(...)"
        names.append(ast.literal_eval(calls[0].args[0]))
        orders.append(ast.literal_eval(next(k.value for k in calls[0].keywords if k.arg == "order")))
    assert len(set(names)) == len(names) and len(set(orders)) == len(orders), (names, orders)
    held = {row["section"] for row in json.loads((ROOT / "docs" / "bench.json").read_text())["rows"]}
    assert held <= set(names), f"docs/bench.json holds sections no module registers: {sorted(held - set(names))}"
