"""The README is a user's guide, not a lab notebook: short, no commit hashes, nothing outside the
repository. Figures and their history live in docs/benchmarks.md and git; the design in docs/design.md."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 600
# A commit hash as git abbreviates it: 7 to 40 hex digits with at least one letter and one digit. A
# decimal such as 1073741824 (a setting's default) is not one, nor a word such as "effaced"; the price
# is that the few hashes made of digits only go unnoticed.
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# What `grep -rn "DESIGN\|shared/" README.md app api rocketkv_mt tiers` looks for: a design document or
# shared folder outside the repository.
OUTSIDE = re.compile(r"DESIGN|shared/")
SCANNED = ("app", "api", "rocketkv_mt", "tiers")


def test_the_readme_is_at_most_600_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; figures belong in docs/benchmarks.md"


def test_the_readme_names_no_commit():
    found = [(n, m.group()) for n, line in enumerate(README.read_text().splitlines(), 1) for m in HASH.finditer(line)]
    assert not found, f"commit hashes in README.md (line, hash): {found}"


def test_the_hash_pattern_finds_hashes_and_only_them():
    assert HASH.findall("measured at 2dbe7e5 and at 0a3a6b6c0ffee, then deadbeef1") == ["2dbe7e5", "0a3a6b6c0ffee",
                                                                                       "deadbeef1"]
    assert HASH.findall("1073741824 bytes, effaced, 4c0433") == []


def test_nothing_points_outside_the_repository():
    files = [README] + [p for folder in SCANNED for p in (ROOT / folder).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts]
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # compiled or binary files: grep reports a match in them, but none is written by hand
        found += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, found


def test_every_result_file_the_docs_cite_exists():
    cited = set()
    for doc in (README, ROOT / "docs" / "design.md"):
        cited |= set(re.findall(r"results/[\w./-]+\.json", doc.read_text()))
    assert cited, "the README's figures name their result files"
    assert sorted(c for c in cited if not (ROOT / c).is_file()) == []
