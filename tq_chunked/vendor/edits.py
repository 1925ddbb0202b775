"""Step 2: the edits of vLLM's ``turboquant_attn.py``, one function per edit site.

``find_sites`` locates every place with ``ast`` and names at once everything it did
not find; each ``*_edit`` function then writes one site:

* ``import_edit``: the import of the vendored module, in isort order;
* ``state_edit``: one module-level ``ChunkedPrefill``, after the module's constants;
* ``prefill_edit``, ``continuation_edit``: ``TurboQuantAttentionImpl``'s two methods
  call it (their bodies replaced, or, where a body also serves the struct-of-arrays
  cache layout, an early return before it);
* ``reservation_edit``: the builder reserves tq_chunked's workspace before vLLM locks
  the WorkspaceManager, and vLLM's (1, Hk, max_model_len, D) continuation pair only
  for layers that keep a continuation prefill of their own;
* ``build_edits``: ``build`` plans the step's prefill once for every layer to run
  (``ChunkedPrefill.plan_step``), after attaching vLLM's own host copies of the
  lengths where the metadata has none (0.20.x);
* ``unused_import_edits``: the imports that only the replaced bodies used, removed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..runtime.vllm_backend import CONTINUATION_PARAMS, PREFILL_PARAMS
from .paths import BACKEND_MODULE, LINE, STATE, VENDORED, VENDORED_DIR, VendorError
from .source import (
    Edit,
    apply_edits,
    body_start,
    call,
    comment,
    find_class,
    find_method,
    is_call_of,
    is_fp16_pair,
    module_imports,
    references_self_attr,
    start_with_comments,
    used_names,
)

IMPL, BUILDER, METADATA = (
    "TurboQuantAttentionImpl",
    "TurboQuantMetadataBuilder",
    "TurboQuantMetadata",
)
# Names the edits bind at module level.
NEW_NAMES = (STATE, "ChunkedPrefill", "window_from_env", "attach_host_lengths")


@dataclass
class Sites:
    """Where the edits go in one turboquant_attn.py."""

    lines: list[str]
    prefill: ast.FunctionDef
    continuation: ast.FunctionDef
    vllm_imports: list[ast.ImportFrom]
    first_def: ast.stmt
    preamble_end: int  # 0-based line after the last statement before first_def
    uses_manager: bool  # the module takes buffers from a WorkspaceManager
    host_copies: bool  # TurboQuantMetadata has query_start_loc_cpu
    pair_start: int | None  # first line of the continuation pair in _reserve_workspace
    pair_indent: str
    builder_init: ast.FunctionDef | None  # where nothing reserves (0.21-0.23)
    build: ast.FunctionDef | None  # where the step is planned


def _pair_block(reserve: ast.FunctionDef, missing: list[str]):
    """The statements of ``_reserve_workspace`` after its first get_simultaneous (the
    decode scratch), ending in the max_model_len fp16 pair; None if not that shape."""
    body = reserve.body
    first = next(
        (i for i, s in enumerate(body) if is_call_of(s, "get_simultaneous")), None
    )
    block = body[first + 1 :] if first is not None else []
    if (
        not block
        or not is_call_of(block[-1], "get_simultaneous")
        or not is_fp16_pair(block[-1].value)
        or "max_model_len" not in "".join(ast.unparse(s) for s in block)
    ):
        missing.append(
            f"in {BUILDER}._reserve_workspace: the decode get_simultaneous(...), then "
            "statements ending in get_simultaneous((shape, torch.float16), (shape, "
            "torch.float16)) of a max_model_len-sized shape"
        )
        return None
    return block


def _build_return(build: ast.FunctionDef, lines: list[str], missing: list[str]):
    last = build.body[-1]
    if not (
        isinstance(last, ast.Return)
        and isinstance(last.value, ast.Call)
        and ast.unparse(last.value.func) == METADATA
        and lines[last.lineno - 1][last.col_offset :].startswith("return ")
    ):
        missing.append(f"{BUILDER}.build ending in 'return {METADATA}(...)'")
    elif len(build.args.args) < 3:
        missing.append(
            f"{BUILDER}.build(self, common_prefix_len, common_attn_metadata, ...)"
        )
    elif "metadata" in {n.id for n in ast.walk(build) if isinstance(n, ast.Name)}:
        missing.append(f"a free local name 'metadata' in {BUILDER}.build")
    else:
        return build
    return None


def find_sites(text: str) -> Sites:
    """Every place the edits go, or VendorError naming everything that was not found
    in the expected shape."""
    tree = ast.parse(text)
    lines = text.splitlines()
    missing: list[str] = []
    imports = module_imports(tree)
    impl = find_class(tree, IMPL, missing)
    builder = find_class(tree, BUILDER, missing)
    meta = find_class(tree, METADATA, missing)
    prefill = find_method(impl, "_prefill_attention", missing, PREFILL_PARAMS)
    continuation = find_method(
        impl, "_continuation_prefill", missing, CONTINUATION_PARAMS
    )
    uses_manager = "current_workspace_manager" in imports
    host_copies = meta is not None and any(
        isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "query_start_loc_cpu"
        for s in meta.body
    )
    has_reserve = builder is not None and any(
        isinstance(s, ast.FunctionDef) and s.name == "_reserve_workspace"
        for s in builder.body
    )
    reserve = (
        find_method(builder, "_reserve_workspace", missing) if has_reserve else None
    )
    block = _pair_block(reserve, missing) if reserve is not None else None
    if reserve is not None and not uses_manager:
        missing.append(
            "current_workspace_manager imported at module level (the module has "
            "_reserve_workspace)"
        )
    # Where nothing reserves the workspace (0.21-0.23), the builder's __init__ will.
    builder_init = (
        find_method(builder, "__init__", missing)
        if uses_manager and not has_reserve
        else None
    )
    build = find_method(builder, "build", missing)
    build = _build_return(build, lines, missing) if build else None
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
    taken = sorted(set(NEW_NAMES) & (defined | imports.keys()))
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
    if missing:
        raise VendorError(
            "turboquant_attn.py does not have the expected shape; not found: "
            + "; ".join(missing)
        )
    return Sites(
        lines=lines,
        prefill=prefill,
        continuation=continuation,
        vllm_imports=vllm_imports,
        first_def=first_def,
        preamble_end=tree.body[tree.body.index(first_def) - 1].end_lineno,
        uses_manager=uses_manager,
        host_copies=host_copies,
        pair_start=start_with_comments(lines, block[0]) if block else None,
        pair_indent=" " * block[0].col_offset if block else "",
        builder_init=builder_init,
        build=build,
    )


def import_edit(s: Sites) -> Edit:
    """``from vllm.v1.attention.ops.tq_chunked.vllm_backend import ...``, before the
    first vllm import that sorts after it (isort order)."""
    names = ["ChunkedPrefill"]
    names += [] if s.host_copies else ["attach_host_lengths"]
    names += ["window_from_env"]
    module = f"{VENDORED}.{BACKEND_MODULE}"
    statement = f"from {module} import {', '.join(names)}"
    new = (
        [statement]
        if len(statement) <= LINE
        else [f"from {module} import ("] + [f"    {n}," for n in names] + [")"]
    )
    after = next((i for i in s.vllm_imports if i.module > module), None)
    if after is not None:
        at = start_with_comments(s.lines, after)
    else:
        at = s.vllm_imports[-1].end_lineno
    return Edit(at, at, new, "the import")


def state_edit(s: Sites) -> Edit:
    """The module-level ChunkedPrefill, after the module's preamble."""
    what = (
        f"tq_chunked ({VENDORED_DIR.as_posix()}) computes prefill attention: every "
        "prefill request of a batch in one call, the cached prefix read in windows "
        "into one workspace"
    )
    if s.uses_manager:
        text = (
            f"{what} from the WorkspaceManager, shared by all layers (this module's "
            "current_workspace_manager, looked up at each call)."
        )
        hooks = "__name__"
    else:
        text = (
            f"{what} per device, shared by all layers (this module takes no buffers "
            "from a WorkspaceManager)."
        )
        hooks = "None"
    lines = comment("", text)
    lines += comment("", "TQ_CHUNKED_WINDOW=N sets the window (key rows per window).")
    lines += call(
        "", f"{STATE} = ChunkedPrefill", [f"hooks={hooks}", "window=window_from_env()"]
    )
    return Edit(s.preamble_end, s.preamble_end, ["", *lines], "the ChunkedPrefill")


def _method_edit(s: Sites, fn: ast.FunctionDef, method: str, args, why: str) -> Edit:
    indent = " " * fn.body[0].col_offset
    start = body_start(s.lines, fn)
    ret = call(indent, f"return {STATE}.{method}", args)
    if references_self_attr(fn, "_soa_store"):  # the body stays, for that layout
        note = (
            f"tq_chunked: {why}. The struct-of-arrays cache layout (FlyDSL) keeps the "
            "path below."
        )
        new = [
            f"{indent}if not self._soa_store:",
            *comment(indent + "    ", note),
            *call(indent + "    ", f"return {STATE}.{method}", args),
        ]
        return Edit(start, start, new, fn.name)
    return Edit(
        start, fn.end_lineno, [*comment(indent, f"tq_chunked: {why}."), *ret], fn.name
    )


def prefill_edit(s: Sites) -> Edit:
    """``_prefill_attention`` calls ``ChunkedPrefill.prefill_attention``."""
    args = ["self", "query", "key", "value", "kv_cache", "attn_metadata", "Pi"]
    return _method_edit(
        s,
        s.prefill,
        "prefill_attention",
        [*args, "centroids"],
        "the whole prefill part of the batch in one call",
    )


def continuation_edit(s: Sites) -> Edit:
    """``_continuation_prefill`` calls ``ChunkedPrefill.continuation_prefill``."""
    return _method_edit(
        s,
        s.continuation,
        "continuation_prefill",
        ["self", *CONTINUATION_PARAMS[2:]],
        "the cached prefix in windows, O(window) memory",
    )


def reservation_edit(s: Sites) -> Edit | None:
    """The builder reserves tq_chunked's workspace: in ``_reserve_workspace`` before
    vLLM's continuation pair, which it then skips unless a layer keeps a continuation
    prefill of its own; where nothing reserves (0.21-0.23), at the end of the
    builder's ``__init__``; none where there is no WorkspaceManager (0.20.x)."""
    reserve = f"{STATE}.reserve(self, {IMPL})"
    if s.pair_start is not None:
        indent = s.pair_indent
        note = (
            f"tq_chunked computes the prefill of every layer whose impl inherits "
            f"{IMPL}'s prefill methods, in windows of one workspace (for "
            "max_num_batched_tokens query tokens) that it reserves here. The "
            "(1, Hk, max_model_len, D) K/V pair below is only for layers that keep a "
            "continuation prefill of their own (a subclass such as UltraQuant, or "
            "the struct-of-arrays (FlyDSL) cache layout)."
        )
        new = [
            *comment(indent, note),
            f"{indent}if {reserve}:",
            f"{indent}    return",
            "",
        ]
        return Edit(s.pair_start, s.pair_start, new, "_reserve_workspace")
    if s.builder_init is not None:
        indent = " " * s.builder_init.body[-1].col_offset
        end = s.builder_init.end_lineno
        note = (
            "tq_chunked's prefill workspace, reserved before vLLM locks the "
            "WorkspaceManager."
        )
        new = [*comment(indent, note), f"{indent}{reserve}"]
        return Edit(end, end, new, f"{BUILDER}.__init__")
    return None


def build_edits(s: Sites) -> list[Edit]:
    """``return TurboQuantMetadata(...)`` becomes ``metadata = ...``; then (0.20.x)
    vLLM's host copies of the lengths are attached, the step's prefill is planned,
    and it is returned."""
    ret = s.build.body[-1]
    i, col = ret.lineno - 1, ret.col_offset
    indent = " " * col
    line = s.lines[i]
    cam = s.build.args.args[2].arg
    new = []
    if not s.host_copies:
        note = (
            "tq_chunked: vLLM's host copies of the lengths, so that prefill reads no "
            "device tensor back."
        )
        new += [
            *comment(indent, note),
            f"{indent}attach_host_lengths(metadata, {cam}, self.vllm_config)",
        ]
    note = (
        "tq_chunked: the prefill part of the step planned once (its windows, their "
        "device indices and workspace), for every layer's _prefill_attention to run."
    )
    new += [
        *comment(indent, note),
        f"{indent}{STATE}.plan_step(self, metadata, {IMPL})",
        f"{indent}return metadata",
    ]
    return [
        Edit(i, i + 1, [line[:col] + "metadata = " + line[col + 7 :]], "build"),
        Edit(ret.end_lineno, ret.end_lineno, new, "build"),
    ]


def plan_edits(text: str) -> list[Edit]:
    """The edits that make turboquant_attn.py (``text``) call tq_chunked, or
    VendorError naming everything that was not found in the expected shape."""
    s = find_sites(text)
    edits = [import_edit(s), state_edit(s), prefill_edit(s), continuation_edit(s)]
    reservation = reservation_edit(s)
    if reservation is not None:
        edits.append(reservation)
    return edits + build_edits(s)


def _import_lines(stmt: ast.ImportFrom | ast.Import, keep: list[ast.alias], lines):
    """``stmt`` rewritten with the names ``keep`` only, in its own style (one line, or
    parenthesized with one name a line)."""
    indent = " " * stmt.col_offset
    names = [a.name + (f" as {a.asname}" if a.asname else "") for a in keep]
    if isinstance(stmt, ast.Import):
        return [f"{indent}import {', '.join(names)}"]
    head = f"{indent}from {'.' * stmt.level}{stmt.module or ''} import "
    one = head + ", ".join(names)
    if stmt.lineno == stmt.end_lineno and len(one) <= LINE:
        return [one]
    return [head + "("] + [f"{indent}    {n}," for n in names] + [f"{indent})"]


def unused_import_edits(old_text: str, new_text: str) -> tuple[list[Edit], list[str]]:
    """Edits of ``new_text`` that remove the names of its top-level imports that the
    edits left unused (used in ``old_text``, not in ``new_text``), and those names."""
    old_used, new_tree = used_names(ast.parse(old_text)), ast.parse(new_text)
    new_used, lines = used_names(new_tree), new_text.splitlines()
    edits, removed = [], []
    for stmt in new_tree.body:
        if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        gone = [
            a
            for a in stmt.names
            if (a.asname or a.name.split(".")[0]) in old_used - new_used
        ]
        if not gone:
            continue
        removed += [a.asname or a.name for a in gone]
        keep = [a for a in stmt.names if a not in gone]
        start = start_with_comments(lines, stmt) if not keep else stmt.lineno - 1
        new = _import_lines(stmt, keep, lines) if keep else []
        edits.append(Edit(start, stmt.end_lineno, new, f"import of {removed[-1]}"))
    return edits, removed


def vendored_text(text: str) -> tuple[str, list[str]]:
    """(turboquant_attn.py calling tq_chunked, notes for the maintainer)."""
    new = apply_edits(text, plan_edits(text))
    try:
        ast.parse(new)
    except SyntaxError as e:  # a bug of this tool: never write it
        raise VendorError(
            f"internal: the edited turboquant_attn.py does not parse ({e})"
        ) from None
    edits, removed = unused_import_edits(text, new)
    new = apply_edits(new, edits)
    notes = []
    if removed:
        notes.append(
            "note: imports only the replaced method bodies used, removed: "
            + ", ".join(removed)
        )
    return new, notes


def is_vendored(text: str) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and (n.module or "").startswith(VENDORED)
        for n in ast.walk(ast.parse(text))
    )
