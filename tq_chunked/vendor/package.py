"""Step 1: the copy of tq_chunked's runtime that vLLM imports as
``vllm.v1.attention.ops.tq_chunked``.

The runtime is one directory, ``tq_chunked/runtime/``: every module in it is copied,
and nothing else (the plugin, the tools, the vendor tool and the kernel prototype live
outside it). Each import of the runtime by its full name is made relative, and every
import of the copied code is checked: relative to a copied module, the standard
library, torch, triton or vllm.
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
# depends on already.
THIRD_PARTY = frozenset({"torch", "triton", "vllm"})


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
    """Every import of a copied module, after the rewrite: relative to a copied module,
    or of the standard library, torch, triton or vllm; no import by name of
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
    directory, its imports rewritten and checked, each under a header saying where it
    comes from."""
    runtime_dir = runtime_dir or RUNTIME_DIR
    texts = {p.stem: p.read_text() for p in sorted(runtime_dir.glob("*.py"))}
    if "__init__" not in texts:
        raise VendorError(f"{runtime_dir} has no __init__.py: it is not the runtime")
    files = {}
    for name, text in texts.items():
        text = rewrite_imports(name, text)
        check_imports(name, text, set(texts))
        files[f"{name}.py"] = header(_origin(name)) + text
    return files
