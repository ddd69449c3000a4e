"""The repository explains itself: every citation points at something inside it.

* No file cites the old developer documents that are not part of the repository (the word ``spec`` or ``design``
  followed by a section sign, also when a comment wraps between the two); `docs/model.md` and `docs/design.md`
  replace them.
* A citation ``docs/<file>.md §N[.M]`` (and the section numbers chained after it: ``§1.4-§1.6, §3``) names a file
  that exists and section numbers that are headings of that file.
* Every ``docs/<file>.md`` path mentioned anywhere exists.
* Documentation and shell scripts describe plain commands, not the tools of the workplace the project was built in
  (its call syntax, its output folder variable, its file-transfer folders).

Each check is a function over (path, text) pairs, tested on synthetic input below so that it is known to fail
when it should; the repository tests run the same functions over every file.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The word spec or design (any case) before a section sign, also across a wrapped comment line.
OLD_CITATION = re.compile(r"\b(spec|design)[ \t]*(?:\r?\n[ \t]*(?:#|//|\*)?[ \t]*)?§", re.IGNORECASE)
# ``docs/<file>.md §N[.M]`` plus chained numbers (``, §3``, ``-§1.6``, `` and §4``); may wrap into a comment line.
DOC_CITATION = re.compile(
    r"docs/([\w.-]+?\.md)((?:[ \t]*(?:\r?\n[ \t]*(?:#|//|\*)?[ \t]*)?(?:,|-|–|and|or)?[ \t]*§\d+(?:\.\d+)*)+)"
)
SECTION_NUMBER = re.compile(r"§(\d+(?:\.\d+)*)")
DOC_PATH = re.compile(r"docs/[\w./-]*?\.md\b")
HEADING = re.compile(r"^#{1,6}[ \t]+(\d+(?:\.\d+)*)\.?(?:[ \t]|$)", re.MULTILINE)
# How the workplace's GPU tool was described: its call syntax and its conventions. Plain shell never needs them.
WORKPLACE = [
    (re.compile(r"\$\{?OUT\b"), "$OUT (the output folder of a workplace tool)"),
    (re.compile(r"\bcarry\s*=", re.IGNORECASE), "carry= (a parameter of a workplace tool)"),
    (re.compile(r"\bfiles_at\b"), "files_at (a field of a workplace tool's reply)"),
    (re.compile(r"\bdevice tool\b", re.IGNORECASE), "'device tool' (a workplace tool)"),
    (re.compile(r"\brun\(\s*command\s*=", re.IGNORECASE), "run(command=...) (a workplace tool's call syntax)"),
    (re.compile(r"\btimeout_s\s*=", re.IGNORECASE), "timeout_s= (a workplace tool's call syntax)"),
]
WORKPLACE_SUFFIXES = (".md", ".rst", ".txt", ".sh")


def repo_files() -> list[str]:
    """Text files of the repository (relative POSIX paths): git's tracked and untracked, non-ignored files, or a
    walk of the tree without ``.git`` and build outputs when this is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, check=True, capture_output=True, timeout=60,
        ).stdout.decode()
        paths = sorted({p for p in out.split("\0") if p})
    except (OSError, subprocess.SubprocessError):
        skip = {".git", "__pycache__", "build", "dist", ".pytest_cache"}
        paths = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
            paths += [(Path(dirpath) / f).relative_to(ROOT).as_posix() for f in filenames]
    return [p for p in paths if not p.startswith(".git/") and (ROOT / p).is_file()]


def read_text(rel: str) -> str | None:
    raw = (ROOT / rel).read_bytes()
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def old_citations(path: str, text: str) -> list[str]:
    """Citations of the documents that are not in the repository."""
    return [f"{path}:{line_of(text, m.start())}: {m.group(0)!r}" for m in OLD_CITATION.finditer(text)]


def headings(doc_text: str) -> set[str]:
    """Section numbers that are headings of a markdown file (``## 1.`` -> ``1``, ``### 1.4 ...`` -> ``1.4``)."""
    return set(HEADING.findall(doc_text))


def bad_doc_citations(path: str, text: str, read_doc) -> list[str]:
    """``docs/<file>.md §N`` citations whose file is missing or whose section is not a heading there.
    ``read_doc(name)`` returns the text of ``docs/<name>`` or None when it does not exist."""
    problems = []
    for m in DOC_CITATION.finditer(text):
        name, where = m.group(1), f"{path}:{line_of(text, m.start())}"
        doc = read_doc(name)
        if doc is None:
            problems.append(f"{where}: cites docs/{name}, which does not exist")
            continue
        have = headings(doc)
        for number in SECTION_NUMBER.findall(m.group(2)):
            if number not in have:
                problems.append(f"{where}: cites docs/{name} §{number}, which is not a heading there")
    return problems


def missing_doc_paths(path: str, text: str, exists) -> list[str]:
    """``docs/<file>.md`` paths that do not exist (``exists(rel)`` tells)."""
    return [
        f"{path}:{line_of(text, m.start())}: {m.group(0)} does not exist"
        for m in DOC_PATH.finditer(text)
        if not exists(m.group(0))
    ]


def workplace_mentions(path: str, text: str) -> list[str]:
    """Descriptions of the workplace's own tools in documentation or shell scripts."""
    if not path.endswith(WORKPLACE_SUFFIXES) and Path(path).name != "README":
        return []
    return [
        f"{path}:{line_of(text, m.start())}: {what}"
        for pattern, what in WORKPLACE
        for m in pattern.finditer(text)
    ]


def _read_repo_doc(name: str) -> str | None:
    p = ROOT / "docs" / name
    return p.read_text(encoding="utf-8") if p.is_file() else None


def _exists(rel: str) -> bool:
    return (ROOT / rel).is_file()


@pytest.fixture(scope="module")
def texts() -> list[tuple[str, str]]:
    out = []
    for rel in repo_files():
        text = read_text(rel)
        if text is not None:
            out.append((rel, text))
    assert any(rel == "README.md" for rel, _ in out), "the repository's files were not found"
    return out


# ----------------------------------------------------------------------------------------------------------------
# The repository
# ----------------------------------------------------------------------------------------------------------------


def test_no_citations_of_documents_outside_the_repository(texts):
    problems = [p for rel, text in texts for p in old_citations(rel, text)]
    assert not problems, "cite docs/model.md or docs/design.md instead:\n" + "\n".join(problems)


def test_doc_citations_name_existing_sections(texts):
    problems = [p for rel, text in texts for p in bad_doc_citations(rel, text, _read_repo_doc)]
    assert not problems, "\n".join(problems)


def test_doc_paths_exist(texts):
    problems = [p for rel, text in texts for p in missing_doc_paths(rel, text, _exists)]
    assert not problems, "\n".join(problems)


def test_docs_describe_no_workplace_tools(texts):
    problems = [p for rel, text in texts for p in workplace_mentions(rel, text)]
    assert not problems, "describe plain commands instead:\n" + "\n".join(problems)


def test_model_and_design_docs_are_numbered():
    """The two documents the code cites most exist and have the numbered sections the citations use."""
    for name, needed in (("model.md", {"1.4", "1.6", "2", "3.3", "4.1", "5.2", "6.1", "7.5", "9"}),
                         ("design.md", {"1", "2", "2.8", "3", "4", "5", "6"})):
        doc = _read_repo_doc(name)
        assert doc is not None, f"docs/{name} is missing"
        assert needed <= headings(doc), f"docs/{name} lacks sections {sorted(needed - headings(doc))}"


# ----------------------------------------------------------------------------------------------------------------
# The checks themselves, on synthetic input (built by concatenation, so this file passes its own checks)
# ----------------------------------------------------------------------------------------------------------------

_S = "\u00a7"  # the section sign
_DOC = "docs/"


def test_old_citation_check_catches_each_form():
    for text in (f"(spe" f"c {_S}1.4)", f"Spe" f"c {_S}4.1: shapes", f"(desig" f"n {_S}2)",
                 f"# values, spe" f"c\n# {_S}4.1", f"// see desig" f"n\n// {_S}5"):
        assert old_citations("x.py", text), text
    assert not old_citations("x.py", f"({_DOC}model.md {_S}1.4, paper {_S}4.1, Eq. 3)")
    assert not old_citations("x.py", "spec = dict(case=1)  # a variable named spec")


def test_doc_citation_check_catches_missing_files_and_sections():
    docs = {"model.md": "# T\n## 1. A\n### 1.4 B\n## 3. C\n", "ops.md": "# Ops\n## Layout\n"}
    read = docs.get
    assert not bad_doc_citations("x.py", f"({_DOC}model.md {_S}1.4)", read)
    assert not bad_doc_citations("x.py", f"({_DOC}model.md {_S}1-{_S}1.4, {_S}3)", read)
    assert not bad_doc_citations("x.py", f"# the values of {_DOC}model.md\n# {_S}1.4", read)
    assert bad_doc_citations("x.py", f"({_DOC}model.md {_S}1.5)", read)  # no such heading
    assert bad_doc_citations("x.py", f"({_DOC}model.md {_S}1.4, {_S}7)", read)  # chained number missing
    assert bad_doc_citations("x.py", f"({_DOC}model.md {_S}2)", read)
    assert bad_doc_citations("x.py", f"({_DOC}ops.md {_S}1)", read)  # ops.md has no numbered sections
    assert bad_doc_citations("x.py", f"({_DOC}missing.md {_S}1)", read)  # no such file
    assert headings(docs["model.md"]) == {"1", "1.4", "3"}


def test_doc_path_check_catches_missing_files():
    exists = {f"{_DOC}ops.md"}.__contains__
    assert not missing_doc_paths("x.md", f"see `{_DOC}ops.md`, \"Edges\"", exists)
    assert missing_doc_paths("x.md", f"see `{_DOC}nowhere.md`", exists)


def test_workplace_check_catches_each_form():
    for text in ("writes under `$" "OUT`", "tee \"${" "OUT}/x.log\"", "ca" "rry=[\".gpu\"]", "cp <files" "_at>/x .",
                 "use the devic" "e tool", "r" "un(command=\"bash x.sh\")", "timeou" "t_s=600"):
        assert workplace_mentions("README.md", text), text
        assert workplace_mentions("benchmarks/gpu_check.sh", text), text
    assert not workplace_mentions("x.py", "r" "un(command=1)")  # code is not documentation
    assert not workplace_mentions("README.md", "bash benchmarks/gpu_check.sh test  # results in benchmarks/results/")
