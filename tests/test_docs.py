"""Every ```python block of README.md and docs/*.md runs as written, on the CPU.

The blocks are found and run by Sybil (a maintained runner of documentation examples):
one test per document, each block a subtest named after the line of its fence, e.g.
``test_snippets_run[README.md] [line 61]``. A document's blocks run in order in one
namespace, as a reader would run them, in this process (so under the suite's
TRITON_INTERPRET setting); a traceback points at the document's own lines. Blocks must
stay small enough to run in seconds in Triton's interpreter. Only ```python blocks run.

A block that needs a package a CPU-only install lacks says so on the line before its
fence, in Sybil's skip syntax with a condition:

    <!-- skip: next if(missing("vllm"), reason="needs vLLM") -->

``missing(module)`` is true where the module is not importable: the block is skipped
there (the subtest says why) and runs where it is. Such a line is an HTML comment, which
a reader does not see: the text before the block says what it needs too.
"""

from __future__ import annotations

import importlib.util
import re
import unittest
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
)
# The marker of the runner this file had before Sybil: a document still using it would
# have its block run where it cannot.
OLD_MARKER = re.compile(r"<!--\s*snippet:")


def missing(module: str) -> bool:
    """Whether ``module`` is not importable here (for skip conditions)."""
    return importlib.util.find_spec(module) is None


def _setup(namespace):
    namespace["missing"] = missing


SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()], setup=_setup)


def run_document(path: Path, subtests):
    """Run the document's blocks in order, each in a subtest; returns the line of each
    block and whether it ran (False: skipped)."""
    document = SYBIL.parse(path)
    SYBIL.setup(document.namespace)
    ran = []
    for example in document.examples():
        if isinstance(example.region.evaluator, Skipper):
            example.evaluate()  # a skip directive: applies to the next block
            continue
        with subtests.test(msg=f"line {example.line}"):
            try:
                example.evaluate()
            except unittest.SkipTest as e:
                ran.append((example.line, False))
                pytest.skip(str(e))
            ran.append((example.line, True))
    return ran


@pytest.mark.parametrize("name", DOCS)
def test_snippets_run(name, subtests):
    text = (ROOT / name).read_text()
    old = OLD_MARKER.search(text)
    assert not old, (
        f"{name}, line {text.count(chr(10), 0, old.start()) + 1}: the old marker "
        "<!-- snippet: needs MODULE --> is not read any more; write <!-- skip: next "
        'if(missing("MODULE"), reason="needs MODULE") --> (tests/test_docs.py)'
    )
    run_document(ROOT / name, subtests)


def test_readme_use_block_is_collected():
    """Sybil finds the README's "Use" block (the one a newcomer copies), unskipped."""
    examples = list(SYBIL.parse(ROOT / "README.md").examples())
    use = [e for e in examples if "continuation_prefill_varlen(" in e.parsed]
    assert len(use) == 1
    before = examples[examples.index(use[0]) - 1]
    assert not isinstance(before.region.evaluator, Skipper)


def test_blocks_in_list_items_skips_and_failures(tmp_path, subtests):
    """How this file runs a document: fences in list items run, a skip condition skips
    only where it holds, a failing block fails with the document's line."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "\n".join(
            [
                "# Title",  # 1
                "```python",  # 2
                "x = 1",  # 3
                "```",  # 4
                "```bash",  # 5
                "echo not python",  # 6
                "```",  # 7
                '<!-- skip: next if(missing("no_such_mod"), reason="a") -->',  # 8
                "```python",  # 9
                "import no_such_mod",  # 10
                "```",  # 11
                '<!-- skip: next if(missing("json"), reason="needs json") -->',  # 12
                "```python",  # 13
                "import json",  # 14
                "```",  # 15
                "1. a list item:",  # 16
                "   ```python",  # 17
                "   y = x + 1",  # 18
                "   ```",  # 19
            ]
        )
        + "\n"
    )
    assert run_document(doc, subtests) == [
        (2, True),
        (9, False),
        (13, True),
        (17, True),
    ]
    doc.write_text("text\n\n```python\nx = 1\nraise ValueError('boom')\n```\n")
    (block,) = SYBIL.parse(doc).examples()
    with pytest.raises(ValueError, match="boom") as info:
        block.evaluate()
    assert any(
        entry.path == doc and entry.lineno + 1 == 5 for entry in info.traceback
    ), info.traceback


def _commands(text):
    """The command lines of a shell text: no comments, no blank lines, each without a
    trailing comment."""
    lines = (re.sub(r"\s+#\s.*$", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_the_readme_commands_as_written():
    """.ci/run, after making its own environment, runs the README's install, wheel and
    test commands, each exactly as the README writes it."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M)
    documented = {line for block in blocks for line in _commands(block)}
    ci = _commands((ROOT / ".ci" / "run").read_text())
    start = ci.index(". /tmp/tq-ci-venv/bin/activate") + 1
    assert ci[start:], ci
    assert [c for c in ci[start:] if c not in documented] == []
    for needed in ("python -m build --wheel", "TRITON_INTERPRET=1 python -m pytest"):
        assert any(c.startswith(needed) for c in ci[start:]), needed


def _sections(text):
    """(title, body) of each ## or ### section of a Markdown text."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
RESULT_FILE = re.compile(r"benchmarks/results/[\w.-]+")


@pytest.mark.parametrize(
    "path", sorted(set(RESULT_FILE.findall(BENCHMARKS))) or ["none named"]
)
def test_every_results_file_docs_benchmarks_names_exists(path):
    assert (ROOT / path).is_file(), path


@pytest.mark.parametrize(
    "title, body",
    [
        pytest.param(t, b, id=t.lstrip("# "))
        for t, b in _sections(BENCHMARKS)
        if re.search(r"^\|.*\d", b, re.M) or "![" in b  # a table of figures, a plot
    ],
)
def test_every_section_of_figures_names_its_results_files(title, body):
    """Every section of docs/benchmarks.md with a table of figures or a plot names the
    results files it comes from (benchmarks/results/...)."""
    assert RESULT_FILE.search(body), title
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", body):
        assert (ROOT / "docs" / image).resolve().is_file(), image
