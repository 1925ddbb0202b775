"""Reading and editing Python source by line, with ``ast``: what the edits share.

An edit replaces whole lines; the new lines are written as ruff formats them at vLLM's
line length (``call``, ``comment``), so that the edited file stays as vLLM's formatter
leaves it.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass

from .paths import LINE, VendorError


@dataclass
class Edit:
    """Replace lines [start, end) (0-based) with ``new`` (lines without newlines); an
    insertion when start == end."""

    start: int
    end: int
    new: list[str]
    what: str  # for the overlap check's message


def apply_edits(text: str, edits: list[Edit]) -> str:
    """``text`` with ``edits`` applied; overlapping edits are a bug of this tool."""
    lines = text.splitlines()
    spans = sorted(edits, key=lambda e: (e.start, e.end))
    for a, b in zip(spans, spans[1:]):
        if b.start < a.end:
            raise VendorError(f"internal: the edits of {a.what} and {b.what} overlap")
    for e in reversed(spans):
        lines[e.start : e.end] = e.new
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def call(indent: str, head: str, args: list[str]) -> list[str]:
    """``head(args)`` as ruff formats it at LINE columns: on one line, with the
    arguments on one line of their own, or one argument a line."""
    one = f"{indent}{head}({', '.join(args)})"
    if len(one) <= LINE:
        return [one]
    hugged = f"{indent}    {', '.join(args)}"
    if len(hugged) <= LINE:
        return [f"{indent}{head}(", hugged, f"{indent})"]
    return [f"{indent}{head}("] + [f"{indent}    {a}," for a in args] + [f"{indent})"]


def comment(indent: str, text: str) -> list[str]:
    """``text`` as comment lines of at most LINE columns."""
    return textwrap.wrap(
        text,
        LINE,
        initial_indent=indent + "# ",
        subsequent_indent=indent + "# ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def start_with_comments(lines: list[str], node: ast.AST) -> int:
    """The 0-based first line of ``node``, extended upwards over the comment lines right
    above it (they belong to it)."""
    i = node.lineno - 1
    while i > 0 and is_comment(lines[i - 1]):
        i -= 1
    return i


def first_line(node: ast.AST) -> int:
    """The 0-based first line of ``node``, its decorators included."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators]) - 1


def has_docstring(fn: ast.FunctionDef) -> bool:
    first = fn.body[0]
    return (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )


def body_start(lines: list[str], fn: ast.FunctionDef) -> int:
    """The 0-based line where ``fn``'s body starts after its signature and docstring
    (comments between them belong to the body)."""
    if has_docstring(fn):
        return fn.body[0].end_lineno
    i = fn.body[0].lineno - 1
    while i > fn.lineno - 1 and (is_comment(lines[i - 1]) or not lines[i - 1].strip()):
        i -= 1
    return i


def references_self_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == attr
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        for n in ast.walk(node)
    )


def is_call_of(stmt: ast.stmt, attr: str) -> bool:
    """Whether ``stmt`` is an expression statement calling a method named ``attr``."""
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Attribute)
        and stmt.value.func.attr == attr
    )


def is_fp16_pair(node: ast.Call) -> bool:
    """``get_simultaneous((shape, torch.float16), (shape, torch.float16))``: two
    buffers of one shape."""
    return (
        len(node.args) == 2
        and all(
            isinstance(a, ast.Tuple)
            and len(a.elts) == 2
            and ast.unparse(a.elts[1]) == "torch.float16"
            for a in node.args
        )
        and ast.unparse(node.args[0].elts[0]) == ast.unparse(node.args[1].elts[0])
    )


def module_imports(tree: ast.Module) -> dict[str, ast.stmt]:
    """Names bound by the module's imports (top level, and inside top-level
    ifs/trys)."""
    names = {}
    for stmt in tree.body:
        nested = isinstance(stmt, (ast.If, ast.Try))
        for node in ast.walk(stmt) if nested else [stmt]:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = node
    return names


def used_names(tree: ast.Module) -> set[str]:
    """Names the module reads (``x`` and the ``x`` of ``x.y``), outside its imports."""
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def find_class(tree: ast.Module, name: str, missing: list[str]):
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return stmt
    missing.append(f"class {name}")
    return None


def find_method(cls, name: str, missing: list[str], params=None):
    """The method ``name`` of class node ``cls`` with exactly ``params`` (when given)
    and a body beyond its docstring, or None, the reason appended to ``missing``."""
    if cls is None:
        return None
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            a = stmt.args
            args = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            if params is not None and (args != params or a.vararg or a.kwarg):
                missing.append(
                    f"{cls.name}.{name}{tuple(params)} "
                    f"(found {cls.name}.{name}{tuple(args)})"
                )
                return None
            if len(stmt.body) == 1 and has_docstring(stmt):
                missing.append(f"a body in {cls.name}.{name}")
                return None
            return stmt
    missing.append(f"{cls.name}.{name}")
    return None
