"""``python -m tq_chunked.vendor VLLM_SOURCE_DIR [--check]``: writes tq_chunked into a vLLM
source tree as a change vLLM's maintainers can review and merge (docs/vendoring.md).

VLLM_SOURCE_DIR holds the ``vllm/`` package (a vLLM git checkout, or a site-packages
directory). The tool

1. copies the modules vLLM needs at runtime (``vllm_backend`` and what it imports, and
   the package ``__init__``; found by following the imports, never the benchmark, demo,
   CLI or harness modules) to ``vllm/v1/attention/ops/tq_chunked/``, with every import
   of the top-level ``tq_chunked`` name made relative, and checked: each import of the
   copied code is relative to a copied module, the standard library, torch, triton or
   vllm;
2. edits ``vllm/v1/attention/backends/turboquant_attn.py`` so that vLLM's own methods
   call ``vllm_backend.ChunkedPrefill`` (the object the runtime plugin calls too), and
   nothing else in the file:

   * one import, and one module-level ``ChunkedPrefill`` (its workspace from vLLM's
     WorkspaceManager where the module uses one);
   * ``TurboQuantAttentionImpl._prefill_attention`` and ``_continuation_prefill``: their
     bodies become a call (signature and docstring kept). Where a body also serves AMD's
     struct-of-arrays cache layout (``self._soa_store``), it stays, for that layout
     only, behind an early return (tq_chunked reads the default layout only);
   * the workspace reservation: where ``TurboQuantMetadataBuilder._reserve_workspace``
     reserves the (1, Hk, max_model_len, D) continuation pair, the tq_chunked
     workspace is reserved in its place (the pair kept only for the struct-of-arrays
     path, where the module has one); where the module takes buffers from a
     WorkspaceManager but reserves none (0.21-0.23), at the end of the builder's
     ``__init__``;
   * where ``TurboQuantMetadata`` has no host copies of the lengths (0.20.x),
     ``build`` attaches vLLM's own.

Every location is found with ``ast``; a file of any other shape is refused with the list
of what was not found, and nothing is written. The unified diff of turboquant_attn.py is
printed, then one line naming the files added. ``--check`` prints the same and writes
nothing. A tree this tool has already vendored with the same tq_chunked is reported as
such (exit 0); one vendored with another is refused.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .vllm_backend import CONTINUATION_PARAMS, PREFILL_PARAMS

PACKAGE = "tq_chunked"
VENDORED = "vllm.v1.attention.ops.tq_chunked"  # the vendored package's import name
VENDORED_DIR = Path(*VENDORED.split("."))
TARGET = Path("vllm/v1/attention/backends/turboquant_attn.py")
BACKEND_MODULE = "vllm_backend"
# What vLLM imports: the package itself, and the module turboquant_attn.py calls. The
# modules to copy are these and whatever they import, found by reading the imports.
ROOTS = ("__init__", BACKEND_MODULE)
# Modules that are tools around tq_chunked, not part of what vLLM runs: if a runtime
# module ever imports one of them, the tool refuses rather than ship it.
NOT_FOR_VLLM = frozenset(
    {
        "bench",
        "bench_engine",
        "cli",
        "demo",
        "reference",
        "vllm_harness",
        "vllm_plugin",
        "vendor",
    }
)
# What the copied code may import besides itself: the standard library and what vLLM
# depends on already.
THIRD_PARTY = frozenset({"torch", "triton", "vllm"})
LINE = 88  # vLLM's line length (ruff): the generated lines are formatted to fit it
STATE = "_tq_chunked_prefill"  # the module-level ChunkedPrefill in turboquant_attn.py


class VendorError(Exception):
    """The vLLM tree, or tq_chunked itself, is not in a shape this tool can vendor."""


# ---------------------------------------------------------------------------
# 1. The package copy
# ---------------------------------------------------------------------------


def _header(name: str) -> str:
    return (
        "# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
        f"# Vendored from tq_chunked {__version__} ({PACKAGE}/{name}.py) by `python -m tq_chunked.vendor`:\n"
        "# change it there and vendor again (docs/vendoring.md in tq_chunked).\n"
    )


def _package_deps(name: str, tree: ast.Module, available: set[str]) -> set[str]:
    """The package modules ``name`` imports (relative or as ``tq_chunked.x``), anywhere in
    it (imports inside functions too)."""
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level > 1:
                raise VendorError(
                    f"{PACKAGE}/{name}.py:{node.lineno}: an import from above the package "
                    f"(level {node.level}); the package is flat"
                )
            if (
                node.level == 1
                or node.module == PACKAGE
                or (node.module or "").startswith(PACKAGE + ".")
            ):
                sub = (
                    node.module
                    if node.level == 1
                    else node.module[len(PACKAGE) + 1 :] or None
                )
                if sub:
                    deps.add(sub.split(".")[0])
                else:  # from . import x: x is a module, or a name the package __init__ defines
                    deps.update(
                        a.name if a.name in available else "__init__"
                        for a in node.names
                    )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    deps.add(a.name.split(".")[1])
    return deps


def _rewrite_imports(name: str, text: str) -> str:
    """``text`` with every import of the top-level ``tq_chunked`` name made relative
    (``from tq_chunked.x import y`` -> ``from .x import y``; ``import tq_chunked.x as y``
    -> ``from . import x as y``). An import that would bind the name ``tq_chunked`` itself
    cannot be made relative and is refused."""
    lines = text.splitlines(keepends=True)
    for node in sorted(
        ast.walk(ast.parse(text)), key=lambda n: -getattr(n, "lineno", 0)
    ):
        where = f"{PACKAGE}/{name}.py:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module == PACKAGE or node.module.startswith(PACKAGE + "."))
        ):
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
        elif isinstance(node, ast.Import) and any(
            a.name == PACKAGE or a.name.startswith(PACKAGE + ".") for a in node.names
        ):
            if (
                len(node.names) != 1
                or node.names[0].asname is None
                or node.names[0].name.count(".") != 1
                or node.lineno != node.end_lineno
            ):
                raise VendorError(
                    f"{where}: 'import {', '.join(a.name for a in node.names)}' binds the name "
                    f"{PACKAGE}; write it as a relative import ('from . import x')"
                )
            a = node.names[0]
            i = node.lineno - 1
            line = lines[i]
            lines[i] = (
                line[: node.col_offset]
                + f"from . import {a.name.split('.')[1]} as {a.asname}"
                + line[node.end_col_offset :]
            )
    return "".join(lines)


def _check_imports(name: str, text: str, copied: set[str]) -> None:
    """Every import of a copied module, after the rewrite: relative to a copied module, or
    of the standard library, torch, triton or vllm; no import by name of tq_chunked."""
    for node in ast.walk(ast.parse(text)):
        where = f"{PACKAGE}/{name}.py:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module and node.module.split(".")[0] not in copied:
                raise VendorError(
                    f"{where}: imports .{node.module}, which is not copied"
                )
            continue
        if isinstance(node, ast.ImportFrom):
            tops = [node.module.split(".")[0]]
        elif isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
        ):
            tops = [node.args[0].value.split(".")[0]]  # a dynamic import by name
        else:
            continue
        for top in tops:
            if top == PACKAGE:
                raise VendorError(
                    f"{where}: still imports {PACKAGE} by name after the rewrite"
                )
            if top not in THIRD_PARTY and top not in sys.stdlib_module_names:
                raise VendorError(
                    f"{where}: imports {top}, which vLLM does not depend on"
                )


def package_files(source_dir: Path | None = None) -> dict[str, str]:
    """{file name: text} of the vendored package: the modules vLLM needs at runtime, their
    imports rewritten and checked, each under a header saying where it comes from."""
    source_dir = source_dir or Path(__file__).resolve().parent
    available = {p.stem for p in source_dir.glob("*.py")}
    texts: dict[str, str] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in texts:
            continue
        if name not in available:
            raise VendorError(
                f"{PACKAGE}/{name}.py is imported by the runtime modules but does not exist"
            )
        texts[name] = (source_dir / f"{name}.py").read_text()
        todo.extend(_package_deps(name, ast.parse(texts[name]), available))
    stray = sorted(NOT_FOR_VLLM & texts.keys())
    if stray:
        raise VendorError(
            f"the runtime modules import {', '.join(m + '.py' for m in stray)}, which are not for "
            f"vLLM (benchmarks, demo, CLI, harness, plugin, this tool)"
        )
    files = {}
    for name, text in sorted(texts.items()):
        text = _rewrite_imports(name, text)
        _check_imports(name, text, set(texts))
        files[f"{name}.py"] = _header(name) + text
    return files


# ---------------------------------------------------------------------------
# 2. The edits of turboquant_attn.py
# ---------------------------------------------------------------------------


@dataclass
class Edit:
    """Replace lines [start, end) (0-based) with ``new`` (lines without newlines); an
    insertion when start == end."""

    start: int
    end: int
    new: list[str]
    what: str  # for the overlap check's message


def _call(indent: str, head: str, args: list[str]) -> list[str]:
    """``head(args)`` as ruff/black format it at LINE columns: on one line, with the
    arguments on one line of their own, or one argument a line."""
    one = f"{indent}{head}({', '.join(args)})"
    if len(one) <= LINE:
        return [one]
    hugged = f"{indent}    {', '.join(args)}"
    if len(hugged) <= LINE:
        return [f"{indent}{head}(", hugged, f"{indent})"]
    return [f"{indent}{head}("] + [f"{indent}    {a}," for a in args] + [f"{indent})"]


def _comment(indent: str, text: str) -> list[str]:
    """``text`` as comment lines of at most LINE columns."""
    return textwrap.wrap(
        text,
        LINE,
        initial_indent=indent + "# ",
        subsequent_indent=indent + "# ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def _start_with_comments(lines: list[str], node: ast.AST) -> int:
    """The 0-based first line of ``node``, extended upwards over the comment lines right
    above it (they belong to it)."""
    i = node.lineno - 1
    while i > 0 and _is_comment(lines[i - 1]):
        i -= 1
    return i


def _body_start(lines: list[str], fn: ast.FunctionDef) -> int:
    """The 0-based line where ``fn``'s body starts after its signature and docstring
    (comments between them belong to the body)."""
    first = fn.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno
    i = first.lineno - 1
    while i > fn.lineno - 1 and (_is_comment(lines[i - 1]) or not lines[i - 1].strip()):
        i -= 1
    return i


def _docstring_only(fn: ast.FunctionDef) -> bool:
    return len(fn.body) == 1 and ast.get_docstring(fn) is not None


def _references_self_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == attr
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        for n in ast.walk(node)
    )


def _is_get_simultaneous(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Attribute)
        and stmt.value.func.attr == "get_simultaneous"
    )


def _is_fp16_pair(call: ast.Call) -> bool:
    """``get_simultaneous((shape, torch.float16), (shape, torch.float16))``: two buffers of
    one shape."""
    return (
        len(call.args) == 2
        and all(
            isinstance(a, ast.Tuple)
            and len(a.elts) == 2
            and ast.unparse(a.elts[1]) == "torch.float16"
            for a in call.args
        )
        and ast.unparse(call.args[0].elts[0]) == ast.unparse(call.args[1].elts[0])
    )


def _module_imports(tree: ast.Module) -> dict[str, ast.stmt]:
    """Names bound by the module's imports (top level, and inside top-level ifs/trys)."""
    names = {}
    for stmt in tree.body:
        for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = node
    return names


def _used_names(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _class(tree, name, missing):
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return stmt
    missing.append(f"class {name}")
    return None


def _method(cls, name, missing, params=None):
    if cls is None:
        return None
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            args = [
                a.arg
                for a in stmt.args.posonlyargs + stmt.args.args + stmt.args.kwonlyargs
            ]
            if params is not None and (
                args != params or stmt.args.vararg or stmt.args.kwarg
            ):
                missing.append(
                    f"{cls.name}.{name}{tuple(params)} (found {cls.name}.{name}{tuple(args)})"
                )
                return None
            if _docstring_only(stmt):
                missing.append(f"a body in {cls.name}.{name}")
                return None
            return stmt
    missing.append(f"{cls.name}.{name}")
    return None


@dataclass
class Plan:
    """The edits for one turboquant_attn.py, and what they found (for the summary)."""

    edits: list[Edit]
    notes: list[str]


def plan_edits(text: str) -> Plan:
    """The edits that make turboquant_attn.py (``text``) call tq_chunked, or VendorError
    naming everything that was not found in the expected shape."""
    tree = ast.parse(text)
    lines = text.splitlines()
    missing: list[str] = []
    notes: list[str] = []
    imports = _module_imports(tree)
    defined = {
        n.id
        for s in tree.body
        if isinstance(s, ast.Assign)
        for n in s.targets
        if isinstance(n, ast.Name)
    }
    defined |= {
        s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.ClassDef))
    }

    impl = _class(tree, "TurboQuantAttentionImpl", missing)
    builder = _class(tree, "TurboQuantMetadataBuilder", missing)
    meta = _class(tree, "TurboQuantMetadata", missing)
    prefill = _method(impl, "_prefill_attention", missing, PREFILL_PARAMS)
    continuation = _method(impl, "_continuation_prefill", missing, CONTINUATION_PARAMS)
    uses_manager = (
        "current_workspace_manager" in imports
    )  # the module takes buffers from a WorkspaceManager
    has_flydsl = (
        "is_flydsl_available" in imports
    )  # the struct-of-arrays (FlyDSL) path exists
    host_copies = meta is not None and any(
        isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "query_start_loc_cpu"
        for s in meta.body
    )
    has_reserve = builder is not None and any(
        isinstance(s, ast.FunctionDef) and s.name == "_reserve_workspace"
        for s in builder.body
    )
    reserve = _method(builder, "_reserve_workspace", missing) if has_reserve else None
    # Where nothing reserves the workspace (0.21-0.23), the builder's __init__ will.
    builder_init = (
        _method(builder, "__init__", missing)
        if uses_manager and not has_reserve
        else None
    )
    build = None if host_copies else _method(builder, "build", missing)
    taken = sorted(
        {STATE, "ChunkedPrefill", "window_from_env", "attach_host_lengths"}
        & (defined | imports.keys())
    )
    if taken:
        missing.append(f"free module-level names (already bound: {', '.join(taken)})")
    vllm_imports = [
        s
        for s in tree.body
        if isinstance(s, ast.ImportFrom) and (s.module or "").startswith("vllm.")
    ]
    if not vllm_imports:
        missing.append("a top-level 'from vllm... import' to place the import among")
    first_def = next(
        (s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.ClassDef))), None
    )
    if first_def is None or tree.body.index(first_def) == 0:
        missing.append("a module-level statement before the first function or class")

    # The continuation reservation in _reserve_workspace: everything after its first
    # get_simultaneous (the decode scratch, kept), ending in the max_model_len fp16 pair.
    pair_block = None
    if reserve is not None:
        body = reserve.body
        first = next((i for i, s in enumerate(body) if _is_get_simultaneous(s)), None)
        block = body[first + 1 :] if first is not None else []
        if (
            first is None
            or not block
            or not _is_get_simultaneous(block[-1])
            or not _is_fp16_pair(block[-1].value)
            or "max_model_len" not in "".join(ast.unparse(s) for s in block)
        ):
            missing.append(
                "in TurboQuantMetadataBuilder._reserve_workspace: the decode get_simultaneous(...), then "
                "statements ending in get_simultaneous((shape, torch.float16), (shape, torch.float16)) "
                "of a max_model_len-sized shape"
            )
        else:
            pair_block = block
    if not uses_manager and reserve is not None:
        missing.append(
            "current_workspace_manager imported at module level (the module has _reserve_workspace)"
        )
    build_return = None
    if build is not None:
        last = build.body[-1]
        if not (
            isinstance(last, ast.Return)
            and isinstance(last.value, ast.Call)
            and ast.unparse(last.value.func) == "TurboQuantMetadata"
            and lines[last.lineno - 1][last.col_offset :].startswith("return ")
        ):
            missing.append(
                "TurboQuantMetadataBuilder.build ending in 'return TurboQuantMetadata(...)'"
            )
        elif len(build.args.args) < 3:
            missing.append(
                "TurboQuantMetadataBuilder.build(self, common_prefix_len, common_attn_metadata, ...)"
            )
        elif "metadata" in {n.id for n in ast.walk(build) if isinstance(n, ast.Name)}:
            missing.append(
                "a free local name 'metadata' in TurboQuantMetadataBuilder.build"
            )
        else:
            build_return = last
    if missing:
        raise VendorError(
            "turboquant_attn.py does not have the expected shape; not found: "
            + "; ".join(missing)
        )

    edits: list[Edit] = []
    # The import, in isort order among the module's vllm imports.
    names = (
        ["ChunkedPrefill"]
        + (["attach_host_lengths"] if not host_copies else [])
        + ["window_from_env"]
    )
    module = f"{VENDORED}.{BACKEND_MODULE}"
    statement = f"from {module} import {', '.join(names)}"
    new_import = (
        [statement]
        if len(statement) <= LINE
        else [f"from {module} import ("] + [f"    {n}," for n in names] + [")"]
    )
    after = next((s for s in vllm_imports if s.module > module), None)
    at = (
        _start_with_comments(lines, after)
        if after is not None
        else vllm_imports[-1].end_lineno
    )
    edits.append(Edit(at, at, new_import, "the import"))

    # The module-level ChunkedPrefill, after the module's preamble (before its first def).
    preamble_end = tree.body[tree.body.index(first_def) - 1].end_lineno
    where = (
        "(vllm/v1/attention/ops/tq_chunked) computes prefill attention: every prefill request of a batch "
        "in one call, the cached prefix read in windows into one workspace"
    )
    if uses_manager:
        comment = _comment(
            "", f"tq_chunked {where} from the WorkspaceManager, shared by all layers."
        )
        args = ["current_workspace_manager", "window_from_env()"]
    else:
        comment = _comment(
            "",
            f"tq_chunked {where} per device, shared by all layers (this module takes no "
            f"buffers from a WorkspaceManager).",
        )
        args = ["workspace_manager=None", "window=window_from_env()"]
    comment += _comment(
        "", "TQ_CHUNKED_WINDOW=N sets the window (key rows per window)."
    )
    state = _call("", f"{STATE} = ChunkedPrefill", args)
    edits.append(
        Edit(
            preamble_end,
            preamble_end,
            [""] + comment + state,
            "the module-level ChunkedPrefill",
        )
    )

    # The two methods.
    for fn, call, why in (
        (
            prefill,
            [
                "prefill_attention",
                [
                    "self",
                    "query",
                    "key",
                    "value",
                    "kv_cache",
                    "attn_metadata",
                    "Pi",
                    "centroids",
                ],
            ],
            "the whole prefill part of the batch in one call",
        ),
        (
            continuation,
            ["continuation_prefill", ["self"] + CONTINUATION_PARAMS[2:]],
            "the cached prefix in windows, O(window) memory",
        ),
    ):
        indent = " " * fn.body[0].col_offset
        start = _body_start(lines, fn)
        if _references_self_attr(
            fn, "_soa_store"
        ):  # keep the body, for that layout only
            body = [
                f"{indent}if not self._soa_store:",
                *_comment(
                    indent + "    ",
                    f"tq_chunked: {why}. The struct-of-arrays cache layout (FlyDSL) "
                    f"keeps the path below.",
                ),
                *_call(indent + "    ", f"return {STATE}.{call[0]}", call[1]),
            ]
            edits.append(Edit(start, start, body, f"{fn.name}"))
        else:
            body = [
                *_comment(indent, f"tq_chunked: {why}."),
                *_call(indent, f"return {STATE}.{call[0]}", call[1]),
            ]
            edits.append(Edit(start, fn.end_lineno, body, f"{fn.name}"))

    # The workspace reservation.
    if pair_block is not None:
        indent = " " * pair_block[0].col_offset
        start = _start_with_comments(lines, pair_block[0])
        what = (
            "tq_chunked's prefill workspace (windows of the cached prefix, for max_num_batched_tokens query "
            "tokens)"
        )
        if has_flydsl:
            new = [
                *_comment(
                    indent,
                    f"{what} replaces the (1, Hk, max_model_len, D) K/V pair below, which only the "
                    f"struct-of-arrays (FlyDSL) path uses.",
                ),
                f"{indent}{STATE}.reserve(self)",
                f"{indent}if not is_flydsl_available():",
                f"{indent}    return",
                "",
            ]
            edits.append(Edit(start, start, new, "_reserve_workspace"))
        else:
            new = [
                *_comment(indent, f"{what}, not a (1, Hk, max_model_len, D) K/V pair."),
                f"{indent}{STATE}.reserve(self)",
            ]
            edits.append(
                Edit(start, pair_block[-1].end_lineno, new, "_reserve_workspace")
            )
    elif (
        uses_manager
    ):  # a WorkspaceManager that nothing reserves the prefill buffers in
        indent = " " * builder_init.body[-1].col_offset
        end = builder_init.end_lineno
        edits.append(
            Edit(
                end,
                end,
                [
                    *_comment(
                        indent,
                        "tq_chunked's prefill workspace, reserved before vLLM locks "
                        "the WorkspaceManager.",
                    ),
                    f"{indent}{STATE}.reserve(self)",
                ],
                "TurboQuantMetadataBuilder.__init__",
            )
        )

    # 0.20.x: the host copies of the lengths.
    if build_return is not None:
        i = build_return.lineno - 1
        col = build_return.col_offset
        indent = " " * col
        edits.append(
            Edit(
                i,
                i + 1,
                [lines[i][:col] + "metadata = " + lines[i][col + len("return ") :]],
                "TurboQuantMetadataBuilder.build",
            )
        )
        end = build_return.end_lineno
        cam = build.args.args[2].arg
        edits.append(
            Edit(
                end,
                end,
                [
                    *_comment(
                        indent,
                        "tq_chunked: vLLM's host copies of the lengths, so that "
                        "prefill reads no device tensor back.",
                    ),
                    f"{indent}attach_host_lengths(metadata, {cam}, self.vllm_config)",
                    f"{indent}return metadata",
                ],
                "TurboQuantMetadataBuilder.build",
            )
        )
    return Plan(edits, notes)


def apply_edits(text: str, edits: list[Edit]) -> str:
    lines = text.splitlines()
    spans = sorted(edits, key=lambda e: (e.start, e.end))
    for a, b in zip(spans, spans[1:]):
        if b.start < a.end:
            raise VendorError(f"internal: the edits of {a.what} and {b.what} overlap")
    for e in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        lines[e.start : e.end] = e.new
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def vendored_text(text: str) -> tuple[str, list[str]]:
    """(turboquant_attn.py calling tq_chunked, notes for the maintainer)."""
    plan = plan_edits(text)
    new = apply_edits(text, plan.edits)
    try:
        new_tree = ast.parse(new)
    except SyntaxError as e:  # a bug of this tool: never write it
        raise VendorError(
            f"internal: the edited turboquant_attn.py does not parse ({e})"
        ) from None
    old_tree = ast.parse(text)
    unused = sorted(
        n
        for n in _module_imports(new_tree)
        if n in _used_names(old_tree) and n not in _used_names(new_tree)
    )
    if unused:  # the brief of this tool is to touch nothing else: say it, leave them
        plan.notes.append(
            f"note: no longer used in turboquant_attn.py (left in place; ruff F401 will ask): "
            f"{', '.join(unused)}"
        )
    return new, plan.notes


def is_vendored(text: str) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and (n.module or "").startswith(VENDORED)
        for n in ast.walk(ast.parse(text))
    )


# ---------------------------------------------------------------------------
# 3. The command
# ---------------------------------------------------------------------------


def _write_package(ops_dir: Path, files: dict[str, str]) -> Path:
    """The package written next to its place, then renamed into it (never half there)."""
    tmp = Path(tempfile.mkdtemp(prefix=".tq_chunked-", dir=ops_dir))
    for name, text in files.items():
        (tmp / name).write_text(text)
    target = ops_dir / VENDORED_DIR.name
    tmp.rename(target)
    return target


def _write_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tq_chunked-tmp")
    tmp.write_text(text)
    shutil.copymode(path, tmp)
    os.replace(tmp, path)


def vendor(root: Path, check: bool = False, out=None) -> int:
    out = out or sys.stdout
    target = root / TARGET
    if not target.is_file():
        raise VendorError(
            f"{target} does not exist: VLLM_SOURCE_DIR must contain the vllm/ package "
            f"(a vLLM checkout or site-packages) with the TurboQuant backend"
        )
    package_dir = root / VENDORED_DIR
    files = package_files()
    text = target.read_text()
    if is_vendored(text):
        same = (
            package_dir.is_dir()
            and {p.name: p.read_text() for p in package_dir.glob("*.py")} == files
        )
        if same:
            print(
                f"{TARGET} already calls {VENDORED}, and {VENDORED_DIR}/ holds what tq_chunked {__version__} "
                f"writes: nothing to do",
                file=out,
            )
            return 0
        raise VendorError(
            f"{TARGET} already calls {VENDORED}, but {VENDORED_DIR}/ is not what tq_chunked "
            f"{__version__} writes (another version, or edited): restore vLLM's {TARGET} and "
            f"remove {VENDORED_DIR}/ (in a checkout: git checkout -- {TARGET}; rm -r {VENDORED_DIR}), "
            f"then run this again"
        )
    if package_dir.exists():
        raise VendorError(
            f"{package_dir} exists but {TARGET} does not call it: remove it (a copy from another "
            f"tool or an interrupted run), then run this again"
        )
    new, notes = vendored_text(text)
    diff = difflib.unified_diff(
        text.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{TARGET.as_posix()}",
        tofile=f"b/{TARGET.as_posix()}",
    )
    out.write("".join(diff))
    if not check:
        written = _write_package(package_dir.parent, files)
        try:
            _write_file(target, new)
        except BaseException:
            shutil.rmtree(written)  # nothing half-applied
            raise
    verb = "would add" if check else "added"
    print(
        f"{verb} {VENDORED_DIR.as_posix()}/ ({len(files)} files from tq_chunked {__version__}: "
        f"{', '.join(sorted(files))})"
        + ("; --check: nothing written" if check else ""),
        file=out,
    )
    for note in notes:
        print(note, file=out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tq_chunked.vendor",
        description="Write tq_chunked into a vLLM source tree as a vendored change: the package as "
        f"{VENDORED}, and vLLM's turboquant_attn.py calling it. Prints the diff.",
    )
    parser.add_argument(
        "vllm_source_dir",
        type=Path,
        metavar="VLLM_SOURCE_DIR",
        help="the directory holding the vllm/ package (a vLLM checkout, or site-packages)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="print the diff and the files; write nothing",
    )
    args = parser.parse_args(argv)
    try:
        return vendor(args.vllm_source_dir, check=args.check)
    except VendorError as e:
        print(f"tq_chunked.vendor: {e}; nothing written", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
