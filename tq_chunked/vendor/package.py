"""Step 1: the copy of tq_chunked's runtime modules that vLLM imports as
``vllm.v1.attention.ops.tq_chunked``.

The modules are ``vllm_backend`` and the package ``__init__`` with whatever they import
(found by reading the imports, never the benchmark, demo, CLI or harness modules); each
import of the top-level ``tq_chunked`` name is made relative, and every import of the
copied code is checked: relative to a copied module, the standard library, torch,
triton or vllm.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

from .. import __version__
from .paths import BACKEND_MODULE, LINE, PACKAGE, VendorError

# What vLLM imports: the package itself, and the module turboquant_attn.py calls. The
# modules to copy are these and whatever they import, found by reading the imports.
ROOTS = ("__init__", BACKEND_MODULE)
# Modules that are tools around tq_chunked, not part of what vLLM runs: if a runtime
# module ever imports one of them, the tool refuses rather than ship it.
NOT_FOR_VLLM = frozenset(
    {
        "baseline",
        "bench",
        "bench_engine",
        "cli",
        "demo",
        "reference",
        "testing",
        "vllm_harness",
        "vllm_plugin",
    }
)
# What the copied code may import besides itself: the standard library and what vLLM
# depends on already.
THIRD_PARTY = frozenset({"torch", "triton", "vllm"})
SOURCE_DIR = Path(__file__).resolve().parent.parent


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


def package_deps(name: str, tree: ast.Module, available: set[str]) -> set[str]:
    """The package modules ``name`` imports (relative or as ``tq_chunked.x``),
    anywhere in it (imports inside functions too)."""
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level > 1:
                raise VendorError(
                    f"{PACKAGE}/{name}.py:{node.lineno}: an import from above the "
                    f"package (level {node.level}); the package is flat"
                )
            if node.level == 0 and module != PACKAGE:
                if module.startswith(PACKAGE + "."):
                    deps.add(module.split(".")[1])
                continue
            sub = module if node.level == 1 else None
            if sub:
                deps.add(sub.split(".")[0])
            else:  # from . import x: a module, or a name the package __init__ defines
                deps.update(
                    a.name if a.name in available else "__init__" for a in node.names
                )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    deps.add(a.name.split(".")[1])
    return deps


def _rewrite_from(lines, node, where):
    i = node.lineno - 1
    pattern = re.compile(r"from\s+" + re.escape(node.module) + r"(?=\s)")
    head, tail = lines[i][: node.col_offset], lines[i][node.col_offset :]
    relative = "from ." + node.module[len(PACKAGE) + 1 :]
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
        or node.names[0].name.count(".") != 1
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
        + f"from . import {a.name.split('.')[1]} as {a.asname}"
        + line[node.end_col_offset :]
    )


def rewrite_imports(name: str, text: str) -> str:
    """``text`` with every import of the top-level ``tq_chunked`` name made relative
    (``from tq_chunked.x import y`` -> ``from .x import y``; ``import tq_chunked.x as
    y`` -> ``from . import x as y``). An import that would bind the name
    ``tq_chunked`` itself cannot be made relative and is refused."""
    lines = text.splitlines(keepends=True)
    nodes = sorted(ast.walk(ast.parse(text)), key=lambda n: -getattr(n, "lineno", 0))
    for node in nodes:
        where = f"{PACKAGE}/{name}.py:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module == PACKAGE or node.module.startswith(PACKAGE + "."))
        ):
            _rewrite_from(lines, node, where)
        elif isinstance(node, ast.Import) and any(
            a.name == PACKAGE or a.name.startswith(PACKAGE + ".") for a in node.names
        ):
            _rewrite_import(lines, node, where)
    return "".join(lines)


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
        where = f"{PACKAGE}/{name}.py:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module and node.module.split(".")[0] not in copied:
                raise VendorError(
                    f"{where}: imports .{node.module}, which is not copied"
                )
            continue
        for top in _imported_tops(node):
            if top == PACKAGE:
                raise VendorError(
                    f"{where}: still imports {PACKAGE} by name after the rewrite"
                )
            if top not in THIRD_PARTY and top not in sys.stdlib_module_names:
                raise VendorError(
                    f"{where}: imports {top}, which vLLM does not depend on"
                )


def package_files(source_dir: Path | None = None) -> dict[str, str]:
    """{file name: text} of the vendored package: the modules vLLM needs at runtime,
    their imports rewritten and checked, each under a header saying where it comes
    from."""
    source_dir = source_dir or SOURCE_DIR
    available = {p.stem for p in source_dir.glob("*.py")}
    texts: dict[str, str] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in texts:
            continue
        if name not in available:
            raise VendorError(
                f"{PACKAGE}/{name}.py is imported by the runtime modules but does not "
                "exist"
            )
        texts[name] = (source_dir / f"{name}.py").read_text()
        todo.extend(package_deps(name, ast.parse(texts[name]), available))
    stray = sorted(NOT_FOR_VLLM & texts.keys())
    if stray:
        raise VendorError(
            f"the runtime modules import {', '.join(m + '.py' for m in stray)}, which "
            "are not for vLLM (benchmarks, demo, CLI, harness, plugin, test helpers)"
        )
    files = {}
    for name, text in sorted(texts.items()):
        text = rewrite_imports(name, text)
        check_imports(name, text, set(texts))
        files[f"{name}.py"] = header(f"{PACKAGE}/{name}.py") + text
    return files
