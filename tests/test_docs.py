"""The documentation's references resolve, and the project cites nothing outside the repository.

- No file of engine/, tests/, scripts/, docs/ (raw logs in docs/runs/ aside), README.md or TODO.md names a
  path into the parent directory's shared folder: the contract lives in docs/contract.md.
- Every relative Markdown link in README.md, TODO.md and docs/ resolves from the file that holds it.
- Every `docs/...` path named in those pages or in the code, tests and scripts exists (pages move; the
  pointers must follow). Paths with placeholders (`<log>`, `{a,b}`, `*`) are patterns, not checked.
Pure file reads: runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "tests", "scripts", "docs")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".cu", ".toml", ".txt", ".cfg", ".yml", ".yaml"}
RAW_LOGS = ROOT / "docs" / "runs"
OUTSIDE = ".." + "/shared"  # split so that this file does not match itself

MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[A-Za-z0-9_./-]*")


def _text_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "TODO.md"]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and RAW_LOGS not in path.parents \
                    and "__pycache__" not in path.parts:
                files.append(path)
    return files


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "TODO.md"] + sorted(
        p for p in (ROOT / "docs").rglob("*.md") if RAW_LOGS not in p.parents)


def test_nothing_cites_a_path_outside_the_repository():
    offenders = [str(p.relative_to(ROOT)) for p in _text_files() if OUTSIDE in p.read_text(errors="replace")]
    assert not offenders, f"{OUTSIDE} cited in {offenders}: cite docs/contract.md instead"


def test_relative_markdown_links_resolve():
    broken = []
    for page in _pages():
        for target in MD_LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # URLs and in-page anchors
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_named_docs_paths_exist():
    missing = []
    for path in _text_files():
        text = path.read_text(errors="replace")
        for match in DOCS_PATH.finditer(text):
            name = match.group(0).rstrip(".-")
            following = text[match.end():match.end() + 1]
            if following in ("<", "{", "*") or name == "docs/":
                continue  # a pattern (placeholder, brace list, glob), or the folder itself
            if not (ROOT / name).exists():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "docs paths that do not exist:\n" + "\n".join(sorted(set(missing)))
