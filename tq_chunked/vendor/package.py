"""Step 1: the copy of tq_chunked's runtime that vLLM imports as
``vllm.v1.attention.ops.tq_chunked``.

The runtime is one directory, ``tq_chunked/runtime/``: every module in it is copied,
and nothing else (the plugin, the tools, the vendor tool and the kernel prototype live
outside it). Each import of the runtime by its full name is made relative; Triton is
taken from ``vllm.triton_utils``, as vLLM's own modules take it (its pre-commit forbids
``import triton``); and every import of the copied code is checked: relative to a
copied module, the standard library, numpy, torch or vllm.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

from .. import __version__
from .paths import LINE, PACKAGE, VendorError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# What vLLM runs: this directory, whole.
RUNTIME = f"{PACKAGE}.runtime"
RUNTIME_DIR = PACKAGE_DIR / "runtime"
# What the copied code may import besides itself: the standard library and what vLLM
# depends on already (Triton through vLLM: rewrite_triton_imports; numpy, which vLLM
# requires and its attention builders import for their host ints).
THIRD_PARTY = frozenset({"numpy", "torch", "vllm"})
# The imports of Triton the vendored copy takes from vLLM's module instead, as
# {(module, asname): the name it binds}: vLLM's pre-commit allows Triton only as
# ``from vllm.triton_utils import tl, triton``.
TRITON_UTILS = "vllm.triton_utils"
TRITON_FORMS = {("triton", None): "triton", ("triton.language", "tl"): "tl"}


def header(origin: str) -> str:
    """The two SPDX lines of vLLM's files, and where this one comes from (``origin``:
    its path in tq_chunked)."""
    note = (
        f"Vendored from tq_chunked {__version__} ({origin}) by "
        "`python -m tq_chunked.vendor`: change it there and vendor again "
        "(docs/vendoring.md in tq_chunked)."
    )
    lines = textwrap.wrap(
        note,
        LINE,
        initial_indent="# ",
        subsequent_indent="# ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return (
        "# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
        + "".join(line + "\n" for line in lines)
    )


def _rewrite_from(lines, node, where):
    i = node.lineno - 1
    pattern = re.compile(r"from\s+" + re.escape(node.module) + r"(?=\s)")
    head, tail = lines[i][: node.col_offset], lines[i][node.col_offset :]
    relative = "from ." + node.module[len(RUNTIME) + 1 :]
    new_tail, n = pattern.subn(relative, tail, count=1)
    if n != 1:
        raise VendorError(
            f"{where}: cannot find 'from {node.module}' on the import's first line"
        )
    lines[i] = head + new_tail


def _rewrite_import(lines, node, where):
    if (
        len(node.names) != 1
        or node.names[0].asname is None
        or node.names[0].name.count(".") != RUNTIME.count(".") + 1
        or node.lineno != node.end_lineno
    ):
        names = ", ".join(a.name for a in node.names)
        raise VendorError(
            f"{where}: 'import {names}' binds the name {PACKAGE}; write it as a "
            "relative import ('from . import x')"
        )
    a = node.names[0]
    i = node.lineno - 1
    line = lines[i]
    lines[i] = (
        line[: node.col_offset]
        + f"from . import {a.name.rsplit('.', 1)[1]} as {a.asname}"
        + line[node.end_col_offset :]
    )


def rewrite_imports(name: str, text: str) -> str:
    """``text`` with every import of the runtime by its full name made relative
    (``from tq_chunked.runtime.x import y`` -> ``from .x import y``; ``import
    tq_chunked.runtime.x as y`` -> ``from . import x as y``). An import that would
    bind the name ``tq_chunked`` itself cannot be made relative and is refused; one of
    tq_chunked outside the runtime is left for ``check_imports`` to refuse."""
    lines = text.splitlines(keepends=True)
    nodes = sorted(ast.walk(ast.parse(text)), key=lambda n: -getattr(n, "lineno", 0))
    for node in nodes:
        where = f"{_origin(name)}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module == RUNTIME or node.module.startswith(RUNTIME + "."))
        ):
            _rewrite_from(lines, node, where)
        elif isinstance(node, ast.Import) and any(
            a.name == RUNTIME or a.name.startswith(RUNTIME + ".") for a in node.names
        ):
            _rewrite_import(lines, node, where)
    return "".join(lines)


def _imports_triton(node) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "triton" for a in node.names)
    return (
        isinstance(node, ast.ImportFrom)
        and not node.level
        and node.module.split(".")[0] == "triton"
    )


def _is_vllm_import(node) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "vllm" for a in node.names)
    return (
        isinstance(node, ast.ImportFrom)
        and not node.level
        and node.module.split(".")[0] == "vllm"
    )


def rewrite_triton_imports(name: str, text: str) -> str:
    """``text`` with its top-level ``import triton`` and ``import triton.language as
    tl`` replaced by one ``from vllm.triton_utils import tl, triton`` (the names it
    bound), placed as ruff's isort places it: among the module's top-level ``vllm``
    imports, or as a section of its own before the relative ones. Any other import of
    Triton is refused, naming it: vLLM's modules take Triton from vllm.triton_utils
    (on a machine without a GPU driver, a placeholder), and this tool writes only
    these two forms."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    bound, drop = [], set()
    for node in ast.walk(tree):
        if not _imports_triton(node):
            continue
        form = None
        if isinstance(node, ast.Import) and len(node.names) == 1:
            form = TRITON_FORMS.get((node.names[0].name, node.names[0].asname))
        if form is None or node not in tree.body or node.lineno != node.end_lineno:
            raise VendorError(
                f"{_origin(name)}:{node.lineno}: '{ast.unparse(node)}': the vendored "
                f"copy takes Triton from {TRITON_UTILS}, which this tool writes for "
                "a top-level 'import triton' or 'import triton.language as tl' only"
            )
        bound.append(form)
        drop.add(node.lineno - 1)
    if not drop:
        return text
    new_line = f"from {TRITON_UTILS} import {', '.join(sorted(set(bound)))}\n"
    top_imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    first_party = [s for s in top_imports if _is_vllm_import(s)]
    relative = [s for s in top_imports if isinstance(s, ast.ImportFrom) and s.level]
    if first_party:
        # isort: plain imports first, then from-imports by module name.
        later = [
            s
            for s in first_party
            if isinstance(s, ast.ImportFrom) and s.module.lower() > TRITON_UTILS
        ]
        at = later[0].lineno - 1 if later else first_party[-1].end_lineno
        insert = [new_line]
    elif relative:
        at, insert = relative[0].lineno - 1, [new_line, "\n"]
    else:
        at, insert = top_imports[-1].end_lineno, ["\n", new_line]
    out = [line for i, line in enumerate(lines[:at]) if i not in drop] + insert
    out += [line for i, line in enumerate(lines[at:], at) if i not in drop]
    return _one_blank_between_sections("".join(out))


def _one_blank_between_sections(text: str) -> str:
    """``text`` with each run of blank lines in its top-level import block (its first
    top-level import to the last of the imports that follow it) made one: a section
    the rewrite emptied leaves two in a row."""
    tree = ast.parse(text)
    block = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            block.append(stmt)
        elif block:
            break
    if not block:
        return text
    lines = text.splitlines(keepends=True)
    start, end = block[0].lineno - 1, block[-1].end_lineno
    kept = [
        line
        for i, line in enumerate(lines[start:end], start)
        if line.strip() or lines[i - 1].strip()
    ]
    return "".join(lines[:start] + kept + lines[end:])


def _origin(name: str) -> str:
    return f"{PACKAGE}/runtime/{name}.py"


def _imported_tops(node) -> list[str]:
    """The top-level names an absolute import (or a dynamic import by a constant name)
    reads; [] for anything else."""
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module.split(".")[0]]
    if isinstance(node, ast.Import):
        return [a.name.split(".")[0] for a in node.names]
    if (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and getattr(node.func, "attr", getattr(node.func, "id", None))
        in ("import_module", "__import__")
    ):
        return [node.args[0].value.split(".")[0]]
    return []


def check_imports(name: str, text: str, copied: set[str]) -> None:
    """Every import of a copied module, after the rewrites: relative to a copied
    module, or of the standard library, numpy, torch or vllm; no import by name of
    tq_chunked."""
    for node in ast.walk(ast.parse(text)):
        where = f"{_origin(name)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module and node.module.split(".")[0] not in copied:
                raise VendorError(
                    f"{where}: imports .{node.module}, which is not copied"
                )
            continue
        for top in _imported_tops(node):
            if top == PACKAGE:
                raise VendorError(
                    f"{where}: imports {PACKAGE} outside its runtime; the runtime "
                    f"({PACKAGE}/runtime/) is what vLLM gets, nothing else"
                )
            if top not in THIRD_PARTY and top not in sys.stdlib_module_names:
                raise VendorError(
                    f"{where}: imports {top}, which vLLM does not depend on"
                )


def package_files(runtime_dir: Path | None = None) -> dict[str, str]:
    """{file name: text} of the vendored package: every module of the runtime
    directory (whatever modules it holds), its imports rewritten and checked, each
    under a header saying where it comes from."""
    runtime_dir = runtime_dir or RUNTIME_DIR
    texts = {p.stem: p.read_text() for p in sorted(runtime_dir.glob("*.py"))}
    if "__init__" not in texts:
        raise VendorError(f"{runtime_dir} has no __init__.py: it is not the runtime")
    files = {}
    for name, text in texts.items():
        text = rewrite_triton_imports(name, rewrite_imports(name, text))
        check_imports(name, text, set(texts))
        files[f"{name}.py"] = header(_origin(name)) + text
    return files
