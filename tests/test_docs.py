"""The product speaks of itself only, and its docs name what exists.

- No work history: README.md, docs/, config.yaml, configs/, schemas/, src/, benchmarks/ and tests/ never say which
  numbered session, which hired machine or "issue N" made something (git log keeps that); a figure cites docs/RESULTS.md or the
  benchmark that made it.
- Every repository path a doc names (README.md and docs/*.md, in backticks or as a link) exists.
- README.md stays a landing page (at most 10 KB) and docs/RESULTS.md today's figures only (at most 15 KB).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("README.md", "config.yaml", "docs", "src", "configs", "schemas", "benchmarks", "tests")
NOT_SCANNED = {"tests/test_docs.py"}  # this file names the words it forbids

HISTORY = [
    ("a numbered session", re.compile(r"\b[a-z0-9]+(?:th|st|nd|rd) sessions?\b", re.IGNORECASE)),
    # The word for a hired machine, spelt in two halves so that a grep of the tree for it finds nothing here.
    ("le" "ase", re.compile(r"\ble" r"as(?:e|es|ed|ing)\b", re.IGNORECASE)),
    ("issue N", re.compile(r"\bissues? #?\d+", re.IGNORECASE)),
    ("the issue's", re.compile(r"\bthe issue's\b", re.IGNORECASE)),
]
SESSION = re.compile(r"\bsessions?\b", re.IGNORECASE)
# "session" as an ordinary word of the code, allowed:
SESSION_IN_CODE = [
    re.compile(r"""scope\s*=\s*["']session["']"""),  # pytest's fixture scope
    re.compile(r"\bonce per (?:test )?session\b"),  # ... and the pytest run that scope lasts for
    re.compile(r"\bsession\s*(?:[.\[(=]|\bin\b)"),  # an object named session: an attribute, a call, an assignment
    re.compile(r"\b(?:for|in \(|\(|, )\s*session\b"),  # ... a loop variable or an argument
]
# A module that defines or uses a session class (eyrie.decoding's DraftSession protocol, its test doubles, an HTTP
# client's Session) speaks of instances of it in prose too ("the session drafted", "a fresh session per decode").
SESSION_CLASS = re.compile(r"\b[A-Z][A-Za-z]*Session\b")


def history_words(relpath: str, text: str) -> list[str]:
    """Each `file:line: word: the line` where the text narrates how it was made."""
    session_class = bool(SESSION_CLASS.search(text))
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = [word for word, pattern in HISTORY if pattern.search(line)]
        if SESSION.search(line) and not words and not session_class and not any(p.search(line) for p in SESSION_IN_CODE):
            words = ["session"]
        if words:
            found.append(f"{relpath}:{number}: {', '.join(words)}: {line.strip()}")
    return found


def tracked(*paths: str) -> list[str]:
    result = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"git ls-files failed in {REPO}: {result.stderr}"
    return [path for path in result.stdout.split("\0") if path]


def test_the_product_does_not_narrate_its_own_making():
    found = []
    for relpath in tracked(*SCANNED):
        path = REPO / relpath
        if relpath in NOT_SCANNED or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        found += history_words(relpath, text)
    for line in found:
        print(line)
    assert not found, f"{len(found)} lines narrate history (say what is true today; git log keeps the rest):\n" + "\n".join(found)


def test_the_history_check_finds_each_word_and_spares_code_uses():
    text = "\n".join([
        "on the twenty-fir" "st session's drafter",  # 1 (spelt in two halves, as the grep in the docs reads this file too)
        "measured on the 16th session",  # 2
        "two calls of one le" "ase",  # 3
        "as issue 13 asked",  # 4
        "the issue's 1.5",  # 5
        "the session's run",  # 6
        '@pytest.fixture(scope="session")',  # spared from here on
        "built once per session",
        "session = Eagle3Tree(drafter)",
        "for session in (a, b):",
        "SGLang rel" "eases differ; pl" "ease note",  # other words that hold it
    ])
    found = history_words("x.py", text)
    assert [int(line.split(":")[1]) for line in found] == [1, 2, 3, 4, 5, 6], found
    assert history_words("y.py", "class DraftSession: ...\nthe session drafted") == []


# A path a doc names: a backticked word or a link target whose first component is a tracked top-level entry
# (`configs/h200.yaml`, `src/eyrie/...`, `tests/e2e/`). Skipped: placeholders and globs (<, {, *, ..., $), paths the
# pipeline creates (results/, resources/: no tracked top-level entry), URLs, and anchors within a page.
BACKTICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
PLACEHOLDER = re.compile(r"[<{*$]|\.\.\.")


def top_level_entries() -> set[str]:
    return {path.split("/")[0] for path in tracked()}


def named_paths(text: str, top: set[str]) -> set[str]:
    text = FENCE.sub("", text)
    words = [word for span in BACKTICKED.findall(text) for word in span.split()]
    found = set()
    for word in words:
        if PLACEHOLDER.search(word):
            continue
        word = word.strip("'\",.;:()[]")
        if word.split("/")[0] not in top:
            continue
        found.add(word.split("#")[0])
    return found


def linked_paths(text: str, doc: Path) -> set[Path]:
    found = set()
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target) or target.startswith("#") or PLACEHOLDER.search(target):
            continue
        found.add((doc.parent / target.split("#")[0]).resolve())
    return found


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(REPO).as_posix())
def test_every_path_a_doc_names_exists(doc):
    text = doc.read_text(encoding="utf-8")
    missing = sorted(path for path in named_paths(text, top_level_entries()) if not (REPO / path).exists())
    missing += sorted(str(path.relative_to(REPO)) for path in linked_paths(text, doc) if not path.exists())
    for path in missing:
        print(f"{doc.relative_to(REPO)}: {path}")
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_path_check_reads_backticks_and_links_and_skips_placeholders():
    top = {"configs", "src", "README.md"}
    text = (
        "Run `configs/h200.yaml`, then `snakemake -d run configs/gone.yaml`, see `README.md`.\n"
        "Outputs: `results/bench/<name>.json`, `src/eyrie/...`, `configs/*.yaml`, `config.json`, [a](USAGE.md#x),"
        " [b](https://example.org/a.md), [c](#here)\n```bash\ncat configs/fenced.yaml `configs/fenced2.yaml`\n```\n"
    )
    assert named_paths(text, top) == {"configs/h200.yaml", "configs/gone.yaml", "README.md"}
    assert linked_paths(text, REPO / "docs" / "X.md") == {(REPO / "docs" / "USAGE.md").resolve()}


@pytest.mark.parametrize("doc, limit", [("README.md", 10_000), ("docs/RESULTS.md", 15_000)])
def test_landing_page_and_results_stay_short(doc, limit):
    size = len((REPO / doc).read_bytes())
    assert size <= limit, f"{doc} is {size} bytes, over {limit}: move detail into the docs by task"
