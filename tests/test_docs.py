"""The docs are the product's reference: every cited anchor exists, nothing points outside the repo."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"(?<!TORCH_)\bSPEC\b|SPEC\.md|DESIGN\.md|task brief|\bissue \d+\b")


def _tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(md: Path) -> set:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", md.read_text(), re.M)}


def test_every_cited_docs_anchor_exists():
    anchors = {p.name: _anchors(p) for p in (ROOT / "docs").glob("*.md")}
    missing = []
    for f in _tracked("*.py", "*.md", "*.toml"):
        for m in re.finditer(r"docs/([\w-]+\.md)#([\w-]+)", f.read_text(errors="replace")):
            doc, anchor = m.group(1), m.group(2)
            if anchor not in anchors.get(doc, set()):
                missing.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "cited anchors that do not exist:\n" + "\n".join(missing)


def test_nothing_refers_to_documents_outside_the_repo():
    hits = []
    for f in _tracked("*.py", "*.md", "*.toml", "Makefile", "*.sh"):
        if f.name == "test_docs.py":
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not hits, "references to documents a user does not have:\n" + "\n".join(hits)
