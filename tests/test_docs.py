"""The repository explains itself: every citation points at something inside it.

* No file cites the old developer documents that are not part of the repository (the word ``spec`` or ``design``
  followed by a section sign, also when a comment wraps between the two); `docs/model.md` and `docs/design.md`
  replace them.
* A citation ``docs/<file>.md §N[.M]`` (and the section numbers chained after it: ``§1.4-§1.6, §3``) names a file
  that exists and section numbers that are headings of that file.
* Every ``docs/<file>.md`` path mentioned anywhere exists, and so does every ``benchmarks/results/<file>`` (the
  stable result names of benchmarks/results/README.md; an older table is cited as ``git show <commit>:<path>``).
* The README's python blocks run, in one process and in order, from a directory outside the source tree.

Each check is a function over (path, text) pairs, tested on synthetic input below so that it is known to fail
when it should; the repository tests run the same functions over every file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
# A result file (not a pattern with <...>, * or {...}); the lookbehind leaves out ``git show <commit>:<path>``.
RESULT_PATH = re.compile(r"(?<![\w:/])benchmarks/results/[\w.+-]+\.(?:md|json)\b")
# benchmarks/HISTORY.md names the files of earlier runs as they were then (each with its commit).
RESULT_PATH_EXEMPT = {"benchmarks/HISTORY.md"}
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


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


def missing_result_paths(path: str, text: str, exists) -> list[str]:
    """``benchmarks/results/<file>`` paths that do not exist (``exists(rel)`` tells)."""
    if path in RESULT_PATH_EXEMPT:
        return []
    return [
        f"{path}:{line_of(text, m.start())}: {m.group(0)} does not exist"
        for m in RESULT_PATH.finditer(text)
        if not exists(m.group(0))
    ]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The fenced ``python`` blocks of a markdown text: (line of the first code line, code)."""
    return [(line_of(text, m.start(1)), m.group(1)) for m in PYTHON_BLOCK.finditer(text)]


# Runs blocks (JSON on stdin: [[line, code], ...]) in order in one namespace; prints one result per block (None or
# the traceback) after a marker, so that a failing block does not hide the ones after it.
BLOCK_RUNNER = """
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
results = []
for line, code in blocks:
    try:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
        results.append(None)
    except BaseException:
        results.append(traceback.format_exc())
print("@@results@@" + json.dumps(results))
"""


def run_blocks(blocks: list[tuple[int, str]], cwd: Path, timeout: float = 900) -> list[str | None]:
    """Run ``blocks`` with :data:`BLOCK_RUNNER` in a fresh interpreter in ``cwd``, importing ppma from this
    checkout; one result per block (None, or its traceback)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", BLOCK_RUNNER], input=json.dumps(blocks), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out, sep, tail = proc.stdout.rpartition("@@results@@")
    assert sep, f"the block runner failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(tail)


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


def test_result_paths_exist(texts):
    problems = [p for rel, text in texts for p in missing_result_paths(rel, text, _exists)]
    assert not problems, ("cite the stable result names (benchmarks/results/README.md), or an older table as "
                          "git show <commit>:<path>:\n" + "\n".join(problems))


def test_readme_is_short():
    """The README is for users (at most 250 lines); analysis lives in docs/performance.md, history in
    benchmarks/HISTORY.md."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines"


def test_release_metadata_agree():
    """One version everywhere: pyproject.toml, ``ppma.__version__``, CITATION.cff and the CHANGELOG's newest entry;
    the distribution name is not ``ppma`` (an unrelated project on PyPI) and LICENSE is the licence declared."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    name = re.search(r'^name\s*=\s*"([^"]+)"', project, re.MULTILINE).group(1)
    version = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE).group(1)
    assert name != "ppma", "the distribution name ppma belongs to an unrelated project on PyPI"
    init = (ROOT / "ppma" / "__init__.py").read_text(encoding="utf-8")
    assert f'__version__ = "{version}"' in init, f"ppma.__version__ differs from pyproject's {version}"
    citation = (ROOT / "CITATION.cff").read_text(encoding="utf-8")
    assert re.search(rf"^version:\s*{re.escape(version)}\s*$", citation, re.MULTILINE), "CITATION.cff's version"
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert newest and newest.group(1) == version, f"CHANGELOG.md's newest entry is not {version}"
    assert re.search(r'^license\s*=\s*"Apache-2.0"', project, re.MULTILINE)
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]


def test_readme_python_blocks_run(tmp_path):
    """The README's python blocks, in order, in one fresh interpreter, run from outside the source tree."""
    blocks = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 2, "the README's quickstart (an op call and a model) is missing"
    results = run_blocks(blocks, tmp_path)
    problems = [f"README.md:{line}:\n{err}" for (line, _), err in zip(blocks, results) if err is not None]
    assert not problems, "\n".join(problems)


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


def test_result_path_check_catches_missing_files():
    res = "benchmarks/" "results/"
    exists = {f"{res}model_cpu_X.md"}.__contains__
    assert not missing_result_paths("README.md", f"table: `{res}model_cpu_X.md`", exists)
    assert missing_result_paths("README.md", f"table: `{res}model_cpu_20990101-000000.md`", exists)
    assert missing_result_paths("benchmarks/README.md", f"({res}ops_gpu_Y.json)", exists)
    # patterns, older tables through git, and the history's own rows are not paths to check
    assert not missing_result_paths("README.md", f"`{res}model_cpu_<machine>.md`, `{res}ops_*.md`", exists)
    assert not missing_result_paths("README.md", f"git show 6bc29af:{res}model_cpu_old.md", exists)
    assert not missing_result_paths("benchmarks/HISTORY.md", f"| `{res}model_cpu_old.md` |", exists)


def test_python_blocks_are_found_and_failures_reported(tmp_path):
    fence = "`" * 3
    text = (f"# T\n\n{fence}python\nx = 1\n{fence}\n\n{fence}bash\nls\n{fence}\n\n"
            f"{fence}python\nassert x == 2, 'x is 1'\n{fence}\n\n{fence}python\ny = x + 1\n{fence}\n")
    blocks = python_blocks(text)
    assert [line for line, _ in blocks] == [4, 12, 16] and blocks[0][1] == "x = 1\n"
    results = run_blocks(blocks, tmp_path, timeout=120)
    assert results[0] is None and results[2] is None  # one namespace: the third block sees x
    assert results[1] is not None and "x is 1" in results[1] and "README.md:12" in results[1]
