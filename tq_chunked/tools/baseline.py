"""vLLM's own TurboQuant prefill: the baseline ``tq-chunked bench`` compares with.

By default it is the installed vLLM's ``TurboQuantAttentionImpl`` methods, as they are.
Given the path to another release's ``vllm/v1/attention/backends/turboquant_attn.py``
(``tq-chunked bench --baseline-source PATH``), it is that release's methods, compiled
into the installed runtime: a release that cannot be installed next to this torch (each
vLLM release pins one) can still be timed on it, since its prefill calls the same kinds
of kernels (vLLM's Triton dequantization and decode, FlashAttention) through the
installed modules. How a source is run:

* methods: ``_prefill_attention`` and ``_continuation_prefill``, and every method of the
  source's ``TurboQuantAttentionImpl`` that they call on ``self`` (read from the code),
  are compiled from the source and bound to one impl object as instance attributes; the
  installed class, and every other impl, stay as they are. Their signatures must be the
  installed ones: the benchmark calls them as the installed ``forward`` does;
* module-level names they use: what the source defines (functions, constants) is taken
  from the source; what it imports is taken from the installed runtime (the installed
  module's name, else the source's import statement, run here). A name that resolves
  neither way is an error naming it, raised before anything runs;
* what the source's ``__init__`` and ``_ensure_on_device`` derive that the installed
  ones do not: set on the impl and the layer from the installed values, where absent
  (:data:`ADAPTATIONS`, each with its reason).
"""

from __future__ import annotations

import ast
import dis
import hashlib
import inspect
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODULE = "vllm.v1.attention.backends.turboquant_attn"
CLASS = "TurboQuantAttentionImpl"
ENTRY_METHODS = ("_prefill_attention", "_continuation_prefill")
# Per-layer buffers a release's _continuation_prefill keeps between calls (0.20), freed
# by reset() so that the next call allocates them again and its peak counts them.
LAYER_BUFFERS = ("_tq_k_dequant_buf", "_tq_v_dequant_buf")

ADAPTATIONS = (  # (object, attribute, value from the installed impl and layer, reason)
    (
        "impl",
        "_soa_store",
        lambda impl, layer: False,
        (
            "the cache layout: array-of-structs, the one the installed store writes "
            "(releases with FlyDSL's ROCm decode write struct-of-arrays there)"
        ),
    ),
    (
        "layer",
        "_tq_Pi_half",
        lambda impl, layer: layer._tq_Pi.to(torch.float16),
        (
            "the rotation in fp16, which later releases derive in _ensure_on_device "
            "for their continuation prefill"
        ),
    ),
)


class BaselineError(ValueError):
    """The baseline source cannot be run in the installed vLLM; the message says why."""


@dataclass(frozen=True)
class Baseline:
    """vLLM's prefill methods from the installed release (``source`` None) or from a
    release's turboquant_attn.py, and how to put them on an impl (:meth:`attach`)."""

    vllm_version: str  # of the installed runtime
    source: str | None = None  # path of the turboquant_attn.py the methods come from
    sha256: str | None = None  # of that file
    methods: dict = field(default_factory=dict)  # name -> function; {} when installed
    # Names the source binds only under a condition (``if _HAS_FLASH_ATTN: from ...
    # import flash_attn_varlen_func``) whose statement fails here: left unbound, as
    # the source module itself would leave them; its code reads them only under that
    # condition.
    unbound: tuple = ()

    def describe(self) -> str:
        """One line for the results and the console: where the methods come from."""
        if self.source is None:
            return f"vLLM {self.vllm_version}'s own methods, as installed"
        unbound = (
            f"; unbound here, as that module leaves them: {', '.join(self.unbound)}"
            if self.unbound
            else ""
        )
        return (
            f"the methods of {self.source} (sha256 {self.sha256[:12]}), run in the "
            f"installed vLLM {self.vllm_version}'s runtime{unbound}"
        )

    def attach(self, impl, layer, device) -> None:
        """Make ``impl`` (an installed TurboQuantAttentionImpl, with its ``layer``)
        run the baseline's methods; initialize vLLM's WorkspaceManager where the
        runtime has one and it is not yet."""
        for name, function in self.methods.items():
            setattr(impl, name, types.MethodType(function, impl))
        if self.source is not None:
            objects = {"impl": impl, "layer": layer}
            for target, attribute, value, _ in ADAPTATIONS:
                if not hasattr(objects[target], attribute):
                    setattr(objects[target], attribute, value(impl, layer))
        ensure_workspace(device)

    def reset(self, layer, device) -> None:
        """Free what the methods keep between calls (per-layer buffers, vLLM's
        WorkspaceManager), so that the next call allocates, and its peak counts, it."""
        for name in LAYER_BUFFERS:
            if hasattr(layer, name):
                delattr(layer, name)
        workspace = _workspace_module()
        if workspace is not None:
            workspace.reset_workspace_manager()
            workspace.init_workspace_manager(torch.device(device))


def ensure_workspace(device) -> None:
    """Initialize vLLM's WorkspaceManager on ``device`` where the installed release
    has one and it is not yet (releases from 0.21 take their buffers from it)."""
    workspace = _workspace_module()
    if workspace is not None and not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device(device))


def continuation_prefill(
    impl, layer, query, key_chunk, val_chunk, kv_cache, block_table, cached_len
):
    """``impl._continuation_prefill`` for one request, with vLLM's arguments."""
    return impl._continuation_prefill(
        layer,
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        block_table.reshape(1, -1),
        cached_len,
        cached_len + query.shape[0],
        layer._tq_Pi,
        layer._tq_centroids,
    )


def load(source: str | Path | None = None) -> Baseline:
    """The baseline: the installed vLLM's methods, or those of ``source``, the path to
    a release's turboquant_attn.py. Raises BaselineError if they cannot run here."""
    import importlib

    if source is None:
        import vllm

        importlib.import_module(MODULE)  # the installed release has TurboQuant
        return Baseline(vllm.__version__)
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise BaselineError(
            f"baseline source {source}: cannot read it ({e.strerror}); expected the "
            "path to a vLLM release's vllm/v1/attention/backends/turboquant_attn.py"
        ) from None
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as e:
        raise BaselineError(
            f"baseline source {source}: not Python this interpreter reads "
            f"(line {e.lineno}: {e.msg})"
        ) from None
    _class_methods(tree, path)  # the right file, before vLLM is imported
    import vllm

    installed = importlib.import_module(MODULE)
    methods, unbound = _compile_methods(
        tree, str(path), vars(installed), getattr(installed, CLASS)
    )
    return Baseline(
        vllm.__version__,
        str(path),
        hashlib.sha256(text.encode()).hexdigest(),
        methods,
        unbound,
    )


# ---------------------------------------------------------------------------
# Compiling a source's methods into the installed runtime
# ---------------------------------------------------------------------------


def _workspace_module():
    """The workspace module of the installed vLLM where it has one, else None."""
    try:
        from vllm.v1.worker import workspace
    except ImportError:
        return None
    return workspace


def _class_methods(tree, path):
    """{name: FunctionDef} of the source's TurboQuantAttentionImpl."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            return {
                n.name: n
                for n in node.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    raise BaselineError(
        f"baseline source {path}: no class {CLASS}; expected vLLM's "
        "vllm/v1/attention/backends/turboquant_attn.py"
    )


def _self_calls(node):
    """Names of the attributes read on ``self`` inside a function node."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


def _global_names(code):
    """The global names a code object reads: in the functions nested in it
    (LOAD_GLOBAL), and at its own level (LOAD_NAME: a module's default values and
    decorators)."""
    names = {
        i.argval
        for i in dis.get_instructions(code)
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


class _StripAnnotations(ast.NodeTransformer):
    """Annotations are not needed to run a function, and would make its definition
    read names (types of the source's release) the installed runtime may lack."""

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.returns = None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node):
        if node.value is None:  # a bare declaration: nothing to run
            return ast.Pass()
        return ast.copy_location(ast.Assign([node.target], node.value), node)


def _compile(node, path):
    """A module of the one statement ``node`` (a copy, without annotations)."""
    import copy

    module = ast.Module([_StripAnnotations().visit(copy.deepcopy(node))], [])
    return compile(ast.fix_missing_locations(module), path, "exec")


def _bindings(tree):
    """{name: [(module-level statement of the source that binds it, whether it is
    inside a top-level ``if``/``try``, i.e. conditional)]}."""
    found: dict[str, list] = {}

    def visit(statements, conditional=False):
        for node in statements:
            if isinstance(node, ast.If | ast.Try):
                visit(node.body, True)
                visit(node.orelse, True)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, True)
                continue
            names = []
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [(a.asname or a.name).split(".")[0] for a in node.names]
            elif isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ):
                names = [node.name]
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                is_assign = isinstance(node, ast.Assign)
                targets = node.targets if is_assign else [node.target]
                names = [
                    n.id
                    for t in targets
                    for n in ast.walk(t)
                    if isinstance(n, ast.Name)
                ]
            for name in names:
                found.setdefault(name, []).append((node, conditional))

    visit(tree.body)
    return found


def _compile_methods(tree, path, installed_namespace, installed_class):
    """{name: function} of the entry methods and the source methods they reach, with
    a namespace that resolves every global name they read (see the module's doc)."""
    source_methods = _class_methods(tree, path)
    missing = [m for m in ENTRY_METHODS if m not in source_methods]
    if missing:
        raise BaselineError(
            f"baseline source {path}: {CLASS} has no {', '.join(missing)}; expected "
            f"the methods {', '.join(ENTRY_METHODS)}"
        )
    # The methods to take: the entry methods and what they call on self, transitively.
    todo, chosen = list(ENTRY_METHODS), []
    while todo:
        name = todo.pop()
        if name in chosen or name not in source_methods:
            continue  # an attribute, or a method the source inherits
        chosen.append(name)
        todo.extend(_self_calls(source_methods[name]))
    for name in chosen:
        installed = getattr(installed_class, name, None)
        if installed is None:
            continue  # new in the source: called only by the source's methods
        ours = _parameters(source_methods[name])
        theirs = list(inspect.signature(installed).parameters)
        if ours != theirs:
            raise BaselineError(
                f"baseline source {path}: {CLASS}.{name} takes ({', '.join(ours)}), "
                f"the installed vLLM's takes ({', '.join(theirs)}); the benchmark "
                "calls it the installed way"
            )
    namespace = dict(installed_namespace)
    codes = {name: _compile(source_methods[name], path) for name in chosen}
    for name, code in codes.items():
        if "super" in _global_names(code):
            raise BaselineError(
                f"baseline source {path}: {CLASS}.{name} calls super(), which a "
                "method compiled outside its class cannot"
            )
    unbound = _resolve(
        set().union(*(_global_names(c) for c in codes.values())),
        namespace,
        _bindings(tree),
        path,
    )
    for code in codes.values():
        exec(code, namespace)
    return {name: namespace[name] for name in chosen}, unbound


def _parameters(node):
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += ["*" + a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += ["**" + a.kwarg.arg] if a.kwarg else []
    return [n.lstrip("*") for n in names]


def _resolve(names, namespace, bindings, path):
    """Bind every name in ``names`` in ``namespace``: what the source defines with
    ``def`` or an assignment comes from the source (compiled here, the names it reads
    resolved the same way); classes and imports come from the installed runtime where
    it has them (classes are its data types), else from the source's statement, run
    here. Returns the names left unbound as the source would leave them (see
    Baseline.unbound); raises BaselineError naming any other name that does not
    resolve."""
    import builtins

    done, failures, unbound = set(), {}, []
    todo = sorted(names, reverse=True)
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        statements = bindings.get(name, [])
        defines = [
            (s, c)
            for s, c in statements
            if isinstance(
                s, ast.FunctionDef | ast.AsyncFunctionDef | ast.Assign | ast.AnnAssign
            )
        ]
        if not defines and (name in namespace or hasattr(builtins, name)):
            continue  # the installed runtime's, or a builtin
        if defines:
            statements = defines[-1:]  # the source's last definition is its value
        errors = []
        for statement, _ in statements:
            code = _compile(_only(statement, name), path)
            needs = _global_names(code) - done
            if needs:  # resolve what the statement reads first, then come back
                done.discard(name)
                todo.append(name)
                todo.extend(sorted(needs, reverse=True))
                break
            try:
                exec(code, namespace)
                break
            except Exception as e:
                errors.append(f"line {statement.lineno}: {type(e).__name__}: {e}")
        else:
            if statements and all(conditional for _, conditional in statements):
                unbound.append(name)
            else:
                failures[name] = "; ".join(errors) or "not defined or imported there"
    if failures:
        detail = "; ".join(f"{n} ({why})" for n, why in sorted(failures.items()))
        raise BaselineError(
            f"baseline source {path}: names its methods use do not resolve in the "
            f"installed vLLM: {detail}"
        )
    return tuple(sorted(unbound))


def _only(statement, name):
    """An import statement reduced to the one name wanted (another name of the same
    statement may not exist in the installed release); other statements as they are."""
    if isinstance(statement, ast.ImportFrom):
        alias = next(a for a in statement.names if (a.asname or a.name) == name)
        reduced = ast.ImportFrom(statement.module, [alias], statement.level)
        return ast.copy_location(reduced, statement)
    return statement
