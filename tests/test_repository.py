"""The repository's own pointers resolve: every docs file and design invariant that code, docs or
scripts name exists in this repository, and every relative link in a Markdown page leads to a file."""
import os
import re
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
