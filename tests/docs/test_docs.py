"""The tutorials in docs/ (and the README) run: every ```python block, every figure script, every local link.

- Each ``docs/*.md`` file and ``README.md`` is one test: its ```python blocks run in order, in one fresh
  namespace, with the repository root as the working directory and matplotlib's Agg backend.
  A block whose info string is ```python no-run is skipped.
- Each ``docs/figures/make_*.py`` script runs with a temporary output directory and must write at
  least one non-empty PNG.
- Relative links and images in the tutorials point to files that exist, and every numbered
  tutorial is linked from ``docs/README.md``.

Files are discovered with glob, so tutorials and figure scripts added later are tested as well.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOC_FILES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]  # the README's example runs too
FIGURE_SCRIPTS = sorted((DOCS / "figures").glob("make_*.py"))

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass
class CodeBlock:
    number: int  # 1-based, counting only ```python blocks
    line: int  # 1-based line of the first code line in the .md file
    source: str
    run: bool


def python_blocks(text: str) -> list[CodeBlock]:
    """The fenced blocks of a Markdown text whose info string's first word is ``python``.

    ``run`` is False when the info string also holds the word ``no-run``.
    """
    blocks: list[CodeBlock] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or ("`" in opening["info"] and opening["fence"][0] == "`"):
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        words = opening["info"].strip().split()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            line = lines[j]
            # CommonMark: strip up to the opening fence's indentation from each content line
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            j += 1
        if words and words[0].lower() == "python":
            blocks.append(
                CodeBlock(number=len(blocks) + 1, line=i + 2, source="\n".join(body) + "\n", run="no-run" not in words[1:])
            )
        i = j + 1
    return blocks


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture
def repo_env(monkeypatch):
    """cwd = repository root, ``reference`` importable, matplotlib on Agg; figures closed afterwards."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    try:
        import matplotlib
    except ImportError:  # a doc that needs matplotlib will fail on its own import
        yield
        return
    matplotlib.use("Agg", force=True)
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_doc_code_blocks(doc: Path, repo_env):
    rel = doc.relative_to(ROOT)
    namespace = {"__name__": f"docs.{doc.stem}", "__file__": str(doc)}
    for block in python_blocks(doc.read_text(encoding="utf-8")):
        if not block.run:
            continue
        # Pad with newlines so tracebacks show the .md file's own line numbers.
        code = compile("\n" * (block.line - 1) + block.source, str(rel), "exec")
        try:
            exec(code, namespace)
        except Exception:
            pytest.fail(
                f"{rel}: python block {block.number} (starting at line {block.line}) failed:\n"
                f"{traceback.format_exc()}",
                pytrace=False,
            )


@pytest.mark.parametrize("script", FIGURE_SCRIPTS, ids=_doc_id)
def test_figure_script_writes_png(script: Path, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hung script, not a time limit: make_accuracy_figures.py evaluates the demo
    )  # model on the CPU, about 80 s alone and more than 2 minutes on a busy 2-core machine
    assert result.returncode == 0, f"{script.relative_to(ROOT)} failed:\n{result.stdout}\n{result.stderr}"
    pngs = [p for p in tmp_path.rglob("*.png") if p.stat().st_size > 0]
    assert pngs, f"{script.relative_to(ROOT)} wrote no non-empty PNG into {tmp_path}"
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png.name} is not a PNG file"


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _local_targets(text: str) -> list[str]:
    """Relative link and image targets outside code blocks (no URLs, no pure #anchors)."""
    outside_code = re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", text, flags=re.MULTILINE | re.DOTALL)
    outside_code = re.sub(r"`[^`\n]*`", "", outside_code)
    targets = []
    for target in _LINK.findall(outside_code):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_doc_local_links_exist(doc: Path):
    missing = [t for t in _local_targets(doc.read_text(encoding="utf-8")) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_every_tutorial_is_in_the_index():
    index = DOCS / "README.md"
    tutorials = [p for p in DOC_FILES if re.match(r"\d+_", p.name)]
    if not tutorials:
        pytest.skip("no numbered tutorials yet")
    assert index.exists(), "docs/README.md (the index of tutorials) is missing"
    linked = set(_local_targets(index.read_text(encoding="utf-8")))
    unlisted = [p.name for p in tutorials if p.name not in linked]
    assert not unlisted, f"docs/README.md does not link to {unlisted}"


def test_block_extraction_follows_the_conventions():
    text = "\n".join([
        "# title",
        "```python",
        "a = 1",
        "```",
        "```python no-run",
        "raise SystemExit",
        "```",
        "```console",
        "$ fp8lab e4m3",
        "```",
        "````python",
        "s = '''",
        "```",
        "'''",
        "````",
        "  ```python",
        "  b = a + 1",
        "  ```",
        "```py",
        "not python by this convention",
        "```",
    ])
    blocks = python_blocks(text)
    assert [(b.number, b.line, b.run) for b in blocks] == [(1, 3, True), (2, 6, False), (3, 12, True), (4, 17, True)]
    assert blocks[0].source == "a = 1\n"
    assert blocks[2].source == "s = '''\n```\n'''\n"
    assert blocks[3].source == "b = a + 1\n"
