"""Every ```python block of README.md and docs/*.md runs as written, on the CPU.

Each block runs in a fresh namespace, in this process (so under the suite's
TRITON_INTERPRET setting), as one test case named after its file and the line of its
opening fence, e.g. ``README.md:53``. Blocks must stay small enough to run in seconds
in Triton's interpreter. Only ```python blocks run; bash and other blocks do not.

Marker convention: a block that cannot run on a CPU-only machine without some package
carries, on the line just before its fence,

    <!-- snippet: needs MODULE -->

(e.g. ``<!-- snippet: needs vllm -->``). It is skipped when MODULE is not importable
and runs when it is. Any other ``<!-- snippet: ... -->`` line is an error, so a typo
cannot skip a block silently.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^\s*```python\s*$")  # also indented, inside a list item
MARKER = re.compile(r"^\s*<!--\s*snippet:(.*)-->\s*$")
NEEDS = re.compile(r"^\s*needs\s+([A-Za-z_][\w.]*)\s*$")


def python_blocks(text: str):
    """[(line of the opening fence, 1-based; code; module it needs or None)] of a Markdown text."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            if i == len(lines):
                raise ValueError(
                    f"line {start + 1}: ```python block without a closing fence"
                )
            needs = None
            marker = MARKER.match(lines[start - 1]) if start else None
            if marker:
                needs = NEEDS.match(marker.group(1))
                if not needs:
                    raise ValueError(
                        f"line {start}: unknown snippet marker {lines[start - 1]!r}; "
                        "expected <!-- snippet: needs MODULE -->"
                    )
                needs = needs.group(1)
            blocks.append(
                (
                    start + 1,
                    textwrap.dedent("\n".join(lines[start + 1 : i]) + "\n"),
                    needs,
                )
            )
        i += 1
    return blocks


def doc_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def collect():
    cases = []
    for path in doc_files():
        name = path.relative_to(ROOT).as_posix()
        for line, code, needs in python_blocks(path.read_text()):
            cases.append(pytest.param(name, line, code, needs, id=f"{name}:{line}"))
    return cases


@pytest.mark.parametrize("name, line, code, needs", collect())
def test_snippet_runs(name, line, code, needs):
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"needs {needs}, which is not importable here")
    # The file name and fence line in the code's name: a traceback points into the document.
    exec(compile(code, f"{name}:{line}", "exec"), {"__name__": "__main__"})


def test_readme_use_block_is_collected():
    """The collector finds the README's "Use" block (the one a newcomer copies)."""
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert any(
        "continuation_prefill_varlen(" in code and needs is None
        for _, code, needs in blocks
    ), blocks


def test_collector_reads_fences_and_markers():
    text = "\n".join(
        [
            "# Title",  # 1
            "```python",  # 2
            "x = 1",  # 3
            "```",  # 4
            "```bash",  # 5
            "echo not python",  # 6
            "```",  # 7
            "<!-- snippet: needs some_module -->",  # 8
            "```python",  # 9
            "import some_module",  # 10
            "```",  # 11
            "1. a list item:",  # 12
            "   ```python",  # 13
            "   y = 2",  # 14
            "   ```",  # 15
        ]
    )
    assert python_blocks(text) == [
        (2, "x = 1\n", None),
        (9, "import some_module\n", "some_module"),
        (13, "y = 2\n", None),
    ]


@pytest.mark.parametrize(
    "marker",
    [
        "<!-- snippet: skip -->",
        "<!-- snippet: needs -->",
        "<!-- snippet: needs vllm torch -->",
    ],
)
def test_unknown_marker_is_an_error(marker):
    with pytest.raises(ValueError, match="unknown snippet marker"):
        python_blocks(f"{marker}\n```python\nx = 1\n```\n")


def test_unclosed_block_is_an_error():
    with pytest.raises(ValueError, match="without a closing fence"):
        python_blocks("```python\nx = 1\n")
