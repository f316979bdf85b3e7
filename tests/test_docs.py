"""The project's files speak of the software as it is: no work-period history, a short README whose
results table links the JSON each figure came from."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = "benchmarks/results/"
TODO = "TODO-FIGURE"

# "session" as a period of work ("session 13", "sessions 10-13", "session 14's code", "this session"),
# not as an API word (a chat session, ChatSession, requests.Session, pytest's scope="session").
WORK_SESSION = re.compile(
    r"\bsessions? \d+"
    r"|\b(?:this|that|same|previous|earlier|last|next|whole|busy) sessions?\b"
    r"|\bsession's (?:code|disk|runs?|store|fixes|changes|end)\b",
    re.IGNORECASE,
)
HISTORY_FREE_EXEMPT = {"CHANGELOG.md",  # history lives there (and in git log)
                       "tests/test_docs.py"}  # its examples of the pattern


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in out.decode().split("\0"):
        if not name or name in HISTORY_FREE_EXEMPT:
            continue
        path = ROOT / name
        if path.is_file():
            files.append(path)
    return files


def work_session_hits(text: str) -> list[str]:
    return [m.group(0) for m in WORK_SESSION.finditer(text)]


@pytest.mark.parametrize("text, hits", [
    ("What a review found (session 13)", ["session 13"]),
    ("session 14's code; sessions 10-13 (raw 1.6-1.9 GB/s)", ["session 14", "sessions 10"]),
    ("The disk ran faster this session than before", ["this session"]),
    ("the session's store changes cost nothing", ["session's store"]),
    ("Session 10 (2026-11-30): the last", ["Session 10"]),
    ("class ChatSession: a chat session keeps its turns", []),
    ('requests.Session(); @pytest.fixture(scope="session")', []),
    ("Each session's first request; requests per session; --session-s 900", []),
])
def test_work_session_pattern(text: str, hits: list[str]) -> None:
    assert work_session_hits(text) == hits


def test_no_work_session_history_in_tracked_files() -> None:
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            for hit in work_session_hits(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {hit!r}")
    assert not found, "work-period history outside CHANGELOG.md:\n" + "\n".join(found)


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) < 250


def results_rows() -> list[str]:
    """The rows of the README's results table (the first table under '## Results')."""
    text = README.read_text()
    m = re.search(r"^## Results\b.*?$(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert m, "README has no '## Results' section"
    lines = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    assert len(lines) > 2, "the results section has no table"
    return [ln for ln in lines[2:]]  # past the header and its rule


def test_results_table_links_exist() -> None:
    rows = results_rows()
    for row in rows:
        links = re.findall(r"\]\((" + re.escape(RESULTS) + r"[^)\s]+)\)", row)
        assert links or TODO in row, f"row links no JSON under {RESULTS}: {row}"
        for link in links:
            assert (ROOT / link).is_file(), f"{link} (linked from the README's results table) does not exist"


def test_no_figure_left_to_fill() -> None:
    offenders = [p.relative_to(ROOT) for p in tracked_text_files()
                 if p.suffix == ".md" and TODO in p.read_text(encoding="utf-8", errors="replace")]
    assert not offenders, f"{TODO} markers remain in {offenders}"
